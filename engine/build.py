"""Building an engine: the one place its parts are made and wired (docs/design.md §1), in this order.

    1. the draft head (EAGLE: loaded from `engine.draft_model` unless given) and its checks;
       the weights prepacked on a CPU
    2. the config resolved against the KV layout (pages, context length)
    3. the KV tensors: the target's layers and, with EAGLE, the head's one layer after them
    4. the device pool, the prefix tree over it, the `KVManager`
    5. the tiers below the tree (L2 host cache, L3 under it), attached to the tree; the sessions
    6. the scheduler: the one owner of request KV
    7. the runner: eager, inside the graph runner, which replays by the step strategy chosen here
       (`engine/graphs/strategy.py`: CUDA graphs captured here, C layers, compiled, buffers, eager)
    8. the speculator over its KV layer, replaying from the graph runner's buckets
    9. `EngineCore`, which hands its connector the engine's ports (the connector's own construction)

Each part gets what it needs when it is made; nothing is wired after `EngineCore` exists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.config import ConfigError, EngineConfig
from engine.connector import ConnectorPorts, KVConnector
from engine.core import EngineCore
from engine.graphs.runner import GraphRunner, graph_max_batch
from engine.graphs.strategy import choose_step_strategy
from engine.graphs.tree import tree_verify_rows
from engine.parts import EngineParts
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.sessions import NullSessions, SessionManager
from engine.spec.factory import NullSpeculator, check_draft_head, draft_aux_layers, load_draft_head, make_speculator
from engine.spec.speculator import EagleSpeculator
from engine.tiers import host_cache, model_id
from engine.tp import ControlGroup, LeadGraphRunner, LeadHead, LeadModel, LeadRunner, lead_moves
from engine.tp_tiers import LeadCopier, LeadL3, rank_l3
from kernels.attention import AUTO, get_backend, resolve_backend
from kernels.attention.base import AttentionBackend
from kernels.kv_layout import TORCH_DTYPES, KVCacheTensors, kv_layout, populate_in_background
from kernels.model.arch import LlamaArch
from kernels.model.eagle import EagleDraftHead
from kernels.model.llama import LlamaForCausalLM
from kernels.model.packed_linear import prepack_cpu
from kv_store.device_pool import DevicePool
from kv_store.host_cache import HostCache, NullHostCache
from kv_store.kv_manager import KVManager
from kv_store.l3.bridge import L3Bridge
from kv_store.l3.config import L3Config
from kv_store.radix_cache import NullPrefixCache, RadixPrefixCache

log = logging.getLogger(__name__)

ConnectorFactory = Callable[[ConnectorPorts], KVConnector]
"""Makes a worker's connector from the ports its engine lends it (None: colocated, `NullConnector`)."""


@dataclass(frozen=True)
class _Pools:
    kv_cache: KVCacheTensors
    target_kv: KVCacheTensors
    draft_kv: KVCacheTensors | None
    device_pool: DevicePool
    tree: RadixPrefixCache | NullPrefixCache
    kvm: KVManager


def choose_attention_backend(config: EngineConfig, model: LlamaForCausalLM, draft_head: EagleDraftHead | None,
                             device: torch.device) -> str:
    """The attention backend this engine runs, `config.attention_backend` resolved for the device and
    the model's dtype (`auto`: `kernels.attention.resolve_backend`), made the model's (and a given
    draft head's; a head loaded later takes the model's) when it was built with another. Logged once.
    Raises ConfigError when the named backend cannot run here (FlashInfer off CUDA, not importable)."""
    if not hasattr(model, "use_attention_backend"):  # a test's wrapper keeps its own forward
        return getattr(getattr(model, "backend", None), "name", "torch")
    dtype = next(model.parameters()).dtype
    try:
        name = resolve_backend(config.attention_backend, device, dtype)
    except ValueError as exc:
        raise ConfigError(f"engine.attention_backend: {exc}") from None
    lacks = _lacks(get_backend(name), getattr(model, "arch", None))
    if lacks and config.attention_backend != AUTO:
        raise ConfigError(f"engine.attention_backend: {name} takes no {lacks} attention, which this model has")
    if lacks:
        log.info("attention backend auto -> torch: %s takes no %s attention, which this model has", name, lacks)
        name = "torch"
    if model.backend.name != name:
        model.use_attention_backend(get_backend(name))
    if draft_head is not None and draft_head.self_attn.backend.name != name:
        draft_head.self_attn.backend = model.backend
    log.info("attention backend: %s (engine.attention_backend %s, %s, %s)", name, config.attention_backend,
             device, str(dtype).removeprefix("torch."))
    return name


