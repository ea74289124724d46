"""`tandem serve` config: defaults, YAML + flag + --set precedence, per-group engines, validation."""

import argparse
from pathlib import Path

import pytest
import yaml

from cluster.serve.config import (
    API_KEY_ENV,
    CPU_DECODE_CHUNK_SIZE,
    CPU_LOCAL_PREFILL_MAX_TOKENS,
    ClusterConfig,
    ConfigError,
    GatewayConfig,
    RouterConfig,
    ServeConfig,
    TransportConfig,
    WorkerGroupConfig,
)
from cluster.serve.config_load import add_serve_args, load_serve_config, serve_config_from_args
from common.config import EngineConfig
from kv_store.config import KVStoreConfig
from kv_store.l3.config import L3Config
from kv_store.transfer.session import TransferDeadlines, TransferState

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cluster.yaml"


@pytest.fixture(autouse=True)
def _no_env_api_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def write_yaml(tmp_path, text: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_no_flags_is_the_laptop_cluster():
    cfg = serve_config_from_args(parse())
    assert cfg == ServeConfig() == load_serve_config()
    assert cfg.cluster.address is None and cfg.cluster.namespace == "tandem"
    assert (cfg.prefill.count, cfg.decode.count, cfg.colocated.count) == (1, 1, 0)
    assert cfg.prefill.engine.device == cfg.decode.engine.device == "cpu"
    assert cfg.prefill.num_gpus == 0.0 and cfg.decode.host_pages is None  # sized by the memory plan
    assert cfg.model == cfg.engine.model == "smollm2"
    assert (cfg.gateway.host, cfg.gateway.port, cfg.gateway.api_key) == ("127.0.0.1", 8000, None)
    assert cfg.router.policy == "cache_aware" and cfg.transport.protocol == "tcp"


def test_empty_file_is_defaults(tmp_path):
    assert load_serve_config(write_yaml(tmp_path, "# nothing here\n")) == ServeConfig()
    assert load_serve_config(write_yaml(tmp_path, "gateway:\n")) == ServeConfig()


def test_file_then_flags_then_set(tmp_path):
    path = write_yaml(tmp_path, "gateway:\n  port: 7000\n  host: 0.0.0.0\nprefill:\n  count: 3\n"
                                "engine:\n  page_size: 32\nrouter:\n  policy: least_load\n")
    args = parse("--config", str(path), "--port", "7001", "--num-prefill", "2", "--page-size", "64",
                 "--set", "gateway.port=7002", "--set", "gateway.max_body_bytes=2048",
                 "--set", "engine.page_size=8")
    cfg = serve_config_from_args(args)
    assert cfg.gateway.port == 7002  # --set beats --port beats the file
    assert cfg.gateway.host == "0.0.0.0"  # file beats the default
    assert cfg.prefill.count == 2  # flag beats the file
    assert cfg.router.policy == "least_load"
    assert cfg.gateway.max_body_bytes == 2048 and isinstance(cfg.gateway.max_body_bytes, int)
    assert cfg.engine.page_size == cfg.prefill.engine.page_size == cfg.decode.engine.page_size == 8


def test_later_set_wins_even_over_a_section_set_before_it():
    cfg = serve_config_from_args(parse("--page-size", "64", "--set", "engine={page_size: 8, chunk_size: 32}",
                                       "--set", "engine.page_size=4"))
    assert (cfg.engine.page_size, cfg.engine.chunk_size) == (4, 32)


def test_flag_beats_file_when_no_set(tmp_path):
    path = write_yaml(tmp_path, "engine:\n  page_size: 32\nrouter:\n  policy: least_load\n")
    cfg = serve_config_from_args(parse("--config", str(path), "--page-size", "64", "--policy", "kv_cost"))
    assert cfg.decode.engine.page_size == 64 and cfg.router.policy == "kv_cost"


def test_every_flag_lands_on_its_field():
    cfg = serve_config_from_args(parse(
        "--address", "ray://head:10001", "--host", "0.0.0.0", "--port", "9000", "--api-key", "sk-1",
        "--policy", "round_robin", "--num-prefill", "0", "--num-decode", "2", "--num-colocated", "1",
        "--model", "/m/llama", "--device", "cpu", "--dtype", "bfloat16", "--page-size", "32",
        "--num-pages", "100", "--max-running", "7"))
    assert cfg.cluster.address == "ray://head:10001"
    assert (cfg.gateway.host, cfg.gateway.port, cfg.gateway.api_key) == ("0.0.0.0", 9000, "sk-1")
    assert cfg.router.policy == "round_robin"
    assert (cfg.prefill.count, cfg.decode.count, cfg.colocated.count) == (0, 2, 1)
    engine = cfg.colocated.engine
    assert (engine.model, engine.dtype, engine.page_size, engine.num_pages, engine.max_running_requests) == (
        "/m/llama", "bfloat16", 32, 100, 7)


def test_set_value_is_yaml():
    cfg = serve_config_from_args(parse("--api-key", "sk-1", "--set", "gateway.api_key=null",
                                       "--set", "transport.waiting_s=5", "--set", "gateway.served_model_name=m"))
    assert cfg.gateway.api_key is None
    assert cfg.transport.waiting_s == 5.0 and isinstance(cfg.transport.waiting_s, float)
    assert cfg.gateway.served_model_name == "m"


def test_set_without_equals_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        parse("--set", "gateway.port")
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_group_engine_merges_over_top_engine(tmp_path):
    path = write_yaml(tmp_path, "engine:\n  chunk_size: 256\n  max_running_requests: 16\n"
                                "decode:\n  engine:\n    max_running_requests: 128\n")
    cfg = load_serve_config(path, {"prefill.engine.chunk_size": 1024})
    assert cfg.engine.max_running_requests == 16 and cfg.engine.chunk_size == 256
    assert (cfg.prefill.engine.chunk_size, cfg.prefill.engine.max_running_requests) == (1024, 16)
    assert (cfg.decode.engine.chunk_size, cfg.decode.engine.max_running_requests) == (256, 128)
    assert cfg.colocated.engine == cfg.engine


def test_cpu_decode_workers_prefill_short_prompts_themselves_in_small_chunks(tmp_path):
    """On a CPU: prompts up to CPU_LOCAL_PREFILL_MAX_TOKENS prefill on the decode worker, in chunks of
    CPU_DECODE_CHUNK_SIZE unless a config names a chunk size; on CUDA every prompt goes to a prefill
    worker and the decode group keeps the engine's chunk size."""
    cpu = load_serve_config()
    assert cpu.router.local_prefill_max_tokens == CPU_LOCAL_PREFILL_MAX_TOKENS == 256
    assert (cpu.decode.engine.chunk_size, cpu.prefill.engine.chunk_size) == (CPU_DECODE_CHUNK_SIZE, 512)
    cuda = load_serve_config(overrides={"engine.device": "cuda"})
    assert cuda.router.local_prefill_max_tokens == 0 and cuda.decode.engine.chunk_size == 512
    assert load_serve_config(overrides={"router.local_prefill_max_tokens": 0}).router.local_prefill_max_tokens == 0
    top = load_serve_config(overrides={"engine.chunk_size": 256})
    assert top.decode.engine.chunk_size == top.prefill.engine.chunk_size == 256
    assert load_serve_config(overrides={"decode.engine.chunk_size": 512}).decode.engine.chunk_size == 512
    yaml_top = load_serve_config(write_yaml(tmp_path, "engine:\n  chunk_size: 128\n"))
    assert yaml_top.decode.engine.chunk_size == 128
    assert serve_config_from_args(parse("--chunk-size", "96")).decode.engine.chunk_size == 96


def test_cuda_device_gives_groups_a_gpu_unless_told():
    cfg = load_serve_config(overrides={"engine.device": "cuda", "decode.num_gpus": 0.5})
    assert cfg.prefill.num_gpus == 1.0 and cfg.decode.num_gpus == 0.5
    with pytest.raises(ConfigError, match=r"^prefill\.num_gpus must be > 0 when engine\.device is 'cuda'"):
        load_serve_config(overrides={"engine.device": "cuda", "prefill.num_gpus": 0, "prefill.num_cpus": 1})


@pytest.mark.parametrize("overrides, message", [
    ({"gatway.port": 1}, r"^unknown key 'gatway' \(valid: model, engine, prefill, decode, colocated, transport, "
                         r"kv_store, router, gateway, cluster, memory\)$"),
    ({"kv_store.l4": {}}, r"^unknown key 'kv_store\.l4' \(valid: l3\)$"),
    ({"kv_store.l3.url": "http://x"}, r"^kv_store\.l3\.url must start with redis:// or rediss://"),
    ({"kv_store.l3.prefetch_policy": "eager"}, r"^kv_store\.l3\.prefetch_policy must be one of"),
    ({"engine.write_policy": "lazy"}, r"^engine\.write_policy must be one of"),
    ({"engine.host_cache_ratio": -1}, r"^engine\.host_cache_ratio must be >= 0"),
    ({"gateway.prot": 1}, r"^unknown key 'gateway\.prot' \(valid: host, port, api_key, "),
    ({"decode.engine.page_sz": 1}, r"^unknown key 'decode\.engine\.page_sz' \(valid: model, device, dtype, "),
    ({"prefill.count": "2"}, r"^prefill\.count must be int, got '2' \(str\)$"),
    ({"gateway.port": True}, r"^gateway\.port must be int, got True \(bool\)$"),
    ({"engine.num_pages": "many"}, r"^engine\.num_pages must be int or null, got 'many' \(str\)$"),
    ({"router.cache_threshold": "0.5"}, r"^router\.cache_threshold must be float, got '0\.5' \(str\)$"),
    ({"model": 3}, r"^model must be str, got 3 \(int\)$"),
    ({"router": [1]}, r"^router must be a mapping, got \[1\] \(list\)$"),
    ({"decode.count": -1}, r"^decode\.count must be >= 0, got -1$"),
    ({"prefill.torch_threads": 0}, r"^prefill\.torch_threads must be >= 1, got 0$"),
    ({"engine.page_size": 12}, r"^engine\.page_size must be a power of two >= 1, got 12$"),
    ({"decode.engine.max_running_requests": 0}, r"^decode\.engine\.max_running_requests must be >= 1, got 0$"),
    ({"gateway.port": 70000}, r"^gateway\.port must be in \[0, 65535\], got 70000$"),
    ({"router.policy": "random"}, r"^router\.policy must be one of .*got 'random'$"),
    ({"transport.protocol": "udp"}, r"^transport\.protocol must be one of \('tcp', 'rdma'\), got 'udp'$"),
    ({"transport.waiting_s": 0}, r"^transport\.waiting_s must be > 0, got 0\.0$"),
    ({"cluster.heartbeat_timeout_s": 0.5}, r"^cluster\.heartbeat_timeout_s must be > cluster\.heartbeat_interval_s"),
    ({"cluster.address": "head"}, r"^cluster\.address must be null, 'auto', "),
    ({"cluster.address": "auto", "cluster.num_cpus": 4}, r"^cluster\.num_cpus sizes a local Ray instance"),
    ({"cluster.placement_strategy": "pack"}, r"^cluster\.placement_strategy must be one of"),
    ({"decode.engine.page_size": 32},
     r"^prefill\.engine\.page_size \(16\) and decode\.engine\.page_size \(32\) must match"),
    ({"prefill.engine.dtype": "bfloat16"},
     r"^prefill\.engine\.dtype \('bfloat16'\) and decode\.engine\.dtype \('float32'\)"),
    ({"decode.engine.model": "other"}, r"^decode\.engine\.model must equal model 'smollm2', got 'other'$"),
    ({"decode.count": 0, "colocated.count": 1}, r"^prefill\.count=1 needs decode\.count >= 1"),
    ({"decode.count": 0}, r"^prefill\.count=1 needs decode\.count >= 1"),
    ({"decode.count": 0, "prefill.count": 0}, r"^at least one decode or colocated worker is needed"),
    ({"prefill.resources": {"CPU": 1}}, r"^prefill\.resources\.CPU is one of Ray's own resources, not a custom one: "
                                         r"set num_cpus$"),
    ({"decode.resources.memory": 1}, r"^decode\.resources\.memory is one of Ray's own resources, not a custom one$"),
    ({"prefill.resources.tandem_prefill": -1}, r"^prefill\.resources\.tandem_prefill must be a number >= 0, "
                                               r"got -1\.0$"),
    ({"prefill.resources.ssd": float("nan")}, r"^prefill\.resources\.ssd must be a number >= 0, got nan$"),
    ({"prefill.resources.ssd": 0.00001}, r"^prefill\.resources\.ssd must be 0 or >= 0\.0001 "
                                         r"\(Ray's resource precision\)"),
    ({"prefill.resources.ssd": "one"}, r"^prefill\.resources\.ssd must be float, got 'one' \(str\)$"),
    ({"prefill.resources.ssd": True}, r"^prefill\.resources\.ssd must be float, got True \(bool\)$"),
    ({"decode.resources": ["tandem_decode"]}, r"^decode\.resources must be a mapping of str to float, "
                                              r"got \['tandem_decode'\] \(list\)$"),
    ({"decode.resources": {1: 1}}, r"^decode\.resources must be a mapping of str to float, got \{1: 1\} \(dict\)$"),
    ({"gateway..port": 1}, r"^override key must be a dotted field path"),
    ({"gateway.port": 8000, "gateway.port.x": 1},
     r"^cannot set 'gateway\.port\.x': gateway\.port is 8000, not a section$"),
])
def test_validation_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_serve_config(None, overrides)


def test_ints_pass_as_floats_and_page_sizes_may_differ_without_prefill():
    cfg = load_serve_config(overrides={"router.cache_threshold": 1, "prefill.count": 0,
                                       "decode.engine.page_size": 32})
    assert cfg.router.cache_threshold == 1.0 and isinstance(cfg.router.cache_threshold, float)
    assert cfg.decode.engine.page_size == 32 and cfg.engine.page_size == 16


def test_colocated_only_cluster_is_valid():
    cfg = load_serve_config(overrides={"prefill.count": 0, "decode.count": 0, "colocated.count": 2})
    assert (cfg.prefill.count, cfg.decode.count, cfg.colocated.count) == (0, 0, 2)


def test_bad_yaml_reports_the_line(tmp_path):
    path = write_yaml(tmp_path, "gateway:\n  port: 8000\n  host: [oops\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+"):
        load_serve_config(path)
    path = write_yaml(tmp_path, "gateway:\n  port: 8000\n    host: x\n")
    with pytest.raises(ConfigError, match=r"invalid YAML at line 3, column \d+"):
        load_serve_config(path)


def test_missing_file_and_non_mapping_top_level(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file not found: .*nope\.yaml$"):
        load_serve_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"the top level must be a mapping of sections, got list$"):
        load_serve_config(write_yaml(tmp_path, "- model: smollm2\n"))
    with pytest.raises(ConfigError, match=r"^unknown key 'gatway' "):
        load_serve_config(write_yaml(tmp_path, "gatway:\n  port: 1\n"))


def test_engine_model_must_match_top_level_model(tmp_path):
    cfg = load_serve_config(write_yaml(tmp_path, "model: /m/llama\nengine:\n  model: /m/llama\n"))
    assert cfg.engine.model == cfg.decode.engine.model == "/m/llama"
    with pytest.raises(ConfigError, match=r"^engine\.model must equal model 'smollm2', got '/m/llama'$"):
        load_serve_config(write_yaml(tmp_path, "engine:\n  model: /m/llama\n"))
    with pytest.raises(ConfigError, match=r"^engine\.model must equal model 'a'"):
        ServeConfig(model="a")


def test_group_resources_from_file_flags_and_set(tmp_path):
    path = write_yaml(tmp_path, "prefill:\n  resources: {tandem_prefill: 1, ssd: 0.5}\n"
                                "decode:\n  resources:\n    tandem_decode: 2\n")
    cfg = load_serve_config(path)
    assert cfg.prefill.resources == {"tandem_prefill": 1.0, "ssd": 0.5}
    assert cfg.decode.resources == {"tandem_decode": 2.0}
    assert all(isinstance(v, float) for v in cfg.prefill.resources.values()) and cfg.colocated.resources == {}
    cfg = serve_config_from_args(parse("--config", str(path), "--set", "prefill.resources.ssd=0",
                                       "--set", "decode.resources={nvme: 1}"))
    assert cfg.prefill.resources == {"tandem_prefill": 1.0, "ssd": 0.0}  # 0: kept, and not asked for
    assert cfg.decode.resources == {"tandem_decode": 2.0, "nvme": 1.0}  # a mapping merges into the file's
    assert ServeConfig().prefill.resources == {}


def test_direct_construction_checks_bounds_too():
    with pytest.raises(ConfigError, match=r"^count must be >= 0, got -1$"):
        WorkerGroupConfig(count=-1)
    with pytest.raises(ConfigError, match=r"^prefill\.engine\.page_size \(16\) and decode\.engine\.page_size \(8\)"):
        ServeConfig(decode=WorkerGroupConfig(count=1, engine=EngineConfig(page_size=8)))
    with pytest.raises(ConfigError, match=r"^max_transfer_retries must be >= 0"):  # a section names its own fields
        RouterConfig(max_transfer_retries=-1)
    with pytest.raises(ConfigError, match=r"^num_cpus and num_gpus are both 0"):
        WorkerGroupConfig(count=1, num_cpus=0)
    with pytest.raises(ConfigError, match=r"^resources: a name must be a non-empty string, got ''$"):
        WorkerGroupConfig(count=1, resources={"": 1.0})
    with pytest.raises(ConfigError, match=r"^resources must be a mapping, got \[\('a', 1\)\]$"):
        WorkerGroupConfig(count=1, resources=[("a", 1)])
    given = {"tandem_decode": 1.0}
    group = WorkerGroupConfig(count=1, resources=given)
    given["tandem_decode"] = 5.0
    assert group.resources == {"tandem_decode": 1.0}, "the config holds its own copy"


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = ServeConfig(
        model="/m/llama", engine=EngineConfig(model="/m/llama", dtype="bfloat16", num_pages=64, kv_memory_gib=1.5),
        prefill=WorkerGroupConfig(count=2, num_cpus=2.5, resources={"tandem_prefill": 1.0, "ssd": 0.0},
                                  engine=EngineConfig(model="/m/llama", dtype="bfloat16", chunk_size=64)),
        decode=WorkerGroupConfig(count=1, host_pages=7, engine=EngineConfig(model="/m/llama", dtype="bfloat16")),
        transport=TransportConfig(protocol="rdma", waiting_s=1.25), router=RouterConfig(policy="kv_cost"),
        gateway=GatewayConfig(api_key="sk-x", max_prompt_tokens=100),
        cluster=ClusterConfig(address="auto", max_restarts=0),
        kv_store=KVStoreConfig(l3=L3Config(url="rediss://:pw@10.0.0.5:6380/2", prefetch_policy="timeout")))
    data = cfg.to_dict()
    assert data["prefill"]["engine"] == {"chunk_size": 64, "num_pages": None, "kv_memory_gib": None}
    assert "model" not in data["engine"]
    assert data["decode"]["engine"] == {"chunk_size": 512, "num_pages": None, "kv_memory_gib": None}
    path = write_yaml(tmp_path, yaml.safe_dump(data))
    assert load_serve_config(path) == cfg
    assert load_serve_config(write_yaml(tmp_path, yaml.safe_dump(ServeConfig().to_dict()))) == ServeConfig()


def test_example_file_loads_with_its_shape():
    cfg = load_serve_config(EXAMPLE)
    assert (cfg.prefill.count, cfg.decode.count, cfg.colocated.count) == (2, 1, 0)
    assert cfg.prefill.num_gpus == cfg.decode.num_gpus == 1.0 and cfg.prefill.num_cpus == 4.0
    assert cfg.decode.engine.max_running_requests == 256 and cfg.prefill.engine.max_running_requests == 64
    assert cfg.prefill.engine.dtype == cfg.decode.engine.dtype == "bfloat16"
    assert cfg.decode.host_pages == 16384
    assert cfg.router.policy == "cache_aware" and cfg.gateway.host == "0.0.0.0"
    assert cfg.cluster.address == "auto" and cfg.cluster.placement_strategy == "SPREAD"
    assert cfg.gateway.api_key is None


def test_api_key_from_env_only_when_not_set(monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert load_serve_config().gateway.api_key == "sk-env"
    assert serve_config_from_args(parse("--port", "9000")).gateway.api_key == "sk-env"
    assert serve_config_from_args(parse("--api-key", "sk-flag")).gateway.api_key == "sk-flag"
    assert load_serve_config(write_yaml(tmp_path, "gateway:\n  api_key: sk-file\n")).gateway.api_key == "sk-file"
    assert load_serve_config(write_yaml(tmp_path, "gateway:\n  api_key: null\n")).gateway.api_key is None
    monkeypatch.setenv(API_KEY_ENV, "")
    assert load_serve_config().gateway.api_key is None


def test_transport_config_is_the_transfer_deadlines():
    """The deadlines are declared once (TransferDeadlines); the transport section adds its address."""
    deadlines = TransportConfig(waiting_s=5, transferring_s=7.5)
    assert isinstance(deadlines, TransferDeadlines)
    assert (deadlines.bootstrapping_s, deadlines.waiting_s, deadlines.transferring_s) == (30.0, 5, 7.5)
    assert deadlines.for_state(TransferState.WAITING) == 5


def test_overrides_are_not_mutated():
    overrides = {"gateway": {"port": 1234}, "gateway.host": "0.0.0.0"}
    cfg = load_serve_config(None, overrides)
    assert (cfg.gateway.port, cfg.gateway.host) == (1234, "0.0.0.0")
    assert overrides == {"gateway": {"port": 1234}, "gateway.host": "0.0.0.0"}


def test_with_groups_replaces_the_named_groups_and_keeps_the_others():
    config = ServeConfig()
    colocated = WorkerGroupConfig(count=2)
    changed = config.with_groups({"colocated": colocated})
    assert changed.colocated == colocated and changed.prefill is config.prefill and changed.decode is config.decode
    with pytest.raises(AssertionError, match=r"not worker groups: \['gateway'\]"):
        config.with_groups({"gateway": colocated})
