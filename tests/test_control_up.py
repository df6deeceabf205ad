"""``control.up.up`` where nothing is started: what it reports and records, with no node
contacted (nothing is placed, so no session is ever asked for)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fakenodes import FakeFleet
from helpers import catalog, cpu_node, profile

from cluster_cli.config.inventory import Inventory
from cluster_cli.control import discovery
from cluster_cli.control.up import up
from cluster_cli.errors import StateError
from cluster_cli.facts import Replica, Shard
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import ReplicaRecord, ShardRun
from cluster_cli.state.store import Store


class _NoSessions:
    async def get(self, node: str) -> Any:
        raise AssertionError(f"no node should be contacted ({node})")


def test_a_replica_no_node_can_take_is_reported_unplaced_in_places_words(tmp_path: Path) -> None:
    inv = Inventory.model_validate({"nodes": [{"name": "cpu-01", "host": "h1"}, {"name": "cpu-02", "host": "h2"}]})
    cat = catalog(("big", 1, [profile("h100-tp8", gpu_class="H100", gpus=8)]))
    with Store(tmp_path / "s.db", actor="up") as s:
        s.save_discovery([replace(cpu_node("cpu-01"), probed_at=1.0), replace(cpu_node("cpu-02"), probed_at=1.0)])

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await up(inv, cat, astore, _NoSessions(), lambda: discovery.fleet(inv, astore, placeable=True),  # type: ignore[arg-type]
                                router_config=tmp_path / "router.yaml", catalog_doc=cat.model_dump(mode="json"))  # fmt: skip

        result = asyncio.run(go())
        (o,) = result.outcomes
        assert (o.name, o.action, o.state) == ("big/0", "unplaced", "unplaced")
        assert o.reason == "h100-tp8: 0/2 nodes are available: 2 no H100 gpu.", o.reason
        assert not result.complete and (tmp_path / "router.yaml").exists()
        stored = s.catalog()
        assert stored is not None and stored.doc["models"][0]["name"] == "big"  # the desired state, kept


# ---- the control flow against fake nodes ------------------------------------------------
class _Nodes(FakeFleet):
    """Fake nodes for the launch path: ``fail`` nodes refuse a start, ``slow`` ones take that
    long, ``gpu_left`` ones leave a GPU process after a stop, ``silent`` ones cannot be reached."""

    def __init__(self, *, fail: set[str] = frozenset(), slow: dict[str, float] | None = None,  # type: ignore[assignment]
                 gpu_left: set[str] = frozenset(), silent: set[str] = frozenset()) -> None:  # type: ignore[assignment]  # fmt: skip
        super().__init__()
        for n in fail:
            self[n].fail_start = "cannot create the run folder"
        for n, s in (slow or {}).items():
            self[n].start_delay = s
        for n in gpu_left:
            self[n].gpu_left = True
        for n in silent:
            self[n].partitioned = True


def _launch_one(store: Store, nodes: _Nodes, rec: ReplicaRecord, inv: Inventory) -> Any:
    from cluster_cli.control import lifecycle

    async def go() -> Any:
        async with AsyncStore(store) as astore:
            out = await lifecycle.start(rec, "start", inv, None, astore, nodes, {}, time.monotonic() + 5,  # type: ignore[arg-type]
                                      lambda *a: None)  # fmt: skip
            await asyncio.sleep(0.6)  # the loop lives on (up waits for other replicas): a stray start would end
            return out

    return asyncio.run(go())


def _starts(monkeypatch: Any) -> None:
    """Shard starts without a catalog: each shard's run folder and marker."""
    from cluster_cli.control import lifecycle
    from cluster_cli.launch.shards import folder

    def starts(rec: ReplicaRecord, cat: Any, inv: Any, facts: Any, **kw: Any) -> list[Any]:
        return [SimpleNamespace(node=s.node, script=SimpleNamespace(ports=(rec.port,) if i == 0 else ()),
                                run=ShardRun(s.node, folder("~/r", rec), f"{rec.name}.g{rec.generation}.s{i}"))
                for i, s in enumerate(rec.replica.shards)]  # fmt: skip

    monkeypatch.setattr(lifecycle, "shard_starts", starts)


