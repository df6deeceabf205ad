"""The router against hostile input: smuggling, response splitting, bad chunk sizes, slow
senders, connection floods, unauthenticated uploads, a client's API key kept from the engines."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from simengine import Fleet

from cluster_cli.router.http import BadRequest, ChunkedDecoder, parse_chunk_size, parse_request_head
from cluster_cli.router.keys import ApiKeys, digest

GOOD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 2"


def _body(model: str = "sim") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def _post(extra_head: bytes = b"", body: bytes | None = None, target: bytes = b"/v1/chat/completions") -> bytes:
    body = _body() if body is None else body
    return b"POST %b HTTP/1.1\r\nHost: r\r\n%bContent-Length: %d\r\n\r\n%b" % (target, extra_head, len(body), body)


def _exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data``, read until the router closes or goes quiet."""
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
            if b"\r\n\r\n" in out and b"Connection: close" not in out and out.count(b"HTTP/1.1 ") >= 1:
                s.settimeout(0.3)
        return out


# ---------------------------------------------------------------------------- request heads
@pytest.mark.parametrize(
    "head",
    [
        GOOD + b"\r\nX-A: a\nGET /admin HTTP/1.1",  # bare LF inside a value: a second request to a lenient engine
        GOOD + b"\r\nX-A: a\rb",  # bare CR
        GOOD + b"\r\nX-A: a\x00b",  # NUL
        GOOD + b"\r\nX-A: a\x0bb",  # other control
        GOOD + b"\r\n Transfer-Encoding: chunked",  # obs-fold continuation line
        GOOD + b"\r\nTransfer-Encoding\x0b: chunked",  # a name that is not a token
        GOOD + b"\r\nX-A : a",  # space before the colon
        GOOD + b"\r\nX A: a",  # space inside the name
        b"POST /v1/chat/completions?x=\n HTTP/1.1\r\nHost: r",  # LF in the target
        b"POST /v1/chat/\xffcompletions HTTP/1.1\r\nHost: r",  # 8-bit target
        b"PO(ST /v1/chat/completions HTTP/1.1\r\nHost: r",  # method not a token
        b"POST /v1/chat/completions HTTP/1.2\r\nHost: r",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -1",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: +2",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1_0",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: " + b"9" * 5000,
        b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
    ],
)
def test_heads_that_could_mean_something_else_to_an_engine_are_refused(head: bytes) -> None:
    with pytest.raises(BadRequest) as e:
        parse_request_head(head)
    assert e.value.status == 400


