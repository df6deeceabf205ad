#!/usr/bin/env python3
"""State store benchmark: the schema-3 store of this checkout against the landed one, side by side.

The baseline is the store as landed before the rewrite (``--baseline``, default commit
``4767b59``, schema 2): its ``cluster_cli`` is extracted with ``git archive`` into a temporary
folder and imported in its own worker process (``PYTHONPATH`` = that folder); the new store
is imported from this checkout in a second worker. Both workers run on this machine at the
same time, driven by this script, one request at a time: every measure is taken in
``--repeat`` interleaved rounds (old then new, new then old in the next round, ...), and the
tables show the best and the median of the rounds, and the ratio new/old of the best.

1. **State writes per second.** A fresh state file on local disk per run (a temp folder
   under ``--work``): a fleet of ``dgx`` nodes (``tests/helpers.py``, 8 GPUs each) saved, and
   ``--write-replicas`` single-GPU replicas reserved and recorded as starting with their
   shards (run dir, token, pid, start time; not timed). Timed: (a) ``--observes`` observed-state
   writes, one ``observe`` call each, the status flipping ready/unhealthy on one replica after
   another (the new store is given back the record each call returned, so no write is
   stale); (b) ``--pairs`` cordon/uncordon pairs on node after node. Writes per second.
2. **One reconcile-sized read.** A state of ``--read-nodes`` ``dgx`` nodes (8 GPUs each) and
   ``--read-replicas`` replicas reserved across them (80% single-GPU, 12% TP-4, 8% TP-8),
   every shard recorded as started, built once per store (not timed). Timed: reading every
   replica and node in one snapshot, new ``Store.plan_view()`` against old
   ``with s.snapshot(): s.nodes(); s.records(); s.version()``.
3. **The event loop's longest stall while another process holds the write lock.** A second
   process opens the state with plain ``sqlite3``, runs ``BEGIN IMMEDIATE``, holds it for
   ``--hold`` seconds and rolls back. Meanwhile an asyncio loop runs a ticker (sleep 5 ms,
   record how late each wake-up is) and, after 100 ms, makes one state write (a cordon):
   (a) a synchronous store call on the loop thread, as the commands do today (old store, and
   the new ``Store`` called directly), (b) ``await astore.cordon(...)`` through the new
   ``AsyncStore``. The longest stall of the ticker, and how long the write took (it waits for
   the lock; ``timeout_s`` is long enough that it never fails). ``--stall-rounds`` rounds.
4. **AsyncStore's overhead per call.** ``--calls`` calls of ``store.version()`` direct against
   ``await astore.version()`` (new store; the old store's direct call for reference), in
   microseconds per call.
5. **A database thread or an async driver** (the store's design question; when ``aiosqlite``
   imports, unless ``--no-aiosqlite``). In the new store's worker, on one state file of 8
   nodes, ``--repeat`` rounds, the contenders' order turned each round: (a) a small read,
   ``await astore.version()`` against the same SELECT through aiosqlite (``BEGIN``, select,
   ``COMMIT``: an await per statement), the same through a plain ``sqlite3`` connection in
   ``asyncio.to_thread``, and the direct ``store.version()``; (b) a small write, ``--aio-pairs``
   cordon/uncordon pairs: ``await astore.cordon(...)`` / ``uncordon(...)`` against the SQL of
   the same transactions (``Store.cordon``/``uncordon``: ``BEGIN IMMEDIATE``, the schema check,
   the cordon's read, insert or delete, the version bump, the event, ``COMMIT``) through
   aiosqlite, through ``sqlite3`` in ``asyncio.to_thread`` (one thread hop a transaction, no
   store code), and the direct store calls; microseconds per call (a read, or one
   transaction). (c) Measure 3's stall for one cordon made through aiosqlite (its busy
   timeout longer than the hold) beside ``AsyncStore``'s, ``--aio-stall-rounds`` rounds.

    python bench/state.py                   # the default sizes: about 70 s on 2 cores
    python bench/state.py --quick           # a smoke run of a few seconds
    python bench/state.py --repeat 7 --read-nodes 2000 --read-replicas 8000 --hold 3
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "4767b59"

# The second process of measure 3: the write lock held for a while, then given up.
LOCKER = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("ROLLBACK")
db.close()
"""

# Measure 5: the SQL of the store's calls, for a connection of another driver. Kept equal to
# Store.version (the snapshot's schema read is left out: the read is one SELECT here), and to
# Store._tx + Store.cordon / Store.uncordon + store._bump + EventLog._event.
SQL_SCHEMA = "SELECT value FROM meta WHERE key='schema_version'"
SQL_VERSION = "SELECT value FROM meta WHERE key='state_version'"
SQL_CORDON_ROW = "SELECT reason, created_at FROM cordons WHERE node=?"
SQL_BUMP = "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE key = 'state_version'"
SQL_CORDON = (
    "INSERT INTO cordons(node, reason, created_at) VALUES (?,?,?) "
    "ON CONFLICT (node) DO UPDATE SET reason=excluded.reason"
)
SQL_UNCORDON = "DELETE FROM cordons WHERE node=?"
SQL_EVENT = (
    "INSERT INTO events(at, kind, node, model, replica, generation, actor, message, detail) VALUES (?,?,?,?,?,?,?,?,?)"
)
# The store's connection settings (cluster_cli/state/sqlite.py), per connection.
SQL_PRAGMAS = ("PRAGMA synchronous=NORMAL", "PRAGMA foreign_keys=ON")
ACTOR = "bench"


