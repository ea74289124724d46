"""An engine's parts, as `engine/build.py:build_engine` makes and wires them for `EngineCore`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import EngineConfig
from engine.graphs.runner import GraphRunner
from engine.scheduler import Scheduler
from engine.sessions import NullSessions, SessionManager
from engine.spec.factory import NullSpeculator
from engine.spec.speculator import EagleSpeculator
from engine.tp import LeadModel
from kernels.kv_layout import KVCacheTensors
from kernels.model.arch import LlamaArch
from kernels.model.llama import LlamaForCausalLM
from kv_store.device_pool import DevicePool
from kv_store.host_cache import HostCache, NullHostCache
from kv_store.kv_manager import KVManager


@dataclass(frozen=True)
class EngineParts:
    """An engine's parts, made and wired by `engine/build.py:build_engine` (the config resolved)."""

    config: EngineConfig
    model: LlamaForCausalLM | LeadModel  # rank 0 of a tensor-parallel engine: its calls go to every rank
    arch: LlamaArch
    tokenizer: Any  # `ServingTokenizer` or a transformers tokenizer; None: token ids only
    eos_token_ids: frozenset[int]
    kv_cache: KVCacheTensors
    device_pool: DevicePool
    kvm: KVManager
    host_cache: HostCache | NullHostCache
    sessions: SessionManager | NullSessions
    scheduler: Scheduler
    runner: GraphRunner
    speculator: EagleSpeculator | NullSpeculator
