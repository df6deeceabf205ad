"""Local SSH mistakes found before any node is contacted: identity files, known_hosts, the
accept-new pin file and ssh_config (read by ``ssh -G``, as connecting will read it). Each is
a configuration error (exit 2, nothing saved) with one line naming the file, not a fleet of
unreachable nodes."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from pathlib import Path

from cluster_cli.config.inventory import ACCEPT_NEW, Inventory, Node, SSHDefaults
from cluster_cli.config.load import value_line
from cluster_cli.errors import ConfigError


def _printable(text: object, limit: int = 200) -> str:
    s = "".join(c if c.isprintable() else "?" for c in str(text))
    return s if len(s) <= limit else s[: limit - 3] + "..."


def check_ssh_files(
    inv: Inventory, path: Path, pinned: Path | None = None, *, warn: Callable[[str], None] = lambda _: None
) -> None:
    """Raise ConfigError for the first local SSH mistake of ``inv`` (loaded from ``path``);
    ``pinned``: the accept-new pin file. What is worth a word but works goes to ``warn``."""
    if inv.ssh_config:
        cfg = inv.resolve_path(inv.ssh_config)
        if not os.path.isfile(cfg) and cfg != os.devnull:  # `ssh -F /dev/null`: no ssh_config at all
            raise ConfigError(f"{where(path, ('ssh_config',))}: not a readable file: {cfg}")
        if cfg != os.devnull:
            _check_ssh_config(inv, [cfg], where(path, ("ssh_config",)))
    elif inv.nodes:
        from cluster_cli.ssh.route import user_config

        # No ssh_config in the inventory: SSH's own ~/.ssh/config applies, as it would to ssh.
        implicit = user_config()
        if implicit is not None:
            _check_ssh_config(inv, [implicit], f"{implicit} (read since {path} sets no ssh_config)")
    from cluster_cli.ssh.identity import agent_identity

    keys_ok: set[str] = set()
    hosts_ok: set[str] = set()
    accept_new = False
    for i, n in enumerate(inv.nodes):
        t = inv.ssh_target(n)
        key = t.identity_file
        if key and key not in keys_ok:
            why = _identity_problem(key)
            if why:  # where it was set is looked up only now: that parses the file again
                raise ConfigError(f"{_setting(path, i, n, 'identity_file')}: {why}")
            keys_ok.add(key)
            mode = os.stat(key).st_mode & 0o777
            public = agent_identity(key) == key  # a public key is meant to be readable
            if mode & 0o077 and not public:  # OpenSSH refuses such a key ("UNPROTECTED PRIVATE KEY FILE")
                warn(f"identity file {key} is open to other users (mode {mode:04o}): chmod 600 it")
        if t.known_hosts == ACCEPT_NEW:
            accept_new = True
        elif t.known_hosts not in hosts_ok:
            system = t.system_known_hosts if t.system_known_hosts and os.path.exists(t.system_known_hosts) else None
            if system is not None and (why := _known_hosts_problem(system)):
                # Not the user's to fix, and OpenSSH passes over it too: said, and left out.
                warn(f"{why}; verifying host keys without it")
                system = None
            # Left unset, known_hosts is the user's file and the system's, as with OpenSSH: one will do.
            if system is None or os.path.exists(t.known_hosts):
                why = _known_hosts_problem(t.known_hosts)
                if why:
                    raise ConfigError(f"{_setting(path, i, n, 'known_hosts')}: {why}")
            hosts_ok.add(t.known_hosts)
    if pinned is not None and accept_new:
        _check_pin_file(pinned)


def where(path: Path, loc: tuple[str | int, ...], name: str | None = None) -> str:
    """``inv.yaml: line 3 (gpu-01): nodes.0.identity_file``: the file, the line that gives the
    setting (when it is written), the node, and the setting's path."""
    line = value_line(path, loc)
    at = " ".join(x for x in (f"line {line}" if line else "", f"({name})" if name else "") if x)
    return f"{path}: {at + ': ' if at else ''}{'.'.join(map(str, loc))}"


def _setting(path: Path, i: int, n: Node, field: str) -> str:
    """Where node ``n``'s ``field`` comes from: the node's own line, else ``defaults``
    (noting SSHDefaults' value when the file leaves it unset)."""
    if getattr(n, field) is not None:
        return where(path, ("nodes", i, field), n.name)
    at = where(path, ("defaults", field))
    if value_line(path, ("defaults", field)) is None:
        default = SSHDefaults.model_fields[field].default
        at += f" (not set: {default})" if default is not None else " (not set)"
    return at


