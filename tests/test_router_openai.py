"""The official openai client through clusterctl's router in front of simulated engines."""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from simengine import Fleet

from cluster_cli.router.keys import ApiKeys, digest

MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture
def fleet():
    f = Fleet(2, capacity=4, token_delay_s=0.002, tokens=8).start()
    yield f
    f.close()


def client(f: Fleet, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f.base, api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=20, **kw)


def test_chat_non_stream_and_stream(fleet):
    c = client(fleet)
    r = c.chat.completions.create(model="sim", messages=MSG)
    assert r.choices[0].message.content.split() == [
        "lorem",
        "ipsum",
        "dolor",
        "sit",
        "amet",
        "consectetur",
        "adipiscing",
        "elit",
    ]
    pieces = [
        ch.choices[0].delta.content
        for ch in c.chat.completions.create(model="sim", messages=MSG, stream=True)
        if ch.choices
    ]
    assert "".join(p for p in pieces if p).split()[:2] == ["lorem", "ipsum"]
    assert len([p for p in pieces if p]) == 8


def test_completions_embeddings_models(fleet):
    c = client(fleet)
    assert c.completions.create(model="sim", prompt="x", max_tokens=3).choices[0].text.split() == [
        "lorem",
        "ipsum",
        "dolor",
    ]
    texts = [ch.choices[0].text for ch in c.completions.create(model="sim", prompt="x", max_tokens=2, stream=True)]
    assert "".join(texts).split() == ["lorem", "ipsum"]
    assert c.embeddings.create(model="sim", input="x").data[0].embedding == [0.1, 0.2, 0.3]
    assert [m.id for m in c.models.list()] == ["sim"]


def test_unknown_model_is_openai_404(fleet):
    with pytest.raises(openai.NotFoundError) as ei:
        client(fleet).chat.completions.create(model="nope", messages=MSG)
    err = ei.value.body
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "model_not_found" and "nope" in err["message"]
    raw = httpx.post(fleet.base + "/chat/completions", json={"model": "nope", "messages": MSG})
    assert raw.status_code == 404 and set(raw.json()) == {"error"}


