"""Pooled keep-alive HTTP/1.1 connections to one upstream engine.

An ``UpstreamConn`` carries one exchange at a time and reports it to a ``Sink`` from its
protocol callbacks: ``on_head`` once, ``on_body`` per piece as it arrives (no
buffering), then exactly one of ``on_end`` / ``on_error``, and ``flush`` after each
read, so a sink can send all that one read produced as one write. Finished connections that
may be reused go back to their ``UpstreamPool``; ``abort`` drops the exchange and
closes the socket at once (the engine sees the disconnect and frees the slot).
Idle timeouts are enforced by the router's sweeper through ``last_io``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Protocol

from cluster_cli.router.http import ChunkedDecoder, parse_response_head

_monotonic = time.monotonic

HEAD, LENGTH, CHUNKED, UNTIL_CLOSE, IDLE = range(5)
MAX_HEAD = 64 * 1024


class UpstreamError(Exception):
    """The exchange failed on the upstream side. ``sent`` says whether any byte was written."""

    def __init__(self, kind: str, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.kind = kind  # connect, reset, timeout, stall, response_timeout, protocol, shutdown
        self.message = message
        self.stale = stale  # a reused keep-alive connection closed before answering


class Sink(Protocol):
    def on_head(self, status: int, lines: list[bytes], ctype: bytes, framing: int) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_end(self) -> None: ...
    def on_error(self, exc: UpstreamError) -> None: ...
    def flush(self) -> None: ...
    def client_stalled(self) -> None: ...
    def client_backlog(self) -> int: ...


class UpstreamConn(asyncio.Protocol):
    __slots__ = (
        "_buf",
        "_decoder",
        "_keep",
        "_mode",
        "_remaining",
        "closed",
        "got_bytes",
        "last_io",
        "paused_at",
        "paused_backlog",
        "pool",
        "reused",
        "sink",
        "stall_timeout",
        "status_line",
        "tr",
        "waits_long",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.tr: asyncio.Transport | None = None
        self.closed = False
        self.sink: Sink | None = None
        self._buf = b""
        self._mode = IDLE
        self._remaining = 0
        self._decoder: ChunkedDecoder | None = None
        self._keep = True
        self.got_bytes = False
        self.reused = False
        self.status_line = b""  # the last response's status line (its reason phrase, for codes the router has none for)
        self.last_io = _monotonic()
        self.paused_at: float | None = None
        self.paused_backlog = -1  # the client's unsent bytes at the last sweep while paused
        # The exchange's answer may rightly be long in coming (a non-streamed reply is sent once
        # generated): its head is waited for under the response timeout, not the idle one.
        self.waits_long = False
        # Set by the sink once its stream reached the client, when the stream can be continued
        # elsewhere: silence past it is a stall (0: the idle timeout alone).
        self.stall_timeout = 0.0

    # ---------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        sink = self.sink
        if sink is None:
            return
        self.sink = None
        if self._mode == UNTIL_CLOSE and exc is None:
            # A close-delimited body ends with a clean close; a reset cuts it (RFC 9112 8).
            sink.on_end()
            sink.flush()
            return
        stale = self.reused and not self.got_bytes
        what = "closed the connection" if exc is None else f"connection lost ({exc})"
        if self._mode == HEAD:
            what += " before answering"
        else:
            what += " mid-response"
        sink.on_error(UpstreamError("reset", f"upstream {what}", stale=stale))

    def eof_received(self) -> bool:
        return False

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:  # nothing asked; an upstream talking out of turn is not reusable
            self.abort()
            return
        self.got_bytes = True
        self.last_io = _monotonic()
        try:
            if self._mode == HEAD:
                data = self._head(data)
                if not data or self.sink is None:
                    return
            self._body(data)
        finally:
            # Everything this read produced (head, body, end of stream) goes out as one write.
            sink.flush()

    # ---------------------------------------------------------------- parsing
    def _head(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        while True:
            idx = buf.find(b"\r\n\r\n")
            if idx < 0:
                if len(buf) > MAX_HEAD:
                    self._fail("protocol", "upstream response head too large")
                    return b""
                self._buf = buf
                return b""
            head, buf = buf[:idx], buf[idx + 4 :]
            # The status line is not relayed (the router writes its own); the header lines are.
            try:
                rh = parse_response_head(head)
            except ValueError as e:
                self._fail("protocol", str(e))
                return b""
            if 100 <= rh.status < 200:  # interim response: skip, the real one follows
                continue
            break
        self._buf = b""
        status = rh.status
        self._keep = rh.keep_alive
        clen = rh.length
        chunked = rh.chunked
        ctype = rh.ctype
        kept = rh.lines
        self.status_line = rh.status_line
        if status in (204, 304):
            mode = LENGTH
            self._remaining = 0
        elif chunked:
            mode = CHUNKED
            self._decoder = ChunkedDecoder()
        elif clen >= 0:
            mode = LENGTH
            self._remaining = clen
        else:
            mode = UNTIL_CLOSE
            self._keep = False
        self._mode = mode
        self.sink.on_head(status, kept, ctype, mode)  # type: ignore[union-attr]
        if self.sink is not None and mode == LENGTH and self._remaining == 0:
            if buf:  # bytes after a response that has no body: the connection is out of step
                self._keep = False
            self._finish()
            return b""
        return buf

    def _body(self, data: bytes) -> None:
        mode = self._mode
        sink = self.sink
        if mode == LENGTH:
            n = len(data)
            if n >= self._remaining:
                if n > self._remaining:  # extra bytes after the body: do not reuse
                    self._keep = False
                    data = data[: self._remaining]
                self._remaining = 0
                if data:
                    sink.on_body(data)  # type: ignore[union-attr]
                if self.sink is not None:
                    self._finish()
                return
            self._remaining -= n
            sink.on_body(data)  # type: ignore[union-attr]
        elif mode == CHUNKED:
            dec = self._decoder
            try:
                payload, extra = dec.feed(data)  # type: ignore[union-attr]
            except ValueError as e:
                self._fail("protocol", f"bad chunked body from upstream: {e}")
                return
            if payload:
                sink.on_body(payload)  # type: ignore[union-attr]
            if dec.done and self.sink is not None:  # type: ignore[union-attr]
                if extra:
                    self._keep = False
                self._finish()
        elif mode == UNTIL_CLOSE:
            sink.on_body(data)  # type: ignore[union-attr]

    def _finish(self) -> None:
        sink = self.sink
        self.sink = None
        self._mode = IDLE
        self.pool.done(self, self._keep)
        if sink is not None:
            sink.on_end()

    def _fail(self, kind: str, message: str) -> None:
        sink = self.sink
        self.abort()
        if sink is not None:
            sink.on_error(UpstreamError(kind, message))

    # ---------------------------------------------------------------- driving
    def send(self, data: bytes, sink: Sink) -> None:
        self.sink = sink
        self.paused_at = None
        self._mode = HEAD
        self._buf = b""
        self.got_bytes = False
        self.stall_timeout = 0.0
        self.last_io = _monotonic()
        if self.closed:  # lost while the caller was getting to this (a fresh connect's await)
            asyncio.get_running_loop().call_soon(self.connection_lost, None)  # reported as any close
            return
        self.pool.active.add(self)
        try:  # noqa: SIM105 - the hot path: a bare try costs nothing, suppress() a context manager
            self.tr.write(data)  # type: ignore[union-attr]
        except RuntimeError:
            # uvloop: the engine closed it and its connection_lost is still queued; that call
            # reports the failure to the sink, as a stale connection's, retried on a fresh one.
            pass

    def stalled(self) -> None:
        self._fail("stall", f"upstream stalled: no byte for {self.stall_timeout:g} s")

    def timed_out(self) -> None:
        self._fail("timeout", "upstream idle timeout")

    def fail(self, kind: str, message: str) -> None:
        """End the exchange as failed, from outside (the engine is judged dead, the router stops)."""
        if self.sink is not None:
            self._fail(kind, message)

    def abort(self) -> None:
        """Drop the exchange and the socket now (reset, so the engine notices at once)."""
        self.sink = None
        self._mode = IDLE
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.tr is not None:
                self.tr.abort()

    def pause(self) -> None:
        """The client is not reading: stop reading the engine (TCP backpressure all the way)."""
        if self.tr is not None and not self.closed:
            if self.paused_at is None:
                self.paused_at = _monotonic()
                self.paused_backlog = -1
            self.tr.pause_reading()

    def resume(self) -> None:
        if self.tr is not None and not self.closed:
            self.paused_at = None
            self.last_io = _monotonic()  # the engine was not idle: we were not reading it
            self.tr.resume_reading()


class UpstreamPool:
    """Keep-alive connections to one host:port. LIFO reuse keeps the warmest connection busy."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0, max_idle: int = 512) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle: list[UpstreamConn] = []
        self.active: set[UpstreamConn] = set()
        self.closed = False

    def get_idle(self) -> UpstreamConn | None:
        idle = self.idle
        while idle:
            c = idle.pop()
            # A transport already closing (the engine went away; connection_lost not yet run) is skipped.
            if not c.closed and c.tr is not None and not c.tr.is_closing():
                c.reused = True
                return c
        return None

    async def connect(self) -> UpstreamConn:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConn(self), self.host, self.port), self.connect_timeout
            )
        except TimeoutError:
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} timed out") from None
        except OSError as e:
            raise UpstreamError("connect", f"connect to {self.host}:{self.port} failed: {e.strerror or e}") from None
        return proto  # type: ignore[return-value]

    def done(self, conn: UpstreamConn, keep: bool) -> None:
        self.active.discard(conn)
        if keep and not conn.closed and not self.closed and len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.closed = True
            if conn.tr is not None:
                conn.tr.close()

    def fail_unanswered(self, message: str, silent_for: float, now: float) -> int:
        """The engine is judged dead: fail the exchanges that relayed nothing to their client
        yet (they may be retried elsewhere), but only if every exchange here has been silent
        for ``silent_for`` seconds. A stream still moving means the engine is alive, only slow
        to answer its health checks: then nothing is cut."""
        active = [c for c in self.active if c.sink is not None]
        if not active or any(now - c.last_io < silent_for for c in active):
            return 0
        victims = [c for c in active if not getattr(c.sink, "sent", True)]
        for c in victims:
            c.fail("timeout", message)
        return len(victims)

    def forget(self, conn: UpstreamConn) -> None:
        self.active.discard(conn)

    def sweep(self, now: float, idle_timeout: float, response_timeout: float = 0.0) -> None:
        """Fail the exchanges that waited too long: ``idle_timeout`` without a byte, except for
        the head of an answer that ``waits_long`` (a non-streamed one, sent once generated):
        ``response_timeout`` (0: no limit), and a stream that may be continued elsewhere, past its
        first byte: its ``stall_timeout``. A client that stopped reading is dropped instead."""
        for c in list(self.active):
            if c.paused_at is not None:
                # Paused because the client is not reading fast enough: the engine is not at
                # fault. A client that drained nothing for a whole idle timeout loses its
                # connection (its lease is released without a verdict on the engine).
                backlog = c.sink.client_backlog() if c.sink is not None else 0
                if backlog != c.paused_backlog:  # it read something: progress, not a stall
                    c.paused_backlog, c.paused_at = backlog, now
                elif now - c.paused_at > idle_timeout and c.sink is not None:
                    c.sink.client_stalled()
            elif c._mode == HEAD and c.waits_long:
                if response_timeout and now - c.last_io > response_timeout:
                    c.fail("response_timeout", f"no answer within {response_timeout:g} s")
            elif c.stall_timeout and now - c.last_io > c.stall_timeout:
                c.stalled()
            elif now - c.last_io > idle_timeout:
                c.timed_out()

    def close_idle(self, now: float, unused_for: float) -> None:
        """Close the kept connections unused for ``unused_for`` seconds or more."""
        keep = []
        for c in self.idle:
            if c.closed:
                continue
            if now - c.last_io >= unused_for:
                c.closed = True
                if c.tr is not None:
                    c.tr.close()
            else:
                keep.append(c)
        self.idle[:] = keep

    def close(self) -> None:
        self.closed = True
        for c in self.idle:
            if not c.closed and c.tr is not None:
                c.closed = True
                c.tr.close()
        self.idle.clear()
