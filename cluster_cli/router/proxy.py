"""Forward one OpenAI request to an endpoint, retrying only before the client saw a byte.

``Exchange`` is the upstream connection's sink for one attempt. It writes to the client
straight from the protocol callbacks (no task switch per chunk), defers the response
head until the first body bytes so that an engine failing after its head is still
retried elsewhere, holds back an incomplete SSE event (a client cannot use half an
event anyway) so that a stream cut by its upstream ends with a clean SSE error event
and terminating chunk, and tells the waiting coroutine how the attempt ended.

A stream that may be continued elsewhere (``state`` set) is relayed as the engine sends it
while ``resume.StreamState`` reads along; cut, it ends nothing itself: the forwarding loop
continues it through a ``Continuation``, which writes a new engine's stream into the same
response through a ``resume.Seam``. A non-streamed answer small enough to hold
(``HOLD_MAX``) is held until it is whole, so that an engine failing in the middle of it is
retried elsewhere: the client has had nothing yet.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from cluster_cli.router.http import REASONS
from cluster_cli.router.resume import Seam, StreamState, cut_event
from cluster_cli.router.upstream import LENGTH, UNTIL_CLOSE, UpstreamConn, UpstreamError

if TYPE_CHECKING:
    from cluster_cli.router.balancer import Lease
    from cluster_cli.router.server import ClientConn

# How an attempt ended.
OK = 0  # response relayed completely
RETRY_5XX = 1  # upstream answered 5xx (or 429: too busy), nothing relayed: may retry
FAIL_BEFORE = 2  # upstream failed before any byte reached the client: may retry
FAIL_AFTER = 3  # upstream failed after bytes reached the client: stream closed cleanly or connection aborted
REFUSED = 4  # a Continuation's engine answered with something other than a stream (its body in ``refused``)

# A non-streamed answer up to this long is held until whole (a chat completion is a few KiB):
# one cut in the middle of it is then retried elsewhere, not a truncated body. Longer ones
# (embeddings of large batches) are relayed as they come.
HOLD_MAX = 1 << 20
_REFUSAL_MAX = 4096  # of an engine's refusal of a continuation, the bytes kept for the client's error event
_END = b"0\r\n\r\n"  # the terminating chunk

# 5xx answers that say the engine does not do this (501 Not Implemented: embeddings asked
# of a chat-only llama-server, 505): every replica would say the same, so relayed, not retried.
NOT_RETRIED = frozenset({501, 505})

# The reason phrase of a relayed status: the standard one (the engine's own for a code that has none).
PHRASES = {s.value: s.phrase.encode() for s in HTTPStatus} | REASONS
_PHRASE = re.compile(rb"[\t\x20-\x7e]*")  # what a relayed reason phrase may hold (no CR/LF: no response splitting)


class Exchange:
    __slots__ = (
        "abort_client",
        "chunked",
        "client",
        "conn",
        "cut_why",
        "done_seen",
        "error",
        "first_at",
        "framing",
        "fut",
        "hold",
        "http10",
        "may_retry",
        "on_answer",
        "out",
        "pending",
        "probe",
        "relayed",
        "sent",
        "sse",
        "stall_s",
        "stalled",
        "state",
        "status",
        "tail",
    )

    def __init__(
        self, client: ClientConn, conn: UpstreamConn, may_retry: bool, fut: asyncio.Future[int], http10: bool = False
    ) -> None:
        self.client = client
        self.http10 = http10  # an HTTP/1.0 client knows no chunked encoding: the body ends with the connection
        self.conn = conn
        self.may_retry = may_retry
        self.probe: Lease | None = None  # set when this request is its breaker's half-open probe
        self.on_answer: Callable[[], None] | None = None  # called once the engine's answer is taken
        self.fut = fut
        self.status = 0
        self.sent = False
        self.pending: bytes | None = None
        self.out: list[bytes] = []  # bytes for the client, written by flush() once per upstream read
        self.abort_client = False  # set when the client must see a cut: the waiting coroutine aborts it
        self.sse = False
        self.chunked = False
        self.framing = 0  # how the upstream frames the body (upstream.LENGTH, CHUNKED, UNTIL_CLOSE)
        self.tail = b""
        self.error: UpstreamError | None = None
        self.first_at = 0.0
        self.stalled = False  # the router dropped the client for reading nothing
        self.done_seen = False  # the stream's final ``data: [DONE]`` event was relayed
        self.relayed = 0  # bytes of the engine's answer written to the client (head and framing included)
        # A stream that may be continued elsewhere: what the client was sent. None: a cut ends
        # it with the error event here, saying ``cut_why`` (why it is not continued) if set.
        self.state: StreamState | None = None
        self.cut_why: str | None = None
        self.stall_s = 0.0  # the upstream's stall timeout once the stream reached the client (state set)
        self.hold: bytearray | None = None  # a non-streamed answer held until whole

    def _resolve(self, code: int) -> None:
        if not self.fut.done():
            self.fut.set_result(code)

    # ---------------------------------------------------------------- Sink
    def on_head(self, status: int, lines: list[bytes], ctype: bytes, framing: int) -> None:
        self.status = status
        if (status >= 500 or status == 429) and status not in NOT_RETRIED and self.may_retry:
            # Failed, or too busy (429), before any byte reached the client: another endpoint may serve it.
            self.conn.abort()
            self._resolve(RETRY_5XX)
            return
        if self.on_answer is not None:
            self.on_answer()
        if self.probe is not None and status < 500 and status != 429:
            self.probe.answered()
        self.sse = ctype.startswith(b"text/event-stream")
        self.framing = framing
        phrase = PHRASES.get(status)
        if phrase is None:
            phrase = _engine_phrase(self.conn)
        head = [b"HTTP/1.1 %d %s" % (status, phrase), *lines]
        if status in NOT_RETRIED:
            # Every replica would say the same: OpenAI's clients retry 5xx unless told not to.
            head.append(b"x-should-retry: false")
        if framing == LENGTH:
            if status != 204 and status != 304:  # a 204 carries no Content-Length (RFC 9110 8.6), a 304 no 0
                head.append(b"Content-Length: %d" % self.conn._remaining)
        elif self.http10:
            self.client.keep_alive = False  # the close marks the end of the body
        else:
            self.chunked = True
            head.append(b"Transfer-Encoding: chunked")
        if self.state is not None and not (status == 200 and self.sse and (self.chunked or self.http10)):
            self.state = None  # not a stream a continuation can be appended to
        elif not self.sse and self.may_retry and framing == LENGTH and 0 < self.conn._remaining <= HOLD_MAX:
            self.hold = bytearray()
        if not self.client.keep_alive:
            head.append(b"Connection: close")
        head.append(b"\r\n")
        self.pending = b"\r\n".join(head)

    def on_body(self, data: bytes) -> None:
        if self.sse:
            if self.tail:
                data = self.tail + data
                self.tail = b""
            if not data.endswith(b"\n\n"):
                cut = _event_end(data)
                self.tail = data[cut:]
                data = data[:cut]
                if not data:
                    return
            if data[-24:].rstrip(b"\r\n").endswith(b"data: [DONE]"):  # the event that ends an OpenAI stream
                self.done_seen = True
            if self.state is not None:
                self.state.feed(data)
        elif self.hold is not None:
            self.hold += data
            return
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self.pending is not None:
            self.out.append(self.pending)
            self.pending = None
            self.sent = True
            self.first_at = self.client.now()
            if self.state is not None:
                self.conn.stall_timeout = self.stall_s
        self.out.append(data)

    def on_end(self) -> None:
        tail = self.tail
        if tail:
            self.tail = b""
            done = tail[-24:].rstrip(b"\r\n").endswith(b"data: [DONE]")
            if self.framing == UNTIL_CLOSE and not done:
                # The body ended with the connection in the middle of an event: it was cut.
                self.on_error(UpstreamError("reset", "upstream closed the connection mid-event"))
                return
            if done:
                self.done_seen = True
            # The body is complete (its length or its chunks said so): its last event is relayed
            # as it is, framed the way the client's response is.
            self.out.append(b"%x\r\n%b\r\n" % (len(tail), tail) if self.chunked else tail)
        if self.hold is not None:
            self.out.append(bytes(self.hold))
            self.hold = None
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        if self.pending is not None:
            self.out.insert(0, self.pending)
            self.pending = None
            self.sent = True
            self.first_at = self.client.now()
        self._resolve(OK)

    def flush(self) -> None:
        out = self.out
        if not out:
            return
        client = self.client
        data = out[0] if len(out) == 1 else b"".join(out)
        self.relayed += len(data)
        client.write(data)
        out.clear()
        if client.paused and not self.fut.done():
            self.conn.pause()

    def on_error(self, exc: UpstreamError) -> None:
        self.flush()  # what was relayed before the failure goes first
        self.error = exc
        if not self.sent:
            self._resolve(FAIL_BEFORE)
            return
        if self.sse and (self.chunked or self.http10):
            self.tail = b""
            if self.state is not None:  # the forwarding loop continues it, or ends it
                self._resolve(FAIL_AFTER)
                return
            event = cut_event(exc.message, self.cut_why)
            self.client.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event) if self.chunked else event)
        else:
            # A truncated plain body must not look complete: the client's connection is reset,
            # by the waiting coroutine once it has recorded the engine's failure (aborting here
            # would cancel it first, and the cut would read as the client's doing).
            self.abort_client = True
        self._resolve(FAIL_AFTER)

    def client_backlog(self) -> int:
        """Bytes written to the client that it has not taken yet."""
        tr = self.client.tr
        return tr.get_write_buffer_size() if tr is not None and not self.client.closed else 0

    def client_stalled(self) -> None:
        """The client stopped reading for a whole idle timeout: drop it (the engine is not at fault)."""
        self.stalled = True
        self.client.abort()

    def cancel(self) -> None:
        """The client went away: drop the upstream request now so the engine frees the slot."""
        self.conn.abort()


class Continuation(Exchange):
    """The sink of a request that continues a cut stream: its engine's stream is written into
    the client's response (already started: no head) through ``seam``.

    An answer other than a 200 stream is not relayed: a 5xx or 429 resolves ``RETRY_5XX``
    (another replica may take it), anything else ``REFUSED`` with its first bytes in
    ``refused``, for the client's error event. Ended whole (``data: [DONE]`` relayed), it
    writes the response's end and resolves ``OK``; cut, or ended before the stream's end, it
    resolves ``FAIL_AFTER`` and writes nothing more.
    """

    __slots__ = ("body", "refused", "seam")

    def __init__(
        self,
        client: ClientConn,
        conn: UpstreamConn,
        fut: asyncio.Future[int],
        first: Exchange,
        state: StreamState,
        body: dict[str, Any],
    ) -> None:
        super().__init__(client, conn, False, fut, first.http10)
        self.chunked = first.chunked
        self.sse = True
        self.sent = True  # the client's response started with the first engine's
        self.status = first.status
        self.state = state
        self.stall_s = first.stall_s
        self.body = body  # the client's request: what the seam gives it (usage, timings)
        self.seam: Seam | None = None
        self.refused: bytearray | None = None

    def on_head(self, status: int, lines: list[bytes], ctype: bytes, framing: int) -> None:
        self.framing = framing
        if status == 200 and ctype.startswith(b"text/event-stream"):
            if self.on_answer is not None:
                self.on_answer()
            if self.probe is not None:
                self.probe.answered()
            assert self.state is not None
            self.seam = Seam(self.state, self.body)
            return
        self.status = status
        if (status >= 500 or status == 429) and status not in NOT_RETRIED:
            self.conn.abort()
            self._resolve(RETRY_5XX)
            return
        if self.on_answer is not None:
            self.on_answer()
        self.refused = bytearray()

    def on_body(self, data: bytes) -> None:
        if self.refused is not None:
            if len(self.refused) < _REFUSAL_MAX:
                self.refused += data[: _REFUSAL_MAX - len(self.refused)]
            return
        out = self.seam.feed(data)  # type: ignore[union-attr]
        if out:
            self._write(out)

    def _write(self, data: bytes) -> None:
        if not self.first_at:
            self.first_at = self.client.now()
            self.conn.stall_timeout = self.stall_s
        if self.state.done:  # type: ignore[union-attr]
            self.done_seen = True
        self.out.append(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def on_end(self) -> None:
        if self.refused is not None:
            self._resolve(REFUSED)
            return
        out = self.seam.end()  # type: ignore[union-attr]
        if out:
            self._write(out)
        if not self.state.done:  # type: ignore[union-attr]
            self.on_error(UpstreamError("reset", "upstream ended the stream before its end"))
            return
        if self.chunked:
            self.out.append(_END)
        self._resolve(OK)

    def on_error(self, exc: UpstreamError) -> None:
        self.flush()
        self.error = exc
        self._resolve(REFUSED if self.refused is not None else FAIL_AFTER)


def end_stream(client: ClientConn, chunked: bool, data: bytes) -> None:
    """Write the last bytes of a streamed response (framed as it is) and its end."""
    client.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if chunked else data)


def _engine_phrase(conn: UpstreamConn) -> bytes:
    """The engine's own reason phrase, for a status code without a standard one (if it is clean)."""
    phrase = conn.status_line[13:]
    return phrase if _PHRASE.fullmatch(phrase) else b""


def _event_end(data: bytes) -> int:
    """Offset just past the last complete SSE event (blank line) in ``data``; 0 if none."""
    a = data.rfind(b"\n\n")
    b = data.rfind(b"\r\n\r\n")
    end = 0
    if a >= 0:
        end = a + 2
    if b >= 0 and b + 4 > end:
        end = b + 4
    return end
