"""What running a command on a node looks like to the rest of clusterctl: a ``Session`` runs
commands, a ``Connector`` opens one per node. Tests and benchmarks stand in for SSH here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cluster_cli.config.inventory import SSHTarget


@dataclass(frozen=True)
class CommandResult:
    """What a remote command did. ``rc`` is None when the connection died under it."""

    rc: int | None
    stdout: str
    stderr: str = ""

    @property
    def output(self) -> str:
        return self.stdout + (("\n" + self.stderr) if self.stderr else "")


class Session(Protocol):
    """Commands on one node. ``run`` decodes the output; ``run_raw`` returns it as bytes,
    with ``input`` as the command's stdin (secrets go there, never on a command line)."""

    async def run(self, command: str, *, timeout: float) -> CommandResult: ...

    async def run_raw(
        self, command: str, *, timeout: float, input: bytes | None = None
    ) -> tuple[int | None, bytes, bytes]: ...


class Connector(Protocol):
    """Opens a node's session for as long as the context it yields lasts."""

    def session(self, target: SSHTarget) -> AsyncIterator[Session]: ...


def decoded(rc: int | None, out: bytes, err: bytes) -> CommandResult:
    """``run``'s result from ``run_raw``'s: the output as UTF-8, bad bytes replaced."""
    return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))
