"""Faults injected on purpose, for chaos runs (`tandem bench chaos`): off unless a worker is started
with `cluster.inject_faults` ("landing=0.05,l2=0.02": each site's chance per event). Each site damages
real bytes where the product checks them, so what a chaos run counts is what the checks catch:

    landing   a landed prompt page, after the transfer and before the decode worker verifies it
    l2        a host-tier page, just after its backup landed and was summed

Nothing here runs unless configured: `strike` is one dict lookup on the hot paths.
"""

from __future__ import annotations

import random

SITES = ("landing", "l2")
_rates: dict[str, float] = {}
_rng = random.Random()


def parse(spec: str) -> dict[str, float]:
    """"site=chance,..." -> {site: chance}; ValueError naming what is wrong."""
    rates = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        site, _, chance = part.partition("=")
        if site not in SITES:
            raise ValueError(f"inject_faults: unknown site {site!r} (sites: {', '.join(SITES)})")
        try:
            rates[site] = float(chance)
        except ValueError:
            raise ValueError(f"inject_faults: {part!r} is not site=chance") from None
        if not 0.0 <= rates[site] <= 1.0:
            raise ValueError(f"inject_faults: the chance of {site} must be in [0, 1], got {chance}")
    return rates


def configure(spec: str, seed: int | None = None) -> None:
    """This process injects faults at the rates `spec` gives ("" turns them off)."""
    _rates.clear()
    _rates.update(parse(spec))
    _rng.seed(seed)


def strike(site: str) -> bool:
    """Whether to damage this event at `site`."""
    rate = _rates.get(site, 0.0)
    return bool(rate) and _rng.random() < rate
