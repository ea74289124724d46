"""What the router remembers between requests (`RouterState`): round-robin turns and its picture of
every worker's KV tiers, which the routing policy (`router.policy`) reads and the dispatcher updates.

Imports stdlib, `common.config`, `router.policy_types` (the policy's views, route and knobs) and
`router.prefix_tree` only: never `router.policy`, which imports this.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from common.config import require
from router.policy_types import DEFAULT_MAX_TREE_TOKENS, PolicyParams, RequestView, Route, WorkerView
from router.prefix_tree import ApproxPrefixTree


class Stage(enum.Enum):
    """Which choice a round-robin turn counter drives."""

    PREFILL = "prefill"  # the prefill worker of a disaggregated route
    DECODE = "decode"  # the decode worker (which, on a local-prefill route, also prefills)


class RouterState:
    """What the router remembers between requests: round-robin turns, two approximate prefix trees per
    worker that has prefilled or decoded something (what its device pool holds, and what its device
    pool and host tier hold, each an LRU tree sized to that worker's capacity in tokens as it
    reports it), and one of every prompt prefilled anywhere (what an L3 store shared by the workers
    may hold: it outlives any one worker's cache). A prompt joins the shared tree when its prefill
    completed (`record_prefilled`), not when it is routed: until then no store has it, and a second
    worker sent the same prefix would prefill it again.

    Mutated only by the `record*` methods and `forget_worker`, called by the one caller that owns the state
    (not thread-safe: serialize `choose` + `record` per state). Read by `choose`.
    """

    def __init__(self, max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS):
        require(isinstance(max_tree_tokens, int) and max_tree_tokens >= 1,
                 f"max_tree_tokens must be an integer >= 1, got {max_tree_tokens!r}")
        self.max_tree_tokens = max_tree_tokens
        self._turns = {stage: 0 for stage in Stage}
        self._trees: dict[str, ApproxPrefixTree] = {}  # device pool + host tier (the same tree without one)
        self._device_trees: dict[str, ApproxPrefixTree] = {}  # device pool, where a host tier is reported
        self._shared = ApproxPrefixTree(max_tree_tokens)

    def turn(self, stage: Stage) -> int:
        """Routes recorded so far that made a `stage` choice."""
        return self._turns[stage]

    def match_len(self, worker_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Prompt prefix the router believes `worker_id` has cached, on device or in its host tier; 0
        for a worker never routed to."""
        tree = self._trees.get(worker_id)
        return tree.match_len(prompt_token_ids) if tree is not None else 0

    def device_match_len(self, worker_id: str, prompt_token_ids: Sequence[int]) -> int:
        """The part of `match_len` the router believes is still in `worker_id`'s device pool."""
        tree = self._device_trees.get(worker_id)
        return tree.match_len(prompt_token_ids) if tree is not None else self.match_len(worker_id, prompt_token_ids)

    def shared_match_len(self, prompt_token_ids: Sequence[int]) -> int:
        """Prompt prefix prefilled by any worker so far (what a shared L3 store may hold)."""
        return self._shared.match_len(prompt_token_ids)

    def effective_match(self, w: WorkerView, prompt_token_ids: Sequence[int], params: PolicyParams) -> float:
        """Prompt tokens `w` would not prefill, each weighted by what it saves: its device match in
        full, what its host tier adds at 1 - host_load_cost, and, where `w` shares L3, what L3 may
        add beyond both at 1 - l3_load_cost."""
        device = self.device_match_len(w.worker_id, prompt_token_ids)
        own = self.match_len(w.worker_id, prompt_token_ids)
        matched = device + (1.0 - params.host_load_cost) * (own - device)
        if not w.shares_l3:
            return matched
        return matched + (1.0 - params.l3_load_cost) * max(0, self.shared_match_len(prompt_token_ids) - own)

    def record(self, request: RequestView, route: Route, prefiller_view: WorkerView | None = None) -> None:
        """Account for `route` having been taken: advance the turns of the choices it made and insert
        the prompt into the trees of the worker that prefills it (`prefill_id`, else `decode_id`).
        `prefiller_view` (that worker's view) sizes its trees when they are made: by the device and
        host tokens it reports, else `max_tree_tokens`."""
        if route.prefill_id is not None:
            self._turns[Stage.PREFILL] += 1
        self._turns[Stage.DECODE] += 1
        prefiller = route.decode_id if route.prefill_id is None else route.prefill_id
        if prefiller not in self._trees:
            self._make_trees(prefiller, prefiller_view)
        for trees in (self._trees, self._device_trees):
            if prefiller in trees:
                trees[prefiller].insert(request.prompt_token_ids)

    def _make_trees(self, worker_id: str, view: WorkerView | None) -> None:
        device = min(view.device_tokens, self.max_tree_tokens) if view is not None and view.device_tokens else 0
        host = view.host_tokens if view is not None and device else 0
        if not device:  # capacity unknown: one tree, bounded only by max_tree_tokens
            self._trees[worker_id] = ApproxPrefixTree(self.max_tree_tokens)
            return
        self._trees[worker_id] = ApproxPrefixTree(min(device + host, self.max_tree_tokens))
        if host:
            self._device_trees[worker_id] = ApproxPrefixTree(device)

    def record_cached(self, worker: WorkerView, token_ids: Sequence[int]) -> None:
        """`worker`'s prefix cache holds (or is computing) `token_ids`: a finished request's prompt and
        output on the worker that decoded it, or on its prefill worker, which prefills the answer."""
        if worker.worker_id not in self._trees:
            self._make_trees(worker.worker_id, worker)
        for trees in (self._trees, self._device_trees):
            if worker.worker_id in trees:
                trees[worker.worker_id].insert(tuple(token_ids))

    def record_prefilled(self, prompt_token_ids: Sequence[int]) -> None:
        """A worker finished prefilling this prompt: its pages are on their way to a shared store."""
        self._shared.insert(tuple(prompt_token_ids))

    def forget_worker(self, worker_id: str) -> None:
        """Drop the tree of a worker whose cache is gone (died, restarted). No-op for an unknown id."""
        self._trees.pop(worker_id, None)
        self._device_trees.pop(worker_id, None)

    def snapshot(self) -> tuple:
        """Turns and every tree's contents with recency; equal snapshots mean equal state."""
        trees = tuple(sorted((wid, tree.snapshot()) for wid, tree in self._trees.items()))
        device = tuple(sorted((wid, tree.snapshot()) for wid, tree in self._device_trees.items()))
        return (tuple(sorted((s.value, n) for s, n in self._turns.items())), trees, device, self._shared.snapshot())

    def check_integrity(self) -> None:
        for tree in (*self._trees.values(), *self._device_trees.values(), self._shared):
            tree.check_integrity()
