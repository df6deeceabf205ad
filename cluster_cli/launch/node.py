"""Running the launch scripts on a node over its SSH session, and reading their answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cluster_cli.errors import ClusterctlError, SSHError
from cluster_cli.launch import remote
from cluster_cli.launch.remote import ShardRef, TokenParts, parse_token
from cluster_cli.router.http import fetch
from cluster_cli.state.records import ShardRun

if TYPE_CHECKING:
    from cluster_cli.launch.shards import ShardStart
    from cluster_cli.ssh.session import Session

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


# ---- everything of clusterctl on a node: list, fence, heartbeat ---------------------------


def _parts(token: str | None) -> TokenParts | None:
    if token is None:
        return None
    try:
        return parse_token(token)
    except ValueError:
        return None


@dataclass(frozen=True)
class MarkedProcess:
    """A process on the node that carries ``CLUSTERCTL_RUN=<token>`` (a shard's engine, one of
    its workers, or what is left of a shard). ``token`` is as the node printed it (made
    printable); ``parts`` is None for a token that is not a clusterctl marker."""

    pid: int
    start_time: int
    token: str

    @property
    def parts(self) -> TokenParts | None:
        return _parts(self.token)


@dataclass(frozen=True)
class RunFolder:
    """A folder under the node's run folder: its name, the marker its ``env`` file ends with
    (None: no env file, or no marker in it) and what its ``pid`` file records (None: none)."""

    name: str
    token: str | None = None
    pid: int | None = None
    start_time: int | None = None

    @property
    def parts(self) -> TokenParts | None:
        return _parts(self.token)


@dataclass
class NodeRuns:
    """Every marked process on a node and every folder under its run folder, as one listing
    found them; ``boot_id``: the node's boot id then (None where it has none)."""

    processes: list[MarkedProcess] = field(default_factory=list)
    folders: list[RunFolder] = field(default_factory=list)
    boot_id: str | None = None

    def tokens(self) -> set[str]:
        """Every token a process or a folder carries."""
        return {p.token for p in self.processes} | {f.token for f in self.folders if f.token is not None}

    def processes_of(self, token: str) -> list[MarkedProcess]:
        return [p for p in self.processes if p.token == token]

    def folders_of(self, token: str) -> list[RunFolder]:
        return [f for f in self.folders if f.token == token]

    @property
    def shared(self) -> dict[str, list[str]]:
        """Tokens found in more than one folder (a copied or moved folder): token -> names."""
        by: dict[str, list[str]] = {}
        for f in self.folders:
            if f.token is not None:
                by.setdefault(f.token, []).append(f.name)
        return {t: names for t, names in by.items() if len(names) > 1}

    @property
    def malformed(self) -> set[str]:
        """Tokens that are not clusterctl markers (``parse_token`` refuses them)."""
        return {t for t in self.tokens() if _parts(t) is None}


def _int(s: str) -> int | None:
    return int(s) if s.isdigit() else None


def _procs(payloads: list[str]) -> list[MarkedProcess]:
    out = []
    for line in payloads:
        pid, _, rest = line.partition(" ")
        st, _, token = rest.partition(" ")
        if pid.isdigit() and st.isdigit() and token:
            out.append(MarkedProcess(int(pid), int(st), token))
    return out


def _complete(script: remote.Script, out: str, what: str) -> None:
    """Raise LaunchError unless the script got to its end (a listing cut short says nothing)."""
    why = script.answers(out, "ERR")
    if why:
        raise LaunchError(f"{what}: {why[0]}")
    if not script.answers(out, "END"):
        raise LaunchError(f"{what}: the node's answer was cut short ({out.strip()[-200:]!r})")


def read_runs(script: remote.Script, out: str) -> NodeRuns:
    """What a ``runs_script`` or ``heartbeat_script`` answered (pure). Raises LaunchError when
    it did not get to its end."""
    _complete(script, out, "listing the node's runs")
    res = NodeRuns(processes=_procs(script.answers(out, "PROC")))
    for line in script.answers(out, "DIR"):
        parts = line.split(" ", 3)
        if len(parts) != 4 or not parts[3]:
            continue
        pid, st, token, name = parts
        res.folders.append(RunFolder(name, None if token == "-" else token, _int(pid), _int(st)))
    boot = script.answers(out, "BOOT")
    res.boot_id = (boot[0] or None) if boot else None
    return res


async def list_runs(session: Session, run_dir: str) -> NodeRuns:
    """Every process on the node that carries a clusterctl marker, and every folder under its
    ``run_dir`` (the node's run folder, ``inventory.run_dir``), in one script that starts 4
    processes (see ``remote.runs_script``)."""
    script = remote.runs_script(run_dir)
    return read_runs(script, await run_script(session, script))


@dataclass
class Fenced:
    """What a fence did: the marked processes it stopped (gone now) and those left running,
    the folders it removed, and those of tokens not kept it left (something of them runs)."""

    stopped: list[MarkedProcess] = field(default_factory=list)
    left: list[MarkedProcess] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.left and not self.held


async def fence(session: Session, run_dir: str, keep: Iterable[str], grace_s: float = 10.0) -> Fenced:
    """Stop every marked process on the node whose token is not in ``keep`` (TERM and CONT,
    ``grace_s``, KILL, as ``stop`` does) and remove their folders under ``run_dir`` once
    nothing of them runs. A process without a marker, or with a kept one, is never signalled.
    Raises ValueError for a ``keep`` token that cannot be compared as written, LaunchError
    when the node's answer was cut short."""
    script = remote.fence_script(run_dir, keep, grace_s=grace_s)
    out = await run_script(session, script, timeout=grace_s + 30)
    _complete(script, out, "fencing the node")
    left = _procs(script.answers(out, "LEFT"))
    still = {p.pid for p in left}
    return Fenced(
        stopped=[p for p in _procs(script.answers(out, "TARGET")) if p.pid not in still],
        left=left,
        removed=script.answers(out, "REMOVED"),
        held=script.answers(out, "HELD"),
    )


@dataclass
class Beat:
    """One heartbeat of a node: its boot id, whether each shard asked about still runs (the
    same PID, start time and boot; in the order given), and what runs there besides."""

    boot_id: str | None
    alive: list[bool]
    runs: NodeRuns


async def heartbeat(session: Session, runs: list[ShardRun], run_dir: str, *, timeout: float = SCRIPT_TIMEOUT_S) -> Beat:
    """One look at the node in one script (``remote.heartbeat_script``: 4 processes started
    there, whatever the number of shards): its boot id, whether each of ``runs`` still runs,
    and every marked process and folder. No nvidia-smi. Raises LaunchError when the answer
    was cut short."""
    script = remote.heartbeat_script((ref(r) for r in runs), run_dir)
    out = await run_script(session, script, timeout=timeout)
    listing = read_runs(script, out)
    live = {int(i) for i in script.answers(out, "ALIVE") if i.isdigit()}
    return Beat(listing.boot_id, [i in live for i in range(len(runs))], listing)


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
