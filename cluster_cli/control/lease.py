"""One supervisor per state: the ``supervise`` lease, held for the life of the loop, every
write of the state's handle then carrying its epoch (``state/leases.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from cluster_cli.errors import ClusterctlError

if TYPE_CHECKING:
    from cluster_cli.control.supervise import Settings
    from cluster_cli.state.leases import Lease
    from cluster_cli.state.store import Store

LEASE = "supervise"


class SupervisorRunning(ClusterctlError):
    """Another supervisor holds this state's lease."""


@asynccontextmanager
async def hold_lease(
    store: Store, settings: Settings, *, standby: bool, stop: asyncio.Event, log: Callable[[str], None]
) -> AsyncIterator[Lease | None]:
    """This process's supervise lease on ``store`` for the block, every write of ``store``
    then carrying its epoch; given up at the end. Raises SupervisorRunning naming the holder,
    unless ``standby``: then waits until it is free (None when ``stop`` is set first)."""
    import os
    import socket
    import uuid

    from cluster_cli.state.leases import LeaseHeld

    holder = f"supervise-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    said = False
    while True:
        try:
            lease = store.acquire_lease(LEASE, holder, settings.lease_ttl_s)
            break
        except LeaseHeld:
            cur = store.lease_of(LEASE)
            who = (f"{cur.holder} (pid {cur.pid} on {cur.host}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(cur.acquired_at))})") if cur else "another"  # fmt: skip
            if not standby:
                raise SupervisorRunning(
                    f"{store.path}: a supervisor already runs on this state: {who}; stop it, or wait with --standby"
                ) from None
            if not said:
                log(f"standby: {who} holds the lease; taking over when it expires")
                said = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.interval_s)
            if stop.is_set():
                yield None
                return
    log(f"lease taken (epoch {lease.epoch})")
    store.lease = lease
    try:
        yield lease
    finally:
        store.lease = None
        with contextlib.suppress(ClusterctlError):
            store.release_lease(lease)
