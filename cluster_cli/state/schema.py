"""The state database's tables, and the migrations that bring an older state up to date.

Version 1 (``discover``, ``cordon``): nodes, cordons, placed replicas, events, meta.
Version 2 (``up``): a replica is a generation of ``MODEL/N`` with its desired and observed
state; ``holds`` books each node GPU and port for one replica at most.
Version 3 (a state a long-running supervisor shares): generations never reused
(``generations``); a replica row has a revision that every observed-state write compares
and sets; shards in a table of their own; holds book a GPU by its UUID and reference their
replica; fence records for what may still run; node status apart from the facts; the
catalog the last ``up`` applied; leases; events with structure. CHECK constraints guard
every status, desired and kind column.

A migration runs inside the transaction that opens the state for writing: it is applied
whole, with everything kept, or not at all. The DDL is portable SQL but for the two words a
:class:`~cluster_cli.state.backend.Dialect` gives; the migrations from version 1 and 2 run
on SQLite only (no other backend held those versions).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

from cluster_cli.state.backend import Dialect, Tx
from cluster_cli.state.records import DESIRED, STATES

SCHEMA_VERSION = 3

SHARD_STATES = ("planned", "starting", "running", "stopped", "fenced")
NODE_STATES = ("ready", "unreachable", "lost", "fencing")
HOLD_KINDS = ("gpu", "port")
# Every kind of event. Replica transitions, node transitions, then what operators and runs do.
EVENT_KINDS = (
    "reserved", "starting", "ready", "unhealthy", "restarted", "failed", "stopping", "stopped", "released",
    "fenced", "unfenced", "down", "conflict",
    "node-ready", "node-unreachable", "node-lost", "node-fencing",
    "discover", "cordon", "uncordon", "catalog", "migrate", "lease", "note",
)  # fmt: skip


def _among(column: str, values: tuple[str, ...]) -> str:
    return f"CHECK ({column} IN ({', '.join(repr(v) for v in values)}))"


def tables(d: Dialect) -> str:
    """The version-3 tables (CREATE ... IF NOT EXISTS: also what a migration adds)."""
    f = d.float_type
    return f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    host TEXT NOT NULL DEFAULT '',
    reachable INTEGER NOT NULL,
    error TEXT,
    facts TEXT NOT NULL,
    probed_at {f},
    updated_at {f} NOT NULL
);
CREATE TABLE IF NOT EXISTS node_status (
    node TEXT PRIMARY KEY,
    status TEXT NOT NULL {_among("status", NODE_STATES)},
    since {f} NOT NULL,
    last_heartbeat {f},
    boot_id TEXT,
    detail TEXT,
    updated_at {f} NOT NULL
);
CREATE TABLE IF NOT EXISTS cordons (
    node TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    created_at {f} NOT NULL
);
CREATE TABLE IF NOT EXISTS generations (
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    last INTEGER NOT NULL CHECK (last >= 0),
    PRIMARY KEY (model, replica)
);
CREATE TABLE IF NOT EXISTS replicas (
    model TEXT NOT NULL,
    replica INTEGER NOT NULL CHECK (replica >= 0),
    generation INTEGER NOT NULL CHECK (generation >= 1),
    profile TEXT NOT NULL,
    engine TEXT NOT NULL,
    fabric TEXT,
    gpu_class TEXT,
    cpus INTEGER,
    memory_mib INTEGER,
    status TEXT NOT NULL DEFAULT 'planned' {_among("status", STATES)},
    desired TEXT NOT NULL DEFAULT 'up' {_among("desired", DESIRED)},
    endpoint TEXT,
    port INTEGER,
    extra_ports TEXT NOT NULL DEFAULT '',
    owner TEXT,
    started_at {f},
    restarts INTEGER NOT NULL DEFAULT 0 CHECK (restarts >= 0),
    detail TEXT,
    revision INTEGER NOT NULL DEFAULT 1 CHECK (revision >= 1),
    created_at {f} NOT NULL,
    updated_at {f} NOT NULL,
    PRIMARY KEY (model, replica, generation)
);
CREATE TABLE IF NOT EXISTS shards (
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    rank INTEGER NOT NULL CHECK (rank >= 0),
    node TEXT NOT NULL,
    gpus TEXT NOT NULL DEFAULT '',
    hcas TEXT NOT NULL DEFAULT '',
    run_dir TEXT,
    token TEXT UNIQUE,
    pid INTEGER,
    start_time INTEGER,
    boot_id TEXT,
    gpu_uuids TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL DEFAULT 'planned' {_among("state", SHARD_STATES)},
    updated_at {f} NOT NULL,
    PRIMARY KEY (model, replica, generation, rank),
    FOREIGN KEY (model, replica, generation) REFERENCES replicas (model, replica, generation) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS shards_by_node ON shards (node);
CREATE TABLE IF NOT EXISTS holds (
    node TEXT NOT NULL,
    kind TEXT NOT NULL {_among("kind", HOLD_KINDS)},
    item INTEGER NOT NULL,
    uuid TEXT,
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    CHECK (kind = 'gpu' OR uuid IS NULL),
    FOREIGN KEY (model, replica, generation) REFERENCES replicas (model, replica, generation) ON DELETE CASCADE
);
CREATE UNIQUE INDEX IF NOT EXISTS holds_by_uuid ON holds (uuid) WHERE uuid IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS holds_by_item ON holds (node, kind, item) WHERE uuid IS NULL;
CREATE INDEX IF NOT EXISTS holds_by_replica ON holds (model, replica, generation);
CREATE TABLE IF NOT EXISTS fences (
    token TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    model TEXT NOT NULL,
    replica INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    pid INTEGER,
    start_time INTEGER,
    since {f} NOT NULL,
    reason TEXT NOT NULL,
    checked_at {f}
);
CREATE INDEX IF NOT EXISTS fences_by_node ON fences (node);
CREATE TABLE IF NOT EXISTS catalogs (
    version INTEGER PRIMARY KEY,
    digest TEXT NOT NULL,
    doc TEXT NOT NULL,
    source TEXT,
    actor TEXT NOT NULL,
    applied_at {f} NOT NULL
);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    epoch INTEGER NOT NULL CHECK (epoch >= 1),
    acquired_at {f} NOT NULL,
    expires_at {f} NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id {d.id_column},
    at {f} NOT NULL,
    kind TEXT NOT NULL {_among("kind", EVENT_KINDS)},
    node TEXT,
    model TEXT,
    replica INTEGER,
    generation INTEGER,
    actor TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS events_by_at ON events (at);
"""


