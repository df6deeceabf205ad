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

from cluster_cli.control import stops
from cluster_cli.control.checks import HealthChecks, find_dead
from cluster_cli.control.discovery import Fleet
from cluster_cli.control.publish import DRAIN_S, drained, engine_keys, publish
from cluster_cli.errors import ClusterctlError, SSHError
from cluster_cli.launch import node as nodeops
from cluster_cli.launch.observe import Observed
from cluster_cli.launch.shards import pick_port, profile_of, shard_starts
from cluster_cli.state.launches import StaleRecord, StaleVersion
from cluster_cli.state.records import (
    FAILED,
    PLANNED,
    READY,
    STARTING,
    STOPPED,
    STOPPING,
    UNHEALTHY,
    ReplicaRecord,
    replica_name,
)

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.runs import Runs
    from cluster_cli.control.sessions import Sessions
    from cluster_cli.facts import NodeFacts
    from cluster_cli.placement import Plan
    from cluster_cli.state.aio import AsyncStore

POLL_S = (0.05, 0.1, 0.2, 0.5)  # readiness checks: soon after the start, then every 0.5 s
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
    store: AsyncStore,
    sessions: Sessions,
    fleet: Callable[[], Awaitable[Fleet]],
    *,
    router_config: Path,
    expect_version: int | None = None,
    timeout_s: float = 600.0,
    report: Report = _quiet,
    observed: Observed | None = None,
    runs: Runs | None = None,
    health: HealthChecks | None = None,
    reprobe: Callable[[], Awaitable[tuple[Fleet, Observed]]] | None = None,
    catalog_doc: dict[str, Any] | None = None,
    catalog_source: str | None = None,
    drain_s: float = DRAIN_S,
) -> UpResult:
    """Apply the catalog to the cluster. ``fleet`` reads the nodes, replicas and state version
    from one snapshot of the state (a cordon is in all three or in none); ``observed``: what
    the probe that made them saw of the shards and ports, if it ran; ``runs``: this run, and
    which others are going on this state: a replica another live run left planned or
    starting is its own, not a leftover to restart; ``health``: the kept replicas' health
    checks, started during the probe; ``reprobe``: probe every node in full and read the
    fleet again, when the first read came from a probe that only checked the running
    replicas: it is called before anything new is placed. ``catalog_doc`` is recorded as the
    desired state once the plan is reserved."""
    from cluster_cli.placement import plan

    # What earlier stops could not confirm, and stops an interrupted down left: tried again
    # first, so that the version checked below already counts what they free.
    await stops.clear(store, sessions, await store.fences())
    outcomes: list[Outcome] = await _finish_stops(store, sessions, runs, report)
    view = await fleet()
    if expect_version is not None and view.version != expect_version:
        raise StaleVersion(
            f"the state is at version {view.version}, not {expect_version}: run 'clusterctl place --dry-run' again"
        )

    # Kept replicas first: which still run and answer.
    current = view.records
    seen = observed or Observed()
    busy: set[tuple[str, int, int]] = set()
    me = runs.id if runs is not None else None

    def theirs(rec: ReplicaRecord) -> bool:
        return runs is not None and rec.owner != me and runs.alive(rec.owner)

    checks = health or HealthChecks([], sessions)
    dead = await find_dead(current, sessions, seen, busy, theirs, checks)
    planned: list[Any] | None = None  # with --check-version: the starts of the plan made at that version

    for attempt in range(4):
        result: Plan = plan(view.nodes, cat, [r.replica for r in current])
        away = _away(result)
        if reprobe is not None and any(p.replica.key not in away for p in result.starts):
            # Something new is placed after all: on facts of every kind, read now.
            view, seen = await reprobe()
            reprobe = None
            current = await _also_check(view, current, dead, sessions, seen, busy, theirs, checks)
            result = plan(view.nodes, cat, [r.replica for r in current])
            away = _away(result)
        if planned is None and expect_version is not None:
            planned = [p.replica for p in result.starts]
        elif planned is not None and [p.replica for p in result.starts] != planned:
            raise StaleVersion("the state moved on while replicas were stopped: run 'clusterctl place --dry-run' again")
        # Each with the plan's reason.
        stopping = [(rec, p.note) for p in result.stops
                    if p.replica.key not in away and (rec := _record_of(current, p.replica)) is not None]  # fmt: skip
        if stopping:
            # Out of the router first, then stopped and released; what the plan starts (a
            # replica placed anew on the GPUs it had) is placed again once they are free:
            # never on GPUs whose engine may still run.
            outcomes += await _stop_all(stopping, cat, store, sessions, router_config, report, me, drain_s)
            view = await fleet()
            current = await _also_check(view, current, dead, sessions, seen, busy, theirs, checks)
            continue
        by_node = {f.name: f for f in view.nodes}
        taken = await _taken_ports(result, sessions, store, seen)
        new, refused = _new_records(result, away, inv, cat, taken, me)
        try:
            # The version the plan was made from is checked and moved in the same statement.
            booked = await store.reserve(new, expect_version=view.version)
            break
        except StaleVersion:
            if attempt == 3 or expect_version is not None:
                raise
            # Another up (or a cordon) wrote meanwhile: plan again from what is there now.
            view = await fleet()
            current = await _also_check(view, current, dead, sessions, seen, busy, theirs, checks)
    else:
        raise StaleVersion("the state kept moving while up planned: run it again")
    if catalog_doc is not None:
        await store.save_catalog(catalog_doc, source=catalog_source)
    for o in refused:
        report(o.name, "failed", o.reason)
    outcomes += refused

    for rec in current:
        if rec.replica.key in away:
            why = f"{away[rec.replica.key]}: left as it is (the next up checks it again)"
            await stops.cas(
                store,
                rec,
                lambda cur, why=why: store.observe(replace(cur, status=UNHEALTHY, detail=why)),
                same=lambda cur: cur.desired == "up" and cur.status not in ("fenced", "stopping", "stopped"),
            )  # out of the router config
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
    jobs = [_launch(rec, "start", inv, cat, store, sessions, by_node, deadline, report) for rec in booked.records]
    for rec in restart:
        jobs.append(_restart(rec, dead[rec.key], me, inv, cat, store, sessions, by_node, deadline, report))
    outcomes += await asyncio.gather(*jobs)

    for u in result.unplaced:
        why = _unplaced_why(u)
        outcomes.append(Outcome(replica_name(u.model, u.replica), u.model, "unplaced", "unplaced", reason=why))
        report(replica_name(u.model, u.replica), "unplaced", why)

    await publish(store, router_config, cat=cat)
    outcomes.sort(key=lambda o: (o.model, int(o.name.rpartition("/")[2])))
    return UpResult(outcomes, await store.version(), router_config)


