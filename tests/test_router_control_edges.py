"""Control-plane edges: half-open probes, an engine's own 429, retries that
have nowhere else to go, IPv6 endpoints, failed scrapes. Simulated engines, real sockets."""

from __future__ import annotations

import threading

import httpx
import pytest
from simengine import Fleet

from cluster_cli.router.breaker import State
from cluster_cli.router.config import RouterConfig, endpoint_views
from cluster_cli.router.endpoint import Endpoint

MSG = [{"role": "user", "content": "hello"}]


def chat(f: Fleet, **kw: object) -> httpx.Response:
    return httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG, **kw}, timeout=30)


@pytest.mark.slow
def test_a_half_open_probe_is_judged_when_the_engine_answers_and_requests_wait_behind_it() -> None:
    """One endpoint, streams of about a second: once its breaker half-opens, requests that
    come while the probe is out wait in the queue (they were refused with 503, for as long
    as two whole generations took), and the probe counts once the engine answers."""
    f = Fleet(1, capacity=8, token_delay_s=0.05, tokens=20).start(
        router={
            "breaker": {"failure_threshold": 1, "open_for_s": 0.2, "success_threshold": 2},
            "health_interval_s": 60,
            "admission": {"max_wait_s": 20},
        }
    )
    (e,) = f.engines
    try:
        f.lt.call(lambda: setattr(e, "fail_status", 500))
        assert chat(f).status_code == 500  # the engine's own answer: nowhere else to retry
        w = f.router.table.endpoints[e.url]
        # The router settles its books just after the answer is out: wait for it (a slow box).
        f.lt.wait_for(lambda: w.failed == 1, what="the failure counted")
        assert w.breaker.state is State.OPEN or w.breaker.openings == 1
        f.lt.call(lambda: setattr(e, "fail_status", None))
        f.lt.wait_for(lambda: w.breaker.current() is State.HALF_OPEN, what="the breaker to half-open")
        codes: list[int] = []
        seen: list[tuple[State, int]] = []  # at each client's first token: the breaker, streams done

        def one() -> None:
            with httpx.stream(
                "POST", f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": True}, timeout=30
            ) as r:
                codes.append(r.status_code)
                if r.status_code == 200:
                    for i, _ in enumerate(r.iter_lines()):
                        if i == 0:
                            seen.append((w.breaker.state, e.served))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert codes == [200, 200, 200, 200], codes
        # Each went on as soon as the probe before it was answered, not a generation later;
        # only streams served whole closed the breaker.
        assert seen == [(State.HALF_OPEN, 0)] * 4, seen
        # settled just after the last stream's end reached its client
        f.lt.wait_for(lambda: w.breaker.state is State.CLOSED, what="the breaker closed by streams served whole")
        assert e.served >= 4
    finally:
        f.close()


