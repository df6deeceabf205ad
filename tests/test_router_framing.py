"""Where each HTTP message ends: the router's request and response framing.

A request body whose end the router reads differently from a front proxy lets a second
request through that the front never saw (request smuggling). The router's parser is held to
RFC 9112 and, by a differential test, to two other parsers (llhttp, as in Node.js and uvicorn,
and h11): every message it hands on, another parser reads the same, or the router refuses.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time

import h11
import httptools
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from simengine import Fleet, LoopThread

from cluster_cli.router.http import (
    BadRequest,
    ChunkedDecoder,
    fetch,
    parse_chunk_size,
    parse_request_head,
    parse_response_head,
)
from cluster_cli.router.server import ClientConn

CHAT = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}]}).encode()
CHAT_POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
CHUNKED_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"

# The two vectors: a chunk extension ended by a bare LF, and a trailer section ended by one.
# A parser that ends lines at LF sees one request in each; a CRLF-only one sees the hidden POST.
BARE_LF_EXTENSION = CHUNKED_HEAD + b"2;\nxx\r\nb1\r\n0\r\n\r\n" + CHAT_POST + b"\r\n0\r\n\r\n"
BARE_LF_TRAILER = CHUNKED_HEAD + b"2\r\nxx\r\n0\r\n\n" + CHAT_POST


def _exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on one connection; everything the router answers until it closes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        s.settimeout(timeout)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                d = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not d:
                break
            out += d
        return out


@pytest.fixture
def fleet():
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(router={"limits": {"request_read_timeout_s": 2}})
    yield f
    f.close()


def _engine_requests(f: Fleet) -> int:
    engine = f.engines[0]
    return f.lt.call(lambda: engine.requests)


# ---------------------------------------------------------------------------- end to end
def test_two_pipelined_requests_reach_the_engine_twice(fleet) -> None:
    """The counting engine and the exchange see what a well-framed pair is: two answers, two requests."""
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
    out = _exchange(fleet.port, CHUNKED_HEAD + body + CHAT_POST.replace(b"Host: r", b"Host: r\r\nConnection: close"))
    assert out.count(b"HTTP/1.1 200 ") == 2
    assert _engine_requests(fleet) == 2


@pytest.mark.parametrize("data", [BARE_LF_EXTENSION, BARE_LF_TRAILER], ids=["extension", "trailer"])
def test_a_bare_lf_in_a_chunked_body_is_one_400_and_reaches_no_engine(fleet, data: bytes) -> None:
    out = _exchange(fleet.port, data)
    assert out.startswith(b"HTTP/1.1 400 ")
    assert out.count(b"HTTP/1.1 ") == 1, out  # the hidden request got no answer
    assert b"Connection: close" in out
    assert _engine_requests(fleet) == 0
    assert _exchange(fleet.port, CHAT_POST.replace(b"Host: r", b"Host: r\r\nConnection: close")).startswith(
        b"HTTP/1.1 200 "
    )


def test_a_request_head_hidden_in_a_trailer_never_becomes_a_request(fleet) -> None:
    """The trailer vector with a harmless POST whose body is a chat request: one answer, no engine request."""
    hidden = b"POST /nowhere HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT_POST), CHAT_POST)
    out = _exchange(fleet.port, CHUNKED_HEAD + b"0\r\n\n" + hidden)
    assert out.startswith(b"HTTP/1.1 400 ") and out.count(b"HTTP/1.1 ") == 1
    assert _engine_requests(fleet) == 0


def test_http10_with_transfer_encoding_is_refused_and_the_connection_closes(fleet) -> None:
    data = CHUNKED_HEAD.replace(b"HTTP/1.1", b"HTTP/1.0") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
    out = _exchange(fleet.port, data + CHAT_POST)
    assert out.startswith(b"HTTP/1.1 400 ") and out.count(b"HTTP/1.1 ") == 1
    assert b"Connection: close" in out
    assert _engine_requests(fleet) == 0


def test_well_formed_extensions_and_trailers_are_served(fleet) -> None:
    half = len(CHAT) // 2
    body = b'%x;a=b;c="d \\" e"\r\n%s\r\n%x;z\r\n%s\r\n0;last\r\nX-Check: 1\r\nX-Other:\r\n\r\n' % (
        half,
        CHAT[:half],
        len(CHAT) - half,
        CHAT[half:],
    )
    out = _exchange(fleet.port, CHUNKED_HEAD.replace(b"Host: r", b"Host: r\r\nConnection: close") + body)
    assert out.startswith(b"HTTP/1.1 200 "), out[:200]
    assert _engine_requests(fleet) == 1


class _HeadRecorder:
    """An engine that records each request head it gets and answers a chat completion."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                clen = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        clen = int(line.split(b":", 1)[1])
                await reader.readexactly(clen)
                body = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "m",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                    }
                ).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_x_forwarded_for_is_appended_with_the_client_address_and_proto_is_set() -> None:
    lt = LoopThread()
    rec = _HeadRecorder()
    server = lt.run(asyncio.start_server(rec.serve, "127.0.0.1", 0))
    port = server.sockets[0].getsockname()[1]
    f = Fleet(0)
    cfg = {"models": {"m": {"endpoints": [{"url": f"http://127.0.0.1:{port}", "engine": "vllm", "replica": "m/0"}]}}}
    try:
        f.start(cfg=cfg)
        body = json.dumps({"model": "m", "messages": []}).encode()
        req = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Forwarded-For: 203.0.113.7\r\n"
            b"X-Forwarded-For: 198.51.100.1, 10.0.0.9\r\nX-Forwarded-Proto: https\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert _exchange(f.port, req).startswith(b"HTTP/1.1 200 ")
        plain = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
        assert _exchange(f.port, plain % (len(body), body)).startswith(b"HTTP/1.1 200 ")
    finally:
        f.close()
        server.close()
        lt.close()
    posts = [h for h in rec.heads if h.startswith(b"POST ")]  # not the router's health checks
    lines = [[ln for ln in h.split(b"\r\n") if ln.lower().startswith(b"x-forwarded")] for h in posts]
    assert lines[0] == [
        b"X-Forwarded-For: 203.0.113.7, 198.51.100.1, 10.0.0.9, 127.0.0.1",
        b"X-Forwarded-Proto: http",
    ]
    assert lines[1] == [b"X-Forwarded-For: 127.0.0.1", b"X-Forwarded-Proto: http"]