async def _stop_all(
    stopping: list[tuple[ReplicaRecord, str]],
    cat: Catalog,
    store: AsyncStore,
    sessions: Sessions,
    router_config: Path,
    report: Report,
    owner: str | None,
    drain_s: float,
) -> list[Outcome]:
    """Replicas the plan does not keep: marked wanted down and published draining first (no
    new request reaches them, those in flight finish), then each stopped and released
    (fenced where its stop is not confirmed). One another command changed meanwhile is its."""
    marked = []
    for rec, why in stopping:
        got = await stops.cas(
            store, rec, lambda cur, why=why: store.want_down(cur, why=f"stopping: {why or 'no longer in the catalog'}",
                                                             owner=owner),
            same=lambda cur, rec=rec: cur.desired == "up" and cur.shards == rec.shards,
        )  # fmt: skip
        if got is not None:
            marked.append((got, why))
    await publish(store, router_config, cat=cat)
    await drained(router_config, {rec.name for rec, _ in marked}, drain_s)
    for rec, _ in marked:
        report(rec.name, "stopping", "")
    return list(await asyncio.gather(*(_stop(rec, why, store, sessions, report) for rec, why in marked)))


async def _finish_stops(store: AsyncStore, sessions: Sessions, runs: Runs | None, report: Report) -> list[Outcome]:
    """Replicas a ``down`` marked wanted down and did not release (it was interrupted, or
    killed): stopped again and released now, or fenced. One whose ``down`` still runs is its own."""
    left = [r for r in await store.records(include_down=True) if r.status == STOPPING]
    mine = [r for r in left if runs is None or not runs.alive(r.owner)]

    async def one(rec: ReplicaRecord) -> Outcome:
        out = await _stop(rec, "left stopping by an interrupted down", store, sessions, report, wanted_down=True)
        return replace(out, action="stop")

    return list(await asyncio.gather(*(one(r) for r in mine)))


async def _also_check(
    view: Fleet,
    checked: list[ReplicaRecord],
    dead: dict[tuple[str, int, int], str],
    sessions: Sessions,
    seen: Observed,
    busy: set[tuple[str, int, int]],
    theirs: Callable[[ReplicaRecord], bool],
    checks: HealthChecks,
) -> list[ReplicaRecord]:
    """The replicas of a fresh read of the state; those not checked before are checked now."""
    before = {r.key for r in checked}
    fresh = [r for r in view.records if r.key not in before]
    dead.update(await find_dead(fresh, sessions, seen, busy, theirs, checks))
    return view.records


def _unplaced_why(u: Any) -> str:
    """Why no profile placed it, profile by profile, in ``place``'s words."""
    from cluster_cli.placement.explain import fit_message

    why = [f"{a.profile}: {fit_message(a.metrics)}" for a in u.attempts if not a.placed]
    return "; ".join(why) or "no profile fits"


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


