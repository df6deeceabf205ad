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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.control import lifecycle, stops
from cluster_cli.control.checks import HealthChecks, find_dead
from cluster_cli.control.discovery import Fleet
from cluster_cli.control.lifecycle import Outcome, Report, kept, quiet
from cluster_cli.control.publish import DRAIN_S, drained, publish
from cluster_cli.errors import SSHError
from cluster_cli.launch.observe import Observed
from cluster_cli.launch.shards import pick_port, profile_of
from cluster_cli.state.launches import StaleVersion
from cluster_cli.state.records import (
    FAILED,
    PLANNED,
    READY,
    STARTING,
    STOPPING,
    UNHEALTHY,
    ReplicaRecord,
    replica_name,
)

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.nodes import Nodes
    from cluster_cli.control.runs import Runs
    from cluster_cli.placement import Plan
    from cluster_cli.state.aio import AsyncStore


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


async def up(
    inv: Inventory,
    cat: Catalog,
    store: AsyncStore,
    nodes: Nodes,
    fleet: Callable[[], Awaitable[Fleet]],
    *,
    router_config: Path,
    expect_version: int | None = None,
    timeout_s: float = 600.0,
    report: Report = quiet,
    observed: Observed | None = None,
    runs: Runs | None = None,
    health: HealthChecks | None = None,
    reprobe: Callable[[], Awaitable[tuple[Fleet, Observed]]] | None = None,
    catalog_doc: dict[str, Any] | None = None,
    catalog_source: str | None = None,
    drain_s: float = DRAIN_S,
    hold: Callable[[ReplicaRecord, str], str | None] | None = None,
    hold_new: Callable[[str], str | None] | None = None,
    max_new: int | None = None,
    keep_down: bool = False,
    sizes: Callable[[Catalog, list[Any]], Awaitable[dict[str, Any]]] | None = None,
) -> UpResult:
    """Apply the catalog to the cluster. ``fleet`` reads the nodes, replicas and state version
    from one snapshot of the state (a cordon is in all three or in none); ``observed``: what
    the probe that made them saw of the shards and ports, if it ran; ``runs``: this run, and
    which others are going on this state: a replica another live run left planned or
    starting is its own, not a leftover to restart; ``health``: the kept replicas' health
    checks, started during the probe; ``reprobe``: probe every node in full and read the
    fleet again, when the first read came from a probe that only checked the running
    replicas: it is called before anything new is placed. ``catalog_doc`` is recorded as the
    desired state once the plan is reserved. ``hold``: asked for each dead replica with why
    it is dead, says why it is not to be restarted yet (a backoff), or None; a held one is
    left out of the router and restarted by a later pass; ``hold_new`` the same for a
    replica to be placed anew (by name). ``keep_down``: a replica a ``down`` took down
    is not placed again (``supervise``; an operator's ``up`` brings it back). ``max_new``: at most this many new
    replicas are reserved and started by this pass; the others wait for the next. ``sizes``:
    reads the catalog's models' sizes on the nodes for the memory-fit check (else the sizes
    the state cached are used)."""
    from cluster_cli.placement import plan

    # What earlier stops could not confirm, and stops an interrupted down left: tried again
    # first, so that the version checked below already counts what they free.
    await stops.clear(store, nodes, await store.fences())
    outcomes: list[Outcome] = await _finish_stops(store, nodes, runs, report)
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

    checks = health or HealthChecks([], nodes)
    dead = await find_dead(current, nodes, seen, busy, theirs, checks)
    planned: list[Any] | None = None  # with --check-version: the starts of the plan made at that version

    model_sizes = await sizes(cat, view.nodes) if sizes is not None else await store.known_model_sizes()
    for attempt in range(4):
        result: Plan = plan(view.nodes, cat, _held(current, theirs), sizes=model_sizes)
        away = _away(result)
        if reprobe is not None and any(p.replica.key not in away for p in result.starts):
            # Something new is placed after all: on facts of every kind, read now.
            view, seen = await reprobe()
            reprobe = None
            current = await _also_check(view, current, dead, nodes, seen, busy, theirs, checks)
            result = plan(view.nodes, cat, _held(current, theirs), sizes=model_sizes)
            away = _away(result)
        if planned is None and expect_version is not None:
            planned = [p.replica for p in result.starts]
        elif planned is not None and [p.replica for p in result.starts] != planned:
            raise StaleVersion("the state moved on while replicas were stopped: run 'clusterctl place --dry-run' again")
        # Each with the plan's reason.
        # Not one another live run is starting (under a catalog newer than this run's, maybe):
        # that run decides what becomes of it.
        stopping = [(rec, p.note) for p in result.stops
                    if p.replica.key not in away and (rec := _record_of(current, p.replica)) is not None
                    and rec.key not in busy]  # fmt: skip
        if stopping:
            # Out of the router first, then stopped and released; what the plan starts (a
            # replica placed anew on the GPUs it had) is placed again once they are free:
            # never on GPUs whose engine may still run.
            outcomes += await _stop_all(stopping, cat, store, nodes, router_config, report, me, drain_s)
            view = await fleet()
            current = await _also_check(view, current, dead, nodes, seen, busy, theirs, checks)
            continue
        by_node = {f.name: f for f in view.nodes}
        taken = await taken_ports(result, nodes, store, seen)
        new, refused = new_records(result, away, inv, cat, taken, me)
        waits = {r.name: w for r in new if hold_new is not None and (w := hold_new(r.name)) is not None}
        if keep_down:  # read in the plan's snapshot: a down after it moves the version, and this plan is redone
            waits.update((r.name, "wanted down by 'down': left so until the next 'up'") for r in new
                         if r.name in view.wanted_down)  # fmt: skip
        later = [(r, waits[r.name]) for r in new if r.name in waits]
        new = [r for r in new if r.name not in waits]
        if max_new is not None:
            why = f"at most {max_new} new replica(s) at once: started by a later pass"
            later += [(r, why) for r in new[max_new:]]
            new = new[:max_new]
        try:
            # The version the plan was made from is checked and moved in the same statement.
            doc = (catalog_doc, catalog_source) if catalog_doc is not None else None
            booked = await store.reserve(new, expect_version=view.version, catalog=doc)
            break
        except StaleVersion:
            if attempt == 3 or expect_version is not None:
                raise
            # Another up (or a cordon) wrote meanwhile: plan again from what is there now.
            view = await fleet()
            current = await _also_check(view, current, dead, nodes, seen, busy, theirs, checks)
    else:
        raise StaleVersion("the state kept moving while up planned: run it again")
    if catalog_doc is not None:
        await store.save_catalog(catalog_doc, source=catalog_source)
    for o in refused:
        report(o.name, "failed", o.reason)
    outcomes += refused
    for rec, why in later:
        outcomes.append(Outcome(rec.name, rec.replica.model, "start", "waiting", [s.node for s in rec.replica.shards],
                                reason=why))  # fmt: skip
        report(rec.name, "waiting", why)

    for rec in current:
        if rec.replica.key in away:
            why = f"{away[rec.replica.key]}: left as it is (the next up checks it again)"
            await stops.cas(
                store,
                rec,
                lambda cur, why=why: store.observe(replace(cur, status=UNHEALTHY, detail=why)),
                same=lambda cur: cur.desired == "up" and cur.status not in ("fenced", "stopping", "stopped"),
            )  # out of the router config
            outcomes.append(replace(kept(rec), state=UNHEALTHY, reason=why))
            report(rec.name, "unhealthy", why)
    keeps = [_record_of(current, p.replica) for p in result.keeps]
    restart = [r for r in keeps if r is not None and r.key in dead]
    for rec in [r for r in restart if hold is not None]:
        wait = hold(rec, dead[rec.key])  # type: ignore[misc]
        if wait is None:
            continue
        restart.remove(rec)
        why = f"{dead[rec.key]}; {wait}"
        await stops.cas(
            store,
            rec,
            lambda cur, why=why: store.observe(replace(cur, status=UNHEALTHY, detail=why)),
            same=lambda cur, rec=rec: cur.desired == "up" and cur.shards == rec.shards,
        )  # out of the router config until it is restarted
        outcomes.append(replace(kept(rec), action="restart", state=UNHEALTHY, reason=why))
        report(rec.name, "unhealthy", why)
    for rec in keeps:
        if rec is not None and rec.key in busy:
            why = "being started by another up"
            outcomes.append(replace(kept(rec), state=STARTING, reason=why))
            report(rec.name, "starting", why)
        elif rec is not None and rec.key not in dead:
            if rec.status != READY:  # it answers again: back in the router
                back = await stops.cas(
                    store,
                    rec,
                    lambda cur: store.observe(replace(cur, status=READY, detail=None)),
                    same=lambda cur, rec=rec: cur.desired == "up" and cur.shards == rec.shards,
                )
                rec = back or rec
            outcomes.append(kept(rec))
            report(rec.name, "ready", "running")

    deadline = time.monotonic() + timeout_s
    jobs = [lifecycle.start(rec, "start", inv, cat, store, nodes, by_node, deadline, report) for rec in booked.records]
    for rec in restart:
        jobs.append(lifecycle.restart(rec, dead[rec.key], me, inv, cat, store, nodes, by_node, deadline, report))
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
    nodes: Nodes,
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
    return list(await asyncio.gather(*(lifecycle.stop(rec, why, store, nodes, report) for rec, why in marked)))


