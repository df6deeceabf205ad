"""Running commands on nodes over SSH (asyncssh), with one-line error messages.

One connection per node; commands run as parallel channels on it, at most
``max_channels`` at once (sshd refuses a connection's sessions beyond its MaxSessions).
Keepalives notice a peer that stopped answering within seconds. Host keys are
always verified: against the configured known_hosts file, or with ``accept-new``
against a pinned file that learns a node's key on first contact and never again.
Nodes behind a jump host (ssh_config ``ProxyJump``) share one connection to it,
verified the same way (pinned as ``jump:HOST`` with ``accept-new``).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import getpass
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.probe.libsearch import import_asyncssh

asyncssh = import_asyncssh()  # asyncssh's liboqs lookup would otherwise run ldconfig, gcc and ld
_T = TypeVar("_T")


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
# A keepalive after each interval without a byte from the peer; the connection is dropped
# after COUNT_MAX + 1 intervals of silence (~9 s): a dead node's commands fail then, and a
# long-lived Sessions opens a new connection, instead of waiting for TCP to give up.
KEEPALIVE_INTERVAL_S = 3.0
KEEPALIVE_COUNT_MAX = 2


def decoded(rc: int | None, out: bytes, err: bytes) -> CommandResult:
    """``run``'s result from ``run_raw``'s: the output as UTF-8, bad bytes replaced."""
    return CommandResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


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


_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr")


@dataclass(frozen=True)
class _Dest:
    """Where one connection goes, a node or a jump host, as ssh_config resolves it."""

    alias: str  # the name its key is pinned under with accept-new
    label: str  # how its errors start
    host: str  # as asyncssh is given it (ssh_config may map it)
    port: int | None
    user: str | None
    real: tuple[str, int]  # HostName and Port after ssh_config, for messages
    jump: bool = False
    keys: tuple[str, ...] = ()  # its IdentityFile lines in ssh_config (tokens expanded, ~ not)
    own_algs: bool = False  # ssh_config sets its HostKeyAlgorithms: never offer others


class _RouteError(ValueError):
    pass


class AsyncsshConnector:
    """Opens verified SSH connections. ``pinned_known_hosts`` backs ``accept-new``.
    ``max_channels``: the commands a session runs at once, for a target that sets none
    (its ``max_channels``, once the inventory has it). ``keepalive_interval_s`` and
    ``keepalive_count_max``: a connection whose peer sends nothing for
    ``(keepalive_count_max + 1) * keepalive_interval_s`` is dropped."""

    def __init__(
        self,
        pinned_known_hosts: Path | None = None,
        *,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
        keepalive_count_max: int = KEEPALIVE_COUNT_MAX,
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be at least 1, not {max_channels}")
        self.pinned = pinned_known_hosts
        self.max_channels = max_channels
        self.keepalive_interval_s = keepalive_interval_s
        self.keepalive_count_max = keepalive_count_max
        self._pin_lock = asyncio.Lock()
        # Parsed known_hosts files by path, re-read when the file changes: asyncssh given a
        # path parses every key in it on every connect, which is quadratic in the fleet size.
        self._parsed: dict[str, tuple[tuple[int, int, int], asyncssh.SSHKnownHosts]] = {}
        self._pins: tuple[tuple[int, int, int], dict[str, list[asyncssh.SSHKey]]] | None = None
        # Jump-host connections (ssh_config ProxyJump), one per route prefix and trust
        # settings, shared by every node behind it until ``aclose``.
        self._hops: dict[tuple[object, ...], asyncio.Future[asyncssh.SSHClientConnection]] = {}
        # ssh-agent, for identity files whose key only it holds: one client for the run.
        self._agent: asyncssh.SSHAgentClient | None = None
        self._agent_held: dict[str, list[Any]] = {}
        self._agent_lock = asyncio.Lock()

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        paths = _config_paths(target)
        route: tuple[_Dest, ...] = ()
        real = (target.host, target.port or 22)
        keys: tuple[str, ...] = ()
        own_algs = False
        if paths:  # ssh_config may run `Match exec` commands: read it off the event loop
            try:
                route, real, keys, own_algs = await _off_loop(_route, paths, target.host, target.port, target.user)
            except _RouteError as e:
                raise SSHError(f"{target.name}: {e}") from None
        via: asyncssh.SSHClientConnection | None = None
        try:
            for i in range(len(route)):
                via = await self._hop(route[: i + 1], via, target, paths)
        except SSHError as e:  # shared by every node behind the hop: name this one
            raise SSHError(f"{target.name}: {e}") from e
        node = _Dest(target.name, f"{target.name}: ", target.host, target.port, target.user, real, keys=keys,
                     own_algs=own_algs)  # fmt: skip
        conn = await self._connect(target, node, paths, via, route[-1].label if route else "")
        try:
            # A node's own limit (a MaxSessions below 10) comes with its target.
            limit = getattr(target, "max_channels", None) or self.max_channels
            yield AsyncsshSession(conn, target.name, host=real[0], max_channels=limit)
        finally:
            conn.close()
            with suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                await asyncio.wait_for(conn.wait_closed(), timeout=1.0)

    async def _agent_keys(self, key: str, pub: str, where: str) -> list[Any]:
        """ssh-agent's key for the identity file ``key`` (``pub``: its public half)."""
        async with self._agent_lock:
            if pub in self._agent_held:
                return self._agent_held[pub]
            sock = os.environ.get("SSH_AUTH_SOCK", "")
            if not sock:
                raise SSHError(
                    f"{where}identity file {key} needs ssh-agent, and none is running (SSH_AUTH_SOCK is unset)"
                )
            try:
                if self._agent is None:
                    self._agent = await asyncssh.connect_agent(sock)
                held = list(await self._agent.get_keys([asyncssh.read_public_key(pub).public_data]))
            except (OSError, ValueError, asyncssh.Error) as e:
                raise SSHError(f"{where}cannot ask ssh-agent ({sock}) for the key of {key}: {e}") from None
            if not held:
                raise SSHError(f"{where}ssh-agent ({sock}) does not hold the key of identity file {key}: ssh-add it")
            self._agent_held[pub] = held
            return held

    async def aclose(self) -> None:
        """Close the shared jump-host connections (waiting at most a second in all), and the
        ssh-agent client."""
        if self._agent is not None:
            self._agent.close()
            self._agent = None
        hops, self._hops = self._hops, {}
        conns = []
        for fut in hops.values():
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled() and fut.exception() is None:
                conns.append(fut.result())
        for c in conns:
            c.close()
        if conns:
            with suppress(TimeoutError, asyncio.TimeoutError, OSError, asyncssh.Error):
                await asyncio.wait_for(asyncio.gather(*(c.wait_closed() for c in conns)), timeout=1.0)

    async def _hop(
        self,
        prefix: tuple[_Dest, ...],
        via: asyncssh.SSHClientConnection | None,
        target: SSHTarget,
        paths: list[str],
    ) -> asyncssh.SSHClientConnection:
        """The shared connection to the last jump host of ``prefix``, opened over ``via``
        (the one to the hop before it) by the first node that needs it. A hop that failed
        fails the nodes behind it at once; one that closed since is opened again."""
        k = (prefix, target.known_hosts, target.identity_file, tuple(paths), target.connect_timeout_s)
        fut = self._hops.get(k)
        if fut is None or fut.cancelled() or (fut.done() and fut.exception() is None and fut.result().is_closed()):
            before = prefix[-2].label if len(prefix) > 1 else ""
            fut = asyncio.ensure_future(self._connect(target, prefix[-1], paths, via, before))
            self._hops[k] = fut
        # Each future depends only on connections already open (``via``), never on another
        # future: shared hops cannot wait on each other. A node that gives up leaves it running.
        return await asyncio.shield(fut)

    async def _connect(
        self,
        target: SSHTarget,
        dest: _Dest,
        paths: list[str],
        via: asyncssh.SSHClientConnection | None,
        via_label: str,
    ) -> asyncssh.SSHClientConnection:
        """One verified connection to ``dest`` (a node, or a jump host), over ``via`` when
        it is behind a jump host. Errors start with ``dest.label``: the node's name, or for a
        jump host (shared by many nodes) the jump host alone."""
        where = dest.label
        files = await self._known_hosts(target, dest, paths, via, via_label)
        file = files[0] if target.known_hosts == ACCEPT_NEW else target.known_hosts  # where a new key goes
        pinned = target.known_hosts == ACCEPT_NEW
        trust = self._trust(dest.alias, where) if pinned else _Lookup.of([self._parse(f) for f in files], files)
        key = target.identity_file
        keys: object = [key] if key else ()
        listed = _existing(dest.keys)  # as OpenSSH, an IdentityFile that does not exist is skipped
        from_config = bool(dest.keys) and (dest.jump or not key)
        # A passphrase-protected identity_file, or its public half: its key is ssh-agent's, and
        # that key alone is offered (as with ``ssh -i``), never the agent's others or ~/.ssh's.
        pub = agent_identity(key) if key and not from_config else None
        held = await self._agent_keys(key, pub, where) if key and pub is not None else None
        if held is not None:
            keys = held
        if from_config:
            # ssh_config's IdentityFile for it (the inventory's identity_file comes first for a
            # node; a jump host's own comes first): the ones that exist; none: SSH's defaults.
            keys = listed
        elif dest.jump:
            # No IdentityFile of its own: the node's key and then SSH's default keys (and ssh-agent).
            keys = [*(held if held is not None else [key]), *_default_keys()] if key else ()
        shown = _shown(target, dest, ", ".join(listed) if from_config else None if keys == () else key)

        def attempt(host_key_algs: object = ()) -> Any:
            return asyncio.wait_for(
                asyncssh.connect(
                    dest.host,
                    # Unset values are left to ssh_config, then to SSH's defaults (``()``).
                    port=dest.port or (),
                    username=dest.user or (),
                    client_keys=keys,
                    agent_path=None if key and not dest.jump else (),
                    ignore_encrypted=True if from_config or (dest.jump and keys != ()) else (),
                    known_hosts=trust,
                    config=paths or (),
                    tunnel=_tunnel(dest, via),
                    # AES-GCM is hardware-accelerated almost everywhere; chacha20 costs ~25% of
                    # discover's client CPU on a large fleet (bench/README.md, Discovery).
                    encryption_algs=_CIPHERS,
                    connect_timeout=target.connect_timeout_s,
                    login_timeout=target.connect_timeout_s,
                    keepalive_interval=self.keepalive_interval_s,
                    keepalive_count_max=self.keepalive_count_max,
                    server_host_key_algs=host_key_algs,
                ),
                timeout=target.connect_timeout_s + 1,
            )

        try:
            try:
                return await attempt()
            except (asyncssh.ConnectionLost, asyncssh.KeyExchangeFailed, ConnectionResetError) as e:
                if not _narrowed(trust) or dest.own_algs:
                    raise
                # asyncssh offers only the host key types it trusts for this host. A node whose
                # key type changed (reinstalled) then has none of them and drops the handshake:
                # ask once more, the trusted types first and then any other, so that a node that
                # still has a trusted type (the drop was the network's) uses it, and one that
                # has none has its new key refused by name (as OpenSSH does).
                try:
                    return await attempt(_trusted_first(trust))
                except asyncssh.HostKeyNotVerifiable:
                    raise
                except (asyncssh.Error, OSError, TimeoutError):
                    raise e from None
        except TimeoutError:
            raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
        except asyncssh.HostKeyNotVerifiable as e:
            raise SSHError(f"{where}{_host_key_error(e, trust, file, dest)}") from e
        except (asyncssh.Error, OSError, ValueError) as e:
            why = _connect_error(e, shown, via_label, dest)
            if from_config and len(listed) < len(dest.keys) and isinstance(e, asyncssh.PermissionDenied):
                gone = ", ".join(k for k in dest.keys if k not in listed)
                why += f" (ssh_config IdentityFile not found: {gone})"
            if from_config and isinstance(e, asyncssh.PermissionDenied) and (locked := _locked(listed)):
                why += f" (ssh_config IdentityFile {', '.join(locked)}: passphrase-protected, used only from ssh-agent)"
            raise SSHError(f"{where}{why}") from e

    def _trust(self, alias: str, where: str) -> tuple[list[asyncssh.SSHKey], list[object], list[object]]:
        """The keys pinned for exactly ``alias``, as asyncssh's explicit trust lists. Not the
        pin file itself: asyncssh also matches a file's entries against the peer's address,
        and a node named like another node's address would lend its pinned key to it."""
        return (list(self._pinned(where).get(alias, [])), [], [])

    def _pinned(self, where: str) -> dict[str, list[asyncssh.SSHKey]]:
        """The pin file by name, parsed once per change of the file, not per node."""
        assert self.pinned is not None
        try:
            fd = os.open(self.pinned, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise SSHError(f"{where}cannot read the pin file {self.pinned}: {_pin_file_error(e)}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if (why := _untrusted(st)) is not None:
                raise SSHError(f"{where}the pin file {self.pinned} {why}: its keys are not trusted")
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if self._pins is None or self._pins[0] != stamp:
                self._pins = (stamp, _pin_table(f.read().decode(errors="replace")))
        return self._pins[1]

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
        dest: _Dest,
        paths: list[str],
        via: asyncssh.SSHClientConnection | None,
        via_label: str,
    ) -> list[str]:
        """The known_hosts files to verify ``dest`` with (the inventory's, and while that is
        left unset the system's too, as OpenSSH reads them); with accept-new, the pin file,
        where its key is pinned under ``dest.alias`` on first contact (reached over ``via``
        when behind a jump host)."""
        where = dest.label
        if target.known_hosts != ACCEPT_NEW:
            files = [target.known_hosts] if os.path.exists(target.known_hosts) else []
            system = target.system_known_hosts
            # The system's file is read as OpenSSH reads it: one it cannot use is left out.
            if system and os.path.exists(system) and isinstance(self._parse(system), asyncssh.SSHKnownHosts):
                files.append(system)
            if not files:
                raise SSHError(f"{where}known_hosts file not found: {target.known_hosts}")
            return files
        if self.pinned is None:
            raise SSHError(f"{where}known_hosts is accept-new but no pinned file is configured")
        async with self._pin_lock:
            if not self.pinned.exists():  # a read-only pin file that knows every node is fine
                try:
                    self.pinned.parent.mkdir(parents=True, exist_ok=True)
                    os.close(os.open(self.pinned, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
                except OSError as e:
                    raise SSHError(f"{where}cannot create the pin file {self.pinned}: {_pin_file_error(e)}") from None
            if dest.alias in self._pinned(where):
                return [str(self.pinned)]
        # First contact: learn the key, pin it, then connect verifying against the pin.
        try:
            key = await asyncio.wait_for(
                asyncssh.get_server_host_key(
                    dest.host,
                    dest.port or (),
                    tunnel=_tunnel(dest, via),
                    config=paths or (),
                ),
                timeout=target.connect_timeout_s + 1,
            )
        except TimeoutError:
            raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
        except (asyncssh.Error, OSError, ValueError) as e:  # ValueError: a peer not speaking SSH
            raise SSHError(f"{where}{_connect_error(e, _shown(target, dest), via_label, dest)}") from e
        if key is None:
            raise SSHError(f"{where}server offered no host key")
        async with self._pin_lock:
            # Another clusterctl may be pinning the same node right now: under an exclusive file
            # lock, pin only if nobody did, so a name never gets two keys (either would pass).
            try:
                fd = os.open(self.pinned, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise SSHError(f"{where}cannot pin its host key in {self.pinned}: {_pin_file_error(e)}") from None
            try:
                with os.fdopen(fd, "a+") as f:
                    if (why := _untrusted(os.fstat(f.fileno()))) is not None:
                        raise SSHError(f"{where}the pin file {self.pinned} {why}: not writing to it")
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.seek(0)
                    text = f.read()
                    if not any(dest.alias in names for names, _ in _pin_lines(text)):
                        sep = "\n" if text and not text.endswith("\n") else ""  # a file edited by hand
                        f.write(f"{sep}{dest.alias} {key.export_public_key('openssh').decode().strip()}\n")
            except OSError as e:
                raise SSHError(f"{where}cannot pin its host key in {self.pinned}: {e.strerror or e}") from None
        return [str(self.pinned)]


def _untrusted(st: os.stat_result) -> str | None:
    """Why a pin file must not be trusted: someone else could have put keys in it (it lives
    beside the state, which may be in a shared folder)."""
    if st.st_uid != os.geteuid():
        return "belongs to another user"
    if st.st_mode & 0o002:
        return "is writable by every user"
    return None


def _pin_file_error(e: OSError) -> str:
    if e.errno == errno.ELOOP:  # O_NOFOLLOW: a link planted there could point at any file of ours
        return "it is a symbolic link (not followed: give the state's real folder)"
    return e.strerror or str(e)


class _Lookup(asyncssh.SSHKnownHosts):
    """A parsed known_hosts file, matched as asyncssh matches it (host name and address; on
    a port other than 22, ``[host]:port`` first, then, unlike OpenSSH, the plain host), that
    notes what it was asked and whether it had a key: a refused key is then told apart as
    unknown, changed or revoked."""

    def __init__(self, parsed: list[asyncssh.SSHKnownHosts], files: list[str]) -> None:
        super().__init__()
        self._inner = list(zip(files, parsed, strict=True))
        self.files = files
        self.asked: tuple[str, str, int | None] | None = None
        self.found = False
        self.holders: list[str] = []  # the files with keys for what was asked
        self.keys: list[Any] = []  # the host keys and CA keys trusted for it
        self.cas: list[Any] = []

    @classmethod
    def of(cls, parsed: list[asyncssh.SSHKnownHosts | str], files: list[str]) -> object:
        """asyncssh's ``known_hosts`` for ``files`` (the path of one that could not be parsed
        here: asyncssh reads it, and reports on it, itself)."""
        bad = next((p for p in parsed if not isinstance(p, asyncssh.SSHKnownHosts)), None)
        return bad if bad is not None else cls(parsed, files)  # type: ignore[arg-type]

    def match(self, host: str, addr: str, port: int | None) -> Any:
        found: list[list[Any]] | None = None
        self.holders = []
        for file, parsed in self._inner:  # each file as asyncssh matches one: its lists joined
            got = parsed.match(host, addr, port)
            found = [list(x) for x in got] if found is None else [a + list(b) for a, b in zip(found, got, strict=True)]
            if got[0] or got[1]:
                self.holders.append(file)
        assert found is not None
        self.keys, self.cas = found[0], found[1]
        self.asked = (host, addr, port)
        self.found = bool(found[0] or found[1])  # host keys, or CA keys for certificates
        return tuple(found)


def _pin_lines(text: str) -> Iterator[tuple[list[str], str]]:
    """(names, key text) of each pin: clusterctl writes plain ``NAME KEY`` lines."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "@")):
            names, _, key = line.partition(" ")
            yield names.split(","), key.strip()


def _pin_table(text: str) -> dict[str, list[asyncssh.SSHKey]]:
    """The pinned keys by exact name; a name whose key cannot be read has none (and is refused)."""
    table: dict[str, list[asyncssh.SSHKey]] = {}
    for names, text_key in _pin_lines(text):
        try:
            key: asyncssh.SSHKey | None = asyncssh.import_public_key(text_key)
        except (asyncssh.KeyImportError, ValueError):
            key = None
        for name in names:
            table.setdefault(name, []).extend([key] if key else [])
    return table


def _host_key_error(e: asyncssh.HostKeyNotVerifiable, trust: object, file: str, dest: _Dest) -> str:
    """A refused host key, unknown or changed, with where its key is kept and what to do."""
    what = "jump host" if dest.jump else "node"
    addr = _host_port(*dest.real)
    if isinstance(trust, tuple):  # the keys pinned for it (accept-new), as ``_trust`` gives them
        if trust[0]:
            return (
                f"host key not verifiable: changed since it was pinned in {file} ({addr}); "
                f"if the {what} was reinstalled, delete its line there ({dest.alias} ...) and run again"
            )
        pin = f"no usable key pinned for {dest.alias} in {file}"
        return f"host key not verifiable: {pin}; delete its line there and run again"
    if isinstance(trust, _Lookup) and trust.asked is not None:
        host, peer, port = trust.asked
        name = host if port in (None, 22) else f"[{host}]:{port}"
        seen = f" ({peer})" if peer and peer != host else ""
        files = " and ".join(trust.files)
        if str(e.reason).startswith(("Host key is revoked", "Host CA key is revoked")):
            return (
                f"host key not verifiable in {files}: the {what} offered a key marked @revoked there for "
                f"{name}{seen} ({e.reason}); do not trust it again until you know why it was revoked"
            )
        if trust.found:
            holder = trust.holders[0] if trust.holders else file
            return (
                f"host key not verifiable in {holder}: it does not match the key there for {name}{seen}; "
                f"if the {what} was reinstalled, remove that key (ssh-keygen -R '{name}' -f {holder}) and run again"
            )
        return (
            f"host key not verifiable in {files}: no key for {name}{seen} there; "
            f"add it (ssh-keyscan -p {dest.real[1]} {dest.real[0]} >> {file}) or use known_hosts: accept-new"
        )
    return f"host key not verifiable in {file}: {e.reason}"


def _trusted_first(trust: object) -> list[str]:
    """Host key algorithms: those of the keys trusted for the host (certificates first when
    a CA is), then every other one asyncssh offers by default, in its order."""
    from asyncssh.public_key import get_default_certificate_algs, get_default_public_key_algs

    keys, cas = (trust[0], trust[1]) if isinstance(trust, tuple) else (trust.keys, trust.cas)  # type: ignore[attr-defined]
    first: list[bytes] = list(get_default_certificate_algs()) if cas else []
    for k in keys:
        first += [a for a in k.sig_algorithms if a not in first]
    rest = [a for a in (*get_default_certificate_algs(), *get_default_public_key_algs()) if a not in first]
    return [a.decode() for a in (*first, *rest)]


def _narrowed(trust: object) -> bool:
    """Whether asyncssh offered the node only the host key types of the keys it trusts for it
    (a pinned key, or known_hosts keys or CA keys that matched it)."""
    if isinstance(trust, tuple):  # pinned keys, as ``_trust`` gives them
        return bool(trust[0])
    return isinstance(trust, _Lookup) and trust.found


def _tunnel(dest: _Dest, via: asyncssh.SSHClientConnection | None) -> object:
    """asyncssh's ``tunnel`` for ``dest``: the hop before it, or for a jump host that is
    the first hop, none at all (its route was read from ssh_config already: never follow
    ProxyJump again); a node without a route leaves it to ssh_config (``()``). Each node
    behind a hop is a forwarded channel on the hop's connection, for as long as the node's
    connection lasts: not held to ``max_channels`` (MaxSessions does not count it)."""
    if via is not None:
        return via
    return None if dest.jump else ()


def _shown(target: SSHTarget, dest: _Dest, identity_file: str | None = None) -> SSHTarget:
    """``target`` as its error messages should name it: ``dest``'s real address and key."""
    return target.model_copy(update={"host": dest.real[0], "port": dest.real[1], "identity_file": identity_file})


def _connect_error(e: BaseException, shown: SSHTarget, via_label: str, dest: _Dest) -> str:
    """A failed connect: a jump host that could not open the way is named as such."""
    if via_label and isinstance(e, asyncssh.ChannelOpenError):
        return f"{via_label.rstrip(': ')} cannot reach {_host_port(*dest.real)}: {e.reason}"
    if isinstance(e, (asyncssh.ConnectionLost, ConnectionResetError)):
        # Before the login ends: something that is not an SSH server (a proxy, a web server
        # on the port), or an sshd turning this client away (MaxStartups, tcp wrappers).
        return (
            f"the other end closed the connection during the SSH handshake ({_host_port(*dest.real)}): "
            "is an SSH server listening there, and does it accept connections from this machine?"
        )
    return ssh_error_message(e, shown)


_DEFAULT_KEYS = ("id_ed25519_sk", "id_ecdsa_sk", "id_ed448", "id_ed25519", "id_ecdsa", "id_rsa", "id_dsa")


@functools.lru_cache(maxsize=256)
def _key_state(key: str) -> str:
    """``usable`` (a private key), ``locked`` (passphrase-protected: only ssh-agent can sign
    with it), or ``other`` (no private key, or unreadable)."""
    try:
        asyncssh.read_private_key(key)
        return "usable"
    except asyncssh.KeyImportError as e:
        return "locked" if "passphrase" in str(e).lower() else "other"
    except (OSError, ValueError):
        return "other"


def _locked(keys: list[str]) -> list[str]:
    """The passphrase-protected ones of ``keys`` (asyncssh skips them: only an agent can sign)."""
    return [k for k in keys if _key_state(k) == "locked"]


@functools.lru_cache(maxsize=256)
def agent_identity(key: str) -> str | None:
    """The public key that picks ``key`` out of ssh-agent's keys, when ``key`` is one to be
    used through the agent: a passphrase-protected private key (its ``.pub`` beside it) or a
    public key file. None for a private key usable as it is, or a file that is neither."""
    state = _key_state(key)
    if state == "usable":
        return None
    for pub in ([key + ".pub"] if state == "locked" else []) + [key]:
        try:
            asyncssh.read_public_key(pub)
        except (asyncssh.KeyImportError, OSError, ValueError):
            continue
        return pub
    return None


def _default_keys() -> list[str]:
    """SSH's default identity files that exist (what asyncssh and OpenSSH try by default)."""
    home = os.path.expanduser(os.path.join("~", ".ssh"))
    return [p for p in (os.path.join(home, n) for n in _DEFAULT_KEYS) if os.path.isfile(p)]


def _config_paths(target: SSHTarget) -> list[str]:
    """The ssh_config files asyncssh reads for ``target``: the inventory's, else ~/.ssh/config."""
    if target.ssh_config:
        return [target.ssh_config]
    default = os.path.expanduser(os.path.join("~", ".ssh", "config"))
    return [default] if os.access(default, os.R_OK) else []


def _host_config(paths: list[str], host: str, port: int | None, user: str | None) -> object | None:
    """ssh_config as it applies to ``host``; None when it cannot be read here (asyncssh then
    reads, and reports, it itself at connect time). Blocking: ``Match exec`` runs commands."""
    try:
        from asyncssh.config import SSHClientConfig

        try:
            local = getpass.getuser()
        except (KeyError, OSError):
            local = ""
        cfg = SSHClientConfig.load(None, paths, False, False, False, local, user or (), host, port or ())
        if cfg.has_match_final():  # a second pass with `Match final` blocks, as asyncssh makes
            cfg = SSHClientConfig.load(cfg, paths, True, False, True, local, user or (), host, port or ())
        return cfg
    except Exception:  # any failure here is asyncssh's to report, per node, at connect time
        return None


def _route(
    paths: list[str], host: str, port: int | None, user: str | None
) -> tuple[tuple[_Dest, ...], tuple[str, int], tuple[str, ...], bool]:
    """The jump hosts on the way to ``host`` (ssh_config ``ProxyJump``; a first hop's own
    ProxyJump comes before it, as with OpenSSH), ``host``'s own HostName and Port, its
    IdentityFile lines, and whether ssh_config sets its HostKeyAlgorithms. Raises
    _RouteError for a hop it cannot read, or a loop."""
    cfg = _host_config(paths, host, port, user)
    real = _real(cfg, host, port)
    spec = _proxy_jump(cfg)
    hops = _hops(paths, spec, frozenset({host})) if spec else ()
    return hops, real, _identity_files(cfg), _own_algs(cfg)


def _own_algs(cfg: object | None) -> bool:
    return cfg is not None and bool(cfg.get("HostKeyAlgorithms"))  # type: ignore[attr-defined]


def _identity_files(cfg: object | None) -> tuple[str, ...]:
    files = cfg.get("IdentityFile") if cfg is not None else None  # type: ignore[attr-defined]
    return tuple(str(f) for f in files) if isinstance(files, (list, tuple)) else ()


def _existing(keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if os.path.isfile(os.path.expanduser(k))]


async def _off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a daemon thread: reading ssh_config may run a ``Match exec`` command
    that hangs, and a thread of the loop's default executor would hold up the command's exit
    (``asyncio.run`` waits for it) long after the node's deadline, or a Ctrl-C."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[_T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def work() -> None:
        try:
            result: Any = fn(*args)
            ok = True
        except BaseException as e:  # handed to the awaiting task
            result, ok = e, False
        with suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=work, name="clusterctl-ssh-config", daemon=True).start()
    return await fut


def _hops(paths: list[str], spec: str, seen: frozenset[str]) -> tuple[_Dest, ...]:
    out: list[_Dest] = []
    for i, text in enumerate(spec.split(",")):
        try:
            user, host, port = _parse_hop(text)
        except ValueError:
            raise _RouteError(f"ProxyJump: cannot read the hop {text.strip()!r}") from None
        cfg = _host_config(paths, host, port, user)
        if i == 0:  # only a first hop's own ProxyJump is followed (as OpenSSH does)
            if host in seen:
                raise _RouteError(f"ProxyJump loops through {host} (ssh_config: ProxyJump {spec})")
            own = _proxy_jump(cfg)
            if own:
                out.extend(_hops(paths, own, seen | {host}))
        name = host if port is None else _host_port(host, port)
        real = _real(cfg, host, port)
        # Pinned by the name written in ProxyJump and the port it resolves to (b and b:2222 differ).
        alias = f"jump:{host}" if real[1] == 22 else f"jump:[{host}]:{real[1]}"
        out.append(
            _Dest(alias, f"jump host {name}: ", host, port, user, real, True, _identity_files(cfg), _own_algs(cfg))
        )
    return tuple(out)


def _real(cfg: object | None, host: str, port: int | None) -> tuple[str, int]:
    if cfg is None:
        return host, port or 22
    real_port = port or cfg.get("Port") or 22  # type: ignore[attr-defined]
    return str(cfg.get("Hostname") or host), int(real_port)  # type: ignore[attr-defined]


def _proxy_jump(cfg: object | None) -> str | None:
    spec = cfg.get("ProxyJump") if cfg is not None else None  # type: ignore[attr-defined]
    return spec.strip() if isinstance(spec, str) and spec.strip() else None


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:2223``, not ``::1:2223``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_hop(hop: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` of a ProxyJump hop, where an IPv6 host is ``[addr]`` (with or
    without a port) or a bare address (without one), as OpenSSH reads it."""
    user, _, host = hop.strip().rpartition("@")
    port_s = ""
    if host.startswith("["):
        host, sep, rest = host[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(hop)
        port_s = rest[1:] if rest else ""
        if rest and not port_s:
            raise ValueError(hop)
    elif host.count(":") == 1:
        host, _, port_s = host.partition(":")
    port: int | None = None
    if port_s:
        port = int(port_s)
        if not 0 < port < 65536:
            raise ValueError(hop)
    if not host:
        raise ValueError(hop)
    return user or None, host, port


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
        named = f" {target.identity_file}" if target and target.identity_file else ""
        return f"cannot load identity file{named}: {e}"
    where = f" ({_host_port(target.host, target.port or 22)})" if target else ""
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