async def _taken_ports(result: Plan, sessions: Sessions, store: AsyncStore, seen: Observed) -> dict[str, set[int]]:
    """Per node that gets a new replica: the ports listening there and those the state holds."""
    nodes = {p.replica.shards[0].node for p in result.starts if p.replica.shards}
    out: dict[str, set[int]] = {}

    async def one(n: str) -> None:
        taken = set(await store.held_ports(n))
        if n in seen.listening:
            taken |= seen.listening[n]
        else:
            with contextlib.suppress(SSHError, OSError):  # the start finds the node unreachable and says so
                taken |= await nodeops.listening(await sessions.get(n))
        out[n] = taken

    await asyncio.gather(*(one(n) for n in sorted(nodes)))
    return out


def _new_records(
    result: Plan, away: dict[tuple[str, int], str], inv: Inventory, cat: Catalog, taken: dict[str, set[int]],
    owner: str | None,
) -> tuple[list[ReplicaRecord], list[Outcome]]:  # fmt: skip
    """The records of the plan's new replicas, each with its port(s), and an outcome for each
    that can have none (a profile's fixed ``port:`` another replica or process takes on that
    node, a range used up): that replica alone is not started. The state gives each record
    its generation when it reserves them (the next one of its ``MODEL/N``)."""
    out, refused = [], []
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
        why = None
        if port is None:
            why = f"{head}: no free port left in {lo}-{hi}"
        elif port in used:  # a fixed port: the profile's one per node
            why = f"{head}: its profile's port {port} is taken there (by another replica or process): one per node"
        extra: tuple[int, ...] = ()
        if why is None and len(r.shards) > 1:  # the replica's own Ray head port
            ray = pick_port(lo, hi, used | {port})
            if ray is None:
                why = f"{head}: no free port left in {lo}-{hi} for a Ray head"
            extra = () if ray is None else (ray,)
        name = replica_name(r.model, r.replica)
        if why is not None:
            refused.append(Outcome(name, r.model, "start", FAILED, [s.node for s in r.shards], reason=why))
            continue
        used.add(port)  # type: ignore[arg-type]
        used.update(extra)
        out.append(ReplicaRecord(r, status=PLANNED, port=port, extra_ports=extra, owner=owner))
    return out, refused


def _endpoint(inv: Inventory, rec: ReplicaRecord, reached: str | None = None) -> str:
    """Where the router finds ``rec``: the address SSH reached its head node at (``reached``:
    ssh_config's HostName when the inventory names an alias), else the inventory's host."""
    n = inv.node(rec.replica.shards[0].node)
    host = reached or (n.host if n is not None else rec.replica.shards[0].node)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{rec.port}"


class _TakenAway(ClusterctlError):
    """The replica's row changed while this run started it (a ``down``, a release)."""


