"""Router regressions found by a review: pipelining, HEAD, cut bodies, retries across a reload,
slow readers, head limits. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from simengine import Fleet, LoopThread

from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig


def _req(pad: int, stream: bool = False) -> bytes:
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "x" * pad}], "stream": stream}).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


def _read_until(s: socket.socket, count: int, needle: bytes = b"HTTP/1.1 200", timeout: float = 8.0) -> bytes:
    s.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while buf.count(needle) < count and time.monotonic() < deadline:
        try:
            d = s.recv(65536)
        except TimeoutError:
            break
        if not d:
            break
        buf += d
    return buf


@pytest.fixture
def fleet():
    f = Fleet(1, capacity=4, token_delay_s=0.01, tokens=20).start()
    yield f
    f.close()


def test_a_connection_keeps_serving_after_a_large_pipelined_request(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(_req(10))
        time.sleep(0.05)  # the first request is in flight when a 100 KB one is pipelined behind it
        s.sendall(_req(100_000))
        assert _read_until(s, 2).count(b"HTTP/1.1 200") == 2
        s.sendall(_req(10))  # reading was paused for the big one: it must have been resumed
        assert _read_until(s, 1).count(b"HTTP/1.1 200") == 1


def test_a_pipelined_body_larger_than_the_head_limit_still_arrives(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(_req(10))
        time.sleep(0.05)
        threading.Thread(target=lambda: s.sendall(_req(1_000_000)), daemon=True).start()
        assert _read_until(s, 2).count(b"HTTP/1.1 200") == 2


def test_head_on_a_proxied_path_is_a_bare_405(fleet) -> None:
    with socket.create_connection(("127.0.0.1", fleet.port)) as s:
        s.sendall(b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: r\r\n\r\n" + _req(1))
        data = _read_until(s, 1)
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
        w = r.table.workers[url]
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


def _retries(r: Router) -> dict[str, float]:
    """The router's retry counter, by reason."""
    return {
        s.labels["reason"]: s.value
        for m in r.metrics.registry.collect()
        for s in m.samples
        if s.name == "clusterctl_router_retries_total"
    }


def test_a_retry_after_a_reload_uses_the_new_endpoints() -> None:
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    old, new = f.engines
    cfg = f.config(router={"limits": {"idle_timeout_s": 1.0}})
    eps = cfg["models"]["sim"]["endpoints"]
    f.start(cfg={**cfg, "models": {"sim": {"endpoints": [eps[0]]}}})
    try:
        f.lt.call(lambda: setattr(old, "hang", True))
        res: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: res.setdefault(
            "r", httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": [], "stream": True},
                            timeout=10)))  # fmt: skip
        t.start()
        # The request hangs on the old endpoint; a reload swaps in the new one.
        f.lt.wait_for(lambda: old.requests == 1, what="the request to reach the old endpoint")
        new_cfg = RouterConfig.model_validate({**cfg, "models": {"sim": {"endpoints": [eps[1]]}}})
        f.lt.call(lambda: f.router.reload(new_cfg))
        t.join(30)
        assert not t.is_alive(), "the request never ended"
        assert res["r"].status_code == 200, res["r"].text
        # The old endpoint timed out (idle timeout: a stream's head comes at once) without
        # answering; the retry went to the new one.
        assert f.lt.call(lambda: (old.requests, old.served, new.requests, new.served)) == (1, 0, 1, 1)
        assert f.lt.call(lambda: _retries(f.router)) == {"timeout": 1.0}
    finally:
        f.close()


def _stream_socket(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # backpressure reaches the router fast
    s.connect(("127.0.0.1", port))
    s.sendall(_req(1, stream=True))
    return s


def test_a_client_that_stops_reading_is_dropped_without_blaming_the_engine() -> None:
    import io

    from cluster_cli.router.accesslog import AccessLog

    log = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0, tokens=20_000).start(
        router={"limits": {"idle_timeout_s": 1.0}, "breaker": {"failure_threshold": 1}},
        access_log=AccessLog(log, max_buffer=1),
    )
    try:
        w = f.router.table.workers[f.engines[0].url]
        s = _stream_socket(f.port)
        s.recv(1024)
        time.sleep(2.5)  # stalled for more than the idle timeout
        s.settimeout(5)
        got = b""
        try:
            while d := s.recv(1 << 20):
                got += d
        except (ConnectionResetError, TimeoutError):
            pass
        s.close()
        assert b"upstream_stream_cut" not in got  # not reported as the engine's cut
        f.lt.wait_for(lambda: w.inflight == 0 and '"status":499' in log.getvalue(), what="the 499 logged")
        assert w.failed == 0 and f.lt.call(lambda: w.breaker.stats())["state"] == "closed"
        assert f.lt.call(lambda: w.inflight) == 0  # the engine slot was freed
        (line,) = [json.loads(x) for x in log.getvalue().splitlines() if '"status":499' in x]
        assert line["note"] == "dropped: the client read nothing for the idle timeout" and line["endpoint"] == "r0"
        # The engine still serves.
        assert httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": [], "max_tokens": 2},
                          timeout=10).status_code == 200  # fmt: skip
    finally:
        f.close()


def test_a_slow_but_steady_reader_gets_the_whole_stream() -> None:
    # Reads 4 KB every 50 ms: always behind (the router stays paused on the engine for the
    # whole stream, far longer than the idle timeout), yet always making progress.
    f = Fleet(1, capacity=4, token_delay_s=0, tokens=2_000).start(router={"limits": {"idle_timeout_s": 1.0}})
    try:
        s = _stream_socket(f.port)
        s.settimeout(10)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            d = s.recv(4096)
            if not d:
                break
            got += d
            time.sleep(0.05)
        s.close()
        assert b"data: [DONE]" in got and b"upstream_stream_cut" not in got
    finally:
        f.close()


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


def test_a_client_that_leaves_mid_stream_is_labelled_with_its_model_and_endpoint() -> None:
    import io

    from cluster_cli.router.accesslog import AccessLog

    log = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.02, tokens=200).start(access_log=AccessLog(log, max_buffer=1))
    try:
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.sendall(_req(1, stream=True))
            got = _read_until(s, 5, needle=b"data: ")  # the stream has started
            assert got.count(b"data: ") >= 5
        deadline = time.monotonic() + 5
        while '"status":499' not in log.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        (line,) = [json.loads(x) for x in log.getvalue().splitlines() if '"status":499' in x]
        assert (line["model"], line["endpoint"], line["attempts"]) == ("sim", "r0", 1)
        assert line["ttfb_ms"] is not None and line["ttfb_ms"] > 0
        assert line["note"] == "client closed the connection"
        metrics = f.lt.call(lambda: f.router.metrics.render()).decode()  # type: ignore[union-attr]
        assert 'model="sim"' in metrics and 'endpoint="r0"' in metrics
        assert [x for x in metrics.splitlines() if 'status="499"' in x and 'model="sim"' in x and 'endpoint="r0"' in x]
    finally:
        f.close()
