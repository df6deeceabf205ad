"""Running commands on nodes over SSH (asyncssh), with one-line error messages.

One connection per node; commands run as parallel channels on it. Host keys are
always verified: against the configured known_hosts file, or with ``accept-new``
against a pinned file that learns a node's key on first contact and never again.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.probe.libsearch import import_asyncssh

asyncssh = import_asyncssh()  # asyncssh's liboqs lookup would otherwise run ldconfig, gcc and ld


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
    async def run(self, command: str, *, timeout: float) -> CommandResult: ...

    async def run_raw(
        self, command: str, *, timeout: float, input: bytes | None = None
    ) -> tuple[int | None, bytes, bytes]: ...


class Connector(Protocol):
    def session(self, target: SSHTarget) -> AsyncIterator[Session]: ...


class AsyncsshSession:
    def __init__(self, conn: asyncssh.SSHClientConnection, name: str) -> None:
        self._conn = conn
        self._name = name

    async def run(self, command: str, *, timeout: float) -> CommandResult:
        rc, out, err = await self.run_raw(command, timeout=timeout)
        return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    async def run_raw(
        self, command: str, *, timeout: float, input: bytes | None = None
    ) -> tuple[int | None, bytes, bytes]:
        try:
            r = await self._conn.run(command, check=False, timeout=timeout, encoding=None, input=input)
        except asyncssh.TimeoutError as e:
            raise SSHError(f"{self._name}: command timed out after {timeout:g}s") from e
        except (asyncssh.Error, OSError) as e:
            raise SSHError(f"{self._name}: {ssh_error_message(e)}") from e
        if r.exit_status is None and r.exit_signal is None:
            # asyncssh reports a connection that died mid-command this way, not as an exception.
            raise SSHError(f"{self._name}: connection lost while running a command")
        if r.exit_signal is not None:  # asyncssh then reports exit_status -1: use the shell's 128+N
            num = getattr(signal, f"SIG{r.exit_signal[0]}", None)
            rc = 128 + int(num) if num is not None else 128 + 9
        else:
            rc = r.exit_status if r.exit_status is not None else 128 + 9
        return rc, bytes(r.stdout or b""), bytes(r.stderr or b"")


_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr")


class AsyncsshConnector:
    """Opens verified SSH connections. ``pinned_known_hosts`` backs ``accept-new``."""

    def __init__(self, pinned_known_hosts: Path | None = None) -> None:
        self.pinned = pinned_known_hosts
        self._pin_lock = asyncio.Lock()
        # Parsed known_hosts files by path, re-read when the file changes: asyncssh given a
        # path parses every key in it on every connect, which is quadratic in the fleet size.
        self._parsed: dict[str, tuple[tuple[int, int, int], asyncssh.SSHKnownHosts]] = {}

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        known_hosts = self._parse(await self._known_hosts(target))
        pinned = target.known_hosts == ACCEPT_NEW
        try:
            conn = await asyncio.wait_for(
                asyncssh.connect(
                    target.host,
                    # Unset values are left to ssh_config, then to SSH's defaults (``()``).
                    port=target.port or (),
                    username=target.user or (),
                    client_keys=[target.identity_file] if target.identity_file else (),
                    agent_path=None if target.identity_file else (),
                    known_hosts=known_hosts,
                    # Pins are kept per node name, whatever host/port ssh_config resolves to.
                    host_key_alias=target.name if pinned else (),
                    config=[target.ssh_config] if target.ssh_config else (),
                    # AES-GCM is hardware-accelerated almost everywhere; chacha20 costs ~25% of
                    # discover's client CPU on a large fleet (bench/README.md, Discovery).
                    encryption_algs=_CIPHERS,
                    connect_timeout=target.connect_timeout_s,
                    login_timeout=target.connect_timeout_s,
                    keepalive_interval=max(1.0, target.command_timeout_s / 3),
                    keepalive_count_max=3,
                ),
                timeout=target.connect_timeout_s + 1,
            )
        except TimeoutError:
            raise SSHError(f"{target.name}: connect timed out after {target.connect_timeout_s:g}s") from None
        except (asyncssh.Error, OSError, ValueError) as e:
            raise SSHError(f"{target.name}: {ssh_error_message(e, target)}") from e
        try:
            yield AsyncsshSession(conn, target.name)
        finally:
            conn.close()
            with suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                await asyncio.wait_for(conn.wait_closed(), timeout=1.0)

    def _parse(self, path: str) -> asyncssh.SSHKnownHosts | str:
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            hit = self._parsed.get(path)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            parsed = asyncssh.read_known_hosts(path)
        except (OSError, ValueError):
            return path  # let asyncssh report it, per node
        self._parsed[path] = (stamp, parsed)
        return parsed

    async def _known_hosts(self, target: SSHTarget) -> str:
        if target.known_hosts != ACCEPT_NEW:
            if not os.path.exists(target.known_hosts):
                raise SSHError(f"{target.name}: known_hosts file not found: {target.known_hosts}")
            return target.known_hosts
        if self.pinned is None:
            raise SSHError(f"{target.name}: known_hosts is accept-new but no pinned file is configured")
        async with self._pin_lock:
            if not self.pinned.exists():  # a read-only pin file that knows every node is fine
                try:
                    self.pinned.parent.mkdir(parents=True, exist_ok=True)
                    self.pinned.touch(exist_ok=True)
                except OSError as e:
                    raise SSHError(f"{target.name}: cannot create the pin file {self.pinned}: {e.strerror or e}") from None
            pins = self._parse(str(self.pinned))  # parsed once per change of the file, not per node
            if isinstance(pins, asyncssh.SSHKnownHosts) and pins.match(target.name, "", None)[0]:
                return str(self.pinned)
        # First contact: learn the key, pin it, then connect verifying against the pin.
        try:
            key = await asyncio.wait_for(
                asyncssh.get_server_host_key(
                    target.host, target.port or (), config=[target.ssh_config] if target.ssh_config else ()
                ),
                timeout=target.connect_timeout_s + 1,
            )
        except TimeoutError:
            raise SSHError(f"{target.name}: connect timed out after {target.connect_timeout_s:g}s") from None
        except (asyncssh.Error, OSError, ValueError) as e:  # ValueError: a peer not speaking SSH
            raise SSHError(f"{target.name}: {ssh_error_message(e, target)}") from e
        if key is None:
            raise SSHError(f"{target.name}: server offered no host key")
        async with self._pin_lock:
            # Another clusterctl may be pinning the same node right now: under an exclusive file
            # lock, pin only if nobody did, so a name never gets two keys (either would pass).
            try:
                with self.pinned.open("a+") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.seek(0)
                    if not any(line.split(" ", 1)[0] == target.name for line in f.read().splitlines()):
                        f.write(f"{target.name} {key.export_public_key('openssh').decode().strip()}\n")
            except OSError as e:
                raise SSHError(f"{target.name}: cannot pin its host key in {self.pinned}: {e.strerror or e}") from None
        return str(self.pinned)


def ssh_error_message(e: BaseException, target: SSHTarget | None = None) -> str:
    """A short, actionable description of an SSH failure."""
    if isinstance(e, asyncssh.HostKeyNotVerifiable):
        where = f" in {target.known_hosts}" if target and target.known_hosts != ACCEPT_NEW else " (pinned key)"
        return f"host key not verifiable{where} (unknown or changed host key): {e.reason}"
    if isinstance(e, asyncssh.PermissionDenied):
        key = f" with {target.identity_file}" if target and target.identity_file else ""
        return f"authentication failed{key}: {e.reason}"
    if isinstance(e, asyncssh.ConnectionLost):
        return f"connection lost: {e.reason}"
    if isinstance(e, asyncssh.DisconnectError):
        return f"disconnected: {e.reason}"
    if isinstance(e, asyncssh.ChannelOpenError):
        return f"cannot open a channel: {e.reason}"
    if isinstance(e, asyncssh.KeyImportError):
        return f"cannot load identity file: {e}"
    where = f" ({target.host}:{target.port or 22})" if target else ""
    if isinstance(e, ConnectionRefusedError):
        return f"connection refused{where}"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "timed out"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host name: {e.strerror or e}{where}"
    if isinstance(e, OSError):
        if e.errno:  # asyncio's "Connect call failed (...)" hides the reason in errno
            return f"{os.strerror(e.errno).lower()}{where}"
        return e.strerror or str(e) or type(e).__name__
    return str(e).splitlines()[0] if str(e) else type(e).__name__
