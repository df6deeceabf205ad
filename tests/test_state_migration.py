"""State schema 2: a version-1 state is upgraded in place, and holds keep GPUs and ports
exclusive whoever writes."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_cli.errors import StateError
from cluster_cli.facts import Gpu, NodeFacts, Replica, Shard
from cluster_cli.state.launches import StaleVersion
from cluster_cli.state.records import READY, STARTING, UNHEALTHY, ReplicaRecord, ShardRun
from cluster_cli.state.schema import SCHEMA_VERSION
from cluster_cli.state.store import Store

V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (name TEXT PRIMARY KEY, host TEXT NOT NULL DEFAULT '', reachable INTEGER NOT NULL,
    error TEXT, facts TEXT NOT NULL, probed_at REAL, updated_at REAL NOT NULL);
CREATE TABLE cordons (node TEXT PRIMARY KEY, reason TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE replicas (model TEXT NOT NULL, replica INTEGER NOT NULL, spec TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'planned', endpoint TEXT, detail TEXT, updated_at REAL NOT NULL,
    PRIMARY KEY (model, replica));
CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL,
    node TEXT, message TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO meta VALUES ('state_version', '7');
"""


def _rep(model: str = "m", n: int = 0, node: str = "gpu-01", gpus: tuple[int, ...] = (0, 1)) -> Replica:
    return Replica(model, n, "p", "vllm", (Shard(node, gpus),), gpu_class="H100")


def _v1_state(path: Path) -> None:
    db = sqlite3.connect(path)
    db.executescript(V1)
    facts = NodeFacts(name="gpu-01", host="10.0.0.1", reachable=True).to_dict()
    db.execute("INSERT INTO nodes VALUES ('gpu-01', '10.0.0.1', 1, NULL, ?, 1.0, 1.0)", (json.dumps(facts),))
    db.execute("INSERT INTO cordons VALUES ('gpu-01', 'fan failing', 5.0)")
    db.execute("INSERT INTO replicas VALUES ('m', 0, ?, 'planned', NULL, NULL, 1.0)", (json.dumps(_rep().to_dict()),))
    db.commit()
    db.close()


