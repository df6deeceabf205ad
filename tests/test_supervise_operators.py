"""Operators' writes while ``supervise`` runs: hundreds of cordons and uncordons, a ``down``
and an ``up`` with a new catalog, each through its own handle on the state, against a
supervisor ticking as fast as it can on fake nodes. Nothing either side writes is lost, and
nothing wanted down is brought back."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

from fakenodes import FakeFleet
from helpers import cpu_node

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.control import discovery
from cluster_cli.control.cluster import Cluster
from cluster_cli.control.replicas import down
from cluster_cli.control.runs import Runs
from cluster_cli.control.supervise import Settings, Supervisor
from cluster_cli.control.up import up
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.store import Store

NODES = ("n1", "n2", "n3", "n4")


def _cat(replicas: int) -> Catalog:
    return Catalog.model_validate({"models": [{"name": "m", "replicas": replicas, "profiles": [
        {"name": "cpu", "engine": "llamacpp", "model": "/models/m.gguf", "cpus": 4}]}]})  # fmt: skip


def test_operators_writes_and_the_supervisors_never_lose_each_other(tmp_path: Path) -> None:
    inv = Inventory.model_validate({"nodes": [{"name": n, "host": f"h-{n}"} for n in NODES]})
    path = tmp_path / "state.db"
    rng = random.Random(7)
    with (
        Store(path, actor="supervise") as sup_store,
        Store(path, actor="operator") as op_store,
        Runs(path) as sup_run,
        Runs(path) as op_run,
    ):
        sup_store.save_discovery([replace(cpu_node(n, cpus=16), probed_at=1.0) for n in NODES],
                                 inventory=tmp_path / "inv.yaml")  # fmt: skip
        fleet = FakeFleet(NODES)
        router = tmp_path / "router.yaml"

        async def go() -> dict[str, str | None]:
            async with AsyncStore(sup_store) as s, AsyncStore(op_store) as op:
                first = await up(inv, _cat(2), op, fleet, lambda: discovery.fleet(inv, op, placeable=True),
                                 router_config=router, timeout_s=5, catalog_doc=_cat(2).to_doc(), runs=op_run)  # fmt: skip
                assert first.complete
                c = Cluster(inv, tmp_path / "inv.yaml", s, None, router, runs=sup_run, nodes=fleet, drain_s=0.05)  # type: ignore[arg-type]
                sup = Supervisor(c, None, Settings(interval_s=0.01, grace_s=5))
                stop = asyncio.Event()
                loop = asyncio.ensure_future(sup.run(stop))
                expected: dict[str, str | None] = dict.fromkeys(NODES)
                for i in range(300):
                    n = rng.choice(NODES)
                    if rng.random() < 0.5:
                        await op.cordon(n, f"reason {i}", inventory=tmp_path / "inv.yaml")
                        expected[n] = f"reason {i}"
                    else:
                        await op.uncordon(n)
                        expected[n] = None
                    if i == 200:  # a down of one replica (the next up would bring it back; supervise must not)
                        (gone,) = [r for r in await op.records() if r.name == "m/1"]
                        (d,) = await down(op, fleet, [gone], router_config=router, report=lambda _: None,
                                          owner=op_run.id, alive=op_run.alive, drain_s=0.05)  # fmt: skip
                        assert d.clean
                    if i == 100:  # an up with a catalog that asks for one more
                        for n2 in NODES:  # room for it, whatever the cordons say now
                            await op.uncordon(n2)
                            expected[n2] = None
                        res = await up(inv, _cat(3), op, fleet, lambda: discovery.fleet(inv, op, placeable=True),
                                       router_config=router, timeout_s=5, catalog_doc=_cat(3).to_doc(), runs=op_run)  # fmt: skip
                        assert {o.name: o.state for o in res.outcomes}["m/2"] in ("ready", "starting"), res.to_dict()
                    await asyncio.sleep(0)
                for _ in range(20):  # the supervisor goes on for a while
                    await asyncio.sleep(0.02)
                stop.set()
                await loop
                assert sup.passes > 0
                return expected

        expected = asyncio.run(go())
        cordons = op_store.cordons()
        assert {n: (cordons[n]["reason"] if n in cordons else None) for n in NODES} == expected
        rows = {r.name: r for r in op_store.records(include_down=True)}
        assert (rows["m/1"].status, rows["m/1"].desired) == ("stopped", "down")  # not brought back
        assert rows["m/0"].status == "ready" and rows["m/2"].status == "ready", [
            (r.name, r.status, r.detail) for r in rows.values()
        ]
        live = {run.token for r in op_store.records() for run in r.shards}
        assert set(fleet.running()) == live  # nothing leaked, nothing of m/1 runs
