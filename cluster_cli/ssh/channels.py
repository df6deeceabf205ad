"""Commands on one node over one SSH connection, never more at once than its sshd allows.

sshd refuses a connection's session channels beyond its ``MaxSessions`` (10 by default): at
most ``max_channels`` commands hold a channel at once, the others wait their turn, and one
refused anyway is asked for again. A command's output is capped, and a command given up on
is ended on the node.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from cluster_cli.errors import SSHError
from cluster_cli.ssh.libsearch import import_asyncssh
from cluster_cli.ssh.messages import ssh_error_message
from cluster_cli.ssh.session import CommandResult, decoded

asyncssh = import_asyncssh()  # asyncssh's liboqs lookup would otherwise run ldconfig, gcc and ld


# A command's output is read up to this many bytes per stream. The probes print a few hundred
# KiB at most, even on the biggest nodes (nvidia-smi, ibstat); a node that sends more (broken,
# or hostile) is cut off, not buffered until the client runs out of memory.
MAX_OUTPUT_BYTES = 8 << 20


class _OutputCut(Exception):
    """A stream of a remote command went over ``MAX_OUTPUT_BYTES``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.stream = stream


# Session channels (commands) open at once on one connection. sshd refuses those beyond its
# MaxSessions, 10 by default, and counts a session until it has read our close, a moment after
# we saw the command end: back-to-back commands get 1 open in 20 refused at 8, 1 in 8 at 10.
DEFAULT_MAX_CHANNELS = 8
# A session refused anyway (one sshd still counts, a node with a lower MaxSessions, a command
# we gave up on that still runs there) is asked for again after a wait, doubling from the
# first to the longest: within the command's timeout, or for a stream (none) this long.
_REOPEN_FIRST_S, _REOPEN_MAX_S = 0.05, 1.0
_STREAM_REOPEN_S = 10.0


