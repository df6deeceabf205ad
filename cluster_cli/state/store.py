"""The state store: the single source of truth that every clusterctl process shares.

Several processes share one state (a long-running ``supervise`` and an operator's
``cordon``, two ``up`` runs). Every write is one transaction that takes the write lock up
front and re-checks the schema version; observed-state writes compare and set a row's
revision; a write made under a lease is refused once the lease's epoch is stale. Neither
writer ever loses the other's work.

* ``nodes``        facts from the last probe, one row per node (JSON: the facts are a document).
* ``node_status``  ready, unreachable, lost, fencing; heartbeats (never a new state version).
* ``cordons``      operator cordons, a table discover never writes.
* ``replicas``, ``shards``, ``holds``, ``generations``: see ``launches.py``; ``fences``: ``fences.py``.
* ``catalogs``, ``leases``, ``events``: see ``desired.py``, ``leases.py``, ``eventlog.py``.
* ``meta``         schema version, the state version (moved by every change placement reads),
                   the inventory the state follows.

SQL lives in this package only, and the database behind it is a :class:`Backend`
(``sqlite.py``; the SQL is portable, see ``backend.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cluster_cli.errors import StateError
from cluster_cli.facts import NodeFacts
from cluster_cli.state import schema
from cluster_cli.state.backend import Backend, Tx
from cluster_cli.state.desired import Desired
from cluster_cli.state.eventlog import EventLog
from cluster_cli.state.fences import FenceTable
from cluster_cli.state.gpucordons import PROBLEM as GPU_CORDON
from cluster_cli.state.gpucordons import GpuCordons, apply_gpu_cordons, gpu_cordons_of
from cluster_cli.state.launches import LaunchTable
from cluster_cli.state.leases import Lease, Leases
from cluster_cli.state.meta import bump as _bump
from cluster_cli.state.meta import get_meta as _meta
from cluster_cli.state.meta import set_meta as _set_meta
from cluster_cli.state.modelsizes import ModelSizes
from cluster_cli.state.records import DOWN
from cluster_cli.state.requests import Requests
from cluster_cli.state.schema import NODE_STATES, SCHEMA_VERSION
from cluster_cli.state.sqlite import SqliteBackend

READY, UNREACHABLE, LOST, FENCING = NODE_STATES


@dataclass(frozen=True)
class PlanView:
    """What a plan is made from, read in one snapshot: the nodes' facts with their cordons, the
    replicas held, the GPUs held apart (by fenced replicas, or ones being stopped), and the
    state version they all belong to."""

    nodes: list[NodeFacts]
    records: list[Any]
    fenced: dict[str, dict[int, str]]
    version: int
    wanted_down: frozenset[str] = frozenset()  # MODEL/N whose latest generation a down took down


@dataclass(frozen=True)
class NodeStatus:
    """A node's liveness as the control plane last saw it (not its hardware: that is its facts)."""

    node: str
    status: str
    since: float
    last_heartbeat: float | None = None
    boot_id: str | None = None
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "status": self.status,
            "since": self.since,
            "last_heartbeat": self.last_heartbeat,
            "boot_id": self.boot_id,
            "detail": self.detail,
        }