def test_a_failed_shard_start_waits_for_the_others_before_it_stops_them(tmp_path: Path, monkeypatch: Any) -> None:
    """One shard's start fails at once while another's is still on its way: the stop comes
    only once every start has ended, so it finds the slower one too."""
    _starts(monkeypatch)
    nodes = _Nodes(fail={"n2"}, slow={"n2": 0.05, "n3": 0.4})
    inv = Inventory.model_validate({"nodes": [{"name": n, "host": n} for n in ("n1", "n2", "n3")]})
    with Store(tmp_path / "s.db") as s:
        rep = Replica("big", 0, "p", "vllm", (Shard("n1", (0,)), Shard("n2", (0,)), Shard("n3", (0,))))
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        out = _launch_one(s, nodes, rec, inv)
        assert out.state == "failed" and "n2: cannot create the run folder" in out.reason
        assert nodes.running() == {}  # n3's engine, started after n2 failed, was stopped too
        assert s.records(include_down=True, include_fenced=True) == [] and s.fences() == []
        assert [e.kind for e in s.events() if e.name == "big/0"][-2:] == ["failed", "released"]


def test_a_down_interrupted_after_marking_is_finished_by_the_next_down(tmp_path: Path, monkeypatch: Any) -> None:
    from cluster_cli.control.replicas import down

    nodes = _Nodes()
    with Store(tmp_path / "s.db", actor="down") as s:
        (rec,) = s.reserve([ReplicaRecord(Replica("m", 0, "p", "llamacpp", (Shard("n1"),)), port=8100)]).records
        rec = s.observe(replace(rec, status="ready", shards=(nodes["n1"].adopt(ShardRun("n1", "~/r", "m/0.g1.s0")),)))
        s.want_down(rec, owner="run-gone")  # that down was killed here
        (stuck,) = [r for r in s.records(include_down=True) if r.status == "stopping"]
        assert s.held_apart() == {}  # a CPU replica: its port stays held all the same
        assert s.held_ports("n1") == {8100}

        async def go(alive: Any) -> Any:
            async with AsyncStore(s) as astore:
                return await down(astore, nodes, [stuck], router_config=tmp_path / "router.yaml",  # type: ignore[arg-type]
                                  report=lambda _: None, owner="run-now", alive=alive)  # fmt: skip

        (busy,) = asyncio.run(go(lambda run: run == "run-gone"))  # still going: its own
        assert not busy.clean and "another down" in busy.problem and nodes.running()
        (done,) = asyncio.run(go(lambda run: False))  # gone: taken over
        assert done.clean and nodes.running() == {}
        (row,) = s.records(include_down=True)
        assert (row.status, row.desired) == ("stopped", "down") and s.held_ports("n1") == set()