class AsyncsshSession:
    """Commands on one node over one connection. At most ``max_channels`` of ``run_raw``
    and ``stream`` hold a channel at once; the others wait for one to end. TCP connections
    (``open_connection``) are not counted: sshd's MaxSessions leaves forwarding alone."""

    def __init__(
        self,
        conn: asyncssh.SSHClientConnection,
        name: str,
        host: str | None = None,
        *,
        max_channels: int = DEFAULT_MAX_CHANNELS,
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"{name}: max_channels must be at least 1, not {max_channels}")
        self._conn = conn
        self._name = name
        # The node's address as SSH reached it: ssh_config's HostName for an alias.
        self.host = host or name
        self.max_output = MAX_OUTPUT_BYTES
        self.max_channels = max_channels
        self._slots = asyncio.Semaphore(max_channels)

    def is_closed(self) -> bool:
        """Whether the connection has ended (closed, lost, or dropped by keepalive)."""
        return self._conn.is_closed()

    async def wait_closed(self) -> None:
        """Return once the connection has ended."""
        await self._conn.wait_closed()

    async def run(self, command: str, *, timeout: float) -> CommandResult:
        return decoded(*await self.run_raw(command, timeout=timeout))

    async def run_raw(
        self, command: str, *, timeout: float, input: bytes | None = None
    ) -> tuple[int | None, bytes, bytes]:
        """Run ``command``: (exit status, stdout, stderr). Raises SSHError. ``timeout`` counts
        from when a channel is free (beyond ``max_channels`` a command waits its turn first)
        and covers the channel's opening, asked for again while the server refuses it."""
        refused: list[asyncssh.ChannelOpenError] = []
        async with self._slots:
            try:
                async with asyncio.timeout(timeout):
                    proc = await self._open_session(
                        lambda: self._conn.create_process(command, encoding=None, input=input), timeout, refused
                    )
                    done = False
                    try:
                        out, err = await _read_both(proc, self.max_output)
                        await proc.wait_closed()  # the exit status comes after the output
                        done = True
                    finally:
                        if not done:
                            _stop(proc)
            except TimeoutError:  # before OSError: TimeoutError is one
                if refused:  # never got a channel: say why, not just that time ran out
                    why = ssh_error_message(refused[-1])
                    raise SSHError(f"{self._name}: {why} (still refused after {timeout:.3g}s)") from None
                raise SSHError(f"{self._name}: command timed out after {timeout:.3g}s") from None
            except _OutputCut as e:
                cap = f"{self.max_output / (1 << 20):g} MiB"
                raise SSHError(f"{self._name}: command output over {cap} on {e.stream}, cut") from None
            except (asyncssh.Error, OSError) as e:
                raise SSHError(f"{self._name}: {ssh_error_message(e)}") from e
        status, sig = proc.exit_status, proc.exit_signal
        if status is None and sig is None:
            # asyncssh reports a connection that died mid-command this way, not as an exception.
            raise SSHError(f"{self._name}: connection lost while running a command")
        if sig is not None:  # asyncssh then reports exit_status -1: use the shell's 128+N
            num = getattr(signal, f"SIG{sig[0]}", None)
            rc = 128 + int(num) if num is not None else 128 + 9
        else:
            rc = status if status is not None else 128 + 9
        return rc, out, err

    async def open_connection(self, host: str, port: int) -> tuple[Any, Any]:
        """A TCP connection from the node to ``host:port`` (the node's own engine, on
        127.0.0.1), carried by this SSH connection: (reader, writer) streams as asyncio's.
        Works where the engine's port cannot be reached from here (a bastion, a laptop).
        Not held to ``max_channels``: sshd's MaxSessions does not count forwarded
        connections, and one refused names a port the node cannot reach (not retried)."""
        try:
            return await self._conn.open_connection(host, port)
        except (asyncssh.Error, OSError) as e:
            raise OSError(f"{self._name}: cannot reach {host}:{port} from the node: {ssh_error_message(e)}") from e

    async def stream(self, command: str, write: Callable[[bytes], None]) -> int | None:
        """Run ``command`` and hand its output to ``write`` as it comes (``logs -f``), until it
        ends or the caller is cancelled; returns its exit status. Holds one of the
        ``max_channels`` for as long as it runs."""
        async with self._slots:
            try:
                proc = await self._open_session(
                    lambda: self._conn.create_process(command, encoding=None, stderr=asyncssh.STDOUT), _STREAM_REOPEN_S
                )
            except (asyncssh.Error, OSError) as e:
                raise SSHError(f"{self._name}: {ssh_error_message(e)}") from e
            try:
                while data := await proc.stdout.read(65536):
                    write(data)
                await proc.wait_closed()
                return proc.exit_status
            finally:
                _stop(proc)

    async def _open_session(
        self,
        open_: Callable[[], Any],
        patience: float,
        refused: list[asyncssh.ChannelOpenError] | None = None,
    ) -> asyncssh.SSHClientProcess:
        """``open_()``, which opens a session channel, asked for again after a short wait while
        the server refuses it and the connection is up, for up to ``patience`` seconds; then
        the refusal is raised. ``refused`` holds the refusals while none has succeeded."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + patience
        wait = _REOPEN_FIRST_S
        while True:
            try:
                proc = await open_()
            except asyncssh.ChannelOpenError as e:
                # asyncssh's own "SSH connection closed" is final; sshd's "open failed" (and
                # another server's shortage) passes once one of its sessions is freed.
                if self._conn.is_closed() or loop.time() + wait > give_up:
                    raise
                if refused is not None:
                    refused.append(e)
            else:
                if refused is not None:
                    refused.clear()
                return proc
            await asyncio.sleep(wait)
            wait = min(wait * 2, _REOPEN_MAX_S)


async def _read_both(proc: asyncssh.SSHClientProcess, cap: int) -> tuple[bytes, bytes]:
    """stdout and stderr of ``proc``, read together (a full one must not stall the other);
    raises _OutputCut as soon as either goes over ``cap``."""
    readers = [
        asyncio.ensure_future(_read_capped(s, cap, n)) for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
    ]
    for r in readers:  # a reader cancelled after failing too must not log "exception never retrieved"
        r.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        out, err = await asyncio.gather(*readers)
    finally:
        for r in readers:
            r.cancel()
    return out, err


async def _read_capped(stream: asyncssh.SSHReader, cap: int, name: str) -> bytes:
    buf = bytearray()
    while True:
        try:
            chunk = await stream.read(cap + 1 - len(buf))  # whatever has arrived, up to one byte over
        except (asyncssh.Error, OSError):
            return bytes(buf)  # the connection died: run_raw reports it from the missing exit status
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > cap:
            raise _OutputCut(name)


def _stop(proc: asyncssh.SSHClientProcess) -> None:
    """End a command that we gave up on: TERM lets the probe batch remove its scratch files
    (its TERM trap), and closing the channel ends whatever ignores it at its next write."""
    with suppress(OSError, asyncssh.Error):
        proc.terminate()
    proc.close()
