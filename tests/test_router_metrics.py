"""Observability: Prometheus /metrics, /health endpoint state, one access-log line per request."""

from __future__ import annotations

import io
import json
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from simengine import Fleet

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.breaker import State
from cluster_cli.router.keys import ApiKeys

MSG = [{"role": "user", "content": "hello"}]


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_and_access_log():
    buf = io.StringIO()
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2).start(access_log=AccessLog(buf))
    try:
        for stream in (False, True, False):
            assert (
                httpx.post(
                    f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": stream}
                ).status_code
                == 200
            )
        assert httpx.post(f.base + "/chat/completions", json={"model": "nope", "messages": MSG}).status_code == 404
        f.lt.wait_for(
            lambda: all(w.scraped.running is not None for w in f.router.table.endpoints.values()), what="scrapes"
        )
        text = httpx.get(f.url + "/metrics").text
        s = samples(text)
        ok = sum(v for (n, lab), v in s.items() if n == "clusterctl_router_requests_total" and ("status", "200") in lab)
        assert ok == 3
        assert s[("clusterctl_router_requests_total", (("endpoint", ""), ("model", ""), ("status", "404")))] == 1
        assert s[("clusterctl_router_request_duration_seconds_count", (("model", "sim"),))] == 3
        assert s[("clusterctl_router_time_to_first_byte_seconds_count", (("model", "sim"),))] == 3
        for name in (
            "clusterctl_router_endpoint_inflight",
            "clusterctl_router_endpoint_breaker_state",
            "clusterctl_router_endpoint_drain_rate",
            "clusterctl_router_endpoint_scrape_age_seconds",
            "clusterctl_router_queue_length",
            "clusterctl_router_retry_budget_overflows_total",
        ):
            assert name in text, name
        # Per-endpoint series carry the replica's name as ``endpoint``, as the per-request ones do
        # (so they join in PromQL), and where it is as ``url``.
        assert s[("clusterctl_router_endpoint_inflight", (("endpoint", "r0"), ("url", f.engines[0].url)))] == 0
        served = {dict(lab)["endpoint"] for (n, lab) in s if n == "clusterctl_router_requests_total"} - {""}
        gauges = {dict(lab)["endpoint"] for (n, lab) in s if n == "clusterctl_router_endpoint_inflight"}
        assert served and served <= gauges
        health = httpx.get(f.url + "/health").json()
        assert {e["replica"] for e in health["endpoints"]} == {"r0", "r1"}
        assert all(e["breaker"]["state"] == "closed" and e["inflight"] == 0 for e in health["endpoints"])
        f.lt.call(f.router.access.flush)
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
        assert [(r["model"], r["status"]) for r in lines[:4]] == [("sim", 200)] * 3 + [("nope", 404)]
        assert all(r["path"] == "/v1/chat/completions" and r["attempts"] <= 1 for r in lines[:4])
        # Every request gets its line, the router's own endpoints too.
        assert [(r["method"], r["path"], r["status"]) for r in lines[4:]] == [
            ("GET", "/metrics", 200), ("GET", "/health", 200)
        ]  # fmt: skip
        assert lines[0]["endpoint"] in ("r0", "r1") and lines[0]["duration_ms"] >= lines[0]["ttfb_ms"] > 0
    finally:
        f.close()


def test_access_log_escapes_client_strings():
    buf = io.StringIO()
    log = AccessLog(buf)
    log.log(1, "127.0.0.1:1", "POST", '/v1/x"\n', 'm"odel', "", 404, 0, None, 0.001, note='a "b"')
    log.flush()
    rec = json.loads(buf.getvalue())
    assert rec["path"] == '/v1/x"\n' and rec["model"] == 'm"odel' and rec["note"] == 'a "b"' and rec["ttfb_ms"] is None


