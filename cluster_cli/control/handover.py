"""Replacing one replica while it serves: make before break.

A new generation of the replica's ``MODEL/N`` is placed by the normal placement (never on a
cordoned node), started beside the old one and published once ready; only then is the old
one marked wanted down, published draining, given until ``drain_s`` for the requests in
flight on it, stopped and released. Where no spare capacity exists for the new one, the old
one is drained and stopped first and the new one placed in what it freed (the others serve
meanwhile). ``drain`` replaces every replica of a node so, one at a time; a rolling ``up``
replaces changed replicas so.

While it runs, the replacement belongs to this run (its ``owner``): another run's reconcile
pass (``supervise``) plans without it, so that neither generation is stopped as a duplicate.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cluster_cli.control import lifecycle, stops
from cluster_cli.control.lifecycle import Outcome, Report, quiet
from cluster_cli.control.publish import drained, publish
from cluster_cli.control.up import new_records, taken_ports
from cluster_cli.errors import StateError
from cluster_cli.launch.observe import Observed
from cluster_cli.state.launches import StaleVersion
from cluster_cli.state.records import FAILED, READY, ReplicaRecord
from cluster_cli.state.view import with_fenced

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.control.cluster import Cluster


@dataclass
class Handover:
    """What replacing one replica did: the new generation's outcome, and the old one's stop."""

    name: str
    old_nodes: list[str]
    new: Outcome | None = None
    stopped: Outcome | None = None
    before_stop: bool = True  # made before the break (False: no spare capacity)
    left_in_flight: int = 0  # requests still in flight on the old one when it was stopped
    reason: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.new is not None and self.new.state == READY and (self.stopped is None or self.stopped.state != FAILED)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "from": self.old_nodes,
            "to": self.new.nodes if self.new is not None else [],
            "state": "replaced" if self.ok else "failed",
            "make_before_break": self.before_stop,
            "left_in_flight": self.left_in_flight,
            "endpoint": self.new.endpoint if self.new is not None else None,
            "reason": self.reason or (self.new.reason if self.new is not None else "") or None,
        }


@dataclass
class _Placed:
    starts: list[Any] = field(default_factory=list)


async def place_one(c: Cluster, cat: Catalog, old: ReplicaRecord, me: str | None) -> ReplicaRecord | None:
    """A new generation of ``old``'s ``MODEL/N`` placed as if ``old`` were gone, reserved for
    this run (None: nowhere to put it now)."""
    from cluster_cli.placement import plan

    for _ in range(4):
        view = await c.fleet()
        others = [r.replica for r in view.records if r.name != old.name]
        result = plan(_held_by(view.nodes, old), cat, others)
        mine = [p for p in result.starts if p.replica.key == old.replica.key]
        if not mine:
            return None
        one: Any = _Placed(mine)
        taken = await taken_ports(one, c.on, c.store, Observed())
        new, refused = new_records(one, {}, c.inv, cat, taken, me)
        if refused or not new:
            return None
        try:
            (booked,) = (await c.store.reserve(new, expect_version=view.version)).records
            return booked
        except StaleVersion:
            continue  # another writer moved the state: place again
        except StateError:
            return None  # something of it is held after all: no room beside it
    return None


def _held_by(nodes: list[Any], old: ReplicaRecord) -> list[Any]:
    """``nodes`` with what ``old`` holds taken out (its GPUs marked held, its CPUs and memory
    off its nodes' totals): its replacement goes beside it, not onto it."""
    gpus = {s.node: dict.fromkeys(s.gpus, f"{old.name} (being replaced)") for s in old.replica.shards if s.gpus}
    out = with_fenced(nodes, gpus)
    r = old.replica
    if r.gpu_class or not (r.cpus or r.memory_mib):
        return out
    on = {s.node for s in r.shards}
    return [
        replace(f, cpus=max(0, (f.cpus or 0) - (r.cpus or 0)) if f.cpus is not None else None,
                memory_mib=max(0, (f.memory_mib or 0) - (r.memory_mib or 0)) if f.memory_mib is not None else None)
        if f.name in on else f
        for f in out
    ]  # fmt: skip


async def replace_replica(
    c: Cluster,
    cat: Catalog,
    old: ReplicaRecord,
    *,
    drain_s: float,
    timeout_s: float = 600.0,
    report: Report = quiet,
) -> Handover:
    """Replace ``old`` by a new generation, make before break where capacity allows (see the
    module). ``old`` is left as it is when its replacement cannot be started."""
    me = c.runs.id if c.runs is not None else None
    h = Handover(old.name, [s.node for s in old.replica.shards])
    new = await place_one(c, cat, old, me)
    if new is None:
        h.before_stop = False  # no room beside it: break, then make
        h.stopped, h.left_in_flight = await _retire(c, cat, old, drain_s, report, me)
        if h.stopped.state == FAILED:
            h.reason = f"its stop is not confirmed: {h.stopped.reason}"
            return h
        new = await place_one(c, cat, old, me)
        if new is None:
            h.reason = "no node can take it now (it was stopped first: no spare capacity)"
            await publish(c.store, c.router_config, cat=cat)
            return h
    facts = {f.name: f for f in (await c.fleet()).nodes}
    h.new = await lifecycle.start(new, "replace", c.inv, cat, c.store, c.on, facts,
                                  time.monotonic() + timeout_s, report)  # fmt: skip
    await publish(c.store, c.router_config, cat=cat)
    if h.new.state != READY or not h.before_stop:
        return h
    h.stopped, h.left_in_flight = await _retire(c, cat, old, drain_s, report, me)
    return h


async def _retire(
    c: Cluster, cat: Catalog, old: ReplicaRecord, drain_s: float, report: Report, me: str | None
) -> tuple[Outcome, int]:
    """``old`` wanted down, published draining, drained (up to ``drain_s``), stopped and
    released; the requests still in flight when it was stopped."""
    why = "replaced"
    got = await stops.cas(
        c.store, old, lambda cur: c.store.want_down(cur, why=f"stopping: {why}", owner=me),
        same=lambda cur: cur.desired == "up" and cur.shards == old.shards,
    )  # fmt: skip
    if got is None:
        return Outcome(old.name, old.replica.model, "stop", "stopped", reason="changed by another command"), 0
    await publish(c.store, c.router_config, cat=cat)
    left = await drained(c.router_config, {old.name}, drain_s)
    report(old.name, "stopping", f"{sum(left.values())} request(s) still in flight" if left else "drained")
    out = await lifecycle.stop(got, why, c.store, c.on, report)
    await publish(c.store, c.router_config, cat=cat)
    return out, sum(left.values())


def launch_spec(cat: Catalog, model: str, profile: str) -> dict[str, Any] | None:
    """What a replica of ``model`` run with ``profile`` is started from (the profile whole,
    minus its priority, and its engine's command, args and environment): None when the
    catalog has no such model or profile."""
    m = cat.model(model)
    prof = m.profile(profile) if m is not None else None
    if prof is None:
        return None
    eng = cat.engines.get(prof.engine)
    spec = prof.model_dump(mode="json", exclude={"priority"})
    spec["engine_config"] = eng.model_dump(mode="json") if eng is not None else None
    return spec


def changed(old: Catalog | None, new: Catalog, records: list[ReplicaRecord]) -> list[ReplicaRecord]:
    """The replicas ``new`` still asks for (their model, their number within its replicas)
    that were started from a profile ``new`` changes (or no longer has): those a rolling
    ``up`` replaces, make before break. ``old``: the catalog they were started from."""
    if old is None:
        return []
    out = []
    for rec in records:
        r = rec.replica
        m = new.model(r.model)
        if m is None or r.replica >= m.replicas:
            continue  # no longer asked for: stopped by the reconcile pass, not replaced
        before = launch_spec(old, r.model, r.profile)
        if before is not None and launch_spec(new, r.model, r.profile) != before:
            out.append(rec)
    return sorted(out, key=lambda rec: rec.key)


async def roll(
    c: Cluster,
    cat: Catalog,
    targets: list[ReplicaRecord],
    *,
    max_surge: int = 1,
    drain_s: float,
    timeout_s: float = 600.0,
    report: Report = quiet,
) -> list[Handover]:
    """Replace ``targets`` ``max_surge`` at a time, each make before break where capacity
    allows; a replacement that fails stops the roll (what is left keeps serving as it is)."""
    import asyncio

    out: list[Handover] = []
    for i in range(0, len(targets), max(1, max_surge)):
        batch = targets[i : i + max(1, max_surge)]
        for rec in batch:
            report(rec.name, "replacing", "its profile changed")
        done = await asyncio.gather(
            *(replace_replica(c, cat, rec, drain_s=drain_s, timeout_s=timeout_s, report=report) for rec in batch)
        )
        out += done
        if not all(h.ok for h in done):
            break
    return out


@dataclass
class Drained:
    node: str
    replaced: list[Handover]
    cordoned: bool

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.replaced)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "cordoned": self.cordoned, "complete": self.ok,
                "replicas": [h.to_dict() for h in self.replaced]}  # fmt: skip


