"""Where a `ServeConfig` comes from: a YAML file, dotted overrides, the `tandem serve` command line.

Precedence, lowest first: dataclass defaults < YAML file < CLI flags < `--set KEY=VALUE`. Every
scalar is type-checked here (ints pass as floats; bools are not ints), every bound by the dataclass
(`cluster/serve/config.py`); a bad value raises `ConfigError` naming the dotted field.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from cluster.serve.config import (
    CPU_DECODE_CHUNK_SIZE,
    DEFAULT_COUNTS,
    GROUP_NAMES,
    ClusterConfig,
    ServeConfig,
    WorkerGroupConfig,
)
from cluster.serve.memory import MemoryConfig
from common.config import GENERATION_CONFIG_MODES, ConfigError, EngineConfig, require
from common.engine_flags import add_engine_args, engine_fields_from_args
from kv_store.config import KVStoreConfig
from kv_store.l3.config import L3Config
from kv_store.transfer.config import TransportConfig
from router.config import POLICIES, RouterConfig
from router.gateway.config import API_KEY_ENV, GatewayConfig

__all__ = ["add_serve_args", "load_serve_config", "serve_config_from_args"]

# ---- loading: YAML -> nested dict -> dotted overrides -> typed dataclasses ----

_NO_OVERRIDES: Mapping[str, Any] = MappingProxyType({})


def load_serve_config(path: str | os.PathLike | None = None,
                      overrides: Mapping[str, Any] = _NO_OVERRIDES) -> ServeConfig:
    """Read `path` (YAML; None or an empty file: defaults), apply dotted `overrides` in order
    ({"gateway.port": 8001, "decode.engine.max_running_requests": 8}), and build a validated config.

    `gateway.api_key` falls back to $TANDEM_API_KEY when neither the file nor an override names it
    (an explicit null keeps the key off). Raises ConfigError naming the dotted field for unknown keys,
    wrong types and out-of-bounds values.
    """
    raw = _read_yaml(path) if path is not None else {}
    for key, value in overrides.items():
        _set_dotted(raw, key, value)
    env_key = os.environ.get(API_KEY_ENV)
    gateway = raw.get("gateway")
    if env_key and (gateway is None or (isinstance(gateway, Mapping) and "api_key" not in gateway)):
        _set_dotted(raw, "gateway.api_key", env_key)
    return _build_serve(raw)


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {os.fspath(path)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {os.fspath(path)}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{os.fspath(path)}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    require(isinstance(data, dict),
             f"{os.fspath(path)}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c` in the nested dict, creating sections; a mapping value merges into a mapping there."""
    parts = dotted.split(".") if isinstance(dotted, str) else [""]
    require(all(parts), f"override key must be a dotted field path like 'gateway.port', got {dotted!r}")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        require(child is None or isinstance(child, Mapping),
                 f"cannot set {dotted!r}: {'.'.join(parts[:i + 1])} is {child!r}, not a section")
        node[part] = node = dict(child or {})
    old, value = node.get(parts[-1]), copy.deepcopy(value)
    if isinstance(old, Mapping) and isinstance(value, Mapping):
        merged = dict(old)
        for key, sub in value.items():
            _set_dotted(merged, str(key), sub)
        value = merged
    node[parts[-1]] = value


def _build_serve(raw: Mapping[str, Any]) -> ServeConfig:
    _reject_unknown(raw, ServeConfig, "")
    model = _check(str, raw.get("model", "smollm2"), "model")
    top = _section(raw, "engine", "")
    engine = _make(EngineConfig, {"model": model, **top}, "engine.")
    built: dict[str, Any] = {"engine": engine}
    for name in GROUP_NAMES:
        built[name] = _build_group(name, _section(raw, name, ""), dataclasses.asdict(engine), set(top))
    for name, cls in (("transport", TransportConfig), ("router", RouterConfig),
                      ("gateway", GatewayConfig), ("cluster", ClusterConfig), ("memory", MemoryConfig)):
        built[name] = _make(cls, _section(raw, name, ""), f"{name}.")
    built["kv_store"] = _build_kv_store(_section(raw, "kv_store", ""))
    return _make(ServeConfig, {"model": model}, "", built)