def test_a_probe_that_is_answered_and_then_cut_reopens_the_breaker_for_longer() -> None:
    """An engine that answers at once and then cuts its streams must not close its breaker
    on the answer: its open time would never grow while each cycle let a burst through."""
    f = Fleet(1, capacity=8, token_delay_s=0.01, tokens=20).start(
        router={"breaker": {"failure_threshold": 1, "open_for_s": 0.2, "success_threshold": 1}, "health_interval_s": 60}
    )
    (e,) = f.engines
    try:
        f.lt.call(lambda: setattr(e, "cut_after", 2))
        w = f.router.table.endpoints[e.url]
        with httpx.stream(
            "POST", f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200 and "upstream_stream_cut" in r.read().decode()
        f.lt.wait_for(lambda: w.breaker.openings == 1, what="the cut counted")  # just after the answer is out
        f.lt.wait_for(lambda: w.breaker.current() is State.HALF_OPEN, what="the breaker to half-open")
        with httpx.stream(
            "POST", f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200 and "upstream_stream_cut" in r.read().decode()
        # A failed probe: reopened, and the open time grows. (Its state is not checked: on a
        # slow box the 0.4 s may be over, and the breaker half-open again, by now.)
        f.lt.wait_for(lambda: w.breaker.openings == 2, what="the failed probe counted")
        assert w.breaker.open_for() == 0.4
    finally:
        f.close()


@pytest.mark.slow
def test_an_engine_s_429_is_retried_elsewhere_and_is_no_success_or_failure() -> None:
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(router={"breaker": {"failure_threshold": 2}})
    busy, good = f.engines
    f.lt.call(lambda: setattr(busy, "fail_status", 429))
    try:
        codes = [chat(f).status_code for _ in range(20)]
        assert codes == [200] * 20
        w = f.router.table.endpoints[busy.url]
        assert busy.requests > 0, "the busy engine was never tried: the test shows nothing"
        assert w.breaker.state is State.CLOSED and w.failed == 0 and w.completed == 0
        assert good.served == 20
    finally:
        f.close()


def test_a_single_endpoint_s_429_and_5xx_reach_the_client_as_the_engine_sent_them() -> None:
    """Nowhere else to go: no retry back to the engine that said no (an engine shedding load
    with 503 got three times the requests), and its own answer, not a made-up 502."""
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2).start(router={"breaker": {"failure_threshold": 50}})
    (e,) = f.engines
    try:
        for status in (429, 503):
            f.lt.call(lambda s=status: setattr(e, "fail_status", s))
            before = e.requests
            r = chat(f)
            assert r.status_code == status and r.json()["error"]["message"] == "simulated failure"
            assert e.requests - before == 1
        w = f.router.table.endpoints[e.url]
        f.lt.wait_for(lambda: w.failed == 1, what="the 503 counted")  # just after the answer is out
        assert (w.failed, w.completed) == (1, 0)  # the 503 is a failure, the 429 neither
    finally:
        f.close()


def test_with_the_other_endpoints_unusable_the_engine_s_own_answer_is_relayed() -> None:
    """Two endpoints, one draining: nowhere else to retry, so the client gets the engine's
    own error, not a 502 made up by the router."""
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    f.start(cfg=f.config(router={"breaker": {"failure_threshold": 50}}, endpoint_extra={1: {"draining": True}}))
    bad, _ = f.engines
    try:
        f.lt.call(lambda: setattr(bad, "fail_status", 500))
        r = chat(f)
        assert r.status_code == 500 and r.json()["error"]["message"] == "simulated failure"
        assert bad.requests == 1
    finally:
        f.close()


def test_a_retry_never_goes_back_to_an_endpoint_that_just_failed() -> None:
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(
        router={"breaker": {"failure_threshold": 50}, "retry": {"max_attempts": 5}}
    )
    try:
        for e in f.engines:
            f.lt.call(lambda e=e: setattr(e, "fail_status", 500))
        r = chat(f)
        # The last endpoint it could try answered: that answer is the client's.
        assert r.status_code == 500 and r.json()["error"]["message"] == "simulated failure"
        assert [e.requests for e in f.engines] == [1, 1]  # one try each, not five in all
    finally:
        f.close()


def _endpoint(url: str) -> Endpoint:
    cfg = RouterConfig.model_validate(
        {"engines": {"vllm": {"metrics": {}}}, "models": {"m": {"endpoints": [{"url": url, "engine": "vllm"}]}}}
    )
    (view,) = endpoint_views(cfg).values()
    return Endpoint(view)


def test_an_ipv6_endpoint_is_asked_with_its_address_in_brackets() -> None:
    assert _endpoint("http://[::1]:8000").host_header == b"[::1]:8000"
    assert _endpoint("http://[fe80::1]:8000").view.host == "fe80::1"  # what the socket connects to
    assert _endpoint("http://10.0.0.1:8000").host_header == b"10.0.0.1:8000"
    assert _endpoint("http://gpu-01:8000").host_header == b"gpu-01:8000"


def test_a_failed_scrape_drops_the_engine_s_load_at_once() -> None:
    """The contract: a failed scrape falls back to the in-flight count, not to the last
    reading until it goes stale (an engine restarting kept its old load for seconds)."""
    w = _endpoint("http://10.0.0.1:8000")
    now = w._clock()
    w.on_scrape(40.0, 3.0, 0.8, now, now)
    assert w.load(now) == 43.0 and w.kv(now) == 0.8
    w.acquire()
    w.on_scrape_error("ValueError: HTTP 500")
    assert w.load(now) == 1.0 and w.kv(now) is None  # only the router's own request
    assert w.scraped.error == "ValueError: HTTP 500" and w.scraped.at == now  # its age still counts
