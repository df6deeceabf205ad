"""The nodes as the control plane acts on them: one small interface per node (start a shard,
stop it, check it, heartbeat, fence, list what runs), whatever carries it.

Every operation of ``control/`` reaches a node through a :class:`Nodes`, never through an SSH
session directly: :class:`SSHNodes` runs the launch scripts over the kept-open sessions, and
the tests' fake fleet answers from memory, so that the reconcile loop's decisions are tested
without SSH. A node that cannot be reached raises ``SSHError`` (or ``OSError``) from ``get``
or from any call; a script that failed on the node raises ``LaunchError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from cluster_cli.errors import SSHError
from cluster_cli.launch import node as nodeops
from cluster_cli.launch import remote

if TYPE_CHECKING:
    from cluster_cli.launch.node import Beat, Fenced, NodeRuns, Stopped
    from cluster_cli.launch.shards import ShardStart
    from cluster_cli.state.records import ShardRun


class Node(Protocol):
    """One node, reached. ``address``: where the node was reached (ssh_config's HostName
    where the inventory names an alias), None where the carrier does not know."""

    name: str
    address: str | None

    async def start(self, s: ShardStart) -> ShardRun: ...

    async def stop(
        self, run: ShardRun, *, grace_s: float = 10.0, port: int | None = None, gpu_check: bool = False
    ) -> Stopped: ...

    async def alive(self, runs: list[ShardRun], *, trim_bytes: int | None = None) -> list[bool]: ...

    async def ready(
        self, port: int, served_name: str, *, list_models: bool = True, api_key: str | None = None
    ) -> str | None: ...

    async def get(self, port: int, path: str, *, api_key: str | None = None) -> tuple[int, bytes]: ...

    async def listening(self) -> set[int]: ...

    async def heartbeat(self, runs: list[ShardRun], run_dir: str, *, timeout: float) -> Beat: ...

    async def fence(self, run_dir: str, keep: Iterable[str], *, grace_s: float = 10.0) -> Fenced: ...

    async def list_runs(self, run_dir: str) -> NodeRuns: ...

    async def log_tail(self, run_dir: str, lines: int) -> str: ...


class Nodes(Protocol):
    """The cluster's nodes: ``get`` reaches one (raises SSHError when it cannot be reached),
    ``prefetch`` starts reaching some now for a later ``get``."""

    async def get(self, node: str) -> Node: ...

    def prefetch(self, nodes: Iterable[str]) -> None: ...


def _ssh_errors(fn: Any) -> Any:
    """An asyncssh error (a connection lost under a call) raised as SSHError naming the node:
    what the control plane treats as "its node did not answer"."""
    import functools

    @functools.wraps(fn)
    async def call(self: SSHNode, *args: Any, **kwargs: Any) -> Any:
        from cluster_cli.ssh.connect import asyncssh

        try:
            return await fn(self, *args, **kwargs)
        except asyncssh.Error as e:
            raise SSHError(f"{self.name}: {e.reason if hasattr(e, 'reason') else e}") from None

    return call


class SSHNode:
    """A node over its SSH session: each operation is one launch script (``launch.node``)."""

    def __init__(self, name: str, session: Any) -> None:
        self.name = name
        self.session = session
        self.address: str | None = getattr(session, "host", None)

    @_ssh_errors
    async def start(self, s: ShardStart) -> ShardRun:
        return await nodeops.start(self.session, s)

    @_ssh_errors
    async def stop(
        self, run: ShardRun, *, grace_s: float = 10.0, port: int | None = None, gpu_check: bool = False
    ) -> Stopped:
        return await nodeops.stop(self.session, run, grace_s=grace_s, port=port, gpu_check=gpu_check)

    @_ssh_errors
    async def alive(self, runs: list[ShardRun], *, trim_bytes: int | None = None) -> list[bool]:
        return await nodeops.alive(self.session, runs, trim_bytes=trim_bytes)

    @_ssh_errors
    async def ready(
        self, port: int, served_name: str, *, list_models: bool = True, api_key: str | None = None
    ) -> str | None:
        return await nodeops.ready(self.session, port, served_name, list_models=list_models, api_key=api_key)

    @_ssh_errors
    async def get(self, port: int, path: str, *, api_key: str | None = None) -> tuple[int, bytes]:
        return await nodeops.get(self.session, port, path, api_key=api_key)

    @_ssh_errors
    async def listening(self) -> set[int]:
        return await nodeops.listening(self.session)

    @_ssh_errors
    async def heartbeat(self, runs: list[ShardRun], run_dir: str, *, timeout: float) -> Beat:
        return await nodeops.heartbeat(self.session, runs, run_dir, timeout=timeout)

    @_ssh_errors
    async def fence(self, run_dir: str, keep: Iterable[str], *, grace_s: float = 10.0) -> Fenced:
        return await nodeops.fence(self.session, run_dir, keep, grace_s=grace_s)

    @_ssh_errors
    async def list_runs(self, run_dir: str) -> NodeRuns:
        return await nodeops.list_runs(self.session, run_dir)

    @_ssh_errors
    async def log_tail(self, run_dir: str, lines: int) -> str:
        res = await self.session.run(remote.log_command(run_dir, lines=lines, follow=False), timeout=30.0)
        return res.stdout


class SSHNodes:
    """The nodes over a session pool (anything with ``get(node)`` and ``prefetch(nodes)``,
    the SSH pool's sessions): a node's connection is the pool's, kept open between calls."""

    def __init__(self, sessions: Any) -> None:
        self.sessions = sessions

    async def get(self, node: str) -> Node:
        return SSHNode(node, await self.sessions.get(node))

    def prefetch(self, nodes: Iterable[str]) -> None:
        self.sessions.prefetch(nodes)
