"""The CUDA-graph path of the decode runner with the Triton backend, on the CPU: a stand-in for
`torch.cuda.CUDAGraph` freezes what a capture freezes, the metadata built at capture (capacity
lengths: what sizes the kernels' grids and splits on the host) and the output tensors, and each
replay re-runs the captured body over the refilled static buffers and writes into those outputs.
So a replay that depends on host values of the step it replays (lengths, splits, a batch size), or
reads a buffer the runner did not refill, gives other tokens than the eager engine: the part of a
GPU run that is about the runner, not the device, checked here under the Triton interpreter."""

from __future__ import annotations

import contextlib

import pytest
import torch

import engine.graphs.runner as graph_runner
from common.config import EngineConfig, SamplingParams
from engine import build_engine
from engine.runner import ForwardOut
from kernels.model.tiny import make_tiny_llama
from tests.helpers import make_prompts


class StandInGraph:
    """What `torch.cuda.graph` would have captured: `body` over the capture's metadata, writing
    into the outputs the capture returned."""

    def __init__(self, body, meta, out: ForwardOut):
        self.body, self.meta, self.out = body, meta, out
        self.replays = 0

    def replay(self) -> None:
        new = self.body(self.meta)
        with torch.inference_mode():  # the outputs are the capture's (inference) tensors, written in place
            for dst, src in ((self.out.logits, new.logits), (self.out.hidden, new.hidden), (self.out.aux, new.aux)):
                if dst is not None:
                    dst.copy_(src)
        self.replays += 1

    def pool(self) -> None:
        return None


def capture_standin(body, make_meta, backend, device, pool):
    for _ in range(2):  # the warm-ups a capture runs
        body(make_meta())
    meta = make_meta()
    backend.prepare_graph_decode(meta)
    out = body(meta)
    return StandInGraph(body, meta, out), out


@contextlib.contextmanager
def standin_capture(monkeypatch):
    monkeypatch.setattr(graph_runner, "capture_graph", capture_standin)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield


def test_triton_decode_replays_from_captured_metadata_give_the_eager_engines_tokens(monkeypatch):
    model, _ = make_tiny_llama(7, num_hidden_layers=2)
    prompts = make_prompts(3, min_len=5, max_len=23, seed=4)  # lengths cross the 16-token Triton tiles
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 6, 11)]
    reference = build_engine(EngineConfig(page_size=4, num_pages=64, chunk_size=32, debug_kv=True,
                                          attention_backend="torch", cuda_graph=False), model, model.arch)
    try:
        expected = [r.output_token_ids for r in reference.generate(prompts, params)]
        reference.check_integrity()
    finally:
        reference.close()
    config = EngineConfig(page_size=4, num_pages=64, chunk_size=32, debug_kv=True, attention_backend="triton",
                          cuda_graph=True, graph_batch_sizes=(1, 2, 4), max_running_requests=4, max_model_len=64,
                          cpu_native_decode=False)
    engine = build_engine(config, model, model.arch)
    try:
        runner = engine.runner
        with standin_capture(monkeypatch):
            runner._capture_all()  # what a CUDA device does at start-up
        assert sorted(runner._graphs) == [1, 2, 4] and model.backend.name == "triton"
        captured_lens = {b: g.graph.meta.seq_lens_cpu for b, g in runner._graphs.items()}
        assert all(lens == (16 * 4,) * b for b, lens in captured_lens.items())  # capacity, not a step's
        got = [r.output_token_ids for r in engine.generate(prompts, params)]
        replays = sum(g.graph.replays for g in runner._graphs.values())
        assert runner.counters.replays == replays >= 8, (runner.counters, replays)
        assert got == expected
        engine.check_integrity()
    finally:
        engine.close()
