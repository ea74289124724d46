"""When each request is sent: offsets in seconds from the start of the run (pure).

Gaps between arrivals are gamma-distributed with shape `burstiness` and mean 1 / rate: burstiness 1
is a Poisson process (exponential gaps), below 1 burstier, above 1 more even (vLLM's model). With
`normalize`, the offsets are scaled so the last one lands at num / rate exactly, as vLLM does, so
runs with different seeds send the same number of requests per second over the run.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets_s(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator,
                      normalize: bool = True) -> np.ndarray:  # [num_requests], non-decreasing
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return np.zeros(num_requests)  # all at once
    if math.isinf(burstiness):
        gaps_s = np.full(num_requests, 1.0 / rate)
    else:
        gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    offsets_s = np.cumsum(gaps_s)
    if normalize and num_requests and offsets_s[-1] > 0:
        offsets_s *= (num_requests / rate) / offsets_s[-1]
    return offsets_s
