"""``supervise``'s decisions against a fleet of fake nodes and a clock of the test's own:
nodes killed, partitioned, all cut off at once, an engine that keeps crashing; what the
state, the router config and the nodes hold after each tick."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakenodes import FakeFleet
from helpers import cpu_node

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.control.cluster import Cluster
from cluster_cli.control.supervise import Settings, Supervisor
from cluster_cli.errors import ClusterctlError
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import FENCED, READY
from cluster_cli.state.store import Store

NODES = ("n1", "n2", "n3")


def _cat(replicas: int = 2) -> Catalog:
    return Catalog.model_validate({"models": [{"name": "m", "replicas": replicas, "profiles": [
        {"name": "cpu", "engine": "llamacpp", "model": "/models/m.gguf", "cpus": 8}]}]})  # fmt: skip


class Rig:
    """A supervisor over fake nodes; ``step`` advances its clock, ticks and waits for the
    pass the tick started."""

    def __init__(self, tmp: Path, astore: AsyncStore, fleet: FakeFleet, cat: Catalog) -> None:
        inv = Inventory.model_validate({"nodes": [{"name": n, "host": f"h-{n}"} for n in NODES]})
        self.now = 1000.0
        self.fleet, self.store, self.router = fleet, astore, tmp / "router.yaml"
        cluster = Cluster(inv, tmp / "inventory.yaml", astore, None, self.router, nodes=fleet, drain_s=0.1)  # type: ignore[arg-type]
        self.logs: list[str] = []
        self.sup = Supervisor(cluster, cat, Settings(interval_s=2, grace_s=30), self.logs.append, lambda: self.now)
        self.sup.settings.start_timeout_s = 5

    async def step(self, advance: float = 2.0) -> None:
        self.now += advance
        await self.sup.tick()
        if self.sup._pass is not None:
            await self.sup._pass

    def published(self) -> list[str]:
        if not self.router.exists():
            return []
        doc = yaml.safe_load(self.router.read_text())
        return sorted(e["replica"] for m in doc["models"].values() for e in m["endpoints"] if not e.get("draining"))

    async def live(self) -> dict[str, Any]:
        return {r.name: r for r in await self.store.records()}


def run(tmp_path: Path, body: Any, cat: Catalog | None = None) -> None:
    with Store(tmp_path / "state.db", actor="supervise") as s:
        s.save_discovery([replace(cpu_node(n, cpus=16), probed_at=1.0) for n in NODES])

        async def go() -> None:
            async with AsyncStore(s) as astore:
                rig = Rig(tmp_path, astore, FakeFleet(NODES), cat or _cat())
                await rig.step()  # the first pass starts what the catalog asks for
                assert rig.published() == ["m/0", "m/1"], rig.logs
                await body(rig)

        asyncio.run(go())


def test_a_killed_node_is_unreachable_then_lost_and_its_replica_rebuilt_elsewhere(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        victim = (await rig.live())["m/0"]
        dead = victim.shards[0].node
        rig.fleet[dead].kill()
        await rig.step()
        assert rig.sup.nodes[dead].state == "unreachable"
        assert rig.published() == ["m/1"]  # out of the router at once
        assert (await rig.live())["m/0"].shards == victim.shards  # kept: it may come back
        await rig.step(15)
        assert rig.sup.nodes[dead].state == "unreachable"  # within the grace
        await rig.step(16)
        assert rig.sup.nodes[dead].state == "lost"
        new = (await rig.live())["m/0"]
        assert new.status == READY and new.shards[0].node != dead and new.generation == victim.generation + 1
        assert rig.published() == ["m/0", "m/1"]
        fenced = [r for r in await rig.store.records(include_fenced=True) if r.status == FENCED]
        assert [r.key for r in fenced] == [victim.key]  # its GPUs and port stay held until the node is back
        # Revived (a new boot): fenced, then trusted; the fence record settled.
        rig.fleet[dead].revive()
        await rig.step()
        await rig.step()
        assert rig.sup.nodes[dead].state == "ready"
        assert await rig.store.fences() == []
        assert [r.key for r in await rig.store.records(include_fenced=True)] == [
            r.key for r in (await rig.live()).values()
        ]
        kinds = [e.kind for e in await rig.store.events()]
        assert {"node-unreachable", "node-lost", "node-ready"} <= set(kinds)

    run(tmp_path, body)


def test_a_partitioned_node_is_fenced_when_it_answers_again(tmp_path: Path) -> None:
    """Its engine ran on while it was away and its replica was rebuilt elsewhere: healed, that
    older engine is stopped before the node is trusted, and never published again."""

    async def body(rig: Rig) -> None:
        victim = (await rig.live())["m/0"]
        node = victim.shards[0].node
        rig.fleet[node].partitioned = True
        await rig.step()
        await rig.step(31)
        assert rig.sup.nodes[node].state == "lost"
        assert victim.shards[0].token in rig.fleet[node].engines  # still running there, unseen
        rig.fleet[node].partitioned = False
        await rig.step()
        assert victim.shards[0].token not in rig.fleet[node].engines
        assert any(op == "fence" for op, _ in rig.fleet[node].calls)
        assert rig.sup.nodes[node].state == "ready" and await rig.store.fences() == []
        live = await rig.live()
        assert live["m/0"].generation == victim.generation + 1 and rig.published() == ["m/0", "m/1"]

    run(tmp_path, body)


def test_a_short_blip_takes_a_node_out_of_the_router_and_back_without_a_rebuild(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        victim = (await rig.live())["m/0"]
        node = victim.shards[0].node
        rig.fleet[node].partitioned = True
        await rig.step()
        assert rig.published() == ["m/1"]
        rig.fleet[node].partitioned = False
        await rig.step()
        await rig.step()
        assert rig.published() == ["m/0", "m/1"]
        assert (await rig.live())["m/0"].shards == victim.shards  # the same engine, not restarted
        assert len(rig.fleet.starts()) == 2

    run(tmp_path, body)


def test_the_storm_brake_rebuilds_nothing_when_every_node_is_cut_off(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        before = await rig.live()
        for n in NODES:
            rig.fleet[n].partitioned = True
        await rig.step()
        for _ in range(5):
            await rig.step(20)
        assert {ns.state for ns in rig.sup.nodes.values()} == {"unreachable"}  # never lost
        assert rig.sup.brake is not None and "nothing is rebuilt" in rig.sup.brake
        assert any("storm brake on" in line for line in rig.logs)
        assert any(e.kind == "note" and "storm brake on" in e.message for e in await rig.store.events())
        for n in NODES:
            rig.fleet[n].partitioned = False
        await rig.step()
        await rig.step()
        assert rig.sup.brake is None and rig.published() == ["m/0", "m/1"]
        assert {k: r.shards for k, r in (await rig.live()).items()} == {k: r.shards for k, r in before.items()}
        assert len(rig.fleet.starts()) == 2

    run(tmp_path, body)


def test_a_crashing_engine_is_restarted_with_growing_delays_then_moved(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        victim = (await rig.live())["m/0"]
        node = rig.fleet[victim.shards[0].node]
        starts_at: list[float] = []
        seen = len(rig.fleet.starts())
        for _ in range(40):
            for token in [t for t in node.engines if t.startswith("m/0.")]:
                node.crash(token)
            await rig.step(0.5)
            if len(rig.fleet.starts()) > seen:
                starts_at.append(rig.now)
                seen = len(rig.fleet.starts())
            if (await rig.live()).get("m/0") is not None and (await rig.live())["m/0"].shards[0].node != node.name:
                break
        moved = (await rig.live())["m/0"]
        assert moved.shards[0].node != node.name, rig.logs
        gaps = [b - a for a, b in itertools.pairwise(starts_at)]
        assert gaps[:2] == sorted(gaps[:2]) and gaps[1] > gaps[0], (starts_at, rig.logs)
        assert any("placing it elsewhere" in line for line in rig.logs)

    run(tmp_path, body)


def test_once_says_whether_the_cluster_converged(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        assert await rig.sup.once()
        rig.fleet["n1"].kill()
        rig.fleet["n2"].kill()
        rig.fleet["n3"].kill()
        assert not await rig.sup.once()

    run(tmp_path, body)


@pytest.mark.parametrize("share", [0.55])
def test_one_node_of_three_lost_is_no_storm(tmp_path: Path, share: float) -> None:
    from cluster_cli.control import supervision

    nodes = {n: supervision.NodeState(since=0) for n in NODES}
    supervision.observe(nodes, {"n1": (False, None, "x"), "n2": (True, "b", ""), "n3": (True, "c", "")}, 1,
                        interval_s=2, grace_s=30)  # fmt: skip
    assert supervision.braking(nodes, 1, grace_s=30, share=share) is None
    supervision.observe(nodes, {"n1": (False, None, "x"), "n2": (False, None, "x"), "n3": (True, "c", "")}, 3,
                        interval_s=2, grace_s=30)  # fmt: skip
    assert supervision.braking(nodes, 3, grace_s=30, share=share) is not None


def test_the_catalog_up_stores_reads_back_for_supervise(tmp_path: Path) -> None:
    """A catalog that declares no engines is stored as given: ``supervise`` without -c reads
    it back (a dump with ``engines: {}`` made explicit would be refused)."""
    from cluster_cli.control.statefile import stored_catalog

    cat = _cat(3)
    with Store(tmp_path / "s.db") as s:
        s.save_catalog(cat.to_doc())

        async def go() -> Catalog:
            async with AsyncStore(s) as astore:
                return await stored_catalog(astore)

        assert asyncio.run(go()) == cat
        s.save_catalog(cat.model_dump(mode="json"))  # as an older clusterctl stored it

        with pytest.raises(ClusterctlError, match="does not read back"):
            asyncio.run(go())


def test_an_engine_that_runs_but_stops_answering_is_restarted(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        rec = (await rig.live())["m/0"]
        node = rig.fleet[rec.shards[0].node]
        node.engines[rec.shards[0].token].healthy = False  # hung: its process is still there
        starts = len(rig.fleet.starts())
        for _ in range(6):
            await rig.step(1)
        assert len(rig.fleet.starts()) == starts + 1, rig.logs
        new = (await rig.live())["m/0"]
        assert new.status == READY and new.shards[0].token != rec.shards[0].token and new.restarts == 1
        assert any("has not answered its health check" in line for line in rig.logs)

    run(tmp_path, body)


def test_a_second_supervisor_refuses_naming_the_first_or_waits_with_standby(tmp_path: Path) -> None:
    from cluster_cli.control.lease import SupervisorRunning, hold_lease

    settings = Settings(interval_s=0.05)
    with Store(tmp_path / "s.db", actor="a") as first, Store(tmp_path / "s.db", actor="b") as second:

        async def go() -> list[str]:
            said: list[str] = []
            stop = asyncio.Event()
            async with hold_lease(first, settings, standby=False, stop=stop, log=said.append) as held:
                assert held is not None and first.lease == held
                with pytest.raises(SupervisorRunning, match=r"already runs on this state: supervise-.* \(pid \d+ on "):
                    async with hold_lease(second, settings, standby=False, stop=stop, log=said.append):
                        pass

                async def standby() -> Any:
                    async with hold_lease(second, settings, standby=True, stop=stop, log=said.append) as got:
                        return got

                waiting = asyncio.ensure_future(standby())
                await asyncio.sleep(0.2)
                assert not waiting.done()  # the first one still holds it
            assert first.lease is None  # given up at the end of the block
            got = await asyncio.wait_for(waiting, 5)
            assert got is not None and got.epoch == held.epoch + 1
            return said

        said = asyncio.run(go())
        assert any(line.startswith("standby:") for line in said)


def test_a_supervisor_whose_lease_was_taken_writes_nothing_more(tmp_path: Path) -> None:
    from cluster_cli.state.leases import LeaseLost

    async def body(rig: Rig) -> None:
        store = rig.store.store
        store.lease = store.acquire_lease("supervise", "me", 30)
        await rig.step()
        other = Store(store.path, actor="other")
        try:
            other.release_lease(store.lease)  # as if it expired...
            other.acquire_lease("supervise", "someone-else", 30)  # ...and another took it
        finally:
            other.close()
        with pytest.raises(LeaseLost, match="stale"):
            await rig.step()
        stop = asyncio.Event()
        with pytest.raises(LeaseLost):
            await rig.sup.run(stop)  # the loop ends on it, it does not tick on

    run(tmp_path, body)


def test_a_drain_asked_of_the_supervisor_is_done_by_it_and_answered(tmp_path: Path) -> None:
    async def body(rig: Rig) -> None:
        rec = (await rig.live())["m/0"]
        node = rec.shards[0].node
        await rig.store.request_drain(node, reason="fan", deadline_s=0.1, force=False)
        assert [r.node for r in await rig.store.drain_requests()] == [node]
        await rig.step()
        answer = await rig.store.drain_result(node)
        assert answer is not None and answer["complete"], answer
        (h,) = answer["replicas"]
        assert h["name"] == "m/0" and h["make_before_break"] and h["to"] != [node]
        assert await rig.store.drain_requests() == [] and await rig.store.drain_result(node) is None  # read once
        assert (await rig.live())["m/0"].shards[0].node != node
        assert node in await rig.store.cordons()
        assert any("draining, asked by" in line for line in rig.logs)

    run(tmp_path, body)


def test_a_drain_request_can_be_withdrawn_before_it_is_taken(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", actor="drain") as s:
        s.request_drain("n1", reason="x", deadline_s=5, force=True)
        s.request_drain("n2", reason="y", deadline_s=5, force=False)
        assert [(r.node, r.force, r.by) for r in s.drain_requests()] == [("n1", True, "drain"), ("n2", False, "drain")]
        assert s.withdraw_drain("n1") and not s.withdraw_drain("n1")
        s.finish_drain("n2", {"complete": True, "replicas": []})
        assert s.drain_requests() == [] and s.drain_result("n2") == {"complete": True, "replicas": []}
        assert [e.message for e in s.events() if e.kind == "note"][-1].startswith("drain of n2 done")


def test_a_frozen_node_holds_up_neither_the_ticks_nor_the_rebuild(tmp_path: Path) -> None:
    """Every call to a frozen node hangs: its heartbeat times out (unreachable), and once it is
    lost the pass that rebuilds its replica never waits on it (a call to it would hang the
    step below for good)."""

    async def body(rig: Rig) -> None:
        rec = (await rig.live())["m/0"]
        node = rig.fleet[rec.shards[0].node]
        node.freeze()
        await rig.step()
        assert rig.sup.nodes[node.name].state == "ready"  # one heartbeat timed out: maybe only slow
        await rig.step()
        assert rig.sup.nodes[node.name].state == "unreachable" and rig.published() == ["m/1"]
        await rig.step(31)
        new = (await rig.live())["m/0"]
        assert rig.sup.nodes[node.name].state == "lost" and new.shards[0].node != node.name
        assert rig.published() == ["m/0", "m/1"]  # the pass ended while the node is still frozen
        node.thaw()
        await rig.step()
        assert rec.shards[0].token not in node.engines  # fenced: the old engine stopped

    run(tmp_path, body)


def test_a_node_still_away_when_the_brake_releases_gets_a_whole_grace(tmp_path: Path) -> None:
    """Every node cut off for longer than the grace, then back one by one: the last one back is
    not lost (and its replica not rebuilt) the moment the others' return releases the brake."""

    async def body(rig: Rig) -> None:
        before = {k: r.shards for k, r in (await rig.live()).items()}
        for n in NODES:
            rig.fleet[n].partitioned = True
        for _ in range(4):
            await rig.step(20)
        assert rig.sup.brake is not None
        last = next(iter(before["m/0"])).node
        for n in NODES:
            if n != last:
                rig.fleet[n].partitioned = False
        await rig.step()
        assert rig.sup.brake is None and rig.sup.nodes[last].state == "unreachable"
        await rig.step(20)
        assert rig.sup.nodes[last].state == "unreachable"  # within its new grace
        rig.fleet[last].partitioned = False
        await rig.step()
        await rig.step()
        assert {k: r.shards for k, r in (await rig.live()).items()} == before

    run(tmp_path, body)
