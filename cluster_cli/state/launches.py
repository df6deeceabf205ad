"""The state's launched replicas: reserve, record what runs, release (a part of ``Store``).

Reserving books every GPU and port of a replica in ``holds`` in the same transaction as its
row: the table's primary key refuses a second booking, whoever writes it. Desired state
changes (a reservation, a release, a ``down``) move the state version that plans are checked
against; observed ones (starting, ready, a PID) do not: a plan stays valid while replicas
merely come up.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from cluster_cli.errors import StateError
from cluster_cli.facts import Replica
from cluster_cli.state.records import DOWN, STOPPED, UP, ReplicaRecord, replica_name

_COLUMNS = "spec, generation, status, desired, endpoint, runtime, started_at, restarts, detail, updated_at"


class StaleVersion(StateError):
    """The state moved on since the plan being applied was computed."""


class LaunchTable:
    """Replica records and holds; mixed into ``Store`` (which provides the helpers used here)."""

    _db: sqlite3.Connection
    schema: int
    path: Any

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]: ...  # type: ignore[empty-body]
    def _replica(self, doc: str) -> Replica: ...  # type: ignore[empty-body]
    def _event(self, db: sqlite3.Connection, kind: str, node: str | None, message: str) -> None: ...
    def version(self) -> int: ...  # type: ignore[empty-body]

    # ---- reads ------------------------------------------------------------
    def records(self, *, include_down: bool = False) -> list[ReplicaRecord]:
        """Every replica record (by model, replica, generation); those wanted down only with
        ``include_down``."""
        if self.schema < 2:  # a version-1 state read as it is: placed replicas, nothing launched
            return [ReplicaRecord(r) for r in self.replicas()]  # type: ignore[attr-defined]
        where = "" if include_down else f"WHERE desired = '{UP}'"
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM replicas {where} ORDER BY model, replica, generation")
        return [self._record(row) for row in rows.fetchall()]

    def _record(self, row: tuple[Any, ...]) -> ReplicaRecord:
        spec, gen, status, desired, endpoint, runtime, started, restarts, detail, updated = row
        try:
            rt = ReplicaRecord.parse_runtime(json.loads(runtime) if runtime else None)
        except (ValueError, KeyError, TypeError) as e:
            raise StateError(f"{self.path}: unreadable replica runtime ({e})") from None
        return ReplicaRecord(
            self._replica(spec),
            generation=gen,
            status=status,
            desired=desired,
            endpoint=endpoint,
            started_at=started,
            restarts=restarts,
            detail=detail,
            updated_at=updated,
            **rt,
        )

    def held_ports(self, node: str) -> set[int]:
        if self.schema < 2:
            return set()
        rows = self._db.execute("SELECT item FROM holds WHERE node=? AND kind='port'", (node,))
        return {r[0] for r in rows}

    # ---- writes -----------------------------------------------------------
    def reserve(
        self,
        records: Iterable[ReplicaRecord],
        *,
        expect_version: int | None = None,
        replacing: Iterable[ReplicaRecord] = (),
    ) -> int:
        """Book ``records`` (new replicas: their rows, GPUs and ports) in one transaction;
        returns the new state version. A GPU or port held by one of ``replacing`` (replicas
        the caller stops before it starts ``records``) is handed over. Raises StaleVersion when
        the state is no longer at ``expect_version``, StateError when a GPU or port is already
        held otherwise (nothing booked)."""
        records = list(records)
        handed = {rec.key for rec in replacing}
        if not records:  # nothing to book: no write, no new version (but the check still holds)
            if expect_version is not None and self.version() != expect_version:
                raise StaleVersion(
                    f"{self.path}: the state moved on (version {self.version()}, the plan was made at {expect_version})"
                )
            return self.version()
        with self._tx() as db:
            if expect_version is not None and self.version() != expect_version:
                raise StaleVersion(
                    f"{self.path}: the state moved on (version {self.version()}, the plan was made at {expect_version})"
                )
            now = time.time()
            for rec in records:
                r = rec.replica
                # A replica wanted down is brought back by this reservation: its old row goes.
                db.execute("DELETE FROM replicas WHERE model=? AND replica=? AND desired=?", (r.model, r.replica, DOWN))
                try:
                    db.execute(
                        f"INSERT INTO replicas(model, replica, {_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (r.model, r.replica, *self._values(rec, now)),
                    )
                except sqlite3.IntegrityError:
                    raise StateError(
                        f"{self.path}: {rec.name} generation {rec.generation} is already recorded"
                    ) from None
                for kind, node, item in _holds(rec):
                    owner = db.execute(
                        "SELECT model, replica, generation FROM holds WHERE node=? AND kind=? AND item=?",
                        (node, kind, item),
                    ).fetchone()
                    if owner is not None and tuple(owner) in handed:
                        db.execute("DELETE FROM holds WHERE node=? AND kind=? AND item=?", (node, kind, item))
                    try:
                        db.execute("INSERT INTO holds VALUES (?,?,?,?,?,?)", (node, kind, item, *rec.key))
                    except sqlite3.IntegrityError:
                        owner = db.execute(
                            "SELECT model, replica FROM holds WHERE node=? AND kind=? AND item=?", (node, kind, item)
                        ).fetchone()
                        who = replica_name(*owner) if owner else "another replica"
                        what = f"GPU {item}" if kind == "gpu" else f"port {item}"
                        raise StateError(f"{node}: {what} is already held by {who}; nothing was reserved") from None
                self._event(db, "reserve", r.shards[0].node if r.shards else None, f"{rec.name} reserved")
            _bump(db)
            return self.version()

    def _values(self, rec: ReplicaRecord, now: float) -> tuple[Any, ...]:
        return (
            json.dumps(rec.replica.to_dict()),
            rec.generation,
            rec.status,
            rec.desired,
            rec.endpoint,
            json.dumps(rec.runtime()),
            rec.started_at,
            rec.restarts,
            rec.detail,
            now,
        )

    def observe(self, rec: ReplicaRecord) -> None:
        """Record what was seen of a reserved replica (status, endpoint, processes, restarts):
        no new state version. A replica released meanwhile stays released."""
        with self._tx() as db:
            db.execute(
                "UPDATE replicas SET status=?, endpoint=?, runtime=?, started_at=?, restarts=?, detail=?, "
                "updated_at=? WHERE model=? AND replica=? AND generation=?",
                (rec.status, rec.endpoint, json.dumps(rec.runtime()), rec.started_at, rec.restarts, rec.detail,
                 time.time(), *rec.key),
            )  # fmt: skip

    def claim(self, seen: ReplicaRecord, rec: ReplicaRecord) -> bool:
        """Record ``rec`` as :meth:`observe` does, only if the row is still as ``seen`` was read
        (same status, same last update): of two runs that take one replica over, one gets it."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE replicas SET status=?, endpoint=?, runtime=?, started_at=?, restarts=?, detail=?, "
                "updated_at=? WHERE model=? AND replica=? AND generation=? AND status=? AND updated_at IS ?",
                (rec.status, rec.endpoint, json.dumps(rec.runtime()), rec.started_at, rec.restarts, rec.detail,
                 time.time(), *rec.key, seen.status, seen.updated_at),
            )  # fmt: skip
            return cur.rowcount == 1

    def release(self, rec: ReplicaRecord, *, wanted_down: bool = False, why: str = "released") -> None:
        """Free every GPU and port of a replica at once. ``wanted_down`` keeps its row as
        stopped and wanted down (``down``: nothing brings it back until the next ``up``)."""
        with self._tx() as db:
            db.execute("DELETE FROM holds WHERE model=? AND replica=? AND generation=?", rec.key)
            if wanted_down:
                db.execute(
                    "UPDATE replicas SET status=?, desired=?, endpoint=NULL, updated_at=? "
                    "WHERE model=? AND replica=? AND generation=?",
                    (STOPPED, DOWN, time.time(), *rec.key),
                )
            else:
                db.execute("DELETE FROM replicas WHERE model=? AND replica=? AND generation=?", rec.key)
            _bump(db)
            self._event(db, "release", None, f"{rec.name} {why}")


def _holds(rec: ReplicaRecord) -> Iterator[tuple[str, str, int]]:
    for s in rec.replica.shards:
        for g in s.gpus:
            yield "gpu", s.node, g
    if rec.replica.shards:
        head = rec.replica.shards[0].node
        for p in (rec.port, *rec.extra_ports):
            if p is not None:
                yield "port", head, p


def _bump(db: sqlite3.Connection) -> None:
    db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'state_version'")


__all__ = ["UP", "LaunchTable", "StaleVersion"]