async def _launch(
    rec: ReplicaRecord,
    action: str,
    inv: Inventory,
    cat: Catalog,
    store: AsyncStore,
    sessions: Sessions,
    facts: dict[str, NodeFacts],
    deadline: float,
    report: Report,
) -> Outcome:
    """Start every shard of ``rec``, wait until it is ready. Its shards' markers are recorded
    before anything starts, so that whatever starts can be found again. On any failure it is
    stopped whole and released whole, or fenced where the stop could not be confirmed. When
    another command changed its row meanwhile (a ``down``), what this run started is
    stopped and the row is left as that command made it."""
    t0 = time.monotonic()
    nodes = [s.node for s in rec.replica.shards]
    out = Outcome(rec.name, rec.replica.model, action, STARTING, nodes)
    report(rec.name, "starting", ", ".join(nodes))
    runs: list[Any] = []  # what may run of it: the shards' markers, then their processes
    key = engine_keys(store)(rec)
    try:
        starts = shard_starts(rec, cat, inv, facts, api_key=key)
        first = await sessions.get(starts[0].node)
        endpoint = _endpoint(inv, rec, getattr(first, "host", None))
        runs = [s.run for s in starts]
        rec = await _record(store, replace(rec, shards=tuple(runs), status=STARTING, endpoint=endpoint, detail=None))
        # Shard 0 first (a multi-node replica's Ray head), then the others together.
        runs[0] = head = await nodeops.start(first, starts[0])

        async def other(i: int, s: Any) -> None:
            runs[i] = await nodeops.start(await sessions.get(s.node), s)

        # Every start ends before a failure is acted on: a slower shard that starts after the
        # stop ran would have nothing that knows of it.
        ends = await asyncio.gather(*(other(i, s) for i, s in enumerate(starts) if i > 0), return_exceptions=True)
        failed = next((e for e in ends if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
        rec = await _record(store, replace(rec, shards=tuple(runs), started_at=time.time()))
        report(rec.name, "loading", f"pid {head.pid} on {head.node}")
        await _wait_ready(rec, sessions, deadline, report, key)
        rec = await _record(store, replace(rec, status=READY, detail=None))
        out.state, out.endpoint = READY, rec.endpoint
        report(rec.name, "ready", rec.endpoint or "")
    except _TakenAway as e:
        # Whatever this run started is its own to stop: the other command could not see it.
        started = replace(rec, shards=tuple(runs))
        stopped = await stops.stop_shards(started, sessions)
        out.state, out.reason = STOPPED, f"{e}: what it started is stopped"
        if stopped.left:  # kept in the state, whatever the other command made of the row
            await store.fence_started(started, stopped.left, why=str(e))
            out.state, out.reason = FAILED, f"{e}; its stop is not confirmed ({stopped.problem()})"
        report(rec.name, out.state, out.reason)
    except (ClusterctlError, OSError, ValueError) as e:
        out.state, out.reason = FAILED, str(e)
        out.log = list(getattr(e, "log", []) or [])
        report(rec.name, "failed", out.reason)
        with contextlib.suppress(StaleRecord):  # the failure, as an event of its own
            rec = await store.observe(replace(rec, status=FAILED, detail=out.reason))
        stopped = await stops.stop_shards(rec, sessions)
        out.log = stopped.log or out.log
        why = f"failed to start: {out.reason}"
        if stopped.left:
            why += f"; its stop is not confirmed ({stopped.problem()})"
        await stops.release(store, rec, stopped, why=why)
    out.seconds = time.monotonic() - t0
    return out


async def _record(store: AsyncStore, rec: ReplicaRecord) -> ReplicaRecord:
    """``rec`` observed at its revision; raises _TakenAway when another command changed it."""
    try:
        return await store.observe(rec)
    except StaleRecord:
        cur = await store.record(*rec.key)
        what = "released" if cur is None else f"{cur.status}, wanted {cur.desired}"
        raise _TakenAway(f"changed by another command while this one started it ({what})") from None


async def _wait_ready(rec: ReplicaRecord, sessions: Sessions, deadline: float, report: Report, key: str) -> None:
    last = ""
    head = rec.shards[0]
    assert rec.port is not None
    polls = 0
    while True:
        why = await nodeops.ready(await sessions.get(head.node), rec.port, rec.replica.model, api_key=key)
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


async def _restart(
    rec: ReplicaRecord,
    why: str,
    me: str | None,
    inv: Inventory,
    cat: Catalog,
    store: AsyncStore,
    sessions: Sessions,
    facts: dict[str, NodeFacts],
    deadline: float,
    report: Report,
) -> Outcome:
    """A kept replica that died: taken over by this run (``me``), what is left of it is
    stopped, then it starts again on its own allocation (GPUs and port, same generation), one
    restart more. Another run that took it over first keeps it; where what is left of it
    cannot be stopped for sure, it is fenced instead."""
    seen = rec
    claimed = await store.claim(seen, replace(rec, status=UNHEALTHY, detail=why, restarts=rec.restarts + 1, owner=me))
    if claimed is None:
        why = "being restarted by another up"
        report(rec.name, "starting", why)
        return replace(_kept(seen), state=STARTING, reason=why)
    report(rec.name, "restarting", why)
    stopped = await stops.stop_shards(claimed, sessions)
    if stopped.left:
        reason = f"{why}; what is left of it could not be stopped ({stopped.problem()})"
        await stops.release(store, claimed, stopped, why=reason)
        report(rec.name, "failed", reason)
        return Outcome(rec.name, rec.replica.model, "restart", FAILED, [s.node for s in rec.replica.shards],
                       reason=reason, log=stopped.log)  # fmt: skip
    out = await _launch(claimed, "restart", inv, cat, store, sessions, facts, deadline, report)
    if not out.reason:
        out.reason = f"restarted: {why}"
    return out


async def _stop(
    rec: ReplicaRecord, why: str, store: AsyncStore, sessions: Sessions, report: Report, *, wanted_down: bool = False
) -> Outcome:
    """Stop a replica the plan does not keep (``why``: the plan's reason) and release it
    (fenced where its stop could not be confirmed)."""
    t0 = time.monotonic()
    out = Outcome(rec.name, rec.replica.model, "stop", "stopped", [s.node for s in rec.replica.shards], reason=why)
    stopped = await stops.stop_shards(rec, sessions)
    if stopped.left:
        out.state, out.reason = FAILED, stopped.problem()
    await stops.release(store, rec, stopped, why=f"stopped ({why or 'no longer in the catalog'})",
                        wanted_down=wanted_down)  # fmt: skip
    report(rec.name, out.state, out.reason)
    out.seconds = time.monotonic() - t0
    return out
