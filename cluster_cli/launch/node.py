"""Running the launch scripts on a node over its SSH session, and reading their answers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cluster_cli.errors import ClusterctlError, SSHError
from cluster_cli.facts import printable
from cluster_cli.launch import remote
from cluster_cli.launch.remote import ShardRef
from cluster_cli.router.http import fetch
from cluster_cli.state.records import ShardRun

if TYPE_CHECKING:
    from cluster_cli.launch.shards import ShardStart
    from cluster_cli.probe.runner import Session

SCRIPT_TIMEOUT_S = 60.0


class LaunchError(ClusterctlError):
    """A shard could not be started, or stopped whole: the reason, and its log's last lines."""

    def __init__(self, message: str, log: list[str] | None = None) -> None:
        super().__init__(message)
        self.log = log or []


async def run_script(session: Session, script: str, timeout: float = SCRIPT_TIMEOUT_S) -> str:
    """Run ``script`` with ``sh -s`` (the script on its stdin, so nothing of it is on a
    command line); its stdout, printable."""
    rc, out, _ = await session.run_raw("sh -s", timeout=timeout, input=script.encode())
    if rc is None:
        raise SSHError("connection lost while running a command")
    return "\n".join(printable(line) for line in out.decode("utf-8", "replace").splitlines())


def ref(run: ShardRun) -> ShardRef:
    return ShardRef(run.run_dir, run.token, run.pid, run.start_time, run.boot_id)


async def start(session: Session, s: ShardStart) -> ShardRun:
    """Start one shard; its run record with PID and start time. Raises LaunchError."""
    out = await run_script(session, remote.start_script(s.script))
    ok = remote.answers(out, "OK")
    if not ok:
        why = remote.answers(out, "ERR")
        raise LaunchError(why[0] if why else f"the start script said nothing ({out.strip()[-200:]!r})")
    pid, st, *boot = ok[0].split()
    return replace(s.run, pid=int(pid), start_time=int(st), boot_id=boot[0] if boot else None)


@dataclass
class Stopped:
    """What stopping a shard found: how many processes it ended, any left behind, an open
    port, GPU processes, and the log's last lines."""

    ended: int = 0
    left: list[int] = field(default_factory=list)
    port_open: bool = False
    gpu_pids: list[int] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.left and not self.port_open and not self.gpu_pids

    def problem(self) -> str:
        parts = []
        if self.left:
            parts.append(f"processes still running: {' '.join(map(str, self.left))}")
        if self.port_open:
            parts.append("its port is still open")
        if self.gpu_pids:
            parts.append(f"nvidia-smi still lists processes {' '.join(map(str, self.gpu_pids))}")
        return "; ".join(parts)


async def stop(
    session: Session,
    run: ShardRun,
    *,
    grace_s: float = 10.0,
    port: int | None = None,
    gpu_check: bool = False,
    remove: bool = True,
) -> Stopped:
    """Stop every process of a shard (TERM, grace, KILL) and check that nothing of it is left."""
    script = remote.stop_script(ref(run), grace_s=grace_s, port=port, gpu_check=gpu_check, remove=remove)
    out = await run_script(session, script, timeout=grace_s + 30)
    res = Stopped(log=remote.log_lines(out))
    stopped = remote.answers(out, "STOPPED")
    if stopped:
        res.ended = int(stopped[0] or 0)
    for line in remote.answers(out, "LEFT"):
        res.left += [int(p) for p in line.split() if p.isdigit()]
    res.port_open = bool(remote.answers(out, "PORT_OPEN"))
    res.gpu_pids = [int(p) for p in remote.answers(out, "GPU") if p.isdigit()]
    return res


async def alive(session: Session, runs: list[ShardRun]) -> list[bool]:
    """Whether each shard's recorded process still runs (the same process: PID and start time)."""
    if not runs:
        return []
    out = await run_script(session, remote.inspect_script(ref(r) for r in runs))
    live = {int(i) for i in remote.answers(out, "ALIVE") if i.isdigit()}
    return [i in live for i in range(len(runs))]


async def listening(session: Session) -> set[int]:
    """The TCP ports something listens on at the node."""
    out = await run_script(session, remote.listening_script())
    ports = set()
    for h in remote.answers(out, "PORT"):
        try:
            ports.add(int(h, 16))
        except ValueError:
            continue
    return ports


async def get(session: Session, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` from the engine on the node's port ``port``, through the SSH connection."""
    opener = getattr(session, "open_connection", None)
    if opener is None:
        raise OSError("this SSH connection cannot carry a TCP connection to the node's engine")
    return await fetch("127.0.0.1", port, path, timeout, max_bytes=1 << 20, connect=opener)


async def ready(
    session: Session, port: int, served_name: str, health_path: str = "/health", *, list_models: bool = True
) -> str | None:
    """None when the engine answers its health check and (``list_models``) lists ``served_name``;
    else what it is waiting for (loading, not listening yet)."""
    try:
        status, _ = await get(session, port, health_path)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        return f"not answering yet ({type(e).__name__})"
    if status != 200:
        return f"health check {status} (loading)"
    if not list_models:
        return None
    try:
        status, body = await get(session, port, "/v1/models")
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (OSError, TimeoutError, ValueError, AttributeError, asyncio.IncompleteReadError) as e:
        return f"/v1/models not readable yet ({type(e).__name__})"
    if status != 200 or served_name not in ids:
        return f"/v1/models does not list {served_name!r} yet"
    return None
