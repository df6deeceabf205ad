"""Running the launch scripts on a node over its SSH session, and reading their answers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cluster_cli.errors import ClusterctlError, SSHError
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


async def run_script(session: Session, script: remote.Script, timeout: float = SCRIPT_TIMEOUT_S) -> str:
    """Run ``script`` with ``sh -s`` (the script on its stdin, so nothing of it is on a
    command line); its stdout as it came, to read with ``script.answers`` and
    ``script.log_lines`` (which make what they return printable). Not split here: a ``\r``
    must stay in its line, where it keeps that line from being an answer."""
    rc, out, _ = await session.run_raw("sh -s", timeout=timeout, input=script.text.encode())
    if rc is None:
        raise SSHError("connection lost while running a command")
    return out.decode("utf-8", "replace")


def ref(run: ShardRun) -> ShardRef:
    return ShardRef(run.run_dir, run.token, run.pid, run.start_time, run.boot_id)


async def start(session: Session, s: ShardStart) -> ShardRun:
    """Start one shard; its run record with PID and start time. Raises LaunchError."""
    script = remote.start_script(s.script)
    out = await run_script(session, script)
    ok = script.answers(out, "OK")
    if not ok:
        why = script.answers(out, "ERR")
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
    res = Stopped(log=script.log_lines(out))
    stopped = script.answers(out, "STOPPED")
    if stopped:
        res.ended = int(stopped[0] or 0)
    for line in script.answers(out, "LEFT"):
        res.left += [int(p) for p in line.split() if p.isdigit()]
    res.port_open = bool(script.answers(out, "PORT_OPEN"))
    res.gpu_pids = [int(p) for p in script.answers(out, "GPU") if p.isdigit()]
    return res


async def alive(session: Session, runs: list[ShardRun], *, trim_bytes: int | None = None) -> list[bool]:
    """Whether each shard's recorded process still runs (the same process: PID and start
    time). ``trim_bytes`` (the node's ``log_max_bytes``): in the same exec, trim each log over
    it (see ``trim_logs``)."""
    if not runs:
        return []
    script = remote.inspect_script((ref(r) for r in runs), trim_bytes=trim_bytes)
    out = await run_script(session, script)
    live = {int(i) for i in script.answers(out, "ALIVE") if i.isdigit()}
    return [i in live for i in range(len(runs))]


@dataclass
class Trimmed:
    """What capping logs did: the shards whose log was trimmed, and those whose could not be
    (with the reason: no room for the copy), left whole."""

    trimmed: list[ShardRun] = field(default_factory=list)
    failed: list[tuple[ShardRun, str]] = field(default_factory=list)


async def trim_logs(session: Session, runs: list[ShardRun], max_bytes: int) -> Trimmed:
    """Cap the logs of these shards (all on one node) at ``max_bytes``: each one over it is
    kept as ``log.1`` and emptied in place (copytruncate, see ``remote.trim_script``)."""
    res = Trimmed()
    if not runs:
        return res
    script = remote.trim_script((ref(r) for r in runs), max_bytes)
    out = await run_script(session, script)
    for i in script.answers(out, "TRIMMED"):
        if i.isdigit() and int(i) < len(runs):
            res.trimmed.append(runs[int(i)])
    for line in script.answers(out, "TRIM_FAILED"):
        i, _, why = line.partition(" ")
        if i.isdigit() and int(i) < len(runs):
            res.failed.append((runs[int(i)], why))
    return res


async def listening(session: Session) -> set[int]:
    """The TCP ports something listens on at the node."""
    script = remote.listening_script()
    out = await run_script(session, script)
    ports = set()
    for h in script.answers(out, "PORT"):
        try:
            ports.add(int(h, 16))
        except ValueError:
            continue
    return ports


async def get(
    session: Session, port: int, path: str, timeout: float = 5.0, *, api_key: str | None = None
) -> tuple[int, bytes]:
    """GET ``path`` from the engine on the node's port ``port``, through the SSH connection
    (``api_key``: the engine's own, for what it keeps behind it)."""
    opener = getattr(session, "open_connection", None)
    if opener is None:
        raise OSError("this SSH connection cannot carry a TCP connection to the node's engine")
    if api_key is None:
        return await fetch("127.0.0.1", port, path, timeout, max_bytes=1 << 20, connect=opener)
    return await fetch("127.0.0.1", port, path, timeout, max_bytes=1 << 20, connect=opener, api_key=api_key)


async def ready(
    session: Session,
    port: int,
    served_name: str,
    health_path: str = "/health",
    *,
    list_models: bool = True,
    api_key: str | None = None,
) -> str | None:
    """None when the engine answers its health check and (``list_models``) lists ``served_name``;
    else what it is waiting for (loading, not listening yet). ``api_key``: the engine's own
    (vLLM keeps ``/v1/models`` behind it)."""
    try:
        status, _ = await get(session, port, health_path, api_key=api_key)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
        return f"not answering yet ({type(e).__name__})"
    if status != 200:
        return f"health check {status} (loading)"
    if not list_models:
        return None
    try:
        status, body = await get(session, port, "/v1/models", api_key=api_key)
        ids = [m.get("id") for m in json.loads(body).get("data", [])]
    except (OSError, TimeoutError, ValueError, AttributeError, asyncio.IncompleteReadError) as e:
        return f"/v1/models not readable yet ({type(e).__name__})"
    if status != 200 or served_name not in ids:
        return f"/v1/models does not list {served_name!r} yet"
    return None
