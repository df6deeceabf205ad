"""``supervise``: the cluster heals itself.

Every tick (``interval_s``) the supervisor heartbeats every node over its kept-open
connection (one cheap script each: boot id, the recorded shards' processes, every marked
process), moves each node through ``ready → unreachable → lost`` (``control/supervision.py``
decides, from what it saw), takes an unreachable node's replicas out of the router at once,
releases a lost node's replicas whole, fences a node that answers again before it is
trusted, and runs a reconcile pass (``control/up.py``, what ``up`` runs once) whenever
something is to be done and none is running: dead replicas are restarted in place with a
backoff, moved elsewhere after repeated failures, lost ones rebuilt on survivors (at most
``max_rebuilds`` at once), nothing at all while the storm brake holds.

The pass runs beside the ticks (a replica's start may take minutes), one at a time, and
reads the state afresh: an operator's ``cordon``, ``down`` or ``up`` with a new catalog
made meanwhile is honoured by the next pass. Every write the supervisor makes carries its
lease's epoch (``Store.lease``): a supervisor whose lease another took writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cluster_cli.control import discovery, stops, supervision
from cluster_cli.control.heartbeat import beat, timed_out
from cluster_cli.control.publish import publish
from cluster_cli.control.statefile import stored_catalog
from cluster_cli.control.supervision import FENCING, LOST, READY, UNREACHABLE, NodeState, Restarts
from cluster_cli.errors import ClusterctlError, SSHError
from cluster_cli.launch.node import Beat
from cluster_cli.launch.observe import Observed
from cluster_cli.state.leases import LeaseLost
from cluster_cli.state.records import READY as REPLICA_READY
from cluster_cli.state.records import UNHEALTHY as REPLICA_UNHEALTHY

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.control.cluster import Cluster
    from cluster_cli.control.up import UpResult
    from cluster_cli.state.records import ReplicaRecord
    from cluster_cli.state.requests import DrainRequest

HEALTH_FAILS = 2  # a ready replica's health check failed this many ticks in a row: checked by a pass


@dataclass
class Settings:
    interval_s: float = 2.0
    grace_s: float = supervision.GRACE_S
    max_rebuilds: int = 2
    brake_share: float = supervision.BRAKE_SHARE
    start_timeout_s: float = 600.0  # a replica's start: ready within this, else failed
    fence_grace_s: float = 5.0  # a fenced engine's TERM before KILL

    @property
    def beat_timeout_s(self) -> float:
        """A node that does not answer its heartbeat within this missed it (within a tick:
        a frozen node must not slow the ticks of the others)."""
        return max(1.0, min(self.interval_s, self.grace_s / 3))

    @property
    def reconnect_s(self) -> float:
        """A node that cannot be reached is tried again at least this often (a node back
        from the dead is seen within it)."""
        return max(5.0, 2 * self.interval_s)

    @property
    def lease_ttl_s(self) -> float:
        return max(15.0, 5 * self.interval_s)


Log = Callable[[str], None]


@dataclass
class Supervisor:
    """One cluster's supervisor (see the module). ``catalog`` None: the one the state keeps
    (the last ``up``'s), read again at each pass."""

    cluster: Cluster
    catalog: Catalog | None = None
    settings: Settings = field(default_factory=Settings)
    log: Log = lambda _: None
    clock: Callable[[], float] = time.monotonic
    nodes: dict[str, NodeState] = field(default_factory=dict)
    restarts: dict[str, Restarts] = field(default_factory=dict)
    brake: str | None = None
    last_pass: UpResult | None = None
    passes: int = 0
    _pass: asyncio.Task[Any] | None = None
    _observed: Observed = field(default_factory=Observed)
    _move: dict[str, set[str]] = field(default_factory=dict)  # replica -> nodes to avoid, being moved
    _said: dict[str, str] = field(default_factory=dict)  # replica -> the last line logged of it
    _failing: dict[str, int] = field(default_factory=dict)  # replica -> health checks failed in a row
    _stored: tuple[int, Catalog] | None = None  # the stored catalog's version, and it read

    # ---- one tick ---------------------------------------------------------------------------
    async def tick(self, *, start_pass: bool = True) -> bool:
        """Heartbeat every node, act on what changed, and start a reconcile pass if one is due
        and none is running. Returns whether anything was seen to need doing."""
        store, s = self.cluster.store, self.settings
        await self._renew()
        records = await store.records()
        on_node: dict[str, list[Any]] = {n.name: [] for n in self.cluster.inv.nodes}
        for rec in records:
            for run in rec.shards:
                if run.pid is not None:
                    on_node.setdefault(run.node, []).append(run)
        run_dirs = {n.name: self.cluster.inv.run_dir(n) for n in self.cluster.inv.nodes}
        # Whose grace is over is lost now, not after its heartbeat times out once more.
        expired = supervision.expire(self.nodes, self.clock(), grace_s=s.grace_s, braked=self.brake is not None)
        beats = await beat(self.cluster.on, on_node, run_dirs, s.beat_timeout_s)
        now = self.clock()
        seen = {n: (isinstance(b, Beat), b.boot_id if isinstance(b, Beat) else None, "" if isinstance(b, Beat) else b)
                for n, b in beats.items()}  # fmt: skip
        slow = {n for n, b in beats.items() if isinstance(b, str) and timed_out(b)}
        changes = expired + supervision.observe(self.nodes, seen, now, interval_s=s.interval_s, grace_s=s.grace_s,
                                                braked=self.brake is not None, timed_out=slow)  # fmt: skip
        await self._braking(now)
        self._observed = _observed(beats)
        changed = False
        for ch in changes:
            if ch.old != ch.new:
                self.log(f"node {ch.node}: {ch.old} -> {ch.new}" + (f" ({ch.why})" if ch.why else ""))
                with contextlib.suppress(ClusterctlError):
                    await store.set_node_status(ch.node, ch.new, detail=ch.why or None,
                                                boot_id=seen[ch.node][1])  # fmt: skip
            if ch.new == UNREACHABLE:
                changed |= await self._out_of_router(records, ch.node, ch.why)
            elif ch.new == LOST:
                changed |= await self._release_lost(records, ch.node)
        for name, ns in self.nodes.items():
            if ns.state == FENCING:
                changed |= await self._fence(name, records, now)
        due = changed or self._due(records, beats, await self._catalog()) or await self._health(records)
        if changed:
            await publish(store, self.cluster.router_config, confirm_s=1.0)
        if start_pass and self.brake is None and (self._pass is None or self._pass.done()):
            asked = await store.drain_requests()
            if asked:  # an operator's drain first: it is a pass of its own
                self._pass = asyncio.ensure_future(self._drain(asked[0]))
            elif due:
                self._pass = asyncio.ensure_future(self.reconcile())
        return due

    async def _drain(self, req: DrainRequest) -> None:
        """Do the drain an operator asked for (``clusterctl drain`` while this one runs), and
        answer it."""
        from cluster_cli.control.handover import drain

        self.log(f"node {req.node}: draining, asked by {req.by} ({req.reason})")
        try:
            cat = self.catalog or await stored_catalog(self.cluster.store)  # raises: no catalog
            res = await drain(self.cluster, req.node, cat, reason=req.reason,
                              drain_s=0.0 if req.force else req.deadline_s, timeout_s=self.settings.start_timeout_s)  # fmt: skip
            answer = res.to_dict()
        except Exception as e:  # answered whatever happened: the asker waits for it
            answer = {"node": req.node, "cordoned": False, "complete": False, "replicas": [], "error": str(e)}
        await self.cluster.store.finish_drain(req.node, answer)
        self.log(f"node {req.node}: drained" + ("" if answer["complete"] else ": not every replica could be moved"))

    async def _health(self, records: list[ReplicaRecord]) -> bool:
        """Ask every ready replica on a ready node its health check; whether one failed it
        ``HEALTH_FAILS`` ticks in a row (its engine runs but no longer answers: the pass that
        this starts checks it again and restarts it, with its backoff)."""
        ready = [r for r in records if r.status == REPLICA_READY and r.port is not None and r.shards
                 and self.nodes.get(r.shards[0].node, NodeState()).state == READY]  # fmt: skip

        async def one(rec: ReplicaRecord) -> tuple[str, bool]:
            assert rec.port is not None
            try:
                async with asyncio.timeout(self.settings.beat_timeout_s):
                    node = await self.cluster.on.get(rec.shards[0].node)
                    why = await node.ready(rec.port, rec.replica.model, list_models=False)
            except (TimeoutError, SSHError, OSError, ClusterctlError):
                return rec.name, True  # its node's own heartbeat tells whether the node is away
            return rec.name, why is None

        got = dict(await asyncio.gather(*(one(r) for r in ready)))
        due = False
        for name, ok in got.items():
            self._failing[name] = 0 if ok else self._failing.get(name, 0) + 1
            if self._failing[name] == HEALTH_FAILS:
                self.log(f"replica {name}: its engine runs but has not answered its health check {HEALTH_FAILS} times")
            due |= self._failing[name] >= HEALTH_FAILS
        for name in set(self._failing) - set(got):
            del self._failing[name]
        return due

    async def _renew(self) -> None:
        """Renew the lease this supervisor writes under (raises LeaseLost once another took it)."""
        lease = getattr(self.cluster.store.store, "lease", None)
        if lease is not None:
            self.cluster.store.store.lease = await self.cluster.store.renew_lease(lease, self.settings.lease_ttl_s)

    async def _catalog(self) -> Catalog | None:
        """The catalog to keep applied: the one given, else the one the last ``up`` stored
        (read again only when the state has a newer one)."""
        if self.catalog is not None:
            return self.catalog
        stored = await self.cluster.store.catalog()
        if stored is None:
            return None
        if self._stored is None or self._stored[0] != stored.version:
            try:
                self._stored = (stored.version, await stored_catalog(self.cluster.store))
            except ClusterctlError as e:
                self.log(f"the stored catalog: {e}")
                return None
        return self._stored[1]

    def _due(self, records: list[ReplicaRecord], beats: dict[str, Beat | str], cat: Catalog | None) -> bool:
        """Whether a pass has work: a replica that is not ready (or whose engine the heartbeat
        found gone), or the catalog asks for one the state does not hold."""
        for rec in records:
            if rec.status != REPLICA_READY:
                return True
            for run, b in ((r, beats.get(r.node)) for r in rec.shards):
                if isinstance(b, Beat) and run.pid is not None:
                    alive = self._observed.alive(run)
                    if alive is False:
                        return True
        if cat is None:
            return False  # nothing to apply yet
        want = {(m.name, i) for m in cat.models for i in range(m.replicas)}
        return want != {(r.replica.model, r.replica.replica) for r in records}

    async def _braking(self, now: float) -> None:
        why = supervision.braking(self.nodes, now, grace_s=self.settings.grace_s, share=self.settings.brake_share)
        was, self.brake = self.brake, why
        if (why is None) == (was is None):
            return  # still on (its wording may change with the count) or still off
        if why is None:
            supervision.rearm(self.nodes, now)
        msg = f"storm brake on: {why}" if why else "storm brake off: the nodes answer again, rebuilding resumes"
        self.log(msg)
        with contextlib.suppress(ClusterctlError):
            await self.cluster.store.record_event("note", msg)

    async def _out_of_router(self, records: list[ReplicaRecord], node: str, why: str) -> bool:
        """The replicas with a shard on ``node`` leave the router (unhealthy); kept."""
        store, hit = self.cluster.store, False
        for rec in records:
            if rec.status == REPLICA_READY and any(run.node == node for run in rec.shards):
                detail = f"its node {node} is unreachable ({why})"
                got = await stops.cas(store, rec, lambda cur, d=detail: store.observe(
                    replace(cur, status=REPLICA_UNHEALTHY, detail=d)),
                    same=lambda cur, rec=rec: cur.desired == "up" and cur.shards == rec.shards)  # fmt: skip
                hit |= got is not None
        return hit

    async def _release_lost(self, records: list[ReplicaRecord], node: str) -> bool:
        """The replicas with a shard on lost ``node``: their shards elsewhere stopped, each
        released whole, fenced (what may still run on ``node`` keeps its GPUs held until the
        node answers again and is fenced), to be rebuilt on survivors by the next pass."""
        store, hit = self.cluster.store, False
        for rec in records:
            if not any(s.node == node for s in rec.replica.shards):
                continue
            elsewhere = replace(rec, shards=tuple(r for r in rec.shards if r.node != node))
            away = {n for n, ns in self.nodes.items() if ns.state != READY}
            reach = _Only(self.cluster.on, away, self.nodes)
            stopped = await stops.stop_shards(elsewhere, reach) if elsewhere.shards else stops.StopResult()
            stopped.left += [(run, f"its node {node} is lost") for run in rec.shards if run.node == node]
            why = f"its node {node} is lost: released, to be rebuilt elsewhere"
            await stops.release(store, rec, stopped, why=why)
            self.log(f"replica {rec.name}: {why}")
            hit = True
        return hit

    async def _fence(self, node: str, records: list[ReplicaRecord], now: float) -> bool:
        """Stop on ``node`` every engine not assigned to it, settle its fence records, then
        trust it again (ready). False while it cannot be fenced (it is tried next tick)."""
        keep = {run.token for rec in records for run in rec.shards if run.node == node}
        n = self.cluster.inv.node(node)
        run_dir = self.cluster.inv.run_dir(n) if n is not None else "~/.clusterctl/run"
        try:
            fenced = await (await self.cluster.on.get(node)).fence(run_dir, keep, grace_s=self.settings.fence_grace_s)
            still = await stops.clear(self.cluster.store, self.cluster.on, await self.cluster.store.fences(node))
        except (SSHError, OSError, ClusterctlError) as e:
            self.log(f"node {node}: cannot be fenced yet ({e})")
            return False
        if fenced.stopped:
            self.log(f"node {node}: fenced, stopped {len(fenced.stopped)} engine(s) not assigned to it: "
                     + ", ".join(p.token for p in fenced.stopped))  # fmt: skip
        if fenced.left or still:
            self.log(f"node {node}: fenced, but something is left: {[p.token for p in fenced.left]} {still}")
            return False
        ch = supervision.fenced(self.nodes, node, now, interval_s=self.settings.interval_s,
                                grace_s=self.settings.grace_s)  # fmt: skip
        if ch is None:
            return False
        self.log(f"node {node}: {ch.old} -> {ch.new} ({ch.why})")
        with contextlib.suppress(ClusterctlError):
            await self.cluster.store.set_node_status(node, READY, detail=ch.why)
        return True

    # ---- one reconcile pass -------------------------------------------------------------------
    async def reconcile(self) -> UpResult | None:
        """One pass of ``up``'s reconcile over the nodes as the heartbeats see them: those not
        ready are taken as unreachable (their replicas are left as they are, nothing new goes
        there). None when there is no catalog to reconcile."""
        from cluster_cli.control.up import up

        store = self.cluster.store
        cat = await self._catalog()
        if cat is None:
            return None
        now = self.clock()
        await self._moves(now)

        away = {n for n, ns in self.nodes.items() if ns.state != READY}
        avoid = set().union(*self._move.values()) if self._move else set()

        async def fleet() -> discovery.Fleet:
            view = await discovery.fleet(self.cluster.inv, store, placeable=True)
            nodes = [
                replace(f, reachable=False, error=f"{self.nodes[f.name].state} (supervise)") if f.name in away
                else replace(f, cordoned=True, cordon_reason="a replica failed here") if f.name in avoid
                else f
                for f in view.nodes
            ]  # fmt: skip
            return discovery.Fleet(nodes, view.records, view.version, view.wanted_down)

        def report(name: str, phase: str, detail: str) -> None:
            if phase in ("loading", "probing", "probed") or (phase == "ready" and detail == "running"):
                return
            line = f"replica {name}: {phase}" + (f" ({detail})" if detail else "")
            # Said once while it stays so (a backoff's countdown is not news every tick).
            if self._said.get(name) != re.sub(r"[0-9.]+ s\b", "N s", line):
                self._said[name] = re.sub(r"[0-9.]+ s\b", "N s", line)
                self.log(line)

        try:
            res = await up(self.cluster.inv, cat, store, _Only(self.cluster.on, away, self.nodes), fleet,
                           router_config=self.cluster.router_config, timeout_s=self.settings.start_timeout_s,
                           report=report, observed=self._observed, runs=self.cluster.runs, hold=self._hold,
                           hold_new=self._hold_new, max_new=self.settings.max_rebuilds, keep_down=True,
                           drain_s=self.cluster.drain_s)  # fmt: skip
        except ClusterctlError as e:
            self.log(f"pass failed: {e}")
            return None
        except Exception as e:  # a bug in one pass must not end a loop meant to run for months
            self.log(f"pass failed: {type(e).__name__}: {e}")
            return None
        self.passes += 1
        self.last_pass = res
        now = self.clock()
        for o in res.outcomes:
            r = self.restarts.setdefault(o.name, Restarts())
            if o.state == REPLICA_READY:
                supervision.healthy(r, now)
            elif o.action in ("start", "restart") and o.state == "failed":
                supervision.failed(r, now, o.nodes[0] if o.nodes else "")
        return res

    def _hold(self, rec: ReplicaRecord, why: str) -> str | None:
        """A dead replica, restarted in place: each death counted once (by the process that
        died), then why it waits (its backoff; moved elsewhere by the next pass after too many
        failures), or None to restart it now."""
        now = self.clock()
        r = self.restarts.setdefault(rec.name, Restarts())
        death = rec.shards[0].token + f":{rec.shards[0].pid}" if rec.shards else rec.name
        if r.last_death != death:
            r.last_death = death
            supervision.failed(r, now, rec.replica.shards[0].node if rec.replica.shards else "")
        what, wait = supervision.next_restart(r, now)
        if what == "move":
            return f"failed {len(r.failures)} times within 10 min: placed elsewhere by the next pass"
        if what == "wait":
            return f"restart in {wait:.1f} s (backoff after {len(r.failures)} failure(s))"
        return None

    def _hold_new(self, name: str) -> str | None:
        """A replica to be placed anew whose last start failed: why it waits (its backoff)."""
        r = self.restarts.get(name)
        if r is None:
            return None
        what, wait = supervision.next_restart(r, self.clock())
        return f"start in {wait:.1f} s (backoff after {len(r.failures)} failure(s))" if what == "wait" else None

    async def _moves(self, now: float) -> None:
        """Replicas that failed too often: released whole now, placed elsewhere by this pass
        (preferring nodes they have not failed on)."""
        store = self.cluster.store
        for rec in await store.records():
            r = self.restarts.get(rec.name)
            if r is None or rec.status == REPLICA_READY or supervision.next_restart(r, now)[0] != "move":
                continue
            avoid = supervision.failed_on(r, now)
            self.log(f"replica {rec.name}: failed {len(r.failures)} times within 10 min on "
                     f"{', '.join(sorted(avoid))}: placing it elsewhere")  # fmt: skip
            stopped = await stops.stop_shards(rec, self.cluster.on)
            await stops.release(
                store, rec, stopped, why=f"moved: failed {len(r.failures)} times on {', '.join(sorted(avoid))}"
            )
            self._move[rec.name] = avoid
            r.failures, r.last_death = [], None

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set; then wait for a pass under way."""
        while not stop.is_set():
            t0 = self.clock()
            try:
                await self.tick()
            except LeaseLost:
                raise
            except ClusterctlError as e:
                self.log(f"tick failed: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, self.settings.interval_s - (self.clock() - t0)))
        if self._pass is not None and not self._pass.done():
            self.log("stopping: waiting for the pass under way")
            with contextlib.suppress(Exception):
                await self._pass

    async def once(self) -> bool:
        """One tick and one pass, waited for: whether the cluster converged (every replica the
        catalog asks for ready, every node ready)."""
        await self.tick(start_pass=False)
        res = await self.reconcile()
        return res is not None and res.complete and all(ns.state == READY for ns in self.nodes.values())


class _Only:
    """The nodes as a pass may reach them: one the heartbeats find away fails at once (a
    frozen node would hold the pass for a connect timeout on every call)."""

    def __init__(self, nodes: Any, away: set[str], states: dict[str, NodeState]) -> None:
        self.nodes, self.away, self.states = nodes, away, states

    async def get(self, node: str) -> Any:
        if node in self.away:
            raise SSHError(f"{node}: {self.states[node].state} (its heartbeats say so)")
        return await self.nodes.get(node)

    def prefetch(self, nodes: Any) -> None:
        self.nodes.prefetch([n for n in nodes if n not in self.away])


def _observed(beats: dict[str, Beat | str]) -> Observed:
    """The heartbeats as ``up``'s reconcile reads a probe: each node's marked processes."""
    out = Observed()
    for node, b in beats.items():
        if isinstance(b, Beat):
            out.started[node] = {p.pid: p.start_time for p in b.runs.processes}
            if b.boot_id:
                out.boot_ids[node] = b.boot_id
    return out