async def drain(
    c: Cluster,
    node: str,
    cat: Catalog,
    *,
    reason: str,
    drain_s: float,
    timeout_s: float = 600.0,
    report: Report = quiet,
) -> Drained:
    """Cordon ``node`` (it stays so until ``uncordon``), then replace every replica with a
    shard on it, one at a time, make before break (see the module)."""
    await c.store.cordon(node, reason, inventory=c.inventory_path)
    out = Drained(node, [], True)
    for rec in await c.store.records():
        if not any(s.node == node for s in rec.replica.shards):
            continue
        report(rec.name, "replacing", f"off {node}")
        out.replaced.append(await replace_replica(c, cat, rec, drain_s=drain_s, timeout_s=timeout_s, report=report))
    return out


async def drain_or_ask(
    c: Cluster,
    node: str,
    *,
    reason: str,
    drain_s: float,
    force: bool,
    timeout_s: float = 600.0,
    report: Report = quiet,
    poll_s: float = 0.5,
) -> dict[str, Any]:
    """``drain`` where no supervisor runs; where one does, ask it (it sequences the drain with
    its own passes) and wait for its answer. Should it stop before it took the request, the
    request is taken back and the drain done here. The answer as ``Drained.to_dict`` gives it."""
    from cluster_cli.control.lease import LEASE
    from cluster_cli.control.statefile import stored_catalog

    def supervised(lease: Any) -> bool:
        return lease is not None and lease.expires_at > time.time()

    if supervised(await c.store.lease_of(LEASE)):
        await c.store.cordon(node, reason, inventory=c.inventory_path)  # nothing new goes there meanwhile
        await c.store.request_drain(node, reason=reason, deadline_s=drain_s, force=force)
        report(node, "asked", "the running supervisor drains it")
        while True:
            answer = await c.store.drain_result(node)
            if answer is not None:
                return answer
            if not supervised(await c.store.lease_of(LEASE)) and await c.store.withdraw_drain(node):
                report(node, "draining", "the supervisor stopped before it took the drain: draining here")
                break
            await asyncio.sleep(poll_s)
    cat = await stored_catalog(c.store)
    res = await drain(c, node, cat, reason=reason, drain_s=0.0 if force else drain_s, timeout_s=timeout_s,
                      report=report)  # fmt: skip
    return res.to_dict()
