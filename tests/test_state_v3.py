"""State schema 3: a schema-2 state migrates whole; generations are never reused; holds book
GPUs by UUID; CHECK constraints; writes re-check the schema; leases fence writes; the version
moves only when what placement reads changes; the desired catalog; node status."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import dgx
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.errors import StateError
from cluster_cli.facts import Gpu, NodeFacts, Replica, Shard
from cluster_cli.state import schema
from cluster_cli.state import store as store_module
from cluster_cli.state.launches import StaleRecord
from cluster_cli.state.leases import LeaseHeld, LeaseLost
from cluster_cli.state.records import READY, ReplicaRecord, ShardRun
from cluster_cli.state.store import Store

FIXTURE = Path(__file__).parent / "fixtures" / "state" / "v2-landed.sql"
INVENTORY = """
gpu_classes: {H200: ["NVIDIA H200"]}
nodes:
  - {name: gpu-01, host: 198.18.0.10, fabric: ib-a}
  - {name: gpu-02, host: 198.18.0.11, fabric: ib-a}
  - {name: cpu-01, host: 198.18.0.12}
  - {name: cpu-02, host: 198.18.0.13}
"""
CATALOG = """
models:
  - name: tp
    profiles: [{name: tp2, engine: vllm, gpu_class: H200, gpus: 2, model: acme/tp-model}]
  - name: tiny
    replicas: 2
    profiles: [{name: cpu, engine: llamacpp, cpus: 1, memory_gib: 0.25, model: /models/tiny.gguf}]
