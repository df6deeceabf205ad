"""``logs``: one shard's engine log, read from its node over SSH."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.ssh.session import Connector
    from cluster_cli.state.records import ReplicaRecord


async def shard_log(
    inv: Inventory,
    rec: ReplicaRecord,
    *,
    shard: int,
    lines: int,
    follow: bool,
    write: Callable[[bytes], None],
    previous: bool = False,
    pinned_known_hosts: Path | None = None,
    connector: Connector | None = None,
) -> int | None:
    """Write shard ``shard``'s last ``lines`` lines of log (``previous``: the instance's before
    its last start) to ``write``; ``follow``: then every new line until cancelled. Over
    ``connector`` (default SSH, ``accept-new`` keys pinned in ``pinned_known_hosts``).
    Returns the exit code of the reading command on the node (None: it had none)."""
    from cluster_cli.control.cluster import ssh_connector
    from cluster_cli.control.replicas import logs
    from cluster_cli.ssh.pool import Sessions

    if connector is None:
        connector = ssh_connector(pinned_known_hosts)
    async with Sessions(inv, connector) as sessions:
        return await logs(sessions, rec, shard=shard, lines=lines, follow=follow, write=write, previous=previous)