# --------------------------------------------------------------------------- worker (one per store)
class Worker:
    """Runs in a subprocess with one store version importable; answers one request a line."""

    def __init__(self, side: str, work: Path) -> None:
        import cluster_cli
        from cluster_cli.facts import Replica, Shard
        from cluster_cli.state import records, store

        self.side = side
        self.work = work
        self.pkg = str(Path(cluster_cli.__file__).resolve().parent)
        self.Store = store.Store
        self.Replica, self.Shard = Replica, Shard
        self.ReplicaRecord, self.ShardRun = records.ReplicaRecord, records.ShardRun
        self.new = hasattr(store.Store, "plan_view")
        spec = importlib.util.spec_from_file_location("bench_helpers", ROOT / "tests" / "helpers.py")
        assert spec is not None and spec.loader is not None
        self.helpers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.helpers)
        self.read_path: Path | None = None
        self.small = self._small_state()
        self.driver_path: Path | None = None

    def hello(self) -> dict[str, Any]:
        from cluster_cli.state.schema import SCHEMA_VERSION

        try:
            import aiosqlite
        except ImportError:
            aio = None
        else:
            aio = getattr(aiosqlite, "__version__", "?")
        return {"package": self.pkg, "schema": SCHEMA_VERSION, "new": self.new, "aiosqlite": aio}

    # ---- building states (never timed) --------------------------------------
    def _fleet(self, n: int, prefix: str = "node") -> list[Any]:
        return [self.helpers.dgx(f"{prefix}-{i:05d}", fabric=f"ib-{i % 4}") for i in range(n)]

    def _open(self, path: Path, **kw: Any) -> Any:
        return self.Store(path, **kw)

    def _started(self, rec: Any, status: str, i: int) -> Any:
        """``rec`` as a launch records it once its processes run: a run dir, token, PID and
        start time per shard, an endpoint."""
        r = rec.replica
        runs = tuple(
            self.ShardRun(
                s.node,
                f"~/.clusterctl/run/{r.model}-{r.replica}-g{rec.generation}",
                f"tok-{r.model}-{r.replica}-{rank}-{i:06d}",
                pid=40_000 + (i * 8 + rank) % 20_000,
                start_time=1_234_567 + i,
                gpu_uuids=tuple(f"GPU-{s.node}-{g}" for g in s.gpus),
            )
            for rank, s in enumerate(r.shards)
        )
        return replace(
            rec,
            status=status,
            shards=runs,
            endpoint=f"http://{r.shards[0].node}:{rec.port}",
            started_at=1_700_000_000.0 + i,
        )

    def _reserve_started(self, s: Any, recs: list[Any]) -> list[Any]:
        """Reserve ``recs`` and record them started; the records as stored (new: with their
        generation and revision)."""
        if not self.new:  # the old store records what it is given, runtime included
            recs = [self._started(rec, "starting", i) for i, rec in enumerate(recs)]
            s.reserve(recs)
            return recs
        booked = s.reserve(recs).records
        with s.write():  # one transaction for the lot (observe nests in it)
            return [s.observe(self._started(rec, "starting", i)) for i, rec in enumerate(booked)]

    def _small_state(self) -> Path:
        path = self.work / "small.db"
        with self._open(path) as s:
            s.save_discovery(self._fleet(8))
        return path

    # ---- 1. writes per second -----------------------------------------------
    def writes(self, replicas: int, observes: int, pairs: int) -> dict[str, Any]:
        folder = Path(tempfile.mkdtemp(prefix="writes-", dir=self.work))
        try:
            nodes = self._fleet(max(1, -(-replicas // 8)))
            recs = [
                self.ReplicaRecord(
                    self.Replica("m", i, "h100-1x1", "vllm", (self.Shard(nodes[i // 8].name, (i % 8,)),), "ib-0"),
                    port=8100 + i % 8,
                )
                for i in range(replicas)
            ]
            with self._open(folder / "state.db") as s:
                s.save_discovery(nodes)
                cur = self._reserve_started(s, recs)
                flips = [
                    (k, "ready" if (i // replicas) % 2 == 0 else "unhealthy")
                    for i, k in enumerate(self._cycle(observes, replicas))
                ]
                t0 = time.perf_counter()
                if self.new:
                    for k, status in flips:
                        cur[k] = s.observe(
                            replace(cur[k], status=status, detail=None if status == "ready" else "health check failed")
                        )
                else:
                    for k, status in flips:
                        rec = replace(
                            cur[k], status=status, detail=None if status == "ready" else "health check failed"
                        )
                        s.observe(rec)
                        cur[k] = rec
                observe_s = time.perf_counter() - t0
                names = [nodes[i % len(nodes)].name for i in range(pairs)]
                t0 = time.perf_counter()
                for name in names:
                    s.cordon(name, "bench: drain")
                    s.uncordon(name)
                cordon_s = time.perf_counter() - t0
                states = sorted({r.status for r in s.records()})
                left = len(s.cordons())
            return {
                "observe_s": observe_s,
                "observe_n": len(flips),
                "cordon_s": cordon_s,
                "cordon_n": 2 * pairs,
                "statuses": states,
                "cordons_left": left,
            }
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _cycle(n: int, size: int) -> list[int]:
        return [i % size for i in range(n)]

    # ---- 2. one reconcile-sized read ----------------------------------------
    def build_read(self, nodes: int, replicas: int) -> dict[str, Any]:
        path = self.work / "read.db"
        t0 = time.perf_counter()
        fleet = self._fleet(nodes)
        recs = _reconcile_replicas(self, [f.name for f in fleet], replicas)
        with self._open(path) as s:
            s.save_discovery(fleet)
            for i in range(0, len(recs), 500):
                self._reserve_started(s, recs[i : i + 500])
            for f in fleet[:: max(1, nodes // 20)]:  # a few cordons, as a fleet has
                s.cordon(f.name, "bench: maintenance")
        self.read_path = path
        return {"build_s": time.perf_counter() - t0, "size_mib": path.stat().st_size / 2**20, "gpus": _gpus(recs)}

    def read(self) -> dict[str, Any]:
        assert self.read_path is not None
        with self._open(self.read_path) as s:
            t0 = time.perf_counter()
            if self.new:
                view = s.plan_view()
                nodes, recs, version = view.nodes, view.records, view.version
            else:
                with s.snapshot():
                    nodes, recs, version = s.nodes(), s.records(), s.version()
            took = time.perf_counter() - t0
        shards = sum(len(r.shards) for r in recs)
        return {"read_s": took, "nodes": len(nodes), "replicas": len(recs), "shards": shards, "version": version}

    # ---- 3. the loop's longest stall ------------------------------------------
    def stall(self, hold_s: float, mode: str, seq: int) -> dict[str, Any]:
        with self._open(self.small, timeout_s=hold_s + 60) as s:
            locker = subprocess.Popen(
                [sys.executable, "-c", LOCKER, str(self.small), str(hold_s)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert locker.stdout is not None
                if locker.stdout.readline().strip() != "locked":
                    raise RuntimeError("the locking process did not take the write lock")
                t_locked = time.perf_counter()
                out = asyncio.run(
                    self._stall_loop(s, mode, f"node-{seq % 8:05d}", f"bench stall {seq}", timeout_s=hold_s + 60)
                )
                out["lock_to_done_s"] = time.perf_counter() - t_locked
            finally:
                locker.wait(timeout=hold_s + 30)
            out["cordoned"] = s.cordons().get(f"node-{seq % 8:05d}", {}).get("reason") == f"bench stall {seq}"
        return out

    async def _stall_loop(self, s: Any, mode: str, node: str, reason: str, timeout_s: float) -> dict[str, Any]:
        late: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                late.append(time.perf_counter() - t0 - 0.005)

        astore = None
        if mode == "async":
            from cluster_cli.state.aio import AsyncStore

            astore = AsyncStore(s)
        db = await _aio_open(s.path, timeout_s) if mode == "aiosqlite" else None
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        if astore is not None:
            await astore.cordon(node, reason)
        elif db is not None:
            await _aio_cordon(db, node, reason)  # BEGIN IMMEDIATE waits in SQLite's busy handler, on aiosqlite's thread
        else:
            s.cordon(node, reason)  # on the loop's thread, as a command's coroutine calls it today
        write_s = time.perf_counter() - t0
        await asyncio.sleep(0.1)
        done.set()
        await tick
        if astore is not None:
            await astore.aclose()
        if db is not None:
            await db.close()
        return {"max_late_s": max(late), "p50_late_s": statistics.median(late), "ticks": len(late), "write_s": write_s}

    # ---- 4. AsyncStore's overhead per call ------------------------------------
    def overhead(self, calls: int) -> dict[str, Any]:
        with self._open(self.small) as s:
            s.version()
            t0 = time.perf_counter()
            for _ in range(calls):
                s.version()
            direct = (time.perf_counter() - t0) / calls
            out: dict[str, Any] = {"direct_us": direct * 1e6}
            if self.new:
                out["async_us"] = asyncio.run(self._async_calls(s, calls)) * 1e6
        return out

    async def _async_calls(self, s: Any, calls: int) -> float:
        from cluster_cli.state.aio import AsyncStore

        async with AsyncStore(s) as astore:
            await astore.version()
            t0 = time.perf_counter()
            for _ in range(calls):
                await astore.version()
            return (time.perf_counter() - t0) / calls

    # ---- 5. a database thread or an async driver ------------------------------
    def driver(self, calls: int, pairs: int, turn: int) -> dict[str, Any]:
        """One round of measure 5 on one state file; the contenders' order turned by ``turn``."""
        if self.driver_path is None:
            self.driver_path = self.work / "driver.db"
            with self._open(self.driver_path) as s:
                s.save_discovery(self._fleet(8))
        with self._open(self.driver_path, actor=ACTOR) as s:
            return asyncio.run(self._driver_round(s, calls, pairs, turn))

    async def _driver_round(self, s: Any, calls: int, pairs: int, turn: int) -> dict[str, Any]:
        from cluster_cli.state.aio import AsyncStore

        nodes = [f"node-{i % 8:05d}" for i in range(pairs)]
        reason = "bench: drain"
        raw = _sqlite_open(s.path, 30.0)
        db = await _aio_open(s.path, 30.0)
        astore = AsyncStore(s)
        out: dict[str, Any] = {}
        try:

            async def reads_astore() -> None:
                for _ in range(calls):
                    await astore.version()

            async def reads_aio() -> None:
                for _ in range(calls):
                    await _aio_version(db)

            async def reads_thread() -> None:
                for _ in range(calls):
                    await asyncio.to_thread(_raw_version, raw)

            async def reads_direct() -> None:
                for _ in range(calls):
                    s.version()

            async def writes_astore() -> None:
                for node in nodes:
                    await astore.cordon(node, reason)
                    await astore.uncordon(node)

            async def writes_aio() -> None:
                for node in nodes:
                    await _aio_cordon(db, node, reason)
                    await _aio_uncordon(db, node)

            async def writes_thread() -> None:
                for node in nodes:
                    await asyncio.to_thread(_raw_cordon, raw, node, reason)
                    await asyncio.to_thread(_raw_uncordon, raw, node)

            async def writes_direct() -> None:
                for node in nodes:
                    s.cordon(node, reason)
                    s.uncordon(node)

            want = s.version()
            for got in (await astore.version(), await _aio_version(db), _raw_version(raw)):
                if got != want:
                    raise RuntimeError(f"the contenders read state version {got}, the store {want}")
            # A warm-up transaction each (not timed), then the timed runs.
            await astore.cordon(nodes[0], reason)
            await astore.uncordon(nodes[0])
            await _aio_cordon(db, nodes[0], reason)
            await _aio_uncordon(db, nodes[0])
            await asyncio.to_thread(_raw_cordon, raw, nodes[0], reason)
            await asyncio.to_thread(_raw_uncordon, raw, nodes[0])
            before = (s.version(), _count_events(raw))
            for kind, n, runs in (
                ("read", calls, [("astore", reads_astore), ("aio", reads_aio), ("thread", reads_thread), ("direct", reads_direct)]),
                ("write", 2 * pairs, [("astore", writes_astore), ("aio", writes_aio), ("thread", writes_thread), ("direct", writes_direct)]),
            ):  # fmt: skip
                k = turn % len(runs)
                for name, run in runs[k:] + runs[:k]:
                    t0 = time.perf_counter()
                    await run()
                    out[f"{kind}_{name}_us"] = (time.perf_counter() - t0) / n * 1e6
            after = (s.version(), _count_events(raw))
            out["version_moved"] = after[0] - before[0]
            out["events_added"] = after[1] - before[1]
            out["cordons_left"] = len(s.cordons())
        finally:
            await astore.aclose()
            await db.close()
            raw.close()
        return out


def _sqlite_open(path: Path, timeout_s: float) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
    for pragma in SQL_PRAGMAS:
        db.execute(pragma)
    return db


async def _aio_open(path: Path, timeout_s: float) -> Any:
    import aiosqlite

    db = await aiosqlite.connect(path, timeout=timeout_s, isolation_level=None)
    for pragma in SQL_PRAGMAS:
        await db.execute(pragma)
    return db


def _check_schema(row: Any) -> None:
    if row is None or row[0] != "3":
        raise RuntimeError(f"state schema {row and row[0]}, not the 3 this SQL is for")


def _version(row: Any) -> int:
    return int(row[0]) if row and row[0] else 0


def _raw_version(db: sqlite3.Connection) -> int:
    db.execute("BEGIN")
    try:
        return _version(db.execute(SQL_VERSION).fetchone())
    finally:
        db.execute("COMMIT")


def _raw_cordon(db: sqlite3.Connection, node: str, reason: str) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        _check_schema(db.execute(SQL_SCHEMA).fetchone())
        row = db.execute(SQL_CORDON_ROW, (node,)).fetchone()
        if row is None or row[0] != reason:
            db.execute(SQL_BUMP)
            db.execute(SQL_CORDON, (node, reason, time.time()))
            message = reason if row is None else f"{reason} (was: {row[0]})"
            db.execute(SQL_EVENT, (time.time(), "cordon", node, None, None, None, ACTOR, message, None))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _raw_uncordon(db: sqlite3.Connection, node: str) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        _check_schema(db.execute(SQL_SCHEMA).fetchone())
        if db.execute(SQL_UNCORDON, (node,)).rowcount:
            db.execute(SQL_BUMP)
            db.execute(SQL_EVENT, (time.time(), "uncordon", node, None, None, None, ACTOR, "cordon lifted", None))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _count_events(db: sqlite3.Connection) -> int:
    return db.execute("SELECT COUNT(*) FROM events").fetchone()[0]


# The same through aiosqlite: every statement is an await, a trip to the connection's thread.
async def _aio_version(db: Any) -> int:
    await db.execute("BEGIN")
    try:
        rows = await db.execute_fetchall(SQL_VERSION)
        return _version(rows[0] if rows else None)
    finally:
        await db.execute("COMMIT")


async def _aio_cordon(db: Any, node: str, reason: str) -> None:
    await db.execute("BEGIN IMMEDIATE")
    try:
        _check_schema(next(iter(await db.execute_fetchall(SQL_SCHEMA)), None))
        row = next(iter(await db.execute_fetchall(SQL_CORDON_ROW, (node,))), None)
        if row is None or row[0] != reason:
            await db.execute(SQL_BUMP)
            await db.execute(SQL_CORDON, (node, reason, time.time()))
            message = reason if row is None else f"{reason} (was: {row[0]})"
            await db.execute(SQL_EVENT, (time.time(), "cordon", node, None, None, None, ACTOR, message, None))
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    await db.execute("COMMIT")


async def _aio_uncordon(db: Any, node: str) -> None:
    await db.execute("BEGIN IMMEDIATE")
    try:
        _check_schema(next(iter(await db.execute_fetchall(SQL_SCHEMA)), None))
        if (await db.execute(SQL_UNCORDON, (node,))).rowcount:
            await db.execute(SQL_BUMP)
            await db.execute(SQL_EVENT, (time.time(), "uncordon", node, None, None, None, ACTOR, "cordon lifted", None))
    except BaseException:
        await db.execute("ROLLBACK")
        raise
    await db.execute("COMMIT")


def _reconcile_replicas(w: Worker, nodes: list[str], n: int) -> list[Any]:
    """``n`` replicas over ``nodes`` (8 GPUs each): 8% TP-8 (a node each), 12% TP-4 (half a
    node), the rest single-GPU, packed node after node; an HTTP port per replica on its node."""
    tp8, tp4 = round(n * 0.08), round(n * 0.12)
    sizes = [8] * tp8 + [4] * tp4 + [1] * (n - tp8 - tp4)
    free = [8] * len(nodes)
    out, node = [], 0
    for i, g in enumerate(sizes):
        while node < len(nodes) and free[node] < g:
            node += 1
        if node >= len(nodes):
            raise SystemExit(f"state bench: {n} replicas do not fit on {len(nodes)} nodes of 8 GPUs")
        first = 8 - free[node]
        free[node] -= g
        model, prof = {8: ("llama-70b", "h100-8x1"), 4: ("mixtral", "h100-4x1"), 1: ("qwen-7b", "h100-1x1")}[g]
        placed = w.Replica(model, i, prof, "vllm", (w.Shard(nodes[node], tuple(range(first, first + g))),), "ib-0")
        out.append(w.ReplicaRecord(placed, port=8100 + first))
    random.Random(7).shuffle(out)  # reserved in no particular order
    return out


def _gpus(recs: list[Any]) -> int:
    return sum(len(s.gpus) for r in recs for s in r.replica.shards)


def serve(side: str, work: Path) -> None:
    proto = sys.stdout
    sys.stdout = sys.stderr  # whatever the store prints never reaches the protocol
    w = Worker(side, work)
    ops: dict[str, Callable[..., dict[str, Any]]] = {
        "hello": w.hello,
        "writes": w.writes,
        "build_read": w.build_read,
        "read": w.read,
        "stall": w.stall,
        "overhead": w.overhead,
        "driver": w.driver,
    }
    for line in sys.stdin:
        req = json.loads(line)
        try:
            res = {"ok": True, **ops[req["op"]](**req.get("args", {}))}
        except Exception as e:  # reported to the driver, which stops
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(res) + "\n")
        proto.flush()


# --------------------------------------------------------------------------- driver
class Side:
    def __init__(self, name: str, code: Path, work: Path) -> None:
        self.name = name
        work.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(code), "PYTHONDONTWRITEBYTECODE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", name, "--work", str(work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(work),
        )
        self.info = self.ask("hello")
        if Path(self.info["package"]) != (code / "cluster_cli").resolve():
            raise SystemExit(f"state bench: the {name} worker imported {self.info['package']}, not {code}")

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"state bench: the {self.name} worker ended (exit {self.proc.wait()})")
        res = json.loads(line)
        if not res.pop("ok"):
            raise SystemExit(f"state bench: {self.name} {op} failed: {res['error']}")
        return res

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def interleaved(sides: list[Side], rounds: int, op: str, **args: Any) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` rounds of ``op`` on every side, the order turned around each round."""
    out: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
    for r in range(rounds):
        for s in sides if r % 2 == 0 else sides[::-1]:
            out[s.name].append(s.ask(op, **args))
    return out


def table(title: str, head: list[str], rows: list[list[str]], note: str) -> None:
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) for i in range(len(head))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    print(note)


def best_med(values: list[float], *, high: bool) -> tuple[float, float]:
    return (max(values) if high else min(values)), statistics.median(values)


def fmt_rate(best: float, med: float) -> str:
    return f"{best:,.0f} ({med:,.0f})"


def fmt_ms(best: float, med: float) -> str:
    return f"{best * 1000:,.1f} ({med * 1000:,.1f})"


def driver_measure(new: Side, args: argparse.Namespace, sync_stall: float) -> str:
    """Measure 5, AsyncStore against aiosqlite, in the new store's worker; its verdict line
    ("" when skipped)."""
    if args.no_aiosqlite:
        print("\n5. AsyncStore against aiosqlite: left out (--no-aiosqlite)")
        return ""
    if not new.info.get("aiosqlite"):
        print("\n5. AsyncStore against aiosqlite: skipped, aiosqlite does not import (pip install 'aiosqlite>=0.20')")
        return ""
    rounds = [new.ask("driver", calls=args.calls, pairs=args.aio_pairs, turn=r) for r in range(args.repeat)]
    for r in rounds:
        contenders = 4  # every one cordons and uncordons each node of its pairs: 2 versions, 2 events a pair
        if (
            r["cordons_left"]
            or r["version_moved"] != r["events_added"]
            or r["events_added"] != 2 * args.aio_pairs * contenders
        ):
            raise SystemExit(f"state bench: measure 5: the writes are not all in the state: {r}")
    st: dict[str, list[dict[str, Any]]] = {"async": [], "aiosqlite": []}
    for r in range(args.aio_stall_rounds):
        for mode in ("async", "aiosqlite") if r % 2 == 0 else ("aiosqlite", "async"):
            res = new.ask("stall", hold_s=args.hold, mode=mode, seq=10_000 + 2 * r + (mode == "aiosqlite"))
            if not res["cordoned"]:
                raise SystemExit(f"state bench: measure 5: the {mode} cordon made under the lock is not in the state")
            st[mode].append(res)

    def us(key: str) -> tuple[float, float, str]:
        b, m = best_med([r[key] for r in rounds], high=False)
        return b, m, f"{b:.1f} ({m:.1f})"

    rows, ratio = [], {}
    for kind, label in (("read", "read: version()"), ("write", "write: a cordon or uncordon")):
        a, _, a_txt = us(f"{kind}_astore_us")
        d, _, d_txt = us(f"{kind}_aio_us")
        ratio[kind] = d / a
        rows.append([label, a_txt, d_txt, f"{d / a:.2f}x", us(f"{kind}_thread_us")[2], us(f"{kind}_direct_us")[2]])
    worst = {m: best_med([r["max_late_s"] for r in st[m]], high=False) for m in st}
    took = {m: statistics.median(r["write_s"] for r in st[m]) for m in st}
    rows.append(
        [
            f"longest loop stall, lock held {args.hold:g} s (ms)",
            fmt_ms(*worst["async"]),
            fmt_ms(*worst["aiosqlite"]),
            f"{worst['aiosqlite'][0] / worst['async'][0]:.2f}x",
            "-",
            f"{sync_stall * 1000:,.1f}",
        ]
    )
    table(
        f"5. a database thread (AsyncStore) or an async driver (aiosqlite {new.info['aiosqlite']}), one state file "
        f"({args.repeat} rounds of {args.calls} reads and {args.aio_pairs} cordon/uncordon pairs; "
        f"{args.aio_stall_rounds} stall rounds)",
        ["us per call", "AsyncStore", "aiosqlite", "aiosqlite/AsyncStore", "sqlite3 in to_thread", "Store, direct"],
        rows,
        "   (a read: aiosqlite and sqlite3 BEGIN, SELECT, COMMIT, the store's call one SELECT more; a write: one\n"
        "   transaction, the store's SQL; aiosqlite awaits each statement, AsyncStore and to_thread each call;\n"
        f"   lower is better; the stall's direct figure is measure 3's new sync median; the write under the lock\n"
        f"   took {took['async']:.2f} s (AsyncStore), {took['aiosqlite']:.2f} s (aiosqlite), medians)",
    )

    def faster(r: float) -> str:
        return f"AsyncStore {r:.2f}x faster" if r >= 1 else f"aiosqlite {1 / r:.2f}x faster"

    free = {m: statistics.median(r["max_late_s"] for r in st[m]) < 0.05 for m in st}
    if all(free.values()):
        loop = "both keep the loop free"
    else:
        loop = ", ".join(f"{m} {'keeps' if free[m] else 'does not keep'} the loop free" for m in st)
    return (
        f"verdict, database thread or async driver: a read {faster(ratio['read'])}, a write {faster(ratio['write'])} "
        f"(best of {args.repeat}); {loop} under a held lock (longest stall {worst['async'][0] * 1000:.1f} ms "
        f"AsyncStore, {worst['aiosqlite'][0] * 1000:.1f} ms aiosqlite, against {sync_stall * 1000:,.0f} ms sync)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BASELINE, help="the landed commit to compare with (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds of measures 1, 2 and 4 (default %(default)s)")
    ap.add_argument("--write-replicas", type=int, default=256)
    ap.add_argument("--observes", type=int, default=3000, help="observe calls per run of measure 1")
    ap.add_argument("--pairs", type=int, default=1000, help="cordon/uncordon pairs per run of measure 1")
    ap.add_argument("--read-nodes", type=int, default=1000)
    ap.add_argument("--read-replicas", type=int, default=4000)
    ap.add_argument("--hold", type=float, default=2.0, help="seconds the other process holds the write lock")
    ap.add_argument("--stall-rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000, help="calls per run of measures 4 and 5 (reads)")
    ap.add_argument("--aio-pairs", type=int, default=300, help="cordon/uncordon pairs per run of measure 5")
    ap.add_argument("--aio-stall-rounds", type=int, default=3, help="rounds of measure 5's stall (each contender)")
    ap.add_argument("--no-aiosqlite", action="store_true", help="leave out measure 5 (AsyncStore against aiosqlite)")
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds (small sizes, one round)")
    ap.add_argument("--work", type=Path, help="a folder for the states (default: a temp folder, removed after)")
    ap.add_argument("--serve", choices=["old", "new"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.work)
        return 0
    if args.quick:
        args.repeat, args.stall_rounds = 1, 1
        args.write_replicas, args.observes, args.pairs = 16, 100, 50
        args.read_nodes, args.read_replicas, args.hold, args.calls = 50, 200, 0.3, 200
        args.aio_pairs, args.aio_stall_rounds = 50, 1

    work = Path(tempfile.mkdtemp(prefix="state-bench-", dir=args.work))
    sides: list[Side] = []
    try:
        old_code = work / "old-code"
        old_code.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "cluster_cli"], capture_output=True, check=False
        )
        if archive.returncode:
            raise SystemExit(f"state bench: git archive {args.baseline}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(old_code)], input=archive.stdout, check=True)
        t_start = time.perf_counter()
        load_start = os.getloadavg()[0]
        sides = [Side("old", old_code, work / "old"), Side("new", ROOT, work / "new")]
        old, new = sides
        print(
            f"machine: nproc {os.cpu_count()}, Python {sys.version.split()[0]}, load average at start {load_start:.2f}"
        )
        print(f"old: {args.baseline} (schema {old.info['schema']}) from {old.info['package']}")
        print(f"new: this checkout (schema {new.info['schema']}) from {new.info['package']}")
        print(f"states under {work} (local disk); {args.repeat} interleaved rounds; best (median)")

        # 1. writes per second
        w = interleaved(
            sides, args.repeat, "writes", replicas=args.write_replicas, observes=args.observes, pairs=args.pairs
        )
        wr: list[list[str]] = []
        for label, key in (("observe (status flips)", "observe"), ("cordon / uncordon", "cordon")):
            rates = {n: [r[f"{key}_n"] / r[f"{key}_s"] for r in w[n]] for n in w}
            bo, mo = best_med(rates["old"], high=True)
            bn, mn = best_med(rates["new"], high=True)
            wr.append([label, fmt_rate(bo, mo), fmt_rate(bn, mn), f"{bn / bo:.2f}x"])
        for n in w:
            for r in w[n]:
                if r["cordons_left"] or (args.observes >= args.write_replicas and "starting" in r["statuses"]):
                    raise SystemExit(f"state bench: {n}: writes not all in the state: {r}")
        table(
            f"1. state writes per second ({args.write_replicas} replicas on {-(-args.write_replicas // 8)} nodes; "
            f"{args.observes} observes, {args.pairs} pairs per run)",
            ["writes/s", "old", "new", "new/old"],
            wr,
            "   (a fresh state file per run; higher is better; new/old of the best)",
        )

        # 2. one reconcile-sized read
        built = {s.name: s.ask("build_read", nodes=args.read_nodes, replicas=args.read_replicas) for s in sides}
        rd = interleaved(sides, args.repeat, "read")
        for n in rd:
            got = rd[n][-1]
            if got["nodes"] != args.read_nodes or got["replicas"] != args.read_replicas:
                raise SystemExit(f"state bench: {n} read {got['nodes']} nodes, {got['replicas']} replicas")
        bo, mo = best_med([r["read_s"] for r in rd["old"]], high=False)
        bn, mn = best_med([r["read_s"] for r in rd["new"]], high=False)
        table(
            f"2. one reconcile-sized read ({args.read_nodes} nodes, {args.read_replicas} replicas, "
            f"{rd['new'][-1]['shards']} shards, {built['new']['gpus']} GPUs held)",
            ["ms", "old", "new", "new/old"],
            [
                ["every node and replica, one snapshot", fmt_ms(bo, mo), fmt_ms(bn, mn), f"{bn / bo:.2f}x"],
                [
                    "state file (MiB), built in (s)",
                    f"{built['old']['size_mib']:.1f}, {built['old']['build_s']:.1f}",
                    f"{built['new']['size_mib']:.1f}, {built['new']['build_s']:.1f}",
                    "",
                ],
            ],
            "   (old: snapshot() + nodes() + records() + version(); new: plan_view(); lower is better)",
        )

        # 3. the loop's longest stall while another process holds the write lock
        st: dict[str, list[dict[str, Any]]] = {"old sync": [], "new sync": [], "new async": []}
        seq = 0
        for r in range(args.stall_rounds):
            runs = [("old sync", old, "sync"), ("new sync", new, "sync"), ("new async", new, "async")]
            for key, side, mode in runs if r % 2 == 0 else runs[::-1]:
                seq += 1
                res = side.ask("stall", hold_s=args.hold, mode=mode, seq=seq)
                if not res["cordoned"]:
                    raise SystemExit(f"state bench: {key}: the cordon made under the lock is not in the state")
                st[key].append(res)

        def stall_cells(key: str) -> tuple[float, str, str]:
            worst = [r["max_late_s"] for r in st[key]]
            waits = [r["write_s"] for r in st[key]]
            b, m = best_med(worst, high=False)
            return b, fmt_ms(b, m), f"{statistics.median(waits):.2f}"

        so, so_txt, wo = stall_cells("old sync")
        sn, sn_txt, wn = stall_cells("new sync")
        sa, sa_txt, wa = stall_cells("new async")
        p50 = statistics.median(r["p50_late_s"] for r in st["new async"]) * 1000
        table(
            f"3. the event loop's longest stall while another process holds the write lock {args.hold:g} s "
            f"({args.stall_rounds} rounds)",
            ["longest stall, ms", "old", "new", "new/old", "write took (s, old / new)"],
            [
                ["(a) sync store call on the loop", so_txt, sn_txt, f"{sn / so:.2f}x", f"{wo} / {wn}"],
                ["(b) old sync vs new AsyncStore", so_txt, sa_txt, f"{sa / so:.4f}x", f"{wo} / {wa}"],
            ],
            f"   (a 5-ms ticker's latest wake-up; the write is one cordon, made 100 ms into the hold; "
            f"median lateness under AsyncStore {p50:.2f} ms)",
        )

        # 4. AsyncStore's overhead per call
        ov = interleaved(sides, args.repeat, "overhead", calls=args.calls)
        do_b, do_m = best_med([r["direct_us"] for r in ov["old"]], high=False)
        dn_b, dn_m = best_med([r["direct_us"] for r in ov["new"]], high=False)
        an_b, an_m = best_med([r["async_us"] for r in ov["new"]], high=False)
        table(
            f"4. time per call of version(), microseconds ({args.calls} calls per run)",
            ["us per call", "old", "new", "new/old"],
            [
                [
                    "store.version(), direct",
                    f"{do_b:.1f} ({do_m:.1f})",
                    f"{dn_b:.1f} ({dn_m:.1f})",
                    f"{dn_b / do_b:.2f}x",
                ],
                ["await astore.version()", "-", f"{an_b:.1f} ({an_m:.1f})", ""],
                ["AsyncStore's overhead", "-", f"{an_b - dn_b:.1f} ({an_m - dn_m:.1f})", ""],
            ],
            "   (lower is better; the overhead is the AsyncStore call less the direct one, new store)",
        )

        # 5. a database thread or an async driver
        driver_verdict = driver_measure(
            new, args, sync_stall=statistics.median(r["max_late_s"] for r in st["new sync"])
        )

        print(
            f"\nverdict: new/old writes/s {wr[0][3]} observe, {wr[1][3]} cordon; reconcile read {bn / bo:.2f}x the time; "
            f"longest loop stall under a held lock {sa * 1000:.1f} ms with AsyncStore against {so * 1000:.0f} ms "
            f"(old, sync); AsyncStore adds {an_b - dn_b:.0f} us a call"
        )
        if driver_verdict:
            print(driver_verdict)
        print(f"(whole run {time.perf_counter() - t_start:.0f} s; load average at end {os.getloadavg()[0]:.2f})")
    finally:
        for s in sides:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
