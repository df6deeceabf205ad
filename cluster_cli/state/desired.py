"""The desired state: the catalog the last ``up`` applied (a part of ``Store``).

Each catalog ``up`` applies is kept as a snapshot with a version of its own (1, 2, ...), and
only when it differs from the last one, so a reconcile loop knows what is wanted without the
operator's file, and sees a newer ``up``'s catalog as a new version. The last
``KEEP_CATALOGS`` are kept.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster_cli.state.backend import Tx

KEEP_CATALOGS = 20


@dataclass(frozen=True)
class StoredCatalog:
    version: int
    doc: dict[str, Any]
    source: str | None
    actor: str
    applied_at: float
    digest: str


def digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Desired:
    """Mixed into ``Store``."""

    actor: str

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...

    def save_catalog(self, doc: dict[str, Any], *, source: str | None = None) -> int:
        """Record ``doc`` (a catalog, as plain data) as the desired state; its catalog version.
        The same catalog again is no new version."""
        with self._tx() as tx:
            return self._save_catalog(tx, doc, source)

    def _save_catalog(self, tx: Tx, doc: dict[str, Any], source: str | None) -> int:
        """``save_catalog`` within ``tx`` (``reserve`` books a plan and its catalog at once)."""
        d = digest(doc)
        row = tx.execute("SELECT version, digest FROM catalogs ORDER BY version DESC LIMIT 1").fetchone()
        if row is not None and row[1] == d:
            return int(row[0])
        version = (int(row[0]) if row else 0) + 1
        tx.execute(
            "INSERT INTO catalogs(version, digest, doc, source, actor, applied_at) VALUES (?,?,?,?,?,?)",
            (version, d, json.dumps(doc, sort_keys=True), source, self.actor, time.time()),
        )
        tx.execute("DELETE FROM catalogs WHERE version <= ?", (version - KEEP_CATALOGS,))
        models = ", ".join(f"{m.get('name')}×{m.get('replicas', 1)}" for m in doc.get("models") or ())
        self._event(tx, "catalog", f"catalog version {version} applied: {models or 'no models'}",
                    detail={"version": version, "source": source, "digest": d})  # fmt: skip
        return version

    def catalog(self, version: int | None = None) -> StoredCatalog | None:
        """The catalog last applied (or catalog ``version``), if any."""
        sql = "SELECT version, doc, source, actor, applied_at, digest FROM catalogs"
        args: tuple[Any, ...] = ()
        if version is not None:
            sql += " WHERE version = ?"
            args = (version,)
        sql += " ORDER BY version DESC LIMIT 1"
        with self._read() as tx:
            row = tx.execute(sql, args).fetchone()
        if row is None:
            return None
        v, doc, source, actor, at, dg = row
        return StoredCatalog(int(v), json.loads(doc), source, actor, at, dg)