def _lacks(backend: AttentionBackend, arch: LlamaArch | None) -> str:
    """What of `arch`'s attention (sliding windows, soft caps) `backend` cannot do, in words ('' if none)."""
    needs = [(getattr(arch, "windowed", False), "supports_window", "sliding-window"),
             (getattr(arch, "attn_softcap", None) is not None, "supports_softcap", "soft-capped")]
    return " or ".join(word for need, flag, word in needs if need and not getattr(backend, flag))


def build_engine(config: EngineConfig, model: LlamaForCausalLM, arch: LlamaArch, tokenizer: Any = None,
                 eos_token_ids: Sequence[int] = (), connector: ConnectorFactory | None = None,
                 l3: L3Config | None = None, draft_head: EagleDraftHead | None = None,
                 compile_in_background: bool = False, populate: bool = True,
                 control: ControlGroup | None = None) -> EngineCore:
    """An engine for `model` (`draft_head`: the EAGLE head when `config.speculative` is `eagle`; None
    loads it from `config.draft_model`). Raises ConfigError before allocating anything it cannot serve.
    `compile_in_background`: `config.cpu_compile`'s compile runs beside serving, from
    `engine.runner.start_compile()` (a served worker's loop), not before this returns (`GraphRunner`).
    `populate` (an engine made alone): its CPU KV pool is mapped in before this returns, so it runs
    at full speed at once; without, pages fault in as they are first written (a one-shot run).
    `control`: rank 0's control group of a tensor-parallel engine (`engine/tp_launch.py:load_tp_engine`)."""
    device = torch.device(config.device)
    backend = choose_attention_backend(config, model, draft_head, device)
    if config.speculative != "none" and (getattr(arch, "windowed", False) or getattr(arch, "attn_softcap", None)):
        raise ConfigError(f"engine.speculative: {config.speculative} is not supported for {arch.model_type}: its "
                          "sliding-window or soft-capped attention takes no draft tree masks")
    if config.speculative != "none":
        draft_head = draft_head if draft_head is not None else load_draft_head(config, model, arch)
        check_draft_head(config, draft_head)
    else:
        draft_head = None
    if config.cpu_prepack is not False:  # None: on (a prefill worker says False); CPU weights only
        for module in (model, draft_head):
            if module is not None:
                prepack_cpu(module)
    num_layers = arch.num_layers + (1 if draft_head is not None else 0)  # the draft head's KV: the last layer
    resolved = config.resolve(kv_layout(num_layers, config.page_size, arch.num_kv_heads, arch.head_dim,
                                        config.dtype).page_bytes, arch.max_position_embeddings)
    assert resolved.num_pages is not None and resolved.max_model_len is not None, "EngineConfig.resolve left one unset"
    pools = _pools(resolved, arch, num_layers, device)
    if populate and not compile_in_background:  # at full speed when returned (a served worker maps it in once ready)
        populating = populate_in_background(pools.kv_cache.k + pools.kv_cache.v)
        if populating is not None:
            populating.join()
    l3_model_id = model_id(config.model, model, draft_head)
    own_l3 = l3
    if control is not None and l3 is not None:  # this rank's keys
        assert model.tp is not None, "rank 0 of a tensor-parallel engine with a model not sharded (`load_shard`)"
        own_l3 = rank_l3(l3, model.tp.shard)
    tier = _tiers(resolved, pools, own_l3, l3_model_id)
    sessions = (SessionManager(pools.kvm, int(resolved.session_kv_fraction * pools.device_pool.pages.num_usable
                                              * resolved.page_size), offload=bool(resolved.host_cache_pages))
                if resolved.enable_prefix_cache else NullSessions())
    scheduler = Scheduler(resolved, pools.kvm, host_cache=tier, sessions=sessions,
                          relocation_version=lambda: pools.device_pool.relocation_version,
                          kv_window=getattr(arch, "kv_window", None))
    served: LlamaForCausalLM | LeadModel = model  # what the engine calls (rank 0's sends its calls on)
    if control is None:
        eager = ModelRunner(model, pools.target_kv, resolved.page_size, device, draft_aux_layers(draft_head))
    else:  # rank 0 of a tensor-parallel engine (`engine/tp.py`): the other ranks size their KV as this
        control.send(("config", resolved, (l3, l3_model_id) if l3 is not None else None))
        if isinstance(tier, HostCache):  # the other ranks copy between their own pages and host tier
            tier.copier = LeadCopier(tier.copier, control)
            if isinstance(tier.l3, L3Bridge):  # ... and put and fetch their own parts of L3's pages
                tier.l3.l3 = LeadL3(tier.l3.l3, control)
        eager = LeadRunner(control, model, pools.target_kv, resolved.page_size, device, draft_aux_layers(draft_head))
        served = LeadModel(model, control)
    plan = choose_step_strategy(resolved, model, device, backend)
    log.info("decode steps: %s", plan.describe())
    graphs = GraphRunner if control is None else functools.partial(LeadGraphRunner, control)
    runner = graphs(eager, pools.device_pool, graph_max_batch(resolved), resolved.max_model_len, plan,
                         sizes=resolved.graph_batch_sizes, loads_in_flight=pools.device_pool.loads_in_flight,
                         tree_rows=tree_verify_rows(resolved),
                         tree_batch=max(1, min(resolved.max_running_requests, resolved.speculative_max_batch)),
                         compile_in_background=compile_in_background)
    speculator = _speculator(resolved, draft_head, device, pools, runner, control)
    parts = EngineParts(resolved, served, arch, tokenizer, frozenset(eos_token_ids), pools.kv_cache, pools.device_pool,
                        pools.kvm, tier, sessions, scheduler, runner, speculator)
    return EngineCore(parts, connector)


