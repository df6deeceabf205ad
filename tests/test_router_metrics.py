"""Observability: Prometheus /metrics, /health endpoint state, one access-log line per request."""

from __future__ import annotations

import io
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families
from simengine import Fleet

from cluster_cli.router.accesslog import AccessLog

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
            lambda: all(w.scraped.running is not None for w in f.router.table.workers.values()), what="scrapes"
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
        assert s[("clusterctl_router_endpoint_inflight", (("endpoint", f.engines[0].url), ("replica", "r0")))] == 0
        health = httpx.get(f.url + "/health").json()
        assert {e["replica"] for e in health["endpoints"]} == {"r0", "r1"}
        assert all(e["breaker"]["state"] == "closed" and e["inflight"] == 0 for e in health["endpoints"])
        f.lt.call(f.router.access.flush)
        lines = [json.loads(line) for line in buf.getvalue().splitlines()]
        assert [(r["model"], r["status"]) for r in lines] == [("sim", 200)] * 3 + [("", 404)]
        assert all(r["path"] == "/v1/chat/completions" and r["attempts"] <= 1 for r in lines)
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