def _build_kv_store(raw: Mapping[str, Any]) -> KVStoreConfig:
    """`kv_store.l3` absent or null: no L3; a mapping (even empty): L3Config from its fields."""
    _reject_unknown(raw, KVStoreConfig, "kv_store.")
    if raw.get("l3") is None:
        return KVStoreConfig()
    return KVStoreConfig(l3=_make(L3Config, _section(raw, "l3", "kv_store."), "kv_store.l3."))


def _build_group(name: str, raw: Mapping[str, Any], engine_fields: dict[str, Any], top_set: set[str]
                 ) -> WorkerGroupConfig:
    """The group's engine is the top-level one with the group's own `engine:` fields laid over it
    (`top_set`: the fields the top-level section names). A CPU decode group whose chunk size neither
    names takes `CPU_DECODE_CHUNK_SIZE`; a CUDA group whose dtype neither names serves bfloat16."""
    own = _section(raw, "engine", f"{name}.")
    fields = {**engine_fields, **own}
    if name == "decode" and fields.get("device") == "cpu" and "chunk_size" not in top_set | set(own):
        fields["chunk_size"] = CPU_DECODE_CHUNK_SIZE
    if str(fields.get("device", "cpu")).startswith("cuda") and "dtype" not in top_set | set(own):
        fields["dtype"] = "bfloat16"  # half the weights and KV of float32; every CUDA backend serves it
    engine = _make(EngineConfig, fields, f"{name}.engine.")
    raw = {"count": DEFAULT_COUNTS[name], **raw}
    if "num_gpus" not in raw and engine.device.startswith("cuda"):
        # a GPU a rank; Ray hides every GPU from a worker asking none
        raw["num_gpus"] = float(engine.tensor_parallel_size)
    return _make(WorkerGroupConfig, raw, f"{name}.", {"engine": engine})


def _section(raw: Mapping[str, Any], name: str, prefix: str) -> Mapping[str, Any]:
    """The mapping under `name` ({} when absent or left empty in YAML)."""
    value = raw.get(name)
    if value is None:
        return {}
    require(isinstance(value, Mapping), f"{prefix}{name} must be a mapping, got {value!r} ({type(value).__name__})")
    return value


def _reject_unknown(raw: Mapping[str, Any], cls: type, prefix: str) -> None:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        require(key in valid, f"unknown key '{prefix}{key}' (valid: {', '.join(valid)})")


def _make(cls: type, raw: Mapping[str, Any], prefix: str, built: Mapping[str, Any] = _NO_OVERRIDES):
    """Build `cls` from `raw`'s scalar fields (type-checked here) and the already-built `built` ones;
    the dataclass checks bounds, and its message gets the field's dotted `prefix`."""
    _reject_unknown(raw, cls, prefix)
    hints = typing.get_type_hints(cls)
    kwargs = {k: _check(hints[k], v, prefix + k) for k, v in raw.items() if k not in built}
    try:
        return cls(**kwargs, **built)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(prefix) else prefix + message) from None


def _check(hint: Any, value: Any, name: str) -> Any:
    """`value` if it has type `hint` (ints pass as floats; bools are not ints); ConfigError otherwise."""
    optional = type(None) in typing.get_args(hint)
    if optional and value is None:
        return None
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if typing.get_origin(base) is dict:  # dict[K, V]: a YAML mapping, each value checked as a V
        key, item = typing.get_args(base)
        if isinstance(value, Mapping) and all(isinstance(k, key) for k in value):
            return {k: _check(item, v, f"{name}.{k}") for k, v in value.items()}
        raise ConfigError(f"{name} must be a mapping of {key.__name__} to {item.__name__}, "
                          f"got {value!r} ({type(value).__name__})")
    if typing.get_origin(base) is tuple:  # tuple[X, ...]: a YAML list of X (one X alone is a list of one)
        item = typing.get_args(base)[0]
        items = [value] if isinstance(value, item) else value
        if isinstance(items, (list, tuple)) and all(isinstance(v, item) for v in items):
            return tuple(items)
        raise ConfigError(f"{name} must be a list of {item.__name__}{' or null' if optional else ''}, "
                          f"got {value!r} ({type(value).__name__})")
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    expected = base.__name__ + (" or null" if optional else "")
    raise ConfigError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


# ---- the `tandem serve` command line ----

_FLAG_FIELDS = {
    "address": "cluster.address", "host": "gateway.host", "port": "gateway.port", "api_key": "gateway.api_key",
    "generation_config": "gateway.generation_config", "memory_budget_gib": "memory.budget_gib",
    "policy": "router.policy", "num_prefill": "prefill.count", "num_decode": "decode.count",
    "num_colocated": "colocated.count",
}


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. gateway.port=8001), got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{key}: VALUE is not valid YAML: {getattr(exc, 'problem', exc)}") from None


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `tandem serve` flags. Each defaults to None (not given): only given flags override the file."""
    p = parser  # short lines below
    p.add_argument("--config", metavar="FILE",
                   help="cluster YAML (see examples/cluster.yaml); default: built-in defaults")
    p.add_argument("--address", metavar="ADDR", help="join a Ray cluster ('auto', 'ray://host:port', 'host:port'); "
                                                     "default: start a local one")
    p.add_argument("--host", help="gateway interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway port (default 8000)")
    p.add_argument("--api-key", help=f"require this bearer token on /v1/* (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--generation-config", choices=GENERATION_CONFIG_MODES,
                   help="unset temperature/top_p/top_k of a request: the model's recommended sampling (auto, "
                        "the default) or the OpenAI API's defaults (none); a request's own fields always win")
    p.add_argument("--memory-budget-gib", type=float, metavar="GIB",
                   help="RAM every process tandem starts on this node may hold together; the KV pools get what "
                        "is left after the weights (default: a quarter of RAM, at most 8 GiB)")
    p.add_argument("--policy", choices=POLICIES, help="routing policy (default cache_aware)")
    p.add_argument("--num-prefill", type=int, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--num-decode", type=int, metavar="N", help="decode workers (default 1)")
    p.add_argument("--num-colocated", type=int, metavar="N", help="colocated workers (default 0)")
    add_engine_args(p, defaults=False, note=" (every worker's default; a group's own engine: section still wins)")
    p.add_argument("--set", action="append", type=_key_value, metavar="KEY=VALUE",
                   help="set any field by dotted path, VALUE parsed as YAML (repeatable; beats the other flags), "
                        "e.g. --set decode.engine.max_running_requests=8 --set gateway.api_key=null")
    p.add_argument("--plan-only", action="store_true",
                   help="print what would be placed where (Ray's GPUs, each worker's weights, KV, landing, staging "
                        "and host tier, the max model length) and exit without starting anything")
    p.add_argument("--plan-gpus", type=int, metavar="N", help="with --plan-only: plan for a node of N GPUs "
                                                              "(default: this node's)")
    p.add_argument("--plan-gpu-memory-gib", type=float, metavar="GIB",
                   help="with --plan-only: plan for GPUs of this much memory (default: this node's)")


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config from `--config`, the given flags, then `--set` (later wins)."""
    overrides = {key: getattr(args, dest) for dest, key in _FLAG_FIELDS.items() if getattr(args, dest) is not None}
    overrides |= {"model" if name == "model" else f"engine.{name}": value
                  for name, value in engine_fields_from_args(args).items()}
    for key, value in args.set or ():
        overrides.pop(key, None)  # re-inserted last, so it applies after every flag
        overrides[key] = value
    return load_serve_config(args.config, overrides)
