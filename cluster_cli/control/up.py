"""``up``: make the cluster run what the catalog asks for.

probe the nodes → save their facts → place (the planner of ``place``, unchanged) → reserve the
new replicas in one transaction → start every shard → wait until each is ready → publish the
router config. Replicas the catalog no longer asks for leave the router config first, then
stop. Running healthy replicas are left alone; a dead or unanswering one is restarted on its
own allocation. A replica that fails is stopped and released whole; the others go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.control.checks import HealthChecks, find_dead
from cluster_cli.errors import ClusterctlError, SSHError
from cluster_cli.launch import node as nodeops
from cluster_cli.launch import routerconf
from cluster_cli.launch.observe import Observed
from cluster_cli.launch.shards import pick_port, profile_of, shard_starts
from cluster_cli.state.launches import StaleVersion
from cluster_cli.state.records import FAILED, PLANNED, READY, STARTING, UNHEALTHY, ReplicaRecord, replica_name
from cluster_cli.state.store import Store

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.runs import Runs
    from cluster_cli.control.sessions import Sessions
    from cluster_cli.facts import NodeFacts
    from cluster_cli.placement import Plan

POLL_S = (0.05, 0.1, 0.2, 0.5)  # readiness checks: soon after the start, then every 0.5 s
STOP_GRACE_S = 10.0
Report = Callable[[str, str, str], None]  # (replica name, phase, detail)


@dataclass
class Outcome:
    """What ``up`` did with one replica."""

    name: str
    model: str
    action: str  # start, restart, keep, stop, unplaced
    state: str  # ready, failed, stopped, unplaced, ...
    nodes: list[str] = field(default_factory=list)
    endpoint: str | None = None
    reason: str = ""
    log: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model,
            "action": self.action,
            "state": self.state,
            "nodes": self.nodes,
            "endpoint": self.endpoint,
            "reason": self.reason or None,
            "log": self.log,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class UpResult:
    outcomes: list[Outcome]
    state_version: int
    router_config: Path

    @property
    def complete(self) -> bool:
        return all(o.state in (READY, "stopped") for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "state_version": self.state_version,
            "router_config": str(self.router_config),
            "replicas": [o.to_dict() for o in self.outcomes],
        }


def _quiet(name: str, phase: str, detail: str) -> None:
    pass


async def up(
    inv: Inventory,
    cat: Catalog,
    store: Store,
    sessions: Sessions,
    facts: list[NodeFacts],
    *,
    router_config: Path,
    expect_version: int | None = None,
    timeout_s: float = 600.0,
    report: Report = _quiet,
    observed: Observed | None = None,
    refresh: Callable[[], list[NodeFacts]] | None = None,
    runs: Runs | None = None,
    health: HealthChecks | None = None,
    reprobe: Callable[[], Awaitable[tuple[list[NodeFacts], Observed]]] | None = None,
) -> UpResult:
    """Apply the catalog to the cluster (``facts``: the nodes as the state holds them now;
    ``observed``: what the probe that made them saw of the shards and ports, if it ran;
    ``refresh``: the nodes as the state holds them, read again after another run wrote;
    ``runs``: this run, and which others are going on this state: a replica another live run
    left planned or starting is its own, not a leftover to restart; ``health``: the kept
    replicas' health checks, started during the probe; ``reprobe``: probe every node in full
    and read the nodes back, when ``facts`` came from a probe that only checked the running
    replicas: it is called before anything new is placed)."""
    from cluster_cli.placement import plan

    by_node = {f.name: f for f in facts}
    outcomes: list[Outcome] = []
    version = store.version()
    if expect_version is not None and version != expect_version:
        raise StaleVersion(
            f"the state is at version {version}, not {expect_version}: run 'clusterctl place --dry-run' again"
        )

    # Kept replicas first: which still run and answer.
    current = store.records()
    seen = observed or Observed()
    busy: set[tuple[str, int, int]] = set()
    me = runs.id if runs is not None else None

    def theirs(rec: ReplicaRecord) -> bool:
        return runs is not None and rec.owner != me and runs.alive(rec.owner)

    checks = health or HealthChecks([], sessions)
    dead = await find_dead(current, sessions, seen, busy, theirs, checks)

    for attempt in range(3):
        result: Plan = plan(facts, cat, [r.replica for r in current])
        away = _away(result)
        if reprobe is not None and any(p.replica.key not in away for p in result.starts):
            # Something new is placed after all: on facts of every kind, read now.
            facts, seen = await reprobe()
            reprobe = None
            by_node = {f.name: f for f in facts}
            if expect_version is None:
                version = store.version()
            result = plan(facts, cat, [r.replica for r in current])
            away = _away(result)
        # Each with the plan's reason.
        stopping = [(rec, p.note) for p in result.stops
                    if p.replica.key not in away and (rec := _record_of(current, p.replica)) is not None]  # fmt: skip
        new = _new_records(result, away, inv, cat, store, await _taken_ports(result, sessions, store, seen), me,
                           current)  # fmt: skip
        try:
            # A replica placed anew (its GPUs gone bad, its profile changed) may take what its
            # stopped allocation held: that is stopped first.
            version = store.reserve(new, expect_version=version, replacing=[rec for rec, _ in stopping])
            break
        except StaleVersion:
            if attempt == 2 or expect_version is not None:
                raise
            # Another up (or a cordon) wrote meanwhile: plan again from what is there now.
            checked = {r.key for r in current}
            current = store.records()
            fresh = [r for r in current if r.key not in checked]
            dead.update(await find_dead(fresh, sessions, seen, busy, theirs, checks))
            facts = refresh() if refresh is not None else store.nodes()
            by_node = {f.name: f for f in facts}
            version = store.version()

    # Out of the router first, then stopped: no new request reaches a replica being stopped.
    if stopping:
        gone = {rec.key for rec, _ in stopping}
        routerconf.write(router_config, routerconf.render([r for r in store.records() if r.key not in gone], cat))
        await asyncio.sleep(routerconf.PICKUP_S)
    for rec, _ in stopping:
        report(rec.name, "stopping", "")
    outcomes += await asyncio.gather(*(_stop(rec, why, store, sessions, report) for rec, why in stopping))

    for rec in current:
        if rec.replica.key in away:
            why = f"{away[rec.replica.key]}: left as it is (the next up checks it again)"
            store.observe(replace(rec, status=UNHEALTHY, detail=why))  # out of the router config
            outcomes.append(replace(_kept(rec), state=UNHEALTHY, reason=why))
            report(rec.name, "unhealthy", why)
    keeps = [_record_of(current, p.replica) for p in result.keeps]
    restart = [r for r in keeps if r is not None and r.key in dead]
    for rec in keeps:
        if rec is not None and rec.key in busy:
            why = "being started by another up"
            outcomes.append(replace(_kept(rec), state=STARTING, reason=why))
            report(rec.name, "starting", why)
        elif rec is not None and rec.key not in dead:
            outcomes.append(_kept(rec))
            report(rec.name, "ready", "running")

    deadline = time.monotonic() + timeout_s
    jobs = [_launch(rec, "start", inv, cat, store, sessions, by_node, deadline, report) for rec in new]
    for rec in restart:
        jobs.append(_restart(replace(rec, owner=me), dead[rec.key], inv, cat, store, sessions, by_node, deadline,
                             report))  # fmt: skip
    outcomes += await asyncio.gather(*jobs)

    for u in result.unplaced:
        why = "; ".join(r.message for r in u.reasons[:3]) if u.reasons else "no profile fits"
        outcomes.append(Outcome(replica_name(u.model, u.replica), u.model, "unplaced", "unplaced", reason=why))
        report(replica_name(u.model, u.replica), "unplaced", why)

    routerconf.write(router_config, routerconf.render(store.records(), cat))
    outcomes.sort(key=lambda o: (o.model, int(o.name.rpartition("/")[2])))
    return UpResult(outcomes, store.version(), router_config)


def _record_of(records: list[ReplicaRecord], replica: Any) -> ReplicaRecord | None:
    """The record of ``replica`` (of two generations of it, the one with that allocation)."""
    return next((r for r in records if r.replica == replica), None)


def _away(result: Plan) -> dict[tuple[str, int], str]:
    """The replicas the plan stops because a node of theirs did not answer, with why: one may
    still run there, so it is neither stopped nor released (its engine would be left behind,
    unrecorded), nor replaced by this run."""
    return {p.replica.key: p.note for p in result.stops if p.note.endswith(" unreachable")}


def _kept(rec: ReplicaRecord) -> Outcome:
    return Outcome(rec.name, rec.replica.model, "keep", rec.status, [s.node for s in rec.replica.shards], rec.endpoint)


async def _taken_ports(result: Plan, sessions: Sessions, store: Store, seen: Observed) -> dict[str, set[int]]:
    """Per node that gets a new replica: the ports listening there and those the state holds."""
    nodes = {p.replica.shards[0].node for p in result.starts if p.replica.shards}
    out: dict[str, set[int]] = {}

    async def one(n: str) -> None:
        taken = set(store.held_ports(n))
        if n in seen.listening:
            taken |= seen.listening[n]
        else:
            with contextlib.suppress(SSHError, OSError):  # the start finds the node unreachable and says so
                taken |= await nodeops.listening(await sessions.get(n))
        out[n] = taken

    await asyncio.gather(*(one(n) for n in sorted(nodes)))
    return out


def _new_records(
    result: Plan, away: dict[tuple[str, int], str], inv: Inventory, cat: Catalog, store: Store,
    taken: dict[str, set[int]], owner: str | None, current: list[ReplicaRecord],
) -> list[ReplicaRecord]:  # fmt: skip
    """The records of the plan's new replicas, each with its port(s); a replica placed anew
    while its earlier allocation is being stopped is that one's next generation."""
    gens: dict[tuple[str, int], int] = {}
    for rec in current:
        gens[rec.replica.key] = max(gens.get(rec.replica.key, 0), rec.generation)
    out = []
    for p in result.starts:
        r = p.replica
        if r.key in away:
            continue
        head = r.shards[0].node
        used = taken.setdefault(head, set())
        n = inv.node(head)
        lo, hi = inv.port_range(n) if n is not None else (8100, 8999)
        profile = profile_of(cat, ReplicaRecord(r))
        port = profile.port or pick_port(lo, hi, used)
        if port is None:
            raise ClusterctlError(f"{head}: no free port left in {lo}-{hi} for {replica_name(r.model, r.replica)}")
        used.add(port)
        extra: tuple[int, ...] = ()
        if len(r.shards) > 1:  # the replica's own Ray head port
            ray = pick_port(lo, hi, used)
            if ray is None:
                raise ClusterctlError(f"{head}: no free port left in {lo}-{hi} for a Ray head")
            used.add(ray)
            extra = (ray,)
        gen = gens.get(r.key, 0) + 1
        out.append(ReplicaRecord(r, generation=gen, status=PLANNED, port=port, extra_ports=extra, owner=owner))
    return out


