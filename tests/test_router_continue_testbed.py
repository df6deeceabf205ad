"""A node killed, then another frozen, under streaming load with `supervise` running: the
router continues every stream the dead or frozen engine was serving on the other replica,
so no request fails, and every stream ends with exactly one finish_reason."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_launch_testbed import _wait, fleet  # noqa: F401 - the fixture
from test_supervise_testbed import _records, supervised  # noqa: F401 - the fixture

pytestmark = [pytest.mark.llama, pytest.mark.slow]


class Streams:
    """Four clients streaming without pause; per request: chunks with content, finish_reasons."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.done: list[tuple[int, int]] = []  # (content chunks, finish_reasons seen)
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(4)]

    def _client(self) -> None:
        from openai import OpenAI

        c = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=60)
        while not self.stop.is_set():
            try:
                parts = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=400, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                chunks = finishes = 0
                for p in parts:
                    for ch in p.choices:
                        chunks += bool(ch.delta.content)
                        finishes += ch.finish_reason is not None
                self.done.append((chunks, finishes))
            except Exception as e:  # every failure is the finding
                self.failed.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def test_a_killed_then_a_frozen_node_fail_no_request(supervised: Any) -> None:  # noqa: F811 - the fixture
    state, cluster = supervised["state"], supervised["cluster"]
    first = _records(state)["tiny/0"].shards[0].node
    with Streams(supervised["port"]) as load:
        _wait(lambda: len(load.done) >= 12, timeout=60)
        cluster.kill(first)
        _wait(lambda: (r := _records(state).get("tiny/0")) is not None and r.status == "ready"
              and r.shards[0].node != first, timeout=60)  # fmt: skip
        served = len(load.done)
        _wait(lambda: len(load.done) >= served + 12, timeout=90)
        second = _records(state)["tiny/1"].shards[0].node
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
    assert _resumed(supervised["port"]) >= 1  # streams were on the killed or frozen engine, and went on


def _resumed(port: int) -> float:
    """The router's count of continued requests (its Prometheus /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("clusterctl_router_requests_resumed_total"))  # fmt: skip
