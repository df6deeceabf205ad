"""Where a node's connection goes, as OpenSSH's own ssh_config resolution (``ssh -G``) says.

``ssh -G [-F FILE] [-p PORT] [-l USER] HOST`` prints the options ssh would use for HOST after
every ``Include``, ``Match`` (host, originalhost, user, localuser, exec, final, ...) and
``Host`` block: exactly what ``ssh HOST`` would do, with none of it re-implemented here. Each
``ProxyJump`` hop is resolved the same way; a first hop's own ProxyJump comes before it, as
OpenSSH reaches a later hop through the one before it. The connector is then given the
resolved values and reads no ssh_config itself, so a node is never resolved twice.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import re
import shutil
import signal
import socket
from contextlib import suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

from cluster_cli.config.inventory import SSHTarget
from cluster_cli.ssh.messages import host_port

# `ssh -G` runs at once at most this many times: a fleet's first connects must not fork
# hundreds of processes together (each is ~5 ms of CPU).
_CONCURRENT_LOOKUPS = 8
# A lookup that takes longer is given up on: ssh_config's `Match exec` may run a command that hangs.
LOOKUP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Dest:
    """Where one connection goes, a node or a jump host, as ssh_config resolves it."""

    alias: str  # the name its key is pinned under with accept-new
    label: str  # how its errors start
    host: str  # HostName after ssh_config: the address connected to
    port: int
    user: str
    jump: bool = False
    keys: tuple[str, ...] = ()  # the IdentityFile lines ssh_config sets for it (tokens and ~ expanded)
    host_key_algs: tuple[str, ...] = ()  # its HostKeyAlgorithms when ssh_config sets them
    proxy_command: str | None = None  # its ProxyCommand (tokens expanded), when it has no ProxyJump

    @property
    def real(self) -> tuple[str, int]:
        return self.host, self.port


@dataclass(frozen=True)
class Route:
    """A node's connection: the jump hosts on the way, in order, then the node itself."""

    hops: tuple[Dest, ...]
    node: Dest


class RouteError(ValueError):
    """ssh_config cannot be read for a host, or its ProxyJump chain loops."""


@dataclass(frozen=True)
class Resolved:
    """What ``ssh -G`` says of one host. Options left at OpenSSH's defaults are empty."""

    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()
    host_key_algs: tuple[str, ...] = ()
    proxy_jump: str | None = None
    proxy_command: str | None = None


def config_file(target: SSHTarget) -> str:
    """The ssh_config given to ``ssh -F``: the inventory's, else ``~/.ssh/config`` when it
    can be read, else none at all (``/dev/null``)."""
    return target.ssh_config or user_config() or os.devnull


def user_config() -> str | None:
    """``~/.ssh/config`` when it can be read: what ``ssh`` reads without ``-F``."""
    path = os.path.expanduser(os.path.join("~", ".ssh", "config"))
    return path if os.access(path, os.R_OK) else None


def ssh_binary() -> str | None:
    """OpenSSH's client, where ssh_config is resolved."""
    return shutil.which("ssh")


