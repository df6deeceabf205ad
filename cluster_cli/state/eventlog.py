"""Events: what happened to the cluster, and who did it (a part of ``Store``).

Each event is one row: when, what kind (``schema.EVENT_KINDS``), the node, the replica
(``MODEL/N``) and its generation where there is one, the actor (the command or loop that
wrote it), a one-line message and a JSON detail. They are written in the same transaction as
the change they describe, so an event is never missing for a change nor present for one that
rolled back. They are kept for ``events_keep_days`` (default 30) and at most
``events_keep_max`` rows (default 100,000), both in the state's ``meta``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster_cli.state.backend import Tx
from cluster_cli.state.meta import set_meta
from cluster_cli.state.records import replica_name

KEEP_DAYS = 30.0
KEEP_MAX = 100_000
_PRUNE_EVERY = 500  # events written by one handle between prunes


@dataclass(frozen=True)
class Event:
    id: int
    at: float
    kind: str
    node: str | None
    model: str | None
    replica: int | None
    generation: int | None
    actor: str
    message: str
    detail: dict[str, Any] | None

    @property
    def name(self) -> str | None:
        """``MODEL/N``, when the event is about a replica."""
        return replica_name(self.model, self.replica) if self.model is not None and self.replica is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "kind": self.kind,
            "node": self.node,
            "replica": self.name,
            "generation": self.generation,
            "actor": self.actor,
            "message": self.message,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Retention:
    days: float = KEEP_DAYS
    max_events: int = KEEP_MAX


class EventLog:
    """Writing, reading and pruning events; mixed into ``Store``."""

    actor: str
    _pruned: int

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...

    def _event(
        self,
        tx: Tx,
        kind: str,
        message: str,
        *,
        node: str | None = None,
        model: str | None = None,
        replica: int | None = None,
        generation: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        tx.execute(
            "INSERT INTO events(at, kind, node, model, replica, generation, actor, message, detail) "
            "VALUES (?,?,?,?,?,?,?,?,?)",
            (time.time(), kind, node, model, replica, generation, self.actor, message,
             json.dumps(detail, sort_keys=True) if detail else None),
        )  # fmt: skip
        self._pruned += 1
        if self._pruned >= _PRUNE_EVERY:
            self._prune(tx)

    def record_event(
        self,
        kind: str,
        message: str,
        *,
        node: str | None = None,
        model: str | None = None,
        replica: int | None = None,
        generation: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Record an event of its own (one that no state change carries)."""
        with self._tx() as tx:
            self._event(tx, kind, message, node=node, model=model, replica=replica, generation=generation,
                        detail=detail)  # fmt: skip

    def events(
        self,
        limit: int | None = 100,
        *,
        since: float | None = None,
        node: str | None = None,
        replica: str | None = None,
        after_id: int | None = None,
    ) -> list[Event]:
        """The newest ``limit`` events matching the filters, newest last. ``replica`` is
        ``MODEL/N`` or a model's name; ``after_id``: only those written after that one."""
        where, args = [], []  # type: ignore[var-annotated]
        if since is not None:
            where.append("at >= ?")
            args.append(since)
        if node is not None:
            where.append("node = ?")
            args.append(node)
        if replica is not None:
            model, _, n = replica.rpartition("/")
            if model and n.isdigit():
                where.append("model = ? AND replica = ?")
                args += [model, int(n)]
            else:
                where.append("model = ?")
                args.append(replica)
        if after_id is not None:
            where.append("id > ?")
            args.append(after_id)
        sql = "SELECT id, at, kind, node, model, replica, generation, actor, message, detail FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        with self._read() as tx:
            rows = tx.execute(sql, args).fetchall()
        return [_event(r) for r in reversed(rows)]

    def last_event_id(self) -> int:
        with self._read() as tx:
            row = tx.execute("SELECT MAX(id) FROM events").fetchone()
        return int(row[0] or 0)

    def retention(self) -> Retention:
        with self._read() as tx:
            return _retention(tx)

    def set_retention(self, *, days: float | None = None, max_events: int | None = None) -> Retention:
        """Keep events for ``days`` and at most ``max_events`` of them; prunes now."""
        with self._tx() as tx:
            for key, value in (("events_keep_days", days), ("events_keep_max", max_events)):
                if value is not None:
                    set_meta(tx, key, str(value))
            self._prune(tx)
            return _retention(tx)

    def _prune(self, tx: Tx) -> None:
        """Drop events older than the retention, then all but the newest ``max_events``."""
        self._pruned = 0
        keep = _retention(tx)
        # The newest event always stays: ids are never reused (a follower's cursor stays valid).
        tx.execute(
            "DELETE FROM events WHERE at < ? AND id < (SELECT MAX(id) FROM events)", (time.time() - keep.days * 86400,)
        )
        row = tx.execute("SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?", (keep.max_events,)).fetchone()
        if row is not None:
            tx.execute("DELETE FROM events WHERE id <= ?", (row[0],))


def _retention(tx: Tx) -> Retention:
    rows = dict(
        tx.execute("SELECT key, value FROM meta WHERE key IN ('events_keep_days', 'events_keep_max')").fetchall()
    )
    try:
        days = float(rows.get("events_keep_days", KEEP_DAYS))
        most = int(rows.get("events_keep_max", KEEP_MAX))
    except ValueError:
        days, most = KEEP_DAYS, KEEP_MAX
    return Retention(days, most)


def _event(row: Any) -> Event:
    id_, at, kind, node, model, replica, generation, actor, message, detail = row
    try:
        doc = json.loads(detail) if detail else None
    except ValueError:
        doc = {"text": detail}
    return Event(id_, at, kind, node, model, replica, generation, actor or "", message, doc)