def _speculator(config: EngineConfig, head: EagleDraftHead | None, device: torch.device, pools: _Pools,
                runner: GraphRunner, control: ControlGroup | None) -> EagleSpeculator | NullSpeculator:
    """Step 7: what `config.speculative` asks for; on rank 0 of a tensor-parallel engine its head's
    calls and K/V moves go to every rank (`engine/tp.py:LeadHead`) and replay no graphs of its own."""
    if control is None:
        return make_speculator(config, head, device, pools.draft_kv, pools.target_kv, runner)
    speculator = make_speculator(config, head and LeadHead(head, control), device, pools.draft_kv, pools.target_kv)
    if head is not None:
        assert isinstance(speculator, EagleSpeculator), "a draft head but no speculator: engine.speculative none?"
        speculator.move_kv = lead_moves(speculator.move_kv, control)
    return speculator


def _pools(config: EngineConfig, arch: LlamaArch, num_layers: int, device: torch.device) -> _Pools:
    """Steps 3 and 4: the KV tensors (the draft head's layer last) and what owns their pages."""
    assert config.num_pages is not None, "the pools of a config not resolved (`EngineConfig.resolve`)"
    kv_cache = KVCacheTensors.allocate(num_layers, config.num_pages, config.page_size, arch.num_kv_heads,
                                       arch.head_dim, TORCH_DTYPES[config.dtype], device)
    n = arch.num_layers
    target_kv = KVCacheTensors(kv_cache.k[:n], kv_cache.v[:n])
    draft_kv = KVCacheTensors(kv_cache.k[n:], kv_cache.v[n:]) if num_layers > n else None
    device_pool = DevicePool(kv_cache)
    pages = device_pool.pages
    tree = RadixPrefixCache(pages) if config.enable_prefix_cache else NullPrefixCache(pages)
    return _Pools(kv_cache, target_kv, draft_kv, device_pool, tree, KVManager(pages, tree))


def _tiers(config: EngineConfig, pools: _Pools, l3: L3Config | None, l3_model_id: str) -> HostCache | NullHostCache:
    """Step 5: the host tier (with L3 under it) the resolved config asks for, attached to the tree."""
    tier = host_cache(config, pools.tree, pools.device_pool, l3, l3_model_id)
    if isinstance(tier, HostCache):
        assert isinstance(pools.tree, RadixPrefixCache), "a host tier under no prefix tree: the prefix cache is off?"
        pools.tree.attach_tier(tier)
    return tier
