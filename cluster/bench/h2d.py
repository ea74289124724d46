"""`tandem bench h2d`: host -> device tier loads against a plain pinned `copy_` of the same bytes.

A load-back (`kv_store/copier.py:PageCopier`, `Direction.TO_DEVICE`; a decode worker's landing loads,
`kv_store/landing.py`, take the same copier) moves `--pages` pages of every
layer's K and V from the host tier (pinned on CUDA, as `kv_store.host_cache.host_tensors` makes it) to
the device pool. The baseline moves exactly as many bytes with one `copy_` per layer tensor from a
pinned host slice into a device slice (`non_blocking`, then one synchronize): what the hardware gives
a copy with no page table at all. Both run `--repeats` times, alternating; the best of each counts.

    tandem (copier)   host pages scattered over the tier -> device pages scattered over the pool
    baseline          host pages [1, n + 1) -> device pages [1, n + 1), contiguous, one copy_ each

Every copier run is checked byte for byte (device pages == the host pages they came from), so a
fast copy that moved the wrong bytes fails the bench instead of winning it. Target: the copier at
>= 80% of the baseline's bandwidth (`TARGET`). On a CPU "device" both sides are host memory (not
pinned); the same comparison then measures the copier's own overhead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from cluster.bench.decode import sync_device
from kernels.kv_layout import TORCH_DTYPES, KVCacheTensors
from kv_store.copier import Direction, PageCopier
from kv_store.tier_copies import host_tensors

TARGET = 0.8
"""The copier's bandwidth / the plain pinned copy's, at least."""
COPY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class H2DSpec:
    num_pages: int = 256  # pages per load
    page_size: int = 16
    num_layers: int = 30  # SmolLM2-135M's KV layout by default
    num_kv_heads: int = 3
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 5
    seed: int = 0

    def __post_init__(self):
        for name in ("num_pages", "page_size", "num_layers", "num_kv_heads", "head_dim", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_bytes(self) -> int:
        """K and V of every layer for `num_pages` pages."""
        itemsize = torch.empty((), dtype=TORCH_DTYPES[self.dtype]).element_size()
        return 2 * self.num_layers * self.num_pages * self.page_size * self.num_kv_heads * self.head_dim * itemsize


def _tiers(spec: H2DSpec) -> tuple[KVCacheTensors, KVCacheTensors]:
    """(device pool, host tier), each with twice the pages a load moves plus scratch page 0; the host
    pages hold random values."""
    num_pages = 2 * spec.num_pages + 1
    device = KVCacheTensors.allocate(spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim,
                                     TORCH_DTYPES[spec.dtype], spec.device)
    host = host_tensors(device, num_pages)
    gen = torch.Generator().manual_seed(spec.seed)
    for t in (*host.k, *host.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return device, host


def time_copier(copier: PageCopier, src_pages: list[int], dst_pages: list[int]) -> float:
    """Seconds of one TO_DEVICE job, submit to done (the copier synchronises its stream)."""
    start = time.perf_counter()
    job = copier.submit(Direction.TO_DEVICE, src_pages, dst_pages)
    if not job.wait(COPY_TIMEOUT_S):
        raise RuntimeError(f"the copier did not finish {len(src_pages)} pages within {COPY_TIMEOUT_S:.0f} s")
    if job.error is not None:
        raise RuntimeError(f"the copier failed: {job.error}") from job.error
    return time.perf_counter() - start


def time_plain_copy(device: KVCacheTensors, host: KVCacheTensors, num_pages: int) -> float:
    """Seconds to move pages [1, num_pages + 1) of every layer tensor with one `copy_` each."""
    dev = device.k[0].device
    sync_device(dev)
    start = time.perf_counter()
    for dst, src in zip((*device.k, *device.v), (*host.k, *host.v)):
        dst[1:num_pages + 1].copy_(src[1:num_pages + 1], non_blocking=True)
    sync_device(dev)
    return time.perf_counter() - start


def check_landed(device: KVCacheTensors, host: KVCacheTensors, src_pages: list[int], dst_pages: list[int]) -> None:
    """Every device page holds the bytes of the host page it was loaded from (a byte comparison)."""
    src, dst = torch.tensor(src_pages), torch.tensor(dst_pages, device=device.k[0].device)
    for layer, (d, h) in enumerate(zip((*device.k, *device.v), (*host.k, *host.v))):
        landed = d.index_select(0, dst).cpu().view(torch.uint8)
        if not torch.equal(landed, h.index_select(0, src).view(torch.uint8)):
            raise RuntimeError(f"layer tensor {layer}: device pages differ from the host pages loaded into them")


def run_h2d(spec: H2DSpec) -> dict:
    device, host = _tiers(spec)
    rng = random.Random(spec.seed)
    pages = list(range(1, 2 * spec.num_pages + 1))
    copier = PageCopier(device, host, name="bench-h2d")
    copier_s, plain_s = [], []
    try:
        time_copier(copier, [1], [1])  # warm-up: the copier's stream and first allocations
        time_plain_copy(device, host, 1)
        for _ in range(spec.repeats):
            src, dst = rng.sample(pages, spec.num_pages), rng.sample(pages, spec.num_pages)
            copier_s.append(time_copier(copier, src, dst))
            check_landed(device, host, src, dst)
            plain_s.append(time_plain_copy(device, host, spec.num_pages))
    finally:
        copier.close()
    gb = spec.num_bytes / 1e9
    copier_gbps, plain_gbps = gb / min(copier_s), gb / min(plain_s)
    return {"spec": asdict(spec), "bytes": spec.num_bytes, "pinned_host": host.k[0].is_pinned(),
            "copier_s": copier_s, "plain_copy_s": plain_s, "copier_gb_per_s": copier_gbps,
            "plain_copy_gb_per_s": plain_gbps, "ratio": copier_gbps / plain_gbps, "target": TARGET,
            "copier_median_gb_per_s": gb / statistics.median(copier_s)}


def format_result(result: dict) -> str:
    spec = result["spec"]
    mib = result["bytes"] / 2**20
    verdict = ("ok" if result["ratio"] >= TARGET else "MISSED") if spec["device"].startswith("cuda") else \
        "the target is for a CUDA device; here both sides are host memory"
    return "\n".join([
        f"host -> {spec['device']}: {spec['num_pages']} pages x {spec['num_layers']} layers (K and V), "
        f"{mib:.1f} MiB a load, {spec['dtype']}, host pinned: {result['pinned_host']}",
        f"{'':<34}{'best GB/s':>10}{'best ms':>10}",
        f"{'tandem copier (scattered pages)':<34}{result['copier_gb_per_s']:>10.2f}"
        f"{1e3 * min(result['copier_s']):>10.2f}",
        f"{'plain copy_ (contiguous)':<34}{result['plain_copy_gb_per_s']:>10.2f}"
        f"{1e3 * min(result['plain_copy_s']):>10.2f}",
        f"copier / plain copy_: {result['ratio']:.2f} (target >= {TARGET:.2f}: {verdict}); "
        "every load checked byte for byte",
    ])


def bench_h2d(args: argparse.Namespace) -> int:
    spec = H2DSpec(num_pages=args.pages, page_size=args.page_size, num_layers=args.num_layers,
                   num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype, device=args.device,
                   repeats=args.repeats, seed=args.seed)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    result = run_h2d(spec)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
