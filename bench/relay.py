#!/usr/bin/env python3
"""The least a Python proxy can do: a bare uvloop byte relay, for the router benchmark's floor.

Every accepted client connection gets its own connection to the one upstream, and bytes are
copied both ways as they come: no HTTP parsing, no routing, no metrics, no log, no limits.
No real router can cost less per request than this on the same event loop, so what it adds
in ``bench/router.py overhead --floor`` is what Python itself adds on this box.

    python bench/relay.py --port 9000 --upstream 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket


class _Side(asyncio.Protocol):
    """One socket of a pair: what it reads goes out on its peer's transport."""

    def __init__(self) -> None:
        self.tr: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.tr is not None:
            peer.tr.write(data)
        else:  # the upstream side is still connecting
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.tr is not None:
            self.peer.tr.close()


async def _pair(client: _Side, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    try:
        _, up = await loop.create_connection(_Side, host, port)
    except OSError:
        if client.tr is not None:
            client.tr.close()
        return
    up.peer, client.peer = client, up
    for data in client.pending:
        up.tr.write(data)  # type: ignore[union-attr]
    client.pending.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="HOST:PORT")
    a = ap.parse_args()
    host, _, port = a.upstream.rpartition(":")
    try:
        import uvloop  # the router's own event loop
    except ImportError:
        uvloop = None  # type: ignore[assignment]

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        tasks: set[asyncio.Task[None]] = set()

        def accept() -> _Side:
            side = _Side()
            t = loop.create_task(_pair(side, host, int(port)))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            return side

        server = await loop.create_server(accept, "127.0.0.1", a.port, backlog=1024)
        async with server:
            await stop.wait()

    if uvloop is not None:
        uvloop.run(serve())
    else:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve())


if __name__ == "__main__":
    main()