class Resolver:
    """ssh_config lookups for one command, each ``(file, host, port, user)`` asked of
    ``ssh -G`` once and kept: jump hosts shared by many nodes are read once."""

    def __init__(self, ssh: str | None = None) -> None:
        self._ssh = ssh
        self._cache: dict[tuple[object, ...], asyncio.Future[Resolved]] = {}
        self._slots: asyncio.Semaphore | None = None

    async def route(self, target: SSHTarget) -> Route:
        """``target``'s route. Raises RouteError (a line that names what is wrong)."""
        cfg = config_file(target)
        r = await self.resolve(cfg, target.host, target.port, target.user)
        hops = await self._hops(cfg, r.proxy_jump, frozenset({target.host})) if r.proxy_jump else ()
        node = Dest(
            target.name, f"{target.name}: ", r.hostname, r.port, r.user,
            keys=r.identity_files, host_key_algs=r.host_key_algs, proxy_command=r.proxy_command,
        )  # fmt: skip
        return Route(hops, node)

    async def resolve(self, cfg: str, host: str, port: int | None, user: str | None) -> Resolved:
        """``host`` as ``ssh -G -F cfg`` resolves it; the
        inventory's ``port`` and ``user``, when set, win over ssh_config as on ssh's command line."""
        key = (cfg, host, port, user)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = self._cache[key] = asyncio.ensure_future(self._lookup(cfg, host, port, user))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(fut)

    async def _hops(self, cfg: str, spec: str, seen: frozenset[str]) -> tuple[Dest, ...]:
        out: list[Dest] = []
        for i, text in enumerate(spec.split(",")):
            user, host, port = split_hop(text)
            if i == 0 and host in seen:
                raise RouteError(f"ProxyJump loops through {host} (ssh_config: ProxyJump {spec})")
            r = await self.resolve(cfg, host, port, user)
            if i == 0 and r.proxy_jump:  # only a first hop's own ProxyJump is followed (as OpenSSH does)
                out.extend(await self._hops(cfg, r.proxy_jump, seen | {host}))
            name = host if port is None else host_port(host, port)
            # Pinned by the name written in ProxyJump and the port it resolves to (b and b:2222 differ).
            alias = f"jump:{host}" if r.port == 22 else f"jump:[{host}]:{r.port}"
            out.append(
                Dest(alias, f"jump host {name}: ", r.hostname, r.port, r.user, jump=True,
                     keys=r.identity_files, host_key_algs=r.host_key_algs, proxy_command=r.proxy_command)
            )  # fmt: skip
        return tuple(out)

    async def _lookup(self, cfg: str, host: str, port: int | None, user: str | None) -> Resolved:
        if cfg == os.devnull:  # no ssh_config: SSH's defaults, no need to ask ssh
            return Resolved(host, port or 22, user or _local_user())
        ssh = self._ssh or ssh_binary()
        if ssh is None:
            raise RouteError(f"reading ssh_config {cfg} needs OpenSSH's ssh client (ssh -G): install openssh-client")
        if self._slots is None:
            self._slots = asyncio.Semaphore(_CONCURRENT_LOOKUPS)
        async with self._slots:
            got = await ssh_g(ssh, cfg, host, port, user)
            defaults = await self._defaults(ssh)
        return _resolved(got, defaults, host)

    async def _defaults(self, ssh: str) -> dict[str, list[str]]:
        """OpenSSH's own defaults (no ssh_config at all): an option ``ssh -G`` prints as
        these was left unset, and is left to asyncssh's defaults (its keys, its algorithms)."""
        key = ("defaults", ssh)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = self._cache[key] = asyncio.ensure_future(ssh_g(ssh, os.devnull, "clusterctl.invalid", None, None))  # type: ignore[assignment]
        return await asyncio.shield(fut)  # type: ignore[return-value]


async def ssh_g(ssh: str, cfg: str, host: str, port: int | None, user: str | None) -> dict[str, list[str]]:
    """``ssh -G``'s answer for ``host``: each option (lower case) with its values, in order.
    Runs off the event loop; a lookup cancelled or timed out kills ssh (and a hung ``Match
    exec`` with it). Raises RouteError with ssh's own complaint (a bad line, an Include loop)."""
    argv = [ssh, "-G", "-T", "-F", cfg]
    if port is not None:
        argv += ["-p", str(port)]
    if user is not None:
        argv += ["-l", user]
    argv += ["--", host]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
    except OSError as e:
        raise RouteError(f"cannot run {ssh} -G to read ssh_config: {e.strerror or e}") from None
    try:
        async with asyncio.timeout(LOOKUP_TIMEOUT_S):
            out, err = await proc.communicate()
    except BaseException as e:
        _kill(proc)
        await proc.wait()
        if isinstance(e, TimeoutError):
            raise RouteError(
                f"ssh -G {host} gave no answer within {LOOKUP_TIMEOUT_S:g}s (a Match exec that hangs?)"
            ) from None
        raise
    if proc.returncode != 0:
        lines = [ln.strip() for ln in err.decode(errors="replace").splitlines()]
        lines = [
            ln
            for ln in lines
            if ln
            and not ln.startswith("Pseudo-terminal")
            and not ln.endswith("terminating, 1 bad configuration options")
        ]
        why = "; ".join(lines[:2]) or f"ssh -G exited with {proc.returncode}"
        loop = re.fullmatch(r"jumphost loop via (\S+)", why)
        if loop:  # ssh's own check: the host's ProxyJump starts with the host itself
            raise RouteError(f"ProxyJump loops through {loop[1]} ({loop[1]}'s own ProxyJump is {loop[1]})")
        raise RouteError(why.replace("Too many recursive configuration includes", "Include loop: too many includes"))
    options: dict[str, list[str]] = {}
    for line in out.decode(errors="replace").splitlines():
        name, _, value = line.partition(" ")
        options.setdefault(name.lower(), []).append(value)
    return options


