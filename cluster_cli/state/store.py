"""The local state store: SQLite in WAL mode, every write one transaction.

Several clusterctl processes share one database (a long-running ``supervise`` and an
operator's ``cordon``, say). Writes take the lock up front (``BEGIN IMMEDIATE``) and
touch only their own rows, so neither loses the other's work:

* ``nodes``    facts from the last discover, one row per node (JSON).
* ``cordons``  operator cordons, a separate table that discover never writes.
* ``replicas`` placed replicas, whole (all shards in one row), with their status.
* ``events``   an append-only audit trail.
* ``meta``     schema version and a state version bumped by every write, so a plan
               computed from one version can be checked before it is applied.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cluster_cli.errors import StateError
from cluster_cli.facts import NodeFacts, Replica
from cluster_cli.state import schema
from cluster_cli.state.launches import LaunchTable
from cluster_cli.state.schema import SCHEMA_VERSION

# SQLite result codes (sqlite3.Error.sqlite_errorcode): extended codes keep the primary in the low byte.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CANTOPEN = 5, 6, 14
_SQLITE_READONLY_DIRECTORY = 8 | (6 << 8)  # 1544: the -shm file cannot be created in the folder
_SQLITE_IOERR, _SQLITE_FULL = 10, 13


_LOCK_POLL_MS = 50  # SQLite's busy wait per try while another process holds the write lock


class Store(LaunchTable):
    """A handle on the state database. Cheap to open; use as a context manager."""

    def __init__(
        self, path: Path | str, *, create: bool = True, readonly: bool = False, timeout_s: float = 30.0
    ) -> None:
        """Open (by default create) the state. ``readonly`` never writes: for commands that only read."""
        self.path = Path(path)
        self._timeout_s = timeout_s
        try:
            exists = self.path.exists()
        except OSError as e:  # a folder on the way that this user may not enter
            raise StateError(f"{self.path}: cannot reach the state: {e.strerror or e}") from None
        if not exists:
            if not create or readonly:
                raise StateError(f"{self.path}: no state yet (run 'clusterctl discover' first)")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StateError(f"{self.path}: cannot create state folder: {e.strerror or e}") from None
            if not os.access(self.path.parent, os.W_OK | os.X_OK):
                raise StateError(f"{self.path}: cannot create the state: folder {self.path.parent} is not writable")
        if readonly:
            self._db = self._open_readonly(timeout_s)
            return
        if exists and not os.access(self.path, os.W_OK):  # now, not after probing the fleet
            raise StateError(f"{self.path}: the state file is read-only (check its permissions)")
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
            if exists and self.path.stat().st_size > 0:
                # Someone else's database given as --state is refused, not taken over (WAL mode
                # and our tables added beside its own).
                self._check_ours()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
            with self._tx() as db:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                if row is None:
                    schema.create(db)
                else:
                    # An older state is upgraded in place, in this transaction: whole, or not at all.
                    if schema.migrate(db, self._check_schema(row[0])) < SCHEMA_VERSION:
                        self._event(db, "migrate", None, f"state schema {row[0]} upgraded to {SCHEMA_VERSION}")
            self.schema = SCHEMA_VERSION
        except sqlite3.DatabaseError as e:
            self._close_quietly()
            raise StateError(f"{self.path}: {_db_error(e)}") from None
        except BaseException:
            self._close_quietly()
            raise

    @staticmethod
    def check_creatable(path: Path | str) -> None:
        """Raise the StateError that creating the state at ``path`` would, without creating
        anything: its nearest existing folder must be a folder this user may write."""
        path = Path(path)
        folder = path.parent
        try:
            while not folder.exists():
                folder = folder.parent
            if not folder.is_dir():
                raise StateError(f"{path}: cannot create state folder: {folder} is not a folder")
        except OSError as e:
            raise StateError(f"{path}: cannot reach the state: {e.strerror or e}") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StateError(f"{path}: cannot create the state: folder {folder} is not writable")

    def _close_quietly(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            with suppress(sqlite3.Error):
                db.close()

    def _check_ours(self) -> None:
        """Refuse an existing database that is not a clusterctl state (no meta table with a
        schema version), before anything is written to it."""
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        row = None
        if "meta" in tables:
            with suppress(sqlite3.DatabaseError):
                row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None and tables:
            raise StateError(
                f"{self.path}: not a clusterctl state database (no schema version); refusing to write to it"
            )

    def _open_readonly(self, timeout_s: float) -> sqlite3.Connection:
        with suppress(OSError):
            if self.path.is_file() and self.path.stat().st_size == 0:
                raise StateError(
                    f"{self.path}: an empty state, nothing recorded yet (a 'clusterctl discover' fills it)"
                )
        uri = f"file:{quote(str(self.path.resolve()))}?mode=ro"
        try:
            db, row = self._connect(uri, timeout_s)
        except sqlite3.OperationalError as e:
            if not self._snapshot_only(e):
                raise StateError(self._read_error(e)) from None
            # A WAL database in a folder we cannot write (no -shm to create), with nothing in its
            # WAL: the database file alone is the whole state, and can be read as a snapshot.
            try:
                db, row = self._connect(uri + "&immutable=1", timeout_s)
            except sqlite3.DatabaseError as e2:
                raise StateError(f"{self.path}: not a usable state database: {e2}") from None
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path}: not a usable state database: {e}") from None
        if row is None:
            db.close()
            raise StateError(f"{self.path}: not a clusterctl state database (no schema version)")
        self.schema = self._check_schema(row[0])  # an older one is read as it is, never upgraded here
        return db

    @staticmethod
    def _connect(uri: str, timeout_s: float) -> tuple[sqlite3.Connection, Any]:
        db = sqlite3.connect(uri, uri=True, timeout=timeout_s, isolation_level=None)
        try:
            return db, db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except BaseException:
            db.close()
            raise

    def _snapshot_only(self, e: sqlite3.OperationalError) -> bool:
        """Whether a read-only open failed only because this folder is not ours to write (SQLite
        needs the -shm file to read a WAL database) and the -wal file holds nothing: then the
        database file is the state and ``immutable=1`` reads all of it. Any other failure (a
        lock, a damaged file) must not be papered over with a snapshot that may miss commits."""
        if getattr(e, "sqlite_errorcode", None) not in (_SQLITE_CANTOPEN, _SQLITE_READONLY_DIRECTORY):
            return False
        folder = self.path.resolve().parent
        if os.access(folder, os.W_OK | os.X_OK):
            return False
        wal = folder / (self.path.name + "-wal")
        try:
            return wal.stat().st_size == 0
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def _read_error(self, e: sqlite3.OperationalError) -> str:
        code = getattr(e, "sqlite_errorcode", 0)
        if _primary(e) in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return f"{self.path}: cannot read the state: {e} (another process holds it; try again)"
        folder = self.path.resolve().parent
        wal = folder / (self.path.name + "-wal")
        no_shm = code in (_SQLITE_CANTOPEN, _SQLITE_READONLY_DIRECTORY)
        if no_shm and not os.access(folder, os.W_OK | os.X_OK) and wal.exists():
            return (
                f"{self.path}: cannot read the state: {wal} holds changes not yet in the database and "
                f"{folder} is not writable here; open it once where that folder is writable (e.g. as its owner)"
            )
        if _primary(e) == _SQLITE_FULL:  # reading a WAL state needs room for its -shm file
            return f"{self.path}: cannot read the state: the disk is full ({e})"
        if _primary(e) == _SQLITE_IOERR:
            return f"{self.path}: cannot read the state: I/O error ({e})"
        return f"{self.path}: not a usable state database: {e}"

    def _check_schema(self, version: str) -> int:
        try:
            number = int(version)
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
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _begin_write(self) -> None:
        """Take the write lock, waiting up to the timeout for another writer to finish.

        SQLite's own busy wait sleeps inside one C call for the whole timeout, where Ctrl-C
        or SIGTERM cannot reach Python. It is asked for short waits instead, in a loop, so an
        interrupt ends the command at once even while another process holds the lock.
        """
        deadline = time.monotonic() + self._timeout_s
        self._db.execute(f"PRAGMA busy_timeout={_LOCK_POLL_MS}")
        try:
            while True:
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as e:
                    if _primary(e) != _SQLITE_BUSY or time.monotonic() >= deadline:
                        raise
        finally:
            self._db.execute(f"PRAGMA busy_timeout={int(self._timeout_s * 1000)}")

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        try:
            self._begin_write()
        except sqlite3.Error as e:
            why = str(e)
            if _primary(e) == _SQLITE_BUSY:
                why += f" (another process has held its write lock for {self._timeout_s:g} s)"
            raise StateError(f"{self.path}: cannot write the state: {why}") from None
        try:
            yield self._db
        except sqlite3.Error as e:
            self._rollback()
            raise StateError(f"{self.path}: cannot write the state: {e}") from None
        except BaseException:
            self._rollback()
            raise
        else:
            try:
                self._db.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise StateError(f"{self.path}: cannot write the state: {e}") from None

    def _rollback(self) -> None:
        """Undo the open transaction, if SQLite has not already (it rolls back by itself on
        some errors, a full disk among them: a second ROLLBACK would hide the first error)."""
        if self._db.in_transaction:
            with suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    @contextmanager
    def snapshot(self) -> Iterator[Store]:
        """Reads inside the block all see one state version (a read transaction).

        Without it each read is its own transaction: a cordon committed between reading the
        nodes and reading the version would give a plan labelled with a state it did not use.
        Nested use is a no-op.
        """
        if self._db.in_transaction:
            yield self
            return
        try:
            self._db.execute("BEGIN")
            self.version()  # the snapshot starts at the first read, so take it now
        except sqlite3.Error as e:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StateError(f"{self.path}: cannot read the state: {e}") from None
        try:
            yield self
        finally:
            if self._db.in_transaction:
                self._db.execute("COMMIT")

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; bumps the state version."""
        with self._tx() as db:
            _bump(db)
            yield db

    def version(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key='state_version'").fetchone()
        return int(row[0]) if row else 0

    def inventory(self) -> Path | None:
        """The inventory the last ``discover`` read (absolute), if any."""
        row = self._db.execute("SELECT value FROM meta WHERE key='inventory'").fetchone()
        return Path(row[0]) if row else None

    def _event(self, db: sqlite3.Connection, kind: str, node: str | None, message: str) -> None:
        db.execute("INSERT INTO events(at, kind, node, message) VALUES (?,?,?,?)", (time.time(), kind, node, message))

    # ---- rows -------------------------------------------------------------
    def _facts(self, name: str, doc: str) -> NodeFacts:
        try:
            return NodeFacts.from_dict(json.loads(doc))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"{self.path}: node {name}: unreadable facts ({e}); run 'clusterctl discover' "
                             "with a fresh --state, or delete that node's row") from None  # fmt: skip

    def _replica(self, doc: str) -> Replica:
        try:
            return Replica.from_dict(json.loads(doc))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StateError(f"{self.path}: unreadable replica record ({e})") from None

    # ---- nodes ------------------------------------------------------------
    def save_discovery(self, facts: Iterable[NodeFacts], *, inventory: Path | str | None = None) -> None:
        """Upsert the facts of one discover run in one transaction.

        A node that did not answer keeps its last known hardware facts but is marked
        unreachable with the error. Cordons are never touched here. ``inventory`` (an
        absolute path) is recorded as the one the state follows, for commands run without -i.
        """
        now = time.time()
        with self.write() as db:
            if inventory is not None:
                db.execute(
                    "INSERT INTO meta VALUES ('inventory', ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    (str(inventory),),
                )
            for f in facts:
                if not f.reachable:
                    row = db.execute("SELECT facts FROM nodes WHERE name=?", (f.name,)).fetchone()
                    old = None
                    if row is not None:
                        with contextlib.suppress(StateError):  # an unreadable old row is replaced
                            old = self._facts(f.name, row[0])
                    if old is not None:
                        # The old hardware facts, stamped with this probe's time: the guard
                        # below must compare when each answer (or silence) was observed.
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
                db.execute(
                    "INSERT INTO nodes(name, host, reachable, error, facts, probed_at, updated_at) "
                    "VALUES (?,?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET host=excluded.host, "
                    "reachable=excluded.reachable, error=excluded.error, facts=excluded.facts, "
                    "probed_at=excluded.probed_at, updated_at=excluded.updated_at "
                    # A discover that finishes last but probed earlier never replaces newer facts.
                    "WHERE excluded.probed_at IS NULL OR nodes.probed_at IS NULL "
                    "OR excluded.probed_at >= nodes.probed_at",
                    (f.name, f.host, int(f.reachable), f.error, json.dumps(doc), f.probed_at, now),
                )
            self._event(db, "discover", None, "facts saved")

    def nodes(self, names: Iterable[str] | None = None, *, unreadable: list[str] | None = None) -> list[NodeFacts]:
        """Stored facts with cordons applied, sorted by name (optionally only ``names``).

        A row that cannot be read is an error, unless ``unreadable`` is given: then its
        node's name goes there and the row is left out (a discover replaces it)."""
        with self.snapshot():  # the cordons and the facts of one state version
            cordons = self.cordons()
            rows = self._db.execute("SELECT name, facts FROM nodes ORDER BY name").fetchall()
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
            out.append(replace(f, cordoned=c is not None, cordon_reason=c["reason"] if c else None))
        return out

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
        with self._tx() as db:
            if inventory is not None:
                verb = "INSERT OR REPLACE" if replace_inventory else "INSERT OR IGNORE"
                db.execute(f"{verb} INTO meta VALUES ('inventory', ?)", (str(inventory),))
            row = db.execute("SELECT reason, created_at FROM cordons WHERE node=?", (node,)).fetchone()
            if row is not None and row[0] == reason:
                return {"reason": row[0], "created_at": row[1]}
            _bump(db)
            db.execute(
                "INSERT INTO cordons(node, reason, created_at) VALUES (?,?,?) "
                "ON CONFLICT(node) DO UPDATE SET reason=excluded.reason",
                (node, reason, time.time()),
            )
            self._event(db, "cordon", node, reason if row is None else f"{reason} (was: {row[0]})")
        return None if row is None else {"reason": row[0], "created_at": row[1]}

    def uncordon(self, node: str) -> bool:
        """Lift ``node``'s cordon. False, and no write nor new state version, when it had none."""
        with self._tx() as db:
            n = db.execute("DELETE FROM cordons WHERE node=?", (node,)).rowcount
            if n:
                _bump(db)
                self._event(db, "uncordon", node, "cordon lifted")
        return n > 0

    def cordons(self) -> dict[str, dict[str, Any]]:
        return {
            node: {"reason": reason, "created_at": at}
            for node, reason, at in self._db.execute("SELECT node, reason, created_at FROM cordons")
        }

    # ---- replicas ---------------------------------------------------------
    def replicas(self) -> list[Replica]:
        """The placed replicas that hold their GPUs: every one but those wanted down."""
        where = "" if self.schema < 2 else "WHERE desired = 'up'"
        rows = self._db.execute(f"SELECT spec FROM replicas {where} ORDER BY model, replica")
        return [self._replica(spec) for (spec,) in rows]

    def replica_rows(self) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT spec, status, endpoint, detail, updated_at FROM replicas ORDER BY model, replica"
        ).fetchall()
        return [
            {"replica": self._replica(s), "status": st, "endpoint": ep, "detail": d, "updated_at": u}
            for s, st, ep, d, u in rows
        ]

    def put_replica(self, r: Replica, *, status: str = "planned", endpoint: str | None = None,
                    detail: str | None = None) -> None:  # fmt: skip
        with self.write() as db:
            db.execute(
                "INSERT INTO replicas(model, replica, spec, status, endpoint, detail, updated_at) "
                "VALUES (?,?,?,?,?,?,?) ON CONFLICT(model, replica, generation) DO UPDATE SET spec=excluded.spec, "
                "status=excluded.status, endpoint=excluded.endpoint, detail=excluded.detail, "
                "updated_at=excluded.updated_at",
                (r.model, r.replica, json.dumps(r.to_dict()), status, endpoint, detail, time.time()),
            )

    def release_replica(self, model: str, replica: int) -> bool:
        """Free every shard of a replica at once. False, and no new state version, when
        there was nothing to release."""
        with self._tx() as db:
            n = db.execute("DELETE FROM replicas WHERE model=? AND replica=?", (model, replica)).rowcount
            db.execute("DELETE FROM holds WHERE model=? AND replica=?", (model, replica))
            if n:
                _bump(db)
                self._event(db, "release", None, f"{model}/{replica} released")
        return n > 0

    def events(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT at, kind, node, message FROM events ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [{"at": a, "kind": k, "node": n, "message": m} for a, k, n, m in rows]


def _primary(e: sqlite3.Error) -> int:
    """SQLite's primary result code of ``e`` (an extended code keeps it in the low byte)."""
    return getattr(e, "sqlite_errorcode", 0) & 0xFF


def _bump(db: sqlite3.Connection) -> None:
    """A new state version: what a plan computed from the old one must not be applied."""
    db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'state_version'")


def _db_error(e: sqlite3.DatabaseError) -> str:
    """What a failed open says: a full disk or an I/O error as what it is, not as a damaged file."""
    code = _primary(e)
    if code == _SQLITE_FULL:
        return f"cannot write the state: the disk is full ({e})"
    if code == _SQLITE_IOERR:
        return f"cannot write the state: I/O error ({e})"
    return f"not a usable state database: {e}"