def _endpoint(inv: Inventory, rec: ReplicaRecord, reached: str | None = None) -> str:
    """Where the router finds ``rec``: the address SSH reached its head node at (``reached``:
    ssh_config's HostName when the inventory names an alias), else the inventory's host."""
    n = inv.node(rec.replica.shards[0].node)
    host = reached or (n.host if n is not None else rec.replica.shards[0].node)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{rec.port}"


async def _launch(
    rec: ReplicaRecord,
    action: str,
    inv: Inventory,
    cat: Catalog,
    store: Store,
    sessions: Sessions,
    facts: dict[str, NodeFacts],
    deadline: float,
    report: Report,
) -> Outcome:
    """Start every shard of ``rec``, wait until it is ready; on any failure stop it whole and
    release it whole."""
    t0 = time.monotonic()
    nodes = [s.node for s in rec.replica.shards]
    out = Outcome(rec.name, rec.replica.model, action, STARTING, nodes)
    runs = []
    report(rec.name, "starting", ", ".join(nodes))
    try:
        starts = shard_starts(rec, cat, inv, facts)
        first = await sessions.get(starts[0].node)
        endpoint = _endpoint(inv, rec, getattr(first, "host", None))
        rec = replace(rec, shards=tuple(s.run for s in starts), status=STARTING, endpoint=endpoint)
        # Shard 0 first (a multi-node replica's Ray head), then the others together.
        head = await nodeops.start(first, starts[0])
        runs.append(head)

        async def other(s: Any) -> Any:
            return await nodeops.start(await sessions.get(s.node), s)

        runs += await asyncio.gather(*(other(s) for s in starts[1:]))
        rec = replace(rec, shards=tuple(runs), started_at=time.time())
        store.observe(rec)
        report(rec.name, "loading", f"pid {head.pid} on {head.node}")
        await _wait_ready(rec, sessions, deadline, report)
        rec = replace(rec, status=READY, detail=None)
        store.observe(rec)
        out.state, out.endpoint = READY, rec.endpoint
        report(rec.name, "ready", rec.endpoint or "")
    except (ClusterctlError, OSError, ValueError) as e:
        out.state, out.reason = FAILED, str(e)
        out.log = list(getattr(e, "log", []) or [])
        report(rec.name, "failed", out.reason)
        out.log = await _stop_whole(rec, sessions, out.log) or out.log
        store.release(rec, why=f"failed to start: {out.reason}")
    out.seconds = time.monotonic() - t0
    return out