"""


def _v2(path: Path) -> Path:
    db = sqlite3.connect(path)
    db.executescript(FIXTURE.read_text())
    db.close()
    return path


def _file_schema(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        return db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    finally:
        db.close()


def _cli(state: Path, *args: str) -> object:
    return CliRunner().invoke(app, ["--state", str(state), *args], catch_exceptions=False)


def test_a_state_written_by_schema_2_migrates_to_3_and_keeps_everything(tmp_path: Path) -> None:
    path = _v2(tmp_path / "state.db")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(INVENTORY)
    cat = tmp_path / "catalog.yaml"
    cat.write_text(CATALOG)
    # place reads it before anything migrated it: through an upgraded copy, the file untouched
    r = _cli(path, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert doc["state_version"] == 5 and _file_schema(path) == "2"
    placed = {f"{x['model']}/{x['replica']}": x for x in doc["replicas"]}
    # tp/0 and tiny/0 are kept where they run (gpu-02 stays cordoned); tiny/1 (down) is placed again
    assert {n: x["action"] for n, x in placed.items()} == {"tp/0": "keep", "tiny/0": "keep", "tiny/1": "start"}
    assert placed["tp/0"]["shards"][0]["node"] == "gpu-01" and placed["tp/0"]["shards"][0]["gpus"] == [0, 1]

    r = _cli(path, "status", "--no-check", "-o", "json")
    assert r.exit_code == 0, r.output  # type: ignore[attr-defined]
    assert _file_schema(path) == "3"  # a command that writes migrated it
    rows = {x["name"]: x for x in json.loads(r.stdout)["replicas"]}  # type: ignore[attr-defined]
    assert {n: (x["state"], x["generation"], x["desired"]) for n, x in rows.items()} == {
        "tiny/0": ("ready", 1, "up"),
        "tiny/1": ("stopped", 1, "down"),
        "tp/0": ("ready", 1, "up"),
    }
    assert rows["tp/0"]["gpus"] == {"gpu-01": [0, 1]} and rows["tp/0"]["endpoint"] == "http://198.18.0.10:8100"

    with Store(path) as s:
        assert s.schema == 3 and s.version() == 5  # an upgrade is no change of what the state says
        assert s.cordons()["gpu-02"]["reason"] == "fan failing"
        assert s.inventory() == Path("/srv/fleet/inventory.yaml")
        assert [n.name for n in s.nodes()] == ["cpu-01", "cpu-02", "gpu-01", "gpu-02"]
        assert {n: st.status for n, st in s.node_status().items()} == dict.fromkeys(
            ["cpu-01", "cpu-02", "gpu-01", "gpu-02"], "ready"
        )
        recs = {r.name: r for r in s.records(include_down=True)}
        tp = recs["tp/0"]
        assert (tp.port, tp.revision, tp.replica.gpu_class) == (8100, 1, "H200")
        (run,) = tp.shards
        assert run.token.startswith("tp/0.g1.s0.") and run.pid == 60 and run.start_time == 20122
        assert len(run.gpu_uuids) == 2 and run.run_dir == "~/.clusterctl/run/tp-0.g1"
        assert tp.replica.shards[0].hcas[:2] == ("mlx5_0", "mlx5_1")
        holds = s._b._db.execute("SELECT node, kind, item, uuid FROM holds ORDER BY model, kind, item").fetchall()
        assert holds == [
            ("cpu-01", "port", 8100, None),
            ("gpu-01", "gpu", 0, run.gpu_uuids[0]),  # booked by UUID now
            ("gpu-01", "gpu", 1, run.gpu_uuids[1]),
            ("gpu-01", "port", 8100, None),
        ]
        kinds = [(e.kind, e.name) for e in s.events()]
        assert kinds[:7] == [("discover", None), ("cordon", None), ("discover", None), ("reserved", "tp/0"),
                             ("reserved", "tiny/0"), ("reserved", "tiny/1"), ("released", "tiny/1")]  # fmt: skip
        assert kinds[-1] == ("migrate", None) and s.events()[-1].actor == "status"
        # generations go on from the highest a schema-2 state used: none is reused
        (again,) = s.reserve([ReplicaRecord(recs["tiny/1"].replica, port=8101)]).records
        assert again.generation == 2
    with Store(path) as s:  # opening again changes nothing
        assert s.version() == 6 and [e.kind for e in s.events()].count("migrate") == 1


def test_generations_are_never_reused(tmp_path: Path) -> None:
    rep = Replica("m", 0, "p", "llamacpp", (Shard("n1"),))
    with Store(tmp_path / "s.db") as s:
        (a,) = s.reserve([ReplicaRecord(rep, port=1)]).records
        s.release(a, wanted_down=True)  # down
        (b,) = s.reserve([ReplicaRecord(rep, port=1)]).records
        s.release(b, why="failed to start")  # row gone
        (c,) = s.reserve([ReplicaRecord(rep, port=1)]).records
        s.release(c, left=[(ShardRun("n1", "~/r", "tok-c"), "node unreachable")])  # fenced
        (d,) = s.reserve([ReplicaRecord(rep, port=2)]).records
        assert [a.generation, b.generation, c.generation, d.generation] == [1, 2, 3, 4]
        assert [(r.generation, r.status) for r in s.records(include_fenced=True)] == [(3, "fenced"), (4, "planned")]


def test_holds_book_a_gpu_by_its_uuid_whatever_its_index(tmp_path: Path) -> None:
    """After a reboot the driver may number the GPUs otherwise: the GPU a replica holds is
    the same device (its UUID), not the same index."""

    def facts(order: tuple[str, str]) -> NodeFacts:
        gpus = tuple(Gpu(index=i, uuid=u, product="NVIDIA H100", gpu_class="H100") for i, u in enumerate(order))
        return NodeFacts("n1", host="h", gpus=gpus, probed_at=time.time())

    with Store(tmp_path / "s.db") as s:
        s.save_discovery([facts(("GPU-x", "GPU-y"))])
        s.reserve([ReplicaRecord(Replica("a", 0, "p", "vllm", (Shard("n1", (0,)),)), port=1)])  # GPU-x
        s.save_discovery([facts(("GPU-y", "GPU-x"))])  # renumbered: GPU-x is index 1 now
        s.reserve([ReplicaRecord(Replica("b", 0, "p", "vllm", (Shard("n1", (0,)),)), port=2)])  # GPU-y: free
        with pytest.raises(StateError, match="GPU 1 is already held by a/0"):
            s.reserve([ReplicaRecord(Replica("c", 0, "p", "vllm", (Shard("n1", (1,)),)), port=3)])
        assert {r.name for r in s.records()} == {"a/0", "b/0"}


@pytest.mark.parametrize(
    ("sql", "column"),
    [
        ("UPDATE replicas SET status='running'", "status"),
        ("UPDATE replicas SET desired='maybe'", "desired"),
        ("UPDATE holds SET kind='disk'", "kind"),
        ("UPDATE shards SET state='zombie'", "state"),
        ("INSERT INTO events(at, kind, message) VALUES (1, 'oops', 'x')", "kind"),
        ("INSERT INTO node_status(node, status, since, updated_at) VALUES ('n', 'gone', 1, 1)", "status"),
        ("INSERT INTO holds VALUES ('n9', 'gpu', 0, NULL, 'nobody', 0, 1)", "FOREIGN KEY"),
    ],
)
def test_check_constraints_guard_every_status_desired_and_kind(tmp_path: Path, sql: str, column: str) -> None:
    with Store(tmp_path / "s.db") as s:
        s.reserve([ReplicaRecord(Replica("m", 0, "p", "vllm", (Shard("n1", (0,)),)), port=1)])
        with pytest.raises(StateError, match=column), s.write() as tx:
            tx.execute(sql)
        assert [r.status for r in s.records()] == ["planned"]


def test_an_older_clusterctl_refuses_a_newer_schema_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        other = sqlite3.connect(path)
        other.execute("UPDATE meta SET value='4' WHERE key='schema_version'")  # a newer clusterctl migrated it
        other.commit()
        other.close()
        with pytest.raises(StateError, match="state schema 4 is not the 3 this clusterctl writes"):
            s.cordon("n1", "x")
        assert s.cordons() == {}
    with pytest.raises(StateError, match=r"state schema 4 is newer than this clusterctl understands \(3\)"):
        Store(path)


def test_a_newer_clusterctl_migrates_only_when_no_process_holds_the_lease(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.cordon("n1", "kept")
        lease = s.acquire_lease("supervise", "supervise-a1", ttl_s=60, host="ctl-01", pid=4242)

    def v3_to_v4(tx: object) -> None:
        tx.execute("CREATE TABLE gpu_cordons (node TEXT, gpu INTEGER)")  # type: ignore[attr-defined]

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 4)
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 4)
    monkeypatch.setitem(schema.MIGRATIONS, 3, v3_to_v4)
    with pytest.raises(StateError, match=r"supervise-a1 \(pid 4242 on ctl-01\) holds the supervise lease"):
        Store(path)
    assert _file_schema(path) == "3"
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 3)
    with Store(path) as s:
        s.release_lease(lease)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 4)
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", 4)
    with Store(path) as s:
        assert s.schema == 4 and s.cordons()["n1"]["reason"] == "kept"
    assert _file_schema(path) == "4"


def test_a_write_under_a_stale_lease_is_refused_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, actor="supervise") as a, Store(path, actor="supervise") as b:
        mine = a.acquire_lease("supervise", "sup-a", ttl_s=0.3, host="h1", pid=1)
        assert mine.epoch == 1
        with pytest.raises(LeaseHeld, match=r"held by sup-a \(pid 1 on h1\)"):
            b.acquire_lease("supervise", "sup-b", ttl_s=30, host="h2", pid=2)
        a.lease = mine
        a.cordon("n1", "under the lease")  # a write under a current lease goes through
        time.sleep(0.35)  # sup-a is paused past its expiry (a frozen VM)
        theirs = b.acquire_lease("supervise", "sup-b", ttl_s=30, host="h2", pid=2)
        assert theirs.epoch == 2
        b.lease = theirs
        b.cordon("n2", "by the new holder")
        with pytest.raises(LeaseLost, match=r"sup-b \(pid 2 on h2\) holds it now \(epoch 2\)"):
            a.cordon("n1", "from the stale holder")
        with pytest.raises(LeaseLost):
            a.renew_lease(mine, 30)
        assert {n: c["reason"] for n, c in b.cordons().items()} == {"n1": "under the lease", "n2": "by the new holder"}
        assert b.renew_lease(theirs, 30).epoch == 2
        kinds = [e.message for e in b.events() if e.kind == "lease"]
        assert kinds == ["supervise lease taken by sup-a, epoch 1",
                         "supervise lease taken by sup-b, epoch 2 (taken over from sup-a (pid 1 on h1), expired)"]  # fmt: skip


def test_the_version_moves_only_when_what_placement_reads_changes(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        assert s.save_discovery([replace(dgx("gpu-01"), probed_at=1.0)]) is True
        v = s.version()
        g0 = dgx("gpu-01").gpus[0]
        busy = replace(dgx("gpu-01"), probed_at=2.0, gpus=(replace(g0, memory_used_mib=40000), *dgx("gpu-01").gpus[1:]))
        assert s.save_discovery([busy]) is False and s.version() == v  # a heartbeat of the same hardware
        ecc = replace(g0, problems=("ecc: 2 uncorrected ECC errors",), ecc_uncorrected=2)
        assert s.save_discovery([replace(busy, probed_at=3.0, gpus=(ecc, *busy.gpus[1:]))]) is True
        assert s.version() == v + 1
        away = NodeFacts("gpu-01", host="h", reachable=False, error="timed out", probed_at=4.0)
        assert s.save_discovery([away]) is True and s.version() == v + 2
        assert s.node_status()["gpu-01"].status == "unreachable"
        assert s.save_discovery([replace(away, probed_at=5.0, error="refused")]) is False  # still away
        assert s.save_discovery([replace(busy, probed_at=6.0, gpus=(ecc, *busy.gpus[1:]))]) is True
        st = s.node_status()["gpu-01"]
        assert (st.status, st.last_heartbeat) == ("ready", 6.0)
        assert [e.message for e in s.events() if e.kind.startswith("node-")] == [
            "gpu-01 ready", "gpu-01 unreachable: timed out", "gpu-01 ready"]  # fmt: skip


def test_node_status_writes_never_move_the_version(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", actor="supervise") as s:
        s.save_discovery([replace(dgx("gpu-01"), probed_at=1.0)])
        v = s.version()
        assert s.set_node_status("gpu-01", "unreachable", detail="3 heartbeats missed") is True
        assert s.set_node_status("gpu-01", "unreachable", heartbeat=None) is False  # no change, no event
        assert s.set_node_status("gpu-01", "lost") is True
        assert s.set_node_status("gpu-01", "ready", boot_id="b2", heartbeat=10.0) is True
        assert s.version() == v
        with pytest.raises(ValueError, match="not a node status"):
            s.set_node_status("gpu-01", "gone")
        ev = [(e.kind, e.actor) for e in s.events() if e.kind.startswith("node-")]
        assert ev[-3:] == [("node-unreachable", "supervise"), ("node-lost", "supervise"), ("node-ready", "supervise")]


def test_the_catalog_up_applied_is_the_desired_state_with_its_own_version(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", actor="up") as s:
        assert s.catalog() is None
        doc = {"models": [{"name": "tiny", "replicas": 2}]}
        assert s.save_catalog(doc, source="/srv/catalog.yaml") == 1
        assert s.save_catalog(dict(doc)) == 1  # the same catalog again: no new version
        assert s.save_catalog({"models": [{"name": "tiny", "replicas": 3}]}) == 2
        got = s.catalog()
        assert got is not None and (got.version, got.doc["models"][0]["replicas"], got.actor) == (2, 3, "up")
        assert s.catalog(1).source == "/srv/catalog.yaml"  # type: ignore[union-attr]


def test_a_release_whose_stop_was_not_confirmed_keeps_the_row_and_its_holds_until_unfenced(tmp_path: Path) -> None:
    rep = Replica("m", 0, "p", "vllm", (Shard("n1", (2, 3)), Shard("n2", (0,))))
    with Store(tmp_path / "s.db") as s:
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        runs = (ShardRun("n1", "~/r/m-0.g1", "t1", pid=11, start_time=5), ShardRun("n2", "~/r/m-0.g1", "t2", pid=12))
        rec = s.observe(replace(rec, status=READY, shards=runs))
        v = s.version()
        kept = s.release(rec, left=[(runs[0], "processes still running: 11")])
        assert kept is not None and kept.status == "fenced" and s.version() == v + 1
        assert s.records() == [] and [r.key for r in s.records(include_fenced=True)] == [rec.key]
        assert s.fenced_gpus() == {"n1": {2: "m/0 generation 1", 3: "m/0 generation 1"}, "n2": {0: "m/0 generation 1"}}
        assert s.held_ports("n1") == {8100}  # nothing else may start there either
        (fence,) = s.fences()
        assert (fence.node, fence.token, fence.generation, fence.pid) == ("n1", "t1", 1, 11)
        with pytest.raises(StateError, match="GPU 3 is already held by m/0"):
            s.reserve([ReplicaRecord(Replica("x", 0, "p", "vllm", (Shard("n1", (3,)),)), port=9000)])
        assert s.unfence("nope") is False
        assert s.unfence("t1") is True
        assert s.fenced_gpus() == {} and s.held_ports("n1") == set() and s.records(include_fenced=True) == []
        assert s.version() == v + 2
        kinds = [e.kind for e in s.events()]
        assert kinds[-3:] == ["fenced", "unfenced", "released"]


def test_a_down_whose_stop_was_not_confirmed_stays_wanted_down_and_fenced(tmp_path: Path) -> None:
    rep = Replica("m", 0, "p", "vllm", (Shard("n1", (0,)),))
    with Store(tmp_path / "s.db") as s:
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        rec = s.observe(replace(rec, status=READY, shards=(ShardRun("n1", "~/r", "t1", pid=11),)))
        rec = s.want_down(rec)
        with pytest.raises(StaleRecord):  # a writer that read it before the down
            s.observe(replace(rec, revision=rec.revision - 1, status=READY))
        s.release(rec, wanted_down=True, left=[(rec.shards[0], "its node did not answer the stop")])
        (got,) = s.records(include_down=True, include_fenced=True)
        assert (got.status, got.desired) == ("fenced", "down")
        # brought back by a new up: a new generation; the fenced one stays until its stop is confirmed
        (again,) = s.reserve([ReplicaRecord(Replica("m", 0, "p", "vllm", (Shard("n1", (1,)),)), port=8101)]).records
        assert again.generation == 2
        s.unfence("t1")
        assert [(r.generation, r.status, r.desired) for r in s.records(include_down=True, include_fenced=True)] == [
            (1, "stopped", "down"),
            (2, "planned", "up"),
        ]


def test_gpus_held_by_a_replica_being_stopped_or_fenced_are_not_placed_and_say_why(tmp_path: Path) -> None:
    """A replica wanted down but not yet released, or fenced, holds its GPUs: placement reads
    them as taken (the plan's snapshot says by whom), and a reservation of its MODEL/N does
    not take them over."""
    from helpers import catalog, profile

    from cluster_cli.placement import plan
    from cluster_cli.state.view import with_fenced

    with Store(tmp_path / "s.db") as s:
        s.save_discovery([replace(dgx("gpu-01"), probed_at=1.0)])
        rep = Replica("m", 0, "tp2", "vllm", (Shard("gpu-01", (0, 1)),), gpu_class="H100")
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        rec = s.observe(replace(rec, status=READY, shards=(ShardRun("gpu-01", "~/r", "t1", pid=5),)))
        s.want_down(rec)  # a down is stopping it
        with pytest.raises(StateError, match="GPU 0 is already held by m/0"):
            s.reserve([ReplicaRecord(rep, port=8101)])  # not handed to its next generation meanwhile
        view = s.plan_view()
        assert view.records == [] and view.fenced == {
            "gpu-01": {0: "m/0 generation 1, being stopped", 1: "m/0 generation 1, being stopped"}
        }
    nodes = with_fenced(view.nodes, view.fenced)
    cat = catalog(("big", 1, [profile("tp8", gpu_class="H100", gpus=8)]))
    result = plan(nodes, cat, [])
    (u,) = result.unplaced
    assert "2 held by a replica being stopped" in u.reasons[0].detail, u.reasons
    assert result.starts == [] and plan(view.nodes, cat, []).starts  # without them it would fit


def test_place_reads_the_gpus_a_fenced_replica_holds_as_taken(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "gpu_classes: {H100: ['NVIDIA H100 80GB HBM3']}\nnodes:\n  - {name: gpu-01, host: h, fabric: ib-a}\n"
    )
    cat = tmp_path / "catalog.yaml"
    cat.write_text(
        "models:\n  - {name: one, replicas: 7, profiles: [{name: g1, engine: vllm, gpu_class: H100, gpus: 1, model: /m}]}\n"
    )
    state = tmp_path / "state.db"
    with Store(state) as s:
        s.save_discovery([replace(dgx("gpu-01"), probed_at=1.0)])
        rep = Replica("old", 0, "x", "vllm", (Shard("gpu-01", (6, 7)),), gpu_class="H100")
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        run = ShardRun("gpu-01", "~/r", "t-old", pid=9)
        s.release(
            s.observe(replace(rec, status=READY, shards=(run,))), left=[(run, "its node did not answer the stop")]
        )
    r = _cli(state, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json")
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    used = sorted(g for x in doc["replicas"] for sh in x["shards"] for g in sh["gpus"])
    assert used == [0, 1, 2, 3, 4, 5], doc["replicas"]  # 6 and 7 are the fenced replica's
    (u,) = doc["unplaced"]
    assert any("2 held by a replica being stopped" in x["detail"] for x in u["reasons"]), u["reasons"]


def test_a_schema_2_state_migrates_where_two_holds_name_one_gpu_and_counts_every_generation(tmp_path: Path) -> None:
    """Two schema-2 holds can resolve to one UUID (GPUs renumbered after a reboot): the
    migration keeps both, the second by its index. Schema 2 could reuse generation 1 after a
    down: every reservation its events saw counts, so no generation is used again."""
    path = _v2(tmp_path / "state.db")
    db = sqlite3.connect(path)
    spec, runtime = db.execute("SELECT spec, runtime FROM replicas WHERE model='tp'").fetchone()
    rt = json.loads(runtime)
    doc = json.loads(spec)
    doc["model"], doc["shards"][0]["gpus"] = "other", [5]
    rt["shards"][0]["gpu_uuids"] = rt["shards"][0]["gpu_uuids"][:1]  # the same device as tp/0's GPU 0
    rt["shards"][0]["token"] = "other/0.g1.s0.x"
    db.execute(
        "INSERT INTO replicas VALUES ('other', 0, 1, ?, 'ready', NULL, NULL, 'up', ?, NULL, 0, 1.0)",
        (json.dumps(doc), json.dumps(rt)),
    )
    db.execute("INSERT INTO holds VALUES ('gpu-01', 'gpu', 5, 'other', 0, 1)")
    for _ in range(2):  # tiny/1 was reserved three times in all (each time as generation 1)
        db.execute("INSERT INTO events(at, kind, node, message) VALUES (2.0, 'reserve', 'cpu-02', 'tiny/1 reserved')")
    db.commit()
    db.close()
    with Store(path) as s:
        holds = s._b._db.execute("SELECT model, item, uuid IS NULL FROM holds WHERE kind='gpu' ORDER BY model, item")
        assert holds.fetchall() == [("other", 5, 1), ("tp", 0, 0), ("tp", 1, 0)]
        tiny1 = next(r for r in s.records(include_down=True) if r.name == "tiny/1")
        (again,) = s.reserve([ReplicaRecord(tiny1.replica, port=8101)]).records
        assert again.generation == 4


def test_fence_started_keeps_what_may_run_even_where_its_row_went_or_its_gpu_was_taken(tmp_path: Path) -> None:
    """What a run started after its row changed may run on: recorded whatever became of the
    row. Gone (released, a newer generation reserved): made again, fenced; a GPU another
    replica booked meanwhile is said in a conflict event, the fence stands all the same."""
    rep = Replica("m", 0, "p", "vllm", (Shard("n1", (0, 1)),))
    run = ShardRun("n1", "~/r/m-0.g1", "m/0.g1.s0", pid=42, start_time=7)
    with Store(tmp_path / "s.db", actor="up") as s:
        (rec,) = s.reserve([ReplicaRecord(rep, port=8100)]).records
        s.release(rec)  # gone
        (other,) = s.reserve([ReplicaRecord(Replica("x", 0, "p", "vllm", (Shard("n1", (1,)),)), port=8200)]).records
        v = s.version()
        kept = s.fence_started(replace(rec, shards=(run,)), [(run, "nvidia-smi still lists processes 42")], why="taken")
        assert (kept.status, kept.desired, kept.shards) == ("fenced", "down", (run,)) and s.version() == v + 1
        assert s.fenced_gpus() == {"n1": {0: "m/0 generation 1"}}  # GPU 1 is x/0's now
        assert s.held_ports("n1") == {8100, 8200}
        (fence,) = s.fences()
        assert (fence.token, fence.pid, fence.generation) == ("m/0.g1.s0", 42, 1)
        conflict = [e for e in s.events() if e.kind == "conflict"]
        assert (
            len(conflict) == 1 and "GPU 1 is held by x/0 while m/0 generation 1 may still use it" in conflict[0].message
        )
        assert s.unfence("m/0.g1.s0")
        assert s.fenced_gpus() == {} and s.held_ports("n1") == {8200}  # its own holds go, x/0's stay
        assert [r.key for r in s.records()] == [other.key]
