"""Child process for the Mooncake integration tests: owns a receiving buffer in its own OS process.

`serve` registers a zeroed buffer with a `MooncakeTransport`, sends `(session_id, addr, length)`
through the pipe, then answers "snapshot" with the buffer's bytes until "quit" (or until killed).
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch


def serve(conn: Connection, num_bytes: int) -> None:
    from kv_store.transfer import MooncakeTransport

    with MooncakeTransport("127.0.0.1") as transport:
        buffer = torch.zeros(num_bytes, dtype=torch.uint8)  # [num_bytes] landing buffer
        with transport.register_tensor(buffer) as region:
            conn.send((transport.session_id, region.addr, region.length))
            while (command := conn.recv()) != "quit":
                assert command == "snapshot", f"unknown command {command!r}"
                conn.send_bytes(buffer.numpy().tobytes())