async def _wait_ready(rec: ReplicaRecord, sessions: Sessions, deadline: float, report: Report) -> None:
    last = ""
    head = rec.shards[0]
    assert rec.port is not None
    polls = 0
    while True:
        why = await nodeops.ready(await sessions.get(head.node), rec.port, rec.replica.model)
        if why is None:
            return
        for run in rec.shards:
            (ok,) = await nodeops.alive(await sessions.get(run.node), [run])
            if not ok:
                raise nodeops.LaunchError(f"the engine exited on {run.node}")
        if why != last:
            report(rec.name, "loading", why)
            last = why
        if time.monotonic() > deadline:
            raise nodeops.LaunchError(f"not ready in time: {why}")
        await asyncio.sleep(POLL_S[min(polls, len(POLL_S) - 1)])
        polls += 1


async def _stop_whole(rec: ReplicaRecord, sessions: Sessions, log: list[str]) -> list[str]:
    """Stop every shard of ``rec`` (what of it started); shard 0's log tail, else ``log``."""
    _, tails = await _stop_shards(rec, sessions, check=False)
    return tails or log


async def _restart(
    rec: ReplicaRecord,
    why: str,
    inv: Inventory,
    cat: Catalog,
    store: Store,
    sessions: Sessions,
    facts: dict[str, NodeFacts],
    deadline: float,
    report: Report,
) -> Outcome:
    """A kept replica that died: taken over by this run (``rec.owner``), what is left of it is
    stopped, then it starts again on its own allocation (GPUs and port), one restart more.
    Another run that took it over first keeps it."""
    seen, rec = rec, replace(rec, status=UNHEALTHY, detail=why, restarts=rec.restarts + 1)
    if not store.claim(seen, rec):
        why = "being restarted by another up"
        report(rec.name, "starting", why)
        return replace(_kept(seen), state=STARTING, reason=why)
    report(rec.name, "restarting", why)
    await _stop_whole(rec, sessions, [])
    out = await _launch(rec, "restart", inv, cat, store, sessions, facts, deadline, report)
    if not out.reason:
        out.reason = f"restarted: {why}"
    return out


