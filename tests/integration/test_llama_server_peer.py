"""llama.cpp's `llama-server` as `tandem bench llamacpp` runs it, and the load harness against it.

Skipped unless a llama-server binary is found the bench's way (`$TANDEM_LLAMA_SERVER`, else
`llama-server` on PATH): it is a bench-only tool, never a tandem dependency. One server (the bundled
SmolLM2 as f32, 8 slots, the bench's fair CPU flags) serves the module. llama-server closes each
connection after a streamed response, so the harness's pooled connections race its closes: both
clients must still get every request answered, each with its exact length (`ignore_eos`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster.bench.llamacpp_gguf import ensure_gguf
from cluster.bench.llamacpp_peers import LlamaServerPeer, find_llama_server, wait_peer_ready
from cluster.bench.load.client import LoadShape, Target, run_client
from cluster.bench.load.datasets import SampleRequest

pytestmark = pytest.mark.slow

NUM_SLOTS = 8


@pytest.fixture(scope="module")
def llama_server():
    try:
        binary = find_llama_server(None)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    peer = LlamaServerPeer(binary, [])
    server = peer.start(ensure_gguf(), threads=2, num_slots=NUM_SLOTS, tokens_per_sequence=64)
    try:
        wait_peer_ready(peer, server, 300)
        yield peer, server
    finally:
        assert server.stop() == 0


def test_its_tokenizer_gives_tandems_ids(llama_server):
    from kernels.model.loader import resolve_model_dir
    from kernels.model.tokenizer import load_tokenizer

    peer, server = llama_server
    text = " The KV cache holds keys and values of every token seen so far."
    tokenizer = load_tokenizer(resolve_model_dir("smollm2"))
    assert peer.token_ids(server.url, text) == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("client", ("aiohttp", "httpx"))
def test_the_harness_gets_every_request_answered_with_its_exact_length(llama_server, client):
    _, server = llama_server
    rng = np.random.default_rng(0)
    jobs = [SampleRequest(i, tuple(int(t) for t in rng.integers(1000, 40000, size=16)), 16, 4) for i in range(24)]
    target = Target(server.url, ignore_eos=True, http_library=client)
    run = asyncio.run(run_client(target, jobs, LoadShape(max_concurrency=NUM_SLOTS)))

    errors = [o.error for o in run.outputs if not o.success]
    assert errors == [], f"{len(errors)} failed, {run.num_retries} retried: {errors[:3]}"
    assert [o.output_tokens for o in run.outputs] == [4] * 24, "ignore_eos: every stream has its exact length"
    assert [o.prompt_len for o in run.outputs] == [16] * 24
