"""A decode worker's landings over tensor-parallel ranks.

Every rank holds a landing of the same page count for its own KV heads, registered with a transport
of its own, so prefill ranks write each rank's heads straight into it (`common/landing.py`). Rank 0's
`LandingPool` decides which pages a request lands in, for every rank; its `Landing` lists each
rank's part (`OtherLandings.spread`). When rank 0 loads a landing into device pages it tells the other
ranks to load the same pages into the same device pages (`OtherLandings.load`, "land") and waits for
their word: once it returns, no rank reads those landing pages any more, so rank 0 may hand them to
the next request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.landing import Landing, LandingShard

if TYPE_CHECKING:
    from engine.tp import ControlGroup
    from engine.tp_launch import RankContext

log = logging.getLogger("tandem.decode")


class OtherLandings:
    """Rank 0's side of the other ranks' landings (`RankLanding` on each)."""

    def __init__(self, control: ControlGroup, held: list[range]) -> None:
        """Gathers each other rank's `LandingShard` (they send it as they start)."""
        self.control, self.held = control, held
        self.shards: tuple[LandingShard, ...] = tuple(self._gather(None)[1:])

    def spread(self, landing: Landing) -> Landing:
        """`landing` (rank 0's part) as every rank's: the whole model's layout, each rank's part."""
        own = LandingShard(landing.session, landing.k_base, landing.v_base, (self.held[0].start, self.held[0].stop))
        layout = dataclasses.replace(landing.layout, num_kv_heads=max(h.stop for h in self.held))
        return dataclasses.replace(landing, layout=layout, shards=(own, *self.shards))

    def digests(self, landing_pages: list[int]) -> list[int]:
        """Each other rank's digests of its part of `landing_pages`, rank after rank (`page_digest.py`);
        a rank that could not digest its part gives none."""
        self.control.send(("landing_sums", tuple(landing_pages)))
        return [d for said in self._gather(None)[1:] for d in (said or ())]

    def load(self, landing_pages: list[int], device_pages: list[int]) -> None:
        """The other ranks copy their landing pages into their device pages; returns when all have
        (raises `RuntimeError` naming each rank whose copy failed)."""
        self.control.send(("land", tuple(landing_pages), tuple(device_pages)))
        errors = [f"rank {rank}: {error}" for rank, error in enumerate(self._gather("")) if error]
        if errors:
            raise RuntimeError(f"the landing -> device copy failed on {'; '.join(errors)}")

    def _gather(self, obj: object) -> list:
        """Every rank's answer, rank 0's `obj` first."""
        answers = self.control.gather(obj)
        assert answers is not None, "rank 0's gather came back empty: OtherLandings on a rank other than 0?"
        return answers


@dataclass(frozen=True)
class RankLanding:
    """What a decode worker's rank other than 0 runs beside its engine shard (made in its process by
    `engine.tp_launch.follower_main`): `num_pages` landing pages for its heads, registered with a
    transport of its own, and the calls "land" (copy these landing pages into those device pages) and
    "landing_sums" (digest these landing pages)."""

    hostname: str
    protocol: str
    num_pages: int

    def start(self, ctx: RankContext) -> dict[str, Callable[..., None]]:
        """Sends rank 0 its `LandingShard`; returns this rank's calls by name."""
        from kv_store.copier import Direction, PageCopier
        from kv_store.tier_copies import host_tensors
        from kv_store.transfer.mooncake import MooncakeTransport
        from kv_store.transfer.page_digest import PageDigest

        transport = MooncakeTransport(self.hostname, self.protocol)
        ctx.closing.callback(transport.close)
        kv = host_tensors(ctx.kv, self.num_pages)
        for t in (*kv.k, *kv.v):
            ctx.closing.enter_context(transport.register_tensor(t))
        copier = PageCopier(ctx.kv, kv, name=f"landing-copier-rank{ctx.rank}")
        ctx.closing.callback(copier.close)
        heads = ctx.shards[ctx.rank].kv_heads
        ctx.control.gather(LandingShard(transport.session_id, tuple(t.data_ptr() for t in kv.k),
                                        tuple(t.data_ptr() for t in kv.v), (heads.start, heads.stop)))

        def land(landing_pages: tuple, device_pages: tuple) -> None:
            job = copier.submit(Direction.TO_DEVICE, list(landing_pages), list(device_pages))
            error = "" if job.wait(LOAD_TIMEOUT_S) else f"no copy within {LOAD_TIMEOUT_S:g} s"
            ctx.control.gather(error or (repr(job.error) if job.error is not None else ""))

        digest = PageDigest(kv)

        def landing_sums(landing_pages: tuple) -> None:
            try:
                said = digest.digests(list(landing_pages))
            except Exception:  # rank 0 then treats its part as unverified: recomputed
                log.exception("digesting landing pages %s failed", landing_pages)
                said = None
            ctx.control.gather(said)

        return {"land": land, "landing_sums": landing_sums}


LOAD_TIMEOUT_S = 60.0
"""The longest a rank waits for its landing -> device copy (host memory to its device)."""
