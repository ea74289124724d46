"""The dispatcher's end of the token relay (`common/relay.py`, `cluster.token_relay`): the server the
workers connect to, its secret, and the greeting that tells a joining worker where it is. With no
host it is off: every worker's messages come by long-poll (`router.workers.LiveWorker`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from common import protocol as p
from common.relay import RelayServer, hello, new_secret
from router.workers import LiveWorker

log = logging.getLogger("tandem.dispatcher")


class RelayEndpoint:
    """Owns the relay server (made by `start`, stopped by `close`) and its secret; reads the live workers
    it is given at each connection, and changes none."""

    def __init__(self, host: str | None) -> None:
        """`host`: where the relay listens; None: off."""
        self.host, self._secret = host, new_secret()
        self._server: RelayServer | None = None

    async def start(self, lives: Mapping[str, LiveWorker], on_message: Callable, polls) -> None:
        """Listen (when on). A connection is accepted from a live worker incarnation of `lives` (read when
        it connects); its messages go to `on_message` as its collector's do (`LiveWorker.relay_sink`)."""
        if self.host is None:
            return

        def sink(peer_id: str):
            live = next((lv for lv in lives.values() if lv.peer_id == peer_id and not lv.gone), None)
            return None if live is None else live.relay_sink(on_message, polls)

        self._server = RelayServer(self.host, self._secret, sink)
        log.info("token relay listening on %s:%d", self.host, await self._server.start())

    def greet(self, live: LiveWorker) -> None:
        """`live` just joined: its first message says where to relay its messages, when the relay
        listens and its link can (`WorkerLink.relays`)."""
        if self._server is not None and getattr(live.info.link, "relays", False):
            live.send(p.RelayTo(self._server.host, self._server.port, hello(self._secret, live.peer_id)))

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
