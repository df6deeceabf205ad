"""Failure handling end to end: retries, breaker, stream cuts, timeouts, draining, admission, clients
that stop reading, and connections closed under a write."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from helpers import chat_request
from simengine import Fleet

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.breaker import State

MSG = [{"role": "user", "content": "hello"}]


def client(f: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f.base, api_key="x", max_retries=0, timeout=20)


def chat(f: Fleet, **kw) -> httpx.Response:
    return httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG, **kw}, timeout=20)


@pytest.mark.slow
def test_5xx_is_retried_elsewhere_and_opens_the_breaker():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(router={"breaker": {"failure_threshold": 3}})
    bad, _good = f.engines
    f.lt.call(lambda: setattr(bad, "fail_status", 500))
    try:
        c = client(f)
        for _ in range(20):
            assert c.chat.completions.create(model="sim", messages=MSG).choices
            assert len(list(c.chat.completions.create(model="sim", messages=MSG, stream=True))) == 3
        w = f.router.table.endpoints[bad.url]
        assert f.lt.call(lambda: w.breaker.state) is State.OPEN
        assert 1 <= bad.requests <= 3 + 2  # threshold, plus at most a half-open probe or two
        assert 'clusterctl_router_retries_total{model="sim",reason="5xx"}' in httpx.get(f.url + "/metrics").text
    finally:
        f.close()


def test_breaker_half_open_probe_closes_after_recovery():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(
        router={"breaker": {"failure_threshold": 2, "open_for_s": 0.2, "success_threshold": 2}}
    )
    bad = f.engines[0]
    w = f.router.table.endpoints[bad.url]
    f.lt.call(lambda: setattr(bad, "fail_status", 503))
    try:
        c = client(f)
        for _ in range(20):  # it opens within a few requests; checked after each, since under
            c.chat.completions.create(model="sim", messages=MSG)  # load 0.2 s can pass in between
            if f.lt.call(lambda: w.breaker.state) is State.OPEN:
                break
        assert f.lt.call(lambda: w.breaker.state) is State.OPEN
        f.lt.call(lambda: setattr(bad, "fail_status", None))
        for _ in range(400):  # bounded: each call is a real request
            c.chat.completions.create(model="sim", messages=MSG)
            if f.lt.call(lambda: w.breaker.current()) is State.CLOSED:
                break
        assert f.lt.call(lambda: w.breaker.current()) is State.CLOSED
        assert bad.served >= 2
    finally:
        f.close()


def test_refused_connections_are_retried():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start()
    dead = f.engines[0]
    f.lt.run(dead.refuse())
    try:
        c = client(f)
        for _ in range(10):
            assert len(list(c.chat.completions.create(model="sim", messages=MSG, stream=True))) == 3
        assert f.engines[1].served == 10
    finally:
        f.close()


def test_stream_cut_upstream_ends_with_sse_error_and_clean_close():
    """A cut stream that is not continued (resume_limit 0; see test_router_continue.py)."""
    f = Fleet(2, capacity=4, token_delay_s=0.002, tokens=10).start(router={"resume_limit": 0})
    for e in f.engines:
        e.cut_after = 3
    try:
        body = {"model": "sim", "messages": MSG, "stream": True}
        with httpx.stream("POST", f.base + "/chat/completions", json=body, timeout=20) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]  # ends: no hang
        assert len(events) == 4
        err = json.loads(events[-1][6:])["error"]
        assert err["code"] == "upstream_stream_cut" and set(err) == {"message", "type", "param", "code"}
        assert sum(e.requests for e in f.engines) == 1  # the stream had started: no retry
        with pytest.raises(openai.APIError):
            for _ in client(f).chat.completions.create(model="sim", messages=MSG, stream=True):
                pass
        assert chat(f, max_tokens=2).status_code == 200  # the router is fine afterwards
    finally:
        f.close()


def test_concurrent_streams_cut_upstream_each_end_cleanly():
    """Every stream of an engine that cuts them ends with the error event; none hangs."""
    f = Fleet(1, capacity=4, token_delay_s=0.01, tokens=10).start()
    eng = f.engines[0]
    eng.cut_after = 3
    body = {"model": "sim", "messages": MSG, "stream": True}
    results: list[str] = []

    def one() -> None:
        with httpx.stream("POST", f.base + "/chat/completions", json=body, timeout=20) as r:
            results.append([line for line in r.iter_lines() if line.startswith("data: ")][-1])

    try:
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert len(results) == 3 and all("upstream_stream_cut" in last for last in results)
        assert f.lt.call(lambda: (eng.running, eng.aborted)) == (0, 3)  # the engine's own books balance
    finally:
        f.close()


def test_a_client_that_hangs_up_after_done_was_served():
    """OpenAI's clients close on "[DONE]"; when the engine's terminating chunk comes later,
    the request still counts as served: status 200 in the log and metrics, a completion."""
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=3).start(access_log=AccessLog(buf))
    eng = f.engines[0]
    eng.done_linger_s = 2.0
    w = f.router.table.endpoints[eng.url]
    try:
        chunks = list(client(f).chat.completions.create(model="sim", messages=MSG, stream=True))
        assert len(chunks) == 4
        f.lt.wait_for(lambda: w.inflight == 0, what="the request to leave the endpoint")
        assert f.lt.call(lambda: (w.completed, w.failed)) == (1, 0)
        f.lt.call(f.router.access.flush)
        (rec,) = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert (rec["status"], rec["note"]) == (200, "client closed after [DONE]")
        assert 'status="200"' in httpx.get(f.url + "/metrics").text
    finally:
        f.close()


def test_only_the_done_event_itself_marks_a_stream_as_complete():
    from cluster_cli.router.proxy import Exchange
    from cluster_cli.router.upstream import CHUNKED

    class Client:
        keep_alive = True

        def now(self) -> float:
            return 0.0

    def ex_after(*bodies: bytes) -> Exchange:
        ex = Exchange(Client(), None, True, None)  # type: ignore[arg-type]
        ex.on_head(200, [], b"text/event-stream", CHUNKED)
        for b in bodies:
            ex.on_body(b)
        return ex

    delta = b'data: {"choices":[{"delta":{"content":"[DONE]"}}]}\n\n'
    assert not ex_after(delta).done_seen  # a model that writes "[DONE]" has not ended its stream
    assert ex_after(delta, b"data: [DONE]\n\n").done_seen
    assert ex_after(b"data: [DO", b"NE]\r\n\r\n").done_seen  # split across reads, CRLF events


def test_upstream_idle_timeout_gives_504_in_openai_shape():
    f = Fleet(1, capacity=4, token_delay_s=0.001).start(
        router={"limits": {"idle_timeout_s": 0.3}, "retry": {"max_attempts": 1}}
    )
    f.engines[0].hang = True
    try:
        r = chat(f, stream=True)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_error" and "timeout" in r.json()["error"]["message"]
    finally:
        f.close()


@pytest.mark.slow
def test_a_non_streamed_answer_may_take_longer_than_the_idle_timeout():
    """A non-streamed reply comes only once generated: silence before it is the engine's work.
    Past the idle timeout it is still served, by one generation, and no breaker is struck."""
    f = Fleet(2, capacity=4, token_delay_s=0.05, tokens=20).start(router={"limits": {"idle_timeout_s": 0.3}})
    try:
        for _ in range(2):
            r = chat(f)
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["message"]["content"].split()) == 20
        assert sum(e.requests for e in f.engines) == 2
        states = f.lt.call(lambda: [w.breaker.state for w in f.router.table.endpoints.values()])
        assert all(s.name == "CLOSED" for s in states), states
    finally:
        f.close()


@pytest.mark.slow
def test_a_response_timeout_is_a_504_not_retried_and_no_breaker_strike():
    """Past response_timeout_s with no answer the client gets 504 upstream_timeout, marked not to
    be retried (x-should-retry: false, which OpenAI's clients honour); no other endpoint starts
    the work over, and the engine's breaker stays closed (its health checks pass)."""
    f = Fleet(2, capacity=4, token_delay_s=0.05, tokens=40).start(
        router={"limits": {"idle_timeout_s": 0.3, "response_timeout_s": 0.5}}
    )
    try:
        c = openai.OpenAI(base_url=f.base, api_key="x", timeout=20)  # the client's default retries on
        with pytest.raises(openai.APIStatusError) as ei:
            c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
        assert ei.value.status_code == 504 and ei.value.body["code"] == "upstream_timeout"
        assert ei.value.response.headers["x-should-retry"] == "false"
        assert sum(e.requests for e in f.engines) == 1  # not retried by the router nor the client
        states = f.lt.call(lambda: [w.breaker.state for w in f.router.table.endpoints.values()])
        assert all(s.name == "CLOSED" for s in states), states
        # A stream's head comes at once: the same engines serve it under the same limits.
        assert chat(f, stream=True).status_code == 200
    finally:
        f.close()


@pytest.mark.slow
def test_hanging_endpoint_is_retried_before_first_byte():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(router={"limits": {"idle_timeout_s": 0.3}})
    f.engines[0].hang = True
    try:
        for _ in range(4):
            assert chat(f, stream=True).status_code == 200
        assert f.engines[1].served == 4
    finally:
        f.close()


@pytest.mark.slow
def test_draining_endpoint_gets_nothing_and_503_reason():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    f.start(cfg=f.config(endpoint_extra={0: {"draining": True}}))
    try:
        for _ in range(6):
            assert chat(f).status_code == 200
        assert f.engines[0].requests == 0 and f.engines[1].served == 6
    finally:
        f.close()
    f = Fleet(4, capacity=4, token_delay_s=0.001, tokens=2)
    f.start(cfg=f.config(endpoint_extra={0: {"draining": True}, 1: {"draining": True}}))
    try:
        for e in f.engines[2:]:
            w = f.router.table.endpoints[e.url]
            f.lt.call(lambda w=w: (w.breaker._open(), None)[1])
        r = chat(f)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "0/4 endpoints available: 2 circuit open, 2 draining"
    finally:
        f.close()


def _raw_stream(port: int) -> socket.socket:
    body = json.dumps({"model": "sim", "messages": MSG, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    return s


def test_admission_queue_then_429_with_retry_after():
    f = Fleet(1, capacity=1, token_delay_s=0.02, tokens=1000)
    f.start(
        cfg=f.config(router={"admission": {"max_queue": 1, "max_wait_s": 20}}, endpoint_extra={0: {"max_inflight": 1}})
    )
    eng = f.engines[0]
    entry = f.router.table.models["sim"]
    try:
        s1 = _raw_stream(f.port)
        f.lt.wait_for(lambda: eng.running == 1, what="first request running")
        result: dict = {}

        def queued() -> None:
            result["r"] = chat(f, max_tokens=2)

        t = threading.Thread(target=queued)
        t.start()
        f.lt.wait_for(lambda: len(entry.queue) == 1, what="second request queued in the router")
        assert eng.requests == 1  # the engine never saw it
        r = chat(f)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        s1.close()  # frees the slot: the queued request goes through
        t.join(20)
        assert result["r"].status_code == 200
        assert (
            'clusterctl_router_admission_rejections_total{model="sim",reason="queue_full"} 1.0'
            in httpx.get(f.url + "/metrics").text
        )
    finally:
        f.close()


def test_a_retry_waits_for_the_busy_endpoint_rather_than_the_dead_one():
    """tiny-0 dies while tiny-1 is full: a new request must not spend its retries on tiny-0."""
    f = Fleet(2, capacity=1, token_delay_s=0.02, tokens=1000)
    # no active health checks here: the retry logic alone must keep the request alive
    f.start(cfg=f.config(router={"health_interval_s": 60}, endpoint_extra={1: {"max_inflight": 1}}))
    dead, busy = f.engines
    entry = f.router.table.models["sim"]
    try:
        s1, s2 = _raw_stream(f.port), _raw_stream(f.port)  # one long stream on each engine
        f.lt.wait_for(lambda: dead.running == 1 and busy.running == 1, what="one stream on each engine")
        f.lt.run(dead.refuse())  # tiny-0 goes away; tiny-1 stays full
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("r", chat(f, max_tokens=2)))
        t.start()
        f.lt.wait_for(lambda: len(entry.queue) == 1 or "r" in result, what="the retry queued for tiny-1")
        assert "r" not in result, result["r"].text  # not failed on tiny-0 over and over
        assert f.router.table.endpoints[dead.url].breaker.failures == 1
        for s in (s1, s2):
            s.close()  # the stream on tiny-1 ends: its slot goes to the waiting retry
        t.join(20)
        assert result["r"].status_code == 200, result["r"].text
        assert busy.served >= 1
    finally:
        f.close()


def test_admission_queue_timeout_is_429():
    f = Fleet(1, capacity=1, token_delay_s=0.02, tokens=1000)
    f.start(
        cfg=f.config(router={"admission": {"max_queue": 4, "max_wait_s": 0.3}}, endpoint_extra={0: {"max_inflight": 1}})
    )
    try:
        s1 = _raw_stream(f.port)
        f.lt.wait_for(lambda: f.engines[0].running == 1, what="first request running")
        r = chat(f)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout" and "retry-after" in r.headers
        s1.close()
    finally:
        f.close()


def test_learned_capacity_holds_requests_in_the_router():
    """Once a scrape shows the engine queueing, the router keeps the surplus in its own queue."""
    f = Fleet(1, capacity=2, token_delay_s=0.02, tokens=1000).start()
    eng = f.engines[0]
    w = f.router.table.endpoints[eng.url]
    socks = []
    try:
        socks = [_raw_stream(f.port) for _ in range(3)]
        f.lt.wait_for(lambda: w.cap == 2, what="capacity learned from the scrape")
        socks.append(_raw_stream(f.port))
        f.lt.wait_for(lambda: len(f.router.table.models["sim"].queue) == 1, what="fourth request held in the router")
        assert eng.requests == 3
    finally:
        for s in socks:
            s.close()
        f.close()


@pytest.mark.slow
def test_requests_waiting_only_for_the_next_scheduler_step_do_not_teach_a_low_capacity():
    """At moderate load a scrape often catches the router's newest request
    waiting for the engine's next step while slots are free. Read as "full at running",
    that taught a capacity of 3 to an engine of 8 and the router held requests back from
    it (at 8 req/s on 16 slots, time to first token went from 15 ms to 9 s)."""
    f = Fleet(1, capacity=8, token_delay_s=0.1, tokens=4).start()
    w = f.router.table.endpoints[f.engines[0].url]
    stop = time.monotonic() + 4.0
    codes: list[int] = []

    def client_loop() -> None:  # four clients, each sending its next request as one ends
        while time.monotonic() < stop:
            codes.append(chat(f, max_tokens=4).status_code)

    try:
        threads = [threading.Thread(target=client_loop) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert codes and set(codes) == {200}
        assert w.cap is None  # never more waiting than was just sent: never seen full
        assert len(f.router.table.models["sim"].queue) == 0
        assert f.engines[0].requests >= 2 * len(threads)  # each client had its next request in
    finally:
        f.close()


@pytest.mark.slow
def test_requests_hanging_on_an_endpoint_judged_dead_are_retried_at_once():
    """A frozen engine (accepts, never answers, fails /health): once its breaker opens on the
    health checks, requests still waiting there for a first byte go elsewhere, instead of
    waiting out the idle timeout (300 s by default; 30 s here, far beyond the test)."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(
        router={"limits": {"idle_timeout_s": 30}, "health_interval_s": 0.1, "breaker": {"health_failure_threshold": 2}}
    )
    frozen, good = f.engines
    f.lt.call(lambda: setattr(frozen, "hang", True))  # takes requests, answers none, /health still fine
    try:
        results: list[int] = []

        def one() -> None:
            results.append(chat(f, stream=True).status_code)

        threads: list[threading.Thread] = []
        t0 = time.monotonic()
        while f.lt.call(lambda: frozen.requests) < 2 and len(threads) < 40:  # until two are stuck there
            threads.append(threading.Thread(target=one))
            threads[-1].start()
            time.sleep(0.02)
        assert f.lt.call(lambda: frozen.requests) >= 1
        f.lt.call(lambda: setattr(frozen, "health_status", 503))  # now its health checks fail too
        for t in threads:
            t.join(25)
        took = time.monotonic() - t0
        assert results == [200] * len(threads)
        assert f.lt.call(lambda: good.served) == len(threads)
        assert took < 20, took  # bounded by the health checks, not by the 30-s idle timeout
    finally:
        f.close()


@pytest.mark.slow
def test_streams_longer_than_the_grace_period_end_cleanly_and_are_logged():
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.05, tokens=200).start(access_log=AccessLog(buf, max_buffer=1))
    try:
        events: list[str] = []
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    f.base + "/chat/completions",
                    json={"model": "sim", "messages": MSG, "stream": True},
                    timeout=20,
                ) as r:
                    events.extend(line for line in r.iter_lines() if line.startswith("data: "))
            except BaseException as e:  # reported by the test
                failure.append(e)

        t = threading.Thread(target=stream)
        t.start()
        f.lt.wait_for(lambda: f.engines[0].running == 1, what="the stream to start")
        time.sleep(0.2)
        f.lt.run(f.router.stop(0.3), 15)
        t.join(10)
        assert not failure, failure  # a clean end: no "incomplete chunked read"
        assert 1 < len(events) < 200
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == "upstream_stream_cut" and "grace period over" in last["error"]["message"]
        f.lt.wait_for(lambda: f.engines[0].running == 0, what="the engine slot to be freed")
        f.lt.call(f.router.access.flush)
        (line,) = [json.loads(x) for x in buf.getvalue().splitlines() if '"/v1/chat/completions"' in x]
        assert line["status"] == 200 and "the router shut down (0.3 s grace period over)" in line["note"]
    finally:
        f.close()


@pytest.mark.slow
def test_a_request_refused_while_draining_closes_its_kept_alive_connection():
    f = Fleet(1, capacity=4, token_delay_s=0.02, tokens=40).start()
    try:
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.settimeout(5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")  # kept alive
            streaming = threading.Thread(target=lambda: chat(f, stream=True))
            streaming.start()
            f.lt.wait_for(lambda: f.engines[0].running == 1, what="a stream in flight")
            stopping = asyncio.run_coroutine_threadsafe(f.router.stop(10), f.lt.loop)
            f.lt.wait_for(lambda: f.router._draining, what="draining")
            body = json.dumps({"model": "sim", "messages": MSG}).encode()
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            head = s.recv(65536).split(b"\r\n\r\n")[0]
            assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head
            streaming.join(10)
            stopping.result(15)
    finally:
        f.close()


def _post_into(f: Fleet, out: list, **kw) -> None:
    try:
        r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG, **kw}, timeout=20)
        out.append((r.status_code, r.headers.get("connection"), r.text))
    except httpx.HTTPError as e:
        out.append(("error", type(e).__name__, str(e)))


def test_a_request_queued_when_the_grace_period_ends_gets_a_503():
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.05, tokens=200)
    f.start(cfg=f.config(endpoint_extra={0: {"max_inflight": 1}}), access_log=AccessLog(buf, max_buffer=1))
    try:
        a: list = []
        b: list = []
        ta = threading.Thread(target=_post_into, args=(f, a), kwargs={"stream": True})
        ta.start()
        f.lt.wait_for(lambda: f.engines[0].running == 1, what="the first request running")
        tb = threading.Thread(target=_post_into, args=(f, b))
        tb.start()
        f.lt.wait_for(lambda: len(f.router.table.models["sim"].queue) == 1, what="the second one queued")
        f.lt.run(f.router.stop(0.3), 15)
        ta.join(10)
        tb.join(10)
        assert b[0][:2] == (503, "close") and "router_draining" in b[0][2], b
        f.lt.call(f.router.access.flush)
        logged = [json.loads(x) for x in buf.getvalue().splitlines() if '"/v1/chat/completions"' in x]
        queued = [x for x in logged if x["status"] == 503]
        assert len(logged) == 2 and len(queued) == 1 and queued[0]["attempts"] == 0
    finally:
        f.close()


def test_an_unanswered_request_cut_by_the_shutdown_gets_a_closing_503():
    f = Fleet(1, capacity=4, token_delay_s=0.05, tokens=20).start()
    f.lt.call(lambda: setattr(f.engines[0], "hang", True))
    try:
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.settimeout(5)
            body = json.dumps({"model": "sim", "messages": MSG}).encode()
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            f.lt.wait_for(lambda: f.engines[0].requests == 1, what="the request at the engine")
            f.lt.run(f.router.stop(0.3), 15)
            head = s.recv(65536).split(b"\r\n\r\n")[0]
            assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head
    finally:
        f.close()


@pytest.mark.slow
def test_a_slow_engine_that_misses_health_checks_keeps_its_requests():
    """A busy engine that misses a few health checks is not frozen: its stream keeps moving,
    so its breaker opens (no new work) but the requests it is serving are not cut."""
    f = Fleet(1, capacity=4, token_delay_s=0.02, tokens=100).start(
        router={"health_interval_s": 0.1, "breaker": {"health_failure_threshold": 2}}
    )
    try:
        streamed: list = []
        plain: list = []
        ts = threading.Thread(target=_post_into, args=(f, streamed), kwargs={"stream": True})
        tp = threading.Thread(target=_post_into, args=(f, plain))
        ts.start()
        tp.start()
        f.lt.wait_for(lambda: f.engines[0].running == 2, what="both running")
        f.lt.call(lambda: setattr(f.engines[0], "health_status", 503))
        f.lt.wait_for(lambda: f.router.table.endpoints[f.engines[0].url].breaker.state is State.OPEN, what="open")
        time.sleep(0.5)
        f.lt.call(lambda: setattr(f.engines[0], "health_status", 200))
        ts.join(20)
        tp.join(20)
        assert streamed[0][0] == 200 and plain[0][0] == 200, (streamed, plain)
        assert f.lt.call(lambda: f.engines[0].aborted) == 0
    finally:
        f.close()


@pytest.mark.slow
def test_the_same_5xx_from_every_endpoint_is_the_requests_fault_and_opens_no_breaker():
    """llama-server answers 500 for an image sent to a text-only model on every replica: a few
    such requests opened every healthy replica's breaker and the whole model answered 503."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(router={"breaker": {"failure_threshold": 2}})
    for e in f.engines:
        f.lt.call(lambda e=e: setattr(e, "fail_status", 500))
    try:
        for _ in range(6):
            r = chat(f)
            assert r.status_code == 500  # the engine's own answer, relayed after the retry
        endpoints = [f.router.table.endpoints[e.url] for e in f.engines]
        assert [f.lt.call(lambda w=w: w.breaker.current()) for w in endpoints] == [State.CLOSED, State.CLOSED]
        assert [w.failed for w in endpoints] == [0, 0]
        for e in f.engines:  # the next good request is served at once
            f.lt.call(lambda e=e: setattr(e, "fail_status", None))
        assert chat(f).status_code == 200
    finally:
        f.close()


def test_a_501_is_relayed_not_retried_and_blames_no_engine():
    """501: the engine does not do this (embeddings asked of a chat-only llama-server). Every
    replica would say the same: relayed at once, counted against none, marked not to be retried."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(router={"breaker": {"failure_threshold": 1}})
    for e in f.engines:
        f.lt.call(lambda e=e: setattr(e, "fail_status", 501))
    try:
        for _ in range(4):
            assert chat(f).status_code == 501
        assert sum(e.requests for e in f.engines) == 4  # one engine each time: not retried
        # Nor by OpenAI's client (its default retries), which the answer tells not to.
        c = openai.OpenAI(base_url=f.base, api_key="x", timeout=20)
        with pytest.raises(openai.APIStatusError) as ei:
            c.embeddings.create(model="sim", input="x")
        assert ei.value.status_code == 501 and ei.value.response.headers["x-should-retry"] == "false"
        assert sum(e.requests for e in f.engines) == 5
        assert [w.breaker.state for w in f.router.table.endpoints.values()] == [State.CLOSED, State.CLOSED]
    finally:
        f.close()


@pytest.mark.slow
def test_kept_connections_the_engine_closed_after_a_stream_are_retried_on_a_new_one():
    """llama-server closes about a quarter of its kept-alive connections after a streamed
    reply, without "Connection: close". A request sent on one is not the engine's failure:
    it goes again on a new connection. It used to get one retry on another kept connection,
    as likely closed, and then a 502 (or a failure on a healthy endpoint's breaker)."""
    f = Fleet(1, capacity=8, token_delay_s=0.001, tokens=2).start()
    engine = f.engines[0]
    f.lt.call(lambda: setattr(engine, "drop_after_stream", True))
    w = f.router.table.endpoints[engine.url]
    try:
        for _ in range(5):
            threads = [threading.Thread(target=lambda: chat(f, stream=True)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(20)
            # every connection kept from those streams is one the engine will drop
            for _ in range(3):
                assert chat(f).status_code == 200
        assert (w.failed, f.lt.call(lambda: w.breaker.state)) == (0, State.CLOSED)
    finally:
        f.close()


@pytest.mark.slow
def test_a_retried_stream_gives_its_retry_budget_slot_back_once_answered():
    """The retry budget limits retries in flight to engines. A retried stream held its slot
    for the whole stream, and a retry waiting in the queue held one too: with streams of a
    second, a few retries used the budget up and every further failure became a 502 while a
    healthy engine was there."""
    f = Fleet(2, capacity=16, token_delay_s=0.05, tokens=20).start(
        router={"retry": {"min_retry_concurrency": 2, "budget_ratio": 0.0}, "breaker": {"failure_threshold": 1000}}
    )
    bad, _good = f.engines
    f.lt.call(lambda: setattr(bad, "fail_status", 500))
    try:
        codes: list[int] = []

        def one() -> None:
            with httpx.stream(
                "POST", f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": True}, timeout=30
            ) as r:
                r.read()
                codes.append(r.status_code)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.02)  # one after another: each finds the others' retried streams running
        for t in threads:
            t.join(60)
        assert bad.requests >= 2, "too few requests met the failing engine: the test shows nothing"
        assert codes == [200] * 8, codes
        assert f.lt.call(lambda: f.router.budget.active) == 0
    finally:
        f.close()


@pytest.mark.slow
def test_a_half_open_probe_is_bounded_by_the_idle_timeout_and_reopens_the_breaker():
    """A half-open breaker's probe holds the endpoint's one slot: even non-streamed, its wait
    for an answer is bounded by the idle timeout, not the (long) response timeout, and a
    probe that gets nothing reopens the breaker (left half-open, the next request probed and
    hung as long, while the model's queue timed out)."""
    f = Fleet(1, capacity=4, token_delay_s=0.01, tokens=4).start(
        router={
            "limits": {"idle_timeout_s": 0.5, "response_timeout_s": 60},
            "breaker": {"failure_threshold": 1, "open_for_s": 0.3},
        }
    )
    e = f.engines[0]
    w = f.router.table.endpoints[e.url]
    try:
        f.lt.call(lambda: setattr(e, "fail_status", 500))
        assert chat(f).status_code == 500
        assert f.lt.call(lambda: w.breaker.state) is State.OPEN
        f.lt.call(lambda: (setattr(e, "fail_status", None), setattr(e, "hang", True)))
        time.sleep(0.4)  # past open_for_s: the next request is the probe
        t0 = time.monotonic()
        r = chat(f)
        # Failed by the idle timeout (seconds, not the response timeout's minute); its failure
        # reopened the breaker, so the model has no endpoint now: 503 with Retry-After.
        assert time.monotonic() - t0 < 10
        assert r.status_code == 503 and "idle timeout" in r.json()["error"]["message"], r.text
        assert f.lt.call(lambda: w.breaker.state) is State.OPEN
    finally:
        f.close()


@pytest.mark.slow
def test_router_does_not_answer_queue_full_for_clients_that_left():
    f = Fleet(1, capacity=1, token_delay_s=0.01, tokens=1)
    f.start(
        cfg=f.config(router={"admission": {"max_queue": 3, "max_wait_s": 30}}, endpoint_extra={0: {"max_inflight": 1}})
    )
    f.lt.call(lambda: setattr(f.engines[0], "hang", True))
    q = f.router.table.models["sim"].queue
    w = f.router.table.endpoints[f.engines[0].url]
    body = {"model": "sim", "messages": []}

    def post(timeout: float) -> int | str:
        try:
            return httpx.post(f.base + "/chat/completions", json=body, timeout=timeout).status_code
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:  # the fleet closing under the ones still waiting
            return "closed"

    try:
        for _ in range(2):  # one in the engine (hangs), one live waiter at the head of the queue
            threading.Thread(target=post, args=(30,), daemon=True).start()
        f.lt.wait_for(lambda: w.inflight == 1 and len(q) == 1, what="one in flight, one queued")
        assert post(0.3) == "timeout" and post(0.3) == "timeout"  # two queued clients give up
        f.lt.wait_for(lambda: len(q) == 1, what="the clients that left no longer counted")
        assert post(0.5) == "timeout"  # queued behind the live waiter, not 429 "queue full"
        assert f.lt.call(lambda: q.rejected_full) == 0
    finally:
        f.close()


# --------------------------------------------------------------------------- clients that stop reading


def _stream_socket(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # backpressure reaches the router fast
    s.connect(("127.0.0.1", port))
    s.sendall(chat_request(1, stream=True))
    return s


@pytest.mark.slow
def test_a_client_that_stops_reading_is_dropped_without_blaming_the_engine() -> None:
    import io

    from cluster_cli.router.accesslog import AccessLog

    log = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0, tokens=20_000).start(
        router={"limits": {"idle_timeout_s": 1.0}, "breaker": {"failure_threshold": 1}},
        access_log=AccessLog(log, max_buffer=1),
    )
    try:
        w = f.router.table.endpoints[f.engines[0].url]
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


@pytest.mark.slow
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


# --------------------------------------------------------------------------- connections closed under a write


class _ClosedTransport:
    """What uvloop hands back once the engine has closed the socket and before the protocol's
    connection_lost has run: closing, and a write raises RuntimeError ("handler is closed")."""

    def is_closing(self) -> bool:
        return True

    def write(self, data: bytes) -> None:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    def abort(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.errors: list = []

    def on_error(self, exc: object) -> None:
        self.errors.append(exc)

    def flush(self) -> None:
        pass


def test_a_pooled_connection_the_engine_closed_is_skipped_or_failed_as_stale_never_raised() -> None:
    """An engine killed with kept-alive connections to it: a request that picked one up just
    then got a 500 from the router (uvloop's RuntimeError escaped). The pool now skips such a
    connection, and a send on one reports a stale failure (retried on a fresh connection)."""
    from cluster_cli.router.upstream import UpstreamConn, UpstreamPool

    async def scenario() -> None:
        pool = UpstreamPool("127.0.0.1", 9)
        c = UpstreamConn(pool)
        c.tr = _ClosedTransport()  # type: ignore[assignment]
        pool.idle.append(c)
        assert pool.get_idle() is None
        c.reused = True
        sink = _Sink()
        c.send(b"GET / HTTP/1.1\r\n\r\n", sink)  # type: ignore[arg-type]
        assert sink.errors == []
        c.connection_lost(None)  # uvloop delivers it next
        (err,) = sink.errors
        assert err.kind == "reset" and err.stale
        # Lost before the send (a fresh connection the engine reset during the caller's await).
        d = UpstreamConn(pool)
        d.tr = _ClosedTransport()  # type: ignore[assignment]
        d.connection_lost(ConnectionResetError())
        sink2 = _Sink()
        d.send(b"GET / HTTP/1.1\r\n\r\n", sink2)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        (err,) = sink2.errors
        assert err.kind == "reset" and not err.stale

    asyncio.run(scenario())


def test_a_write_to_a_client_that_just_reset_does_not_raise() -> None:
    """The client resets its connection; before its connection_lost runs, the engine's next
    chunk is written to it: the RuntimeError uvloop raises must not escape into the engine's
    connection (it would be torn down with an error logged)."""
    from cluster_cli.router.server import ClientConn

    conn = ClientConn.__new__(ClientConn)
    conn.closed = False
    conn.tr = _ClosedTransport()  # type: ignore[assignment]
    conn.write(b"data: {}\n\n")
