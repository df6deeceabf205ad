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
import re
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

from cluster_cli.router.http import BadRequest, ChunkedDecoder, Request, error_response, head_only, parse_request_head

if TYPE_CHECKING:
    from cluster_cli.router.proxy import Exchange

log = logging.getLogger("clusterctl.router")
_EMPTY_LINES = re.compile(rb"(?:\r\n)*")
# A connection answered before its request was read whole is read and dropped for at most
# this long in all, and this long without a byte (nginx: lingering_time 30 s, lingering_timeout 5 s).
LINGER_S = 30.0
LINGER_IDLE_S = 5.0
_monotonic = time.monotonic


class Handler(Protocol):
    max_header_bytes: int
    max_body_bytes: int
    max_connections: int
    conns: set[ClientConn]
    lingering: set[ClientConn]  # answered and closing, still reading: they hold a descriptor too

    def handle(self, conn: ClientConn, req: Request) -> Awaitable[None] | None: ...

    def check_head(self, req: Request, body_bytes: int) -> tuple[int, str, str, bytes] | None:
        """Refuse a request on its head alone, before its body is read: (status, message, code,
        extra head lines). ``body_bytes``: its Content-Length, -1 for a chunked body."""

    def refused(self, conn: ClientConn, req: Request | None, status: int, code: str) -> None:
        """A request answered with an error while it was still being read (its log line and metrics)."""


