"""One SSH session per node, opened on first use and shared by everything done there (start,
check, stop). A session whose connection has ended (the node went away, or keepalive gave up
on it) is opened again by the next user. A node that cannot be reached is remembered as such:
its error is raised to each user at once, the others go on. For one command that is for the
rest of the command; a long-lived ``Sessions`` (``retry_failed``) tries again after a backoff."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from cluster_cli.errors import SSHError

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory, SSHTarget
    from cluster_cli.ssh.session import Connector, Session

# A node that failed to connect is tried again after these many seconds, doubling from the
# first to the longest, with ``retry_failed``: a dead node costs one connect per wait, however
# many callers ask for it meanwhile, and is found again soon after it is back.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


class Sessions:
    """The nodes' sessions. With ``retry_failed`` false (one command: ``up``, ``down``,
    ``status``), a node that failed to connect fails every later ``get`` at once, with the
    same error, and is never tried again: no second connect timeout. With it true (a loop
    that runs for long), it is tried again by the first ``get`` after ``backoff_s`` seconds,
    doubling after each failure up to ``max_backoff_s``, back to ``backoff_s`` on success."""

    def __init__(
        self,
        inv: Inventory,
        connector: Connector,
        *,
        retry_failed: bool = False,
        backoff_s: float = BACKOFF_FIRST_S,
        max_backoff_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.inv = inv
        self.connector = connector
        self.retry_failed = retry_failed
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._open: dict[str, asyncio.Task[Session]] = {}
        self._entered: dict[str, AbstractAsyncContextManager[Session]] = {}
        self._failures: dict[str, int] = {}  # connects failed in a row, per node
        self._retry_at: dict[str, float] = {}  # when a failed node may be tried again (loop time)

    async def get(self, node: str) -> Session:
        """The node's open session: the one open, else a new one opened now. Raises SSHError;
        a node that failed recently raises that error again without a new attempt (see the
        class). A caller cancelled while it waits leaves the connection to go on for the others."""
        task = self._open.get(node)
        if task is None or self._spent(node, task):
            task = self._start(node)
        return await asyncio.shield(task)

    def prefetch(self, nodes: Iterable[str]) -> None:
        """Start connecting to ``nodes`` now, for a later ``get``."""
        for n in nodes:
            task = self._open.get(n)
            if task is None or self._spent(n, task):
                self._start(n)

    def _spent(self, node: str, task: asyncio.Task[Session]) -> bool:
        """Whether ``task`` (the node's latest connect) no longer answers ``get``: its session
        has ended, or it failed and its backoff is over."""
        if not task.done():
            return False  # a connect under way: join it
        if task.cancelled():
            return True
        if task.exception() is not None:
            return self.retry_failed and asyncio.get_running_loop().time() >= self._retry_at.get(node, 0.0)
        closed = getattr(task.result(), "is_closed", None)  # sessions that cannot tell stay open
        return closed is not None and bool(closed())

    def _start(self, node: str) -> asyncio.Task[Session]:
        task = self._open[node] = asyncio.ensure_future(self._connect(node, self._entered.pop(node, None)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return task

    async def _connect(self, node: str, ended: AbstractAsyncContextManager[Session] | None) -> Session:
        if ended is not None:  # the session it replaces: its connection is gone already
            with contextlib.suppress(Exception):
                await ended.__aexit__(None, None, None)
        try:
            session, cm = await self._enter(node)
        except Exception:  # whatever the connector raised is the node's answer until the retry
            failures = self._failures[node] = self._failures.get(node, 0) + 1
            wait = min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))
            self._retry_at[node] = asyncio.get_running_loop().time() + wait
            raise
        self._failures.pop(node, None)
        self._entered[node] = cm
        return session

    async def _enter(self, node: str) -> tuple[Session, AbstractAsyncContextManager[Session]]:
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
        return session, cm

    def connector_view(self) -> Connector:
        """A connector whose sessions are these (kept open for the rest of the command): the
        probe of ``up`` and its launch share one connection per node."""
        return _Shared(self)

    async def aclose(self) -> None:
        """Close every session at once (each waits a moment for its connection to end)."""
        for task in self._open.values():
            task.cancel()
        entered, self._entered = list(self._entered.values()), {}
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