def test_a_version_1_state_is_upgraded_in_place_with_its_cordons_and_facts(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _v1_state(path)
    with Store(path, readonly=True) as ro:  # read through an upgraded copy; the file is not written
        assert ro.schema == SCHEMA_VERSION and ro.replicas() == [_rep()]
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("1",)
    db.close()
    with Store(path) as s:
        assert s.schema == SCHEMA_VERSION
        assert s.cordons()["gpu-01"]["reason"] == "fan failing"
        assert [n.name for n in s.nodes()] == ["gpu-01"] and s.nodes()[0].cordoned
        assert s.version() == 7  # an upgrade is no change of what the state says
        (rec,) = s.records()
        assert (rec.replica, rec.generation, rec.desired) == (_rep(), 1, "up")
        assert s.events(1)[-1].kind == "migrate"
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    db.close()
    with Store(path) as s:  # opening again changes nothing
        assert s.version() == 7 and len(s.records()) == 1


def test_a_failed_migration_leaves_the_version_1_state_as_it_was(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.db"
    _v1_state(path)
    from cluster_cli.state import schema

    def broken(db: sqlite3.Connection) -> None:
        db.execute("ALTER TABLE replicas RENAME TO replicas_v1")
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setitem(schema.MIGRATIONS, 1, broken)
    with pytest.raises(StateError):
        Store(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("1",)
    assert db.execute("SELECT count(*) FROM replicas").fetchone() == (1,)
    assert db.execute("SELECT reason FROM cordons").fetchone() == ("fan failing",)
    db.close()


def test_reserving_moves_the_version_and_observing_does_not(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        v0 = s.version()
        booked = s.reserve([ReplicaRecord(_rep(), port=8100)], expect_version=v0)
        assert booked.version == v0 + 1 == s.version()
        (rec,) = booked.records
        assert (rec.generation, rec.revision) == (1, 1)
        run = ShardRun("gpu-01", "~/.clusterctl/run/m-0.g1", "tok", pid=42, start_time=1234)
        rec = s.observe(replace(rec, status=STARTING, shards=(run,)))
        rec = s.observe(replace(rec, status=READY, endpoint="http://h:8100"))
        assert s.version() == v0 + 1 and rec.revision == 3
        (got,) = s.records()
        assert (got.status, got.shards, got.endpoint, got.revision) == (READY, (run,), "http://h:8100", 3)
        with pytest.raises(StaleVersion):
            s.reserve([ReplicaRecord(_rep("other", 0, "gpu-02"), port=8100)], expect_version=v0)
        assert len(s.records()) == 1
        s.release(got, wanted_down=True)
        assert s.records() == [] and s.records(include_down=True)[0].desired == "down"
        assert s.version() == v0 + 2 and s.replicas() == []  # wanted down: holds no GPU


def test_of_two_runs_that_take_one_replica_over_one_gets_it(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        (rec,) = s.reserve([ReplicaRecord(_rep(), port=8100)]).records
        s.observe(replace(rec, status=READY))
        (seen,) = s.records()
        mine = s.claim(seen, replace(seen, status=UNHEALTHY, owner="run-a", restarts=1))
        assert mine is not None and mine.revision == seen.revision + 1
        assert s.claim(seen, replace(seen, status=UNHEALTHY, owner="run-b", restarts=1)) is None
        (got,) = s.records()
        assert (got.status, got.owner, got.restarts) == (UNHEALTHY, "run-a", 1)
        assert s.claim(got, replace(got, status=STARTING)) is not None  # read again, it can be taken on
        assert s.records()[0].owner == "run-a"


def test_a_gpu_or_port_held_by_another_replica_is_refused_and_nothing_is_booked(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.reserve([ReplicaRecord(_rep("a"), port=8100)])
        v = s.version()
        with pytest.raises(StateError, match="GPU 1 is already held by a/0"):
            s.reserve([ReplicaRecord(_rep("b", gpus=(1, 2)), port=8101), ReplicaRecord(_rep("c", node="x"), port=1)])
        with pytest.raises(StateError, match="port 8100 is already held by a/0"):
            s.reserve([ReplicaRecord(_rep("d", gpus=(5,)), port=8100)])
        assert [r.name for r in s.records()] == ["a/0"] and s.version() == v
        assert s.held_ports("gpu-01") == {8100}


def test_a_replica_placed_anew_gets_its_earlier_gpus_only_once_that_one_is_released(tmp_path: Path) -> None:
    """Placed anew (its profile changed): a second generation. The GPUs it reuses stay the
    first's until the first is stopped and released; held by any other replica, a GPU is
    refused all the same."""
    with Store(tmp_path / "s.db") as s:
        old, _ = s.reserve(
            [ReplicaRecord(_rep(gpus=(0, 1)), port=8100), ReplicaRecord(_rep("o", gpus=(4,)), port=8200)]
        ).records
        new = ReplicaRecord(_rep(gpus=(1, 2)), port=8101)
        with pytest.raises(StateError, match="GPU 1 is already held by m/0"):
            s.reserve([new])
        assert [r.key for r in s.records()] == [("m", 0, 1), ("o", 0, 1)]
        s.release(old)  # stopped, confirmed
        (got,) = s.reserve([new]).records
        assert got.key == ("m", 0, 2)
        with pytest.raises(StateError, match="GPU 4 is already held by o/0"):
            s.reserve([ReplicaRecord(_rep("z", gpus=(3, 4)), port=8300)])
        assert s.held_ports("gpu-01") == {8101, 8200}
        s.reserve([ReplicaRecord(_rep("z", gpus=(0,)), port=8300)])  # released with the first


def test_a_gpu_held_by_index_and_the_same_gpu_by_uuid_are_one_gpu(tmp_path: Path) -> None:
    """A hold made while its UUID was unknown (a migrated one) is the device at that index:
    the same GPU booked later by its UUID is refused, and the other way round."""
    with Store(tmp_path / "s.db") as s:
        s.reserve([ReplicaRecord(_rep("a", gpus=(0,)), port=1)])  # no facts: by index
        g = Gpu(index=0, uuid="GPU-x", product="NVIDIA H100", gpu_class="H100")
        s.save_discovery([NodeFacts("gpu-01", host="h", gpus=(g,), probed_at=1.0)])
        with pytest.raises(StateError, match="GPU 0 is already held by a/0"):
            s.reserve([ReplicaRecord(_rep("b", gpus=(0,)), port=2)])
    with Store(tmp_path / "t.db") as s:
        g1 = Gpu(index=1, uuid="GPU-y", product="NVIDIA H100", gpu_class="H100")
        s.save_discovery([NodeFacts("gpu-01", host="h", gpus=(g1,), probed_at=1.0)])
        s.reserve([ReplicaRecord(_rep("a", gpus=(1,)), port=1)])  # by UUID
        s.save_discovery([NodeFacts("gpu-01", host="h", probed_at=2.0)])  # nvidia-smi lists nothing now
        with pytest.raises(StateError, match="GPU 1 is already held by a/0"):
            s.reserve([ReplicaRecord(_rep("b", gpus=(1,)), port=2)])  # by index: in doubt, the same


def test_two_processes_reserving_the_same_gpu_at_once_book_it_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    Store(path).close()
    barrier = threading.Barrier(2)
    results: list[str] = []

    def one(model: str) -> None:
        with Store(path) as s:
            barrier.wait()
            try:
                s.reserve([ReplicaRecord(_rep(model, gpus=(3,)), port=9000 + len(model))])
                results.append("ok")
            except StateError as e:
                results.append(str(e))

    threads = [threading.Thread(target=one, args=(m,)) for m in ("a", "bb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(r == "ok" for r in results) == [False, True], results
    with Store(path) as s:
        assert len(s.records()) == 1


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(st.sampled_from(["reserve", "release", "down"]), st.sampled_from("abc"), st.sets(st.integers(0, 3))),
        max_size=12,
    )
)
def test_holds_never_give_one_gpu_to_two_replicas(tmp_path_factory, ops) -> None:
    """Any sequence of reservations and releases: every GPU is held by one replica at most,
    and exactly the GPUs of the replicas recorded up are held."""
    path = tmp_path_factory.mktemp("s") / "s.db"
    with Store(path) as s:
        for op, model, gpus in ops:
            recs = {r.replica.model: r for r in s.records()}
            if op == "reserve" and model not in recs and gpus:
                rep = Replica(model, 0, "p", "vllm", (Shard("n", tuple(sorted(gpus))),), gpu_class="H100")
                with contextlib.suppress(StateError):  # a GPU another one holds: refused whole
                    s.reserve([ReplicaRecord(rep)])
            elif op in ("release", "down") and model in recs:
                s.release(recs[model], wanted_down=op == "down")
        held = s._b._db.execute("SELECT item, model FROM holds WHERE kind='gpu'").fetchall()  # one node: index = GPU
        assert len(held) == len({g for g, _ in held})
        want = {(g, r.replica.model) for r in s.records() for sh in r.replica.shards for g in sh.gpus}
        assert set(held) == want
