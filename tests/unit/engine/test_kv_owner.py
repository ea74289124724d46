"""One owner for a request's device KV (docs/design.md §1): inside the workers' packages only the
scheduler calls `KVManager`'s request methods, and only it (with the sessions it owns and the engine
that builds both) holds a `KVManager`. Walked over the AST as `test_layering.py` walks imports, with
`file:line` for every violation; the engine commits through `Scheduler.commit`, the speculator
reserves draft slots through `Scheduler.reserve_draft_slots`, a connector gets it as `ConnectorKV`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
WORKER_PACKAGES = ("engine", "prefill_worker", "decode_worker")
OWNER = "engine/scheduler.py"
HOLDERS = (OWNER, "engine/sessions.py", "engine/core.py")
REQUEST_METHODS = {"open", "try_open", "match_prefix", "try_allocate", "commit", "cache_unfinished", "free_tail",
                   "drop_behind", "release", "pin_for_transfer", "unpin_transfer", "lent_pages"}


def kv_manager_methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse((ROOT / "kv_store" / "kv_manager.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVManager")
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def test_the_request_methods_are_every_method_that_takes_or_makes_a_request_kv():
    methods = kv_manager_methods()
    about_requests = {name for name, fn in methods.items()
                      if "ReqKV" in ast.unparse(fn.args)
                      or (fn.returns is not None and "ReqKV" in ast.unparse(fn.returns))}
    assert REQUEST_METHODS <= set(methods), f"not KVManager methods: {REQUEST_METHODS - set(methods)}"
    assert about_requests - {"unpin_transfer"} <= REQUEST_METHODS, (
        f"KVManager methods about a request's KV missing from REQUEST_METHODS: {about_requests - REQUEST_METHODS}")


def violations(root: Path = ROOT) -> list[str]:
    """Request-method calls on a `kvm` outside the owner, and `KVManager`s held outside the holders."""
    out = []
    for package in WORKER_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            where = str(path.relative_to(root))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in REQUEST_METHODS and _names_kvm(node.func.value) and where != OWNER):
                    out.append(f"{where}:{node.lineno}: calls KVManager.{node.func.attr} (only {OWNER} may)")
                elif isinstance(node, ast.arg) and node.annotation is not None and where not in HOLDERS \
                        and "KVManager" in ast.unparse(node.annotation):
                    out.append(f"{where}:{node.lineno}: takes a KVManager ({node.arg})")
    return out


def _names_kvm(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kvm") or (isinstance(node, ast.Attribute) and node.attr == "kvm")


def test_only_the_scheduler_calls_request_methods_of_the_kv_manager():
    found = violations()
    assert not found, "request KV touched outside its owner:\n" + "\n".join(found)


def test_a_call_from_another_module_is_named_with_its_line(tmp_path):
    for package in WORKER_PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "prefill_worker" / "spec.py").write_text(
        "def draft(req, kvm):\n    return kvm.try_allocate(req.kv, 3)\n\n\n"
        "def hold(manager: KVManager):\n    pass\n", encoding="utf-8")
    (tmp_path / "decode_worker" / "recv.py").write_text("def load(self):\n    self.engine.kvm.commit(None, 1)\n",
                                                         encoding="utf-8")
    assert violations(tmp_path) == [
        f"prefill_worker/spec.py:2: calls KVManager.try_allocate (only {OWNER} may)",
        "prefill_worker/spec.py:5: takes a KVManager (manager)",
        f"decode_worker/recv.py:2: calls KVManager.commit (only {OWNER} may)",
    ]
