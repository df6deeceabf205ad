"""Which of the replicas the state holds still run and answer: each shard's process (its
PID and start time, as the probe's batch saw it, else asked now) and the engine's health
check, started as soon as the probe of its node is done: what ``up`` checks before it
plans."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster_cli.errors import SSHError
from cluster_cli.launch.observe import Observed
from cluster_cli.state.records import PLANNED, READY, STARTING, UNHEALTHY, ReplicaRecord

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.control.nodes import Nodes
    from cluster_cli.facts import NodeFacts


def expects_new(cat: Catalog, records: list[ReplicaRecord]) -> bool:
    """Whether the catalog asks for a replica the state does not hold: then ``up`` probes the
    nodes in full (hardware, and the ports listening there: a new replica's port must be
    free); otherwise the probe only checks the replicas held."""
    held = {(r.replica.model, r.replica.replica) for r in records}
    return any((m.name, n) not in held for m in cat.models for n in range(m.replicas))


async def find_dead(
    records: list[ReplicaRecord],
    nodes: Nodes,
    seen: Observed,
    busy: set[tuple[str, int, int]],
    theirs: Callable[[ReplicaRecord], bool],
    health: HealthChecks,
) -> dict[tuple[str, int, int], str]:
    """The kept replicas that no longer run or answer, with why (their processes as the probe
    saw them, else asked for now). A replica another run that is still going set planned,
    starting or restarting (``theirs``) goes to ``busy``: neither dead nor ready."""
    out: dict[tuple[str, int, int], str] = {}

    async def check(rec: ReplicaRecord) -> None:
        if rec.status in (PLANNED, STARTING, UNHEALTHY) and theirs(rec):
            busy.add(rec.key)
            return
        # Unhealthy is checked as ready is: a replica whose node was away, or whose engine
        # did not answer for a while, is trusted again when it runs and answers now.
        if rec.status not in (READY, UNHEALTHY) or not rec.shards or rec.port is None:
            out[rec.key] = f"was left {rec.status} by an earlier run"
            return
        try:
            for run in rec.shards:
                # A process the probe did not see may have started since (the probe's snapshot
                # is older than this read of the state): asked again before it is called dead.
                ok = seen.alive(run)
                if not ok:
                    (ok,) = await (await nodes.get(run.node)).alive([run])
                if not ok:
                    out[rec.key] = f"its engine on {run.node} is not running"
                    return
            why = await health.result(rec)
            if why is not None:
                out[rec.key] = f"its engine stopped answering ({why})"
        except (SSHError, OSError) as e:
            out[rec.key] = f"its node cannot be reached ({e})"

    await asyncio.gather(*(check(r) for r in records))
    return out


class HealthChecks:
    """The health checks of the state's ready replicas, each started as soon as the probe of
    its head node is done: on that node's connection, while slower nodes are still probed,
    and never competing with the node's own probe."""

    def __init__(self, records: list[ReplicaRecord], nodes: Nodes) -> None:
        self._nodes = nodes
        self._waiting: dict[str, list[ReplicaRecord]] = {}
        self._tasks: dict[tuple[str, int, int], asyncio.Task[str | None]] = {}
        for rec in records:
            if rec.status == READY and rec.shards and rec.port is not None:
                self._waiting.setdefault(rec.shards[0].node, []).append(rec)

    def node_done(self, facts: NodeFacts) -> None:
        """The probe of ``facts``' node is done (the probe's ``on_done``)."""
        if not facts.reachable:
            return
        for rec in self._waiting.pop(facts.name, []):
            task = asyncio.ensure_future(self._check(rec))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
            self._tasks[rec.key] = task

    async def result(self, rec: ReplicaRecord) -> str | None:
        """None when ``rec`` answers its health check, else why not. Raises SSHError."""
        task = self._tasks.get(rec.key)
        return await (task if task is not None else self._check(rec))

    async def _check(self, rec: ReplicaRecord) -> str | None:
        assert rec.port is not None
        node = await self._nodes.get(rec.shards[0].node)
        return await node.ready(rec.port, rec.replica.model, list_models=False)
