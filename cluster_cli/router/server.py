"""The client side: one ``ClientConn`` per TCP connection, minimal HTTP/1.1.

Parses request heads and bodies (Content-Length or chunked, ``Expect: 100-continue``),
enforces the header and body size limits, serves keep-alive and pipelined requests
one at a time, and hands each complete request to the router's handler as a task.
When the client disconnects, that task is cancelled at once, which aborts the
upstream request. Write backpressure is passed on to the upstream connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from cluster_cli.router.http import BadRequest, ChunkedDecoder, Request, error_response, parse_request_head

if TYPE_CHECKING:
    from cluster_cli.router.proxy import Exchange

log = logging.getLogger("clusterctl.router")
_monotonic = time.monotonic


class Handler(Protocol):
    max_header_bytes: int
    max_body_bytes: int
    conns: set[ClientConn]

    def handle(self, conn: ClientConn, req: Request) -> Awaitable[None] | None: ...

    def refused(self, conn: ClientConn, req: Request | None, status: int, code: str) -> None:
        """A request answered with an error while it was still being read (its log line and metrics)."""


class ClientConn(asyncio.Protocol):
    __slots__ = (
        "_body_parts",
        "_buf",
        "_clen",
        "_dec",
        "_req",
        "busy",
        "closed",
        "exchange",
        "h",
        "keep_alive",
        "last_io",
        "paused",
        "peer",
        "reading_paused",
        "task",
        "tr",
    )

    def __init__(self, handler: Handler) -> None:
        self.h = handler
        self.tr: asyncio.Transport | None = None
        self._buf = b""
        self._req: Request | None = None
        self._clen = 0
        self._dec: ChunkedDecoder | None = None
        self._body_parts: list[bytes] = []
        self.busy = False
        self.closed = False
        self.paused = False
        self.reading_paused = False  # we paused reading: a client pipelining far ahead
        self.keep_alive = True
        self.task: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.last_io = _monotonic()
        self.peer = ""

    now = staticmethod(_monotonic)

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        self.h.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.h.conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        ex = self.exchange
        if ex is not None:
            ex.conn.resume()

    def data_received(self, data: bytes) -> None:
        self.last_io = _monotonic()
        self._buf = self._buf + data if self._buf else data
        if not self.busy:
            self._parse()
        elif len(self._buf) > self.h.max_header_bytes and not self.reading_paused:
            # A client pipelining far ahead: stop reading until this request is answered.
            self.reading_paused = True
            self.tr.pause_reading()  # type: ignore[union-attr]

    # ---------------------------------------------------------------- parsing
    def _parse(self) -> None:
        h = self.h
        while not self.busy and not self.closed:
            buf = self._buf
            req = self._req
            if req is None:
                if not buf:
                    return
                idx = buf.find(b"\r\n\r\n")
                if idx < 0 or idx > h.max_header_bytes:
                    if idx > h.max_header_bytes or len(buf) > h.max_header_bytes:
                        self._reject(None, 431, "request head too large", "request_header_too_large")
                    return
                try:
                    req, clen, chunked = parse_request_head(buf[:idx])
                except BadRequest as e:
                    self._reject(None, e.status, e.message, e.code)
                    return
                buf = self._buf = buf[idx + 4 :]
                self.keep_alive = req.keep_alive
                if chunked:
                    self._dec = ChunkedDecoder()
                    self._body_parts = []
                    self._clen = -1
                else:
                    clen = clen or 0
                    if clen > h.max_body_bytes:
                        msg = f"request body is {clen} bytes; the limit is {h.max_body_bytes}"
                        self._reject(req, 413, msg, "request_too_large")
                        return
                    self._clen = clen
                self._req = req
                if req.expect_continue and (chunked or len(buf) < self._clen):
                    self.tr.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
            if self._clen >= 0:
                if len(buf) < self._clen:
                    return
                req.body = buf[: self._clen]
                self._buf = buf[self._clen :]
            else:
                dec = self._dec
                try:
                    payload, rest = dec.feed(buf)  # type: ignore[union-attr]
                except ValueError:
                    self._reject(req, 400, "malformed chunked request body", "bad_request")
                    return
                self._buf = b""
                if payload:
                    self._body_parts.append(payload)
                    if sum(len(p) for p in self._body_parts) > h.max_body_bytes:
                        msg = f"request body is over the limit of {h.max_body_bytes} bytes"
                        self._reject(req, 413, msg, "request_too_large")
                        return
                if not dec.done:  # type: ignore[union-attr]
                    return
                req.body = b"".join(self._body_parts)
                self._body_parts = []
                self._buf = rest
            self._req = None
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(self._run(req))

    def _reject(self, req: Request | None, status: int, message: str, code: str) -> None:
        """Answer an error before the request was read whole (``req``: its head, when parsed), and close."""
        self.keep_alive = False
        self.write(error_response(status, message, code, keep_alive=False))
        self.close()
        try:
            self.h.refused(self, req, status, code)
        except Exception:  # its log line must never take the connection handling down
            log.exception("could not record a refused request")

    async def _run(self, req: Request) -> None:
        try:
            aw = self.h.handle(self, req)
            if aw is not None:
                await aw
        except asyncio.CancelledError:
            self.close()
            return
        except Exception:
            log.exception("internal error while serving %s %s", req.method.decode(), req.path.decode("latin-1"))
            self.write(error_response(500, "internal router error", "internal_error", keep_alive=False))
            self.close()
            return
        finally:
            self.task = None
            self.busy = False
        self.last_io = _monotonic()
        if self.closed:
            return
        if not self.keep_alive:
            self.close()
            return
        if self.reading_paused and self.tr is not None:
            # Always resume: the next request may be complete in the buffer, or still arriving.
            self.reading_paused = False
            self.tr.resume_reading()
        if self._buf:
            self._parse()

    # ---------------------------------------------------------------- writing
    def write(self, data: bytes) -> None:
        if not self.closed:
            self.tr.write(data)  # type: ignore[union-attr]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.h.conns.discard(self)
            if self.tr is not None:
                self.tr.close()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.h.conns.discard(self)
            if self.tr is not None:
                self.tr.abort()