def _kill(proc: asyncio.subprocess.Process) -> None:
    """End ``ssh -G`` and whatever its ``Match exec`` started (its own session)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _resolved(got: dict[str, list[str]], defaults: dict[str, list[str]], host: str) -> Resolved:
    hostname = _one(got, "hostname") or host
    port = int(_one(got, "port") or 22)
    user = _one(got, "user") or _local_user()
    tokens = {"h": hostname, "p": str(port), "r": user, "n": host}
    files = got.get("identityfile", [])
    keys = () if files == defaults.get("identityfile", []) else tuple(_expand(f, tokens) for f in files)
    algs = _one(got, "hostkeyalgorithms")
    own_algs = tuple(algs.split(",")) if algs and algs != _one(defaults, "hostkeyalgorithms") else ()
    jump = _one(got, "proxyjump")
    command = _one(got, "proxycommand")
    return Resolved(
        hostname, port, user, keys, own_algs,
        proxy_jump=jump if jump and jump != "none" else None,
        proxy_command=_expand(command, tokens, home=False) if command and command != "none" and not jump else None,
    )  # fmt: skip


def _one(got: dict[str, list[str]], name: str) -> str | None:
    values = got.get(name)
    return values[0] if values else None


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def _expand(text: str, tokens: dict[str, str], *, home: bool = True) -> str:
    """OpenSSH's ``%`` tokens in an IdentityFile or ProxyCommand (``ssh -G`` prints them as
    written): ``%h`` host, ``%p`` port, ``%r`` remote user, ``%n`` the name as given, ``%u``
    local user, ``%d`` home, ``%i`` uid, ``%l``/``%L`` local host name, ``%%``; then ``~``."""
    local = socket.gethostname()
    table = {
        **tokens, "u": _local_user(), "d": os.path.expanduser("~"), "i": str(os.getuid()),
        "l": local, "L": local.split(".")[0], "%": "%",
    }  # fmt: skip
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "%" and i + 1 < len(text) and text[i + 1] in table:
            out.append(table[text[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    expanded = "".join(out)
    return os.path.expanduser(expanded) if home else expanded


def split_hop(hop: str) -> tuple[str | None, str, int | None]:
    """A ProxyJump hop as OpenSSH splits it: ``[user@]host[:port]``, where an IPv6 host is
    ``[addr]`` (with or without a port) or a bare address (without one), or an ``ssh://``
    URI. ``ssh -G`` has already refused a hop it cannot read; this only takes it apart."""
    text = hop.strip()
    try:
        if text.startswith("ssh://"):
            u = urlsplit(text)
            if u.path not in ("", "/") or not u.hostname:
                raise ValueError(hop)
            return u.username or None, u.hostname, u.port
        user, _, rest = text.rpartition("@")
        port_s = ""
        if rest.startswith("["):
            rest, sep, tail = rest[1:].partition("]")
            if not sep or (tail and (not tail.startswith(":") or len(tail) == 1)):
                raise ValueError(hop)
            port_s = tail[1:]
        elif rest.count(":") == 1:
            rest, _, port_s = rest.partition(":")
        port = int(port_s) if port_s else None
        if not rest or (port is not None and not 0 < port < 65536):
            raise ValueError(hop)
    except ValueError:
        raise RouteError(f"ProxyJump: cannot read the hop {hop.strip()!r}") from None
    return user or None, rest, port
