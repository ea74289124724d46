"""Structured outputs: a request's grammar (`common.grammar_spec.GrammarSpec`: a JSON schema, any JSON
object, a regex, a choice of strings, EBNF) compiled by xgrammar for one tokenizer, and the
per-request matcher that masks logits to the tokens the grammar allows. Its errors are `GrammarError`s.

Owns: `GrammarCompiler` (one per engine: the tokenizer's vocabulary as xgrammar sees it, a thread
pool and an LRU cache of compiled grammars), `CompiledGrammar` (immutable, shared by threads and requests) and
`GrammarState` (one request's position in its grammar; not thread-safe, and not picklable: another process rebuilds it
from the spec and the accepted token ids with `GrammarCompiler.rebuild_state`).

The end of a request: once the grammar is complete the mask allows the stop tokens (and whatever
continues the grammar); once it is complete and nothing can follow, only the stop tokens. Accepting a
stop token terminates the state (`is_terminated()`), which is when the stop rules end the request
with FinishReason.STOP; the state then fills no more masks. A request that ends otherwise (length, a
stop string) simply drops its state, its output possibly an incomplete sentence of the grammar.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import xgrammar as xgr

from common.grammar_spec import GrammarError, GrammarSpec, compile_error, grammar_of

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarSpec", "GrammarState", "allocate_bitmask",
           "apply_bitmask"]


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask, every token allowed.  # [num_rows, ceil(vocab_size / 32)] int32, bit j of word
    w allows token 32 * w + j."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Set logits of disallowed tokens to -inf, in place. `logits`: [R, V'] with V' >= vocab_size, on
    any device (the bitmask [R, W] is copied there); columns [vocab_size, V') are never allowed."""
    assert logits.dim() == 2 and logits.shape[0] == bitmask.shape[0], (
        f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)}: one bitmask row per logits row")
    assert logits.shape[-1] >= vocab_size, (
        f"logits have {logits.shape[-1]} columns, fewer than the grammar's vocab_size {vocab_size}: "
        "the compiler was built with the wrong vocab size?")
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=vocab_size)
    if logits.shape[-1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One spec compiled for one tokenizer; immutable, shared by every request that asks for it."""

    spec: GrammarSpec
    vocab_size: int
    _xgr: xgr.CompiledGrammar

    @property
    def memory_bytes(self) -> int:
        return self._xgr.memory_size_bytes

    def new_state(self) -> GrammarState:
        """A state at the start of the grammar."""
        return GrammarState(self, xgr.GrammarMatcher(self._xgr), [])


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, `max_threads` compile threads
    and an LRU cache of compiles (finished, failed or in flight) keyed by spec: at most `cache_entries`
    of them, and compiled grammars of at most `cache_bytes` together unless the newest alone is larger
    (a JSON schema's grammar holds token masks over the whole vocabulary: megabytes each).

    `vocab_size` is the model's (the width of its logits), which may exceed the tokenizer's: ids past
    the tokenizer's vocabulary are never allowed. `stop_token_ids` (default: the tokenizer's EOS) are
    the tokens that end a complete grammar; pass the engine's EOS ids. Every method is thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 max_threads: int = 2, cache_entries: int = 256, cache_bytes: int = 256 << 20) -> None:
        assert min(max_threads, cache_entries, cache_bytes) >= 1, f"{max_threads=} {cache_entries=} {cache_bytes=}"
        self.vocab_size = vocab_size
        self.cache_entries, self.cache_bytes = cache_entries, cache_bytes
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self.stop_token_ids = tuple(info.stop_token_ids)
        # xgrammar's own cache is unbounded in entries: ours bounds them and also dedups in-flight compiles.
        self._xgr = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future[CompiledGrammar]] = OrderedDict()  # oldest first
        self._entry_bytes: dict[GrammarSpec, int] = {}  # the cached entries compiled so far
        self.cached_bytes = 0  # sum of _entry_bytes
        self.num_compiles = 0  # compiles started, cache misses
        self._closed = False

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """The compile of `spec`, started on the pool unless cached; never blocks on a compile. The
        future's result raises GrammarError for a spec that does not compile (failures are cached
        too). An asyncio caller awaits `asyncio.wrap_future(compiler.submit(spec))`."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None and not future.cancelled():  # asyncio.wrap_future's waiter can cancel it
                self._cache.move_to_end(spec)
                return future
            future = self._cache[spec] = Future()
            self._cache.move_to_end(spec)  # a cancelled one is replaced
            self.num_compiles += 1
            self._evict_locked()
        self._pool.submit(self._run, spec, future)
        return future

    def ready(self, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled (or failed), so that `compiled(spec)` will not wait. Submits a spec
        that is not cached: polling a spec evicted meanwhile compiles it again instead of waiting forever."""
        return self.submit(spec).done()

    def compiled(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        """The compiled `spec`, waiting for its compile; raises GrammarError when it failed, and
        TimeoutError after `timeout_s`."""
        return self.submit(spec).result(timeout_s)

    def compile_now(self, spec: GrammarSpec) -> CompiledGrammar:
        """`compiled(spec)`, for a caller that validates synchronously (the gateway answers 400 on GrammarError)."""
        return self.compiled(spec)

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        """A state at the start of `spec` (waits for its compile)."""
        return self.compiled(spec).new_state()

    def rebuild_state(self, spec: GrammarSpec, token_ids: Sequence[int]) -> GrammarState:
        """The state another process reached with `spec` after accepting `token_ids` (e.g. the decode
        worker after the prefill worker sampled the first token), by replaying them. Raises
        GrammarError if the grammar refuses one: the two processes disagree on the spec or tokenizer."""
        state = self.new_state(spec)
        accepted = state.accept(token_ids)
        if not all(accepted):
            at = accepted.index(False)
            raise GrammarError(f"replaying {spec.kind} grammar: token {token_ids[at]} at {at} is refused "
                               "(a different spec, tokenizer or vocab size than where it was sampled?)")
        return state

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._cache) <= self.cache_entries, (
                f"{len(self._cache)} cached compiles over the bound {self.cache_entries}: eviction skipped?")
            assert self._entry_bytes.keys() <= self._cache.keys(), "bytes counted for an evicted compile"
            assert self.cached_bytes == sum(self._entry_bytes.values()), "cached_bytes out of step"
            assert self.cached_bytes <= self.cache_bytes or len(self._cache) == 1, (
                f"{self.cached_bytes} cached bytes over the bound {self.cache_bytes}: eviction skipped?")

    def close(self) -> None:
        """Stops the pool: compiles not started are cancelled (their futures raise CancelledError)."""
        self._closed = True
        self._pool.shutdown(wait=False)

    def _run(self, spec: GrammarSpec, future: Future[CompiledGrammar]) -> None:
        if self._closed:
            future.cancel()
        if not future.set_running_or_notify_cancel():
            return
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # noqa: BLE001 - the future carries it to every waiter
            future.set_exception(exc)
            return
        with self._lock:  # counted before any waiter wakes
            if self._cache.get(spec) is future:  # else evicted while compiling
                self._entry_bytes[spec] = compiled.memory_bytes
                self.cached_bytes += compiled.memory_bytes
                self._evict_locked()
        future.set_result(compiled)

    def _evict_locked(self) -> None:
        """Drops the least recent compiles past the bounds; a compile in flight still completes for its holders."""
        while len(self._cache) > self.cache_entries or (self.cached_bytes > self.cache_bytes and len(self._cache) > 1):
            spec, _ = self._cache.popitem(last=False)
            self.cached_bytes -= self._entry_bytes.pop(spec, 0)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = grammar_of(spec)  # raises GrammarError
        try:
            compiled = self._xgr.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's C++ errors are RuntimeErrors
            raise compile_error(spec, exc) from None
        return CompiledGrammar(spec, self.vocab_size, compiled)


class GrammarState:
    """One request's position in its grammar: the tokens it has accepted, and the mask of the next.

    Mutates only through `accept` and `rollback`; the mask methods leave it as it was. Used by one
    thread at a time (the engine's). Does not pickle: send (spec, token_ids) and rebuild the state.
    """

    def __init__(self, grammar: CompiledGrammar, matcher: xgr.GrammarMatcher, token_ids: list[int]) -> None:
        self.grammar = grammar
        self._matcher = matcher
        self._token_ids = token_ids  # accepted so far, the stop token included
        self._bitmask = allocate_bitmask(1, grammar.vocab_size)  # [1, W], reused by fill_mask

    @property
    def spec(self) -> GrammarSpec:
        return self.grammar.spec

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._token_ids)

    @property
    def num_accepted(self) -> int:
        return len(self._token_ids)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the request ends here and no mask follows."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The accepted tokens form a whole sentence of the grammar (a stop token would be allowed)."""
        return self._matcher.is_completed()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Writes the next token's mask into `bitmask[row]` (a CPU [R, W] tensor from allocate_bitmask),
        for a sampler that masks a whole batch with one `apply_bitmask`."""
        self._check_live("fill a mask")
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fill_mask(self, logits: torch.Tensor) -> None:
        """Sets the logits of the tokens the grammar does not allow next to -inf, in place.
        `logits`: [V'] or [R, V'] (every row gets the same mask), V' >= vocab_size."""
        self.fill_bitmask(self._bitmask)
        rows = logits.unsqueeze(0) if logits.dim() == 1 else logits  # a view: masking it masks `logits`
        bitmask = self._bitmask if rows.shape[0] == 1 else self._bitmask.repeat(rows.shape[0], 1)
        apply_bitmask(rows, bitmask, self.grammar.vocab_size)

    def draft_bitmask(self, draft_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Masks for verifying a chain of k drafts, and how many drafts the grammar accepts (the
        first refused draft ends the chain). The state is unchanged afterwards.

            drafts    d1     d2    ...   dk
            row       0      1     ...   k-1      k
            row i: the mask after the accepted tokens + d1..di (row 0: before d1, row k: after dk)

        Rows past the first refused draft, or past an accepted stop token, allow every token: the
        target's choice at the refused draft's row differs from the draft (it is masked out), so
        verification never reads them. Returns ([k+1, W] bitmask, num_valid in [0, k])."""
        self._check_live("fill draft masks")
        bitmask = allocate_bitmask(len(draft_ids) + 1, self.grammar.vocab_size)
        num_valid = 0
        try:
            for token_id in draft_ids:
                self._matcher.fill_next_token_bitmask(bitmask, num_valid)
                if not self._matcher.accept_token(int(token_id)):
                    break
                num_valid += 1
                if self._matcher.is_terminated():
                    break
            else:
                self._matcher.fill_next_token_bitmask(bitmask, num_valid)
        finally:
            self._matcher.rollback(num_valid)
        return bitmask, num_valid

    def fill_draft_masks(self, logits: torch.Tensor, draft_ids: Sequence[int]) -> int:
        """`draft_bitmask` applied in place to `logits` [k+1, V']; returns num_valid."""
        bitmask, num_valid = self.draft_bitmask(draft_ids)
        apply_bitmask(logits, bitmask, self.grammar.vocab_size)
        return num_valid

    def accept(self, token_ids: Sequence[int]) -> list[bool]:
        """Advances over `token_ids` in order while the grammar accepts them: True per accepted token;
        the first refused one and all after it are False and leave the state where it was."""
        accepted = [False] * len(token_ids)
        for i, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(int(token_id)):
                break
            self._token_ids.append(int(token_id))
            accepted[i] = True
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (a stop token included: it un-terminates)."""
        assert 0 <= num_tokens <= len(self._token_ids), (
            f"rollback of {num_tokens} tokens with {len(self._token_ids)} accepted: rejected drafts "
            "rolled back twice?")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._token_ids[-num_tokens:]

    def fork(self) -> GrammarState:
        """An independent state at the same position (a sibling of `n` choices after the shared prompt)."""
        return GrammarState(self.grammar, self._matcher.fork(), list(self._token_ids))

    def __reduce__(self) -> NoReturn:
        raise TypeError("a GrammarState does not pickle: send (spec, token_ids) and call "
                        "GrammarCompiler.rebuild_state on the other side")

    def _check_live(self, what: str) -> None:
        if self._matcher.is_terminated():
            raise RuntimeError(f"cannot {what}: the {self.spec.kind} grammar accepted a stop token, so its "
                               "request has ended (stop rules skipped, or ignore_eos with a grammar?)")
