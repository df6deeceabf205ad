"""One SSH session per node for the length of a command, opened on first use and shared by
everything the command does there (start, check, stop). A node that cannot be reached is
remembered as such: its error is raised to each user, the others go on."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from cluster_cli.errors import SSHError

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.probe.runner import Connector, Session


class Sessions:
    def __init__(self, inv: Inventory, connector: Connector) -> None:
        self.inv = inv
        self.connector = connector
        self._stack = contextlib.AsyncExitStack()
        self._open: dict[str, asyncio.Future[Session]] = {}

    async def get(self, node: str) -> Session:
        """The node's session (opened now if need be). Raises SSHError."""
        fut = self._open.get(node)
        if fut is None:
            fut = self._open[node] = asyncio.get_running_loop().create_future()
            n = self.inv.node(node)
            try:
                if n is None:
                    raise SSHError(f"{node}: not in the inventory")
                t = self.inv.ssh_target(n)
                s = await asyncio.wait_for(
                    self._stack.enter_async_context(self.connector.session(t)), t.connect_timeout_s * 2 + 5
                )
            except TimeoutError:
                fut.set_exception(SSHError(f"{node}: no answer over SSH"))
            except (SSHError, OSError) as e:
                fut.set_exception(e if isinstance(e, SSHError) else SSHError(f"{node}: {e}"))
            else:
                fut.set_result(s)
            fut.add_done_callback(lambda f: f.exception())  # retrieved: no "never retrieved" warning
        return await asyncio.shield(fut)

    def forget(self, node: str) -> None:
        """Drop a node's session (it failed): the next use opens a new one."""
        self._open.pop(node, None)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._stack.aclose()
        aclose = getattr(self.connector, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    async def __aenter__(self) -> Sessions:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
