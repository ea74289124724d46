"""The one-way import rule of docs/design.md §1, checked on every import (function-level ones too).

Layers, bottom to top; each may import only what its line allows (third-party code is not checked):

    common           -> nothing in tandem            (the shared vocabulary: configs, wire protocol, relay)
    kernels          -> common
    kv_store         -> kernels, common
    engine           -> kv_store, kernels, common     (the engine every worker runs)
    prefill_worker   -> engine, kv_store, kernels, common
    decode_worker    -> engine, kv_store, kernels, common   (never prefill_worker, nor it decode_worker)
    router           -> kernels.model.tokenizer, common
    cluster          -> anything                     (the top layer: serve, worker_host, cli, bench, train)

Nothing below the top layer imports `cluster`. Within a layer, no two modules import each other
(directly or round a longer path), and no module is over 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("common", "kernels", "kv_store", "engine", "prefill_worker", "decode_worker", "router", "cluster")

ALLOWED: dict[str, tuple[str, ...]] = {
    "common": ("common",),
    "kernels": ("kernels", "common"),
    "kv_store": ("kv_store", "kernels", "common"),
    "engine": ("engine", "kv_store", "kernels", "common"),
    "prefill_worker": ("prefill_worker", "engine", "kv_store", "kernels", "common"),
    "decode_worker": ("decode_worker", "engine", "kv_store", "kernels", "common"),
    # the router runs in the gateway process: text helpers without torch, the wire vocabulary, and
    # the transport's config (no engine, no torch)
    "router": ("router", "kernels.model.tokenizer", "common"),
    "cluster": PACKAGES,
}


def layer_of_module(dotted: str) -> str | None:
    """The layer a module name belongs to, or None when it is not tandem's."""
    head = dotted.partition(".")[0]
    return head if head in PACKAGES else None