class ClientConn(asyncio.Protocol):
    __slots__ = (
        "_body_len",
        "_body_parts",
        "_buf",
        "_clen",
        "_dec",
        "_req",
        "_scan",
        "busy",
        "closed",
        "exchange",
        "h",
        "keep_alive",
        "last_io",
        "linger_left",
        "lingering_since",
        "paused",
        "peer",
        "reading_paused",
        "reading_since",
        "task",
        "tr",
    )

    def __init__(self, handler: Handler) -> None:
        self.h = handler
        self.tr: asyncio.Transport | None = None
        # Unparsed bytes: the read itself when one read holds them all (the common case), else a
        # bytearray that grows in place (a body in many small reads costs O(n), not O(n^2)).
        self._buf: bytes | bytearray = b""
        self._scan = 0  # where the search for the head's end resumes in a head still arriving
        self._req: Request | None = None
        self._clen = 0
        self._dec: ChunkedDecoder | None = None
        self._body_parts: list[bytes] = []
        self._body_len = 0
        self.reading_since = 0.0  # when the request being read began to arrive (0: none is)
        self.busy = False
        self.closed = False
        self.paused = False
        self.reading_paused = False  # we paused reading: a client pipelining far ahead
        self.keep_alive = True
        self.task: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.last_io = _monotonic()
        self.peer = ""
        self.lingering_since = 0.0  # when the router answered and began to discard what the client still sends
        self.linger_left = 0  # bytes it will still read and drop: the rest of the refused body

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
        if len(self.h.conns) + len(self.h.lingering) >= self.h.max_connections:
            # Over the limit: answered and closed at once, so a flood of idle connections cannot
            # take the file descriptors that the serving ones need.
            self._reject(None, 503, "too many connections to the router", "too_many_connections", linger=False)
            return
        self.h.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.h.conns.discard(self)
        self.h.lingering.discard(self)
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
        if self.lingering_since:
            # Answered and closing: what is still coming is read and dropped, up to the rest of
            # the refused body, then the connection is closed (nothing unread: no reset).
            self.linger_left -= len(data)
            if self.linger_left <= 0 and self.tr is not None:
                self.tr.close()
            return
        buf = self._buf
        if not buf:
            self._buf = data
        elif type(buf) is bytes:
            self._buf = bytearray(buf) + data
        else:
            buf += data
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
                if buf.startswith(b"\r\n"):
                    # Empty lines before a request line are ignored (RFC 9112 2.2): a client's
                    # stray CRLF after a body, say.
                    buf = self._buf = _skip_empty_lines(buf)
                    self._scan = 0
                    self._reading()  # blank lines are no request: its read deadline keeps running
                    if not buf:
                        return
                if not buf:
                    self.reading_since = 0.0
                    return
                idx = buf.find(b"\r\n\r\n", self._scan)
                if idx < 0 or idx > h.max_header_bytes:
                    if idx > h.max_header_bytes or len(buf) > h.max_header_bytes:
                        self._reject(None, 431, "request head too large", "request_header_too_large")
                        return
                    if idx < 0 and buf.find(b"\n\n", max(0, self._scan - 1)) >= 0:
                        # A head whose lines end in a bare LF (a CRLF head never holds "\n\n"):
                        # refused now, not held until the read timeout for a CRLF that never comes.
                        self._reject(None, 400, "request head lines must end in CRLF", "bad_request")
                        return
                    self._scan = max(0, len(buf) - 3)
                    self._reading()
                    return
                self._scan = 0
                try:
                    req, clen, chunked = parse_request_head(bytes(buf[:idx]))
                except BadRequest as e:
                    self._reject(None, e.status, e.message, e.code)
                    return
                if not req.has_host and req.version == b"HTTP/1.1":
                    self._reject(req, 400, "an HTTP/1.1 request needs a Host header", "bad_request")
                    return
                buf = self._buf = buf[idx + 4 :]
                self.keep_alive = req.keep_alive
                if chunked:
                    self._dec = ChunkedDecoder()
                    self._body_parts = []
                    self._body_len = 0
                    self._clen = -1
                else:
                    clen = clen or 0
                    if clen > h.max_body_bytes:
                        msg = f"request body is {clen} bytes; the limit is {h.max_body_bytes}"
                        self._reject(req, 413, msg, "request_too_large", left=clen - len(buf))
                        return
                    self._clen = clen
                if chunked or len(buf) < clen:
                    # Refused on its head (no API key, ...): the body is never parsed nor kept
                    # (what arrives of it is read and dropped while the connection lingers).
                    refusal = h.check_head(req, -1 if chunked else clen)
                    if refusal is not None:
                        self._reject(req, *refusal, left=None if chunked else clen - len(buf))
                        return
                self._req = req
                if req.expect_continue and (chunked or len(buf) < self._clen):
                    self.tr.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
            if self._clen >= 0:
                if len(buf) < self._clen:
                    self._reading()
                    return
                body = buf[: self._clen]
                rest = buf[self._clen :]
                req.body = bytes(body) if type(body) is bytearray else body
                self._buf = bytes(rest) if type(rest) is bytearray else rest
            else:
                dec = self._dec
                try:
                    payload, rest = dec.feed(bytes(buf) if type(buf) is bytearray else buf)  # type: ignore[union-attr]
                except ValueError:
                    self._reject(req, 400, "malformed chunked request body", "bad_request")
                    return
                self._buf = b""
                if payload:
                    self._body_parts.append(payload)
                    self._body_len += len(payload)
                    if self._body_len > h.max_body_bytes:
                        msg = f"request body is over the limit of {h.max_body_bytes} bytes"
                        self._reject(req, 413, msg, "request_too_large")
                        return
                if not dec.done:  # type: ignore[union-attr]
                    self._reading()
                    return
                req.body = b"".join(self._body_parts)
                self._body_parts = []
                self._buf = rest
            self._req = None
            self.reading_since = 0.0
            self.busy = True
            self.task = asyncio.get_running_loop().create_task(self._run(req))

    def _reading(self) -> None:
        """A request is arriving but incomplete: its read deadline runs from its first byte."""
        if not self.reading_since:
            self.reading_since = _monotonic()

    def read_timed_out(self, timeout: float) -> None:
        """The request being read did not arrive whole in time (a slow or stalled sender)."""
        req = self._req
        left = self._clen - len(self._buf) if req is not None and self._clen >= 0 else None
        self._reject(req, 408, f"the request did not arrive within {timeout:g} s", "request_timeout", left=left)

    def _reject(
        self,
        req: Request | None,
        status: int,
        message: str,
        code: str,
        extra: bytes = b"",
        *,
        linger: bool = True,
        left: int | None = None,
    ) -> None:
        """Answer an error before the request was read whole (``req``: its head, when parsed), and close.

        The client may still be sending (the body of a 413 or a 401): closing with its bytes
        unread would reset the connection, and a reset can destroy the answer before the client
        reads it (an HTTP client reads only once it has sent the whole body). So the router
        half-closes, then reads and drops what still comes, as nginx's lingering close does: up
        to ``left`` bytes (the rest of the refused body; None: not known, as much as a body
        may be), for up to ``LINGER_S`` (``LINGER_IDLE_S`` without a byte), and closes then or
        once the client has. Lingering connections count against ``max_connections``."""
        self.keep_alive = False
        self.reading_since = 0.0
        data = error_response(status, message, code, keep_alive=False, extra=extra)
        if req is not None and req.method == b"HEAD":
            data = head_only(data)
        self.write(data)
        if not (linger and self._linger(left)):
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
            try:  # noqa: SIM105 - the hot path: a bare try costs nothing, suppress() a context manager
                self.tr.write(data)  # type: ignore[union-attr]
            except RuntimeError:
                # uvloop: the client reset the connection and connection_lost (which cancels the
                # request) is still queued; raising here would fail the engine's side instead.
                pass

    def _linger(self, left: int | None) -> bool:
        tr = self.tr
        if tr is None or self.closed or not tr.can_write_eof():
            return False
        limit = 2 * self.h.max_body_bytes  # what one refused request may make the router read, at most
        if left is not None and left <= 0:
            return False  # all of it is here: nothing to wait for
        self.linger_left = limit if left is None else min(left, limit)
        self.closed = True  # no more answers on it
        self.h.conns.discard(self)
        self.h.lingering.add(self)
        self._buf = b""
        self._body_parts = []
        self.lingering_since = self.last_io = _monotonic()
        try:
            tr.write_eof()
        except (OSError, RuntimeError):
            tr.abort()
            return True
        if self.reading_paused:
            self.reading_paused = False
            tr.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_IDLE_S, self._linger_check)
        return True

    def _linger_check(self) -> None:
        tr = self.tr
        if tr is None or tr.is_closing():
            return
        now = _monotonic()
        idle_left = self.last_io + LINGER_IDLE_S - now
        total_left = self.lingering_since + LINGER_S - now
        if idle_left <= 0 or total_left <= 0:
            tr.abort()  # the client neither finished nor closed: give up on it
            return
        asyncio.get_running_loop().call_later(min(idle_left, total_left), self._linger_check)

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


def _skip_empty_lines(buf: bytes | bytearray) -> bytes | bytearray:
    """``buf`` without the CRLFs at its start."""
    return buf[_EMPTY_LINES.match(buf).end() :]  # type: ignore[union-attr]


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft open-files limit toward the hard one, so that ``max_connections``
    clients (each with an engine connection of its own) fit; returns the soft limit now
    (-1: unlimited or unknown). The router caps its connections to what this allows."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Linux
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * max_connections + 256
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return -1 if soft == resource.RLIM_INFINITY else soft