async def _stop(rec: ReplicaRecord, why: str, store: Store, sessions: Sessions, report: Report) -> Outcome:
    """Stop a replica the plan does not keep (``why``: the plan's reason) and release it."""
    t0 = time.monotonic()
    out = Outcome(rec.name, rec.replica.model, "stop", "stopped", [s.node for s in rec.replica.shards], reason=why)
    problems = await stop_replica(rec, sessions)
    if problems:
        out.state, out.reason = FAILED, problems
    store.release(rec, why=f"stopped ({why or 'no longer in the catalog'})")
    report(rec.name, out.state, out.reason)
    out.seconds = time.monotonic() - t0
    return out


async def stop_replica(rec: ReplicaRecord, sessions: Sessions) -> str:
    """Stop every shard and check that nothing of it is left; what was left, or ""."""
    problems, _ = await _stop_shards(rec, sessions, check=True)
    return "; ".join(problems)


async def _stop_shards(rec: ReplicaRecord, sessions: Sessions, *, check: bool) -> tuple[list[str], list[str]]:
    """Stop every shard of ``rec`` at once: (what was left of it, shard 0's log tail). With
    ``check``, shard 0's port and the shards' GPUs are checked too, and an unreachable node is
    a problem (without, it is passed over: the node went away with what ran there)."""
    problems: list[str] = []
    tails: list[str] = []

    async def one(i: int, run: Any) -> None:
        port = rec.port if i == 0 and check else None
        try:
            res = await nodeops.stop(
                await sessions.get(run.node),
                run,
                grace_s=STOP_GRACE_S,
                port=port,
                gpu_check=check and bool(run.gpu_uuids),
            )
        except (SSHError, OSError) as e:
            if check:
                problems.append(f"{run.node}: {e}")
            return
        if i == 0:
            tails.extend(res.log)
        if not res.clean:
            problems.append(f"{run.node}: {res.problem()}")

    await asyncio.gather(*(one(i, run) for i, run in enumerate(rec.shards)))
    return problems, tails
