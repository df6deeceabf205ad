"""State store: transactions, cordons surviving discovery, concurrent writers."""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ctrl_c_while_locked

from cluster_cli.errors import StateError
from cluster_cli.facts import Gpu, NodeFacts, Replica, Shard
from cluster_cli.state.launches import StaleRecord
from cluster_cli.state.records import ReplicaRecord
from cluster_cli.state.store import Store


def node(name: str, **kw: object) -> NodeFacts:
    g = Gpu(index=0, uuid=f"GPU-{name}", product="NVIDIA H100 PCIe", gpu_class="H100", memory_total_mib=81559)
    return NodeFacts(name=name, host="198.18.0.10", cpus=8, memory_mib=1024, gpus=(g,), nvlink_domains=(), **kw)  # type: ignore[arg-type]


def test_discovery_never_clears_a_cordon(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([node("a"), node("b")])
        s.cordon("a", "bad fan")
        s.save_discovery([node("a"), node("b")])
        by = {f.name: f for f in s.nodes()}
        assert by["a"].cordoned and by["a"].cordon_reason == "bad fan"
        assert not by["b"].cordoned
        assert s.uncordon("a") is True
        assert s.uncordon("a") is False
        assert not any(f.cordoned for f in s.nodes())


def test_unreachable_keeps_last_known_hardware(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([node("a", probed_at=100.0)])
        for t in (200.0, 300.0):
            s.save_discovery([NodeFacts(name="a", host="198.18.0.10", reachable=False, error="refused", probed_at=t)])
        (f,) = s.nodes()
        assert not f.reachable and f.error == "refused"
        assert len(f.gpus) == 1 and f.cpus == 8
        assert (f.probed_at, f.last_seen_at) == (300.0, 100.0)  # when it last answered, not the last attempt
        d = f.to_dict()
        assert d["last_seen_at"] == 100.0 and [g["free"] for g in d["gpus"]] == [False]  # none free while away
        assert f.gpus[0].free  # the GPU itself was free when last seen: back when the node answers again
        s.save_discovery([node("a", probed_at=400.0)])
        assert s.nodes()[0].to_dict()["last_seen_at"] == 400.0 and s.nodes()[0].to_dict()["gpus"][0]["free"]


def test_versions_and_replicas_released_whole(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        v0 = s.version()
        a = Replica("m", 0, "p", "vllm", (Shard("a", (0, 1), ("mlx5_0",)), Shard("b", (0, 1), ("mlx5_0",))), "ib-a")
        b = Replica("m", 1, "p", "vllm", (Shard("c", (0, 1, 2, 3), ("mlx5_0", "mlx5_1")), Shard("d", (4, 5))), "ib-a")
        ra, rb = s.reserve([ReplicaRecord(a, port=8100), ReplicaRecord(b, port=8100)]).records
        v1 = s.version()
        assert v1 > v0
        assert s.replicas() == [a, b]  # shards, GPUs and HCAs as placed, read back from their own rows
        s.observe(replace(ra, status="starting", endpoint="http://a:1", detail="pulling"))
        assert s.version() == v1  # observed, not desired: no new version
        assert [(r.replica, r.status, r.endpoint, r.detail) for r in s.records()] == [
            (a, "starting", "http://a:1", "pulling"),
            (b, "planned", None, None),
        ]
        assert s.release(s.records()[0]) is None  # whole: its row, shards and holds at once
        assert s.version() > v1
        assert s.replicas() == [b] and [r.key for r in s.records()] == [rb.key]
        ev = s.events(1)[-1]
        assert (ev.kind, ev.name, ev.generation, ev.message) == ("released", "m/0", 1, "m/0 released")
        with pytest.raises(StaleRecord):  # nothing left to release: refused, not a silent no-op
            s.release(ra)
    with Store(tmp_path / "s.db") as s:  # and it is all on disk
        assert s.replicas() == [b]


def _cordon_many(path: str, prefix: str, n: int) -> None:
    with Store(path) as s:
        for i in range(n):
            s.cordon(f"{prefix}{i}", "r")


def _discover_many(path: str, n: int) -> None:
    with Store(path) as s:
        for _ in range(n):
            s.save_discovery([node(f"n{i}") for i in range(20)])


@pytest.mark.slow
def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    Store(path).close()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_cordon_many, args=(path, "x", 40)),
        ctx.Process(target=_cordon_many, args=(path, "y", 40)),
        ctx.Process(target=_discover_many, args=(path, 15)),
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with Store(path) as s:
        assert len(s.cordons()) == 80
        assert len(s.nodes()) == 20


def test_a_locked_database_is_a_one_line_state_error(tmp_path: Path) -> None:
    import sqlite3

    import pytest

    from cluster_cli.errors import StateError

    path = tmp_path / "s.db"
    Store(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another clusterctl holds the write lock
    try:
        with (
            pytest.raises(StateError, match="cannot write the state: database is locked"),
            Store(path, timeout_s=0.2) as s,
        ):
            s.cordon("a", "r")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with Store(path) as s:
        assert s.cordons() == {}  # nothing half-written


def test_a_readonly_handle_reads_and_refuses_to_write(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with pytest.raises(StateError, match="no state yet"):
        Store(path, readonly=True)
    assert not path.exists()
    with Store(path) as s:
        s.save_discovery([node("a")])
    with Store(path, readonly=True) as ro:
        assert [f.name for f in ro.nodes()] == ["a"]
        with pytest.raises(StateError):
            ro.cordon("a", "x")
    with Store(path) as s:
        assert s.cordons() == {}
    (tmp_path / "junk.db").write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(StateError, match="not a usable state database"):
        Store(tmp_path / "junk.db", readonly=True)


def test_an_older_probe_never_replaces_newer_facts(tmp_path: Path) -> None:
    # Two discovers overlap: the one that probed later finishes first.
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([NodeFacts(name="a", host="h", cpus=64, probed_at=200.0)])
        s.save_discovery([NodeFacts(name="a", host="h", cpus=32, probed_at=100.0)])
        assert s.nodes(["a"])[0].cpus == 64
        s.save_discovery([NodeFacts(name="a", host="h", cpus=16, probed_at=300.0)])
        assert s.nodes(["a"])[0].cpus == 16


def test_newest_observation_wins_when_one_of_them_is_unreachable(tmp_path: Path) -> None:
    lost = dict(reachable=False, error="connect timed out")
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([NodeFacts(name="a", host="h", cpus=64, probed_at=100.0)])
        s.save_discovery([NodeFacts(name="a", host="h", probed_at=300.0, **lost)])
        s.save_discovery([NodeFacts(name="a", host="h", cpus=32, probed_at=200.0)])  # older, finished last
        (a,) = s.nodes(["a"])
        assert (a.reachable, a.error, a.probed_at, a.cpus) == (False, "connect timed out", 300.0, 64)
    with Store(tmp_path / "t.db") as s:
        s.save_discovery([NodeFacts(name="a", host="h", cpus=64, probed_at=300.0)])
        s.save_discovery([NodeFacts(name="a", host="h", probed_at=200.0, **lost)])  # an older silence
        (a,) = s.nodes(["a"])
        assert (a.reachable, a.error, a.probed_at, a.cpus) == (True, None, 300.0, 64)


def test_reads_in_a_snapshot_see_one_state_version(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path) as w:
        w.save_discovery([NodeFacts(name="a", host="h", cpus=8, probed_at=1.0)])
    reader = Store(path, readonly=True)
    try:
        with reader.snapshot():
            v = reader.version()
            with Store(path) as w:  # an operator's cordon lands in the middle of a plan's reads
                w.cordon("a", "disk")
            assert [n.cordoned for n in reader.nodes()] == [False]
            assert reader.cordons() == {} and reader.version() == v
        assert reader.version() > v and reader.nodes()[0].cordoned
    finally:
        reader.close()


def test_an_unreadable_row_is_a_located_error_and_a_new_discover_replaces_it(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "s.db"
    with Store(path) as s:
        s.save_discovery([NodeFacts(name="a", host="h", cpus=8, probed_at=1.0), NodeFacts(name="b", host="g")])
    db = sqlite3.connect(path)
    db.execute("""UPDATE nodes SET facts='{"name": "a", "gpus": [{"uuid": 1}]}' WHERE name='a'""")
    db.commit()
    db.close()
    with Store(path) as s:
        with pytest.raises(StateError, match=r"s\.db: node a: unreadable facts"):
            s.nodes()
        # The node is unreachable this time: its unreadable old facts are dropped, not kept.
        s.save_discovery([NodeFacts(name="a", host="h", reachable=False, error="timeout", probed_at=2.0)])
        (a, _b) = s.nodes()
        assert (a.reachable, a.error, a.cpus, a.gpus) == (False, "timeout", None, ())


def test_cordon_returns_the_cordon_it_replaced(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        assert s.cordon("a", "fan") is None
        first = s.cordons()["a"]
        assert s.cordon("a", "psu") == first == {"reason": "fan", "created_at": first["created_at"]}
        assert s.cordons()["a"] == {"reason": "psu", "created_at": first["created_at"]}
        assert s.events(1)[-1].message == "psu (was: fan)"


def _exclusive_writer(path: Path) -> sqlite3.Connection:
    """A connection that committed a cordon into the WAL and keeps the database to itself
    (locking_mode=EXCLUSIVE: no -shm, no checkpoint until it closes)."""
    w = sqlite3.connect(path, isolation_level=None)
    w.execute("PRAGMA locking_mode=EXCLUSIVE")
    w.execute("INSERT INTO cordons VALUES ('a', 'fan', 1)")
    return w


def test_a_locked_state_is_an_error_not_a_snapshot_that_misses_commits(tmp_path: Path) -> None:
    Store(tmp_path / "s.db").close()
    w = _exclusive_writer(tmp_path / "s.db")
    try:
        assert (tmp_path / "s.db-wal").stat().st_size > 0  # the cordon is committed, in the WAL only
        with pytest.raises(StateError, match=r"s\.db: cannot read the state: database is locked"):
            Store(tmp_path / "s.db", readonly=True, timeout_s=0.1)
    finally:
        w.close()
    with Store(tmp_path / "s.db", readonly=True) as s:
        assert "a" in s.cordons()


def _unwritable_folder(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """As if the state's folder were not ours to write: SQLite cannot make the -shm file there."""
    real = sqlite3.connect

    def connect(database: str, *a: object, **kw: object) -> sqlite3.Connection:
        if "mode=ro" in str(database) and "immutable=1" not in str(database):
            e = sqlite3.OperationalError("unable to open database file")
            e.sqlite_errorcode = code  # type: ignore[attr-defined]
            raise e
        return real(database, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite3, "connect", connect)
    monkeypatch.setattr(os, "access", lambda p, mode: False)


def test_an_unwritable_folder_is_read_as_a_snapshot_only_when_the_wal_is_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store(tmp_path / "s.db") as s:
        s.cordon("b", "psu")
    assert not (tmp_path / "s.db-wal").exists()  # the last close folded the WAL in
    leftover = tmp_path / "crashed"
    leftover.mkdir()
    Store(leftover / "s.db").close()
    w = _exclusive_writer(leftover / "s.db")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("s.db", "s.db-wal"):  # what a writer that died leaves behind
        (copy / name).write_bytes((leftover / name).read_bytes())
    w.close()
    _unwritable_folder(monkeypatch, 1544)  # SQLITE_READONLY_DIRECTORY
    with Store(tmp_path / "s.db", readonly=True) as s:
        assert set(s.cordons()) == {"b"}
    with pytest.raises(StateError, match=r"copy/s\.db-wal holds changes not yet in the database"):
        Store(copy / "s.db", readonly=True)
    _unwritable_folder(monkeypatch, 5)  # SQLITE_BUSY: never a snapshot
    with pytest.raises(StateError, match="cannot read the state"):
        Store(tmp_path / "s.db", readonly=True)


def test_a_full_disk_is_a_one_line_state_error_and_loses_nothing(tmp_path: Path) -> None:
    """SQLite rolls a transaction back by itself when the disk fills up: the store must not
    ROLLBACK a second time (that error, "no transaction is active", hid the real one)."""
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.cordon("a", "first")
        version = s.version()
        # A database that may not grow (what a full disk does to it); WAL pages count too.
        s._b._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = s._b._db.execute("PRAGMA page_count").fetchone()[0]
        s._b._db.execute(f"PRAGMA max_page_count={pages}")
        with pytest.raises(StateError, match=r"s\.db: cannot write the state: database or disk is full"):
            s.cordon("b", "x" * 200_000)
        assert s.version() == version  # nothing half-written
    with Store(path) as s:
        assert set(s.cordons()) == {"a"}


def test_a_database_that_is_not_a_state_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE users(id)")
    db.commit()
    db.close()
    with pytest.raises(StateError, match=r"other\.db: not a clusterctl state database"):
        Store(path)
    db = sqlite3.connect(path)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    mode = db.execute("PRAGMA journal_mode").fetchone()[0]
    db.close()
    assert (tables, mode) == ({"users"}, "delete")  # no tables added, not switched to WAL
    # An empty file (as `touch` leaves it) is a new state, as a missing one is.
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(StateError, match=r"empty\.db: an empty state, nothing recorded yet"):
        Store(empty, readonly=True)  # to read, it says so (it said "no such table: meta")
    with Store(empty) as s:
        assert s.version() == 0


@pytest.mark.parametrize("readonly", [False, True])
def test_a_schema_version_that_is_not_a_number_is_a_state_error(tmp_path: Path, readonly: bool) -> None:
    path = tmp_path / "s.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='1.0' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(StateError, match=r"s\.db: not a usable state database \(schema version '1.0'\)"):
        Store(path, readonly=readonly)


def test_discover_replaces_an_unreadable_row_and_warns_of_one_it_did_not_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored row that cannot be read must not make every later discover fail (its error
    advised a fresh state, losing every cordon), nor a --node run exit 2 after saving."""
    from typer.testing import CliRunner

    import cluster_cli.probe.collect as collect
    from cluster_cli.cli.main import app

    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "defaults: {known_hosts: accept-new}\nnodes:\n  - {name: n1, host: 198.18.0.11}\n  - {name: n2, host: 198.18.0.12}\n"
    )
    state = tmp_path / "s.db"
    cpus = {"n1": 8, "n2": 4}

    async def probed(inv, nodes, *, on_done, **_kw):  # type: ignore[no-untyped-def]
        out = [NodeFacts(name=n.name, host=n.host, cpus=cpus[n.name], memory_mib=1024) for n in nodes]
        for f in out:
            on_done(f)
        return out

    monkeypatch.setattr(collect, "discover", probed)
    run = CliRunner().invoke
    assert run(app, ["--state", str(state), "discover", "-i", str(inv)]).exit_code == 0
    with Store(state) as s:
        s.cordon("n2", "keep me")

    def spoil(name: str) -> None:
        db = sqlite3.connect(state)
        db.execute("""UPDATE nodes SET facts='{"name": "x", "gpus": [{"uuid": 1}]}' WHERE name=?""", (name,))
        db.commit()
        db.close()

    spoil("n1")
    cpus["n1"] = 16
    r = run(app, ["--state", str(state), "discover", "-i", str(inv)])
    assert r.exit_code == 0, r.output
    with Store(state) as s:
        assert {f.name: f.cpus for f in s.nodes()} == {"n1": 16, "n2": 4}
        assert set(s.cordons()) == {"n2"}
    # --node n2 with n1's row unreadable: n2 is saved, exit 0, and n1 is named in a warning.
    spoil("n1")
    cpus["n2"] = 64
    r = run(app, ["--state", str(state), "discover", "-i", str(inv), "--node", "n2"])
    assert r.exit_code == 0, r.output
    assert "node n1: its stored facts cannot be read" in r.output
    with Store(state) as s:
        assert [f.cpus for f in s.nodes(["n2"])] == [64]


def test_a_full_disk_reads_as_a_full_disk_not_a_damaged_state(tmp_path: Path) -> None:
    """Reading a WAL state needs room for its -shm file: on a full disk that is an I/O error,
    said as one, not "not a usable state database" (which sends one looking for damage)."""
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        path = mnt / "s.db"
        with Store(path) as s:
            s.cordon("a", "x")
        subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'fill'}", "bs=4k"], capture_output=True, check=False)
        for suffix in ("-shm", "-wal"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        with pytest.raises(StateError) as e:
            Store(path, readonly=True)
        assert str(e.value).startswith(f"{path}: cannot read the state: ") and "usable" not in str(e.value)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.slow
def test_ctrl_c_ends_a_command_waiting_for_the_write_lock_at_once(tmp_path: Path) -> None:
    """SQLite's own busy wait sleeps in C for the whole 30-s timeout, out of Ctrl-C's reach.
    (SIGTERM's default action ends the process anyway; nothing is committed either way.)"""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("nodes:\n  - {name: gpu-01, host: h}\n")
    path = tmp_path / "s.db"
    Store(path).close()
    rc, out, err, took = ctrl_c_while_locked(path, "cordon", "gpu-01", "-i", str(inv), "--reason", "r")
    assert rc == 130, (out, err)
    assert "Traceback" not in err, err
    assert took < 5, took
    with Store(path) as s:
        assert s.cordons() == {}


def test_noop_cordon_changes_do_not_bump_the_version(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        v0 = s.version()
        assert s.uncordon("h1") is False
        assert s.uncordon("h1") is False
        assert s.version() == v0
        assert s.cordon("h1", "fan") is None
        v1 = s.version()
        assert v1 == v0 + 1
        assert s.cordon("h1", "fan") == {"reason": "fan", "created_at": s.cordons()["h1"]["created_at"]}
        assert s.version() == v1
        s.cordon("h1", "psu")  # a new reason is a change
        assert s.version() == v1 + 1
        assert s.uncordon("h1") is True
        assert s.version() == v1 + 2


def test_an_unreachable_node_takes_its_new_host_labels_and_fabric_from_the_inventory(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([NodeFacts(name="n1", host="10.0.0.1", cpus=8, labels={"rack": "r1"}, fabric="ib-a")])
        s.save_discovery(
            [
                NodeFacts(
                    name="n1", host="10.0.0.9", reachable=False, error="refused", labels={"rack": "r7"}, fabric="ib-b"
                )
            ]
        )
        (n,) = s.nodes()
    assert (n.host, n.labels, n.fabric, n.reachable, n.cpus) == ("10.0.0.9", {"rack": "r7"}, "ib-b", False, 8)
