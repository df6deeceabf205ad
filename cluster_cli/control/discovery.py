"""What ``discover`` does, for every command that needs fresh facts (``discover``, ``up``,
later ``supervise``): probe the nodes, save their facts, and read back the fleet as placement
sees it (inventory declarations, cordons, fabric cross-checks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster_cli.facts import NodeFacts
from cluster_cli.launch.observe import Observed, node_commands
from cluster_cli.state.records import ReplicaRecord, ShardRun

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory, Node
    from cluster_cli.ssh.session import Connector
    from cluster_cli.state.aio import AsyncStore


def launched(records: Sequence[ReplicaRecord]) -> tuple[dict[str, frozenset[int]], dict[str, frozenset[str]]]:
    """Per node, the PIDs and the launch markers of the shards the state launched there: their
    GPU processes (workers included, which carry the marker) are the replicas' own, not
    foreign ones."""
    pids: dict[str, set[int]] = {}
    tokens: dict[str, set[str]] = {}
    for rec in records:
        for run in rec.shards:
            tokens.setdefault(run.node, set()).add(run.token)
            if run.pid is not None:
                pids.setdefault(run.node, set()).add(run.pid)
    return {k: frozenset(v) for k, v in pids.items()}, {k: frozenset(v) for k, v in tokens.items()}


async def probe(
    inv: Inventory,
    nodes: Sequence[Node] | None = None,
    *,
    connector: Connector,
    parallel: int = 64,
    node_timeout_s: float | None = None,
    store: AsyncStore | None = None,
    on_done: Callable[[NodeFacts], None] | None = None,
    observed: Observed | None = None,
    ports: bool = True,
    hardware: bool = True,
    models: Sequence[str] = (),
) -> list[NodeFacts]:
    """Probe ``nodes`` (default: all), the state's launched processes known as its own.
    ``observed`` also gets, from the same batch, whether each recorded shard still runs and
    (``ports``) which ports listen: what ``up`` checks. Without ``hardware``, what does not
    change while engines run is taken from the state's earlier facts where they hold it
    (``carried``): a check of running replicas, which places nothing new. ``models``: each
    node's batch also lists these models' files (``Observed.models``: the memory-fit check)."""
    from cluster_cli.probe.collect import discover

    records = await store.records(include_fenced=True) if store is not None else []
    pids, tokens = launched(records)
    carry = carried(await store.nodes(unreadable=[]), records) if store is not None and not hardware else None
    extra = None
    if observed is not None:
        runs: dict[str, list[ShardRun]] = {}
        for rec in records:
            for run in rec.shards:
                runs.setdefault(run.node, []).append(run)
        extra = {
            n.name: node_commands(runs.get(n.name, ()), ports=ports, models=models)
            for n in (nodes if nodes is not None else inv.nodes)
        }
    return await discover(
        inv,
        nodes,
        connector=connector,
        parallel=parallel,
        node_timeout_s=node_timeout_s,
        own_pids=pids,
        own_tokens=tokens,
        on_done=on_done,
        extra=extra,
        on_outputs=observed.record if observed is not None else None,
        carry=carry,
    )


def carried(stored: list[NodeFacts], records: Sequence[ReplicaRecord]) -> dict[str, tuple[NodeFacts, frozenset[str]]]:
    """Per node the state knows, its earlier facts and the probes that may be left out, their
    facts taken from those: the hardware ones whose value the facts hold; ``ibstat`` where no
    multi-node replica runs (only those read the ports' state while they run); and on a node
    where nvidia-smi found no GPU (a CPU node), nvidia-smi. A GPU node's GPUs are read
    again: their health decides whether its replicas are kept."""
    from cluster_cli.probe.commands import HARDWARE_PROBES

    fabric_nodes = {run.node for rec in records if len(rec.shards) > 1 for run in rec.shards}
    out: dict[str, tuple[NodeFacts, frozenset[str]]] = {}
    for f in stored:
        if not f.reachable:
            continue
        held = {"cpus": f.cpus, "meminfo": f.memory_mib, "topo": f.nvlink_domains}  # what each would read
        skip = {p for p in HARDWARE_PROBES if held[p] is not None}
        if f.name not in fabric_nodes and not any(p.startswith("ibstat:") for p in f.problems):
            skip.add("ibstat")
        if not f.gpus and not any(p.startswith("nvidia-smi:") for p in f.problems):
            skip |= {"gpus", "apps", "topo"}
        out[f.name] = (f, frozenset(skip))
    return out


async def save(
    store: AsyncStore, facts: list[NodeFacts], inventory: Path, observed: Observed | None = None
) -> list[NodeFacts]:
    """Save one probe run's facts (one transaction), each with what changed since the last,
    and (``observed``) the nodes' boot ids; returns them as saved. A stored row that cannot
    be read is no earlier knowledge: replaced."""
    from cluster_cli.state.view import note_changes

    before = {f.name: f for f in await store.nodes([f.name for f in facts], unreadable=[])}
    facts = [note_changes(f, before.get(f.name)) for f in facts]
    boots = observed.boot_ids if observed is not None else None
    await store.save_discovery(facts, inventory=inventory.resolve(), boot_ids=boots)
    return facts


@dataclass(frozen=True)
class Fleet:
    """What a plan is made from, from one snapshot of the state: the inventory's nodes as
    placement sees them, the replicas held, and the state version."""

    nodes: list[NodeFacts]
    records: list[ReplicaRecord]
    version: int
    wanted_down: frozenset[str] = frozenset()  # MODEL/N a down took down (its latest generation)


async def fleet(
    inv: Inventory, store: AsyncStore, unreadable: list[str] | None = None, *, placeable: bool = False
) -> Fleet:
    """Every node of the inventory as the state holds it, with what the inventory declares
    (fabrics, classes, labels), the cordons, and the GPUs fenced replicas hold; with the
    replicas and the state version of the same snapshot. Nodes whose row cannot be read go
    to ``unreadable``. ``placeable``: as placement takes them (see :func:`_placeable`)."""
    from cluster_cli.state.view import for_inventory, with_fenced

    bad = unreadable if unreadable is not None else []
    view = await store.plan_view([n.name for n in inv.nodes], unreadable=bad)
    nodes = with_fenced(for_inventory(inv, view.nodes, from_state=True), view.fenced)
    return Fleet(_placeable(inv, nodes) if placeable else nodes, view.records, view.version, view.wanted_down)


def _placeable(inv: Inventory, nodes: list[NodeFacts]) -> list[NodeFacts]:
    """``nodes`` with the ports whose subnet contradicts their declared fabric taken off."""
    from cluster_cli.probe.fabric import distrust_conflicting_ports

    return distrust_conflicting_ports(nodes, inv.declared_prefixes())
