"""The races a shared state must win, each on the real path where one exists (testbed nodes,
the vLLM stand-in): a ``down`` during ``up``'s start leaves no engine behind; a ``status``
during a restart keeps the new processes; a cordon between plan and reserve is not missed;
a stop that leaves a GPU process keeps the GPUs held and records a fence."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ctl, json_out

from cluster_cli.config.catalog import load_catalog
from cluster_cli.config.inventory import load_inventory
from cluster_cli.control import discovery
from cluster_cli.control.nodes import SSHNodes
from cluster_cli.control.replicas import status
from cluster_cli.control.up import up
from cluster_cli.facts import Replica, Shard
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.pool import Sessions
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import READY, ReplicaRecord, ShardRun
from cluster_cli.state.store import Store

STANDIN = Path(__file__).resolve().parent.parent / "testbed" / "standin"
PROFILE = {"name": "tp1", "engine": "vllm", "gpu_class": "H200", "gpus": 1, "model": "acme/m",
           "env": {"STANDIN_LOAD_S": "0.2"}}  # fmt: skip


def _catalog(path: Path, **profile: Any) -> Path:
    path.write_text(yaml.safe_dump({"models": [{"name": "tp", "profiles": [{**PROFILE, **profile}]}]}))
    return path


def _engines(cluster: Any, node: str) -> list[str]:
    out = cluster.ssh(
        node, "for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' <$p/cmdline 2>/dev/null); echo \"$c\"; done"
    ).stdout.decode()
    return [ln for ln in out.splitlines() if "VLLM::" in ln or "standin/vllm" in ln]


def _wait(pred: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _starting(state: Path) -> ReplicaRecord | None:
    if not state.exists():
        return None
    try:
        with Store(state, readonly=True) as s:
            recs = [r for r in s.records() if r.status == "starting" and r.shards]
    except Exception:
        return None
    return recs[0] if recs else None


@pytest.mark.parametrize("slow", ["mkdir", "setsid"])
def test_a_down_during_ups_start_leaves_no_engine_running(testbed_factory, tmp_path: Path, slow: str) -> None:
    """``down`` lands while ``up`` is starting the replica: its shards' markers are recorded,
    the engine not yet started (a slow ``mkdir`` of the run folder, or a slow ``setsid``, as
    on a loaded node). The stop finds nothing of it. Either ``up`` then records the engine,
    finds the row changed, and stops what it started (mkdir); or the stop removed the run
    folder the start was about to use, and the engine never starts (setsid). No engine is
    left without a row."""
    slowbin = tmp_path / "slowbin"
    slowbin.mkdir()
    # Long enough for the down (a new process: seconds on a loaded machine) to land within it.
    (slowbin / slow).write_text(f'#!/bin/sh\nsleep 6\nexec {shutil.which(slow)} "$@"\n')
    (slowbin / slow).chmod(0o755)
    cluster = testbed_factory("gpu-01=hgx-h200x8:fabric=ib-a", path_extra=(str(STANDIN), str(slowbin)))
    cat = _catalog(tmp_path / "catalog.yaml")
    state = tmp_path / "st" / "state.db"
    cmd = [sys.executable, "-m", "cluster_cli", "--state", str(state), "up", "-i", str(cluster.inventory_path),
           "-c", str(cat), "-o", "json", "--timeout", "60"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rec = _wait(lambda: _starting(state))
        assert rec.generation == 1 and rec.shards[0].token.startswith("tp/0.g1.s0.")
        r = ctl(state, "down", "tp/0", "-o", "json")
        assert r.returncode == 0, r.stderr
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    (got,) = json.loads(out)["replicas"]
    if slow == "mkdir":
        assert got["state"] == "stopped" and "changed by another command" in got["reason"], (got["reason"], err)
    assert _engines(cluster, "gpu-01") == []  # nothing of it runs: no engine without a row
    with Store(state, readonly=True) as s:
        (row,) = s.records(include_down=True, include_fenced=True)
        assert (row.status, row.desired, row.generation) == ("stopped", "down", 1)
        assert s.fences() == [] and s.held_ports("gpu-01") == set()
        kinds = [e.kind for e in s.events() if e.name == "tp/0"]
        assert kinds[:3] == ["reserved", "starting", "down"] and "stopped" in kinds
    if slow == "mkdir":  # brought back by the next up: a new generation, never the old one again
        r = ctl(state, "up", "-c", str(cat), "-o", "json", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        st = json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]
        assert [(x["name"], x["generation"], x["state"]) for x in st] == [("tp/0", 2, "ready")]
        assert ctl(state, "down", "--all").returncode == 0


class _Node:
    """A node whose replica's engine is found dead; while ``status`` checks it, another
    writer (an ``up`` restarting it) records the new processes."""

    def __init__(self, on_check: Any) -> None:
        self.on_check = on_check

    async def run_raw(self, cmd: str, *, timeout: float, input: bytes) -> tuple[int, bytes, bytes]:
        self.on_check()
        return 0, b"@@DEAD 0\n", b""


class _Sessions:
    def __init__(self, node: _Node) -> None:
        self.node = node

    async def get(self, name: str) -> _Node:
        return self.node


def test_a_status_during_a_restart_keeps_the_new_processes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    old_run = ShardRun("n1", "~/r/m-0.g1", "m/0.g1.s0.old", pid=100, start_time=5)
    with Store(path, actor="up") as s:
        (rec,) = s.reserve([ReplicaRecord(Replica("m", 0, "p", "llamacpp", (Shard("n1"),)), port=8100)]).records
        s.observe(replace(rec, status=READY, shards=(old_run,), endpoint="http://n1:8100"))
    new_run = ShardRun("n1", "~/r/m-0.g1", "m/0.g1.s0.new", pid=200, start_time=9)
    restarter = Store(path, actor="up")

    def restart() -> None:  # up takes it over and records its new engine meanwhile
        (cur,) = restarter.records()
        mine = restarter.claim(cur, replace(cur, status="starting", restarts=1, shards=(new_run,)))
        assert mine is not None
        restarter.observe(replace(mine, status=READY))

    async def go() -> list[Any]:
        with Store(path, actor="status") as st:
            async with AsyncStore(st) as astore:
                return await status(astore, SSHNodes(_Sessions(_Node(restart))))  # type: ignore[arg-type]

    try:
        (row,) = asyncio.run(go())
        assert row.state == "unhealthy"  # what status saw of the old engine...
        with Store(path, readonly=True) as s:
            (got,) = s.records()
        # ...is not written over the restart: the new engine's PID and state stand
        assert (got.status, got.shards, got.restarts) == (READY, (new_run,), 1)
    finally:
        restarter.close()


def test_a_cordon_between_plan_and_reserve_is_not_missed(testbed_factory, tmp_path: Path) -> None:
    """The fleet ``up`` plans from is read in one snapshot with its version; a cordon that
    lands after that read makes the reservation fail as stale, and the plan is made again."""
    cluster = testbed_factory("gpu-01=hgx-h200x8:fabric=ib-a,gpu-02=hgx-h200x8:fabric=ib-a", path_extra=(str(STANDIN),))
    state = tmp_path / "st" / "state.db"
    assert ctl(state, "discover", "-i", str(cluster.inventory_path)).returncode == 0
    inv = load_inventory(cluster.inventory_path)
    cat = load_catalog(_catalog(tmp_path / "catalog.yaml"))
    reads: list[int] = []

    async def go() -> Any:
        with Store(state, actor="up") as st, Store(state, actor="cordon") as operator:
            connector = AsyncsshConnector(pinned_known_hosts=state.with_suffix(".known_hosts"))
            async with Sessions(inv, connector) as sessions, AsyncStore(st) as astore:

                async def fleet() -> Any:
                    view = await discovery.fleet(inv, astore, placeable=True)
                    reads.append(view.version)
                    if len(reads) == 1:
                        # The plan would put it on gpu-01; the operator cordons that node now.
                        assert not any(n.cordoned for n in view.nodes)
                        operator.cordon("gpu-01", "fan failing")
                    return view

                return await up(inv, cat, astore, SSHNodes(sessions), fleet, router_config=tmp_path / "router.yaml",
                                timeout_s=60)  # fmt: skip

    result = asyncio.run(go())
    (o,) = result.outcomes
    assert (o.state, o.nodes) == ("ready", ["gpu-02"]), o
    assert len(reads) == 2 and reads[1] == reads[0] + 1  # read again at the cordon's version
    assert ctl(state, "down", "--all").returncode == 0


def test_a_stop_that_leaves_a_gpu_process_keeps_the_gpu_held_and_records_a_fence(testbed_factory, tmp_path) -> None:
    """nvidia-smi still lists the engine's process after the stop (a CUDA context that outlived
    it): the GPU is not free, so the replica is fenced and its GPU stays held; once the node
    lists nothing of it, the next ``down`` confirms it gone and frees the GPU."""
    cluster = testbed_factory("gpu-01=hgx-h200x8:fabric=ib-a", path_extra=(str(STANDIN),))
    cat = _catalog(tmp_path / "catalog.yaml")
    state = tmp_path / "st" / "state.db"
    r = ctl(state, "up", "-i", str(cluster.inventory_path), "-c", str(cat), "-o", "json", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    with Store(state, readonly=True) as s:
        (rec,) = s.records()
    gpu, pid = rec.replica.shards[0].gpus[0], rec.shards[0].pid
    spec_file = cluster.node("gpu-01").dir / "spec.json"
    clean = spec_file.read_text()
    doc = json.loads(clean)
    doc["spec"]["foreign"] = [{"gpu": gpu, "pid": pid, "name": "VLLM::EngineCore", "used_mib": 1024}]
    spec_file.write_text(json.dumps(doc))  # nvidia-smi now lists the engine's PID on its GPU

    r = ctl(state, "down", "tp/0", "-o", "json")
    (d,) = json_out(r)["replicas"]
    assert r.returncode == 1 and not d["stopped"] and f"nvidia-smi still lists processes {pid}" in d["problem"], d
    assert _engines(cluster, "gpu-01") == []  # the processes are gone; the GPU is not
    with Store(state, readonly=True) as s:
        (row,) = s.records(include_down=True, include_fenced=True)
        assert (row.status, row.desired) == ("fenced", "down")
        (fence,) = s.fences()
        assert (fence.node, fence.token, fence.pid) == ("gpu-01", rec.shards[0].token, pid)
        assert s.fenced_gpus() == {"gpu-01": {gpu: "tp/0 generation 1"}}
        assert s.held_ports("gpu-01") == {rec.port}
    st = json_out(ctl(state, "status", "--no-check", "-o", "json"))
    assert [(x["name"], x["state"]) for x in st["replicas"]] == [("tp/0", "fenced")]
    assert [(f["replica"], f["node"], f["pid"]) for f in st["fences"]] == [("tp/0", "gpu-01", pid)]
    table = ctl(state, "status", "--no-check").stdout
    assert "fenced tp/0 g1 on gpu-01 since " in table and "nvidia-smi still lists processes" in table

    spec_file.write_text(clean)  # the context is gone
    r = ctl(state, "down", "tp/0", "-o", "json")
    assert r.returncode == 0 and json_out(r)["replicas"][0]["stopped"], r.stdout
    with Store(state, readonly=True) as s:
        assert s.fences() == [] and s.fenced_gpus() == {} and s.held_ports("gpu-01") == set()
        (row,) = s.records(include_down=True, include_fenced=True)
        assert (row.status, row.desired) == ("stopped", "down")
        assert [e.kind for e in s.events() if e.name == "tp/0"][-3:] == ["fenced", "unfenced", "released"]


def test_a_replica_whose_node_is_cut_off_during_down_is_fenced_until_a_stop_confirms_it(
    testbed_factory, tmp_path: Path
) -> None:
    """The node does not answer the stop (a partition): its engine may well run on, so the
    replica is fenced, not forgotten; once the node answers, the next ``down`` stops what ran
    on through the partition and frees the GPU."""
    cluster = testbed_factory("gpu-01=hgx-h200x8:fabric=ib-a", path_extra=(str(STANDIN),))
    doc = yaml.safe_load(cluster.inventory_path.read_text())
    doc["defaults"]["connect_timeout_s"] = 2.0
    inv = cluster.inventory_path.parent / "inventory-fast.yaml"
    inv.write_text(yaml.safe_dump(doc))
    cat = _catalog(tmp_path / "catalog.yaml")
    state = tmp_path / "st" / "state.db"
    r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    cluster.partition("gpu-01")
    try:
        r = ctl(state, "down", "tp/0", "-o", "json")
        (d,) = json_out(r)["replicas"]
        assert r.returncode == 1 and not d["stopped"] and "did not answer the stop" in d["problem"], d
        with Store(state, readonly=True) as s:
            (row,) = s.records(include_down=True, include_fenced=True)
            assert (row.status, row.desired) == ("fenced", "down")
            (fence,) = s.fences()
            assert fence.node == "gpu-01" and "did not answer" in fence.reason
            assert list(s.fenced_gpus()) == ["gpu-01"]
    finally:
        cluster.heal("gpu-01")
    assert _engines(cluster, "gpu-01")  # it ran on through the partition: forgetting it would have leaked it
    r = ctl(state, "down", "tp/0", "-o", "json")
    assert r.returncode == 0 and json_out(r)["replicas"][0]["stopped"], r.stdout
    assert _engines(cluster, "gpu-01") == []
    with Store(state, readonly=True) as s:
        assert s.fences() == [] and s.fenced_gpus() == {}
