"""The state's launched replicas: reserve, record what runs, release, fence (a part of ``Store``).

* A replica is a generation of ``MODEL/N``. Generations are counted in ``generations`` and
  never reused (after a ``down``, a failed start, a release): the generation is the fencing
  token, in every shard's marker on its node.
* Reserving books every GPU (by UUID where the facts know it, else by node and index) and
  port of a replica in ``holds``, in the same transaction as its row: the unique indexes
  refuse a second booking, whoever writes it.
* Every row has a revision. Observed-state writes (starting, ready, a PID) and releases
  compare and set it: a writer that read an older revision is refused (``StaleRecord``) and
  reads again; it never overwrites what another wrote meanwhile.
* A release whose stop was not confirmed keeps the row (status ``fenced``) and its holds,
  with a fence record per shard that may still run, until a later stop confirms it gone
  (``unfence``). A row is never deleted while its engine may still run.

Desired-state changes (a reservation, a release, a ``down``) move the state version that
plans are checked against; observed ones do not: a plan stays valid while replicas come up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from cluster_cli.errors import StateError
from cluster_cli.facts import Replica, Shard
from cluster_cli.state.backend import Tx
from cluster_cli.state.meta import bump as _bump
from cluster_cli.state.records import (
    DOWN,
    FENCED,
    STOPPED,
    STOPPING,
    UP,
    ReplicaRecord,
    ShardRun,
    replica_name,
)

_R = ("model, replica, generation, profile, engine, fabric, gpu_class, cpus, memory_mib, status, desired, endpoint, "
      "port, extra_ports, owner, started_at, restarts, detail, revision, updated_at")  # fmt: skip
_S = "model, replica, generation, rank, node, gpus, hcas, run_dir, token, pid, start_time, boot_id, gpu_uuids"
_F = "node, run_dir, token, model, replica, generation, since, reason, pid, start_time, checked_at"
_KEY = "model=? AND replica=? AND generation=?"


class StaleVersion(StateError):
    """The state moved on since the plan being applied was computed."""


class StaleRecord(StateError):
    """A replica row changed (or went) since it was read: read it again."""


@dataclass(frozen=True)
class Reservation:
    version: int  # the state version after it
    records: list[ReplicaRecord]  # as recorded: each with its generation and revision


class LaunchTable:
    """Replica records, shards, holds and fences; mixed into ``Store``."""

    path: Any
    _b: Any

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...
        def version(self) -> int: ...  # type: ignore[empty-body]
        def _save_catalog(self, tx: Tx, doc: dict[str, Any], source: str | None) -> int: ...  # type: ignore[empty-body]

    # ---- reads ------------------------------------------------------------
    def records(self, *, include_down: bool = False, include_fenced: bool = False) -> list[ReplicaRecord]:
        """Replica records by model, replica, generation: those wanted up and not fenced; with
        ``include_down`` those wanted down too, with ``include_fenced`` the fenced ones."""
        with self._read() as tx:
            return _records(tx, include_down=include_down, include_fenced=include_fenced)

    def record(self, model: str, replica: int, generation: int) -> ReplicaRecord | None:
        with self._read() as tx:
            out = _records(tx, include_down=True, include_fenced=True, key=(model, replica, generation))
        return out[0] if out else None

    def replicas(self) -> list[Replica]:
        """The placements of the replicas that hold their GPUs and run (or are to)."""
        return [r.replica for r in self.records()]

    def held_ports(self, node: str) -> set[int]:
        with self._read() as tx:
            rows = tx.execute("SELECT item FROM holds WHERE node=? AND kind='port'", (node,)).fetchall()
        return {r[0] for r in rows}

    # ---- reserve ----------------------------------------------------------
    def reserve(
        self,
        records: Iterable[ReplicaRecord],
        *,
        expect_version: int | None = None,
        catalog: tuple[dict[str, Any], str | None] | None = None,
    ) -> Reservation:
        """Book ``records`` (new replicas: their rows, shards, GPUs and ports) in one
        transaction, each as the next generation of its ``MODEL/N``; ``catalog`` (a document
        and its source): recorded as the desired state in the same transaction, so that no
        reader sees the new replicas under the catalog before it. Raises StaleVersion when
        the state is no longer at ``expect_version`` (checked and moved in one statement),
        StateError when a GPU or port is already held (nothing booked): a replica placed anew
        gets the GPUs of its earlier generation only once that one's stop is confirmed and it
        is released."""
        records = list(records)
        if not records:  # nothing to book: no write, no new version (but the check still holds)
            version = self.version()
            if expect_version is not None and version != expect_version:
                raise _stale(self.path, version, expect_version)
            return Reservation(version, [])
        with self._tx() as tx:
            if expect_version is not None:
                moved = tx.execute(
                    "UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) "
                    "WHERE key = 'state_version' AND value = ?",
                    (str(expect_version),),
                ).rowcount
                if not moved:
                    raise _stale(self.path, _version(tx), expect_version)
            else:
                _bump(tx)
            if catalog is not None:
                self._save_catalog(tx, *catalog)
            uuids = gpu_uuids(tx, {s.node for rec in records for s in rec.replica.shards if s.gpus})
            now = time.time()
            out = []
            for rec in records:
                r = rec.replica
                # A replica wanted down and stopped is brought back by this reservation: its old row
                # goes (its shards with it). One still being stopped, or fenced, stays with its holds
                # until its stop is confirmed.
                tx.execute(
                    "DELETE FROM replicas WHERE model=? AND replica=? AND desired=? AND status=?",
                    (r.model, r.replica, DOWN, STOPPED),
                )
                gen = _next_generation(tx, r.model, r.replica)
                rec = replace(rec, generation=gen, revision=1)
                tx.execute(
                    f"INSERT INTO replicas({_R}, created_at) VALUES ({','.join('?' * 21)})",
                    (*_row(rec, now), now),
                )
                for rank, s in enumerate(r.shards):
                    tx.execute(
                        "INSERT INTO shards(model, replica, generation, rank, node, gpus, hcas, state, updated_at) "
                        "VALUES (?,?,?,?,?,?,?,?,?)",
                        (*rec.key, rank, s.node, _ints(s.gpus), ",".join(s.hcas), "planned", now),
                    )
                for kind, node, item in _holds(rec):
                    uuid = uuids.get((node, item)) if kind == "gpu" else None
                    self._hold(tx, kind, node, item, uuid, rec)
                head = r.shards[0].node if r.shards else None
                self._event(tx, "reserved", f"{rec.name} generation {gen} reserved on {_where(r)}",
                            node=head, model=r.model, replica=r.replica, generation=gen)  # fmt: skip
                out.append(rec)
            return Reservation(_version(tx), out)

    def _hold(self, tx: Tx, kind: str, node: str, item: int, uuid: str | None, rec: ReplicaRecord) -> None:
        """Book one GPU or port for ``rec``. A GPU is the same device by its UUID; a hold made
        without one (its UUID unknown then) is taken to be the device at that index, and a
        booking without a UUID conflicts with any hold at that index: in doubt, refused."""
        owner = _owner(tx, kind, node, item, uuid)
        if owner is not None:
            what = f"GPU {item}" if kind == "gpu" else f"port {item}"
            raise StateError(
                f"{node}: {what} is already held by {replica_name(owner[0], owner[1])}; nothing was reserved"
            )
        try:
            tx.execute("INSERT INTO holds VALUES (?,?,?,?,?,?,?)", (node, kind, item, uuid, *rec.key))
        except self._b.IntegrityError:
            what = f"GPU {item}" if kind == "gpu" else f"port {item}"
            raise StateError(f"{node}: {what} is already held; nothing was reserved") from None

    # ---- observed state ---------------------------------------------------
    def observe(self, rec: ReplicaRecord) -> ReplicaRecord:
        """Record what was seen of a replica (status, endpoint, its shards' processes,
        restarts), if its row is still at ``rec.revision``; the record at its new revision. No
        new state version. Raises StaleRecord when the row changed or went meanwhile."""
        with self._tx() as tx:
            old = self._current(tx, rec)
            if old.status == FENCED or old.desired == DOWN:
                # Only a confirmed stop moves a fenced row on, and a replica wanted down is not
                # brought back by what someone saw of it.
                raise StaleRecord(f"{self.path}: {rec.name} generation {rec.generation} is {old.status}, "
                                  f"wanted {old.desired}: not written")  # fmt: skip
            return self._observe(tx, old, rec)

    def claim(self, seen: ReplicaRecord, rec: ReplicaRecord) -> ReplicaRecord | None:
        """Record ``rec`` as :meth:`observe` does, only if the row is still as ``seen`` was read:
        of two runs that take one replica over, one gets it (the record), the other None."""
        try:
            return self.observe(replace(rec, revision=seen.revision))
        except StaleRecord:
            return None

    def _current(self, tx: Tx, rec: ReplicaRecord) -> ReplicaRecord:
        got = _records(tx, include_down=True, include_fenced=True, key=rec.key)
        if not got:
            raise StaleRecord(f"{self.path}: {rec.name} generation {rec.generation} is no longer recorded")
        old = got[0]
        if old.revision != rec.revision:
            raise StaleRecord(
                f"{self.path}: {rec.name} generation {rec.generation} changed since it was read "
                f"(revision {rec.revision}, now {old.revision}: {old.status}, wanted {old.desired}); read it again"
            )
        return old

    def _observe(self, tx: Tx, old: ReplicaRecord, rec: ReplicaRecord, *, desired: str | None = None) -> ReplicaRecord:
        now = time.time()
        desired = desired or old.desired
        n = tx.execute(
            "UPDATE replicas SET status=?, desired=?, endpoint=?, port=?, extra_ports=?, owner=?, started_at=?, "
            f"restarts=?, detail=?, revision=revision+1, updated_at=? WHERE {_KEY} AND revision=?",
            (rec.status, desired, rec.endpoint, rec.port, _ints(rec.extra_ports), rec.owner, rec.started_at,
             rec.restarts, rec.detail, now, *rec.key, old.revision),
        ).rowcount  # fmt: skip
        if n != 1:
            raise StaleRecord(f"{self.path}: {rec.name} generation {rec.generation} changed meanwhile; read it again")
        states = [_shard_state(rec.status, run) for run in rec.shards]
        if rec.shards != old.shards or states != [_shard_state(old.status, run) for run in old.shards]:
            for rank, run in enumerate(rec.shards):
                tx.execute(
                    "UPDATE shards SET run_dir=?, token=?, pid=?, start_time=?, boot_id=?, gpu_uuids=?, state=?, "
                    f"updated_at=? WHERE {_KEY} AND rank=?",
                    (run.run_dir, run.token, run.pid, run.start_time, run.boot_id, ",".join(run.gpu_uuids),
                     states[rank], now, *rec.key, rank),
                )  # fmt: skip
        r = rec.replica
        head = r.shards[0].node if r.shards else None
        ids = {"node": head, "model": r.model, "replica": r.replica, "generation": rec.generation}
        if rec.restarts > old.restarts:
            self._event(tx, "restarted", f"{rec.name} restarting ({rec.restarts} so far): {rec.detail or ''}".rstrip(": "),
                        **ids)  # fmt: skip
        elif rec.status != old.status and rec.status in ("starting", "ready", "unhealthy", "failed"):
            what = f"{rec.name} {rec.status}"
            if rec.status == "ready" and rec.endpoint:
                what += f" at {rec.endpoint}"
            elif rec.detail:
                what += f": {rec.detail}"
            self._event(tx, rec.status, what, **ids)
        return replace(rec, revision=old.revision + 1, desired=desired)

    def want_down(self, rec: ReplicaRecord, *, why: str = "taken down", owner: str | None = None) -> ReplicaRecord:
        """Mark a replica wanted down and being stopped (compare and set), before its processes
        are stopped: a run starting it meanwhile sees it and stops what it started. ``owner``:
        the run stopping it (once that run is gone, another takes the stop over). A new state
        version. Raises StaleRecord."""
        with self._tx(bump=True) as tx:
            old = self._current(tx, rec)
            new = self._observe(tx, old, replace(old, status=STOPPING, detail=why, owner=owner), desired=DOWN)
            r = rec.replica
            self._event(tx, "down", f"{rec.name} {why}", node=r.shards[0].node if r.shards else None,
                        model=r.model, replica=r.replica, generation=rec.generation)  # fmt: skip
            return new

    # ---- release and fences -----------------------------------------------
    def release(
        self,
        rec: ReplicaRecord,
        *,
        wanted_down: bool = False,
        why: str = "released",
        left: Sequence[tuple[ShardRun, str]] = (),
    ) -> ReplicaRecord | None:
        """Release a stopped replica whole, if its row is still at ``rec.revision``.

        ``left`` empty (every stop confirmed): its GPUs and ports are freed and its row goes
        (``wanted_down``: kept, stopped and wanted down, so nothing brings it back until the
        next ``up``). ``left`` names the shards whose stop could not be confirmed, each with
        why: the row stays ``fenced`` with its holds (nothing else may start on those GPUs),
        and a fence record per shard, until :meth:`unfence`. Returns the row as kept (None
        when it went). Raises StaleRecord."""
        with self._tx(bump=True) as tx:
            old = self._current(tx, rec)
            r = rec.replica
            head = r.shards[0].node if r.shards else None
            ids = {"model": r.model, "replica": r.replica, "generation": rec.generation}
            now = time.time()
            if left:
                desired = DOWN if wanted_down else old.desired
                kept = self._observe(tx, old, replace(old, status=FENCED, endpoint=None, detail=why), desired=desired)
                tx.execute(f"UPDATE shards SET state='stopped' WHERE {_KEY} AND state<>'planned'", rec.key)
                write_fences(tx, rec, left, now, why=why, event=self._event)
                return kept
            tx.execute(f"DELETE FROM holds WHERE {_KEY}", rec.key)
            if wanted_down:
                kept = self._observe(tx, old, replace(old, status=STOPPED, endpoint=None), desired=DOWN)
                tx.execute(f"UPDATE shards SET state='stopped', updated_at=? WHERE {_KEY}", (now, *rec.key))
                self._event(tx, "stopped", f"{rec.name} {why}", node=head, **ids)
                return kept
            tx.execute(f"DELETE FROM replicas WHERE {_KEY}", rec.key)
            self._event(tx, "released", f"{rec.name} {why}", node=head, **ids)
            return None


# ---- rows -------------------------------------------------------------------
def write_fences(
    tx: Tx, rec: ReplicaRecord, left: Sequence[tuple[ShardRun, str]], now: float, *, why: str,
    event: Callable[..., None],
) -> None:  # fmt: skip
    """A fence record per shard of ``rec`` in ``left`` (each with why it may still run), its
    shard marked fenced, and a ``fenced`` event (``event``: the store's ``_event``)."""
    r = rec.replica
    ids = {"model": r.model, "replica": r.replica, "generation": rec.generation}
    for run, reason in left:
        tx.execute(
            f"INSERT INTO fences({_F}) VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (token) DO UPDATE "
            "SET reason=excluded.reason, checked_at=excluded.checked_at",
            (run.node, run.run_dir, run.token, r.model, r.replica, rec.generation, now, reason,
             run.pid, run.start_time, now),
        )  # fmt: skip
        tx.execute("UPDATE shards SET state='fenced', updated_at=? WHERE token=?", (now, run.token))
        event(tx, "fenced", f"{rec.name} may still run on {run.node}: {reason}", node=run.node,
              detail={"token": run.token, "run_dir": run.run_dir, "why": why}, **ids)  # fmt: skip


def _records(
    tx: Tx, *, include_down: bool, include_fenced: bool, key: tuple[str, int, int] | None = None
) -> list[ReplicaRecord]:
    where, args = [], []  # type: ignore[var-annotated]
    if key is not None:
        where.append(_KEY)
        args += list(key)
    if not include_down:
        where.append("desired = ?")
        args.append(UP)
    if not include_fenced:
        where.append("status <> ?")
        args.append(FENCED)
    cond = (" WHERE " + " AND ".join(where)) if where else ""
    rows = tx.execute(f"SELECT {_R} FROM replicas{cond} ORDER BY model, replica, generation", args).fetchall()
    if not rows:
        return []
    shards: dict[tuple[str, int, int], list[Any]] = {}
    scond = f" WHERE {_KEY}" if key is not None else ""
    for s in tx.execute(f"SELECT {_S} FROM shards{scond} ORDER BY model, replica, generation, rank",
                        list(key) if key is not None else []).fetchall():  # fmt: skip
        shards.setdefault((s[0], s[1], s[2]), []).append(s)
    return [_record(r, shards.get((r[0], r[1], r[2]), [])) for r in rows]


def _record(row: Any, shards: list[Any]) -> ReplicaRecord:
    (model, replica, gen, profile, engine, fabric, gpu_class, cpus, memory_mib, status, desired, endpoint, port,
     extra, owner, started, restarts, detail, revision, updated) = row  # fmt: skip
    placed = tuple(Shard(s[4], _parse_ints(s[5]), tuple(h for h in s[6].split(",") if h)) for s in shards)
    rep = Replica(model, replica, profile, engine, placed, fabric=fabric, gpu_class=gpu_class, cpus=cpus,
                  memory_mib=memory_mib)  # fmt: skip
    runs: tuple[ShardRun, ...] = ()
    if shards and all(s[7] is not None and s[8] is not None for s in shards):
        runs = tuple(
            ShardRun(s[4], s[7], s[8], s[9], s[10], tuple(u for u in (s[12] or "").split(",") if u), s[11])
            for s in shards
        )
    return ReplicaRecord(
        rep,
        generation=gen,
        status=status,
        desired=desired,
        endpoint=endpoint,
        port=port,
        shards=runs,
        started_at=started,
        restarts=restarts,
        detail=detail,
        updated_at=updated,
        extra_ports=_parse_ints(extra),
        owner=owner,
        revision=revision,
    )


def _row(rec: ReplicaRecord, now: float) -> tuple[Any, ...]:
    r = rec.replica
    return (r.model, r.replica, rec.generation, r.profile, r.engine, r.fabric, r.gpu_class, r.cpus, r.memory_mib,
            rec.status, rec.desired, rec.endpoint, rec.port, _ints(rec.extra_ports), rec.owner, rec.started_at,
            rec.restarts, rec.detail, rec.revision, now)  # fmt: skip


def _shard_state(status: str, run: ShardRun) -> str:
    if status in (STOPPED, FENCED):
        return status
    return "running" if run.pid is not None else "starting"


def _ints(values: Iterable[int]) -> str:
    return ",".join(str(int(v)) for v in values)


def _parse_ints(text: str | None) -> tuple[int, ...]:
    return tuple(int(v) for v in (text or "").split(",") if v)


def _holds(rec: ReplicaRecord) -> Iterator[tuple[str, str, int]]:
    for s in rec.replica.shards:
        for g in s.gpus:
            yield "gpu", s.node, g
    if rec.replica.shards:
        head = rec.replica.shards[0].node
        for p in (rec.port, *rec.extra_ports):
            if p is not None:
                yield "port", head, p


def gpu_uuids(tx: Tx, nodes: set[str] | None = None) -> dict[tuple[str, int], str]:
    """Per (node, GPU index) of ``nodes`` (default: all), the GPU's UUID as the stored facts
    give it."""
    out: dict[tuple[str, int], str] = {}
    if nodes is None:
        rows = tx.execute("SELECT name, facts FROM nodes").fetchall()
    else:
        rows = [
            (n, r[0])
            for n in sorted(nodes)
            if (r := tx.execute("SELECT facts FROM nodes WHERE name=?", (n,)).fetchone())
        ]
    for name, doc in rows:
        try:
            gpus = json.loads(doc).get("gpus") or []
        except (ValueError, AttributeError):
            continue
        for g in gpus:
            if isinstance(g, dict) and g.get("uuid") and isinstance(g.get("index"), int):
                out[(name, g["index"])] = str(g["uuid"])
    return out


def _owner(tx: Tx, kind: str, node: str, item: int, uuid: str | None) -> Any:
    """Who holds that GPU or port, if anyone: by UUID, else at that index."""
    if uuid is not None:
        row = tx.execute("SELECT model, replica, generation FROM holds WHERE uuid=?", (uuid,)).fetchone()
        if row is not None:
            return row
        return tx.execute(
            "SELECT model, replica, generation FROM holds WHERE node=? AND kind=? AND item=? AND uuid IS NULL",
            (node, kind, item),
        ).fetchone()
    return tx.execute(
        "SELECT model, replica, generation FROM holds WHERE node=? AND kind=? AND item=?", (node, kind, item)
    ).fetchone()


def _next_generation(tx: Tx, model: str, replica: int) -> int:
    tx.execute(
        "INSERT INTO generations(model, replica, last) VALUES (?,?,0) ON CONFLICT (model, replica) DO NOTHING",
        (model, replica),
    )
    tx.execute("UPDATE generations SET last = last + 1 WHERE model=? AND replica=?", (model, replica))
    return int(tx.execute("SELECT last FROM generations WHERE model=? AND replica=?", (model, replica)).fetchone()[0])


def _where(r: Replica) -> str:
    parts = []
    for s in r.shards:
        parts.append(f"{s.node} GPU {_ints(s.gpus)}" if s.gpus else s.node)
    return ", ".join(parts) or "no node"


def _version(tx: Tx) -> int:
    row = tx.execute("SELECT value FROM meta WHERE key='state_version'").fetchone()
    return int(row[0]) if row else 0


def _stale(path: Any, version: int, expected: int) -> StaleVersion:
    return StaleVersion(f"{path}: the state moved on (version {version}, the plan was made at {expected})")


__all__ = ["UP", "LaunchTable", "Reservation", "StaleRecord", "StaleVersion"]
