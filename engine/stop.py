"""When a request stops: EOS, stop token ids, stop strings and length, for every worker and `tandem run`.

The contract: after each new token, in this order,
  1. the token is a stop token id, or EOS unless `ignore_eos`    -> STOP (text not cut);
  2. a stop string occurs in `decode(output, skip_special_tokens=True)` -> STOP, and the text is
     cut before the FIRST occurrence of any stop string (`StopRules.text_len`);
  3. `max_tokens` outputs, or the request fills the engine's per-request capacity -> LENGTH.

Rule 2 is checked incrementally (`StopStringMatcher`) so that a token costs O(its text + the
longest stop string) rather than O(output): the same answer as decoding and searching the whole
output every token (`first_stop(decode(output), stop)`), which is what `cut_at_stop` computes once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.config import SamplingParams
from common.protocol import FinishReason
from kernels.model.tokenizer import REPLACEMENT_CHAR, cut_at_stop, decode, first_stop

__all__ = ["StopRules", "StopStringMatcher", "cut_at_stop", "decode", "first_stop"]
SPLIT_AFTER_TOKENS = 8
"""Pending tokens (decoded text still ending in U+FFFD) before a split point among them is sought:
an incomplete UTF-8 character completes within 4 bytes, so only a literal U+FFFD or invalid bytes
keep text pending this long."""
MAX_PENDING_TOKENS = 64
"""Pending tokens at most: a window no split point can be proven in (a tokenizer whose decode of a
slice differs from the same slice of a whole decode) is then settled as decoded, bounding the cost."""


class StopStringMatcher:
    """Finds the first stop string in a request's decoded output as its tokens arrive.

    Tokens are decoded in a window that starts one settled step back (`prefix`), so a tokenizer that
    strips the first token's leading space sees the same context as a whole decode; the window's
    text past the context is new. Text is *settled* once no later token can change it: the window
    no longer ends in U+FFFD (an incomplete UTF-8 sequence waits for the bytes that complete it).

        token ids: | settled              | context          | pending           |
                   0                   prefix              read            len(ids)
        text:      | settled (S)                           | new = window[len(context):] |
                   0                                  settled_len

    No stop string lies entirely inside S (it was searched when it was new), so a stop string still
    to be found starts at or after `settled_len - (len(s) - 1)`: each feed searches the last
    `max(len(s)) - 1` settled characters plus the new text, and keeps only those characters of S.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]):
        assert stop, "a matcher without stop strings has nothing to find"
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._overlap = max(map(len, self._stop)) - 1
        self._prefix = self._read = 0
        self._context = ""  # decode(ids[prefix:read])
        self._settled_len = 0  # characters of S
        self._settled_tail = ""  # the last `_overlap` characters of S
        self.chars_searched = 0
        """Characters handed to the stop string search so far (tests bound it per token)."""

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """`token_ids` is the whole output so far: the tokens of earlier feeds plus new ones. Returns
        where the first stop string begins in its decoded text, or None while none occurs."""
        window = decode(self._tokenizer, token_ids[self._prefix:])
        new = window[len(self._context):]
        at = self._search(new)
        if at is not None:
            return at
        if not window.endswith(REPLACEMENT_CHAR) and len(window) >= len(self._context):
            self._settle(token_ids, len(token_ids), new)
        elif len(token_ids) - self._read > SPLIT_AFTER_TOKENS:
            self._settle_pending(token_ids, window)
        return None

    def _search(self, new: str) -> int | None:
        region = self._settled_tail + new  # S[settled_len - len(tail):] + new
        region_start = self._settled_len - len(self._settled_tail)
        starts = [max(0, len(self._settled_tail) - len(s) + 1) for s in self._stop]
        hits = [i for i in (region.find(s, start) for s, start in zip(self._stop, starts)) if i >= 0]
        self.chars_searched += sum(len(region) - start for start in starts)
        return region_start + min(hits) if hits else None

    def _settle(self, token_ids: Sequence[int], upto: int, new: str) -> None:
        """Tokens [read, upto) decode to `new` for good: add it to S; the window moves up."""
        tail = self._settled_tail + new
        self._settled_len += len(new)
        self._settled_tail = tail[max(0, len(tail) - self._overlap):]
        self._prefix, self._read = self._read, upto
        self._context = decode(self._tokenizer, token_ids[self._prefix:self._read])

    def _settle_pending(self, token_ids: Sequence[int], window: str) -> None:
        """Pending text that keeps ending in U+FFFD (a literal U+FFFD, invalid bytes): settle up to the
        last token k after which decoding restarts cleanly, i.e. decode([prefix, k)) + decode([k, end))
        is the window and [k, end) has text (the bytes after k ended whatever sequence k cut)."""
        for k in range(len(token_ids) - 1, self._read, -1):
            head = decode(self._tokenizer, token_ids[self._prefix:k])
            rest = decode(self._tokenizer, token_ids[k:])
            if rest and head + rest == window and len(head) >= len(self._context):
                self._settle(token_ids, k, head[len(self._context):])
                return
        if len(token_ids) - self._read > MAX_PENDING_TOKENS:
            self._settle(token_ids, len(token_ids), window[len(self._context):])


class StopRules:
    """The stop rules of one request (module docstring), applied once per new output token."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: Any,
                 max_request_tokens: int):
        stop_ids = frozenset(params.stop_token_ids)
        self._stop_token_ids = stop_ids if params.ignore_eos else stop_ids | eos_token_ids
        self._max_tokens, self._max_request_tokens = params.max_tokens, max_request_tokens
        self._strings = StopStringMatcher(tokenizer, params.stop) if params.stop else None
        self.text_len: int | None = None
        """Where a stop string cut the output text (characters); None: not cut."""

    @property
    def token_ids(self) -> frozenset[int]:
        """The tokens that end the request: its stop token ids, and EOS unless `ignore_eos`."""
        return self._stop_token_ids

    def check(self, output_token_ids: Sequence[int], num_tokens: int) -> FinishReason | None:
        """Whether the request ends after its newest output token `output_token_ids[-1]`;
        `num_tokens` counts prompt and output. Call once per appended token, in order."""
        if output_token_ids[-1] in self._stop_token_ids:
            return FinishReason.STOP
        if self._strings is not None:
            self.text_len = self._strings.feed(output_token_ids)
            if self.text_len is not None:
                return FinishReason.STOP
        if len(output_token_ids) >= self._max_tokens or num_tokens >= self._max_request_tokens:
            return FinishReason.LENGTH
        return None

    def resume(self, output_token_ids: Sequence[int]) -> None:
        """The output a resumed request already has (`Request.resume`): none of it ended the request
        where it was made, so the stop strings are only fed it, as its tokens arrived there."""
        if self._strings is not None:
            self._strings.feed(output_token_ids)

    @property
    def chars_searched(self) -> int:
        return self._strings.chars_searched if self._strings is not None else 0
