"""Verified SSH connections to nodes, one per node, dropped within seconds of going silent.

Each node's connection goes where ssh_config sends it (``route``), through shared jump-host
connections: nodes behind a jump host share one connection to each hop, verified like a
node. Keepalives notice a peer that stopped answering within seconds. The session handed out
runs commands at most ``max_channels`` at once (``channels``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.ssh.channels import DEFAULT_MAX_CHANNELS, AsyncsshSession
from cluster_cli.ssh.identity import agent_identity, default_keys, existing, locked
from cluster_cli.ssh.libsearch import import_asyncssh
from cluster_cli.ssh.messages import host_port, ssh_error_message
from cluster_cli.ssh.route import Dest, Resolver, RouteError
from cluster_cli.ssh.session import Session
from cluster_cli.ssh.trust import HostKeys, Lookup, host_key_error, narrowed, trusted_first

asyncssh = import_asyncssh()  # asyncssh's liboqs lookup would otherwise run ldconfig, gcc and ld

# A keepalive after each interval without a byte from the peer; the connection is dropped
# after COUNT_MAX + 1 intervals of silence (~9 s): a dead node's commands fail then, and a
# long-lived Sessions opens a new connection, instead of waiting for TCP to give up.
KEEPALIVE_INTERVAL_S = 3.0
KEEPALIVE_COUNT_MAX = 2

_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr")


class AsyncsshConnector:
    """Opens verified SSH connections, where ssh_config sends them. ``pinned_known_hosts``
    backs ``accept-new``.
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
        self.max_channels = max_channels
        self.keepalive_interval_s = keepalive_interval_s
        self.keepalive_count_max = keepalive_count_max
        self.host_keys = HostKeys(pinned_known_hosts)
        self.routes = Resolver()  # ssh_config, read once per host for the connector's life
        # Jump-host connections (ssh_config ProxyJump), one per route prefix and trust
        # settings, shared by every node behind it until ``aclose``.
        self._hops: dict[tuple[object, ...], asyncio.Future[asyncssh.SSHClientConnection]] = {}
        # ssh-agent, for identity files whose key only it holds: one client for the run.
        self._agent: asyncssh.SSHAgentClient | None = None
        self._agent_held: dict[str, list[Any]] = {}
        self._agent_lock = asyncio.Lock()

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        """A session on ``target``, over one connection for as long as the context lasts.
        Raises SSHError, naming the node (and the jump host, when one failed)."""
        try:
            route = await self.routes.route(target)
        except RouteError as e:
            raise SSHError(f"{target.name}: {e}") from None
        via: asyncssh.SSHClientConnection | None = None
        try:
            for i in range(len(route.hops)):
                via = await self._hop(route.hops[: i + 1], via, target)
        except SSHError as e:  # shared by every node behind the hop: name this one
            raise SSHError(f"{target.name}: {e}") from e
        node = route.node
        conn = await self._connect(target, node, via, route.hops[-1].label if route.hops else "")
        try:
            # A node's own limit (a MaxSessions below 10) comes with its target.
            limit = getattr(target, "max_channels", None) or self.max_channels
            yield AsyncsshSession(conn, target.name, host=node.host, max_channels=limit)
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
        prefix: tuple[Dest, ...],
        via: asyncssh.SSHClientConnection | None,
        target: SSHTarget,
    ) -> asyncssh.SSHClientConnection:
        """The shared connection to the last jump host of ``prefix``, opened over ``via``
        (the one to the hop before it) by the first node that needs it. A hop that failed
        fails the nodes behind it at once; one that closed since is opened again."""
        k = (prefix, target.known_hosts, target.identity_file, target.connect_timeout_s)
        fut = self._hops.get(k)
        if fut is None or fut.cancelled() or (fut.done() and fut.exception() is None and fut.result().is_closed()):
            before = prefix[-2].label if len(prefix) > 1 else ""
            fut = asyncio.ensure_future(self._connect(target, prefix[-1], via, before))
            self._hops[k] = fut
        # Each future depends only on connections already open (``via``), never on another
        # future: shared hops cannot wait on each other. A node that gives up leaves it running.
        return await asyncio.shield(fut)

    async def _connect(
        self,
        target: SSHTarget,
        dest: Dest,
        via: asyncssh.SSHClientConnection | None,
        via_label: str,
    ) -> asyncssh.SSHClientConnection:
        """One verified connection to ``dest`` (a node, or a jump host), over ``via`` when
        it is behind a jump host. Errors start with ``dest.label``: the node's name, or for a
        jump host (shared by many nodes) the jump host alone."""
        where = dest.label

        async def fetch_key() -> Any:  # accept-new's first contact: the key to pin
            try:
                return await asyncio.wait_for(
                    asyncssh.get_server_host_key(
                        dest.host, dest.port, tunnel=via, proxy_command=_proxy(dest, via), config=None
                    ),
                    timeout=target.connect_timeout_s + 1,
                )
            except TimeoutError:
                raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
            except (asyncssh.Error, OSError, ValueError) as e:  # ValueError: a peer not speaking SSH
                raise SSHError(f"{where}{_connect_error(e, _shown(target, dest), via_label, dest)}") from e

        files = await self.host_keys.files(target, dest, fetch_key)
        file = files[0] if target.known_hosts == ACCEPT_NEW else target.known_hosts  # where a new key goes
        pinned = target.known_hosts == ACCEPT_NEW
        hk = self.host_keys
        trust = hk.trust(dest.alias, where) if pinned else Lookup.of([hk.parse(f) for f in files], files)
        key = target.identity_file
        keys: object = [key] if key else ()
        listed = existing(dest.keys)  # as OpenSSH, an IdentityFile that does not exist is skipped
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
            keys = [*(held if held is not None else [key]), *default_keys()] if key else ()
        shown = _shown(target, dest, ", ".join(listed) if from_config else None if keys == () else key)

        def attempt(host_key_algs: object = ()) -> Any:
            return asyncio.wait_for(
                asyncssh.connect(
                    dest.host,
                    port=dest.port,
                    username=dest.user,
                    client_keys=keys,
                    agent_path=None if key and not dest.jump else (),
                    ignore_encrypted=True if from_config or (dest.jump and keys != ()) else (),
                    known_hosts=trust,
                    # ssh_config was resolved already (``route``): asyncssh must not read it again.
                    config=None,
                    tunnel=via,
                    proxy_command=_proxy(dest, via),
                    # AES-GCM is hardware-accelerated almost everywhere; chacha20 costs ~25% of
                    # discover's client CPU on a large fleet (bench/README.md, Discovery).
                    encryption_algs=_CIPHERS,
                    connect_timeout=target.connect_timeout_s,
                    login_timeout=target.connect_timeout_s,
                    keepalive_interval=self.keepalive_interval_s,
                    keepalive_count_max=self.keepalive_count_max,
                    server_host_key_algs=host_key_algs or _own_algs(dest),
                ),
                timeout=target.connect_timeout_s + 1,
            )

        try:
            try:
                return await attempt()
            except (asyncssh.ConnectionLost, asyncssh.KeyExchangeFailed, ConnectionResetError) as e:
                if not narrowed(trust) or dest.host_key_algs:
                    raise
                # asyncssh offers only the host key types it trusts for this host. A node whose
                # key type changed (reinstalled) then has none of them and drops the handshake:
                # ask once more, the trusted types first and then any other, so that a node that
                # still has a trusted type (the drop was the network's) uses it, and one that
                # has none has its new key refused by name (as OpenSSH does).
                try:
                    return await attempt(trusted_first(trust))
                except asyncssh.HostKeyNotVerifiable:
                    raise
                except (asyncssh.Error, OSError, TimeoutError):
                    raise e from None
        except TimeoutError:
            raise SSHError(f"{where}connect timed out after {target.connect_timeout_s:g}s") from None
        except asyncssh.HostKeyNotVerifiable as e:
            raise SSHError(f"{where}{host_key_error(e, trust, file, dest)}") from e
        except (asyncssh.Error, OSError, ValueError) as e:
            why = _connect_error(e, shown, via_label, dest)
            if from_config and len(listed) < len(dest.keys) and isinstance(e, asyncssh.PermissionDenied):
                gone = ", ".join(k for k in dest.keys if k not in listed)
                why += f" (ssh_config IdentityFile not found: {gone})"
            if from_config and isinstance(e, asyncssh.PermissionDenied) and (held_back := locked(listed)):
                why += (
                    f" (ssh_config IdentityFile {', '.join(held_back)}: passphrase-protected, used only from ssh-agent)"
                )
            raise SSHError(f"{where}{why}") from e