def test_down_of_a_replica_up_replaced_meanwhile_takes_down_its_new_generation(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from cluster_cli.control.replicas import down

    nodes = _Nodes()
    rep = Replica("m", 0, "p", "llamacpp", (Shard("n1"),))
    with Store(tmp_path / "s.db") as s:
        (old,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        s.release(old)  # up replaced it...
        s.reserve([ReplicaRecord(rep, port=8101)])  # ...with its next generation

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await down(astore, nodes, [old], router_config=tmp_path / "router.yaml",  # type: ignore[arg-type]
                                  report=lambda _: None)  # fmt: skip

        (done,) = asyncio.run(go())  # the down read generation 1
        assert done.clean and done.name == "m/0"
        (row,) = s.records(include_down=True)
        assert (row.generation, row.status, row.desired) == (2, "stopped", "down")


def test_what_up_started_after_a_down_is_fenced_with_its_gpus_when_its_stop_is_not_confirmed(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A ``down`` lands while ``up`` starts the replica and releases it (nothing ran yet); the
    engine then starts; ``up`` finds the row changed and stops what it started, but nvidia-smi
    still lists it: the row is fenced again, with its GPU booked again, so nothing else is
    placed on a GPU its engine may still use."""
    _starts(monkeypatch)
    nodes = _Nodes(gpu_left={"n1"})
    inv = Inventory.model_validate({"nodes": [{"name": "n1", "host": "n1"}]})
    path = tmp_path / "s.db"
    with Store(path, actor="up") as s, Store(path, actor="down") as operator:
        (rec,) = s.reserve([ReplicaRecord(Replica("m", 0, "p", "vllm", (Shard("n1", (0, 1)),)), port=8100)]).records

        def a_down(sh: Any) -> None:
            (cur,) = operator.records()  # the down: marked, nothing found running, released
            operator.release(operator.want_down(cur, owner="down-run"), wanted_down=True, why="stopped by down")

        nodes["n1"].before_start = a_down
        out = _launch_one(s, nodes, rec, inv)
        assert out.state == "failed" and "changed by another command" in out.reason and "not confirmed" in out.reason
        (row,) = s.records(include_down=True, include_fenced=True)
        assert (row.status, row.desired) == ("fenced", "down")
        assert s.fenced_gpus() == {"n1": {0: "m/0 generation 1", 1: "m/0 generation 1"}}
        (fence,) = s.fences()
        assert fence.token == "m/0.g1.s0"
        with pytest.raises(StateError, match="GPU 0 is already held by m/0"):
            s.reserve([ReplicaRecord(Replica("x", 0, "p", "vllm", (Shard("n1", (0,)),)), port=9000)])


def test_down_keeps_the_catalogs_metric_mappings_in_the_router_config(tmp_path: Path, monkeypatch: Any) -> None:
    """The router config is rendered with the catalog up applied (the state keeps it), so a
    down does not fall back to the engine's own metric names."""
    import yaml

    from cluster_cli.config.catalog import Catalog
    from cluster_cli.control.replicas import down

    nodes = _Nodes()
    mapping = {"running": "my_running", "waiting": "my_waiting", "kv_cache_usage": "my_kv"}
    cat = Catalog.model_validate({
        "engines": {"llamacpp": {"command": "llama-server", "metrics": mapping}},
        "models": [{"name": "m", "replicas": 2, "profiles": [{"name": "p", "engine": "llamacpp", "model": "/m.gguf", "cpus": 1}]}],
    })  # fmt: skip
    with Store(tmp_path / "s.db") as s:
        s.save_catalog(cat.model_dump(mode="json"))
        recs = s.reserve(
            [ReplicaRecord(Replica("m", i, "p", "llamacpp", (Shard(f"n{i}"),)), port=8100) for i in (0, 1)]
        )
        ready = [s.observe(replace(r, status="ready", endpoint=f"http://n{r.replica.replica}:8100",
                                   shards=(ShardRun(f"n{r.replica.replica}", "~/r", f"t{r.replica.replica}"),)))
                 for r in recs.records]  # fmt: skip

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await down(astore, nodes, ready[:1], router_config=tmp_path / "router.yaml",  # type: ignore[arg-type]
                                  report=lambda _: None)  # fmt: skip

        asyncio.run(go())
    doc = yaml.safe_load((tmp_path / "router.yaml").read_text())
    assert doc["engines"]["llamacpp"]["metrics"] == mapping
    assert [e["replica"] for e in doc["models"]["m"]["endpoints"]] == ["m/1"]


def test_a_fixed_port_two_replicas_share_a_node_for_fails_the_second_alone(tmp_path: Path, monkeypatch: Any) -> None:
    """A profile's ``port:`` is one per node: two replicas placed on one node cannot both have
    it. The second is reported failed with why; the first starts; ``up`` goes on."""
    from cluster_cli.config.catalog import Catalog

    _starts(monkeypatch)
    nodes = _Nodes()
    inv = Inventory.model_validate({"nodes": [{"name": "cpu-01", "host": "h1"}]})
    cat = Catalog.model_validate({"models": [{"name": "m", "replicas": 2, "profiles": [
        {"name": "p", "engine": "llamacpp", "model": "/m.gguf", "cpus": 1, "port": 9000}]}]})  # fmt: skip
    with Store(tmp_path / "s.db", actor="up") as s:
        s.save_discovery([replace(cpu_node("cpu-01"), probed_at=1.0)])

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await up(inv, cat, astore, nodes, lambda: discovery.fleet(inv, astore, placeable=True),  # type: ignore[arg-type]
                                router_config=tmp_path / "router.yaml", timeout_s=5)  # fmt: skip

        result = asyncio.run(go())
        got = {o.name: o for o in result.outcomes}
        assert (got["m/0"].state, got["m/1"].state) == ("ready", "failed"), got
        assert "port 9000 is taken" in got["m/1"].reason and not result.complete
        assert [(r.name, r.port) for r in s.records()] == [("m/0", 9000)]
