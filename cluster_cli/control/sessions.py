"""One SSH session per node for the length of a command, opened on first use and shared by
everything the command does there (start, check, stop). A node that cannot be reached is
remembered as such: its error is raised to each user, the others go on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from cluster_cli.errors import SSHError

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory, SSHTarget
    from cluster_cli.probe.runner import Connector, Session


class Sessions:
    def __init__(self, inv: Inventory, connector: Connector) -> None:
        self.inv = inv
        self.connector = connector
        self._entered: list[AbstractAsyncContextManager[Session]] = []
        self._open: dict[str, asyncio.Task[Session]] = {}

    async def get(self, node: str) -> Session:
        """The node's session (opened now if need be). Raises SSHError. A caller cancelled
        while it waits leaves the connection to go on for the others."""
        task = self._open.get(node)
        if task is None:
            task = self._open[node] = asyncio.ensure_future(self._connect(node))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return await asyncio.shield(task)

    def prefetch(self, nodes: Iterable[str]) -> None:
        """Start connecting to ``nodes`` now, for a later ``get``."""
        for n in nodes:
            if n not in self._open:
                task = self._open[n] = asyncio.ensure_future(self._connect(n))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _connect(self, node: str) -> Session:
        n = self.inv.node(node)
        if n is None:
            raise SSHError(f"{node}: not in the inventory")
        t = self.inv.ssh_target(n)
        cm = self.connector.session(t)
        try:
            session = await asyncio.wait_for(cm.__aenter__(), t.connect_timeout_s * 2 + 5)
        except TimeoutError:
            raise SSHError(f"{node}: no answer over SSH") from None
        except OSError as e:
            raise SSHError(f"{node}: {e}") from None
        self._entered.append(cm)
        return session

    def connector_view(self) -> Connector:
        """A connector whose sessions are these (kept open for the rest of the command): the
        probe of ``up`` and its launch share one connection per node."""
        return _Shared(self)

    async def aclose(self) -> None:
        """Close every session at once (each waits a moment for its connection to end)."""
        for task in self._open.values():
            task.cancel()
        entered, self._entered = self._entered, []
        await asyncio.gather(*(cm.__aexit__(None, None, None) for cm in entered), return_exceptions=True)
        aclose = getattr(self.connector, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    async def __aenter__(self) -> Sessions:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Shared:
    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    @contextlib.asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        yield await self._sessions.get(target.name)
