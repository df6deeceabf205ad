"""One-line, actionable descriptions of SSH failures."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING

from cluster_cli.config.inventory import ACCEPT_NEW
from cluster_cli.ssh.libsearch import import_asyncssh

if TYPE_CHECKING:
    from cluster_cli.config.inventory import SSHTarget

asyncssh = import_asyncssh()


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (``[::1]:2223``, not ``::1:2223``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    where = f" ({host_port(target.host, target.port or 22)})" if target else ""
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
