"""Structured outputs in one engine: requests whose `params.grammar` constrains every token.

    new request   its grammar's compile starts on a thread (`prepare`); the step never waits for one
    add_request   a request whose grammar is not compiled yet is held here, not queued; each step
                  queues those whose compile finished (`take_ready`) and fails those whose failed
    each step     every scheduled request with a grammar gets its matcher (`ensure_states`): made by
                  replaying its output so far, so a request that arrived from a prefill worker (which
                  sampled its first token under the grammar), or was retracted, resumes where it was;
                  the sampler masks its rows with it (`engine.tokens.adjusted_logits`; a verify row's
                  rows after each draft in turn), and its emitted tokens advance it (`accept`)
    the end       a matcher that accepted a stop token has ended its grammar: the request stops

The first grammar in a process loads xgrammar and the HF tokenizer's vocabulary on that thread too
(seconds; nothing is paid by an engine that never sees a grammar).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from common.grammar_spec import GrammarError, GrammarSpec
from engine.request import Request

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler

log = logging.getLogger("tandem.engine")

ARRIVAL_WAIT_S = 120.0
"""The most a step waits for the grammar of a request that arrived with its KV (its compile started
when its landing was reserved, so it is normally long done)."""


class StructuredOutputs:
    """One engine's grammars: a compiler made on first use, and the requests waiting for a compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_token_ids
        self._setup: ThreadPoolExecutor | None = None
        self._compiler: Future | None = None  # Future[GrammarCompiler]
        self._waiting: dict[GrammarSpec, Future] = {}  # compiles asked for before the compiler was made
        self.held: list[Request] = []
        """Requests added before their grammar compiled, in arrival order."""

    # ---- compiles ----------------------------------------------------------------------------------
    def prepare(self, spec: GrammarSpec) -> Future:
        """The compile of `spec` (started now unless cached or running); never blocks."""
        if self._compiler is None:
            self._setup = ThreadPoolExecutor(1, thread_name_prefix="grammar-setup")
            self._compiler = self._setup.submit(self._make_compiler)
        if self._compiler.done():
            self._waiting.clear()
            error = self._compiler.exception()
            return self._compiler.result().submit(spec) if error is None else _failed(error)
        future = self._waiting.get(spec)
        if future is None:
            future = self._waiting[spec] = Future()
            self._compiler.add_done_callback(lambda made: _chain(made, spec, future))
        return future

    def _make_compiler(self) -> GrammarCompiler:
        from engine.grammar import GrammarCompiler
        from kernels.model.tokenizer import ServingTokenizer, load_hf_tokenizer

        tokenizer = self._tokenizer
        if isinstance(tokenizer, ServingTokenizer):  # xgrammar reads a transformers tokenizer's vocabulary
            tokenizer = load_hf_tokenizer(tokenizer.model_dir)
        return GrammarCompiler(tokenizer, self._vocab_size, stop_token_ids=self._stop_ids)

    # ---- requests waiting for a compile ------------------------------------------------------------
    def hold(self, req: Request) -> None:
        self.held.append(req)

    def release(self, req: Request) -> bool:
        """Stop holding `req` (aborted); False when it is not held."""
        if req in self.held:
            self.held.remove(req)
            return True
        return False

    def take_ready(self, queue: Callable[[Request], None]) -> list[tuple[Request, str]]:
        """`queue` the held requests whose grammar compiled, in arrival order; stop holding those whose
        compile failed and return them, each with why."""
        failed, still = [], []
        for req in self.held:
            grammar = req.params.grammar
            assert grammar is not None, f"request {req.request_id} held for a grammar it does not have"
            future = self.prepare(grammar)
            if not future.done():
                still.append(req)
            elif future.exception() is not None:
                failed.append((req, f"its grammar did not compile: {future.exception()}"))
            else:
                queue(req)
        self.held = still
        return failed

    # ---- the step ----------------------------------------------------------------------------------
    def ensure_states(self, reqs: list[Request]) -> None:
        """Give each request with a grammar and no matcher one, past its output so far. One that cannot
        have one (its grammar did not compile, or refuses its output) is left without: its row then
        fails it alone (`engine.tokens.adjusted_logits`)."""
        for req in reqs:
            if req.params.grammar is not None and req.grammar is None:
                try:
                    state = self.prepare(req.params.grammar).result(ARRIVAL_WAIT_S).new_state()
                    if not all(state.accept(req.output_token_ids)):
                        raise GrammarError("its grammar refuses its output so far (sampled under another grammar?)")
                except Exception:  # this request's: logged here, failed by its row
                    log.exception("request %s gets no grammar matcher", req.request_id)
                    continue
                req.grammar = state

    @staticmethod
    def accept(req: Request, tokens: list[int]) -> bool:
        """Advance `req`'s matcher over its emitted `tokens`; whether its grammar has ended (a stop
        token accepted). Raises when the grammar refuses one (the mask would have kept it out)."""
        state = req.grammar
        if state is None or not tokens:
            return False
        if not all(state.accept(tokens)):
            raise GrammarError(f"the grammar refused an emitted token of {tokens}")
        return state.is_terminated()

    def close(self) -> None:
        if self._compiler is not None and self._compiler.done() and self._compiler.exception() is None:
            self._compiler.result().close()
        if self._setup is not None:
            self._setup.shutdown(wait=False, cancel_futures=True)


def _failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def _chain(made: Future, spec: GrammarSpec, future: Future) -> None:
    """The compiler is made (or failed): start `spec`'s compile and pass its outcome to `future`."""
    if made.exception() is not None:
        future.set_exception(made.exception())
        return
    inner = made.result().submit(spec)
    inner.add_done_callback(lambda done: future.set_exception(done.exception()) if done.exception() is not None
                            else future.set_result(done.result()))
