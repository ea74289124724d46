"""Disaggregated serving across real processes: prefill and decode workers over Mooncake TCP on
127.0.0.1, with SmolLM2-135M-Instruct. Workers are started and stopped by the tests."""

import json
import random
import time

import pytest

from cluster.config import EngineConfig, SamplingParams
from cluster.worker_host.pair import ProcessPair, RequestFailure
from kv_store.transfer.session import TransferDeadlines
from tests.helpers import CHAT_PROMPTS, greedy, hf_greedy, make_smollm2_engine, smollm2

pytestmark = pytest.mark.slow
MAX_NEW = 16


def apply_chat(prompt):
    from kernels.model.tokenizer import apply_chat_template

    return apply_chat_template(smollm2()[0].tokenizer, prompt)


@pytest.fixture(scope="module")
def chat_ids():
    return [apply_chat(p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(chat_ids):
    loaded, ref = smollm2()
    return [hf_greedy(ref, ids, MAX_NEW, eos_token_id=list(loaded.eos_token_ids)) for ids in chat_ids]


def long_prompt(num_words=900):
    rng = random.Random(3)
    words = ["cache", "page", "token", "prefill", "decode", "memory", "transfer", "engine", "request", "layer"]
    return apply_chat("Summarize: " + " ".join(rng.choice(words) for _ in range(num_words)))


def wait_for(pair, role, predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = pair.stats(role)
        if predicate(stats):
            return stats
    raise AssertionError(f"{role}: {what} not reached within {timeout_s}s; last stats {stats}")


def at_rest(stats) -> bool:
    host_ok = stats.host is None or stats.host.free == stats.host.total
    return (stats.device.private == 0 and stats.device.in_flight == 0 and stats.num_transfers == 0
            and host_ok and not stats.integrity_error)


@pytest.fixture
def make_pair():
    pairs = []

    def make(page_size=16, chunk_size=32, deadlines=None, num_pages=1024, host_pages=1024, heartbeat_timeout_s=5.0):
        config = EngineConfig(page_size=page_size, chunk_size=chunk_size, num_pages=num_pages, debug_kv=True)
        pair = ProcessPair(config, host_pages=host_pages, deadlines=deadlines, heartbeat_timeout_s=heartbeat_timeout_s)
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_disaggregated_equals_colocated_equals_hf(make_pair, chat_ids, hf_outputs, page_size):
    chunk = 32
    assert max(map(len, chat_ids)) >= 3 * chunk  # the longest prompt takes >= 3 chunks
    pair = make_pair(page_size=page_size, chunk_size=chunk)
    results = pair.generate(chat_ids, greedy(max_tokens=MAX_NEW))
    colocated = make_smollm2_engine(page_size=page_size, chunk_size=chunk).generate(chat_ids, greedy(max_tokens=MAX_NEW))
    assert [r.token_ids for r in results] == [r.output_token_ids for r in colocated] == hf_outputs
    assert all(not r.error for r in results)
    for role in ("prefill", "decode"):
        wait_for(pair, role, at_rest, 10, "pools at rest")


def test_kill_decode_mid_transfer_prefill_releases_everything(make_pair):
    pair = make_pair(chunk_size=32, deadlines=TransferDeadlines(transferring_s=10), heartbeat_timeout_s=3)
    req = pair.submit("long", long_prompt(), greedy(max_tokens=4))
    wait_for(pair, "prefill", lambda s: s.num_transfers == 1 and s.device.private + s.device.in_flight > 0, 60,
             "a transfer in progress")
    pair.kill("decode")
    stats = wait_for(pair, "prefill", at_rest, 30, "all pages FREE or CACHED after the decode worker died")
    assert stats.device.free + stats.device.cached == stats.device.total
    assert req.done and req.failure is RequestFailure.WORKER_DIED


def test_kill_prefill_mid_transfer_decode_frees_landing_and_keeps_serving(make_pair, chat_ids, hf_outputs):
    pair = make_pair(chunk_size=32, deadlines=TransferDeadlines(transferring_s=10), heartbeat_timeout_s=3)
    req = pair.submit("long", long_prompt(), greedy(max_tokens=4))
    wait_for(pair, "decode", lambda s: s.num_transfers == 1 and s.host.in_flight > 0, 60, "a landing being written")
    pair.kill("prefill")
    deadline = time.monotonic() + 30
    while not req.done and time.monotonic() < deadline:
        pair.pump(0.1)
    assert req.done and req.failure is RequestFailure.TRANSFER and "peer_dead" in req.error
    wait_for(pair, "decode", at_rest, 30, "landing pages freed")
    [after] = pair.generate([chat_ids[1]], greedy(max_tokens=MAX_NEW))  # served by the decode worker alone
    assert after.token_ids == hf_outputs[1] and not after.error
    wait_for(pair, "decode", at_rest, 10, "pools at rest")


def test_stall_trips_deadline_and_both_sides_end_clean(make_pair, chat_ids, hf_outputs):
    deadlines = TransferDeadlines(waiting_s=1.5, transferring_s=1.5)
    pair = make_pair(chunk_size=32, deadlines=deadlines, heartbeat_timeout_s=10)
    pair.stall("prefill", 4.0)  # a slow peer: stops stepping (and writing) for longer than the deadline
    req = pair.submit("stalled", chat_ids[4], greedy(max_tokens=4))
    deadline = time.monotonic() + 30
    while not req.done and time.monotonic() < deadline:
        pair.pump(0.1)
    assert req.done and req.failure is RequestFailure.TRANSFER and "timeout" in req.error
    for role in ("prefill", "decode"):
        wait_for(pair, role, at_rest, 30, "pools at rest after the timeout")
    [after] = pair.generate([chat_ids[1]], greedy(max_tokens=MAX_NEW))
    assert after.token_ids == hf_outputs[1]


def test_200_random_requests_with_aborts_leak_nothing(make_pair):
    rng = random.Random(11)
    pair = make_pair(page_size=16, chunk_size=256, num_pages=1 + 4096 // 16, host_pages=1 + 2048 // 16)
    vocab = smollm2()[0].arch.vocab_size
    submitted = []
    for i in range(200):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randrange(4, 48))]
        submitted.append(pair.submit(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 6), ignore_eos=True)))
        if rng.random() < 0.3:
            pair.pump(0.0)
        live = [r for r in submitted if not r.done]
        if live and rng.random() < 0.2:
            pair.abort(rng.choice(live).request_id)
    deadline = time.monotonic() + 300
    while pair.busy() and time.monotonic() < deadline:
        pair.pump(0.05)
    assert not pair.busy()
    assert sum(r.finish_reason == "abort" for r in submitted) >= 20
    assert all(len(r.token_ids) == r.params.max_tokens for r in submitted if r.finish_reason != "abort")
    assert not any(r.failure for r in submitted), [r.error for r in submitted if r.failure][:3]
    for role in ("prefill", "decode"):
        wait_for(pair, role, at_rest, 30, "no page leaked")