def test_access_log_records_the_unknown_model_asked_for():
    """A 404 for an unknown model logs the name the client sent (escaped, capped); metrics keep ""."""
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2).start(access_log=AccessLog(buf))
    long_name = 'x"\n\u00e9' + "y" * 1000
    try:
        for name in ("no-such-model", long_name):
            r = httpx.post(f.base + "/chat/completions", json={"model": name, "messages": MSG})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f.base + "/chat/completions", json={"messages": MSG})  # no model at all: nothing to log
        assert r.status_code == 400
        f.lt.call(f.router.access.flush)
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
        assert [(r["model"], r["status"]) for r in lines] == [
            ("no-such-model", 404),
            (long_name[:200], 404),
            ("", 400),
        ]
        s = samples(httpx.get(f.url + "/metrics").text)
        assert s[("clusterctl_router_requests_total", (("endpoint", ""), ("model", ""), ("status", "404")))] == 2
        assert not any(("model", "no-such-model") in lab for _n, lab in s)
    finally:
        f.close()


def test_health_is_degraded_while_a_model_has_no_endpoint():
    """Open breakers and draining endpoints leave a model unservable: still 200 (liveness), "degraded"."""
    f = Fleet(3, capacity=4, token_delay_s=0.001, tokens=2)
    r0, r1, r2 = ({"url": e.url, "engine": "vllm", "replica": f"r{i}"} for i, e in enumerate(f.engines))
    cfg = {
        "models": {
            "sim": {"endpoints": [r0, r1]},
            "solo": {"endpoints": [r0]},
            "gone": {"endpoints": [{**r2, "draining": True}]},
        },
        "router": {"scrape_interval_s": 0.1, "health_interval_s": 0.2},
    }
    f.start(cfg=cfg)
    w0 = f.router.table.endpoints[f.engines[0].url]
    try:
        r = httpx.get(f.url + "/health")
        assert r.status_code == 200
        h = r.json()
        assert h["status"] == "degraded" and h["unavailable_models"] == ["gone"]  # its only endpoint drains
        assert set(h) >= {"models", "endpoints", "last_reload_error"} and h["last_reload_error"] is None

        # r0's breaker held open (as failed requests open it; passing health checks do not close it)
        f.lt.call(lambda: setattr(w0.breaker, "state", State.OPEN) or setattr(w0.breaker, "opened_at", 1e18))
        r = httpx.get(f.url + "/health")
        assert r.status_code == 200
        assert r.json()["status"] == "degraded" and r.json()["unavailable_models"] == ["solo", "gone"]
        assert httpx.post(f.base + "/chat/completions", json={"model": "solo", "messages": MSG}).status_code == 503
        assert httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}).status_code == 200

        f.lt.call(lambda: setattr(w0.breaker, "state", State.CLOSED))
        h = httpx.get(f.url + "/health").json()
        assert h["status"] == "degraded" and h["unavailable_models"] == ["gone"]
    finally:
        f.close()


