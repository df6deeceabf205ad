"""``down``, ``status`` and ``logs``: the launched replicas, found again from the state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.control.publish import DRAIN_S, drained, engine_keys, publish
from cluster_cli.engines import get_engine
from cluster_cli.errors import ClusterctlError, ConfigError, SSHError
from cluster_cli.launch import node as nodeops
from cluster_cli.launch import remote
from cluster_cli.state.records import DOWN, FENCED, READY, UNHEALTHY, UP, ReplicaRecord

if TYPE_CHECKING:
    from cluster_cli.control.nodes import Node, Nodes
    from cluster_cli.ssh.pool import Sessions
    from cluster_cli.state.aio import AsyncStore
    from cluster_cli.state.store import Store


def select(records: Iterable[ReplicaRecord], names: Iterable[str]) -> list[ReplicaRecord]:
    """The records that ``names`` (``MODEL/N`` or ``MODEL``) name. Raises ConfigError naming
    one that matches nothing."""
    records = list(records)
    out: dict[tuple[str, int, int], ReplicaRecord] = {}
    for name in names:
        hit = [r for r in records if r.name == name or r.replica.model == name]
        if not hit:
            known = ", ".join(sorted({r.name for r in records})) or "none"
            raise ConfigError(f"{name}: no such replica or model in the state (replicas: {known})")
        out.update((r.key, r) for r in hit)
    return sorted(out.values(), key=lambda r: r.key)


@dataclass
class Downed:
    name: str
    nodes: list[str]
    clean: bool
    problem: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "nodes": self.nodes, "stopped": self.clean, "problem": self.problem or None}


async def down(
    store: AsyncStore,
    nodes: Nodes,
    targets: list[ReplicaRecord],
    *,
    router_config: Path,
    report: Callable[[str], None],
    owner: str | None = None,
    alive: Callable[[str | None], bool] = lambda _: False,
    drain_s: float = DRAIN_S,
) -> list[Downed]:
    """Mark ``targets`` wanted down (a run starting one meanwhile sees it and stops what it
    started), take them out of the router config, then stop each whole and release it,
    wanted down (nothing brings it back until the next ``up``). One whose stop cannot be
    confirmed is fenced: its GPUs stay held until a later stop confirms it gone. Targets
    fenced by an earlier stop are stopped again, and freed once confirmed gone; one an
    interrupted ``down`` left stopping is stopped now (one whose ``down`` is still going,
    ``alive``, is left to it). ``owner``: this run, recorded on what it stops. Published
    draining first, each is stopped once the routers on this host have no request left on
    it, or after ``drain_s``."""
    from cluster_cli.control import stops

    fenced = [t for t in targets if t.status == FENCED]
    marked: list[ReplicaRecord] = []
    theirs: list[ReplicaRecord] = []
    for t in targets:
        if t.status == FENCED:
            continue
        if t.desired == DOWN:  # stopping: left so by a down that is gone, or still going
            (theirs if t.owner != owner and alive(t.owner) else marked).append(t)
            continue
        marked += await _want_down(store, t, owner)
    nodes.prefetch(sorted({run.node for t in marked for run in t.shards}))  # connect while the router catches up
    published = router_config.exists() or bool(await store.records())
    if published:  # draining: no new request reaches them, those in flight finish
        await publish(store, router_config)
        await drained(router_config, {t.name for t in marked}, drain_s)

    async def one(rec: ReplicaRecord) -> Downed:
        stopped = await stops.stop_shards(rec, nodes)
        await stops.release(store, rec, stopped, why="stopped by down", wanted_down=True)
        return _downed(rec, stopped.problem(), report)

    async def again(rec: ReplicaRecord) -> Downed:
        mine = [f for f in await store.fences() if (f.model, f.replica, f.generation) == rec.key]
        still = await stops.clear(store, nodes, mine)
        return _downed(rec, "; ".join(f"{f.node}: {f.reason}" for f in still), report)

    busy = [Downed(t.name, [s.node for s in t.replica.shards], False, "being stopped by another down") for t in theirs]
    done = list(await asyncio.gather(*(one(r) for r in marked), *(again(r) for r in fenced)))
    if published:
        await publish(store, router_config)  # the stopped ones leave it
    return busy + done


async def _want_down(store: AsyncStore, rec: ReplicaRecord, owner: str | None) -> list[ReplicaRecord]:
    """``rec`` marked wanted down; where its row changed meanwhile (a status, a restart, an
    ``up`` that replaced it with its next generation), every live generation of its
    ``MODEL/N`` as read again."""
    from cluster_cli.state.launches import StaleRecord

    why = "wanted down: stopping it"
    try:
        return [await store.want_down(rec, why=why, owner=owner)]
    except StaleRecord:
        pass
    out = []
    for cur in [r for r in await store.records() if r.name == rec.name]:
        try:
            out.append(await store.want_down(cur, why=why, owner=owner))
        except StaleRecord:
            continue  # changed once more: the next down takes it
    return out


def _downed(rec: ReplicaRecord, problem: str, report: Callable[[str], None]) -> Downed:
    if problem:
        problem += " (fenced: its GPUs and ports stay held until a stop confirms it gone)"
    report(f"{rec.name}: {'stopped' if not problem else 'stopped, with problems: ' + problem}")
    return Downed(rec.name, [s.node for s in rec.replica.shards], not problem, problem)


@dataclass
class Row:
    """One replica as ``status`` shows it."""

    rec: ReplicaRecord
    state: str
    load: dict[str, float | None]
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        r = self.rec.replica
        return {
            "name": self.rec.name,
            "model": r.model,
            "profile": r.profile,
            "engine": r.engine,
            "nodes": [s.node for s in r.shards],
            "gpus": {s.node: list(s.gpus) for s in r.shards if s.gpus},
            "endpoint": self.rec.endpoint,
            "state": self.state,
            "generation": self.rec.generation,
            "uptime_s": round(time.time() - self.rec.started_at, 1)
            if self.rec.started_at and self.state == READY
            else None,
            "restarts": self.rec.restarts,
            "desired": self.rec.desired,
            "load": self.load,
            "detail": self.detail or self.rec.detail,
        }


_UNKNOWN = {"running": None, "waiting": None, "kv_cache_usage": None}


async def status(
    store: AsyncStore, nodes: Nodes | None, *, log_cap: Callable[[str], int | None] = lambda _: None
) -> list[Row]:
    """Every replica with its state as seen now (``nodes`` None: as last recorded) and its
    engine's load, scraped through the node's SSH session. What it sees is recorded only if
    the row is still as it was read: a replica restarted meanwhile keeps its new processes.
    ``log_cap``: per node, the size its shards' logs are trimmed to as they are checked."""
    records = await store.records(include_down=True, include_fenced=True)
    key_of = engine_keys(store) if nodes is not None else None

    async def one(rec: ReplicaRecord) -> Row:
        if rec.status == FENCED or rec.desired != UP:  # stopping, stopped or fenced: as recorded
            return Row(rec, rec.status, dict(_UNKNOWN))
        if nodes is None or rec.status != READY or rec.port is None or not rec.shards:
            return Row(rec, rec.status, dict(_UNKNOWN))
        try:
            for run in rec.shards:
                (ok,) = await (await nodes.get(run.node)).alive([run], trim_bytes=log_cap(run.node))
                if not ok:
                    return Row(rec, UNHEALTHY, dict(_UNKNOWN), f"its engine on {run.node} is not running")
            s = await nodes.get(rec.shards[0].node)
            key = key_of(rec) if key_of is not None else None
            why = await s.ready(rec.port, rec.replica.model, api_key=key)
            if why is not None:
                return Row(rec, UNHEALTHY, dict(_UNKNOWN), why)
            return Row(rec, READY, await _load(s, rec, key))
        except (SSHError, OSError) as e:
            return Row(rec, UNHEALTHY, dict(_UNKNOWN), f"cannot be checked: {e}")

    rows = list(await asyncio.gather(*(one(r) for r in records)))
    for row in rows:  # observed health: recorded (compare and set), no new state version
        if row.rec.desired == UP and row.state != row.rec.status and nodes is not None:
            await store.claim(row.rec, replace(row.rec, status=row.state, detail=row.detail or None))
    return rows