# ---------------------------------------------------------------------------- chunk-size lines
@pytest.mark.parametrize(
    "line,size",
    [
        (b"1f", 31),
        (b"1f;name=value", 31),
        (b"a;x;y=z", 10),
        (b'5;a="b c"', 5),
        (b'5;a="\\"q"', 5),
        (b"0;last", 0),
    ],
)
def test_a_chunk_size_line_with_well_formed_extensions_is_read(line: bytes, size: int) -> None:
    assert parse_chunk_size(line) == size


@pytest.mark.parametrize(
    "line",
    [
        b"2;\nxx",  # the bare LF of the first vector
        b"2;a\rb",
        b"2;",  # an extension without a name
        b"2;a=",  # nor a value
        b"5 ",  # whitespace with no extension after it
        b" 5",
        b"5;a b",
        b'5;a="unterminated',
        b'5;a="x"y',
        b"5;a=b=c",
        b"5;(a)",
        b"A \t;x",  # whitespace around ";" or "=" (the RFC's BWS): llhttp refuses it, so does the router
        b'5 ; a = "b c"',
        b"5;a =b",
        b"5\x00",
        b"5;a=\x7f",
    ],
)
def test_a_malformed_chunk_size_line_is_refused(line: bytes) -> None:
    with pytest.raises(ValueError):
        parse_chunk_size(line)


@pytest.mark.parametrize(
    "body",
    [
        b"2;\n",  # a bare LF before any CRLF: refused before the line's end arrives
        b"2\r\nxx\r\n0\r\nX-T: 1\n",
        b"2\r\nxx\r\n0\r\n\n",
        b"2\r\nxx\r\n0\r\nnot a field\r\n",
        b"2\r\nxx\r\n0\r\n X-Folded: 1\r\n",  # obs-fold
        b"2\r\nxx\r\n0\r\nX-T : 1\r\n",
        b"2\r\nxx\r\n0\r\nX-T: a\rb\r\n",
        b"2\r\nxx\n",  # the data's end must be CRLF
        b"2;a\rb",  # a bare CR inside a line still arriving
    ],
)
def test_the_decoder_refuses_bare_line_ends_and_bad_trailer_lines(body: bytes) -> None:
    dec = ChunkedDecoder()
    with pytest.raises(ValueError):
        dec.feed(body)
    # The same bytes one at a time: refused as early, never taken as an end.
    dec = ChunkedDecoder()
    with pytest.raises(ValueError):
        for i in range(len(body)):
            dec.feed(body[i : i + 1])
    assert not dec.done


def test_many_trailer_lines_are_bounded_in_all() -> None:
    dec = ChunkedDecoder()
    with pytest.raises(ValueError, match="trailer too long"):
        dec.feed(b"0\r\n" + b"X-T: " + b"a" * 100 + b"\r\n" * 1 + (b"X-U: " + b"b" * 100 + b"\r\n") * 200)


def test_http10_with_chunked_is_bad_framing_in_the_head_parser() -> None:
    with pytest.raises(BadRequest) as e:
        parse_request_head(b"POST /v1/completions HTTP/1.0\r\nHost: r\r\nTransfer-Encoding: chunked")
    assert e.value.status == 400