def test_cli_disaggregated_json_equals_colocated(capsys):
    from cluster.cli.main import main

    args = ["run", "--prompt", CHAT_PROMPTS[1], "--prompt", CHAT_PROMPTS[2], "--max-tokens", str(MAX_NEW),
            "--num-pages", "256", "--host-pages", "256", "--json"]
    assert main(args) == 0
    colocated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main(args + ["--mode", "disaggregated"]) == 0
    disaggregated = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(colocated) == 2 and disaggregated == colocated


def test_decode_kv_is_byte_identical_to_prefill_kv_over_mooncake(make_pair):
    pair = make_pair(page_size=16, chunk_size=64)
    prompt = long_prompt(150)
    [res] = pair.generate([prompt], greedy(max_tokens=4))
    assert not res.error
    full_pages = len(prompt) // 16
    assert full_pages >= 8
    prefill, decode = pair.kv_digest("prefill", prompt, full_pages), pair.kv_digest("decode", prompt, full_pages)
    assert prefill.num_pages == decode.num_pages == full_pages
    assert prefill.sha256 and prefill.sha256 == decode.sha256
    other = pair.kv_digest("prefill", long_prompt(150)[:16] + [7] * 16 * (full_pages - 1), full_pages)
    assert other.sha256 == ""  # a prefix nobody computed is not found: the digest is not vacuous