def run(tx: Tx, script: str) -> None:
    # Statement by statement: a script runner would COMMIT the caller's transaction.
    for stmt in script.split(";"):
        if stmt.strip():
            tx.execute(stmt)


def create(tx: Tx, d: Dialect) -> None:
    """The tables of a new state, at the current schema version (inside a transaction)."""
    run(tx, tables(d))
    tx.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    tx.execute("INSERT INTO meta VALUES ('state_version', '0')")


# ---- version 1 -> 2 (SQLite) ----------------------------------------------
_V1_REPLICAS = """
CREATE TABLE IF NOT EXISTS replicas (
    model TEXT NOT NULL, replica INTEGER NOT NULL, spec TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'planned', endpoint TEXT, detail TEXT, updated_at REAL NOT NULL,
    PRIMARY KEY (model, replica)
);
"""
_V2_REPLICAS = """
CREATE TABLE replicas (
    model TEXT NOT NULL, replica INTEGER NOT NULL, generation INTEGER NOT NULL DEFAULT 1,
    spec TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'planned', endpoint TEXT, detail TEXT,
    desired TEXT NOT NULL DEFAULT 'up', runtime TEXT, started_at REAL,
    restarts INTEGER NOT NULL DEFAULT 0, updated_at REAL NOT NULL,
    PRIMARY KEY (model, replica, generation)
);
CREATE TABLE IF NOT EXISTS holds (
    node TEXT NOT NULL, kind TEXT NOT NULL, item INTEGER NOT NULL,
    model TEXT NOT NULL, replica INTEGER NOT NULL, generation INTEGER NOT NULL,
    PRIMARY KEY (node, kind, item)
);
"""
_V1_COMMON = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, host TEXT NOT NULL DEFAULT '', reachable INTEGER NOT NULL,
    error TEXT, facts TEXT NOT NULL, probed_at REAL, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS cordons (node TEXT PRIMARY KEY, reason TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, at REAL NOT NULL, kind TEXT NOT NULL, node TEXT, message TEXT NOT NULL
);
"""


def _v1_to_v2(tx: Tx) -> None:
    """Replicas gain a generation (part of their key), desired state, runtime and restarts;
    holds appear. Rows a version-1 state holds are generation 1, desired up."""
    run(tx, _V1_COMMON + _V1_REPLICAS)  # a v1 state that never had them (made by an early build)
    tx.execute("ALTER TABLE replicas RENAME TO replicas_v1")
    run(tx, _V2_REPLICAS)
    tx.execute(
        "INSERT INTO replicas(model, replica, generation, spec, status, endpoint, detail, updated_at) "
        "SELECT model, replica, 1, spec, status, endpoint, detail, updated_at FROM replicas_v1"
    )
    tx.execute("DROP TABLE replicas_v1")


# ---- version 2 -> 3 (SQLite) ----------------------------------------------
_OLD_KINDS = {"reserve": "reserved", "release": "released", "discover": "discover", "cordon": "cordon",
              "uncordon": "uncordon", "migrate": "migrate"}  # fmt: skip
_NAMED = re.compile(r"^(?P<model>\S+)/(?P<replica>\d+)\b")


def _ints(values: Any) -> str:
    return ",".join(str(int(v)) for v in values or ())


def _v2_to_v3(tx: Tx) -> None:
    """Replicas lose their JSON (placement columns, shards in their own table) and gain a
    revision; generations are counted apart, so none is reused; holds gain the GPU's UUID
    and reference their replica; events gain structure. Node status starts from the facts:
    ready where the last probe answered. Everything a version-2 state holds is kept."""
    from cluster_cli.state.sqlite import SQLITE

    now = time.time()
    for old in ("replicas", "holds", "events"):
        tx.execute(f"ALTER TABLE {old} RENAME TO {old}_v2")
    tx.execute("DROP INDEX IF EXISTS holds_by_replica")
    run(tx, tables(SQLITE))
    from cluster_cli.state.launches import gpu_uuids

    uuids = gpu_uuids(tx)
    rows = tx.execute(
        "SELECT model, replica, generation, spec, status, endpoint, detail, desired, runtime, started_at, "
        "restarts, updated_at FROM replicas_v2 ORDER BY model, replica, generation"
    ).fetchall()
    shard_uuid: dict[tuple[str, int, int, str, int], str] = {}
    for model, replica, gen, spec_doc, status, endpoint, detail, desired, runtime_doc, started, restarts, upd in rows:
        spec = json.loads(spec_doc)
        rt = json.loads(runtime_doc) if runtime_doc else {}
        status = status if status in STATES else "failed"
        desired = desired if desired in DESIRED else "up"
        tx.execute(
            "INSERT INTO replicas(model, replica, generation, profile, engine, fabric, gpu_class, cpus, memory_mib, "
            "status, desired, endpoint, port, extra_ports, owner, started_at, restarts, detail, revision, "
            "created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,1,?,?)",
            (model, replica, gen, spec.get("profile", ""), spec.get("engine", ""), spec.get("fabric"),
             spec.get("gpu_class"), spec.get("cpus"), spec.get("memory_mib"), status, desired, endpoint,
             rt.get("port"), _ints(rt.get("extra_ports")), rt.get("owner"), started, restarts or 0, detail,
             upd, upd),
        )  # fmt: skip
        runs = rt.get("shards") or []
        for rank, sh in enumerate(spec.get("shards") or []):
            r = runs[rank] if rank < len(runs) else {}
            gpus = [int(g) for g in sh.get("gpus") or ()]
            run_uuids = list(r.get("gpu_uuids") or ())
            for i, g in enumerate(gpus):
                u = run_uuids[i] if len(run_uuids) == len(gpus) else uuids.get((sh["node"], g))
                if u:
                    shard_uuid[(model, replica, gen, sh["node"], g)] = u
            state = "running" if r.get("pid") is not None else ("starting" if r.get("token") else "planned")
            if status == "stopped":
                state = "stopped"
            tx.execute(
                "INSERT INTO shards(model, replica, generation, rank, node, gpus, hcas, run_dir, token, pid, "
                "start_time, gpu_uuids, state, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (model, replica, gen, rank, sh["node"], _ints(gpus), ",".join(sh.get("hcas") or ()),
                 r.get("run_dir"), r.get("token"), r.get("pid"), r.get("start_time"), ",".join(run_uuids),
                 state, upd),
            )  # fmt: skip
        tx.execute(
            "INSERT INTO generations(model, replica, last) VALUES (?,?,?) "
            "ON CONFLICT (model, replica) DO UPDATE SET last = CASE WHEN excluded.last > generations.last "
            "THEN excluded.last ELSE generations.last END",
            (model, replica, gen),
        )
    for node, kind, item, model, replica, gen in tx.execute(
        "SELECT node, kind, item, model, replica, generation FROM holds_v2"
    ).fetchall():
        if (
            tx.execute(
                "SELECT 1 FROM replicas WHERE model=? AND replica=? AND generation=?", (model, replica, gen)
            ).fetchone()
            is None
        ):
            continue  # a hold of no replica: books nothing
        u = shard_uuid.get((model, replica, gen, node, item)) if kind == "gpu" else None
        if u is not None and tx.execute("SELECT 1 FROM holds WHERE uuid=?", (u,)).fetchone() is not None:
            u = None  # two v2 holds name one device (renumbered GPUs): this one is kept by its index
        tx.execute("INSERT INTO holds VALUES (?,?,?,?,?,?,?)", (node, kind, item, u, model, replica, gen))
    reserved: dict[tuple[str, int], int] = {}
    for at, kind, node, message in tx.execute("SELECT at, kind, node, message FROM events_v2 ORDER BY id").fetchall():
        m = _NAMED.match(message or "")
        if m and kind == "reserve":
            key = (m["model"], int(m["replica"]))
            reserved[key] = reserved.get(key, 0) + 1
        tx.execute(
            "INSERT INTO events(at, kind, node, model, replica, actor, message) VALUES (?,?,?,?,?,?,?)",
            (at, _OLD_KINDS.get(kind, "note"), node, m["model"] if m else None,
             int(m["replica"]) if m else None, "", message),
        )  # fmt: skip
    # Schema 2 could reserve a MODEL/N's generation 1 again after a down: every reservation its
    # events saw counts, so that no generation a node may still have a folder of is used again.
    for (model, replica), n in reserved.items():
        tx.execute(
            "INSERT INTO generations(model, replica, last) VALUES (?,?,?) ON CONFLICT (model, replica) "
            "DO UPDATE SET last = CASE WHEN excluded.last > generations.last THEN excluded.last ELSE generations.last END",
            (model, replica, n),
        )
    for name, reachable, probed_at in tx.execute("SELECT name, reachable, probed_at FROM nodes").fetchall():
        tx.execute(
            "INSERT INTO node_status(node, status, since, last_heartbeat, updated_at) VALUES (?,?,?,?,?)",
            (name, "ready" if reachable else "unreachable", probed_at or now, probed_at if reachable else None, now),
        )
    for old in ("replicas", "holds", "events"):
        tx.execute(f"DROP TABLE {old}_v2")


MIGRATIONS: dict[int, Callable[[Tx], None]] = {1: _v1_to_v2, 2: _v2_to_v3}  # from version N to N+1


def migrate(tx: Tx, version: int) -> int:
    """Bring a state at schema ``version`` up to date (inside the caller's transaction);
    returns the version it started from."""
    if version < 2:
        run(tx, _V1_COMMON)
    for v in range(version, SCHEMA_VERSION):
        MIGRATIONS[v](tx)
    if version != SCHEMA_VERSION:
        tx.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    return version
