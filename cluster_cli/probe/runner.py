"""Running commands on nodes over SSH (asyncssh), with one-line error messages.

One connection per node; commands run as parallel channels on it. Host keys are
always verified: against the configured known_hosts file, or with ``accept-new``
against a pinned file that learns a node's key on first contact and never again.
Nodes behind a jump host (ssh_config ``ProxyJump``) share one connection to it,
verified the same way (pinned as ``jump:HOST`` with ``accept-new``).
"""

from __future__ import annotations

import asyncio
import fcntl
import getpass
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
        # Jump-host connections (ssh_config ProxyJump), one per chain of hops and trust
        # settings, shared by every node behind it until ``aclose``.
        self._hops: dict[tuple[object, ...], asyncio.Future[asyncssh.SSHClientConnection]] = {}

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        paths = _config_paths(target)
        spec = _proxy_jump(paths, target.host, target.port, target.user)
        try:
            via = await self._jump(spec, target, paths, frozenset()) if spec else None
        except SSHError as e:  # shared by every node behind the hop: name this one
            raise SSHError(f"{target.name}: {e}") from e
        conn = await self._connect(target, target.name, target.host, target.port, target.user, paths, via, spec)
        try:
            yield AsyncsshSession(conn, target.name)
        finally:
            conn.close()
            with suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                await asyncio.wait_for(conn.wait_closed(), timeout=1.0)

    async def aclose(self) -> None:
        """Close the shared jump-host connections."""
        hops, self._hops = self._hops, {}
        for fut in hops.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().close()
            else:
                fut.cancel()
        for fut in hops.values():
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                with suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                    await asyncio.wait_for(fut.result().wait_closed(), timeout=1.0)

    async def _connect(
        self,
        target: SSHTarget,
        alias: str,
        host: str,
        port: int | None,
        user: str | None,
        paths: list[str],
        via: asyncssh.SSHClientConnection | None,
        spec: str | None,
        *,
        hop: bool = False,
    ) -> asyncssh.SSHClientConnection:
        """One verified connection to ``host`` (a node, or with ``hop`` a jump host), over
        ``via`` when it is behind a jump host. Errors are SSHError naming the node, or for a
        jump host (shared by many nodes) the jump host alone."""
        where = f"jump host {alias.removeprefix('jump:')}: " if hop else f"{target.name}: "
        shown = target if not hop else target.model_copy(update={"host": host, "port": port})
        known_hosts = self._parse(await self._known_hosts(target, alias, host, port, via, where))
        pinned = target.known_hosts == ACCEPT_NEW
        key = target.identity_file
        if hop and _resolve(paths, host, port, user, "IdentityFile"):
            key = None  # the jump host's own IdentityFile in ssh_config comes first, as in OpenSSH
        try:
            return await asyncio.wait_for(
                asyncssh.connect(
                    host,
                    # Unset values are left to ssh_config, then to SSH's defaults (``()``).
                    port=port or (),
                    username=user or (),
                    client_keys=[key] if key else (),
                    agent_path=None if key and not hop else (),
                    known_hosts=known_hosts,
                    # Pins are kept per node name, whatever host/port ssh_config resolves to.
                    host_key_alias=alias if pinned else (),
                    config=paths or (),
                    # A jump host's own ProxyJump was followed by ``_jump``: never again here.
                    tunnel=via if via is not None else (None if hop or spec else ()),
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
            raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
        except asyncssh.ChannelOpenError as e:
            if via is None:
                raise SSHError(f"{where}{ssh_error_message(e, shown)}") from e
            real = _resolve(paths, host, port, user, "Hostname") or host
            real_port = port or _resolve(paths, host, port, user, "Port") or 22
            raise SSHError(f"{where}jump host {spec} cannot reach {real}:{real_port}: {e.reason}") from e
        except (asyncssh.Error, OSError, ValueError) as e:
            raise SSHError(f"{where}{ssh_error_message(e, shown)}") from e

    async def _jump(
        self, spec: str, target: SSHTarget, paths: list[str], seen: frozenset[str]
    ) -> asyncssh.SSHClientConnection:
        """The connection to the last hop of a ProxyJump ``spec`` ("[user@]host[:port],...").

        Each hop is opened once and shared by every node behind it (a bastion's MaxStartups
        would refuse 64 logins at once), verified against the node's known_hosts (or, with
        ``accept-new``, pinned as ``jump:HOST``), and a failed hop fails its nodes at once.
        """
        via: asyncssh.SSHClientConnection | None = None
        chain = ""
        for hop in spec.split(","):
            chain = f"{chain},{hop}" if chain else hop
            k = (chain, target.known_hosts, target.identity_file, tuple(paths), target.connect_timeout_s)
            fut = self._hops.get(k)
            if (
                fut is not None
                and fut.done()
                and not fut.cancelled()
                and fut.exception() is None
                and fut.result().is_closed()
            ):  # it died since: open it again
                fut = None
            if fut is None or fut.cancelled():
                fut = asyncio.ensure_future(self._open_hop(hop, via, target, paths, seen))
                self._hops[k] = fut
            via = await asyncio.shield(fut)
        assert via is not None
        return via

    async def _open_hop(
        self,
        hop: str,
        via: asyncssh.SSHClientConnection | None,
        target: SSHTarget,
        paths: list[str],
        seen: frozenset[str],
    ) -> asyncssh.SSHClientConnection:
        try:
            user, host, port = _parse_hop(hop)
        except ValueError:
            raise SSHError(f"ProxyJump: cannot read the hop {hop!r}") from None
        if via is None:  # the first hop may sit behind its own ProxyJump
            own = _proxy_jump(paths, host, port, user)
            if own:
                names = {_parse_hop_host(h) for h in own.split(",")}
                if names & (seen | {host}):
                    raise SSHError(f"ProxyJump loops through {host} (ssh_config: ProxyJump {own})")
                via = await self._jump(own, target, paths, seen | {host})
        return await self._connect(target, f"jump:{host}", host, port, user, paths, via, None, hop=True)

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

    async def _known_hosts(
        self,
        target: SSHTarget,
        alias: str,
        host: str,
        port: int | None,
        via: asyncssh.SSHClientConnection | None,
        where: str,
    ) -> str:
        """The known_hosts file to verify ``host`` with; with accept-new, pins its key under
        ``alias`` on first contact (reached over ``via`` when behind a jump host)."""
        if target.known_hosts != ACCEPT_NEW:
            if not os.path.exists(target.known_hosts):
                raise SSHError(f"{where}known_hosts file not found: {target.known_hosts}")
            return target.known_hosts
        if self.pinned is None:
            raise SSHError(f"{where}known_hosts is accept-new but no pinned file is configured")
        async with self._pin_lock:
            if not self.pinned.exists():  # a read-only pin file that knows every node is fine
                try:
                    self.pinned.parent.mkdir(parents=True, exist_ok=True)
                    self.pinned.touch(exist_ok=True)
                except OSError as e:
                    raise SSHError(f"{where}cannot create the pin file {self.pinned}: {e.strerror or e}") from None
            pins = self._parse(str(self.pinned))  # parsed once per change of the file, not per node
            if isinstance(pins, asyncssh.SSHKnownHosts) and pins.match(alias, "", None)[0]:
                return str(self.pinned)
        # First contact: learn the key, pin it, then connect verifying against the pin.
        try:
            key = await asyncio.wait_for(
                asyncssh.get_server_host_key(
                    host, port or (), tunnel=via if via is not None else (), config=_config_paths(target) or ()
                ),
                timeout=target.connect_timeout_s + 1,
            )
        except TimeoutError:
            raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
        except (asyncssh.Error, OSError, ValueError) as e:  # ValueError: a peer not speaking SSH
            shown = target.model_copy(update={"host": host, "port": port})
            raise SSHError(f"{where}{ssh_error_message(e, shown)}") from e
        if key is None:
            raise SSHError(f"{where}server offered no host key")
        async with self._pin_lock:
            # Another clusterctl may be pinning the same node right now: under an exclusive file
            # lock, pin only if nobody did, so a name never gets two keys (either would pass).
            try:
                with self.pinned.open("a+") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.seek(0)
                    if not any(line.split(" ", 1)[0] == alias for line in f.read().splitlines()):
                        f.write(f"{alias} {key.export_public_key('openssh').decode().strip()}\n")
            except OSError as e:
                raise SSHError(f"{where}cannot pin its host key in {self.pinned}: {e.strerror or e}") from None
        return str(self.pinned)


def _config_paths(target: SSHTarget) -> list[str]:
    """The ssh_config files asyncssh reads for ``target``: the inventory's, else ~/.ssh/config."""
    if target.ssh_config:
        return [target.ssh_config]
    default = os.path.expanduser(os.path.join("~", ".ssh", "config"))
    return [default] if os.access(default, os.R_OK) else []


def _resolve(paths: list[str], host: str, port: int | None, user: str | None, option: str) -> object:
    """``option`` as ssh_config sets it for ``host`` (None when unset or unreadable: then
    asyncssh resolves, and reports, the config itself at connect time)."""
    if not paths:
        return None
    try:
        from asyncssh.config import SSHClientConfig

        try:
            local = getpass.getuser()
        except (KeyError, OSError):
            local = ""
        cfg = SSHClientConfig.load(None, paths, False, False, False, local, user or (), host, port or ())
        return cfg.get(option)
    except Exception:  # any failure here is asyncssh's to report, per node, at connect time
        return None


def _proxy_jump(paths: list[str], host: str, port: int | None, user: str | None) -> str | None:
    spec = _resolve(paths, host, port, user, "ProxyJump")
    return spec.strip() if isinstance(spec, str) and spec.strip() else None


def _parse_hop(hop: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` as asyncssh reads a ProxyJump hop."""
    user, _, host = hop.strip().rpartition("@")
    port: int | None = None
    if ":" in host:
        host, _, port_s = host.rpartition(":")
        port = int(port_s)
        if not 0 < port < 65536:
            raise ValueError(hop)
    if not host:
        raise ValueError(hop)
    return user or None, host, port


def _parse_hop_host(hop: str) -> str:
    try:
        return _parse_hop(hop)[1]
    except ValueError:
        return hop


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
