"""The roles' workers at their edge: which message kinds each takes (one table a role), how a fault
while handling one is answered, how the roles relate, and the rule that keeps workers out of the
engine's parts (they ask the engine, never its scheduler or caches)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from cluster.worker_host.build import make_worker
from common import protocol as p
from common.config import EngineConfig, SamplingParams
from decode_worker.worker import ClientWorker, ColocatedWorker, DecodeWorker
from engine.core import EngineCore
from engine.request import FinishReason, Request
from engine.stop import StopRules
from engine.worker_base import EngineWorker
from kv_store.transfer.local import LocalTransport
from prefill_worker.worker import PrefillWorker
from tests.helpers import tiny_models

ROOT = Path(__file__).resolve().parents[3]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
CLIENT_KINDS = {p.Generate, p.OpenSession, p.CloseSession, p.Abort}
FROM_PREFILL = {p.KVProgress, p.KVComplete, p.TransferAborted}


@pytest.fixture
def workers():
    """{role: worker} for the three roles, each over a tiny model and its own LocalTransport."""
    ours, _, arch = tiny_models()
    built = {}
    for role in ("prefill", "decode", "colocated"):
        transport = LocalTransport()
        built[role] = (make_worker(role, EngineConfig(page_size=4, num_pages=32), ours, arch, transport,
                                   host_pages=16), transport)
    yield {role: worker for role, (worker, _) in built.items()}
    for worker, transport in built.values():
        worker.check_integrity()
        worker.close()
        transport.close()


def test_each_role_takes_exactly_its_message_kinds():
    assert set(ColocatedWorker.HANDLERS) == CLIENT_KINDS | {p.PeerDead}
    assert set(DecodeWorker.HANDLERS) == CLIENT_KINDS | FROM_PREFILL | {p.Reserve, p.PeerDead}
    assert set(PrefillWorker.HANDLERS) == {p.Prefill, p.PrefillAnswer, p.AbortTransfer, p.PeerDead}
    for role in (ColocatedWorker, DecodeWorker, PrefillWorker):
        assert set(role.HANDLERS) <= set(p.ToWorker.__args__), role
        assert set(role.FAULTS) <= set(p.AboutRequest.__args__), role


def test_the_client_roles_are_siblings_not_parent_and_child():
    """A decode worker is not a kind of colocated worker: both serve clients; the decode worker adds landings."""
    assert not issubclass(DecodeWorker, ColocatedWorker) and not issubclass(ColocatedWorker, DecodeWorker)
    assert DecodeWorker.__bases__ == ColocatedWorker.__bases__ == (ClientWorker,)
    assert ClientWorker.__bases__ == PrefillWorker.__bases__ == (EngineWorker,)


@pytest.mark.parametrize("role, msg", [
    ("colocated", p.Reserve("r", (1, 2), PARAMS, "prefill-0")),
    ("colocated", p.KVProgress("r", 1)),
    ("decode", p.Prefill("r", (1, 2), PARAMS, None)),
    ("prefill", p.Generate("r", (1, 2), PARAMS)),
    ("prefill", p.Abort("r")),
])
def test_a_kind_the_role_does_not_take_is_a_type_error_naming_both(workers, role, msg):
    with pytest.raises(TypeError, match=f"^a {role} worker cannot handle {type(msg).__name__}$"):
        workers[role].handle(msg)


def test_a_peer_dead_is_nothing_to_a_colocated_worker(workers):
    assert workers["colocated"].handle(p.PeerDead("prefill-0")) == []


def test_a_failed_reservation_is_answered_twice_and_a_failed_generate_once(workers):
    """The client hears an internal error; the dispatcher, which waits for a reservation's answer, hears it too."""
    decode, colocated = workers["decode"], workers["colocated"]
    internal = p.TokenOutput("r", (), p.FinishReason.ABORT, "boom", failure=p.Failure.INTERNAL)
    assert decode.fail(p.Reserve("r", (1, 2), PARAMS, "prefill-0"), "boom") == [internal, p.Reserved("r", None, "boom")]
    assert decode.fail(p.Generate("r", (1, 2), PARAMS), "boom") == [internal]
    assert colocated.fail(p.Generate("r", (1, 2), PARAMS), "boom") == [internal]


def test_a_failed_prefill_aborts_its_transfer_and_a_failed_answer_tells_nobody(workers):
    prefill = workers["prefill"]
    assert prefill.fail(p.PrefillAnswer("answer", (1, 2, 3, 4, 5), 2), "boom") == []
    assert prefill.sender.outbox == []  # nobody waits for an answer's prefill
    assert prefill.fail(p.Prefill("r", (1, 2), PARAMS, None), "boom") == []
    assert prefill.sender.outbox == [p.TransferAborted("r", "boom", p.Failure.INTERNAL)]


def arrived(max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop_token_ids)
    return Request("a", [1, 2, 3], params, stop_rules=StopRules(params, frozenset(), None, 1_000))


def test_an_arrived_first_token_goes_through_the_stop_rules_as_a_sampled_one():
    going = arrived(max_tokens=4)
    assert EngineCore.accept_first_token(going, 7, None, ()) is None and going.output_token_ids == [7]
    assert "first_token" not in going.timings  # the prefill worker computed it, not this engine
    assert EngineCore.accept_first_token(arrived(max_tokens=1), 7, None, ()) is FinishReason.LENGTH
    assert EngineCore.accept_first_token(arrived(max_tokens=4, stop_token_ids=(7,)), 7, None, ()) is FinishReason.STOP


WORKER_SOURCES = ["decode_worker", "prefill_worker", "engine/worker_base.py", "cluster/worker_host"]
BENCH_SOURCES = ["cluster/bench"]  # the in-process benchmarks drive an `EngineCore` the same way
FROZEN_PARTS = ("config", "arch")  # frozen values fixed at build (`EngineConfig`, `LlamaArch`): read freely


def engine_reach_ins(path: Path) -> list[str]:
    """`engine.a.b` chains (the engine a worker holds, `engine`, `self.engine` or `worker.engine`, then
    two attributes), but its frozen config's and model shape's fields."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
            continue
        held = node.value.value
        if node.value.attr in FROZEN_PARTS:
            continue
        if (isinstance(held, ast.Name) and held.id == "engine") or (
                isinstance(held, ast.Attribute) and held.attr == "engine" and isinstance(held.value, ast.Name)
                and held.value.id in ("self", "worker")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return found


def sources(names: list[str]) -> list[Path]:
    """The modules of `names`: files as given, folders walked to the bottom."""
    return [f for source in names
            for f in ([ROOT / source] if source.endswith(".py") else sorted((ROOT / source).rglob("*.py")))]


@pytest.mark.parametrize("names", [WORKER_SOURCES, BENCH_SOURCES], ids=["workers", "benches"])
def test_workers_and_benches_ask_the_engine_and_never_reach_into_its_parts(names):
    """A worker or a benchmark calls `EngineCore`'s own methods (`has_compute`, `cached_prefix_len`,
    `tier_stats`, `occupancy`...); a chain like `engine.kvm.prefix_cache` ties it to how the engine is built."""
    files = sources(names)
    assert len(files) > 5
    assert [hit for f in files for hit in engine_reach_ins(f)] == []


def test_a_reach_in_is_named_with_its_line(tmp_path, monkeypatch):
    """The walker names a chain through a part, and lets the frozen config and arch be read."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    probe = tmp_path / "probe.py"
    probe.write_text("def f(engine):\n    return engine.config.dtype, engine.arch.vocab_size, engine.kvm.pool\n")
    assert engine_reach_ins(probe) == ["probe.py:2 engine.kvm.pool"]