def _identity_problem(key: str) -> str | None:
    """Why the identity file ``key`` cannot be used, or None."""
    import asyncssh

    from cluster_cli.ssh.identity import agent_identity, key_state

    if not os.path.exists(key):
        return f"identity file not found: {key}"
    if not os.path.isfile(key):
        return f"identity file is not a file: {key}"
    try:
        asyncssh.read_private_key(key)
    except asyncssh.KeyImportError as e:
        why = str(e)
        encrypted = key_state(key) == "locked"
        pub = agent_identity(key)
        if pub is None and not encrypted:
            return f"identity file {key} unusable: {why} (neither a private nor a public key)"
        if pub is None:
            return (
                f"identity file {key} is passphrase-protected and has no {key}.pub beside it: "
                "put its public key there, or point identity_file at it, and load the key into ssh-agent"
            )
        if not os.environ.get("SSH_AUTH_SOCK"):
            what = "is passphrase-protected" if encrypted else "is a public key"
            return (
                f"identity file {key} {what}: its key must come from ssh-agent, and none is running "
                "(SSH_AUTH_SOCK is unset); start one and ssh-add the private key"
            )
    except OSError as e:
        return f"identity file {key}: {e.strerror or e}"
    return None


def _known_hosts_problem(file: str) -> str | None:
    """Why the known_hosts file cannot be used (asyncssh parses it as it will at connect time), or None."""
    import asyncssh

    if not os.path.isfile(file):
        return f"known_hosts file not found: {file} (create it, or set known_hosts: accept-new to pin keys on first contact)"
    try:
        asyncssh.read_known_hosts(file)
    except (ValueError, OSError, asyncssh.Error) as e:
        return f"known_hosts {file}: {_printable(e)}"
    return None


def _check_ssh_config(inv: Inventory, files: list[str], at: str) -> None:
    """Resolve each node's host and its ProxyJump chain as connecting will (``ssh -G``): a
    bad line, an Include loop or a ProxyJump loop is exit 2 now, not N unreachable nodes.
    ``files``: the ssh_config read (the inventory's, or ~/.ssh/config)."""
    from cluster_cli.ssh.route import Resolver, RouteError

    for cfg in files:
        try:
            text = Path(cfg).read_text(errors="replace")
        except OSError as e:
            raise ConfigError(f"{at}: {cfg}: {e.strerror or e}") from None
        if _runs_commands(cfg, text):
            return  # `Match exec` runs a command per host: leave it to connect time, not N times up front
    targets = {}
    for n in inv.nodes:
        t = inv.ssh_target(n)
        targets.setdefault((t.host, t.port, t.user), (n, t))

    async def resolve_all() -> None:
        resolver = Resolver()
        routes = [asyncio.ensure_future(resolver.route(t)) for _, t in targets.values()]
        try:
            for (n, t), fut in zip(targets.values(), routes, strict=True):
                try:
                    await fut
                except RouteError as e:
                    raise ConfigError(f"{at} (node {n.name}, host {t.host}): {_printable(e)}") from None
        finally:
            for fut in routes:
                fut.cancel()
            await asyncio.gather(*routes, return_exceptions=True)

    asyncio.run(resolve_all())


_MATCH_EXEC = re.compile(r"(?im)^\s*match\b.*\bexec\b")
_INCLUDE = re.compile(r"(?im)^\s*include\s*=?\s*(.+?)\s*$")


def _runs_commands(cfg: str, text: str, depth: int = 0, seen: set[str] | None = None) -> bool:
    """Whether ``cfg`` (text ``text``), or a file it includes, has a ``Match exec``. Include
    paths are tried as absolute, in ~/.ssh and beside the file (any of them may be meant);
    a file that cannot be read is ssh's to report."""
    import glob
    import shlex

    if _MATCH_EXEC.search(text):
        return True
    seen = seen if seen is not None else {os.path.realpath(cfg)}
    if depth >= 16:
        return False
    bases = [os.path.expanduser("~/.ssh"), os.path.dirname(os.path.abspath(cfg))]
    for line in _INCLUDE.findall(text):
        try:
            patterns = shlex.split(line)
        except ValueError:
            continue
        for pattern in patterns:
            pattern = os.path.expanduser(pattern)
            candidates = [pattern] if os.path.isabs(pattern) else [os.path.join(b, pattern) for b in bases]
            for path in (p for c in candidates for p in sorted(glob.glob(c))):
                real = os.path.realpath(path)
                if real in seen or not os.path.isfile(real):
                    continue
                seen.add(real)
                try:
                    inner = Path(real).read_text(errors="replace")
                except OSError:
                    continue
                if _runs_commands(real, inner, depth + 1, seen):
                    return True
    return False


def _check_pin_file(pinned: Path) -> None:
    if pinned.exists():
        if not pinned.is_file():
            raise ConfigError(f"{pinned}: the accept-new pin file is not a regular file")
        why = _known_hosts_problem(str(pinned))
        if why:
            raise ConfigError(f"{pinned}: the accept-new pin file is unreadable: {why}")
    else:
        parent = next((p for p in pinned.parents if p.exists()), None)
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{pinned}: cannot create the accept-new pin file ({parent} is not writable)")


def pinned_hosts_path(state_path: Path) -> Path:
    """Where ``known_hosts: accept-new`` pins keys: beside the state, named after it
    (``.clusterctl/state.known_hosts``), so it never mixes with an OpenSSH known_hosts,
    nor is the state file itself."""
    pinned = state_path.with_suffix(".known_hosts")
    return pinned if pinned != state_path else state_path.with_name(state_path.name + ".pins")
