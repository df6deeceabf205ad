"""Replacing a replica while it serves (``control/handover.py``), and ``drain``, on fake nodes:
the order of what happens on the nodes and in the router config."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from fakenodes import FakeFleet
from helpers import cpu_node

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.control.cluster import Cluster
from cluster_cli.control.handover import drain
from cluster_cli.control.up import up
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import READY
from cluster_cli.state.store import Store


def _cat(replicas: int, cpus: int = 8) -> Catalog:
    return Catalog.model_validate({"models": [{"name": "m", "replicas": replicas, "profiles": [
        {"name": "cpu", "engine": "llamacpp", "model": "/models/m.gguf", "cpus": cpus}]}]})  # fmt: skip


def _published(path: Path) -> list[tuple[str, bool]]:
    doc = yaml.safe_load(path.read_text())
    return sorted((e["replica"], bool(e.get("draining"))) for m in doc["models"].values() for e in m["endpoints"])


def _run(tmp: Path, nodes: tuple[str, ...], cat: Catalog, body: Any, *, cpus: int = 16) -> None:
    inv = Inventory.model_validate({"nodes": [{"name": n, "host": f"h-{n}"} for n in nodes]})
    with Store(tmp / "state.db", actor="drain") as s:
        s.save_discovery([replace(cpu_node(n, cpus=cpus), probed_at=1.0) for n in nodes], inventory=tmp / "inv.yaml")

        async def go() -> None:
            async with AsyncStore(s) as astore:
                fleet = FakeFleet(nodes)
                c = Cluster(inv, tmp / "inv.yaml", astore, None, tmp / "router.yaml", nodes=fleet, drain_s=0.1)  # type: ignore[arg-type]
                res = await up(inv, cat, astore, fleet, c.fleet, router_config=c.router_config, timeout_s=5,
                               catalog_doc=cat.model_dump(mode="json"))  # fmt: skip
                assert res.complete
                await body(c, fleet)

        asyncio.run(go())


def test_drain_starts_the_replacement_before_it_stops_the_old_one(tmp_path: Path) -> None:
    async def body(c: Cluster, fleet: FakeFleet) -> None:
        (old,) = await c.store.records()
        node = old.shards[0].node
        seen: list[Any] = []
        for n in fleet.nodes.values():  # what the router config says at each start and stop
            n.before_start = lambda s: seen.append(("start", _published(c.router_config)))
        res = await drain(c, node, _cat(1), reason="maintenance", drain_s=0.1, timeout_s=5)
        assert res.ok and res.cordoned, res.to_dict()
        (h,) = res.replaced
        assert h.before_stop and h.new is not None and h.new.nodes != [node]
        assert seen == [("start", [("m/0", False)])]  # the old one served while the new one started
        (new,) = await c.store.records()
        assert new.generation == old.generation + 1 and new.status == READY and new.shards[0].node != node
        assert old.shards[0].token not in fleet.running() and new.shards[0].token in fleet.running()
        assert _published(c.router_config) == [("m/0", False)]
        assert (await c.store.cordons())[node]["reason"] == "maintenance"
        ops = [(n.name, op) for n in fleet.nodes.values() for op, _ in n.calls if op in ("start", "stop")]
        assert (node, "stop") in ops

    _run(tmp_path, ("n1", "n2"), _cat(1), body)


def test_without_spare_capacity_drain_stops_first_then_places(tmp_path: Path) -> None:
    """Two nodes that take one replica each; the third is free only after the drained one's
    replica is gone... there is none: the replica is stopped first and reported unplaced."""

    async def body(c: Cluster, fleet: FakeFleet) -> None:
        recs = {r.name: r for r in await c.store.records()}
        node = recs["m/0"].shards[0].node
        res = await drain(c, node, _cat(2, cpus=16), reason="dead fan", drain_s=0.1, timeout_s=5)
        (h,) = res.replaced
        assert not h.before_stop and not h.ok and "no node can take it" in h.reason
        assert recs["m/0"].shards[0].token not in fleet.running()
        assert _published(c.router_config) == [("m/1", False)]  # the other one serves on

    _run(tmp_path, ("n1", "n2"), _cat(2, cpus=16), body, cpus=16)


def test_a_pass_of_another_run_leaves_both_generations_of_a_handover_alone(tmp_path: Path) -> None:
    from cluster_cli.control.up import _held

    async def body(c: Cluster, fleet: FakeFleet) -> None:
        (old,) = await c.store.records()
        newer = replace(old, generation=old.generation + 1, owner="drain-run")
        held = _held([old, newer], lambda r: r.owner == "drain-run")
        assert held == [old.replica]
        assert _held([old, newer], lambda r: True) == [old.replica]  # both theirs: the older is planned
        assert _held([old], lambda r: True) == [old.replica]

    _run(tmp_path, ("n1", "n2"), _cat(1), body)


def test_changed_finds_replicas_whose_launch_spec_moved() -> None:
    from cluster_cli.control.handover import changed
    from cluster_cli.facts import Replica, Shard
    from cluster_cli.state.records import ReplicaRecord

    def cat(**profile: Any) -> Catalog:
        prof = {"name": "cpu", "engine": "llamacpp", "model": "/models/m.gguf", "cpus": 8, **profile}
        return Catalog.model_validate({"models": [{"name": "m", "replicas": 2, "profiles": [prof]}]})

    recs = [ReplicaRecord(Replica("m", i, "cpu", "llamacpp", (Shard("n1"),)), port=8100 + i) for i in (0, 1, 2)]
    base = cat()
    assert changed(base, cat(), recs) == []
    assert changed(None, cat(args=["-c", "4096"]), recs) == []  # nothing to compare with
    assert [r.name for r in changed(base, cat(args=["-c", "4096"]), recs)] == ["m/0", "m/1"]  # not m/2: beyond
    assert [r.name for r in changed(base, cat(model="/models/other.gguf"), recs)] == ["m/0", "m/1"]
    assert changed(base, cat(priority=5), recs) == []  # placement's order, not what runs
    engine = Catalog.model_validate({**base.model_dump(mode="json"), "engines": {"llamacpp": {"command": "/opt/ls"}}})
    assert len(changed(base, engine, recs)) == 2


def test_a_roll_replaces_one_at_a_time_and_stops_at_a_failure(tmp_path: Path) -> None:
    from cluster_cli.control.handover import roll

    async def body(c: Cluster, fleet: FakeFleet) -> None:
        olds = sorted(await c.store.records(), key=lambda r: r.key)
        order: list[str] = []
        for n in fleet.nodes.values():
            n.before_start = lambda s: order.append(f"start {s.run.token.split('.')[0]}")
        hs = await roll(c, _cat(2), olds, drain_s=0.1, timeout_s=5)
        assert [h.ok for h in hs] == [True, True] and order == ["start m/0", "start m/1"]
        news = {r.name: r for r in await c.store.records()}
        assert all(news[o.name].generation == o.generation + 1 for o in olds)
        assert _published(c.router_config) == [("m/0", False), ("m/1", False)]
        for n in fleet.nodes.values():
            n.fail_start = "no room"
        hs = await roll(c, _cat(2), sorted(news.values(), key=lambda r: r.key), drain_s=0.1, timeout_s=5)
        assert len(hs) == 1 and not hs[0].ok  # the first failed: the second is left as it is
        assert {r.name: r.generation for r in await c.store.records()} == {n: r.generation for n, r in news.items()}

    _run(tmp_path, ("n1", "n2", "n3"), _cat(2), body)
