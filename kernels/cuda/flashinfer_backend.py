"""The FlashInfer attention backend: tandem's paged KV through FlashInfer's paged decode and prefill kernels.

A step whose sequences all have query_len == 1 runs ``BatchDecodeWithPagedKVCacheWrapper``; any other
step (prefill, extend over a cached prefix, mixed) runs ``BatchPrefillWithPagedKVCacheWrapper`` (ragged
queries over paged KV, causal with the diagonal at the end of each sequence, which is tandem's rule: a
new token sees every cached position and the new ones up to itself). A wrapper is planned once per step
(per ``AttnMetadata`` object, on the first layer) and run once per layer. The caches go in as the tuple
``(k_cache, v_cache)`` in FlashInfer's "NHD" layout, which is tandem's ``[num_pages, page_size, kvh, hd]``;
new K/V are written with ``index_copy_``, as the torch backend does. FlashInfer runs fp16/bf16 only.

A sliding window and a soft cap are plan arguments (``window_left``, ``logits_soft_cap``), and a model's
layers may differ in them (Gemma alternates windowed and global layers). So each `_Variant` a step uses
has a wrapper of its own, planned on the step's first layer of that variant and reused by the others.

FlashInfer takes the page table in CSR form (``paged_kv_index_no_sync``). For sequence ``b`` with
``s_b`` KV positions in ``n_b = ceil(s_b / page_size)`` pages (none when it has no new tokens: no query
reads them)::

    kv_indices        | page_table[0, :n_0] | page_table[1, :n_1] | ... | page_table[B-1, :n_{B-1}] |
                      0                 kv_indptr[1]          kv_indptr[2]                     kv_indptr[B]
    last_page_len[b]  s_b - (n_b - 1) * page_size, in [1, page_size]; 0 when n_b == 0
    qo_indptr         meta.query_start_loc: rows [qo_indptr[b], qo_indptr[b+1]) of q are seq b's

The page-0 padding at the end of a page-table row is never listed. The indptrs and last-page lengths
are built on the host from ``meta.*_cpu``, since FlashInfer's planner reads them there (host tensors go
in, so nothing is read back from the device); ``kv_indices`` is gathered on the device.

CUDA graphs, decode only. FlashInfer plans on the host and ``plan()`` cannot be captured; a wrapper
built with ``use_cuda_graph=True`` has fixed index buffers that every ``plan()`` rewrites in place, and
the captured kernels read them. The graph runner's side of the contract:

1. run at least one eager step of the whole model first (the usual warm-up): the attention shape (heads,
   head_dim, dtype, scale) a graph plan is for is the one that step used, and the variants it plans are
   every one an eager step has used (a layer with a variant no eager step used raises under capture);
2. before capturing a batch-size bucket, call ``prepare_graph_decode(meta)`` outside the capture, with
   the metadata object it then passes to the captured forward (one token per sequence; ``page_table``
   the static ``[B, W]`` buffer; ``seq_lens_cpu`` may be the capacity ``W * page_size``);
3. before every replay, fill the static buffers, then call ``prepare_graph_decode(meta)`` again with a
   metadata object over the same buffers whose ``seq_lens_cpu`` are the real lengths (padding rows: 1);
4. never let the backend plan inside a capture: ``attention`` under capture with metadata that was not
   prepared raises.

Each ``(B, W)`` and variant gets its own graph wrapper with buffers for ``B + 1`` indptrs, ``B`` last-page
lengths and ``B * W`` page ids (every row full), so any lengths up to the captured width fit.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from kernels.attention.base import AttentionBackend, index_write_kv
from kernels.attention.metadata import AttnMetadata

WORKSPACE_BYTES = 128 * 2**20
"""FlashInfer's float workspace (split-KV partial outputs), one shared by every wrapper; its recommended size."""
KV_LAYOUT = "NHD"
HALF_DTYPES = (torch.float16, torch.bfloat16)
TENSOR_CORE_DECODE_MIN_GROUP = 5
"""GQA groups from this size decode with the tensor-core kernels: faster for large groups, and the
CUDA-core decode kernel is built only for groups 1, 2, 3, 4, 6, 8 and 16."""


@dataclass(frozen=True)
class PagedKVIndex:
    """A step's page table in FlashInfer's CSR form (see the module docstring); B sequences."""

    qo_indptr_cpu: torch.Tensor  # [B+1] int32 host
    kv_indptr_cpu: torch.Tensor  # [B+1] int32 host
    kv_last_page_len_cpu: torch.Tensor  # [B] int32 host
    kv_indices: torch.Tensor  # [kv_indptr[B]] int32, on the page table's device


