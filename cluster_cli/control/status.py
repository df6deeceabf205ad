"""``status --no-check``: the replicas and fences as the state last recorded them, with no
node asked and no inventory needed (:meth:`Cluster.status` checks them on their nodes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster_cli.state.aio import AsyncStore

if TYPE_CHECKING:
    from cluster_cli.control.replicas import Row
    from cluster_cli.state.records import Fence
    from cluster_cli.state.store import Store


async def recorded_status(store: Store) -> tuple[list[Row], list[Fence]]:
    """Every replica as last recorded, and the fences; ``store`` is not to be used directly meanwhile."""
    from cluster_cli.control.replicas import status

    async with AsyncStore(store) as astore:
        return await status(astore, None), await astore.fences()
