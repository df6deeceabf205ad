"""``status``: the replicas, the fences, the nodes' liveness and who supervises, as one view.
``--no-check`` reads them as the state last recorded them, with no node asked and no
inventory needed (:meth:`Cluster.status` checks the replicas on their nodes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster_cli.state.aio import AsyncStore

if TYPE_CHECKING:
    from cluster_cli.control.replicas import Row
    from cluster_cli.state.leases import Lease
    from cluster_cli.state.records import Fence
    from cluster_cli.state.store import NodeStatus, Store


@dataclass
class StatusView:
    rows: list[Row]
    fences: list[Fence]
    nodes: list[NodeStatus] = field(default_factory=list)  # as the supervisor (or a probe) last saw them
    supervisor: Lease | None = None  # the running supervisor's lease, if one holds it

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": [r.to_dict() for r in self.rows],
            "fences": [f.to_dict() for f in self.fences],
            "nodes": [n.to_dict() for n in self.nodes],
            "supervisor": self.supervisor.to_dict() if self.supervisor is not None else None,
        }


async def around(astore: AsyncStore, rows: list[Row]) -> StatusView:
    """``rows`` with the fences, the nodes' liveness and the supervisor, read now."""
    from cluster_cli.control.lease import LEASE

    lease = await astore.lease_of(LEASE)
    live = lease if lease is not None and lease.expires_at > time.time() else None
    nodes = list((await astore.node_status()).values())
    return StatusView(rows, await astore.fences(), nodes, live)


async def recorded_status(store: Store) -> StatusView:
    """Every replica as last recorded, and the rest of the view; ``store`` is not to be used
    directly meanwhile."""
    from cluster_cli.control.replicas import status

    async with AsyncStore(store) as astore:
        return await around(astore, await status(astore, None))