async def _finish_stops(store: AsyncStore, nodes: Nodes, runs: Runs | None, report: Report) -> list[Outcome]:
    """Replicas a ``down`` marked wanted down and did not release (it was interrupted, or
    killed): stopped again and released now, or fenced. One whose ``down`` still runs is its own."""
    left = [r for r in await store.records(include_down=True) if r.status == STOPPING]
    mine = [r for r in left if runs is None or not runs.alive(r.owner)]

    async def one(rec: ReplicaRecord) -> Outcome:
        out = await lifecycle.stop(rec, "left stopping by an interrupted down", store, nodes, report, wanted_down=True)
        return replace(out, action="stop")

    return list(await asyncio.gather(*(one(r) for r in mine)))


async def _also_check(
    view: Fleet,
    checked: list[ReplicaRecord],
    dead: dict[tuple[str, int, int], str],
    nodes: Nodes,
    seen: Observed,
    busy: set[tuple[str, int, int]],
    theirs: Callable[[ReplicaRecord], bool],
    checks: HealthChecks,
) -> list[ReplicaRecord]:
    """The replicas of a fresh read of the state; those not checked before are checked now."""
    before = {r.key for r in checked}
    fresh = [r for r in view.records if r.key not in before]
    dead.update(await find_dead(fresh, nodes, seen, busy, theirs, checks))
    return view.records


def _held(records: list[ReplicaRecord], theirs: Callable[[ReplicaRecord], bool]) -> list[Any]:
    """The allocations a plan starts from: every record's, except a replacement another live
    run is making beside the generation it replaces (a drain, a rolling update): that run
    stops the old one once the new one serves; planned here, one of the two would be stopped
    as a duplicate."""
    by: dict[str, list[ReplicaRecord]] = {}
    for r in records:
        by.setdefault(r.name, []).append(r)
    out = []
    for recs in by.values():
        mine = [r for r in recs if not theirs(r)] if len(recs) > 1 else recs
        out += [r.replica for r in (mine or sorted(recs, key=lambda r: r.generation)[:1])]
    return out


def _unplaced_why(u: Any) -> str:
    """Why no profile placed it, profile by profile, in ``place``'s words."""
    from cluster_cli.placement.verdict import fit_message

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


async def taken_ports(result: Plan, nodes: Nodes, store: AsyncStore, seen: Observed) -> dict[str, set[int]]:
    """Per node that gets a new replica: the ports listening there and those the state holds."""
    heads = {p.replica.shards[0].node for p in result.starts if p.replica.shards}
    out: dict[str, set[int]] = {}

    async def one(n: str) -> None:
        taken = set(await store.held_ports(n))
        if n in seen.listening:
            taken |= seen.listening[n]
        else:
            with contextlib.suppress(SSHError, OSError):  # the start finds the node unreachable and says so
                taken |= await (await nodes.get(n)).listening()
        out[n] = taken

    await asyncio.gather(*(one(n) for n in sorted(heads)))
    return out


def new_records(
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
        if why is None and len(r.shards) > 1:  # the replica's own Ray head and Ray Client ports
            ray = pick_port(lo, hi, used | {port})
            client = pick_port(lo, hi, used | {port, ray}) if ray is not None else None
            if ray is None or client is None:
                why = f"{head}: no free port left in {lo}-{hi} for a Ray head"
            extra = () if ray is None or client is None else (ray, client)
        name = replica_name(r.model, r.replica)
        if why is not None:
            refused.append(Outcome(name, r.model, "start", FAILED, [s.node for s in r.shards], reason=why))
            continue
        used.add(port)  # type: ignore[arg-type]
        used.update(extra)
        out.append(ReplicaRecord(r, status=PLANNED, port=port, extra_ports=extra, owner=owner))
    return out, refused
