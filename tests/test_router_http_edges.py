"""HTTP/1.1 edge cases of the router's hand-written protocol layer, each against a real router
and a small misbehaving engine on loopback sockets: close-delimited bodies cut by a reset or
in the middle of an SSE event, SSE bodies with a Content-Length, close-delimited metric
scrapes, the Connection header's options, Expect from HTTP/1.0 clients, Host and the
request-target forms, 204 responses and reason phrases, transfer codings other than chunked;
and, on a simulated engine, pipelined requests, HEAD, oversized heads and HTTP/1.0 streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from helpers import chat_request, read_until
from simengine import Fleet, LoopThread

from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.http import fetch, parse_request_head

HANG_GUARD = 10.0  # seconds: only so that a broken router fails a test instead of hanging it
BODY = b'{"model":"raw","messages":[{"role":"user","content":"hi"}]}'
JSON = b'{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'

# What a script gets: the engine's socket for this connection, the request head, and the
# connection's number (1, 2, ... in accept order). It returns whether to keep serving it.
Script = Callable[[socket.socket, bytes, int], bool]


class RawEngine:
    """A threaded engine on 127.0.0.1 that answers each POST with whatever ``script`` writes;
    GETs (health checks, metric scrapes) get an empty 200. ``posts`` records (connection
    number, head) for each POST."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.posts: list[tuple[int, bytes]] = []
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.socks: list[socket.socket] = []
        self.n = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                self.n += 1
                n = self.n
                self.socks.append(s)
            threading.Thread(target=self._serve, args=(s, n), daemon=True).start()

    def _serve(self, s: socket.socket, n: int) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    d = s.recv(65536)
                    if not d:
                        return
                    buf += d
                head, _, buf = buf.partition(b"\r\n\r\n")
                clen = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        clen = int(line.split(b":", 1)[1])
                while len(buf) < clen:
                    d = s.recv(65536)
                    if not d:
                        return
                    buf += d
                buf = buf[clen:]
                if head.startswith(b"GET "):
                    s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    continue
                with self.lock:
                    self.posts.append((n, head))
                if not self.script(s, head, n):
                    s.close()
                    return
        except OSError:
            return

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.lsock.close()
        with self.lock:
            for s in self.socks:
                with contextlib.suppress(OSError):
                    s.close()


def reset(s: socket.socket) -> None:
    """Close with a TCP reset (RST), not a FIN."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.fixture
def router() -> Iterator[Callable[[Script], tuple[Fleet, RawEngine]]]:
    """``router(script)`` starts a RawEngine and a router with it as model ``raw``'s only endpoint."""
    started: list[tuple[Fleet, RawEngine]] = []

    def start(script: Script) -> tuple[Fleet, RawEngine]:
        eng = RawEngine(script)
        f = Fleet(0)
        ep = {"url": f"http://127.0.0.1:{eng.port}", "engine": "vllm", "replica": "raw"}
        cfg = {
            "engines": {"vllm": {"metrics": {}}},
            "models": {"raw": {"endpoints": [ep]}},
            "router": {
                "retry": {"max_attempts": 1},
                "breaker": {"failure_threshold": 1000, "health_failure_threshold": 1000},
            },
        }
        started.append((f.start(cfg=cfg), eng))
        return f, eng

    try:
        yield start
    finally:
        for f, eng in started:
            eng.close()
            f.close()


def post(extra: bytes = b"", version: bytes = b"HTTP/1.1", target: bytes = b"/v1/chat/completions") -> bytes:
    return b"POST %b %b\r\nHost: r\r\n%bContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        target,
        version,
        extra,
        len(BODY),
        BODY,
    )


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(HANG_GUARD)
    return s


def read_to_close(s: socket.socket) -> tuple[bytes, bool]:
    """Everything until the router closes; also whether it was a reset."""
    out = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                return out, False
            out += d
    except ConnectionResetError:
        return out, True
    except TimeoutError:  # the hang guard: what came is checked by the caller
        return out, False


