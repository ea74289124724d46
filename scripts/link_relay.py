"""Delay and loss on one network link in user space, for kernels without the netem queueing
discipline (`scripts/netns_cluster.py:NetnsCluster.netem` starts it; a person need not).

A host's link is a veth pair whose root-side end is a port of the cluster's bridge. For the
impairment that end leaves the bridge and this process joins the two: it reads the frames arriving
on the veth end (a packet socket) and writes them into a TAP device that takes the veth's place on
the bridge, and back. Every frame, either way, is held `delay_ms` and dropped with probability
`loss_pct` / 100 (seeded). Both sides carry the virtio-net header, so a segmentation-offloaded
frame (up to 64 KiB) passes whole with its checksum still to fill in, and TCP over the link sees
real delay, loss and retransmission, as under `tc netem` (one difference: a lost offloaded frame is
many wire packets). It prints "ready" once both ends are open; SIGTERM or SIGINT stops it, and the
TAP device goes with it.

    python scripts/link_relay.py VETH TAP --delay-ms 40 --loss-pct 3 [--seed 0]
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
SOL_PACKET, PACKET_VNET_HDR = 263, 15
ETH_P_ALL = 0x0003
MAX_FRAME = 65536 + 64  # an offloaded frame and its virtio-net header
TO_BRIDGE, TO_HOST = 0, 1


def open_ends(veth: str, tap: str) -> tuple[socket.socket, int]:
    """(the packet socket on `veth`, the TAP device's fd), both with virtio-net headers."""
    tap_fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(tap_fd, TUNSETIFF, struct.pack("16sH", tap.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((veth, 0))
    sock.setblocking(False)
    return sock, tap_fd


def relay(sock: socket.socket, tap_fd: int, delay_s: float, loss: float, seed: int, stop: list[bool]) -> None:
    rng, held, n = random.Random(seed), [], 0  # held: (due, order, direction, frame)

    def take(direction: int, frame: bytes, now: float) -> None:
        nonlocal n
        if rng.random() >= loss:
            n += 1
            heapq.heappush(held, (now + delay_s, n, direction, frame))

    while not stop[0]:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        ready, _, _ = select.select([sock, tap_fd], [], [], timeout)
        now = time.monotonic()
        if sock in ready:
            while True:
                try:
                    frame, addr = sock.recvfrom(MAX_FRAME)
                except BlockingIOError:
                    break
                if addr[2] != socket.PACKET_OUTGOING:  # not our own writes towards the host
                    take(TO_BRIDGE, frame, now)
        if tap_fd in ready:
            while True:
                try:
                    take(TO_HOST, os.read(tap_fd, MAX_FRAME), now)
                except BlockingIOError:
                    break
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, direction, frame = heapq.heappop(held)
            try:
                if direction == TO_BRIDGE:
                    os.write(tap_fd, frame)
                else:
                    sock.send(frame)
            except OSError:
                pass  # an end that is down loses the frame, as a wire would


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("veth")
    parser.add_argument("tap")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--loss-pct", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.delay_ms < 0 or not 0 <= args.loss_pct < 100:
        parser.error("--delay-ms must be >= 0 and --loss-pct in [0, 100)")
    sock, tap_fd = open_ends(args.veth, args.tap)
    stop = [False]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.__setitem__(0, True))
    print("ready", flush=True)
    relay(sock, tap_fd, args.delay_ms / 1000, args.loss_pct / 100, args.seed, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
