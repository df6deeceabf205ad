"""One replica's life, each an operation that returns what happened (an :class:`Outcome`)
instead of raising: start it (its shards' markers recorded first) and wait until it is
ready, restart it in place, stop it. ``up``'s reconcile pass (``control/up.py``) and, next,
``supervise``'s loop call them; none of them decides what the cluster should run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cluster_cli.control import stops
from cluster_cli.control.publish import engine_keys
from cluster_cli.errors import ClusterctlError
from cluster_cli.launch import node as nodeops
from cluster_cli.launch.shards import shard_starts
from cluster_cli.state.launches import StaleRecord
from cluster_cli.state.records import FAILED, READY, STARTING, STOPPED, UNHEALTHY, ReplicaRecord

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.nodes import Nodes
    from cluster_cli.facts import NodeFacts
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


def quiet(name: str, phase: str, detail: str) -> None:
    pass


def kept(rec: ReplicaRecord) -> Outcome:
    return Outcome(rec.name, rec.replica.model, "keep", rec.status, [s.node for s in rec.replica.shards], rec.endpoint)


def endpoint_of(inv: Inventory, rec: ReplicaRecord, reached: str | None = None) -> str:
    """Where the router finds ``rec``: the address SSH reached its head node at (``reached``:
    ssh_config's HostName when the inventory names an alias), else the inventory's host."""
    n = inv.node(rec.replica.shards[0].node)
    host = reached or (n.host if n is not None else rec.replica.shards[0].node)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{rec.port}"


class TakenAway(ClusterctlError):
    """The replica's row changed while this run started it (a ``down``, a release)."""


async def start(
    rec: ReplicaRecord,
    action: str,
    inv: Inventory,
    cat: Catalog,
    store: AsyncStore,
    nodes: Nodes,
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
    where = [s.node for s in rec.replica.shards]
    out = Outcome(rec.name, rec.replica.model, action, STARTING, where)
    report(rec.name, "starting", ", ".join(where))
    runs: list[Any] = []  # what may run of it: the shards' markers, then their processes
    key = engine_keys(store)(rec)
    try:
        starts = shard_starts(rec, cat, inv, facts, api_key=key)
        first = await nodes.get(starts[0].node)
        endpoint = endpoint_of(inv, rec, first.address)
        runs = [s.run for s in starts]
        rec = await record(store, replace(rec, shards=tuple(runs), status=STARTING, endpoint=endpoint, detail=None))
        # Shard 0 first (a multi-node replica's Ray head), then the others together.
        runs[0] = head = await first.start(starts[0])

        async def other(i: int, s: Any) -> None:
            runs[i] = await (await nodes.get(s.node)).start(s)

        # Every start ends before a failure is acted on: a slower shard that starts after the
        # stop ran would have nothing that knows of it.
        ends = await asyncio.gather(*(other(i, s) for i, s in enumerate(starts) if i > 0), return_exceptions=True)
        failed = next((e for e in ends if isinstance(e, BaseException)), None)
        if failed is not None:
            raise failed
        rec = await record(store, replace(rec, shards=tuple(runs), started_at=time.time()))
        report(rec.name, "loading", f"pid {head.pid} on {head.node}")
        await wait_ready(rec, nodes, deadline, report, key)
        rec = await record(store, replace(rec, status=READY, detail=None))
        out.state, out.endpoint = READY, rec.endpoint
        report(rec.name, "ready", rec.endpoint or "")
        await check_memory(rec, cat, store, first, head.run_dir, report)
    except TakenAway as e:
        # Whatever this run started is its own to stop: the other command could not see it.
        started = replace(rec, shards=tuple(runs))
        stopped = await stops.stop_shards(started, nodes)
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
        stopped = await stops.stop_shards(rec, nodes)
        out.log = stopped.log or out.log
        why = f"failed to start: {out.reason}"
        if stopped.left:
            why += f"; its stop is not confirmed ({stopped.problem()})"
        await stops.release(store, rec, stopped, why=why)
    out.seconds = time.monotonic() - t0
    return out


async def record(store: AsyncStore, rec: ReplicaRecord) -> ReplicaRecord:
    """``rec`` observed at its revision; raises TakenAway when another command changed it."""
    try:
        return await store.observe(rec)
    except StaleRecord:
        cur = await store.record(*rec.key)
        what = "released" if cur is None else f"{cur.status}, wanted {cur.desired}"
        raise TakenAway(f"changed by another command while this one started it ({what})") from None


async def wait_ready(rec: ReplicaRecord, nodes: Nodes, deadline: float, report: Report, key: str) -> None:
    last = ""
    head = rec.shards[0]
    assert rec.port is not None
    polls = 0
    while True:
        why = await (await nodes.get(head.node)).ready(rec.port, rec.replica.model, api_key=key)
        if why is None:
            return
        for run in rec.shards:
            (ok,) = await (await nodes.get(run.node)).alive([run])
            if not ok:
                raise nodeops.LaunchError(f"the engine exited on {run.node}")
        if why != last:
            report(rec.name, "loading", why)
            last = why
        if time.monotonic() > deadline:
            raise nodeops.LaunchError(f"not ready in time: {why}")
        await asyncio.sleep(POLL_S[min(polls, len(POLL_S) - 1)])
        polls += 1


async def restart(
    rec: ReplicaRecord,
    why: str,
    me: str | None,
    inv: Inventory,
    cat: Catalog,
    store: AsyncStore,
    nodes: Nodes,
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
        return replace(kept(seen), state=STARTING, reason=why)
    report(rec.name, "restarting", why)
    stopped = await stops.stop_shards(claimed, nodes)
    if stopped.left:
        reason = f"{why}; what is left of it could not be stopped ({stopped.problem()})"
        await stops.release(store, claimed, stopped, why=reason)
        report(rec.name, "failed", reason)
        return Outcome(rec.name, rec.replica.model, "restart", FAILED, [s.node for s in rec.replica.shards],
                       reason=reason, log=stopped.log)  # fmt: skip
    out = await start(claimed, "restart", inv, cat, store, nodes, facts, deadline, report)
    if not out.reason:
        out.reason = f"restarted: {why}"
    return out


async def stop(
    rec: ReplicaRecord, why: str, store: AsyncStore, nodes: Nodes, report: Report, *, wanted_down: bool = False
) -> Outcome:
    """Stop a replica the plan does not keep (``why``: the plan's reason) and release it
    (fenced where its stop could not be confirmed)."""
    t0 = time.monotonic()
    out = Outcome(rec.name, rec.replica.model, "stop", "stopped", [s.node for s in rec.replica.shards], reason=why)
    stopped = await stops.stop_shards(rec, nodes)
    if stopped.left:
        out.state, out.reason = FAILED, stopped.problem()
    await stops.release(store, rec, stopped, why=f"stopped ({why or 'no longer in the catalog'})",
                        wanted_down=wanted_down)  # fmt: skip
    report(rec.name, out.state, out.reason)
    out.seconds = time.monotonic() - t0
    return out


async def check_memory(
    rec: ReplicaRecord, cat: Catalog, store: AsyncStore, node: Any, run_dir: str, report: Report
) -> None:
    """Compare what the engine logged of its memory once ready with the placement's estimate;
    a large miss is reported and recorded as an event, with both figures. Best effort: a
    log that cannot be read, or says nothing, is no failure of the replica."""
    from cluster_cli.engines.memreport import parse_memory_report
    from cluster_cli.placement.fit import catalog_size, misses, need_of

    model = cat.model(rec.replica.model)
    prof = model.profile(rec.replica.profile) if model is not None else None
    if prof is None:
        return
    try:
        size = catalog_size(prof) or (await store.known_model_sizes()).get(prof.model or "")
        cfg = cat.engines.get(prof.engine)
        est = need_of(prof, size, cfg.overhead_gib if cfg is not None else None)
        if est is None:
            return
        got = parse_memory_report(await node.log_tail(run_dir, 2000))
    except Exception:  # a node that cannot tell fails nothing
        return
    off = misses(est, got)
    if off:
        said = "memory off the estimate: " + "; ".join(off)
        report(rec.name, "memory", said)
        await store.record_event(
            "note", said, node=rec.shards[0].node, model=rec.replica.model, replica=rec.replica.replica,
            generation=rec.generation,
            detail={"estimate": est.to_dict(), "reported": {"weights_bytes": got.weights_bytes,
                    "kv_bytes": got.kv_bytes, "kv_tokens": got.kv_tokens}},
        )  # fmt: skip