def paged_kv_index_no_sync(meta: AttnMetadata) -> PagedKVIndex:
    """The CSR form of ``meta``'s page table. Lengths come from ``meta.*_cpu`` only (so a capture's
    capacity lengths are honoured); the page ids are gathered on the device without a host sync."""
    page_size, width = meta.page_size, meta.page_table.shape[1]
    kv_lens = [s if q > 0 else 0 for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu)]
    num_pages = [-(-s // page_size) for s in kv_lens]
    assert max(num_pages, default=0) <= width, (
        f"seq_lens_cpu {meta.seq_lens_cpu} need {max(num_pages)} pages but page_table has {width} columns: "
        "seq_lens_cpu not the lengths of this page table?"
    )
    kv_indptr = [0, *accumulate(num_pages)]
    last_page_len = [s - (n - 1) * page_size if n else 0 for s, n in zip(kv_lens, num_pages)]
    pin = meta.page_table.device.type == "cuda"
    return PagedKVIndex(
        qo_indptr_cpu=_host_tensor(meta.query_start_loc_cpu, torch.int32, pin),
        kv_indptr_cpu=_host_tensor(kv_indptr, torch.int32, pin),
        kv_last_page_len_cpu=_host_tensor(last_page_len, torch.int32, pin),
        kv_indices=_gather_page_ids_no_sync(meta.page_table, num_pages, pin),
    )


def _host_tensor(values, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Pinned when it is bound for a CUDA device, so its copy there is asynchronous."""
    tensor = torch.tensor(list(values), dtype=dtype)
    return tensor.pin_memory() if pin else tensor


def _gather_page_ids_no_sync(page_table: torch.Tensor, num_pages: list[int], pin: bool) -> torch.Tensor:
    """``page_table[b, :num_pages[b]]`` for every b, concatenated: int32 ``[sum(num_pages)]``."""
    device = page_table.device
    total = sum(num_pages)
    counts = _host_tensor(num_pages, torch.int64, pin).to(device, non_blocking=True)  # [B]
    rows = torch.repeat_interleave(torch.arange(len(num_pages), device=device), counts, output_size=total)  # [total]
    first = torch.cumsum(counts, 0) - counts  # [B]: where row b's pages start in the output
    cols = torch.arange(total, device=device) - first[rows]  # [total]
    return page_table[rows, cols].to(torch.int32)


def import_flashinfer() -> Any:
    """The ``flashinfer`` module; ImportError naming the package to install where it is missing."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(
            f"the flashinfer attention backend needs flashinfer-python (the `gpu` extra): {exc}"
        ) from exc


@dataclass(frozen=True)
class _Shape:
    """What a plan is for besides the lengths (the same in every layer of a model)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    scale: float

    @property
    def decode_tensor_cores(self) -> bool:
        return self.num_heads // self.num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP


def _shape_of(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
              scale: float) -> _Shape:
    assert q.dtype in HALF_DTYPES, (
        f"flashinfer kernels take fp16/bf16, got {q.dtype}: use attention_backend triton or torch (auto picks one)"
    )
    assert k_cache.dtype == v_cache.dtype == q.dtype, (
        f"q is {q.dtype} but the caches are {k_cache.dtype}/{v_cache.dtype}: model and KV dtypes differ?"
    )
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        f"K cache {tuple(k_cache.shape)}/{k_cache.stride()} and V cache {tuple(v_cache.shape)}/{v_cache.stride()} "
        "differ (FlashInfer reads both with one set of strides): caches of two different layers passed?"
    )
    assert k_cache.stride(-1) == 1, f"cache head_dim stride {k_cache.stride(-1)} != 1: a transposed cache view?"
    assert k_cache.shape[1] == meta.page_size, f"cache page_size {k_cache.shape[1]} != metadata's {meta.page_size}"
    assert q.shape[2] == k_cache.shape[3], f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}"
    assert q.shape[1] % k_cache.shape[2] == 0, f"{q.shape[1]} query heads not a multiple of {k_cache.shape[2]} kv heads"
    return _Shape(q.shape[1], k_cache.shape[2], q.shape[2], meta.page_size, q.dtype, float(scale))


@dataclass(frozen=True)
class _Variant:
    """A layer's score rule, which FlashInfer takes at plan time rather than at run time."""

    window: int | None  # sliding window: a token sees its last `window` positions; None: all before it
    softcap: float | None  # scores become softcap * tanh(score / softcap); None: not capped

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, f"window={self.window} must be >= 1 (None: no window)"
        assert self.softcap is None or self.softcap > 0, f"softcap={self.softcap} must be > 0 (None: no soft cap)"

    @property
    def plan_kwargs(self) -> dict[str, Any]:
        """What plan() takes for it; nothing for a plain layer, so its plan is FlashInfer's default."""
        kwargs: dict[str, Any] = {}
        if self.window is not None:
            kwargs["window_left"] = self.window - 1  # FlashInfer counts the positions left of the query
        if self.softcap is not None:
            kwargs["logits_soft_cap"] = self.softcap
        return kwargs


class _Wrapper:
    """A FlashInfer wrapper and the fence of its last plan.

    ``plan()`` writes its schedule into one pinned host buffer per wrapper and copies that to the
    device asynchronously; planning the same wrapper again before the copy ran would overwrite it. So a
    plan first waits for the previous plan's copy (long done in a running engine, which reads sampled
    tokens every step): a wait on one event, not on the device.
    """

    def __init__(self, wrapper: Any, device: torch.device) -> None:
        self.wrapper = wrapper
        self._device = device
        self._last_plan: torch.cuda.Event | None = None

    def plan(self, *args: Any, **kwargs: Any) -> None:
        if self._last_plan is not None:
            self._last_plan.synchronize()
        self.wrapper.plan(*args, **kwargs)
        if self._device.type == "cuda":
            self._last_plan = torch.cuda.Event()
            self._last_plan.record(torch.cuda.current_stream(self._device))


@dataclass
class _Planned:
    """One step's planned wrappers, one per variant its layers have used so far."""

    meta: AttnMetadata  # held, so its identity is not reused while the plan is memoised
    shape: _Shape
    wrappers: dict[_Variant, _Wrapper] = field(default_factory=dict)


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention in FlashInfer's kernels (CUDA, fp16/bf16); see the module docstring.

    Nothing is allocated until the first step: models are built on the meta device. Then one float
    workspace of ``workspace_bytes`` is allocated on the step's device and shared by every wrapper.
    """

    name = "flashinfer"
    supports_tree_mask = False  # its custom-mask prefill is not wired in: tree drafting needs torch or triton
    supports_window = True
    supports_softcap = True

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        assert workspace_bytes > 0, f"workspace_bytes={workspace_bytes} must be positive"
        self._fi = import_flashinfer()
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None  # [workspace_bytes] uint8
        self._eager: dict[tuple[str, bool, _Variant], _Wrapper] = {}  # (kind, tensor cores, variant) -> wrapper
        self._graph: dict[tuple[int, int, bool, _Variant], _Wrapper] = {}  # (batch, width, tensor cores, variant)
        self._shape: _Shape | None = None  # of the latest eager step: what prepare_graph_decode plans for
        self._variants: dict[_Variant, None] = {}  # every variant an eager step used, in first-use order
        self._memo: _Planned | None = None  # the current step's eager plan
        self._graph_memo: _Planned | None = None  # the latest prepare_graph_decode

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_pages, page_size, kvh, hd]
        v_cache: torch.Tensor,
        k: torch.Tensor,  # [T, kvh, hd]
        v: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        index_write_kv(k_cache, v_cache, k, v, slot_mapping)

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
        window: int | None = None, softcap: float | None = None,
    ) -> torch.Tensor:
        shape = _shape_of(q, k_cache, v_cache, meta, scale)
        variant = _Variant(window, softcap)
        assert meta.tree_mask is None, "flashinfer takes no tree masks here (tree drafting needs torch or triton)"
        if meta.num_tokens == 0 or meta.num_seqs == 0:
            return torch.empty_like(q)
        wrapper = self._wrapper_for(meta, shape, variant, q.device)
        q = q if q.stride(-1) == 1 else q.contiguous()
        return wrapper.wrapper.run(q, (k_cache, v_cache))  # [T, H, hd]

    def prepare_graph_decode(self, meta: AttnMetadata) -> None:
        """Plan the decode step a CUDA graph captures or replays, outside the capture (the contract
        is in the module docstring). Plans every variant the eager steps have used; the next ``attention``
        calls with this very ``meta`` run the graph wrapper of its ``(batch, page-table width)`` and their
        variant, whose fixed buffers this rewrites."""
        shape = self._shape
        assert shape is not None, "prepare_graph_decode before any eager step: run the warm-up step first"
        assert shape.page_size == meta.page_size, f"page_size {meta.page_size} != the model's {shape.page_size}"
        assert meta.num_seqs > 0 and all(q_len == 1 for q_len in meta.query_lens_cpu), (
            f"a graph step decodes one token per sequence, got query_lens {meta.query_lens_cpu}"
        )
        device = meta.page_table.device
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), (
            "prepare_graph_decode inside a CUDA-graph capture: FlashInfer's plan runs on the host; call it before"
        )
        batch, width = meta.page_table.shape
        index = paged_kv_index_no_sync(meta)
        planned = _Planned(meta, shape)
        for variant in self._variants:
            wrapper = self._graph_wrapper(batch, width, shape.decode_tensor_cores, variant, device)
            self._plan_decode(wrapper, index, shape, variant)
            planned.wrappers[variant] = wrapper
        self._graph_memo = planned

    # ---- plans ---------------------------------------------------------------------------------------
    def _wrapper_for(self, meta: AttnMetadata, shape: _Shape, variant: _Variant, device: torch.device) -> _Wrapper:
        """The planned wrapper of this step and variant: the graph plan when ``meta`` was prepared for one,
        else the eager plan, made on the step's first layer of the variant and memoised with the metadata."""
        graph = self._graph_memo
        if graph is not None and graph.meta is meta:
            assert graph.shape == shape, f"graph planned for {graph.shape}, layer has {shape}: one model per backend"
            if variant in graph.wrappers:
                return graph.wrappers[variant]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"flashinfer attention under CUDA-graph capture with metadata or a variant ({variant}) that was not "
                "prepared: the graph runner must call backend.prepare_graph_decode(meta) outside the capture, "
                "before capturing and before every replay, after an eager step of every layer (see "
                "kernels/cuda/flashinfer_backend.py)"
            )
        if self._memo is None or self._memo.meta is not meta or self._memo.shape != shape:
            self._memo = _Planned(meta, shape)
        if variant not in self._memo.wrappers:
            self._memo.wrappers[variant] = self._plan_eager(meta, shape, variant, device)
        self._shape = shape
        self._variants[variant] = None
        return self._memo.wrappers[variant]

    def _plan_eager(self, meta: AttnMetadata, shape: _Shape, variant: _Variant, device: torch.device) -> _Wrapper:
        index = paged_kv_index_no_sync(meta)
        if all(q_len == 1 for q_len in meta.query_lens_cpu):
            wrapper = self._eager_wrapper("decode", shape.decode_tensor_cores, variant, device)
            self._plan_decode(wrapper, index, shape, variant)
            return wrapper
        wrapper = self._eager_wrapper("prefill", False, variant, device)
        wrapper.plan(
            index.qo_indptr_cpu, index.kv_indptr_cpu, index.kv_indices, index.kv_last_page_len_cpu,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            causal=True, sm_scale=shape.scale, q_data_type=shape.dtype, kv_data_type=shape.dtype, non_blocking=True,
            **variant.plan_kwargs,
        )
        return wrapper

    @staticmethod
    def _plan_decode(wrapper: _Wrapper, index: PagedKVIndex, shape: _Shape, variant: _Variant) -> None:
        wrapper.plan(
            index.kv_indptr_cpu, index.kv_indices, index.kv_last_page_len_cpu,
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.page_size,
            q_data_type=shape.dtype, kv_data_type=shape.dtype, sm_scale=shape.scale, non_blocking=True,
            **variant.plan_kwargs,
        )

    # ---- wrappers ------------------------------------------------------------------------------------
    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            # zeroed: FlashInfer requires it for the workspace's first use
            self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=device)
        assert self._workspace.device == device, (
            f"flashinfer backend used on {device} after {self._workspace.device}: one backend per model and device"
        )
        return self._workspace

    def _eager_wrapper(self, kind: str, tensor_cores: bool, variant: _Variant, device: torch.device) -> _Wrapper:
        key = (kind, tensor_cores, variant)
        if key not in self._eager:
            workspace = self._workspace_on(device)
            if kind == "decode":
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, KV_LAYOUT, use_tensor_cores=tensor_cores)
            else:
                wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(workspace, KV_LAYOUT)
            self._eager[key] = _Wrapper(wrapper, device)
        return self._eager[key]

    def _graph_wrapper(self, batch: int, width: int, tensor_cores: bool, variant: _Variant,
                       device: torch.device) -> _Wrapper:
        key = (batch, width, tensor_cores, variant)
        if key not in self._graph:
            def buffer(size: int) -> torch.Tensor:
                return torch.zeros(size, dtype=torch.int32, device=device)

            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace_on(device), KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=buffer(batch + 1),
                paged_kv_indices_buffer=buffer(max(1, batch * width)),
                paged_kv_last_page_len_buffer=buffer(batch),
            )
            self._graph[key] = _Wrapper(wrapper, device)
        return self._graph[key]