def _proxy(dest: Dest, via: asyncssh.SSHClientConnection | None) -> object:
    """asyncssh's ``proxy_command`` for ``dest``: ssh_config's ProxyCommand when no jump host
    carries it (OpenSSH uses the first of ProxyJump and ProxyCommand it reads), else none."""
    return dest.proxy_command if dest.proxy_command and via is None else None


def _own_algs(dest: Dest) -> object:
    """The HostKeyAlgorithms ssh_config sets for ``dest``, those asyncssh knows (OpenSSH's
    list may name ones it lacks, such as security keys'); ``()``: asyncssh's defaults."""
    if not dest.host_key_algs:
        return ()
    known = {a.decode() for a in asyncssh.public_key.get_public_key_algs()}
    known |= {a.decode() for a in asyncssh.public_key.get_certificate_algs()}
    return [a for a in dest.host_key_algs if a in known] or ()


def _shown(target: SSHTarget, dest: Dest, identity_file: str | None = None) -> SSHTarget:
    """``target`` as its error messages should name it: ``dest``'s real address and key."""
    return target.model_copy(update={"host": dest.real[0], "port": dest.real[1], "identity_file": identity_file})


def _connect_error(e: BaseException, shown: SSHTarget, via_label: str, dest: Dest) -> str:
    """A failed connect: a jump host that could not open the way is named as such."""
    if via_label and isinstance(e, asyncssh.ChannelOpenError):
        return f"{via_label.rstrip(': ')} cannot reach {host_port(*dest.real)}: {e.reason}"
    if isinstance(e, (asyncssh.ConnectionLost, ConnectionResetError)):
        # Before the login ends: something that is not an SSH server (a proxy, a web server
        # on the port), or an sshd turning this client away (MaxStartups, tcp wrappers).
        return (
            f"the other end closed the connection during the SSH handshake ({host_port(*dest.real)}): "
            "is an SSH server listening there, and does it accept connections from this machine?"
        )
    return ssh_error_message(e, shown)
