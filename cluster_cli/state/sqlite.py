"""The embedded state backend: one SQLite file in WAL mode.

Everything SQLite-specific lives here: opening the file (and refusing one that is not a
state), ``BEGIN IMMEDIATE`` taken in short waits so that Ctrl-C (or :meth:`interrupt` from
another thread) ends a wait for another process's write lock at once, read-only opens in a
folder this user cannot write, and what SQLite's result codes mean in words.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

from cluster_cli.errors import StateError
from cluster_cli.state.backend import Dialect, Tx

# SQLite result codes (sqlite3.Error.sqlite_errorcode): extended codes keep the primary in the low byte.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CANTOPEN = 5, 6, 14
_SQLITE_READONLY_DIRECTORY = 8 | (6 << 8)  # 1544: the -shm file cannot be created in the folder
_SQLITE_IOERR, _SQLITE_FULL = 10, 13
_LOCK_POLL_MS = 50  # SQLite's busy wait per try while another process holds the write lock

SQLITE = Dialect(name="sqlite", id_column="INTEGER PRIMARY KEY", float_type="REAL")


class SqliteBackend:
    """A state in one SQLite file. Thread-safe: one connection, used by one thread at a time
    (a lock guards it), so a dedicated database thread and the main thread may share it."""

    dialect = SQLITE
    IntegrityError = sqlite3.IntegrityError  # a UNIQUE, CHECK or FOREIGN KEY refusal

    def __init__(
        self, path: Path | str, *, create: bool = True, readonly: bool = False, timeout_s: float = 30.0
    ) -> None:
        """Open (by default create) the file. ``readonly`` never writes. Raises StateError."""
        self.path = Path(path)
        self.readonly = readonly
        self.timeout_s = timeout_s
        self.existed = False
        self._lock = threading.RLock()
        self._depth = 0  # nesting of read()/write() blocks on this connection
        self._writing = False
        self._stop = threading.Event()
        try:
            exists = self.path.exists()
        except OSError as e:  # a folder on the way that this user may not enter
            raise StateError(f"{self.path}: cannot reach the state: {e.strerror or e}") from None
        self.existed = exists and self._size() > 0
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
            self._db = self._open_readonly()
            return
        if exists and not os.access(self.path, os.W_OK):  # now, not after probing the fleet
            raise StateError(f"{self.path}: the state file is read-only (check its permissions)")
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
            if self.existed:
                # Someone else's database given as --state is refused, not taken over (WAL mode
                # and our tables added beside its own).
                self._check_ours()
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        except sqlite3.DatabaseError as e:
            self._close_quietly()
            raise StateError(f"{self.path}: {_db_error(e)}") from None

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

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

    # ---- transactions -----------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[Tx]:
        with self._lock:
            if self._depth:  # inside another block: its snapshot (or its write)
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            try:
                self._db.execute("BEGIN")
                # The snapshot starts at the first read: take it now.
                self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            except sqlite3.Error as e:
                self._rollback()
                raise StateError(f"{self.path}: cannot read the state: {e}") from None
            self._depth = 1
            try:
                yield self._db
            except sqlite3.Error as e:
                raise StateError(f"{self.path}: cannot read the state: {e}") from None
            finally:
                self._depth = 0
                self._stop.clear()  # an interrupt meant for this block ends with it
                if self._db.in_transaction:
                    with suppress(sqlite3.Error):
                        self._db.execute("COMMIT")

    @contextmanager
    def write(self) -> Iterator[Tx]:
        if self.readonly:
            raise StateError(f"{self.path}: opened read-only; cannot write the state")
        with self._lock:
            if self._depth:
                if not self._writing:
                    raise StateError(f"{self.path}: a write inside a read snapshot")  # a bug, said plainly
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            try:
                self._begin_write()
            except sqlite3.Error as e:
                why = str(e)
                if _primary(e) == _SQLITE_BUSY:
                    why += f" (another process has held its write lock for {self.timeout_s:g} s)"
                raise StateError(f"{self.path}: cannot write the state: {why}") from None
            self._depth, self._writing = 1, True
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
            finally:
                self._depth, self._writing = 0, False
                self._stop.clear()  # an interrupt meant for this block ends with it

    def _begin_write(self) -> None:
        """Take the write lock, waiting up to the timeout for another writer to finish.

        SQLite's own busy wait sleeps inside one C call for the whole timeout, where Ctrl-C
        or SIGTERM cannot reach Python. It is asked for short waits instead, in a loop, so an
        interrupt ends the command at once even while another process holds the lock.
        """
        deadline = time.monotonic() + self.timeout_s
        self._db.execute(f"PRAGMA busy_timeout={_LOCK_POLL_MS}")
        try:
            while True:
                if self._stop.is_set():
                    self._stop.clear()
                    raise KeyboardInterrupt
                try:
                    self._db.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as e:
                    if self._stop.is_set():
                        continue  # interrupted meanwhile: said once, at the top

                    if _primary(e) != _SQLITE_BUSY or time.monotonic() >= deadline:
                        raise
                    continue
                if self._stop.is_set():  # the lock came with the interrupt: nothing is written
                    self._db.execute("ROLLBACK")
                    continue
                return
        finally:
            self._db.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")

    def clear_interrupt(self) -> None:
        self._stop.clear()

    def interrupt(self) -> None:
        """End a wait for the write lock (or a long statement) at once; from any thread."""
        self._stop.set()
        with suppress(sqlite3.Error, AttributeError):
            self._db.interrupt()

    def _rollback(self) -> None:
        """Undo the open transaction, if SQLite has not already (it rolls back by itself on
        some errors, a full disk among them: a second ROLLBACK would hide the first error)."""
        if self._db.in_transaction:
            with suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _close_quietly(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            with suppress(sqlite3.Error):
                db.close()

    # ---- opening ----------------------------------------------------------
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

    def _open_readonly(self) -> sqlite3.Connection:
        with suppress(OSError):
            if self.path.is_file() and self.path.stat().st_size == 0:
                raise StateError(
                    f"{self.path}: an empty state, nothing recorded yet (a 'clusterctl discover' fills it)"
                )
        uri = f"file:{quote(str(self.path.resolve()))}?mode=ro"
        try:
            db, row = self._connect(uri)
        except sqlite3.OperationalError as e:
            if not self._snapshot_only(e):
                raise StateError(self._read_error(e)) from None
            # A WAL database in a folder we cannot write (no -shm to create), with nothing in its
            # WAL: the database file alone is the whole state, and can be read as a snapshot.
            try:
                db, row = self._connect(uri + "&immutable=1")
            except sqlite3.DatabaseError as e2:
                raise StateError(f"{self.path}: not a usable state database: {e2}") from None
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path}: not a usable state database: {e}") from None
        if row is None:
            db.close()
            raise StateError(f"{self.path}: not a clusterctl state database (no schema version)")
        return db

    def _connect(self, uri: str) -> tuple[sqlite3.Connection, Any]:
        db = sqlite3.connect(uri, uri=True, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
        try:
            return db, db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except BaseException:
            db.close()
            raise

    def in_memory_copy(self) -> None:
        """Read from a private in-memory copy of the database from now on (a read-only open of
        an older schema migrates that copy, never the file)."""
        with self._lock:
            mem = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            try:
                self._db.backup(mem)
            except sqlite3.Error as e:
                mem.close()
                raise StateError(f"{self.path}: cannot read the state: {e}") from None
            self._db.close()
            self._db = mem
            self.readonly = False  # the copy is ours to migrate; the file is never written

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

    @staticmethod
    def tables(tx: Tx) -> set[str]:
        """The names of the tables the database holds."""
        return {r[0] for r in tx.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()}


def _primary(e: sqlite3.Error) -> int:
    """SQLite's primary result code of ``e`` (an extended code keeps it in the low byte)."""
    return getattr(e, "sqlite_errorcode", 0) & 0xFF


def _db_error(e: sqlite3.DatabaseError) -> str:
    """What a failed open says: a full disk or an I/O error as what it is, not as a damaged file."""
    code = _primary(e)
    if code == _SQLITE_FULL:
        return f"cannot write the state: the disk is full ({e})"
    if code == _SQLITE_IOERR:
        return f"cannot write the state: I/O error ({e})"
    return f"not a usable state database: {e}"