# ---------------------------------------------------------------------------- responses
@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length : 2",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 2",
        b"HTTP/2 200 OK\r\nContent-Length: 2",
    ],
)
def test_a_response_head_another_parser_may_frame_otherwise_is_refused(head: bytes) -> None:
    with pytest.raises(ValueError):
        parse_response_head(head)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length : 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;\nok\r\n0\r\n\r\n",
    ],
)
def test_health_checks_and_scrapes_read_responses_as_strictly_as_relayed_ones(answer: bytes) -> None:
    async def go() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            with pytest.raises(ValueError):
                await fetch("127.0.0.1", server.sockets[0].getsockname()[1], "/health", 5.0)

    asyncio.run(go())


def test_fetch_skips_an_interim_response_and_reads_a_chunked_body() -> None:
    async def go() -> tuple[int, bytes]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"2;x=y\r\nok\r\n0\r\nX-T: 1\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            return await fetch("127.0.0.1", server.sockets[0].getsockname()[1], "/metrics", 5.0)

    assert asyncio.run(go()) == (200, b"ok")


# ---------------------------------------------------------------------------- differential
class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = b""
        self.closing = False

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.out += bytes(data)

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class _Recorder:
    """The router's side of ClientConn: records each request it is handed, with the offset in
    the stream where it ended, and answers 200."""

    max_header_bytes = 64 * 1024
    max_body_bytes = 1 << 20
    max_connections = 10

    def __init__(self) -> None:
        self.conns: set = set()
        self.lingering: set = set()
        self.got: list[tuple[int, bytes, bytes, bytes]] = []
        self.fed = 0
        self.refusals = 0

    def handle(self, conn: ClientConn, req) -> None:
        self.got.append((self.fed - len(conn._buf), req.method, req.target, req.body))
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def check_head(self, req, body_bytes: int) -> None:
        return None

    def refused(self, conn: ClientConn, req, status: int, code: str) -> None:
        self.refusals += 1


Message = tuple[int, bytes, bytes, bytes]  # (offset of its end in the stream, method, target, body)


def router_messages(pieces: list[bytes]) -> list[Message]:
    """The requests the router's ClientConn hands on for this byte stream, fed in ``pieces``."""

    async def go() -> list[Message]:
        rec = _Recorder()
        conn = ClientConn(rec)  # type: ignore[arg-type]
        tr = _Transport()
        conn.connection_made(tr)
        for p in pieces:
            if tr.closing:
                break
            rec.fed += len(p)
            conn.data_received(p)
            while conn.task is not None:  # each request handled before the next bytes come
                await asyncio.sleep(0)
        return rec.got

    return asyncio.run(go())


class _Llhttp:
    def __init__(self) -> None:
        self.done: list[Message] = []
        self.at = 0
        self.url = b""
        self.body = b""

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done.append((self.at, self.parser.get_method(), self.url, self.body))


def llhttp_messages(data: bytes) -> tuple[list[Message], str]:
    """The requests llhttp reads whole from ``data`` (fed a byte at a time, so that each end's
    offset is known), up to its first error; and how it stopped: "" (waiting for more),
    "request line" (it knows no such method or target: a matter of names, not of framing)
    or "framing" (any other error)."""
    cb = _Llhttp()
    cb.parser = httptools.HttpRequestParser(cb)  # type: ignore[attr-defined]
    for i in range(len(data)):
        cb.at = i + 1
        try:
            cb.parser.feed_data(data[i : i + 1])  # type: ignore[attr-defined]
        except (httptools.HttpParserInvalidMethodError, httptools.HttpParserInvalidURLError):
            return cb.done, "request line"
        except httptools.HttpParserError:
            return cb.done, "framing"
    return cb.done, ""


def h11_messages(data: bytes) -> tuple[list[Message], bool]:
    """The requests h11 reads whole from ``data`` (a byte at a time), up to its first error;
    and whether it stopped on an error."""
    conn = h11.Connection(h11.SERVER)
    done: list[Message] = []
    method = target = body = b""
    for i in range(len(data)):
        conn.receive_data(data[i : i + 1])
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    break
                if ev is h11.PAUSED:
                    if conn.their_state is not h11.DONE:
                        return done, False
                    conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                    conn.send(h11.EndOfMessage())
                    if conn.our_state is h11.MUST_CLOSE:
                        return done, False
                    conn.start_next_cycle()
                elif isinstance(ev, h11.Request):
                    method, target, body = ev.method, ev.target, b""
                elif isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    done.append((i + 1, method, target, body))
                else:
                    return done, False
        except (h11.RemoteProtocolError, h11.LocalProtocolError):
            return done, True
    return done, False