def test_bad_requests(fleet):
    r = httpx.post(fleet.base + "/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(fleet.base + "/chat/completions", json={"messages": MSG})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_model"
    r = httpx.get(fleet.url + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_body_limit_413():
    f = Fleet(1, capacity=2, token_delay_s=0.001).start(router={"limits": {"max_body_bytes": 2048}})
    try:
        big = {"model": "sim", "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(f.base + "/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert f.engines[0].requests == 0
        ok = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG})
        assert ok.status_code == 200
    finally:
        f.close()


def test_chunked_request_body_and_pipelining(fleet):
    body = json.dumps({"model": "sim", "messages": MSG, "max_tokens": 2}).encode()
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    req1 = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    req2 = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", fleet.port), timeout=10) as s:
        s.sendall(req1 + req2)  # pipelined: answered in order
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    first, _, rest = data.partition(b"HTTP/1.1 200 OK")[2].partition(b"HTTP/1.1 200")
    assert b"chat.completion" in first and b'"id":"sim"' in rest


def test_head_answers_with_the_head_alone_on_a_kept_alive_connection(fleet):
    reqs = (
        b"".join(
            b"%s %s HTTP/1.1\r\nHost: x\r\n\r\n" % (m, p)
            for m, p in ((b"HEAD", b"/health"), (b"HEAD", b"/v1/models"), (b"HEAD", b"/nope"), (b"GET", b"/v1/models"))
        )
        + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", fleet.port), timeout=10) as s:
        s.sendall(reqs)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    # Five responses in order; the three HEAD ones carry a Content-Length but no body, so the
    # GET answers that follow on the same connection start right after their heads.
    parts = data.split(b"HTTP/1.1 ")[1:]
    assert [p[:3] for p in parts] == [b"200", b"200", b"404", b"200", b"200"]
    for p in parts[:3]:
        head, _, body = p.partition(b"\r\n\r\n")
        assert body == b"" and b"content-length: " in head.lower() and not head.lower().endswith(b"length: 0")
    assert b'"id":"sim"' in parts[3] and b'"status":"ok"' in parts[4]


@pytest.mark.slow
def test_api_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nsk-alpha\nsha256:" + digest("sk-beta").hex() + "\n")
    f = Fleet(1, capacity=2, token_delay_s=0.001, tokens=2).start(api_keys=ApiKeys.load(keys))
    try:
        with pytest.raises(openai.AuthenticationError) as ei:
            client(f, api_key="sk-wrong").chat.completions.create(model="sim", messages=MSG)
        assert ei.value.body["code"] == "invalid_api_key" and set(ei.value.body) == {"message", "type", "param", "code"}
        assert httpx.get(f.base + "/models").status_code == 401
        for key in ("sk-alpha", "sk-beta"):
            assert client(f, api_key=key).chat.completions.create(model="sim", messages=MSG).choices
        metrics = httpx.get(f.url + "/metrics").text
        health = httpx.get(f.url + "/health").text
        assert "sk-alpha" not in metrics + health and "sk-wrong" not in metrics + health
    finally:
        f.close()


def test_stream_passes_through_before_upstream_finishes():
    """The client reads its first token while the engine is still generating the rest."""
    f = Fleet(1, capacity=2, token_delay_s=0.05, tokens=200).start()
    eng = f.engines[0]
    try:
        body = {"model": "sim", "messages": MSG, "stream": True}
        with httpx.stream("POST", f.base + "/chat/completions", json=body, timeout=20) as r:
            it = r.iter_lines()
            first = next(line for line in it if line.startswith("data: "))
            assert "lorem" in first
            assert f.lt.call(lambda: eng.running) == 1  # still generating: nothing was buffered
    finally:
        f.close()


def test_client_disconnect_frees_engine_slot():
    f = Fleet(1, capacity=2, token_delay_s=0.05, tokens=500).start()
    eng = f.engines[0]
    try:
        c = client(f)
        stream = c.chat.completions.create(model="sim", messages=MSG, stream=True)
        next(iter(stream))
        assert f.lt.call(lambda: eng.running) == 1
        stream.close()  # the client goes away mid-stream
        f.lt.wait_for(lambda: eng.running == 0 and eng.aborted == 1, what="engine slot freed")
        f.lt.wait_for(lambda: f.router.table.endpoints[eng.url].inflight == 0, what="router in-flight back to 0")
        assert eng.served == 0
    finally:
        f.close()


def test_client_disconnect_while_queued_in_engine():
    """A request waiting in the engine's queue is dropped there too when its client leaves."""
    f = Fleet(1, capacity=1, token_delay_s=0.05, tokens=500).start()
    eng = f.engines[0]
    try:
        c = client(f)
        s1 = c.chat.completions.create(model="sim", messages=MSG, stream=True)
        next(iter(s1))
        body = json.dumps({"model": "sim", "messages": MSG, "stream": True}).encode()
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection(("127.0.0.1", f.port), timeout=10) as s:
            s.sendall(head + body)  # no response head yet: the router waits for the first token
            f.lt.wait_for(lambda: eng.waiting == 1, what="second request queued in the engine")
        f.lt.wait_for(lambda: eng.waiting == 0 and eng.aborted == 1, what="queued request dropped")
        s1.close()
        f.lt.wait_for(lambda: eng.running == 0 and f.router.table.endpoints[eng.url].inflight == 0, what="all freed")
    finally:
        f.close()


def test_llamacpp_metric_names_are_scraped():
    f = Fleet(1, capacity=3, token_delay_s=0.001, metrics_style="llamacpp").start()
    try:
        w = f.router.table.endpoints[f.engines[0].url]
        f.lt.wait_for(lambda: w.scraped.running is not None, what="a scrape")
        assert w.scraped.waiting == 0.0
        assert w.scraped.kv is None  # llama.cpp exports no KV-cache gauge: unknown, not 0
    finally:
        f.close()


def test_async_openai_client(fleet):
    import asyncio

    async def go() -> list[str]:
        c = openai.AsyncOpenAI(base_url=fleet.base, api_key="x", max_retries=0, timeout=20)
        async with c:
            rs = await asyncio.gather(
                *(c.chat.completions.create(model="sim", messages=MSG, max_tokens=2) for _ in range(12))
            )
        return [r.choices[0].message.content for r in rs]

    outs = asyncio.run(go())
    assert outs == ["lorem ipsum "] * 12
    served = [e.served for e in fleet.engines]
    assert sum(served) == 12 and min(served) > 0  # both endpoints were used


def test_models_retrieve_answers_one_model_or_openai_404():
    f = Fleet(1, model="org/tiny-1.5b", capacity=4, token_delay_s=0.001, tokens=2).start()
    try:
        c = client(f)
        m = c.models.retrieve("org/tiny-1.5b")  # a name with "/" (Hugging Face style) works too
        assert (m.id, m.object, m.owned_by) == ("org/tiny-1.5b", "model", "clusterctl")
        assert httpx.get(f.base + "/models/org%2Ftiny-1.5b").json()["id"] == "org/tiny-1.5b"
        with pytest.raises(openai.NotFoundError) as ei:
            c.models.retrieve("nope")
        assert ei.value.body["code"] == "model_not_found"
    finally:
        f.close()


def test_models_retrieve_needs_the_api_key():
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2).start(api_keys=ApiKeys({digest("sk-1")}))
    try:
        with pytest.raises(openai.AuthenticationError):
            client(f, api_key="wrong").models.retrieve("sim")
        assert client(f, api_key="sk-1").models.retrieve("sim").id == "sim"
    finally:
        f.close()


def test_a_model_that_is_not_a_string_is_named_as_such(fleet):
    r = httpx.post(fleet.base + "/chat/completions", json={"model": 123, "messages": MSG})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_model"
    assert "must be a string, not int" in r.json()["error"]["message"]


def test_every_endpoint_down_is_503_with_retry_after():
    """Once failures have opened every breaker, the model is unavailable (503), and
    Retry-After says when the first endpoint will be probed again."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(
        router={"breaker": {"failure_threshold": 1, "open_for_s": 7}, "health_interval_s": 60}
    )
    try:
        for e in f.engines:
            f.lt.run(e.refuse())
        r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}, timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_endpoint"
        assert "2 circuit open" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 7
        r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}, timeout=10)
        assert r.status_code == 503 and 1 <= int(r.headers["Retry-After"]) <= 7  # refused up front, same answer
    finally:
        f.close()


@pytest.mark.slow
def test_a_request_refused_on_its_head_reaches_the_async_client_as_its_status() -> None:
    """A body over the limit (413) or a wrong key (401) is answered before the body is read;
    the router then reads and drops the rest instead of closing on it, so the client, which
    reads only once it has sent everything, gets the answer and not a reset connection (the
    async client saw ReadError, retried, and uploaded the body three times)."""
    import asyncio

    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(
        router={"limits": {"max_body_bytes": 16 << 20}}, api_keys=ApiKeys({digest("sk-right")})
    )
    try:

        async def call(key: str, size: int) -> BaseException:
            c = openai.AsyncOpenAI(base_url=f.base, api_key=key, max_retries=0, timeout=30)
            try:
                await c.chat.completions.create(
                    model="sim", max_tokens=1, messages=[{"role": "user", "content": "a" * size}]
                )
            except BaseException as e:
                return e
            finally:
                await c.close()
            raise AssertionError("no error")

        for _ in range(3):
            e = asyncio.run(call("sk-right", 24 << 20))
            assert isinstance(e, openai.APIStatusError) and e.status_code == 413, repr(e)
            assert e.body["code"] == "request_too_large"
            e = asyncio.run(call("sk-wrong", 8 << 20))
            assert isinstance(e, openai.AuthenticationError) and e.body["code"] == "invalid_api_key", repr(e)
        # The router still serves (nothing was left half-read).
        ok = openai.OpenAI(base_url=f.base, api_key="sk-right", max_retries=0, timeout=20)
        assert ok.chat.completions.create(model="sim", messages=MSG).choices[0].message.content
    finally:
        f.close()


@pytest.mark.slow
def test_a_client_that_never_finishes_its_body_is_let_go() -> None:
    """Lingering after a refusal is bounded: a client that keeps the connection open without
    sending is dropped once LINGER_IDLE_S passes without a byte."""
    import time

    from cluster_cli.router import server

    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(router={"limits": {"max_body_bytes": 1024}})
    old = server.LINGER_IDLE_S
    server.LINGER_IDLE_S = 0.3
    try:
        with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 5000\r\n\r\n" + b"x" * 100)
            got = b""
            t0 = time.monotonic()
            while b"\r\n\r\n" not in got:
                got += s.recv(4096)
            assert got.startswith(b"HTTP/1.1 413 ")
            # Half-closed by the router: the answer ends (EOF) while the client may still send.
            while chunk := s.recv(4096):
                got += chunk
            for _ in range(3):  # still read (and dropped) while it keeps coming, not reset
                s.sendall(b"y" * 100)
                time.sleep(0.1)
            # Idle now for longer than the bound: the router drops it (a reset greets the next sends).
            time.sleep(1.0)
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                for _ in range(5):
                    s.sendall(b"z")
                    time.sleep(0.1)
            assert time.monotonic() - t0 < 4
    finally:
        server.LINGER_IDLE_S = old
        f.close()


def _lingering(port: int, n: int) -> list[socket.socket]:
    """``n`` connections refused (a malformed head), each answered and now lingering."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"BAD REQUEST LINE\r\n\r\n")
        got = b""
        while chunk := s.recv(4096):  # the 400, then the router's half-close
            got += chunk
        assert got.startswith(b"HTTP/1.1 400 "), got
        out.append(s)
    return out


def test_lingering_connections_count_against_max_connections_and_go_with_the_router() -> None:
    """A refused connection still reading holds a descriptor: it counts against
    max_connections (a flood of bad requests gets 503s, not the descriptors that health checks
    and served clients need), and the router's stop closes it."""
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(router={"limits": {"max_connections": 6}})
    try:
        socks = _lingering(f.port, 6)
        assert f.lt.call(lambda: len(f.router.lingering)) == 6
        with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 503 ")
        for s in socks[:3]:
            s.close()
        f.lt.wait_for(lambda: len(f.router.lingering) == 3, what="the closed ones to be let go")
        assert httpx.get(f.url + "/health").status_code == 200
        f.lt.run(f.router.stop(0.2))
        f.lt.wait_for(lambda: not f.router.lingering, what="stop to close the lingering connections")
        for s in socks[3:]:
            s.close()
    finally:
        f.close()


def test_lingering_reads_the_refused_body_and_no_more() -> None:
    """A 401 refused on its head is read on only for the body it announced: then the router
    closes, instead of taking whatever the client sends for half a minute."""
    import time

    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(api_keys=ApiKeys({digest("sk-right")}))
    try:
        with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 200000\r\n\r\n")
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            assert got.startswith(b"HTTP/1.1 401 ")
            s.sendall(b"x" * 200000)  # the body it announced: read and dropped
            t0 = time.monotonic()
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                while time.monotonic() - t0 < 10:  # more than announced: not read for long
                    s.sendall(b"y" * 65536)
                    time.sleep(0.01)
            assert time.monotonic() - t0 < 3
    finally:
        f.close()


def test_a_refused_head_request_gets_a_head_alone() -> None:
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start()
    try:
        for target in (b"/v1/chat/completions", b"/nope"):
            with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
                s.sendall(b"HEAD " + target + b" HTTP/1.1\r\nHost: r\r\nContent-Length: 100000\r\n\r\n")
                got = b""
                while chunk := s.recv(4096):
                    got += chunk
                status = b"405 " if target == b"/v1/chat/completions" else b"404 "
                assert got.startswith(b"HTTP/1.1 " + status) and got.endswith(b"\r\n\r\n"), got
    finally:
        f.close()


def test_a_head_with_bare_lf_line_ends_is_refused_at_once() -> None:
    """The head's end is found by CRLF CRLF: one written with bare LFs never ended, and the
    connection was held until the read timeout (a minute) for a 408."""
    import time

    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start()
    try:
        for head in (b"GET /health HTTP/1.1\nHost: x\n\n", b"GET /health HTTP/1.1\r\nHost: x\n\n"):
            with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
                t0 = time.monotonic()
                s.sendall(head)
                got = s.recv(4096)
                assert got.startswith(b"HTTP/1.1 400 ") and b"CRLF" in got, got
                assert time.monotonic() - t0 < 2
        # Sent in pieces, the "\n\n" split across two reads, all the same.
        with socket.create_connection(("127.0.0.1", f.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\nHost: x\n")
            time.sleep(0.1)
            s.sendall(b"\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
        assert httpx.get(f.url + "/health").status_code == 200
    finally:
        f.close()
