"""The HBM-bandwidth limit of decoding, and Llama shapes with random weights built on the device.

A decode step of B sequences must read every weight once (the input embedding excepted: its lookup
reads B rows of the table) and the KV of every sequence; HBM cannot deliver that faster than its peak
bandwidth, so `bytes / peak` is the floor of a step's time. `tandem bench decode` reports each run's
fraction of that limit:

    fraction = (weight bytes + KV bytes read) / mean timed step seconds / peak HBM bytes per second

The KV one request's timed step k (0-based, of S timed steps) reads, n being the request's output
tokens after the last timed step (so n - S + k before step k):

    positions [0, prompt_len)                   the prompt's KV, written by prefill
              [prompt_len, prompt_len + n-S+k)  the outputs before step k; the last of them is the
                                                token step k feeds: its KV is written, then attended

so a step reads `prompt_len + n - S + k` tokens of KV per request, `prompt_len + n - S + (S - 1) / 2`
on average over the timed steps. Activations, logits and the KV written are left out (small beside
the weights at decode batch sizes): the fraction is a lower bound of the true one.

The peak comes from the device's name (the vendor's datasheet figure) or else from its memory clock
and bus width as the CUDA driver reports them (torch's device properties; `nvidia-smi` reports the
clock but not the bus width); a device neither gives (a CPU) has none, and its fraction is None.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.model.arch import LlamaArch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from common.config import EngineConfig
    from kernels.model.llama import LlamaForCausalLM

RANDOM_SHAPES: dict[str, LlamaArch] = {
    "llama-3-8b": LlamaArch(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                            max_position_embeddings=8192, tie_word_embeddings=False),
    "tiny": LlamaArch(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=1024, tie_word_embeddings=False),
}
"""`tandem bench decode --random-weights NAME`: Llama-3-8B's shape (GQA 4, 128k vocabulary), and a tiny
one that runs the same code on a CPU in seconds."""
INIT_STD = 0.02  # HF Llama's initializer_range: every matrix N(0, 0.02^2), every norm weight 1

PEAK_HBM_BYTES_PER_S: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 4.8e12),
    (("H100", "HBM3"), 3.35e12),  # the SXM part names itself "H100 80GB HBM3"
    (("H100", "SXM"), 3.35e12),
    (("A100", "80GB"), 2.0e12),  # SXM4 2.04, PCIe 1.94
)
"""(words all in the device name, peak HBM bytes per second); the first match wins."""


def random_llama(arch: LlamaArch, device: torch.device | str, dtype: torch.dtype, backend: str,
                 seed: int = 0) -> LlamaForCausalLM:
    """Our model of `arch` with seeded random weights, drawn on `device` in `dtype` (an 8B model is
    16 GB of bf16: never materialised on the host, nor in float32 first)."""
    from kernels.attention import get_backend
    from kernels.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(arch, get_backend(backend)).to(dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, INIT_STD, generator=gen)
            else:  # norm weights 1, biases 0
                param.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


class RandomModels:
    """The decode bench's `Models` over a named shape (`RANDOM_SHAPES`) with random weights: ours
    only (no checkpoint, so no HF twin: `hf` raises), one backend's model kept at a time."""

    def __init__(self, config: EngineConfig, shape: str, seed: int = 0):
        if shape not in RANDOM_SHAPES:
            raise ValueError(f"unknown --random-weights shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
        self.config, self.arch, self.seed = config, RANDOM_SHAPES[shape], seed
        self._loaded: dict[str, LlamaForCausalLM] = {}

    def ours(self, backend: str) -> tuple[LlamaForCausalLM, LlamaArch]:
        from kernels.kv_layout import TORCH_DTYPES

        if backend not in self._loaded:
            self._loaded.clear()
            self._loaded[backend] = random_llama(self.arch, self.config.device, TORCH_DTYPES[self.config.dtype],
                                                 backend, self.seed)
        return self._loaded[backend], self.arch

    def hf(self) -> PreTrainedModel:
        raise ValueError("random weights have no HF transformers twin: run with --skip-hf")


# ---- bytes a decode step reads ------------------------------------------------------------------------
class TimedRun(Protocol):
    """What the figures need of one timed decode run (`cluster.bench.decode.DecodeRow`), read-only."""

    @property
    def system(self) -> str: ...  # "tandem" | a baseline's name
    @property
    def backend(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def batch(self) -> int: ...
    @property
    def step_s(self) -> tuple[float, ...]: ...  # each timed step
    @property
    def tokens(self) -> tuple[tuple[int, ...], ...]: ...  # every request's output tokens after the last timed step
    @property
    def tokens_per_s(self) -> float: ...  # output tokens per second while decoding


def weight_bytes_read(arch: LlamaArch, dtype_bytes: int) -> int:
    """Weights one decode step reads: every layer's, the final norm, the LM head (the tied embedding
    when tied); not the input embedding's table, of which the step reads B rows."""
    h, hd = arch.hidden_size, arch.head_dim
    qkv = h * (arch.num_heads + 2 * arch.num_kv_heads) * hd
    qkv_bias = (arch.num_heads + 2 * arch.num_kv_heads) * hd if arch.attention_bias else 0
    o = arch.num_heads * hd * h + (h if arch.o_proj_bias else 0)
    mlp = 3 * h * arch.intermediate_size + ((2 * arch.intermediate_size + h) if arch.mlp_bias else 0)
    per_layer = qkv + qkv_bias + o + mlp + 2 * h  # 2 RMSNorm weights
    return dtype_bytes * (arch.num_layers * per_layer + h + arch.vocab_size * h)


def kv_bytes_per_token(arch: LlamaArch, dtype_bytes: int) -> int:
    """K and V of one token in every layer."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes


def mean_kv_tokens_read(row: TimedRun, prompt_len: int) -> float:
    """KV tokens a timed step of `row` reads, summed over its requests, averaged over its steps
    (module docstring)."""
    steps = len(row.step_s)
    return sum(prompt_len + len(tokens) - steps + (steps - 1) / 2 for tokens in row.tokens)


# ---- the device's peak -------------------------------------------------------------------------------
def peak_hbm_bytes_per_s(device: torch.device | str) -> tuple[float | None, str]:
    """(peak HBM bytes per second of `device`, where that figure came from); (None, why) when unknown."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no HBM figure for a {device.type} device"
    props = torch.cuda.get_device_properties(device)
    for words, peak in PEAK_HBM_BYTES_PER_S:
        if all(w in props.name for w in words):
            return peak, f"datasheet figure for {props.name}"
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate: two transfers a clock
        return 2 * clock_khz * 1e3 * bus_bits / 8, (f"{props.name}: memory clock {clock_khz / 1e3:.0f} MHz x "
                                                    f"{bus_bits}-bit bus x 2 (torch's device properties)")
    return None, f"{props.name}: not in the table, and torch reports no memory clock and bus width"


def decode_bandwidth(rows: Sequence[TimedRun], arch: LlamaArch, base: EngineConfig, prompt_len: int) -> dict:
    """Per tandem row ("backend/mode/batch"): bytes a step reads, the bandwidth that is, its fraction of
    the peak (None where the peak is unknown)."""
    from kernels.kv_layout import TORCH_DTYPES

    dtype_bytes = TORCH_DTYPES[base.dtype].itemsize
    weights, per_token = weight_bytes_read(arch, dtype_bytes), kv_bytes_per_token(arch, dtype_bytes)
    peak, source = peak_hbm_bytes_per_s(base.device)
    out: dict = {"peak_bytes_per_s": peak, "peak_source": source, "weight_bytes": weights,
                 "kv_bytes_per_token": per_token, "rows": {}}
    for r in (r for r in rows if r.system == "tandem"):
        read = weights + per_token * mean_kv_tokens_read(r, prompt_len)
        achieved = read / statistics.fmean(r.step_s)
        out["rows"][f"{r.backend}/{r.mode}/{r.batch}"] = {
            "bytes_per_step": round(read), "bytes_per_s": achieved, "tokens_per_s": r.tokens_per_s,
            "fraction_of_peak": None if peak is None else achieved / peak}
    return out


def print_bandwidth(bandwidth: dict) -> None:
    peak = bandwidth["peak_bytes_per_s"]
    print(f"\nHBM reads a decode step: weights {bandwidth['weight_bytes'] / 1e6:,.1f} MB + KV "
          f"{bandwidth['kv_bytes_per_token']:,} B a token; peak "
          f"{'unknown' if peak is None else f'{peak / 1e9:,.0f} GB/s'} ({bandwidth['peak_source']})")
    for key, r in bandwidth["rows"].items():
        fraction = "-" if r["fraction_of_peak"] is None else f"{r['fraction_of_peak']:.2f} of peak"
        print(f"  {key:<22}{r['bytes_per_step'] / 1e6:>12,.1f} MB/step "
              f"{r['bytes_per_s'] / 1e9:>10,.1f} GB/s  {fraction}")
