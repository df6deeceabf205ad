"""A node killed, then another frozen, under streaming load with `supervise` running: the
router continues every stream the dead or frozen engine was serving on the other replica,
so no request fails, and every stream ends with exactly one finish_reason."""

from __future__ import annotations

from typing import Any

import pytest
from test_launch_testbed import _wait, fleet  # noqa: F401 - the fixture
from test_supervise_testbed import Load, _records, supervised  # noqa: F401 - the fixture

pytestmark = [pytest.mark.llama, pytest.mark.slow]


def test_a_killed_then_a_frozen_node_fail_no_request(supervised: Any) -> None:  # noqa: F811 - the fixture
    state, cluster = supervised["state"], supervised["cluster"]
    first = _records(state)["tiny/0"].shards[0].node
    with Load(supervised["port"], max_tokens=400) as load:
        _wait(lambda: len(load.done) >= 12, timeout=60)
        _busy(supervised["port"], _records(state)["tiny/0"].endpoint)
        cluster.kill(first)  # streams on it, to be continued
        _wait(lambda: (r := _records(state).get("tiny/0")) is not None and r.status == "ready"
              and r.shards[0].node != first, timeout=60)  # fmt: skip
        served = len(load.done)
        _wait(lambda: len(load.done) >= served + 12, timeout=90)
        second = _records(state)["tiny/1"].shards[0].node
        _busy(supervised["port"], _records(state)["tiny/1"].endpoint)
        cluster.freeze(second)
        try:
            _wait(lambda: (r := _records(state).get("tiny/1")) is not None and r.status == "ready"
                  and r.shards[0].node not in (first, second), timeout=60)  # fmt: skip
            served = len(load.done)
            _wait(lambda: len(load.done) >= served + 12, timeout=90)
        finally:
            cluster.thaw(second)
    assert load.failed == [], load.failed[:3]
    assert len(load.done) >= 36 and all(f == 1 for _, f in load.done), [d for d in load.done if d[1] != 1][:5]
    # The tokens: llama-server sends one a chunk and, told to ignore EOS, exactly max_tokens of
    # them; a continued stream has as many (the seam neither repeats nor drops one).
    assert {c for c, _ in load.done} == {400}, sorted({c for c, _ in load.done})
    # The faults cut streams, and those went on elsewhere: none failed (above), and the router
    # continued them (a stream lasts about 0.2 s here: each fault waits for two on its node).
    assert _metric(supervised["port"], "clusterctl_router_responses_cut_total") >= 1
    assert _metric(supervised["port"], "clusterctl_router_requests_resumed_total") >= 1


def _busy(port: int, url: str | None) -> None:
    """Wait until two requests are in flight on ``url`` (one, if it never has two in 5 s)."""
    try:
        _wait(lambda: _inflight(port, url) >= 2, timeout=5)
    except AssertionError:
        _wait(lambda: _inflight(port, url) >= 1, timeout=30)


def _inflight(port: int, url: str | None) -> int:
    """Requests in flight on the endpoint ``url``, as the router's ``/health`` says."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        doc = json.load(r)
    return sum(int(e.get("inflight", 0)) for e in doc.get("endpoints", []) if e.get("url") == url)


def _metric(port: int, name: str) -> float:
    """A counter of the router's Prometheus /metrics, summed over its labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip
