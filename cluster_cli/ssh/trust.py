"""Host keys: which keys a node (or a jump host) may present, and learning one on first contact.

Host keys are always verified: against known_hosts files (the inventory's, and while that
is unset the system's too, as OpenSSH reads them), or with ``accept-new`` against a pin
file that learns a name's key on first contact and never again. A refused key is told apart
as unknown, changed or revoked, with what to run about it.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.config.inventory import ACCEPT_NEW, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.ssh.libsearch import import_asyncssh
from cluster_cli.ssh.messages import host_port

if TYPE_CHECKING:
    from cluster_cli.ssh.route import Dest

asyncssh = import_asyncssh()


class HostKeys:
    """The host keys trusted in one command. ``pin_file`` backs ``accept-new``. Files are
    parsed once per change, not per node: asyncssh given a path parses every key in it on
    every connect, which is quadratic in the fleet size."""

    def __init__(self, pin_file: Path | None = None) -> None:
        self.pin_file = pin_file
        self._pin_lock = asyncio.Lock()
        self._parsed: dict[str, tuple[tuple[int, int, int], asyncssh.SSHKnownHosts]] = {}
        self._pins: tuple[tuple[int, int, int], dict[str, list[asyncssh.SSHKey]]] | None = None

    def trust(self, alias: str, where: str) -> tuple[list[asyncssh.SSHKey], list[object], list[object]]:
        """The keys pinned for exactly ``alias``, as asyncssh's explicit trust lists. Not the
        pin file itself: asyncssh also matches a file's entries against the peer's address,
        and a node named like another node's address would lend its pinned key to it."""
        return (list(self.pinned_keys(where).get(alias, [])), [], [])

    def pinned_keys(self, where: str) -> dict[str, list[asyncssh.SSHKey]]:
        """The pin file by name, parsed once per change of the file, not per node."""
        assert self.pin_file is not None
        try:
            fd = os.open(self.pin_file, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise SSHError(f"{where}cannot read the pin file {self.pin_file}: {_pin_file_error(e)}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if (why := _untrusted(st)) is not None:
                raise SSHError(f"{where}the pin file {self.pin_file} {why}: its keys are not trusted")
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if self._pins is None or self._pins[0] != stamp:
                self._pins = (stamp, _pin_table(f.read().decode(errors="replace")))
        return self._pins[1]

    def parse(self, path: str) -> asyncssh.SSHKnownHosts | str:
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

    async def files(self, target: SSHTarget, dest: Dest, fetch_key: Callable[[], Awaitable[Any]]) -> list[str]:
        """The known_hosts files to verify ``dest`` with (the inventory's, and while that is
        left unset the system's too, as OpenSSH reads them); with accept-new, the pin file,
        where its key is pinned under ``dest.alias`` on first contact: ``fetch_key()`` asks
        the server for it (raising SSHError)."""
        where = dest.label
        if target.known_hosts != ACCEPT_NEW:
            files = [target.known_hosts] if os.path.exists(target.known_hosts) else []
            system = target.system_known_hosts
            # The system's file is read as OpenSSH reads it: one it cannot use is left out.
            if system and os.path.exists(system) and isinstance(self.parse(system), asyncssh.SSHKnownHosts):
                files.append(system)
            if not files:
                raise SSHError(f"{where}known_hosts file not found: {target.known_hosts}")
            return files
        if self.pin_file is None:
            raise SSHError(f"{where}known_hosts is accept-new but no pinned file is configured")
        async with self._pin_lock:
            if not self.pin_file.exists():  # a read-only pin file that knows every node is fine
                try:
                    self.pin_file.parent.mkdir(parents=True, exist_ok=True)
                    os.close(os.open(self.pin_file, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
                except OSError as e:
                    raise SSHError(f"{where}cannot create the pin file {self.pin_file}: {_pin_file_error(e)}") from None
            if dest.alias in self.pinned_keys(where):
                return [str(self.pin_file)]
        # First contact: learn the key, pin it, then connect verifying against the pin.
        key = await fetch_key()
        if key is None:
            raise SSHError(f"{where}server offered no host key")
        async with self._pin_lock:
            # Another clusterctl may be pinning the same node right now: under an exclusive file
            # lock, pin only if nobody did, so a name never gets two keys (either would pass).
            try:
                fd = os.open(self.pin_file, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise SSHError(f"{where}cannot pin its host key in {self.pin_file}: {_pin_file_error(e)}") from None
            try:
                with os.fdopen(fd, "a+") as f:
                    if (why := _untrusted(os.fstat(f.fileno()))) is not None:
                        raise SSHError(f"{where}the pin file {self.pin_file} {why}: not writing to it")
                    fcntl.flock(f, fcntl.LOCK_EX)
                    f.seek(0)
                    text = f.read()
                    if not any(dest.alias in names for names, _ in _pin_lines(text)):
                        sep = "\n" if text and not text.endswith("\n") else ""  # a file edited by hand
                        f.write(f"{sep}{dest.alias} {key.export_public_key('openssh').decode().strip()}\n")
            except OSError as e:
                raise SSHError(f"{where}cannot pin its host key in {self.pin_file}: {e.strerror or e}") from None
        return [str(self.pin_file)]


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


class Lookup(asyncssh.SSHKnownHosts):
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


def host_key_error(e: asyncssh.HostKeyNotVerifiable, trust: object, file: str, dest: Dest) -> str:
    """A refused host key, unknown or changed, with where its key is kept and what to do."""
    what = "jump host" if dest.jump else "node"
    addr = host_port(*dest.real)
    if isinstance(trust, tuple):  # the keys pinned for it (accept-new), as ``_trust`` gives them
        if trust[0]:
            return (
                f"host key not verifiable: changed since it was pinned in {file} ({addr}); "
                f"if the {what} was reinstalled, delete its line there ({dest.alias} ...) and run again"
            )
        pin = f"no usable key pinned for {dest.alias} in {file}"
        return f"host key not verifiable: {pin}; delete its line there and run again"
    if isinstance(trust, Lookup) and trust.asked is not None:
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


def trusted_first(trust: object) -> list[str]:
    """Host key algorithms: those of the keys trusted for the host (certificates first when
    a CA is), then every other one asyncssh offers by default, in its order."""
    from asyncssh.public_key import get_default_certificate_algs, get_default_public_key_algs

    keys, cas = (trust[0], trust[1]) if isinstance(trust, tuple) else (trust.keys, trust.cas)  # type: ignore[attr-defined]
    first: list[bytes] = list(get_default_certificate_algs()) if cas else []
    for k in keys:
        first += [a for a in k.sig_algorithms if a not in first]
    rest = [a for a in (*get_default_certificate_algs(), *get_default_public_key_algs()) if a not in first]
    return [a.decode() for a in (*first, *rest)]


def narrowed(trust: object) -> bool:
    """Whether asyncssh offered the node only the host key types of the keys it trusts for it
    (a pinned key, or known_hosts keys or CA keys that matched it)."""
    if isinstance(trust, tuple):  # pinned keys, as ``_trust`` gives them
        return bool(trust[0])
    return isinstance(trust, Lookup) and trust.found
