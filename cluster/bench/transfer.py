"""`tandem bench transfer`: raw Mooncake write bandwidth vs KV moved through tandem, and a TTFT breakdown.

For each prompt length L:
- raw: the same bytes as L tokens of KV, written between two processes with the transport alone,
  in the op sizes tandem's layer-first layout produces (one op per layer tensor per chunk) and,
  for comparison, one op per whole page (what a page-first layout would produce);
- through tandem: the prompt is prefilled once (warming the prefill worker's prefix cache), then
  sent again: nearly all of its KV ships in one go, so first write -> last write retired is the
  transfer path alone (page gathering, ops, polling, retire);
- TTFT breakdown of the cold run: queue (reserve + dispatch), prefill compute, exposed transfer
  (after compute ends), KV-complete notice to the client; and the host->device load (which the
  second token waits for, not the first: the first is streamed on KV-complete).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import random
from dataclasses import asdict, dataclass

log = logging.getLogger("tandem.bench")


@dataclass(frozen=True)
class TransferRow:
    prompt_tokens: int
    kv_bytes: int
    raw_layer_first_gbps: float
    raw_page_first_gbps: float
    tandem_gbps: float
    ttft_s: float
    queue_s: float
    prefill_compute_s: float
    transfer_exposed_s: float
    notice_s: float
    load_s: float

    @property
    def tandem_over_raw(self) -> float:
        return self.tandem_gbps / self.raw_layer_first_gbps

    @property
    def transfer_share_of_ttft(self) -> float:
        return self.transfer_exposed_s / self.ttft_s


def _receiver(num_bytes: int, conn) -> None:
    """Child process: a registered buffer that the parent writes into."""
    import torch

    from kv_store.transfer.mooncake import MooncakeTransport

    buf = torch.zeros(num_bytes, dtype=torch.uint8)
    with MooncakeTransport("127.0.0.1") as transport, transport.register_tensor(buf):
        conn.send((transport.session_id, buf.data_ptr()))
        conn.recv()  # wait for "done"


def measure_raw(num_bytes: int, op_sizes: list[int], repeats: int = 3) -> list[float]:
    """Raw Mooncake write GB/s between two processes, for each op size, over `num_bytes`."""
    import torch

    from kv_store.transfer.bandwidth import measure_write_bandwidth
    from kv_store.transfer.mooncake import MooncakeTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(num_bytes, child), daemon=True)
    proc.start()
    try:
        peer, dst = parent.recv()
        src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
        with MooncakeTransport("127.0.0.1") as transport, transport.register_tensor(src):
            return [measure_write_bandwidth(transport, peer, src.data_ptr(), dst, num_bytes // op * op, op,
                                            repeats).bytes_per_s / 1e9 for op in op_sizes]
    finally:
        parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab) for _ in range(length)]


def measure_through_tandem(views, length: int, vocab: int, seed: int) -> tuple[dict, dict]:
    """(cold timings, warm timings) of one prompt of `length` tokens through the dispatcher over
    the worker processes (worker timestamps and the client's, all `time.monotonic()` of this host)."""
    import asyncio

    from cluster.worker_host.process import serve_prompts
    from common.config import SamplingParams

    params = SamplingParams(max_tokens=2, ignore_eos=True)  # 2: the second token needs the host->device load
    prompt = _prompt(length, vocab, seed)
    runs = []
    for attempt in ("cold", "warm"):
        [req] = asyncio.run(serve_prompts(views, [prompt], params, id_prefix=f"bench-{length}-{seed}-{attempt}"))
        if req.error:
            raise RuntimeError(f"benchmark request failed: {req.error}")
        runs.append({**req.timings, "submitted": req.submitted_s, "first_token": req.first_token_s})
    return runs[0], runs[1]


def bench_transfer(args: argparse.Namespace) -> int:
    from cluster.cli.args import engine_config_from_args
    from cluster.worker_host.process import ProcessViews, pair_specs
    from kernels.kv_layout import kv_layout

    config = engine_config_from_args(args)
    from transformers import AutoConfig

    from kernels.model.arch import LlamaArch
    from kernels.model.loader import resolve_model_dir

    arch = LlamaArch.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(config.model)))
    lengths = [min(n, arch.max_position_embeddings - 2) for n in args.prompt_tokens]  # room for 2 tokens
    layout = kv_layout(arch.num_layers, config.page_size, arch.num_kv_heads, arch.head_dim, config.dtype)
    per_page, tensor_page = layout.page_bytes, layout.page_bytes_per_tensor
    max_pages = -(-max(lengths) // config.page_size)
    rows = []
    with ProcessViews(pair_specs(config, None, host_pages=max_pages * 2 + 8)) as views:
        for i, length in enumerate(lengths):
            pages = -(-length // config.page_size)
            kv_bytes = pages * per_page
            chunk_pages = min(pages, max(1, config.chunk_size // config.page_size))
            raw_lf, raw_pf = measure_raw(kv_bytes, [chunk_pages * tensor_page, per_page])
            cold, warm = measure_through_tandem(views, length, arch.vocab_size, seed=args.seed + i)
            rows.append(_row(length, kv_bytes, raw_lf, raw_pf, cold, warm))
            log.info("done %d tokens", length)
    print_table(rows, args.json)
    return 0


def _row(length, kv_bytes, raw_lf, raw_pf, cold, warm) -> TransferRow:
    tandem_s = warm["transfer_done"] - warm["first_write"]
    return TransferRow(
        prompt_tokens=length, kv_bytes=kv_bytes, raw_layer_first_gbps=raw_lf, raw_page_first_gbps=raw_pf,
        tandem_gbps=kv_bytes / tandem_s / 1e9, ttft_s=cold["first_token"] - cold["submitted"],
        queue_s=cold["prefill_submitted"] - cold["submitted"],
        prefill_compute_s=cold["compute_done"] - cold["prefill_submitted"],
        transfer_exposed_s=cold["transfer_done"] - cold["compute_done"],
        notice_s=cold["first_token"] - cold["transfer_done"], load_s=cold["load_done"] - cold["load_start"])


def print_table(rows: list[TransferRow], as_json: bool) -> None:
    head = (f"{'tokens':>7}{'KV MiB':>8}{'raw LF GB/s':>12}{'raw PF GB/s':>12}{'tandem GB/s':>12}{'tandem/raw':>11}"
            f"{'TTFT s':>8}{'queue':>7}{'compute':>8}{'xfer':>7}{'notice':>8}{'load':>7}{'xfer%':>7}")
    print(head)
    for r in rows:
        print(f"{r.prompt_tokens:>7}{r.kv_bytes / 2**20:>8.1f}{r.raw_layer_first_gbps:>12.2f}"
              f"{r.raw_page_first_gbps:>12.2f}{r.tandem_gbps:>12.2f}{r.tandem_over_raw:>10.0%} {r.ttft_s:>7.2f}"
              f"{r.queue_s:>7.3f}{r.prefill_compute_s:>8.2f}{r.transfer_exposed_s:>7.3f}{r.notice_s:>8.3f}{r.load_s:>7.3f}"
              f"{r.transfer_share_of_ttft:>7.1%}")
    print("raw LF: one op per layer tensor per prefill chunk (tandem's layer-first layout); raw PF: one op per "
          "page (a page-first layout). xfer: transfer still running after prefill compute ended; notice: "
          "KV-complete message to first token at the client (TTFT = queue + compute + xfer + notice); load: the "
          "host->device load, which delays the second token, not the first.")
    if as_json:
        print(json.dumps([{**asdict(r), "tandem_over_raw": r.tandem_over_raw,
                           "transfer_share_of_ttft": r.transfer_share_of_ttft} for r in rows]))