class Reader:
    """Reads framed responses off one client socket, like a keep-alive HTTP/1.1 client."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""

    def _more(self) -> None:
        d = self.s.recv(65536)
        if not d:
            raise EOFError("the router closed the connection")
        self.buf += d

    def until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._more()
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[bytes, dict[bytes, bytes], bytes]:
        """(status line, lower-cased headers, de-chunked body) of the next response."""
        head = self.until(b"\r\n\r\n")[:-4].split(b"\r\n")
        headers = {}
        for line in head[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if b"content-length" in headers:
            return head[0], headers, self.exactly(int(headers[b"content-length"]))
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size = int(self.until(b"\r\n")[:-2], 16)
                if size == 0:
                    self.until(b"\r\n")
                    return head[0], headers, body
                body += self.exactly(size + 2)[:-2]
        return head[0], headers, b""  # no body (204, 304)


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` events of a chunked SSE response (head included in ``raw``)."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    payload = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        payload, body = payload + body[:size], body[size + 2 :]
    return [e for e in payload.split(b"\n\n") if e]


def worker_counts(f: Fleet, eng: RawEngine) -> tuple[int, int]:
    w = f.router.table.endpoints[f"http://127.0.0.1:{eng.port}"]  # type: ignore[union-attr]
    f.lt.wait_for(lambda: w.inflight == 0, what="the request to leave the endpoint")
    return f.lt.call(lambda: (w.completed, w.failed))


# ---------------------------------------------------------------------------- 1. close-delimited bodies cut
def test_close_delimited_body_cut_by_a_reset_is_not_relayed_as_complete(router) -> None:
    seen = threading.Event()

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + JSON[:40])
        seen.wait(HANG_GUARD)  # the client has the first part: the router read it
        reset(s)
        return False

    f, eng = router(script)
    with connect(f.port) as c:
        c.sendall(post())
        out = b""
        while JSON[:40] not in out:
            d = c.recv(65536)
            assert d, out
            out += d
        seen.set()
        rest, _ = read_to_close(c)  # returns: the router ends the connection, not the response
    out += rest
    assert out.startswith(b"HTTP/1.1 200 ")
    assert not out.endswith(b"0\r\n\r\n")  # no clean end of a chunked body: the client sees the cut
    assert worker_counts(f, eng) == (0, 1)  # a failure of the engine, not a success


@pytest.mark.parametrize("by_reset", [True, False])
def test_close_delimited_sse_cut_mid_event_ends_with_the_error_event(router, by_reset: bool) -> None:
    """Cut by a reset, or ended by a clean close right in an event: the half event is never
    relayed as complete; the stream ends with the ``upstream_stream_cut`` event."""
    seen = threading.Event()

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {"i":0}\n\ndata: {"i":1, "pa')
        seen.wait(HANG_GUARD)
        if by_reset:
            reset(s)
        else:
            s.shutdown(socket.SHUT_WR)
        return False

    f, eng = router(script)
    with connect(f.port) as c:
        c.sendall(post())
        r = Reader(c)
        raw = r.until(b'data: {"i":0}\n\n')
        seen.set()
        raw += r.until(b"\r\n0\r\n\r\n")  # the stream ends (cleanly, for an SSE client)
    events = sse_events(raw)
    assert events[0] == b'data: {"i":0}' and len(events) == 2  # no half event
    err = json.loads(events[-1][6:])["error"]
    assert err["code"] == "upstream_stream_cut"
    assert worker_counts(f, eng) == (0, 1)


# ---------------------------------------------------------------------------- 2. SSE tail framing
@pytest.mark.parametrize(
    "status, body",
    [
        (b"200 OK", b'data: {"a":1}\n\ndata: [DONE]\n'),  # the last event without its blank line
        (b"400 Bad Request", b'{"error":{"message":"boom"}}'),  # an error labelled as a stream
    ],
)
def test_sse_with_a_content_length_is_relayed_byte_for_byte(router, status: bytes, body: bytes) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        if b"X-Second" in head:
            s.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(JSON), JSON)
            )
        else:
            ans = b"HTTP/1.1 %b\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%b"
            s.sendall(ans % (status, len(body), body))
        return True

    f, _ = router(script)
    with connect(f.port) as c:
        r = Reader(c)
        c.sendall(post())
        line, headers, got = r.response()
        assert line.startswith(b"HTTP/1.1 " + status[:3])
        assert (headers[b"content-length"], got) == (b"%d" % len(body), body)
        c.sendall(post(b"X-Second: 1\r\n"))  # the same connection is still in step
        line, _, got = r.response()
        assert (line, got) == (b"HTTP/1.1 200 OK", JSON)


def test_complete_sse_body_reaches_an_http10_client_without_chunk_framing(router) -> None:
    body = b'data: {"a":1}\n\ndata: [DONE]\n'

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        )
        return True

    f, _ = router(script)
    with connect(f.port) as c:
        c.sendall(post(version=b"HTTP/1.0"))
        out, _ = read_to_close(c)
    assert out.split(b"\r\n\r\n", 1)[1] == body


# ---------------------------------------------------------------------------- 3. fetch of a close-delimited body
def test_fetch_reads_a_close_delimited_body_to_the_end_and_caps_it() -> None:
    text = b"".join(b"vllm:some_metric_%d 1\n" % i for i in range(300)) + b"vllm:num_requests_running 7\n"

    async def main() -> None:
        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + text[:1000])  # as prometheus_client
            await w.drain()
            await asyncio.sleep(0.05)  # the rest in another segment
            w.write(text[1000:])
            await w.drain()
            w.close()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        try:
            assert await fetch("127.0.0.1", port, "/metrics", HANG_GUARD) == (200, text)
            with pytest.raises(ValueError, match="too large"):  # as for a Content-Length over the cap
                await fetch("127.0.0.1", port, "/metrics", HANG_GUARD, max_bytes=2000)
        finally:
            srv.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------- 4. the Connection header
@pytest.mark.parametrize(
    "lines, keep",
    [
        (b"Connection: close\r\nConnection: foo", False),
        (b"Connection: foo\r\nConnection: close", False),
        (b"Connection: Foo ,CLOSE", False),
        (b"Connection: x-closed", True),
        (b"Connection: keep-alive, x-closed", True),
    ],
)
def test_connection_options_are_a_token_list_across_all_lines(lines: bytes, keep: bool) -> None:
    req, _, _ = parse_request_head(b"GET /health HTTP/1.1\r\nHost: r\r\n" + lines)
    assert req.keep_alive is keep


def test_client_close_is_kept_when_another_connection_line_follows(router) -> None:
    f, _ = router(lambda s, head, n: True)
    with connect(f.port) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\nConnection: foo\r\n\r\n")
        out, _ = read_to_close(c)  # returns: the router closed
    assert out.startswith(b"HTTP/1.1 200 ") and b"Connection: close\r\n" in out


def test_headers_named_in_connection_are_not_forwarded_either_way(router) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: X-Secret, keep-alive\r\n"
            b"X-Secret: internal\r\nX-Public: yes\r\nContent-Length: %d\r\n\r\n%b" % (len(JSON), JSON)
        )
        return True

    f, eng = router(script)
    with connect(f.port) as c:
        c.sendall(post(b"Connection: x-internal\r\nX-Internal: secret\r\nX-Other: fine\r\n"))
        line, headers, body = Reader(c).response()
    assert (line, body) == (b"HTTP/1.1 200 OK", JSON)
    assert b"x-secret" not in headers and headers[b"x-public"] == b"yes"
    ((_, head),) = eng.posts
    assert b"x-internal" not in head.lower() and b"X-Other: fine\r\n" in head


@pytest.mark.parametrize(
    "conn_lines, reused",
    [
        (b"Connection: close\r\nConnection: keep-alive\r\n", False),  # close wins, whatever comes after
        (b"Connection: x-closed\r\n", True),  # not "close"
    ],
)
def test_engine_connection_options_decide_reuse(router, conn_lines: bytes, reused: bool) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b"
            % (conn_lines, len(JSON), JSON)
        )
        return True  # the engine itself keeps serving the connection either way

    f, eng = router(script)
    with connect(f.port) as c:
        r = Reader(c)
        for _ in range(2):
            c.sendall(post())
            assert r.response()[2] == JSON
    (a, _), (b, _) = eng.posts
    assert (a == b) is reused


def test_an_http_1_0_client_asking_for_keep_alive_is_not_kept() -> None:
    req = parse_request_head(b"GET /health HTTP/1.0\r\nHost: a\r\nConnection: keep-alive")[0]
    assert req.keep_alive is False
    assert parse_request_head(b"GET /health HTTP/1.1\r\nHost: a")[0].keep_alive is True


# ---------------------------------------------------------------------------- 5. Expect from HTTP/1.0
def test_http10_expect_continue_is_ignored(router) -> None:
    req, _, _ = parse_request_head(b"POST /v1/chat/completions HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2")
    assert not req.expect_continue
    req, _, _ = parse_request_head(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue")
    assert req.expect_continue

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(JSON), JSON)
        )
        return True

    f, _ = router(script)
    with connect(f.port) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = post(b"Expect: 100-continue\r\n", version=b"HTTP/1.0")
        head_end = data.index(b"\r\n\r\n") + 4
        c.sendall(data[:head_end])  # the head alone: a 100 would be sent now
        time.sleep(0.1)  # not an assertion on time: only so that the body comes in a later read
        c.sendall(data[head_end:])
        out, _ = read_to_close(c)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b" 100 " not in out


# ---------------------------------------------------------------------------- 6. Host, target forms, empty lines
@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /health HTTP/1.1\r\n\r\n", b"400"),  # no Host
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),  # two Host lines
        (b"GET /health HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),
        (b"GET /health HTTP/1.0\r\n\r\n", b"200"),  # HTTP/1.0 needs none
        (b"GET http://r/health HTTP/1.1\r\nHost: r\r\n\r\n", b"200"),  # absolute form
        (b"GET http://r:8080/health?x=1 HTTP/1.1\r\nHost: r\r\n\r\n", b"200"),
        (b"\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n", b"200"),  # an empty line first
        (b"\r\n\r\n\r\nGET /health HTTP/1.1\r\nHost: r\r\n\r\n", b"200"),
    ],
)
def test_host_and_request_line_forms(router, request_bytes: bytes, status: bytes) -> None:
    f, _ = router(lambda s, head, n: True)
    with connect(f.port) as c:
        c.sendall(request_bytes)
        line = Reader(c).response()[0]
    assert line.startswith(b"HTTP/1.1 " + status + b" "), line


def test_absolute_form_is_forwarded_in_origin_form_and_a_stray_crlf_after_a_body_is_skipped(router) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(JSON), JSON)
        )
        return True

    f, eng = router(script)
    with connect(f.port) as c:
        r = Reader(c)
        c.sendall(post(target=b"http://router.example/v1/chat/completions?x=1") + b"\r\n")
        assert r.response()[:1] == (b"HTTP/1.1 200 OK",)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")  # after the stray CRLF, same connection
        assert r.response()[0] == b"HTTP/1.1 200 OK"
    ((_, head),) = eng.posts
    assert head.startswith(b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n")


# ---------------------------------------------------------------------------- 7. 204 and reason phrases
@pytest.mark.parametrize(
    "upstream_status, relayed",
    [
        (b"204 No Content", b"HTTP/1.1 204 No Content"),
        (b"201 Created", b"HTTP/1.1 201 Created"),
        (b"403 Forbidden", b"HTTP/1.1 403 Forbidden"),
        (b"422 Whatever", b"HTTP/1.1 422 Unprocessable Entity"),  # the standard phrase
        (b"299 Custom", b"HTTP/1.1 299 Custom"),  # no standard one: the engine's
    ],
)
def test_relayed_status_lines_and_204_without_content_length(router, upstream_status: bytes, relayed: bytes) -> None:
    no_body = upstream_status.startswith(b"204")

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        if no_body:
            s.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        else:
            ans = b"HTTP/1.1 %b\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
            s.sendall(ans % upstream_status)
        return True

    f, _ = router(script)
    with connect(f.port) as c:
        r = Reader(c)
        c.sendall(post())
        line, headers, body = r.response()
        if no_body:
            assert b"content-length" not in headers and b"transfer-encoding" not in headers
        else:
            assert body == b"{}"
        assert line == relayed
        c.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")  # still in step
        assert r.response()[0] == b"HTTP/1.1 200 OK"


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 204 No Content\r\n\r\nhello",
        b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nhello",  # a 204 has no body, whatever it says
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\nhello",
    ],
)
def test_bytes_after_a_bodiless_response_keep_the_connection_out_of_the_pool(router, answer: bytes) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(answer if b"X-First" in head else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        return True

    f, eng = router(script)
    with connect(f.port) as c:
        r = Reader(c)
        c.sendall(post(b"X-First: 1\r\n"))
        assert r.response()[0].startswith(b"HTTP/1.1 20")
        c.sendall(post())
        assert r.response()[2] == b"{}"
    (a, _), (b, _) = eng.posts
    assert a != b  # the second request went on a fresh engine connection


def test_an_engines_own_reason_phrase_is_relayed_only_when_clean() -> None:
    from types import SimpleNamespace

    from cluster_cli.router.proxy import _engine_phrase

    assert _engine_phrase(SimpleNamespace(status_line=b"HTTP/1.1 599 Network Timeout")) == b"Network Timeout"
    for dirty in (b"HTTP/1.1 599 Bad\x1b[31m red", b"HTTP/1.1 599 a\rSet-Cookie: x", b"HTTP/1.1 599 nul\x00"):
        assert _engine_phrase(SimpleNamespace(status_line=dirty)) == b""


# ---------------------------------------------------------------------------- 8. transfer codings
def test_a_transfer_coding_other_than_chunked_is_refused_as_502(router) -> None:
    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(JSON), JSON)
        )
        return True

    f, _ = router(script)
    with connect(f.port) as c:
        c.sendall(post())
        line, _, body = Reader(c).response()
    assert line.startswith(b"HTTP/1.1 502 ")
    assert "Transfer-Encoding" in json.loads(body)["error"]["message"]


def test_a_close_delimited_sse_stream_that_ends_with_done_is_complete(router) -> None:
    """``data: [DONE]`` then the close, without the event's blank line: the stream was served
    whole (as with a length or chunks), not cut."""

    def script(s: socket.socket, head: bytes, n: int) -> bool:
        s.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: {"i":0}\n\ndata: [DONE]\n')
        s.shutdown(socket.SHUT_WR)
        return False

    f, eng = router(script)
    with connect(f.port) as c:
        c.sendall(post())
        raw = Reader(c).until(b"\r\n0\r\n\r\n")
    assert [e.strip() for e in sse_events(raw)] == [b'data: {"i":0}', b"data: [DONE]"]  # relayed as sent
    assert worker_counts(f, eng) == (1, 0)


@pytest.mark.slow
def test_blank_lines_alone_do_not_hold_a_connection_open() -> None:
    """Empty lines before a request are skipped (RFC 9112 2.2), but the request's read deadline
    keeps running: a client sending nothing else is answered 408 and dropped."""
    f = Fleet(1).start(router={"limits": {"request_read_timeout_s": 0.5, "idle_timeout_s": 60}})
    try:
        with connect(f.port) as c:
            got = b""
            for _ in range(int(HANG_GUARD / 0.1)):
                try:
                    c.sendall(b"\r\n")
                except OSError:
                    break  # closed by the router
                c.settimeout(0.1)
                try:
                    chunk = c.recv(65536)
                except TimeoutError:
                    continue
                got += chunk
                if not chunk or b"\r\n\r\n" in got:
                    break
        assert got.startswith(b"HTTP/1.1 408 "), got
    finally:
        f.close()


# ---------------------------------------------------------------------------- 9. pipelining, HEAD and head limits on a simulated engine


@pytest.fixture
def fleet():
    f = Fleet(1, capacity=4, token_delay_s=0.01, tokens=20).start()
    yield f
    f.close()


@pytest.mark.slow
def test_a_connection_keeps_serving_after_a_large_pipelined_request(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(chat_request(10))
        time.sleep(0.05)  # the first request is in flight when a 100 KB one is pipelined behind it
        s.sendall(chat_request(100_000))
        assert read_until(s, 2).count(b"HTTP/1.1 200") == 2
        s.sendall(chat_request(10))  # reading was paused for the big one: it must have been resumed
        assert read_until(s, 1).count(b"HTTP/1.1 200") == 1


def test_a_pipelined_body_larger_than_the_head_limit_still_arrives(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(chat_request(10))
        time.sleep(0.05)
        threading.Thread(target=lambda: s.sendall(chat_request(1_000_000)), daemon=True).start()
        assert read_until(s, 2).count(b"HTTP/1.1 200") == 2


def test_head_on_a_proxied_path_is_a_bare_405(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: r\r\n\r\n" + chat_request(1))
        data = read_until(s, 1)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405") and rest.startswith(b"HTTP/1.1 200")


def test_an_oversized_head_is_refused_even_when_it_arrives_whole(fleet) -> None:
    body = json.dumps({"model": "sim", "messages": []}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 100_000
    head += b"\r\nContent-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(head + body)
        s.settimeout(5)
        assert s.recv(200).startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize("cut", [False, True])
def test_an_http10_client_gets_a_plain_stream_that_ends_with_the_connection(cut: bool) -> None:
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=5).start()
    try:
        if cut:
            f.lt.call(lambda: setattr(f.engines[0], "cut_after", 2))
        body = json.dumps({"model": "sim", "messages": [], "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
            s.settimeout(5)
            data = b""
            while d := s.recv(65536):  # the router closes the connection at the end of the body
                data += d
        head, _, payload = data.partition(b"\r\n\r\n")
        assert b"transfer-encoding" not in head.lower() and payload.startswith(b"data: ")
        events = [e for e in payload.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events), events  # no chunk-size lines in between
        assert (b"upstream_stream_cut" in payload) == cut and (events[-1] == b"data: [DONE]") != cut
    finally:
        f.close()


# ---------------------------------------------------------------------------- 10. a plain body cut by the engine


class _Cutter(asyncio.Protocol):
    """An engine that sends half of a Content-Length body, then resets the connection."""

    def connection_made(self, tr: asyncio.BaseTransport) -> None:
        self.tr = tr

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data and b"/v1/" in data:
            self.tr.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b"{" * 100
            )
            asyncio.get_running_loop().call_later(0.05, self.tr.abort)


def test_a_plain_body_cut_by_the_engine_is_the_engines_failure_not_the_clients() -> None:
    lt = LoopThread()

    async def serve() -> tuple[asyncio.Server, int]:
        srv = await asyncio.get_running_loop().create_server(_Cutter, "127.0.0.1", 0)
        return srv, srv.sockets[0].getsockname()[1]

    srv, port = lt.run(serve())
    url = f"http://127.0.0.1:{port}"
    cfg = RouterConfig.model_validate({
        "models": {"m": {"endpoints": [{"url": url, "replica": "cutter"}]}},
        "router": {"breaker": {"failure_threshold": 3}, "health_interval_s": 1000, "scrape_interval_s": 1000},
    })  # fmt: skip
    r = Router(cfg)
    rport = lt.run(r.start("127.0.0.1", 0))
    try:
        w = r.table.endpoints[url]
        for _ in range(3):
            with pytest.raises(httpx.HTTPError):  # the truncated body must not look complete
                httpx.post(f"http://127.0.0.1:{rport}/v1/chat/completions", json={"model": "m", "messages": []})
        lt.wait_for(lambda: w.failed >= 3, what="the third failure recorded")
        assert w.failed == 3 and lt.call(lambda: w.breaker.stats())["state"] == "open"
        metrics = lt.call(lambda: r.metrics.render()).decode()
        assert 'status="499"' not in metrics
    finally:
        lt.run(r.stop(0.5), 15)
        srv.close()
        lt.close()
