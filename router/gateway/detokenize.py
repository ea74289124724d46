"""Token ids -> text for one request, incrementally, with stop strings.

The text a client finally gets is `final_text(tokenizer, output_ids, stop)`: the whole output decoded
with `skip_special_tokens=True` and cut before the first stop string found, exactly what the offline
runner returns. `IncrementalDetokenizer` turns a token stream into text deltas whose concatenation is
that same string, so a streamed and a non-streamed request read the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kernels.model.tokenizer import REPLACEMENT_CHAR, cut_at_stop, decode, first_stop

log = logging.getLogger(__name__)


def final_text(tokenizer: Any, token_ids: Sequence[int], stop: Sequence[str]) -> str:
    """The output text of a finished request (the reference every delta stream must add up to): the
    engine's own stop-string rule (`kernels.model.tokenizer.cut_at_stop`, used by `StopRules`)."""
    return cut_at_stop(decode(tokenizer, token_ids), stop)


class IncrementalDetokenizer:
    """Text deltas of one request's output as its tokens arrive.

    Contract: the concatenation of every `feed` result and the `finish` result equals
    `final_text(tokenizer, all_ids, stop)`. A delta is never retracted, so text is held back while it
    could still change:

    - a decode ending in U+FFFD is an incomplete UTF-8 sequence; its tokens wait for the next ones;
    - with stop strings, the last `max(len(s)) - 1` characters wait, since a stop string may be starting
      there; once a stop string is seen, the text ends before it and `stopped` becomes True.

    Cost: each `feed` decodes only a window of tokens, not the whole output. The window starts one
    decoded step back, so tokenizers that strip a word's leading space at the start of a decode
    (SentencePiece) see the same context as a full decode does. `finish` decodes the whole output once
    and emits the remainder of the exact final text.

        ids:   | settled text            | window context      | new tokens    |
               0                   prefix_offset          read_offset       len(ids)
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # decoded so far by windows; ends before a stop string once `stopped`
        self._emitted = 0  # characters of the text already returned
        self._stop_search_from = 0
        self.stopped = False
        self.finished = False

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def token_ids(self) -> list[int]:
        """Every token fed so far (those after a stop string included)."""
        return list(self._ids)

    def feed(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now certain (possibly ""). No-op once stopped."""
        assert not self.finished, "feed() after finish(): the request already ended"
        self._ids.extend(new_token_ids)
        if self.stopped or not new_token_ids:
            return ""
        self._decode_window()
        self._find_stop()
        safe_end = len(self._text) if self.stopped else len(self._text) - self._hold_chars
        return self._emit_up_to(safe_end)

    def finish(self) -> str:
        """The rest of the final text (decodes the whole output once)."""
        assert not self.finished, "finish() called twice"
        self.finished = True
        text = decode(self._tokenizer, self._ids)
        at = first_stop(text, self._stop)
        text = text if at is None else text[:at]
        self.stopped = self.stopped or at is not None
        sent = self._text[:self._emitted]
        if not text.startswith(sent):
            # Only a tokenizer whose decode is not compositional over token windows gets here; the
            # streamed text then differs from the final one, and no delta can take it back.
            log.warning("streamed text diverged from the final decode after %d characters", len(sent))
            return ""
        self._text, self._emitted = text, len(text)
        return text[len(sent):]

    @property
    def text(self) -> str:
        """The final text; valid after `finish`."""
        assert self.finished, "text is final only after finish()"
        return self._text

    # ---- helpers -------------------------------------------------------------------------------
    def _decode_window(self) -> None:
        """Append the text of tokens [read_offset, len) to `_text`, unless it ends mid-character."""
        context = decode(self._tokenizer, self._ids[self._prefix_offset:self._read_offset])
        window = decode(self._tokenizer, self._ids[self._prefix_offset:])
        if window.endswith(REPLACEMENT_CHAR) or len(window) < len(context):
            return  # incomplete UTF-8: wait for the token that completes the character
        self._text += window[len(context):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _find_stop(self) -> None:
        if not self._stop:
            return
        at = first_stop(self._text, self._stop, self._stop_search_from)
        if at is not None:
            self._text = self._text[:at]
            self.stopped = True
        else:
            # a stop string that starts before this point would have been complete and found already
            self._stop_search_from = max(0, len(self._text) - self._hold_chars)

    def _emit_up_to(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta
