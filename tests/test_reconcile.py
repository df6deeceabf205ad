"""One reconcile pass (``control.up.up``, what ``up`` runs once and ``supervise`` every tick)
against a fleet of fake nodes: its decisions, in milliseconds, with no SSH and no testbed.

The nodes' facts come from the state (as a probe saved them); what runs on each node is the
fake fleet's (``tests/fakenodes.py``); the router config is the real publisher's file.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakenodes import FakeFleet
from helpers import cpu_node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.control import discovery
from cluster_cli.control.up import UpResult, up
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import FENCED, READY
from cluster_cli.state.store import Store

NODES = ("n1", "n2", "n3")


def _inv(names: tuple[str, ...] = NODES) -> Inventory:
    return Inventory.model_validate({"nodes": [{"name": n, "host": f"h-{n}"} for n in names]})


def _cat(replicas: int = 2, *, model: str = "m", cpus: int = 8) -> Catalog:
    return Catalog.model_validate({"models": [{"name": model, "replicas": replicas, "profiles": [
        {"name": "cpu", "engine": "llamacpp", "model": "/models/m.gguf", "cpus": cpus}]}]})  # fmt: skip


class Cluster:
    """A state, an inventory and a fake fleet; ``reconcile`` runs one pass."""

    def __init__(self, tmp: Path, names: tuple[str, ...] = NODES, *, cpus: int = 16) -> None:
        self.tmp, self.inv = tmp, _inv(names)
        self.fleet = FakeFleet(names)
        self.store = Store(tmp / "state.db", actor="up")
        self.router = tmp / "router.yaml"
        self.save(names, cpus=cpus)

    def save(self, names: tuple[str, ...], *, unreachable: tuple[str, ...] = (), cpus: int = 16) -> None:
        """What a probe would save: ``unreachable`` ones did not answer it."""
        facts = [replace(cpu_node(n, cpus=cpus, reachable=n not in unreachable), probed_at=1.0) for n in names]
        self.store.save_discovery(facts)

    def reconcile(self, cat: Catalog, **kw: Any) -> UpResult:
        async def go() -> UpResult:
            async with AsyncStore(self.store) as astore:
                return await up(self.inv, cat, astore, self.fleet,
                                lambda: discovery.fleet(self.inv, astore, placeable=True),
                                router_config=self.router, catalog_doc=cat.model_dump(mode="json"),
                                **{"timeout_s": 5, "drain_s": 0.2, **kw})  # fmt: skip

        return asyncio.run(go())

    def published(self) -> list[str]:
        doc = yaml.safe_load(self.router.read_text())
        return sorted(e["replica"] for m in doc["models"].values() for e in m["endpoints"] if not e.get("draining"))

    def live(self) -> dict[str, Any]:
        return {r.name: r for r in self.store.records()}

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    c = Cluster(tmp_path)
    yield c
    c.close()


def _actions(res: UpResult) -> dict[str, tuple[str, str]]:
    return {o.name: (o.action, o.state) for o in res.outcomes}


def test_a_first_pass_starts_every_replica_and_publishes_it(cluster: Cluster) -> None:
    res = cluster.reconcile(_cat(2))
    assert _actions(res) == {"m/0": ("start", READY), "m/1": ("start", READY)} and res.complete
    assert cluster.published() == ["m/0", "m/1"]
    running = cluster.fleet.running()
    live = cluster.live()
    assert sorted(running) == sorted(r.shards[0].token for r in live.values())
    for rec in live.values():  # each recorded with the process the node reported
        node = cluster.fleet[rec.shards[0].node]
        assert node.engines[rec.shards[0].token].pid == rec.shards[0].pid
        assert rec.endpoint == f"http://h-{rec.shards[0].node}:{rec.port}"


def test_a_second_pass_over_a_healthy_cluster_changes_nothing(cluster: Cluster) -> None:
    cluster.reconcile(_cat(2))
    before = cluster.fleet.starts()
    version = cluster.store.version()
    res = cluster.reconcile(_cat(2))
    assert _actions(res) == {"m/0": ("keep", READY), "m/1": ("keep", READY)}
    assert cluster.fleet.starts() == before and cluster.store.version() == version


def test_a_crashed_engine_is_restarted_in_place_with_its_allocation(cluster: Cluster) -> None:
    cluster.reconcile(_cat(2))
    old = cluster.live()["m/0"]
    cluster.fleet[old.shards[0].node].crash(old.shards[0].token)
    res = cluster.reconcile(_cat(2))
    assert _actions(res)["m/0"] == ("restart", READY) and _actions(res)["m/1"] == ("keep", READY)
    assert "is not running" in next(o.reason for o in res.outcomes if o.name == "m/0")
    new = cluster.live()["m/0"]
    assert (new.replica, new.port, new.generation, new.restarts) == (old.replica, old.port, old.generation, 1)
    assert new.shards[0].pid != old.shards[0].pid
    assert cluster.published() == ["m/0", "m/1"]


def test_an_engine_that_never_gets_ready_is_released_whole_and_the_others_go_on(cluster: Cluster) -> None:
    for n in NODES:
        cluster.fleet[n].load_checks = 10**6
    res = cluster.reconcile(_cat(1), timeout_s=0.3)
    ((name, (action, state)),) = _actions(res).items()
    assert (name, action, state) == ("m/0", "start", "failed") and not res.complete
    assert "not ready in time" in res.outcomes[0].reason
    assert cluster.fleet.running() == {} and cluster.live() == {} and cluster.store.fences() == []
    assert cluster.published() == []


def test_a_replica_whose_node_did_not_answer_the_probe_is_left_as_it_is(cluster: Cluster) -> None:
    """It may still run there: neither stopped, released nor replaced; out of the router."""
    cluster.reconcile(_cat(2))
    rec = cluster.live()["m/0"]
    node = rec.shards[0].node
    cluster.fleet[node].partitioned = True
    cluster.save(NODES, unreachable=(node,))
    starts = len(cluster.fleet.starts())
    res = cluster.reconcile(_cat(2))
    out = next(o for o in res.outcomes if o.name == "m/0")
    assert out.state == "unhealthy" and "unreachable" in out.reason
    assert len(cluster.fleet.starts()) == starts  # not replaced elsewhere
    assert cluster.live()["m/0"].shards == rec.shards and cluster.published() == ["m/1"]
    # Healed: back in service as it was.
    cluster.fleet[node].partitioned = False
    cluster.save(NODES)
    res = cluster.reconcile(_cat(2))
    assert cluster.published() == ["m/0", "m/1"]
    assert cluster.live()["m/0"].shards[0].token == rec.shards[0].token


def test_a_replica_the_catalog_drops_leaves_the_router_then_stops(cluster: Cluster) -> None:
    cluster.reconcile(_cat(2))
    gone = cluster.live()["m/1"]
    res = cluster.reconcile(_cat(1))
    assert _actions(res) == {"m/0": ("keep", READY), "m/1": ("stop", "stopped")}
    assert gone.shards[0].token not in cluster.fleet.running()
    assert cluster.published() == ["m/0"] and list(cluster.live()) == ["m/0"]
    assert cluster.store.held_ports(gone.shards[0].node) == (
        {cluster.live()["m/0"].port} if cluster.live()["m/0"].shards[0].node == gone.shards[0].node else set()
    )


def test_a_stop_that_leaves_something_fences_and_a_later_pass_clears_it(cluster: Cluster) -> None:
    cluster.reconcile(_cat(2))
    gone = cluster.live()["m/1"]
    node = cluster.fleet[gone.shards[0].node]
    node.stuck = True
    res = cluster.reconcile(_cat(1))
    assert _actions(res)["m/1"] == ("stop", "failed") and "still running" in res.outcomes[1].reason
    (fence,) = cluster.store.fences()
    assert fence.token == gone.shards[0].token
    assert cluster.store.held_ports(node.name) >= {gone.port}  # still held: its engine may run
    node.stuck = False
    cluster.reconcile(_cat(1))
    assert cluster.store.fences() == [] and gone.shards[0].token not in cluster.fleet.running()
    assert gone.port not in cluster.store.held_ports(node.name) or cluster.live()["m/0"].port == gone.port


def test_a_node_that_refuses_every_start_fails_its_replica_and_the_next_pass_retries(tmp_path: Path) -> None:
    c = Cluster(tmp_path, ("n1",))
    try:
        c.fleet["n1"].fail_start = "cannot create the run folder"
        res = c.reconcile(_cat(1))
        assert (
            _actions(res) == {"m/0": ("start", "failed")} and "cannot create the run folder" in res.outcomes[0].reason
        )
        assert c.live() == {} and c.fleet.running() == {}
        c.fleet["n1"].fail_start = None
        assert _actions(c.reconcile(_cat(1))) == {"m/0": ("start", READY)}
    finally:
        c.close()


def test_nothing_fits_is_unplaced_in_places_words(cluster: Cluster) -> None:
    res = cluster.reconcile(_cat(1, cpus=64))
    (o,) = res.outcomes
    assert (o.action, o.state) == ("unplaced", "unplaced") and "0/3 nodes are available" in o.reason
    assert cluster.fleet.starts() == []


# ---- the decisions under any sequence of faults ------------------------------------------
_step = st.one_of(
    st.tuples(st.just("crash"), st.integers(0, 5)),
    st.tuples(st.just("replicas"), st.integers(1, 4)),
    st.tuples(st.just("stuck"), st.sampled_from(NODES)),
    st.tuples(st.just("unstuck"), st.sampled_from(NODES)),
    st.tuples(st.just("refuse"), st.sampled_from(NODES)),
    st.tuples(st.just("accept"), st.sampled_from(NODES)),
)


@pytest.mark.hypothesis
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_step, min_size=1, max_size=6))
def test_after_every_pass_what_runs_is_recorded_and_what_is_published_runs(
    tmp_path_factory: Any, steps: list[tuple[str, Any]]
) -> None:
    """Whatever happened before a pass, after it: every engine running on a node is a live
    replica's or a fence's (nothing leaks); every published replica is ready and runs; no two
    live replicas share a node's port; a pass with no fault left ends complete."""
    c = Cluster(tmp_path_factory.mktemp("r"), cpus=16)
    want = 2
    try:
        c.reconcile(_cat(want))
        for op, arg in steps:
            if op == "crash":
                running = sorted(c.fleet.running().items())
                if running:
                    token, node = running[arg % len(running)]
                    c.fleet[node].crash(token)
            elif op == "replicas":
                want = arg
            elif op in ("stuck", "unstuck"):
                c.fleet[arg].stuck = op == "stuck"
            else:
                c.fleet[arg].fail_start = "refused" if op == "refuse" else None
            c.reconcile(_cat(want))
            _check(c)
        for n in NODES:  # every fault gone: two passes converge
            c.fleet[n].stuck, c.fleet[n].fail_start = False, None
        c.reconcile(_cat(want))
        res = c.reconcile(_cat(want))
        _check(c)
        assert res.complete and len([o for o in res.outcomes if o.state == READY]) == want
        assert c.store.fences() == []
    finally:
        c.close()


def _check(c: Cluster) -> None:
    live = c.store.records(include_fenced=True)
    owned = {run.token for r in live for run in r.shards} | {f.token for f in c.store.fences()}
    assert set(c.fleet.running()) <= owned, "an engine runs that nothing records"
    ready = {r.name: r for r in live if r.status == READY}
    assert set(c.published()) <= set(ready)
    for name in c.published():
        run = ready[name].shards[0]
        assert c.fleet.running().get(run.token) == run.node
    ports = [(r.shards[0].node if r.shards else r.replica.shards[0].node, r.port) for r in live if r.status != FENCED]
    assert len(ports) == len(set(ports)), ports


def test_an_engine_started_after_the_probe_is_asked_about_before_it_is_called_dead(cluster: Cluster) -> None:
    """The probe's snapshot (or a heartbeat's) is older than the state the pass reads: a shard
    it did not see is asked about on its node, not restarted on the snapshot's word."""
    from cluster_cli.launch.observe import Observed

    cluster.reconcile(_cat(1))
    (rec,) = cluster.live().values()
    stale = Observed(started={rec.shards[0].node: {}})  # the node answered, before the engine ran
    res = cluster.reconcile(_cat(1), observed=stale)
    assert _actions(res) == {"m/0": ("keep", READY)} and len(cluster.fleet.starts()) == 1
