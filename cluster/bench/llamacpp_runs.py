"""What `tandem bench llamacpp` runs and what it measures: the run's spec, each stream's timings, one
server's samples, and a server's rounds pooled into one. llamacpp.py fills them; llamacpp_report.py
turns them into figures."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.bench.proc_memory import ProcessMemory


@dataclass(frozen=True)
class BenchSpec:
    threads: int  # llama.cpp -t / -tb (n_threads / n_threads_batch), and tandem's workers' threads in all
    prompt_len: int = 128  # tokens per prompt of the single-stream and concurrency runs
    output_len: int = 128  # tokens asked for per request of those runs
    itl_runs: int = 3
    ttft_prompt_len: int = 1032
    ttft_runs: int = 3
    concurrency: int = 16
    num_requests: int = 32  # of the concurrency run
    seed: int = 0
    dtype: str = "float32"  # both servers' weights (`--dtype`)

    def __post_init__(self):
        for name in ("threads", "prompt_len", "output_len", "itl_runs", "ttft_prompt_len", "ttft_runs",
                     "concurrency", "num_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def context_len(self) -> int:
        """Tokens one llama.cpp sequence must hold: the longest prompt plus what follows it."""
        return max(self.prompt_len + self.output_len, self.ttft_prompt_len + 2)


@dataclass(frozen=True)
class StreamResult:
    ttft_s: float  # to the first non-empty text frame
    frame_gaps_s: tuple[float, ...]  # between consecutive non-empty text frames
    output_tokens: int  # the usage block's count where the server sends one, else the text frames
    text: str


@dataclass(frozen=True)
class SystemRun:
    system: str
    itl: tuple[StreamResult, ...]
    ttft: tuple[StreamResult, ...]
    concurrent_elapsed_s: float
    concurrent_output_tokens: int
    memory: ProcessMemory | None = None  # every process of the server, after the runs
    peer: str = ""  # llama.cpp's: which server (llamacpp_peers.PEERS)
    concurrent: tuple[StreamResult, ...] = ()  # the concurrency run's streams
    ready_s: tuple[float, ...] = ()  # start to ready, per round


def merge_runs(runs: list[SystemRun]) -> SystemRun:
    """One system's rounds as one run: every stream of every round, the concurrency runs' tokens and
    seconds summed (so its tok/s is total tokens / total time, not a mean of rates), the memory of the
    round that held the most."""
    memories = [run.memory for run in runs if run.memory is not None]
    return SystemRun(runs[0].system, tuple(r for run in runs for r in run.itl),
                     tuple(r for run in runs for r in run.ttft),
                     sum(run.concurrent_elapsed_s for run in runs), sum(run.concurrent_output_tokens for run in runs),
                     max(memories, key=lambda m: m.rss_bytes, default=None), runs[0].peer,
                     tuple(r for run in runs for r in run.concurrent), tuple(s for run in runs for s in run.ready_s))