def test_health_is_ok_when_every_model_can_be_served():
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    f.start(cfg=f.config(endpoint_extra={1: {"draining": True}}))  # one endpoint left is enough
    try:
        r = httpx.get(f.url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["unavailable_models"] == []
        f.lt.call(lambda: setattr(f.router, "_draining", True))  # what stop() sets first
        r = httpx.get(f.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
    finally:
        f.close()


def test_refused_and_unrouted_requests_get_access_log_lines_too(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-test\n")
    buf = io.StringIO()
    f = Fleet(1, capacity=2, token_delay_s=0, tokens=2).start(
        api_keys=ApiKeys.load(keys), access_log=AccessLog(buf, max_buffer=1)
    )
    try:
        assert httpx.get(f.url + "/v1/models").status_code == 401
        assert httpx.get(f.url + "/v1/models", headers={"Authorization": "Bearer sk-test"}).status_code == 200
        assert httpx.get(f.url + "/v1/chat/completions").status_code == 405
        assert httpx.delete(f.url + "/nowhere").status_code == 404
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert [(r["method"], r["path"], r["status"]) for r in lines] == [
            ("GET", "/v1/models", 401), ("GET", "/v1/models", 200),
            ("GET", "/v1/chat/completions", 405), ("DELETE", "/nowhere", 404),
        ]  # fmt: skip
        assert "sk-test" not in buf.getvalue()
    finally:
        f.close()


def _raw(port: int, data: bytes) -> bytes:
    """Send raw bytes, read until the router closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_requests_refused_while_being_read_are_logged_and_counted():
    buf = io.StringIO()
    f = Fleet(1, capacity=2, token_delay_s=0, tokens=2).start(
        router={"limits": {"max_body_bytes": 1024, "max_header_bytes": 1024}}, access_log=AccessLog(buf, max_buffer=1)
    )
    try:
        big = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
        assert _raw(f.port, big).startswith(b"HTTP/1.1 413 ")
        chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n" + b"x" * 2048
        assert _raw(f.port, chunked + b"\r\n0\r\n\r\n").startswith(b"HTTP/1.1 413 ")
        assert _raw(f.port, b"GET /health HTTP/1.1\r\nX: " + b"y" * 2000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
        assert _raw(f.port, b"BROKEN\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        deep = b"[" * 200_000
        r = httpx.post(f.base + "/chat/completions", content=deep[:1000], headers={"content-type": "application/json"})
        assert r.status_code == 400  # not valid JSON
        f.lt.call(lambda: setattr(f.router, "max_body_bytes", 1 << 20))  # let a deep one through the size check
        r = httpx.post(f.base + "/chat/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        lines = [json.loads(x) for x in buf.getvalue().splitlines()]
        assert [(r["method"], r["path"], r["status"], r["note"]) for r in lines[:4]] == [
            ("POST", "/v1/chat/completions", 413, "request_too_large"),
            ("POST", "/v1/completions", 413, "request_too_large"),
            ("", "", 431, "request_header_too_large"),
            ("", "", 400, "bad_request"),
        ]
        assert [r["status"] for r in lines[4:]] == [400, 400]
        s = samples(httpx.get(f.url + "/metrics").text)
        count = {st: s.get(("clusterctl_router_requests_total", (("endpoint", ""), ("model", ""), ("status", st))))
                 for st in ("413", "431", "400")}  # fmt: skip
        assert count == {"413": 2, "431": 1, "400": 3}
        assert not any(("status", "0") in lab for (n, lab) in s if n == "clusterctl_router_requests_total")
    finally:
        f.close()


def test_wrong_methods_get_405_with_allow_and_http10_keep_alive_is_declined():
    f = Fleet(1, capacity=2, token_delay_s=0, tokens=2).start()
    try:
        r = httpx.put(f.url + "/v1/models")
        assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = httpx.get(f.base + "/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert httpx.post(f.url + "/nowhere").status_code == 404
        out = _raw(f.port, b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")  # returns: the router closed
        head = out.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 200") and b"connection: close" in head
    finally:
        f.close()


@pytest.mark.slow
def test_a_stream_its_engine_cut_is_counted_as_cut():
    """A cut stream is counted under the status already sent (200); without a series of its
    own an engine dying mid-stream looked healthy in the metrics."""
    f = Fleet(1, capacity=4, token_delay_s=0.01, tokens=20).start()
    (e,) = f.engines
    f.lt.call(lambda: setattr(e, "cut_after", 2))
    try:
        with httpx.stream(
            "POST", f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200 and "upstream_stream_cut" in r.read().decode()
        f.lt.call(lambda: setattr(e, "cut_after", None))
        assert httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}).status_code == 200
        f.lt.wait_for(lambda: sum(f.router.metrics._req.cut.values()) == 1, what="the cut counted")
        s = samples(httpx.get(f.url + "/metrics").text)
        assert s[("clusterctl_router_responses_cut_total", (("endpoint", "r0"), ("model", "sim")))] == 1
    finally:
        f.close()
