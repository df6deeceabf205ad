"""Fence records and the holds of replicas no longer wanted (a part of ``Store``).

A shard whose stop could not be confirmed (its node did not answer, processes, its port or
GPU processes were left) may still run: its replica stays ``fenced`` with its GPUs and ports
held, and a fence record names what may run (node, run folder, marker, generation, since,
why), until a later stop on that node finds nothing of it left (:meth:`unfence`). Until
then placement reads those GPUs as taken, as it reads those of a replica being stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cluster_cli.state.backend import Tx
from cluster_cli.state.launches import (
    _F,
    _KEY,
    _R,
    _bump,
    _holds,
    _ints,
    _owner,
    _records,
    _row,
    gpu_uuids,
    write_fences,
)
from cluster_cli.state.records import DOWN, FENCED, STOPPED, Fence, ReplicaRecord, ShardRun, replica_name


class FenceTable:
    """Mixed into ``Store``."""

    path: Any

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...

    def fenced_gpus(self) -> dict[str, dict[int, str]]:
        """Per node, the GPUs (index -> who) held by fenced replicas: no one may use them until
        a stop confirms that nothing of those replicas runs."""
        with self._read() as tx:
            return _held_gpus(tx, "r.status = ?", (FENCED,))

    def held_apart(self) -> dict[str, dict[int, str]]:
        """Per node, the GPUs (index -> who, and why) that replicas no longer wanted hold: those
        fenced, and those being stopped (wanted down, not yet released). Placement must not
        give them to another; :meth:`records` does not list their replicas."""
        with self._read() as tx:
            return _held_gpus(tx, "(r.status = ? OR r.desired = ?)", (FENCED, DOWN), why=True)

    def fences(self, node: str | None = None) -> list[Fence]:
        sql = f"SELECT {_F} FROM fences" + (" WHERE node=?" if node is not None else "") + " ORDER BY since, token"
        with self._read() as tx:
            rows = tx.execute(sql, (node,) if node is not None else ()).fetchall()
        return [Fence(*r) for r in rows]

    def unfence(self, token: str, *, why: str = "a stop found nothing of it left") -> bool:
        """A fenced shard's stop was confirmed: its fence goes; once none of its replica is
        left, the replica's GPUs and ports are freed (and its row goes, or stays stopped if
        it was wanted down). False when there was no such fence."""
        with self._tx() as tx:
            row = tx.execute("SELECT node, model, replica, generation FROM fences WHERE token=?", (token,)).fetchone()
            if row is None:
                return False
            node, model, replica, gen = row
            tx.execute("DELETE FROM fences WHERE token=?", (token,))
            tx.execute("UPDATE shards SET state='stopped', updated_at=? WHERE token=?", (time.time(), token))
            ids = {"node": node, "model": model, "replica": replica, "generation": gen}
            self._event(tx, "unfenced", f"{replica_name(model, replica)} on {node}: {why}", **ids)
            more = tx.execute(f"SELECT COUNT(*) FROM fences WHERE {_KEY}", (model, replica, gen)).fetchone()[0]
            status = tx.execute(f"SELECT status, desired FROM replicas WHERE {_KEY}", (model, replica, gen)).fetchone()
            if more or status is None or status[0] != FENCED:
                return True
            _bump(tx)  # its GPUs are free again: plans made before must be made again
            tx.execute(f"DELETE FROM holds WHERE {_KEY}", (model, replica, gen))
            if status[1] == DOWN:
                tx.execute(
                    f"UPDATE replicas SET status=?, revision=revision+1, updated_at=? WHERE {_KEY}",
                    (STOPPED, time.time(), model, replica, gen),
                )
            else:
                tx.execute(f"DELETE FROM replicas WHERE {_KEY}", (model, replica, gen))
            self._event(tx, "released", f"{replica_name(model, replica)} generation {gen} released: nothing of it runs",
                        model=model, replica=replica, generation=gen)  # fmt: skip
            return True

    def fence_started(self, rec: ReplicaRecord, left: Sequence[tuple[ShardRun, str]], *, why: str) -> ReplicaRecord:
        """Record that shards a run started after another command changed their row (a
        ``down``, a release) may still run: whatever that row's revision, the row is kept or
        made again ``fenced`` (wanted down), its GPUs and ports booked again where no one else
        took them meanwhile, and a fence written per shard. Never refused: forgetting what may
        run is the one thing that must not happen. A GPU another replica booked meanwhile is
        said in a ``conflict`` event."""
        now = time.time()
        r = rec.replica
        ids = {"model": r.model, "replica": r.replica, "generation": rec.generation}
        with self._tx(bump=True) as tx:
            got = _records(tx, include_down=True, include_fenced=True, key=rec.key)
            if got:
                tx.execute(
                    f"UPDATE replicas SET status=?, desired=?, endpoint=NULL, detail=?, revision=revision+1, "
                    f"updated_at=? WHERE {_KEY}",
                    (FENCED, DOWN, why, now, *rec.key),
                )
            else:
                kept = replace(rec, status=FENCED, desired=DOWN, endpoint=None, detail=why, revision=1)
                tx.execute(f"INSERT INTO replicas({_R}, created_at) VALUES ({','.join('?' * 21)})",
                           (*_row(kept, now), now))  # fmt: skip
                for rank, sh in enumerate(r.shards):
                    tx.execute(
                        "INSERT INTO shards(model, replica, generation, rank, node, gpus, hcas, state, updated_at) "
                        "VALUES (?,?,?,?,?,?,?,?,?)",
                        (*rec.key, rank, sh.node, _ints(sh.gpus), ",".join(sh.hcas), "stopped", now),
                    )
            for rank, run in enumerate(rec.shards):
                tx.execute(
                    f"UPDATE shards SET run_dir=?, token=?, pid=?, start_time=?, boot_id=?, state=?, updated_at=? "
                    f"WHERE {_KEY} AND rank=?",
                    (run.run_dir, run.token, run.pid, run.start_time, run.boot_id, "stopped", now, *rec.key, rank),
                )
            uuids = gpu_uuids(tx, {sh.node for sh in r.shards if sh.gpus})
            for kind, node, item in _holds(rec):
                uuid = uuids.get((node, item)) if kind == "gpu" else None
                owner = _owner(tx, kind, node, item, uuid)
                if owner is None:
                    tx.execute("INSERT INTO holds VALUES (?,?,?,?,?,?,?)", (node, kind, item, uuid, *rec.key))
                elif tuple(owner) != rec.key:
                    what = f"GPU {item}" if kind == "gpu" else f"port {item}"
                    self._event(tx, "conflict", f"{node}: {what} is held by {replica_name(owner[0], owner[1])} "
                                f"while {rec.name} generation {rec.generation} may still use it", node=node, **ids)  # fmt: skip
            write_fences(tx, rec, left, now, why=why, event=self._event)
            out = _records(tx, include_down=True, include_fenced=True, key=rec.key)
        return out[0] if out else replace(rec, status=FENCED, desired=DOWN)

    def fence_checked(self, token: str, reason: str) -> None:
        """A fenced shard was checked again and may still run (``reason``): noted, no event."""
        with self._tx() as tx:
            tx.execute("UPDATE fences SET reason=?, checked_at=? WHERE token=?", (reason, time.time(), token))


def _held_gpus(tx: Tx, where: str, args: tuple[Any, ...], *, why: bool = False) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {}
    rows = tx.execute(
        "SELECT h.node, h.item, h.model, h.replica, h.generation, r.status FROM holds h JOIN replicas r "
        "ON r.model = h.model AND r.replica = h.replica AND r.generation = h.generation "
        f"WHERE h.kind = 'gpu' AND {where}",
        args,
    ).fetchall()
    for node, item, model, replica, gen, status in rows:
        who = f"{replica_name(model, replica)} generation {gen}"
        if why:
            who += ", whose stop is not confirmed" if status == FENCED else ", being stopped"
        out.setdefault(node, {})[item] = who
    return out
