"""/metrics and the access log as an operator's dashboards read them: latency histograms
measure only requests that reached an engine, bucket bounds are spelt as prometheus-client
spells them, no stray ``_created`` families, a client that left the queue made no attempt,
a client that left mid-stream is labelled with its model and endpoint, and every access-log line
is JSON any parser takes."""

from __future__ import annotations

import io
import json
import socket
import threading
import time

import httpx
import pytest
from helpers import chat_request, read_until
from prometheus_client.parser import text_string_to_metric_families
from simengine import Fleet

from cluster_cli.router.accesslog import AccessLog

MSG = [{"role": "user", "content": "hello"}]


def _families(text: str) -> dict[str, list]:
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def _strict(line: str) -> dict:
    """json.loads, refusing what RFC 8259 leaves undefined: a lone surrogate escape."""
    doc = json.loads(line)

    def walk(v: object) -> None:
        if isinstance(v, str):
            v.encode("utf-8")  # a lone surrogate cannot be encoded: UnicodeEncodeError
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(doc)
    return doc


def test_refusals_stay_out_of_the_latency_histograms_and_bounds_are_prometheus_spelt() -> None:
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2).start(access_log=AccessLog(buf))
    try:
        assert httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}).status_code == 200
        for name in ("nope", "x\ud800y"):  # unknown models: the router's own 404s
            body = json.dumps({"model": name, "messages": MSG})  # ensure_ascii: "x\\ud800y" on the wire
            r = httpx.post(f.base + "/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 404
        f.lt.wait_for(lambda: all(w.inflight == 0 for w in f.router.table.endpoints.values()), what="books settled")
        text = httpx.get(f.url + "/metrics").text
        fams = _families(text)
        durations = [s for s in fams["clusterctl_router_request_duration_seconds"] if s.name.endswith("_count")]
        assert [(s.labels, s.value) for s in durations] == [({"model": "sim"}, 1.0)]
        ttfb = [s for s in fams["clusterctl_router_time_to_first_byte_seconds"] if s.name.endswith("_count")]
        assert [(s.labels, s.value) for s in ttfb] == [({"model": "sim"}, 1.0)]
        statuses = {(s.labels["model"], s.labels["status"]): s.value for s in fams["clusterctl_router_requests"]}
        assert statuses[("", "404")] == 2 and statuses[("sim", "200")] == 1  # still counted
        bounds = [s.labels["le"] for s in fams["clusterctl_router_request_duration_seconds"] if "le" in s.labels]
        assert bounds[:10] == ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0"]
        assert 'le="1"' not in text and 'le="300.0"' in text
        assert "_created" not in text
        assert "# TYPE clusterctl_router_retries_total counter" in text  # still exposed, with no retry yet
        f.lt.call(f.router.access.flush)
        lines = [_strict(line) for line in buf.getvalue().splitlines()]
        assert [x["model"] for x in lines[:3]] == ["sim", "nope", "x\ufffdy"]
    finally:
        f.close()


@pytest.mark.slow
def test_a_client_that_leaves_the_queue_made_no_attempt_and_adds_no_latency() -> None:
    """One slot (max_inflight 1) held by a long stream; a second request waits in the queue and
    its client gives up; a third finds the queue (max 1) full: 429. Neither reached an engine:
    the access log says attempts 0 and the latency histograms hold the stream alone."""
    buf = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.05, tokens=30)
    cfg = f.config({"admission": {"max_queue": 1, "max_wait_s": 20.0}}, endpoint_extra={0: {"max_inflight": 1}})
    f.start(cfg=cfg, access_log=AccessLog(buf))
    try:
        streamed: list[int] = []

        def stream() -> None:
            with httpx.stream("POST", f.base + "/chat/completions", timeout=30,
                              json={"model": "sim", "messages": MSG, "stream": True}) as r:  # fmt: skip
                streamed.append(r.status_code)
                for _ in r.iter_bytes():
                    pass

        t = threading.Thread(target=stream)
        t.start()
        f.lt.wait_for(lambda: f.engines[0].running == 1, what="the stream holds the slot")
        waits = threading.Thread(target=lambda: _gives_up(f.base))
        waits.start()
        entry = f.router.table.models["sim"]
        f.lt.wait_for(lambda: len(entry.queue) == 1, what="a request queued")
        full = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}, timeout=10)
        assert full.status_code == 429 and full.headers.get("retry-after")
        waits.join()
        t.join()
        assert streamed == [200]
        f.lt.wait_for(lambda: len(entry.queue) == 0, what="queue empty")
        f.lt.call(f.router.access.flush)
        lines = [_strict(line) for line in buf.getvalue().splitlines()]
        by_status = {x["status"]: x for x in lines}
        assert by_status[499]["attempts"] == 0 and by_status[499]["endpoint"] == ""
        assert by_status[429]["attempts"] == 0
        assert by_status[200]["attempts"] == 1
        fams = _families(httpx.get(f.url + "/metrics").text)
        counts = [s.value for s in fams["clusterctl_router_request_duration_seconds"] if s.name.endswith("_count")]
        assert counts == [1.0]
        rejected = {s.labels["reason"]: s.value for s in fams["clusterctl_router_admission_rejections"]}
        assert rejected == {"queue_full": 1.0}
    finally:
        f.close()


def _gives_up(base: str) -> None:
    try:
        httpx.post(base + "/chat/completions", json={"model": "sim", "messages": MSG}, timeout=0.8)
    except httpx.TimeoutException:
        time.sleep(0)  # it left, as a client with a deadline does
    else:
        raise AssertionError("the queued request should have timed out on the client")


def test_a_client_that_leaves_mid_stream_is_labelled_with_its_model_and_endpoint() -> None:
    import io

    from cluster_cli.router.accesslog import AccessLog

    log = io.StringIO()
    f = Fleet(1, capacity=4, token_delay_s=0.02, tokens=200).start(access_log=AccessLog(log, max_buffer=1))
    try:
        with socket.create_connection(("127.0.0.1", f.port)) as s:
            s.sendall(chat_request(1, stream=True))
            got = read_until(s, 5, needle=b"data: ")  # the stream has started
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
