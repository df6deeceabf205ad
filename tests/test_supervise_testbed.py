"""``supervise`` end to end: real ``llama-server`` replicas on the testbed's sshd nodes, a real
``serve-router`` in front, four clients streaming through it with the official ``openai``
client, and a node killed (or frozen, or every node cut off) under that load."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ctl, json_out
from test_launch_testbed import _catalog, _models, _pids, _router, _wait, fleet  # noqa: F401 - the fixture

from cluster_cli.state.store import Store

pytestmark = [pytest.mark.llama, pytest.mark.slow]


def _supervise(state: Path, inv: Path, tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster_cli", "--state", str(state), "supervise", "-i", str(inv),
         "--interval", "0.5", "--grace", "4", "--timeout", "60", *args],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "supervise.err", "wb"),
    )  # fmt: skip


class Load:
    """Four clients streaming through the router without pause; what each request did: done,
    its content chunks and the finish_reasons it saw; failed, when, how long and why."""

    def __init__(self, port: int, max_tokens: int = 300) -> None:
        self.port, self.max_tokens = port, max_tokens
        self.stop = threading.Event()
        self.done: list[tuple[int, int]] = []
        self.failed: list[tuple[float, float, str]] = []  # (started, took, why)
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(4)]

    def _client(self) -> None:
        from openai import OpenAI

        c = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=60)
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                parts = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=self.max_tokens,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                chunks = finishes = 0
                for p in parts:
                    for ch in p.choices:
                        chunks += bool(ch.delta.content)
                        finishes += ch.finish_reason is not None
                self.done.append((chunks, finishes))
            except Exception as e:  # every failure is the finding
                self.failed.append((t0, time.monotonic() - t0, f"{type(e).__name__}: {e}"))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def _records(state: Path) -> dict[str, Any]:
    with Store(state, readonly=True) as s:
        return {r.name: r for r in s.records()}


@pytest.fixture
def supervised(fleet: dict[str, Any]) -> Iterator[dict[str, Any]]:  # noqa: F811 - the imported fixture
    """Two replicas up behind a router, ``supervise`` running."""
    state, inv, tmp = fleet["state"], fleet["inventory"], fleet["tmp"]
    # Room for a continuation's prompt: the tiny model's words come back from the text streamed
    # so far as letters (tests/test_router_continue_fidelity.py), several tokens each.
    cat = _catalog(tmp / "two.yaml", fleet["model"], fleet["binary"], replicas=2, args=["-c", "16384"])
    config = state.parent / "router.yaml"
    config.parent.mkdir(parents=True)
    # An engine that stops answering mid-stream (a frozen node) is given up on after 5 s.
    config.write_text("models: {}\nrouter:\n  limits:\n    idle_timeout_s: 5.0\n")
    router, port = _router(config, tmp)
    sup = None
    try:
        r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        _wait(lambda: _models(port) == ["tiny"])
        sup = _supervise(state, inv, tmp)
        # It holds the lease before a test starts (a test's own supervise --once would take it first).
        _wait(lambda: "lease taken" in (tmp / "supervise.err").read_text(), timeout=30)
        yield {**fleet, "port": port, "supervise": sup, "router_proc": router}
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0, (tmp / "supervise.err").read_text()
    finally:
        if sup is not None and sup.poll() is None:
            sup.kill()
        router.terminate()
        router.wait(30)


def test_a_node_killed_under_load_is_rebuilt_elsewhere_and_loses_only_its_streams(supervised) -> None:
    state, cluster, tmp = supervised["state"], supervised["cluster"], supervised["tmp"]
    victim = _records(state)["tiny/0"]
    dead = victim.shards[0].node
    with Load(supervised["port"]) as load:
        _wait(lambda: len(load.done) >= 20, timeout=60)
        before = len(load.done)
        killed_at = time.monotonic()
        cluster.kill(dead)

        def rebuilt() -> bool:
            rec = _records(state).get("tiny/0")
            return rec is not None and rec.status == "ready" and rec.shards[0].node != dead

        _wait(rebuilt, timeout=60)
        took = time.monotonic() - killed_at
        _wait(lambda: len(load.done) >= max(300, before + 100), timeout=120)
    log = (tmp / "supervise.err").read_text()
    assert f"node {dead}: ready -> unreachable" in log and f"node {dead}: unreachable -> lost" in log, log
    assert len(load.done) >= 300
    # Only streams that were on the killed node fail, each at once (an error, not a hang).
    assert len(load.failed) <= 4, load.failed
    assert all(took_s < 15 for _, took_s, _ in load.failed), load.failed
    live = _records(state)
    assert all(run.node != dead for rec in live.values() for run in rec.shards)
    assert took < 30, took
    # Revived: fenced, and nothing of the old generation runs there.
    cluster.revive(dead)
    _wait(lambda: f"node {dead}: fencing -> ready" in (tmp / "supervise.err").read_text(), timeout=30)
    assert _pids(cluster, dead) == set()
    with Store(state, readonly=True) as s:
        assert s.fences() == []
        kinds = [e.kind for e in s.events()]
    assert {"node-unreachable", "node-lost", "node-ready"} <= set(kinds)


def test_every_node_cut_off_at_once_rebuilds_nothing(supervised) -> None:
    state, cluster, tmp = supervised["state"], supervised["cluster"], supervised["tmp"]
    if cluster.mode != "netns":
        pytest.skip("partitions need the testbed's network namespaces")
    before = {k: r.shards for k, r in _records(state).items()}
    nodes = sorted({run.node for runs in before.values() for run in runs} | {"cpu-01", "cpu-02", "cpu-03"})
    for n in nodes:
        cluster.partition(n)
    time.sleep(8)  # twice the grace
    log = (tmp / "supervise.err").read_text()
    assert "storm brake on" in log and "-> lost" not in log, log
    for n in nodes:
        cluster.heal(n)
    _wait(lambda: all(r.status == "ready" for r in _records(state).values()), timeout=30)
    assert {k: r.shards for k, r in _records(state).items()} == before


def test_a_second_supervisor_refuses_naming_the_first(supervised) -> None:
    r = ctl(supervised["state"], "supervise", "-i", str(supervised["inventory"]), "--once")
    assert r.returncode == 2 and "a supervisor already runs on this state" in r.stderr, r.stderr
    assert f"pid {supervised['supervise'].pid}" in r.stderr
    st = json_out(ctl(supervised["state"], "status", "--no-check", "-o", "json"))["replicas"]
    assert [x["state"] for x in st] == ["ready", "ready"]


def test_drain_under_load_with_supervise_running_fails_no_request(supervised) -> None:
    state, tmp = supervised["state"], supervised["tmp"]
    victim = _records(state)["tiny/0"]
    node = victim.shards[0].node
    with Load(supervised["port"]) as load:
        _wait(lambda: len(load.done) >= 20, timeout=60)
        r = ctl(state, "drain", node, "-i", str(supervised["inventory"]), "-o", "json", "--deadline", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        served = len(load.done)
        _wait(lambda: len(load.done) >= served + 40, timeout=60)
    assert load.failed == [], load.failed[:3]
    (h,) = json_out(r)["replicas"]
    assert h["state"] == "replaced" and h["make_before_break"] and h["from"] == [node] and h["to"] != [node]
    live = _records(state)
    assert sorted(live) == ["tiny/0", "tiny/1"] and all(run.node != node for run in live["tiny/0"].shards)
    assert live["tiny/0"].generation == victim.generation + 1
    with Store(state, readonly=True) as s:
        assert node in s.cordons()
    time.sleep(2)  # supervise's next passes change nothing of it
    assert {k: r.shards for k, r in _records(state).items()} == {k: r.shards for k, r in live.items()}
    log = (tmp / "supervise.err").read_text()
    assert "duplicate" not in log and f"node {node}: draining, asked by drain" in log, log  # it asked supervise


def test_a_rolling_up_of_a_changed_profile_under_load_fails_no_request(supervised) -> None:
    state, tmp = supervised["state"], supervised["tmp"]
    before = _records(state)
    changed = _catalog(tmp / "changed.yaml", supervised["model"], supervised["binary"], replicas=2,
                       args=["--threads", "1"])  # fmt: skip
    with Load(supervised["port"]) as load:
        _wait(lambda: len(load.done) >= 20, timeout=60)
        r = ctl(state, "up", "-i", str(supervised["inventory"]), "-c", str(changed), "-o", "json")
        assert r.returncode == 0, r.stdout + r.stderr
        served = len(load.done)
        _wait(lambda: len(load.done) >= served + 40, timeout=60)
    assert load.failed == [], load.failed[:3]
    got = {x["name"]: x for x in json_out(r)["replicas"]}
    assert {n: (x["action"], x["state"]) for n, x in got.items()} == {
        "tiny/0": ("replace", "ready"), "tiny/1": ("replace", "ready")}  # fmt: skip
    after = _records(state)
    assert all(after[n].generation == before[n].generation + 1 for n in before)
    again = ctl(state, "up", "-i", str(supervised["inventory"]), "-c", str(changed), "-o", "json")
    assert {x["action"] for x in json_out(again)["replicas"]} == {"keep"}


def test_an_engine_that_keeps_crashing_is_restarted_with_growing_delays_then_moved(supervised) -> None:
    state, cluster, tmp = supervised["state"], supervised["cluster"], supervised["tmp"]
    first = _records(state)["tiny/0"]
    node = first.shards[0].node
    killed: list[float] = []
    for _ in range(4):
        rec = _records(state)["tiny/0"]
        if rec.shards[0].node != node:
            break
        cluster.ssh(node, f"kill -9 {rec.shards[0].pid}")
        killed.append(time.monotonic())
        _wait(lambda rec=rec: (r := _records(state).get("tiny/0")) is not None and r.status == "ready"
              and r.shards[0].pid != rec.shards[0].pid, timeout=90)  # fmt: skip
    moved = _records(state)["tiny/0"]
    log = (tmp / "supervise.err").read_text()
    assert moved.shards[0].node != node, log
    assert "restart in 1.0 s" in log and "restart in 2.0 s" in log and "placing it elsewhere" in log, log
    with Store(state, readonly=True) as s:
        why = [e.message for e in s.events() if e.name == "tiny/0"]
    assert any("moved: failed" in m for m in why), why


def _published(state: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((state.parent / "router.yaml").read_text())["models"]


@pytest.mark.parametrize(("fault", "undo"), [("freeze", "thaw"), ("partition", "heal")])
def test_a_frozen_or_partitioned_node_is_rebuilt_elsewhere_and_fenced_when_back(
    supervised, fault: str, undo: str
) -> None:
    """Its engine runs on, unseen, while the node hangs or is cut off; back, the node is fenced
    before it is trusted: that older engine is stopped and never published again."""
    state, cluster, tmp = supervised["state"], supervised["cluster"], supervised["tmp"]
    if fault == "partition" and cluster.mode != "netns":
        pytest.skip("partitions need the testbed's network namespaces")
    victim = _records(state)["tiny/0"]
    node = victim.shards[0].node
    with Load(supervised["port"]) as load:
        _wait(lambda: len(load.done) >= 20, timeout=60)
        before = len(load.done)
        getattr(cluster, fault)(node)
        try:
            _wait(lambda: (r := _records(state).get("tiny/0")) is not None and r.status == "ready"
                  and r.shards[0].node != node, timeout=60)  # fmt: skip
            _wait(lambda: len(load.done) >= before + 100, timeout=120)
        finally:
            getattr(cluster, undo)(node)
    # Streams of the stuck engine end with an error after the router's idle timeout; no other.
    assert len(load.failed) <= 4 and all(took < 15 for _, took, _ in load.failed), load.failed
    _wait(lambda: f"node {node}: fencing -> ready" in (tmp / "supervise.err").read_text(), timeout=40)
    assert victim.shards[0].pid not in _pids(cluster, node)  # the old generation's engine is stopped
    with Store(state, readonly=True) as s:
        assert s.fences() == []
    urls = [e["url"] for m in _published(state).values() for e in m["endpoints"]]
    assert victim.endpoint not in urls


def test_once_exits_0_when_converged_and_3_when_not(fleet) -> None:  # noqa: F811 - the imported fixture
    state, inv, tmp, cluster = fleet["state"], fleet["inventory"], fleet["tmp"], fleet["cluster"]
    cat = _catalog(tmp / "one.yaml", fleet["model"], fleet["binary"], replicas=1)
    assert ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json").returncode == 0
    r = ctl(state, "supervise", "-i", str(inv), "--once")
    assert r.returncode == 0, r.stderr
    node = _records(state)["tiny/0"].shards[0].node
    cluster.kill(node)
    r = ctl(state, "supervise", "-i", str(inv), "--once")
    assert r.returncode == 3 and f"node {node}: ready -> unreachable" in r.stderr, r.stderr
    st = json_out(ctl(state, "status", "--no-check", "-o", "json"))
    assert [(n["node"], n["status"]) for n in st["nodes"] if n["status"] != "ready"] == [(node, "unreachable")]
    cluster.revive(node)


def test_operators_writes_while_supervise_runs_are_never_lost(supervised) -> None:
    """Hundreds of cordons and uncordons from another process's handle on the state, a `down`
    and an `up` from the CLI, all while `supervise` ticks on the same state: every write
    stands, and the replica taken down stays down until the next `up` brings it back."""
    import random

    state, inv, tmp = supervised["state"], supervised["inventory"], supervised["tmp"]
    rng = random.Random(11)
    nodes = ("cpu-01", "cpu-02", "cpu-03")
    expected: dict[str, str | None] = dict.fromkeys(nodes)
    with Store(state, actor="operator") as op:
        for i in range(300):
            n = rng.choice(nodes)
            if rng.random() < 0.5:
                op.cordon(n, f"reason {i}")
                expected[n] = f"reason {i}"
            else:
                op.uncordon(n)
                expected[n] = None
            if i == 150:
                r = ctl(state, "down", "tiny/1", "-o", "json")
                assert r.returncode == 0, r.stderr
        time.sleep(2)  # supervise's passes go on meanwhile
        cordons = op.cordons()
        assert {n: (cordons[n]["reason"] if n in cordons else None) for n in nodes} == expected
    st = {x["name"]: x for x in json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]}
    assert (st["tiny/1"]["state"], st["tiny/0"]["state"]) == ("stopped", "ready")  # not brought back
    for n in nodes:
        ctl(state, "uncordon", n)
    r = ctl(state, "up", "-i", str(inv), "-c", str(tmp / "two.yaml"), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = {x["name"]: x["state"] for x in json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]}
    assert st == {"tiny/0": "ready", "tiny/1": "ready"}  # the next up brings it back
    assert "pass failed" not in (tmp / "supervise.err").read_text()