def test_only_plain_chunked_transfer_coding_is_taken() -> None:
    with pytest.raises(BadRequest) as e:
        parse_request_head(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked")
    assert e.value.status == 501
    assert parse_request_head(b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: Chunked")[2] is True


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_whatever_a_head_holds_what_is_forwarded_is_clean_header_lines(junk: bytes) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Junk: " + junk
    try:
        req, _, _ = parse_request_head(head)
    except BadRequest:
        return
    for line in req.forward.split(b"\r\n")[:-1]:
        name, sep, _ = line.partition(b":")
        assert sep and name and not any((c < 0x20 and c != 0x09) or c == 0x7F for c in line)


# ---------------------------------------------------------------------------- chunk sizes
@pytest.mark.parametrize("size", [b"-6", b"+6", b"0x6", b"6_0", b" 6", b"", b"g", b"1" * 17])
def test_a_chunk_size_is_hex_digits_only(size: bytes) -> None:
    with pytest.raises(ValueError):
        parse_chunk_size(size)
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(b"1\r\nA\r\n" + size + b"\r\nXXXXXXXX\r\n0\r\n\r\n")


def test_chunk_extensions_are_still_read_and_padding_before_them_is_not() -> None:
    """Extensions are read (and ignored); whitespace before one is refused, as llhttp refuses
    it: a chunk line the router reads one way, a parser behind it must not read another."""
    assert parse_chunk_size(b"1f;name=value") == 31
    with pytest.raises(ValueError):
        parse_chunk_size(b"A \t;x")
    payload, rest = ChunkedDecoder().feed(b"3;x=y\r\nabc\r\n0\r\n\r\nnext")
    assert (payload, rest) == (b"abc", b"next")


_CHUNKISH = st.lists(
    st.one_of(
        st.sampled_from([b"1", b"3", b"-6", b"+2", b"0x1", b"0", b"\r\n", b";x=1", b"A", b"abc"]), st.binary(max_size=4)
    ),
    max_size=24,
).map(b"".join)


@settings(max_examples=400, deadline=2000)
@given(_CHUNKISH, st.integers(1, 7))
@example(b"1\r\nA\r\n-6\r\nX", 100)  # "-6" stepped back onto "\r\n-6": the old decoder's endless loop
def test_the_chunk_decoder_ends_on_any_input(data: bytes, cut: int) -> None:
    """It returns or raises ValueError, and what it returns is no more than it was given."""
    dec = ChunkedDecoder()
    got = 0
    try:
        for i in range(0, len(data), cut):
            payload, _ = dec.feed(data[i : i + cut])
            got += len(payload)
    except ValueError:
        return
    assert got <= len(data)


# ---------------------------------------------------------------------------- live router
@pytest.fixture
def fleet():
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(
        router={"limits": {"request_read_timeout_s": 0.6, "max_connections": 6}}
    )
    yield f
    f.close()


def test_a_smuggling_attempt_never_reaches_the_engine(fleet) -> None:
    engine = fleet.engines[0]
    before = fleet.lt.call(lambda: engine.requests)
    out = _exchange(fleet.port, _post(b"X-A: a\nGET /internal HTTP/1.1\nX-B: b\r\n"))
    assert out.startswith(b"HTTP/1.1 400 ")
    assert b"malformed header line" in out
    assert fleet.lt.call(lambda: engine.requests) == before
    assert _exchange(fleet.port, _post()).startswith(b"HTTP/1.1 200 ")  # and the router is fine


def test_a_negative_chunk_size_gets_a_400_and_does_not_hang_the_router(fleet) -> None:
    bad = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nA\r\n-6\r\nX"
    out = _exchange(fleet.port, bad)
    assert out.startswith(b"HTTP/1.1 400 ")
    assert _exchange(fleet.port, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n", timeout=3).startswith(b"HTTP/1.1 200 ")


def test_a_content_length_of_thousands_of_digits_gets_a_400(fleet) -> None:
    out = _exchange(
        fleet.port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n"
    )
    assert out.startswith(b"HTTP/1.1 400 ")


@pytest.mark.slow
def test_a_request_that_trickles_in_is_cut_at_the_read_deadline(fleet) -> None:
    """One byte every 0.1 s keeps the idle timer fresh for ever; the read deadline does not."""
    engine = fleet.engines[0]
    before = fleet.lt.call(lambda: engine.requests)
    data = _post()
    sent = 0
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.settimeout(0.05)
        got = b""
        for i in range(len(data)):  # about 10 s if nothing stops it
            try:
                s.sendall(data[i : i + 1])
            except OSError:
                break
            sent = i + 1
            try:
                got += s.recv(65536)
            except TimeoutError:
                pass
            except OSError:
                break
            if got:
                break
            time.sleep(0.05)
        s.settimeout(5)
        try:
            while d := s.recv(65536):  # the router closes the connection after its answer
                got += d
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
    assert got.startswith(b"HTTP/1.1 408 "), got[:80]
    assert b"within 0.6 s" in got and b"request_timeout" in got and closed
    # Cut while the request was still arriving (a byte per 0.1 s or slower: the 0.6 s deadline
    # comes after ~6 bytes), not once it was whole: far from the end, and the engine never saw it.
    assert sent <= len(data) // 2, (sent, len(data))
    assert fleet.lt.call(lambda: engine.requests) == before
    assert 'status="408"' in fleet.lt.call(lambda: fleet.router.metrics.render()).decode()


@pytest.mark.slow
def test_connections_over_the_limit_get_a_503_and_are_closed(fleet) -> None:
    held = [socket.create_connection(("127.0.0.1", fleet.port)) for _ in range(6)]
    try:
        time.sleep(0.2)
        out = _exchange(fleet.port, _post(), timeout=3)
        assert out.startswith(b"HTTP/1.1 503 ")
        assert b"too_many_connections" in out
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5  # room again once the router has seen the closes
    while not (ok := _exchange(fleet.port, _post())).startswith(b"HTTP/1.1 200 ") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ok.startswith(b"HTTP/1.1 200 "), ok[:80]


def test_an_upload_without_a_key_is_refused_on_its_head() -> None:
    """The router answers 401 before the body arrives, so it never buffers a stranger's upload."""
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(api_keys=ApiKeys({digest("sk-good")}))
    try:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 30000000\r\n\r\n"
        out = _exchange(f.port, head + b"x" * 1000, timeout=3)
        assert out.startswith(b"HTTP/1.1 401 ")
        assert b"WWW-Authenticate: Bearer" in out and b"Connection: close" in out
        # With the key, the same head is read on (and the body, when it comes, is served).
        body = _body()
        ok = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer sk-good\r\nContent-Length: %d\r\n\r\n"
        assert _exchange(f.port, ok % len(body) + body).startswith(b"HTTP/1.1 200 ")
    finally:
        f.close()


@pytest.mark.parametrize(
    ("head", "answer"),
    [
        (b"POST /nope HTTP/1.1\r\nHost: r\r\nContent-Length: 30000000\r\n\r\n", b"404 Not Found"),
        (b"GET /v1/models HTTP/1.1\r\nHost: r\r\nContent-Length: 30000000\r\n\r\n", b"413 "),
        (b"PUT /health HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n", b"405 "),
        (b"GET /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 30000000\r\n\r\n", b"405 "),
    ],
)
def test_a_body_for_a_route_that_reads_none_is_refused_on_its_head(fleet, head: bytes, answer: bytes) -> None:
    """Only the proxied routes read a body: any other route is answered before a large or
    chunked one arrives (the router held up to max_body_bytes per connection for a 404),
    with what the route answers anyway: no route 404, a wrong method 405 (not "too large")."""
    out = _exchange(fleet.port, head + b"x" * 1000, timeout=3)
    assert out.startswith(b"HTTP/1.1 " + answer) and b"Connection: close" in out
    assert (b"takes no request body" in out) == (answer == b"413 ")
    # A small body on such a route is read and ignored, as before.
    small = b"GET /health HTTP/1.1\r\nHost: r\r\nContent-Length: 5\r\n\r\nhello"
    assert _exchange(fleet.port, small, timeout=3).startswith(b"HTTP/1.1 200 ")


# ---------------------------------------------------------------------------- engine responses
class _RawEngine:
    """An engine that answers every request with the same bytes (and health checks with 200)."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        async def on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    clen = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            clen = int(line.split(b":")[1])
                    await reader.readexactly(clen)
                    if head.startswith(b"GET /health") or head.startswith(b"GET /metrics"):
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    else:
                        writer.write(self.answer)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        self.server = await asyncio.start_server(on, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Evil: a\nSet-Cookie: injected=1\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\n Set-Cookie: injected=1\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-6\r\nX",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}",
    ],
)
def test_a_malformed_engine_response_is_a_502_never_relayed(answer: bytes) -> None:
    f = Fleet(0)
    raw = _RawEngine(answer)
    port = f.lt.run(raw.start())
    cfg = {
        "engines": {"vllm": {"metrics": {}}},
        "models": {"sim": {"endpoints": [{"url": f"http://127.0.0.1:{port}", "engine": "vllm", "replica": "raw"}]}},
        "router": {"retry": {"max_attempts": 1}},
    }
    f.start(cfg=cfg)
    try:
        out = _exchange(f.port, _post(), timeout=4)
        assert out.startswith(b"HTTP/1.1 502 "), out[:120]
        assert b"injected" not in out
        assert _exchange(f.port, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n", timeout=3).startswith(b"HTTP/1.1 200 ")
    finally:
        if raw.server is not None:
            f.lt.call(raw.server.close)
        f.close()


def test_client_connections_are_capped_to_what_the_open_files_limit_allows(caplog, monkeypatch) -> None:
    import cluster_cli.router.lifecycle as app_mod
    from cluster_cli.router.app import Router
    from cluster_cli.router.config import RouterConfig

    asked: list[int] = []

    def raise_fd_limit(wanted: int) -> int:  # a hard limit of 1256 open files
        asked.append(wanted)
        return min(2 * wanted + 256, 1256)

    monkeypatch.setattr(app_mod, "raise_fd_limit", raise_fd_limit)
    eps = {"sim": {"endpoints": [{"url": "http://127.0.0.1:9", "engine": "vllm", "replica": "r0"}]}}
    r = Router(RouterConfig.model_validate({"models": eps}))
    r.manage_open_files()
    assert (asked, r.max_connections) == ([10000], 500)  # (1256 - 256) / 2: each client may hold an engine connection
    assert "max_connections" not in caplog.text  # the default is cut quietly
    r.reload(RouterConfig.model_validate({"models": eps, "router": {"limits": {"max_connections": 100}}}))
    assert (asked[-1], r.max_connections) == (100, 100)
    r.reload(RouterConfig.model_validate({"models": eps, "router": {"limits": {"max_connections": 5000}}}))
    assert asked[-1] == 5000  # a reload asking for more raises the limit again
    assert r.max_connections == 500
    assert "max_connections 5000 is more than the open-files limit 1256 allows" in caplog.text


def test_the_clients_api_key_never_reaches_an_engine() -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer sk-router\r\nX-Trace: 1\r\nContent-Length: 2"
    req = parse_request_head(head)[0]
    fwd = req.forward.lower()
    assert b"authorization" not in fwd and b"sk-router" not in fwd
    assert b"x-trace: 1" in fwd  # other headers do go through


# ---------------------------------------------------------------------------- /health behind the keys


def _health(port: int, key: str | None = None, method: bytes = b"GET") -> tuple[int, bytes, bytes]:
    auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    out = _exchange(port, b"%s /health HTTP/1.1\r\nHost: r\r\n%bConnection: close\r\n\r\n" % (method, auth), timeout=3)
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), head, body


def test_health_shows_its_detail_only_to_a_client_with_a_key() -> None:
    """With client keys, a stranger learns "ok" or "degraded" (with the same status code) and
    nothing of the engines behind the router: no URL, replica, model or error."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=3).start(api_keys=ApiKeys({digest("sk-good")}))
    try:
        for key in (None, "sk-wrong", "Bearer"):
            status, _, body = _health(f.port, key)
            assert (status, json.loads(body)) == (200, {"status": "ok"})
            for secret in (b"127.0.0.1", b"r0", b"sim", b"endpoints", b"http://"):
                assert secret not in body
        status, _, body = _health(f.port, "sk-good")
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "ok" and len(doc["endpoints"]) == 2
        assert {e["url"] for e in doc["endpoints"]} == {e.url for e in f.engines}
        # HEAD: the GET answer's head, each its own length.
        _, head, body = _health(f.port, None, b"HEAD")
        assert body == b"" and b"Content-Length: %d" % len(b'{"status":"ok"}') in head
        # Degraded (no endpoint would take a request): the status, still without detail, still 200.
        for e in f.engines:
            f.lt.run(e.refuse())
        deadline = time.monotonic() + 15  # (polled from here: the loop thread serves the answers)
        status, _, body = _health(f.port)
        while json.loads(body) != {"status": "degraded"} and time.monotonic() < deadline:
            time.sleep(0.05)
            status, _, body = _health(f.port)
        assert status == 200 and json.loads(body) == {"status": "degraded"}
        assert json.loads(_health(f.port, "sk-good")[2])["unavailable_models"] == ["sim"]
    finally:
        f.close()


def test_health_without_client_keys_shows_its_detail_to_anyone() -> None:
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start()
    try:
        status, _, body = _health(f.port)
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "ok" and doc["endpoints"][0]["url"] == f.engines[0].url
    finally:
        f.close()


def test_a_draining_router_says_so_without_detail_to_a_stranger() -> None:
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(api_keys=ApiKeys({digest("sk-good")}))
    try:
        f.router._draining = True  # as stop() sets it: /health answers 503
        status, _, body = _health(f.port)
        assert (status, json.loads(body)) == (503, {"status": "draining"})
        assert "endpoints" in json.loads(_health(f.port, "sk-good")[2])
    finally:
        f.router._draining = False
        f.close()
