"""The state database's tables, and the migrations that bring an older state up to date.

Version 1 (``discover``, ``cordon``): nodes, cordons, placed replicas, events, meta.
Version 2 (``up``): a replica is a generation of ``MODEL/N`` with its desired and observed
state and where its shards run; ``holds`` books each node GPU and port for one replica at
most (its primary key is the exclusivity: two ``up`` runs can never book one GPU twice).

A migration runs inside the transaction that opens the state for writing: it is applied
whole, with the cordons and facts kept, or not at all.
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 2

_COMMON = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    host TEXT NOT NULL DEFAULT '',
    reachable INTEGER NOT NULL,
    error TEXT,
    facts TEXT NOT NULL,
    probed_at REAL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS cordons (
    node TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT,
    message TEXT NOT NULL
);
"""

# status: the observed state (planned, starting, ready, unhealthy, failed, stopped);
# desired: up, or down (stopped by 'down': nothing brings it back until the next 'up').
_REPLICAS_V2 = """
CREATE TABLE IF NOT EXISTS replicas (
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL DEFAULT 1,
    spec TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'planned',
    endpoint TEXT,
    detail TEXT,
    desired TEXT NOT NULL DEFAULT 'up',
    runtime TEXT,
    started_at REAL,
    restarts INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL,
    PRIMARY KEY (model, replica, generation)
);
CREATE TABLE IF NOT EXISTS holds (
    node TEXT NOT NULL,
    kind TEXT NOT NULL,
    item INTEGER NOT NULL,
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    PRIMARY KEY (node, kind, item)
);
CREATE INDEX IF NOT EXISTS holds_by_replica ON holds (model, replica, generation);
"""

_V1_REPLICAS = """
CREATE TABLE IF NOT EXISTS replicas (
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'planned',
    endpoint TEXT,
    detail TEXT,
    updated_at REAL NOT NULL,
    PRIMARY KEY (model, replica)
);
"""


def _run(db: sqlite3.Connection, script: str) -> None:
    # Statement by statement: executescript() would COMMIT the caller's transaction.
    for stmt in script.split(";"):
        if stmt.strip():
            db.execute(stmt)


def create(db: sqlite3.Connection) -> None:
    """The tables of a new state, at the current schema version (inside a transaction)."""
    _run(db, _COMMON + _REPLICAS_V2)
    db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    db.execute("INSERT INTO meta VALUES ('state_version', '0')")


def _v1_to_v2(db: sqlite3.Connection) -> None:
    """Replicas gain a generation (part of their key), desired state, runtime and restarts;
    holds appear. Rows a version-1 state holds are generation 1, desired up."""
    _run(db, _V1_REPLICAS)  # a v1 state that never had one (made by an early build)
    db.execute("ALTER TABLE replicas RENAME TO replicas_v1")
    _run(db, _REPLICAS_V2)
    db.execute(
        "INSERT INTO replicas(model, replica, generation, spec, status, endpoint, detail, updated_at) "
        "SELECT model, replica, 1, spec, status, endpoint, detail, updated_at FROM replicas_v1"
    )
    db.execute("DROP TABLE replicas_v1")


MIGRATIONS = {1: _v1_to_v2}  # from version N to N+1


def migrate(db: sqlite3.Connection, version: int) -> int:
    """Bring a state at schema ``version`` up to date (inside the caller's transaction);
    returns the version it started from."""
    _run(db, _COMMON)
    for v in range(version, SCHEMA_VERSION):
        MIGRATIONS[v](db)
    if version != SCHEMA_VERSION:
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    return version
