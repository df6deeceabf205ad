"""The interface between the state store and a database: what ``Store`` calls, and all it may
assume of the SQL it sends.

``Store`` (and the table modules beside it) write SQL that runs unchanged on SQLite and on
PostgreSQL: ``?`` marks a parameter (a backend maps it to its driver's style), upserts are
``INSERT ... ON CONFLICT (...) DO UPDATE/NOTHING``, ids come from the backend's own column
type (``Dialect.id_column``), timestamps are ``Dialect.float_type``, and no statement relies on
SQLite's whole-file write lock for its correctness: every check-then-write is one statement
or runs in a transaction that took the write lock first. How a transaction is begun, how a
lock is waited for, and what an error means are the backend's own.

A second backend (PostgreSQL) implements :class:`Backend` and :class:`Dialect`; nothing
above this module changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol


class Cursor(Protocol):
    """What a statement returns: its rows, and how many rows a write touched."""

    rowcount: int

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Tx(Protocol):
    """One open transaction (read or write)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor: ...


@dataclass(frozen=True)
class Dialect:
    """The few words of DDL that differ between databases."""

    name: str
    id_column: str  # an integer primary key the database assigns, rising
    float_type: str  # a double-precision float (PostgreSQL's REAL is single precision)


class Backend(Protocol):
    """A connection to one state database.

    ``read()`` is one consistent snapshot: every statement inside sees the same committed
    state. ``write()`` is one transaction that holds the database's write lock from its first
    statement (so a check inside it stays true until the commit); it commits when the block
    ends and rolls back on any exception. Both raise ``StateError`` with a one-line reason.
    ``interrupt()`` may be called from another thread: a wait for the lock ends at once with
    ``KeyboardInterrupt``.
    """

    dialect: Dialect
    readonly: bool
    path: Any
    IntegrityError: type[Exception]  # what a UNIQUE, CHECK or FOREIGN KEY refusal raises in a block

    def tables(self, tx: Tx) -> set[str]: ...

    def read(self) -> AbstractContextManager[Tx]: ...
    def write(self) -> AbstractContextManager[Tx]: ...
    def interrupt(self) -> None: ...
    def clear_interrupt(self) -> None: ...
    def close(self) -> None: ...