async def _load(node: Node, rec: ReplicaRecord, key: str | None = None) -> dict[str, float | None]:
    from cluster_cli.engines.metrics import mapped_names, parse_metrics, resolve

    engine = get_engine(rec.replica.engine)
    if engine is None or rec.port is None:
        return dict(_UNKNOWN)
    try:
        code, body = await node.get(rec.port, "/metrics", api_key=key)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return dict(_UNKNOWN)
    if code != 200:
        return dict(_UNKNOWN)
    values = parse_metrics(body.decode("utf-8", "replace"), mapped_names(engine.metrics))
    running, waiting, kv = resolve(values, engine.metrics)
    return {"running": running, "waiting": waiting, "kv_cache_usage": kv}


def find(store: Store, name: str, shard: int = 0) -> ReplicaRecord:
    """The live record of replica ``name`` (``MODEL/N``). Raises ConfigError."""
    recs = [r for r in store.records(include_down=True, include_fenced=True) if r.name == name]
    if not recs:
        known = ", ".join(sorted({r.name for r in store.records()})) or "none"
        raise ConfigError(f"{name}: no such replica in the state (replicas: {known})")
    rec = recs[-1]
    if not rec.shards:
        raise ClusterctlError(f"{name}: it was never started (state {rec.status})")
    if not 0 <= shard < len(rec.shards):
        raise ConfigError(f"--shard {shard}: {name} has shards 0-{len(rec.shards) - 1}")
    return rec


async def logs(
    sessions: Sessions,
    rec: ReplicaRecord,
    *,
    shard: int,
    lines: int,
    follow: bool,
    write: Callable[[bytes], None],
    previous: bool = False,
) -> int | None:
    """Print a shard's log (``previous``: the one before its last start, ``log.1``)."""
    run = rec.shards[shard]
    s = await sessions.get(run.node)
    cmd = remote.log_command(run.run_dir, lines=lines, follow=follow, previous=previous)
    stream = getattr(s, "stream", None)
    if stream is None:
        res = await s.run(cmd, timeout=nodeops.SCRIPT_TIMEOUT_S)
        write(res.stdout.encode())
        return res.rc
    return await stream(cmd, write)
