"""The load harness's transports against a server that closes its idle keep-alive connections
(cluster/bench/load/transport.py: the retry rule).

The server (asyncio + h11 on 127.0.0.1, its own thread) streams SSE completions and, like llama.cpp's
`llama-server` (which closes each connection after a streamed response), closes a connection after a
few responses and a short delay without saying `Connection: close`: a client that reuses the
connection races the close, and a request sent into it is dropped unread. The server records
every request body it read in full, so a test can check that no request was processed twice; a plan
per request number makes it fail a request on purpose (read it and close without an answer, or close
after the first frame) to check what must not be sent again."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter

import h11
import pytest

from cluster.bench.load.client import LoadShape, Target, run_client
from cluster.bench.load.datasets import SampleRequest

CLIENTS = ("aiohttp", "httpx")


class IdleClosingServer:
    """Serves `requests_per_connection` (a range, drawn per connection) requests on a connection, then
    closes it 0 to `max_close_delay_s` after the last response (drawn per close) without reading on:
    a request that arrived meanwhile is dropped unread. `bodies`: every request body read in full, in
    arrival order; `plan`: request number (arrival order) -> "no-answer" (close once it is read) |
    "cut" (close after the first content frame)."""

    def __init__(self, requests_per_connection: tuple[int, int] = (1, 3), max_close_delay_s: float = 0.03,
                 frame_delay_s: float = 0.001, seed: int = 0):
        self.requests_per_connection, self.max_close_delay_s = requests_per_connection, max_close_delay_s
        self.frame_delay_s = frame_delay_s
        self.rng = random.Random(seed)
        self.bodies: list[bytes] = []
        self.plan: dict[int, str] = {}
        self.num_connections = self.num_idle_closes = 0
        self.handlers: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        async def close():
            self.server.close()
            for task in self.handlers:
                task.cancel()
            await asyncio.gather(*self.handlers, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        self.handlers.add(asyncio.current_task())
        conn = h11.Connection(h11.SERVER)
        try:
            for _ in range(self.rng.randint(*self.requests_per_connection)):
                body = await self._read_request(conn, reader)
                if body is None:
                    return  # the client closed it
                number = len(self.bodies)
                self.bodies.append(body)
                action = self.plan.get(number)
                if action == "no-answer":
                    return
                await self._stream(conn, writer, json.loads(body), cut=action == "cut")
                if action == "cut":
                    return
                conn.start_next_cycle()
            self.num_idle_closes += 1  # no `Connection: close` said: the client learns it from the socket
            await asyncio.sleep(self.rng.uniform(0.0, self.max_close_delay_s))
        except (ConnectionError, h11.ProtocolError):
            pass  # the client went away: nothing to answer
        finally:
            writer.close()
            self.handlers.discard(asyncio.current_task())

    @staticmethod
    async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The body of the next request; None when the client closed the connection first."""
        chunks = []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                return None

    async def _stream(self, conn: h11.Connection, writer: asyncio.StreamWriter, body: dict, cut: bool) -> None:
        writer.write(conn.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream"),
                                                                      ("transfer-encoding", "chunked")])))
        for i in range(body["max_tokens"]):
            frame = {"choices": [{"index": 0, "text": f" t{i}"}]}
            writer.write(conn.send(h11.Data(data=f"data: {json.dumps(frame)}\n\n".encode())))
            await writer.drain()
            if cut:
                return
            await asyncio.sleep(self.frame_delay_s)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        writer.write(conn.send(h11.Data(data=f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                                             "data: [DONE]\n\n".encode())))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()


@pytest.fixture
def server():
    srv = IdleClosingServer()
    yield srv
    srv.stop()


def make_jobs(num_jobs: int, output_len: int = 6) -> list[SampleRequest]:
    """Prompts that differ in their first id, so each request body is unique."""
    return [SampleRequest(i, (i, 7, 8, 9), 4, output_len) for i in range(num_jobs)]


def run(server: IdleClosingServer, jobs: list, client: str, concurrency: int):
    target = Target(server.url, model="m", http_library=client)
    return asyncio.run(run_client(target, jobs, LoadShape(max_concurrency=concurrency)))


@pytest.mark.parametrize("client", CLIENTS)
def test_closed_pooled_connections_are_retried_and_no_request_reaches_the_server_twice(server, client):
    jobs = make_jobs(96)
    result = run(server, jobs, client, concurrency=16)

    failed = [o.error for o in result.outputs if not o.success]
    assert failed == [], failed[:3]
    assert [o.output_tokens for o in result.outputs] == [6] * 96
    counts = Counter(server.bodies)
    assert len(server.bodies) == 96 and max(counts.values()) == 1, "a request the server read was sent again"
    assert sorted(json.loads(b)["prompt"][0] for b in server.bodies) == list(range(96))
    # the race happened: the server closed idle connections and the client met some of them
    assert server.num_idle_closes > 0 and result.num_retries > 0, (server.num_idle_closes, result.num_retries)
    assert result.num_retries <= 96


@pytest.mark.parametrize("client", CLIENTS)
def test_a_request_on_a_fresh_connection_that_gets_no_answer_is_not_sent_again(server, client):
    server.plan = {0: "no-answer"}  # the first request of the run: a fresh connection
    result = run(server, make_jobs(3), client, concurrency=1)

    first, *rest = result.outputs
    assert not first.success and first.error
    assert all(o.success for o in rest)
    assert len(server.bodies) == 3 and max(Counter(server.bodies).values()) == 1
    assert result.num_retries == 0


@pytest.mark.parametrize("client", CLIENTS)
def test_a_response_that_began_is_never_sent_again(client):
    srv = IdleClosingServer(requests_per_connection=(2, 2))  # the second request reuses the connection
    srv.plan = {1: "cut"}
    try:
        result = run(srv, make_jobs(2), client, concurrency=1)
    finally:
        srv.stop()

    assert [o.success for o in result.outputs] == [True, False]
    assert srv.num_connections == 1, "both requests on one pooled connection"
    assert len(srv.bodies) == 2 and max(Counter(srv.bodies).values()) == 1
    assert result.num_retries == 0