_EOLS = [b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r", b"\r\r\n", b""]
_EXTS = [b"", b"", b";a", b";a=b", b' ; a = "b c"', b";", b";\n", b";a=\n", b" ", b";a=b;c"]
_TRAILERS = [b"", b"", b"X-T: 1\r\n", b"X-T: 1\n", b"bad\r\n", b" X-F: 1\r\n", b"X-T : 1\r\n", b"\n"]
_NOISE = st.sampled_from([b"\r", b"\n", b"\r\n", b" ", b";", b"0", b"a", b":", b'"', b"\t", b"=", b"\x00"])


@st.composite
def _message(draw: st.DrawFn) -> bytes:
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
    target = draw(st.sampled_from([b"/v1/chat/completions", b"/nowhere", b"/health"]))
    head = b"POST " + target + b" " + version + b"\r\nHost: r\r\n"
    if version == b"HTTP/1.0":
        head += b"Connection: keep-alive\r\n"
    payload = draw(st.binary(max_size=12))
    framing = draw(st.sampled_from(["length", "chunked", "both", "none"]))
    if framing in ("length", "both"):
        n = len(payload) + draw(st.sampled_from([0, 0, 0, 1, -1])) if payload else 0
        head += b"Content-Length: %d\r\n" % max(n, 0)
    if framing in ("chunked", "both"):
        head += b"Transfer-Encoding: chunked\r\n"
    head += b"\r\n"
    if framing in ("length", "none"):
        return head + (payload if framing == "length" else b"")
    body = b""
    rest = payload
    while rest:
        k = draw(st.integers(1, len(rest)))
        piece, rest = rest[:k], rest[k:]
        size = b"%x" % len(piece) if draw(st.integers(0, 9)) else b"%x" % (len(piece) + 1)
        body += (
            size + draw(st.sampled_from(_EXTS)) + draw(st.sampled_from(_EOLS)) + piece + draw(st.sampled_from(_EOLS))
        )
    body += b"0" + draw(st.sampled_from(_EXTS)) + draw(st.sampled_from(_EOLS))
    body += draw(st.sampled_from(_TRAILERS)) + draw(st.sampled_from(_EOLS))
    return head + body


@st.composite
def _stream(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    data = b"".join(draw(st.lists(_message(), min_size=1, max_size=3)))
    for _ in range(draw(st.integers(0, 2))):  # mutations: a byte put in, taken out or changed
        i = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        b = draw(_NOISE)
        if op == "insert":
            data = data[:i] + b + data[i:]
        elif op == "delete":
            data = data[:i] + data[i + 1 :]
        else:
            data = data[:i] + b + data[i + 1 :]
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    return data, cuts


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stream())
@example((BARE_LF_EXTENSION, []))
@example((BARE_LF_TRAILER, []))
@example((BARE_LF_EXTENSION, [len(CHUNKED_HEAD) + 3]))
@example((CHUNKED_HEAD + b"0\r\n\n" + CHAT_POST, []))
def test_every_request_the_router_hands_on_other_parsers_read_the_same(stream: tuple[bytes, list[int]]) -> None:
    """Each request the router passes on is, in order, the one llhttp reads at that place in
    the stream, ending at the same byte (method, target and body alike): where llhttp would
    read otherwise or refuse, the router has refused before. h11, more lenient in places and
    stricter in others (it refuses an empty line before a request line), must agree on every
    message both read, and must not be left inside a message the router has ended."""
    data, cuts = stream
    got = router_messages(_pieces(data, cuts))
    strict, stop = llhttp_messages(data)
    if stop == "request line":  # llhttp knows only the registered methods; nginx and the router take any token
        n = min(len(got), len(strict))
        assert got[:n] == strict[:n], f"llhttp reads {strict!r}, the router passed on {got!r}"
    else:
        assert got == strict[: len(got)], f"llhttp reads {strict!r}, the router passed on {got!r}"
    lenient, refused = h11_messages(data)
    n = min(len(got), len(lenient))
    assert got[:n] == lenient[:n], f"h11 reads {lenient!r}, the router passed on {got!r}"
    assert refused or len(got) <= len(lenient), f"h11 reads {lenient!r} and waits, the router passed on {got!r}"


def test_the_differential_harness_sees_well_framed_messages_alike() -> None:
    """A control: for well-framed pipelined requests all three parsers find the same messages."""
    body = b"%x;a=b\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
    data = CHUNKED_HEAD + body + CHAT_POST
    first = len(CHUNKED_HEAD + body)
    want = [(first, b"POST", b"/v1/chat/completions", CHAT), (len(data), b"POST", b"/v1/chat/completions", CHAT)]
    assert router_messages([data]) == want
    assert router_messages([data[i : i + 1] for i in range(len(data))]) == want
    assert llhttp_messages(data) == (want, "")
    assert h11_messages(data) == (want, False)
