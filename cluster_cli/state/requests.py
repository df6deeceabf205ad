"""Requests to the running supervisor (a part of ``Store``): a ``drain`` asks it to move a
node's replicas off, and reads back what it did. Kept in the ``meta`` table, one row per node
(``drain:NODE`` while asked, ``drained:NODE`` once done), so no migration is needed; each
step is an event."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster_cli.state.backend import Tx
from cluster_cli.state.meta import set_meta

_ASKED, _DONE = "drain:", "drained:"


@dataclass(frozen=True)
class DrainRequest:
    node: str
    reason: str
    deadline_s: float
    force: bool
    requested_at: float
    by: str

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "reason": self.reason, "deadline_s": self.deadline_s, "force": self.force,
                "requested_at": self.requested_at, "by": self.by}  # fmt: skip


class Requests:
    """Mixed into ``Store``."""

    actor: str

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...

    def request_drain(self, node: str, *, reason: str, deadline_s: float, force: bool) -> DrainRequest:
        """Ask the supervisor to drain ``node`` (a request already there is replaced); an
        answer of an earlier one is dropped."""
        req = DrainRequest(node, reason, deadline_s, force, time.time(), self.actor)
        with self._tx() as tx:
            tx.execute("DELETE FROM meta WHERE key=?", (_DONE + node,))
            set_meta(tx, _ASKED + node, json.dumps(req.to_dict()))
            self._event(tx, "note", f"drain of {node} asked of the supervisor ({reason})", node=node)
        return req

    def drain_requests(self) -> list[DrainRequest]:
        """The drains asked and not yet done, oldest first."""
        with self._read() as tx:
            rows = tx.execute("SELECT value FROM meta WHERE key LIKE ?", (_ASKED + "%",)).fetchall()
        return sorted((DrainRequest(**json.loads(r[0])) for r in rows), key=lambda r: r.requested_at)

    def withdraw_drain(self, node: str) -> bool:
        """Take back a drain asked of the supervisor (it did not start it); whether one was there."""
        with self._tx() as tx:
            return bool(tx.execute("DELETE FROM meta WHERE key=?", (_ASKED + node,)).rowcount)

    def finish_drain(self, node: str, result: dict[str, Any]) -> None:
        """The supervisor's answer to the drain of ``node``: the request goes, ``result`` stays
        for the asker (``drain_result``)."""
        with self._tx() as tx:
            tx.execute("DELETE FROM meta WHERE key=?", (_ASKED + node,))
            set_meta(tx, _DONE + node, json.dumps(result))
            done = "every replica moved" if result.get("complete") else "not every replica could be moved"
            self._event(tx, "note", f"drain of {node} done by the supervisor: {done}", node=node)

    def drain_result(self, node: str) -> dict[str, Any] | None:
        """What the supervisor did of the drain of ``node``, once it is done (taken: read once)."""
        with self._tx() as tx:
            row = tx.execute("SELECT value FROM meta WHERE key=?", (_DONE + node,)).fetchone()
            if row is None:
                return None
            tx.execute("DELETE FROM meta WHERE key=?", (_DONE + node,))
            return dict(json.loads(row[0]))