class Store(LaunchTable, FenceTable, EventLog, Leases, Desired, Requests, GpuCordons, ModelSizes):
    """A handle on the state. Cheap to open; use as a context manager. ``actor`` names who
    writes (``up``, ``cordon``, ``supervise``...) in the events it records."""

    check_creatable = staticmethod(SqliteBackend.check_creatable)

    def __init__(
        self,
        path: Path | str,
        *,
        create: bool = True,
        readonly: bool = False,
        timeout_s: float = 30.0,
        actor: str = "",
        backend: Backend | None = None,
    ) -> None:
        """Open (by default create) the state. ``readonly`` never writes: for commands that only
        read (an older schema is then read through a migrated in-memory copy)."""
        self.path = Path(path)
        self.actor = actor
        self.lease: Lease | None = None  # set: every write is refused once its epoch is stale
        self._b: Any = backend or SqliteBackend(self.path, create=create, readonly=readonly, timeout_s=timeout_s)
        self._pruned = 0
        self.on_disk_schema = SCHEMA_VERSION  # a read-only open of an older state reads a migrated copy
        try:
            if readonly:
                with self._b.read() as tx:
                    self.schema = self._check_schema(_meta(tx, "schema_version"))
                self.on_disk_schema = self.schema
                if self.schema < SCHEMA_VERSION:
                    self._b.in_memory_copy()
                    with self._b.write() as tx:
                        schema.migrate(tx, self.schema)
                    self.schema = SCHEMA_VERSION
                return
            self._open_for_writing()
        except BaseException:
            with suppress(Exception):
                self._b.close()
            raise

    def _open_for_writing(self) -> None:
        with self._b.write() as tx:
            tx.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = _meta(tx, "schema_version")
            if found is None:
                schema.create(tx, self._b.dialect)
            else:
                version = self._check_schema(found)
                if version < SCHEMA_VERSION:
                    # An older state is upgraded in place, in this transaction: whole, or not at all;
                    # never under a running supervisor (it holds the lease, and an older schema).
                    self._refuse_migration_under_lease(tx, version)
                    schema.migrate(tx, version)
                    self._event(tx, "migrate", f"state schema {version} upgraded to {SCHEMA_VERSION}")
            self._prune(tx)
        self.schema = SCHEMA_VERSION

    def _refuse_migration_under_lease(self, tx: Tx, version: int) -> None:
        if "leases" not in self._b.tables(tx):
            return
        row = tx.execute(
            "SELECT name, holder, host, pid FROM leases WHERE expires_at > ? ORDER BY name", (time.time(),)
        ).fetchone()
        if row is not None:
            name, holder, host, pid = row
            raise StateError(
                f"{self.path}: state schema {version} must be upgraded to {SCHEMA_VERSION}, but {holder} "
                f"(pid {pid} on {host}) holds the {name} lease; stop it, then run this command again"
            )

    def _check_schema(self, version: str | None) -> int:
        try:
            number = int(version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise StateError(f"{self.path}: not a usable state database (schema version {version!r})") from None
        if number > SCHEMA_VERSION:
            raise StateError(
                f"{self.path}: state schema {version} is newer than this clusterctl understands "
                f"({SCHEMA_VERSION}); upgrade clusterctl"
            )
        return number

    # ---- plumbing ---------------------------------------------------------
    def close(self) -> None:
        self._b.close()

    def interrupt(self) -> None:
        """End a wait for another process's write lock at once (from any thread)."""
        self._b.interrupt()

    def clear_interrupt(self) -> None:
        """Forget an interrupt that found no wait to end."""
        self._b.clear_interrupt()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self, *, bump: bool = False) -> Iterator[Tx]:
        """One write transaction: the lock taken up front, the schema checked again (a newer
        clusterctl may have migrated it meanwhile), the lease's epoch checked when this handle
        writes under one; ``bump`` moves the state version."""
        with self._b.write() as tx:
            found = _meta(tx, "schema_version")
            if found is not None and found != str(SCHEMA_VERSION):
                raise StateError(
                    f"{self.path}: state schema {found} is not the {SCHEMA_VERSION} this clusterctl "
                    "writes (another clusterctl changed it); upgrade clusterctl"
                )
            if self.lease is not None:
                self._check_lease(tx, self.lease)
            if bump:
                _bump(tx)
            yield tx

    # Kept for callers that write a transaction of their own (a bumped version).
    def write(self) -> Any:
        return self._tx(bump=True)

    @contextmanager
    def snapshot(self) -> Iterator[Store]:
        """Reads inside the block all see one state version (a read transaction).

        Without it each read is its own transaction: a cordon committed between reading the
        nodes and reading the version would give a plan labelled with a state it did not use.
        Nested use is a no-op.
        """
        with self._b.read():
            yield self

    def _read(self) -> Any:
        return self._b.read()

    def version(self) -> int:
        with self._read() as tx:
            value = _meta(tx, "state_version")
        return int(value) if value else 0

    def inventory(self) -> Path | None:
        """The inventory the last ``discover`` read (absolute), if any."""
        with self._read() as tx:
            value = _meta(tx, "inventory")
        return Path(value) if value else None

    # ---- nodes ------------------------------------------------------------
    def _facts(self, name: str, doc: str) -> NodeFacts:
        try:
            return NodeFacts.from_dict(json.loads(doc))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"{self.path}: node {name}: unreadable facts ({e}); run 'clusterctl discover' "
                             "with a fresh --state, or delete that node's row") from None  # fmt: skip

    def save_discovery(
        self,
        facts: Iterable[NodeFacts],
        *,
        inventory: Path | str | None = None,
        boot_ids: dict[str, str] | None = None,
    ) -> bool:
        """Upsert the facts of one probe run in one transaction; True when the state version
        moved.

        A node that did not answer keeps its last known hardware facts but is marked
        unreachable with the error. Cordons are never touched here. ``inventory`` (an
        absolute path) is recorded as the one the state follows, for commands run without -i.
        The state version moves only when what placement reads changed (hardware, GPU
        health and processes, reachability, fabrics): a probe that finds the fleet as it was
        leaves a plan made before it valid. Each node's status follows its answer (with its
        boot id, where ``boot_ids`` has it).
        """
        now = time.time()
        moved = False
        with self._tx() as tx:
            if inventory is not None and _meta(tx, "inventory") != str(inventory):
                _set_meta(tx, "inventory", str(inventory))
            for f in facts:
                row = tx.execute("SELECT facts, probed_at FROM nodes WHERE name=?", (f.name,)).fetchone()
                old = None
                if row is not None:
                    with suppress(StateError):  # an unreadable old row is replaced
                        old = self._facts(f.name, row[0])
                    if row[1] is not None and f.probed_at is not None and f.probed_at < row[1]:
                        continue  # a probe that finishes last but probed earlier never replaces newer facts
                if not f.reachable and old is not None:
                    # The old hardware facts, stamped with this probe's time.
                    f = replace(
                        old,
                        host=f.host,
                        reachable=False,
                        error=f.error,
                        labels=f.labels,
                        fabric=f.fabric,
                        probed_at=f.probed_at,
                        last_seen_at=old.probed_at if old.reachable else old.last_seen_at,
                    )
                doc = f.to_dict()
                doc.pop("cordoned", None)
                doc.pop("cordon_reason", None)
                for g in doc.get("gpus") or ():  # GPU cordons live apart, as node cordons do
                    kept = [x for x in g.get("problems", ()) if not x.startswith(GPU_CORDON + ":")]
                    if len(kept) != len(g.get("problems", ())):
                        g["problems"] = kept
                        g["free"] = g["free"] or (f.reachable and not kept)
                if old is None or row is None or _placement_view(old) != _placement_view(f):
                    moved = True
                tx.execute(
                    "INSERT INTO nodes(name, host, reachable, error, facts, probed_at, updated_at) "
                    "VALUES (?,?,?,?,?,?,?) ON CONFLICT (name) DO UPDATE SET host=excluded.host, "
                    "reachable=excluded.reachable, error=excluded.error, facts=excluded.facts, "
                    "probed_at=excluded.probed_at, updated_at=excluded.updated_at",
                    (f.name, f.host, int(f.reachable), f.error, json.dumps(doc), f.probed_at, now),
                )
                boot = (boot_ids or {}).get(f.name) if f.reachable else None
                self._node_seen(tx, f.name, f.reachable, f.probed_at or now, error=f.error, boot_id=boot)
            if moved:
                _bump(tx)
            self._event(tx, "discover", "facts saved" + ("" if moved else " (nothing placement reads changed)"))
        return moved

    def nodes(self, names: Iterable[str] | None = None, *, unreadable: list[str] | None = None) -> list[NodeFacts]:
        """Stored facts with cordons applied, sorted by name (optionally only ``names``).

        A row that cannot be read is an error, unless ``unreadable`` is given: then its
        node's name goes there and the row is left out (a discover replaces it)."""
        with self._read() as tx:  # the cordons and the facts of one state version
            cordons = _cordons(tx)
            gpu_cordons = gpu_cordons_of(tx)
            rows = tx.execute("SELECT name, facts FROM nodes ORDER BY name").fetchall()
        wanted = None if names is None else set(names)
        out = []
        for name, facts in rows:
            if wanted is not None and name not in wanted:
                continue
            try:
                f = self._facts(name, facts)
            except StateError:
                if unreadable is None:
                    raise
                unreadable.append(name)
                continue
            c = cordons.get(name)
            f = apply_gpu_cordons(f, gpu_cordons)
            out.append(replace(f, cordoned=c is not None, cordon_reason=c["reason"] if c else None))
        return out

    def plan_view(self, names: Iterable[str] | None = None, *, unreadable: list[str] | None = None) -> PlanView:
        """The facts, cordons, replicas, fenced GPUs and state version of one snapshot: a cordon
        committed while a plan reads them is either in all of them or in none."""
        with self.snapshot():
            latest: dict[str, Any] = {}
            for r in self.records(include_down=True, include_fenced=True):
                if r.name not in latest or r.generation > latest[r.name].generation:
                    latest[r.name] = r
            down = frozenset(n for n, r in latest.items() if r.desired == DOWN)
            return PlanView(self.nodes(names, unreadable=unreadable), self.records(), self.held_apart(),
                            self.version(), down)  # fmt: skip

    # ---- node status ------------------------------------------------------
    def _node_seen(
        self, tx: Tx, node: str, answered: bool, at: float, *, error: str | None = None, boot_id: str | None = None
    ) -> None:
        """A probe's or heartbeat's answer (or silence): ready, or unreachable (a lost or
        fencing node stays so until it answers)."""
        row = tx.execute("SELECT status, boot_id FROM node_status WHERE node=?", (node,)).fetchone()
        if answered:
            status, detail = READY, None
        else:
            status = row[0] if row is not None and row[0] in (LOST, FENCING) else UNREACHABLE
            detail = error
        self._set_status(tx, node, status, at, row, detail=detail, boot_id=boot_id, heartbeat=at if answered else None)

    def _set_status(
        self, tx: Tx, node: str, status: str, at: float, row: Any, *, detail: str | None,
        boot_id: str | None, heartbeat: float | None,
    ) -> bool:  # fmt: skip
        now = time.time()
        if row is None:
            tx.execute(
                "INSERT INTO node_status(node, status, since, last_heartbeat, boot_id, detail, updated_at) "
                "VALUES (?,?,?,?,?,?,?)",
                (node, status, at, heartbeat, boot_id, detail, now),
            )
            changed = True
        else:
            changed = row[0] != status
            tx.execute(
                "UPDATE node_status SET status=?, since=CASE WHEN status=? THEN since ELSE ? END, "
                "last_heartbeat=COALESCE(?, last_heartbeat), boot_id=COALESCE(?, boot_id), detail=?, updated_at=? "
                "WHERE node=?",
                (status, status, at, heartbeat, boot_id, detail, now, node),
            )
            if boot_id is not None and row[1] is not None and row[1] != boot_id:
                self._event(tx, "note", f"{node} rebooted (boot id {row[1][:8]} -> {boot_id[:8]})", node=node)
        if changed:
            self._event(tx, f"node-{status}", f"{node} {status}" + (f": {detail}" if detail else ""), node=node)
        return changed

    def set_node_status(
        self, node: str, status: str, *, detail: str | None = None, boot_id: str | None = None,
        heartbeat: float | None = None,
    ) -> bool:  # fmt: skip
        """Record a node's status (``ready``, ``unreachable``, ``lost``, ``fencing``) and its last
        heartbeat; an event when the status changes (returns whether it did). Never moves the
        state version: placement reads reachability from the facts."""
        if status not in NODE_STATES:
            raise ValueError(f"not a node status: {status!r}")
        now = time.time()
        with self._tx() as tx:
            row = tx.execute("SELECT status, boot_id FROM node_status WHERE node=?", (node,)).fetchone()
            return self._set_status(tx, node, status, now, row, detail=detail, boot_id=boot_id, heartbeat=heartbeat)

    def node_status(self) -> dict[str, NodeStatus]:
        with self._read() as tx:
            rows = tx.execute(
                "SELECT node, status, since, last_heartbeat, boot_id, detail FROM node_status ORDER BY node"
            ).fetchall()
        return {r[0]: NodeStatus(*r) for r in rows}

    # ---- cordons ----------------------------------------------------------
    def cordon(
        self, node: str, reason: str, *, inventory: Path | str | None = None, replace_inventory: bool = False
    ) -> dict[str, Any] | None:
        """Cordon ``node`` with ``reason``; a cordon already there keeps its start time and
        takes the new reason. Returns the cordon it found (``reason``, ``created_at``), if any.
        The same reason again changes nothing: no write, no new state version. ``inventory``
        (absolute), the one the node was checked against, is recorded when the state has
        none yet (a cordon before the first discover), so later commands need no ``-i``, or
        with ``replace_inventory`` in place of the one recorded (whose file is gone)."""
        with self._tx() as tx:
            if inventory is not None and (replace_inventory or _meta(tx, "inventory") is None):
                _set_meta(tx, "inventory", str(inventory))
            row = tx.execute("SELECT reason, created_at FROM cordons WHERE node=?", (node,)).fetchone()
            if row is not None and row[0] == reason:
                return {"reason": row[0], "created_at": row[1]}
            _bump(tx)
            tx.execute(
                "INSERT INTO cordons(node, reason, created_at) VALUES (?,?,?) "
                "ON CONFLICT (node) DO UPDATE SET reason=excluded.reason",
                (node, reason, time.time()),
            )
            self._event(tx, "cordon", reason if row is None else f"{reason} (was: {row[0]})", node=node)
        return None if row is None else {"reason": row[0], "created_at": row[1]}

    def uncordon(self, node: str) -> bool:
        """Lift ``node``'s cordon. False, and no write nor new state version, when it had none."""
        with self._tx() as tx:
            n = tx.execute("DELETE FROM cordons WHERE node=?", (node,)).rowcount
            if n:
                _bump(tx)
                self._event(tx, "uncordon", "cordon lifted", node=node)
        return n > 0

    def cordons(self) -> dict[str, dict[str, Any]]:
        with self._read() as tx:
            return _cordons(tx)


def _cordons(tx: Tx) -> dict[str, dict[str, Any]]:
    return {
        node: {"reason": reason, "created_at": at}
        for node, reason, at in tx.execute("SELECT node, reason, created_at FROM cordons").fetchall()
    }


_VOLATILE = ("probed_at", "last_seen_at", "error")


def _placement_view(f: NodeFacts) -> dict[str, Any]:
    """What placement reads of a node's facts: everything but when it was probed, the error's
    wording, and the GPUs' memory in use (it moves with every request an engine serves)."""
    d = f.to_dict()
    for k in (*_VOLATILE, "cordoned", "cordon_reason"):
        d.pop(k, None)
    for g in d.get("gpus") or ():
        g.pop("memory_used_mib", None)
        for p in g.get("processes") or ():
            p.pop("used_mib", None)
    return d