def allowed(importer: str, imported: str) -> bool:
    """May module `importer` (dotted) import module `imported` (dotted)?"""
    target_layer = layer_of_module(imported)
    if target_layer is None:
        return True
    for entry in ALLOWED[layer_of_module(importer)]:
        if "." not in entry:
            if entry == target_layer:
                return True
        elif imported == entry or imported.startswith(entry + "."):
            return True
    return False


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import in the file, wherever it sits; relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` may name a sub-module: check the most specific name
            found += [(node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
                      for alias in node.names]
    return sorted(set(found))


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations() -> list[str]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            importer = _module_name(path)
            for line, imported in imports_of(path):
                if not allowed(importer, imported):
                    out.append(f"{path.relative_to(ROOT)}:{line}: {layer_of_module(importer)} may not import "
                               f"{imported} ({layer_of_module(imported)})")
    return out


def test_every_import_follows_the_one_way_rule():
    found = violations()
    assert not found, "upward imports (docs/design.md §1):\n" + "\n".join(found)


@pytest.mark.parametrize("importer, imported, ok", [
    ("kv_store.page_pool", "kernels.kv_layout", True),
    ("kernels.sampling", "kv_store.page_pool", False),
    ("kernels.sampling", "common.config", True),
    ("common.protocol", "common.config", True),
    ("common.config", "kv_store.transfer.session", False),
    ("prefill_worker.worker", "cluster.serve.config", False),  # cluster is the top layer
    ("common.protocol", "kernels.kv_layout", False),  # the vocabulary stands on nothing
    ("cluster.serve.launch", "router.dispatcher", True),
    ("router.gateway.app", "kernels.model.tokenizer", True),
    ("router.gateway.app", "kernels.model.loader", False),  # torch and the model stay out of the gateway
    ("decode_worker.worker", "engine", True),
    ("decode_worker.worker", "prefill_worker.sender", False),  # the roles share the engine, not each other
    ("engine.core", "prefill_worker.worker", False),
    ("prefill_worker.worker", "decode_worker.worker", False),
])
def test_the_rule_itself(importer, imported, ok):
    assert allowed(importer, imported) is ok


def test_an_injected_upward_import_is_named_with_its_line(tmp_path, monkeypatch):
    """The walker finds a function-level upward import and names file:line."""
    module = ROOT / "kernels" / "_layering_probe.py"
    module.write_text("def f():\n    import os\n    from router import dispatcher\n", encoding="utf-8")
    try:
        found = violations()
    finally:
        module.unlink()
    assert "kernels/_layering_probe.py:3: kernels may not import router.dispatcher (router)" in found


# third-party packages that one place alone may import (docs/design.md §1)
# ray: the serving cluster, and the load bench's client actors (`tandem bench serve --num-clients`)
CONFINED = {"ray": ("cluster/serve/", "cluster/bench/load/multinode.py"), "fastapi": ("router/gateway/",),
            "uvicorn": ("router/gateway/",), "mooncake": ("kv_store/transfer/mooncake.py",),
            "redis": ("kv_store/l3/redis_store.py", "kv_store/l3/redis_process.py")}


def test_confined_packages_are_imported_in_their_one_place():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            for line, imported in imports_of(path):
                owners = CONFINED.get(imported.split(".")[0])
                if owners and not where.startswith(owners):
                    found.append(f"{where}:{line}: imports {imported} (only {', '.join(owners)} may)")
    assert not found, "\n".join(found)


# ---- the connector seam (docs/design.md §1): a connector gets data, never the engine ---------------
ENGINE_CORE = "engine.core"
CONNECTOR_BASES = {"KVConnector", "NullConnector"}


def connector_modules() -> list[Path]:
    """The seam's own module and every module defining a class on a connector base."""
    found = [ROOT / "engine" / "connector.py"]
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if path not in found and any(isinstance(node, ast.ClassDef) and {
                    base.id for base in node.bases if isinstance(base, ast.Name)} & CONNECTOR_BASES
                    for node in ast.walk(tree)):
                found.append(path)
    return found


def engine_holdings(path: Path) -> list[str]:
    """Where a module imports the engine core or names `EngineCore` (an annotation, an attribute)."""
    where = str(path.relative_to(ROOT))
    out = [f"{where}:{line}: imports {imported}" for line, imported in imports_of(path)
           if imported == ENGINE_CORE or imported.startswith(ENGINE_CORE + ".")]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        named = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                 else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else "")
        if named == "EngineCore" or (isinstance(node, ast.Attribute) and node.attr == "engine"):
            out.append(f"{where}:{node.lineno}: names {named or 'engine'}")
    return out


def test_connectors_neither_import_nor_hold_the_engine():
    modules = connector_modules()
    names = {str(path.relative_to(ROOT)) for path in modules}
    assert {"prefill_worker/sender.py", "decode_worker/receiver.py"} <= names, f"connectors found: {names}"
    found = [hit for path in modules for hit in engine_holdings(path)]
    assert not found, "a connector reaches into the engine (docs/design.md §1):\n" + "\n".join(found)


def test_a_connector_holding_the_engine_is_named_with_its_line():
    module = ROOT / "decode_worker" / "_seam_probe.py"
    module.write_text("from engine.connector import NullConnector\n\n\n"
                      "class Probe(NullConnector):\n    def attach(self, ports):\n        self.engine = ports\n",
                      encoding="utf-8")
    try:
        found = [hit for path in connector_modules() for hit in engine_holdings(path)]
    finally:
        module.unlink()
    assert found == ["decode_worker/_seam_probe.py:6: names engine"]


# ---- rooms stay readable: no two modules import each other, no module over 400 lines (docs/design.md §1)

MAX_MODULE_LINES = 400


def module_graph() -> dict[str, set[str]]:
    """Each tandem module -> the tandem modules it imports (every import, function-level ones too)."""
    graph = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = _module_name(path)
            graph[name] = {m for _, m in imports_of(path) if layer_of_module(m) and m != name and _is_module(m)}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another, directly or round a longer path (Tarjan's
    strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_modules_import_each_other():
    circles = import_circles(module_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_an_injected_import_circle_is_named():
    probes = [ROOT / "kernels" / "_circle_a.py", ROOT / "kernels" / "_circle_b.py", ROOT / "kernels" / "_circle_c.py"]
    for path, other in zip(probes, probes[1:] + probes[:1]):  # a -> b -> c -> a
        path.write_text(f"def f():\n    from kernels import {other.stem}\n", encoding="utf-8")
    try:
        circles = import_circles(module_graph())
    finally:
        for path in probes:
            path.unlink()
    assert circles == [["kernels._circle_a", "kernels._circle_b", "kernels._circle_c"]]


def test_no_module_is_over_400_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split along a seam):\n" + "\n".join(long)
