"""A fleet of fake nodes for the control plane's decisions: ``control.nodes.Nodes`` answered
from memory, no SSH, no testbed, so that a reconcile pass runs in milliseconds.

Each node keeps what a real one would: its boot id, the engines running (by marker, with PID
and start time), their folders, the ports they listen on. Faults are set per node: killed
(everything on it dies; unreachable until revived with a new boot id), partitioned
(unreachable, its engines go on), frozen (every call hangs until thawed), a failing start, an
engine that crashes, that never gets ready, or whose stop leaves something behind.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from cluster_cli.errors import SSHError
from cluster_cli.launch.node import Beat, Fenced, LaunchError, MarkedProcess, NodeRuns, RunFolder, Stopped
from cluster_cli.launch.shards import ShardStart
from cluster_cli.state.records import ShardRun

_pids = itertools.count(1000)


@dataclass
class Engine:
    """One engine process on a fake node."""

    token: str
    pid: int
    start_time: int
    run_dir: str
    ports: tuple[int, ...]
    gpus: tuple[str, ...]
    ready_after: int = 0  # ready checks that answer "loading" first
    checks: int = 0
    healthy: bool = True


@dataclass
class FakeNode:
    """One node (see the module). ``calls`` records every operation asked of it."""

    name: str
    address: str | None = None
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    engines: dict[str, Engine] = field(default_factory=dict)
    folders: dict[str, str] = field(default_factory=dict)  # run_dir -> token
    other_ports: set[int] = field(default_factory=set)
    up: bool = True
    partitioned: bool = False
    frozen: asyncio.Event | None = None
    fail_start: str | None = None
    load_checks: int = 0  # each new engine answers "loading" to this many checks first
    crash_on_start: bool = False  # engines exit right after they start
    stuck: bool = False  # a stop leaves the processes running
    gpu_left: bool = False  # a stop ends the processes but nvidia-smi still lists them
    start_delay: float = 0.0
    before_start: Any = None  # called with the ShardStart before a start (a race to stage)
    calls: list[tuple[str, str]] = field(default_factory=list)
    clock: int = 100

    async def _enter(self, op: str, what: str = "") -> None:
        if not self.up or self.partitioned:
            raise SSHError(f"{self.name}: connection lost")
        if self.frozen is not None:
            await self.frozen.wait()
        self.calls.append((op, what))

    # ---- Node ----------------------------------------------------------------------------
    async def start(self, s: ShardStart) -> ShardRun:
        await self._enter("start", s.run.token)
        await asyncio.sleep(self.start_delay)
        if self.before_start is not None:
            self.before_start(s)
        if self.fail_start is not None:
            raise LaunchError(f"{self.name}: {self.fail_start}")
        taken = self._listening()
        busy = [p for p in s.script.ports if p in taken]
        if busy:
            raise LaunchError(f"{self.name}: port {busy[0]} is already in use")
        self.clock += 1
        e = Engine(s.run.token, next(_pids), self.clock, s.run.run_dir, tuple(s.script.ports), s.run.gpu_uuids,
                   ready_after=self.load_checks)  # fmt: skip
        self.folders[s.run.run_dir] = s.run.token
        if not self.crash_on_start:
            self.engines[s.run.token] = e
        return replace(s.run, pid=e.pid, start_time=e.start_time, boot_id=self.boot_id)

    async def stop(
        self, run: ShardRun, *, grace_s: float = 10.0, port: int | None = None, gpu_check: bool = False
    ) -> Stopped:
        await self._enter("stop", run.token)
        e = self.engines.get(run.token)
        if e is not None and self.stuck:
            return Stopped(left=[e.pid])
        self.engines.pop(run.token, None)
        self.folders.pop(run.run_dir, None)
        return Stopped(ended=int(e is not None), gpu_pids=[run.pid or 1] if self.gpu_left else [])

    async def alive(self, runs: list[ShardRun], *, trim_bytes: int | None = None) -> list[bool]:
        await self._enter("alive", ",".join(r.token for r in runs))
        return [self._runs(r) for r in runs]

    async def ready(
        self, port: int, served_name: str, *, list_models: bool = True, api_key: str | None = None
    ) -> str | None:
        await self._enter("ready", str(port))
        e = next((e for e in self.engines.values() if e.ports and e.ports[0] == port), None)
        if e is None:
            return "not answering yet (ConnectionRefusedError)"
        e.checks += 1
        if not e.healthy:
            return "health check 503 (loading)"
        if e.checks <= e.ready_after:
            return "health check 503 (loading)"
        return None

    async def get(self, port: int, path: str, *, api_key: str | None = None) -> tuple[int, bytes]:
        await self._enter("get", f"{port}{path}")
        if not any(e.ports and e.ports[0] == port for e in self.engines.values()):
            raise ConnectionRefusedError(port)
        return 404, b""

    async def listening(self) -> set[int]:
        await self._enter("listening")
        return self._listening()

    async def heartbeat(self, runs: list[ShardRun], run_dir: str, *, timeout: float) -> Beat:
        await self._enter("heartbeat")
        return Beat(self.boot_id, [self._runs(r) for r in runs], self._listing())

    async def fence(self, run_dir: str, keep: Iterable[str], *, grace_s: float = 10.0) -> Fenced:
        keep = set(keep)
        await self._enter("fence", ",".join(sorted(keep)))
        out = Fenced()
        for token, e in list(self.engines.items()):
            if token in keep:
                continue
            p = MarkedProcess(e.pid, e.start_time, token)
            if self.stuck:
                out.left.append(p)
                continue
            out.stopped.append(p)
            del self.engines[token]
        for d, token in list(self.folders.items()):
            if token in keep:
                continue
            if token in self.engines:
                out.held.append(d.rsplit("/", 1)[-1])
            else:
                out.removed.append(d.rsplit("/", 1)[-1])
                del self.folders[d]
        return out

    async def log_tail(self, run_dir: str, lines: int) -> str:
        await self._enter("log", run_dir)
        return ""

    async def list_runs(self, run_dir: str) -> NodeRuns:
        await self._enter("list_runs")
        return self._listing()

    def adopt(self, run: ShardRun, port: int | None = None) -> ShardRun:
        """``run``'s engine running here (as if an earlier start had started it): ``run``
        with its PID, start time and boot id."""
        self.clock += 1
        e = Engine(run.token, next(_pids), self.clock, run.run_dir, (port,) if port else (), run.gpu_uuids)
        self.engines[run.token] = e
        self.folders[run.run_dir] = run.token
        return replace(run, pid=e.pid, start_time=e.start_time, boot_id=self.boot_id)

    # ---- faults --------------------------------------------------------------------------
    def kill(self) -> None:
        """Power off: every engine dies; unreachable until ``revive``."""
        self.up = False
        self.engines.clear()

    def revive(self) -> None:
        """Booted again (a new boot id); what was in its folders is still there, nothing runs."""
        self.up, self.boot_id = True, uuid.uuid4().hex

    def crash(self, token: str | None = None) -> None:
        """The engine of ``token`` (every engine: None) exits."""
        for t in [token] if token is not None else list(self.engines):
            self.engines.pop(t, None)

    def freeze(self) -> None:
        self.frozen = asyncio.Event()

    def thaw(self) -> None:
        if self.frozen is not None:
            self.frozen.set()
        self.frozen = None

    # ---- what it holds -------------------------------------------------------------------
    def _runs(self, r: ShardRun) -> bool:
        e = self.engines.get(r.token)
        same_boot = r.boot_id is None or r.boot_id == self.boot_id
        return e is not None and same_boot and e.pid == r.pid and e.start_time == r.start_time

    def _listening(self) -> set[int]:
        return set(self.other_ports) | {p for e in self.engines.values() for p in e.ports}

    def _listing(self) -> NodeRuns:
        procs = [MarkedProcess(e.pid, e.start_time, t) for t, e in self.engines.items()]
        dirs = [RunFolder(d.rsplit("/", 1)[-1], t) for d, t in self.folders.items()]
        return NodeRuns(procs, dirs, self.boot_id)


class FakeFleet:
    """``control.nodes.Nodes`` over fake nodes, one per name (made on first use)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.nodes: dict[str, FakeNode] = {n: FakeNode(n) for n in names}

    def __getitem__(self, name: str) -> FakeNode:
        return self.nodes.setdefault(name, FakeNode(name))

    async def get(self, node: str) -> Any:
        n = self[node]
        if not n.up or n.partitioned:
            raise SSHError(f"{node}: cannot connect (connection refused)")
        return n

    def prefetch(self, nodes: Iterable[str]) -> None:
        pass

    def running(self) -> dict[str, str]:
        """Every engine running in the fleet: token -> node."""
        return {t: n.name for n in self.nodes.values() for t in n.engines}

    def starts(self) -> list[tuple[str, str]]:
        """(node, token) of every start asked, in order."""
        return [(n.name, what) for n in self.nodes.values() for op, what in n.calls if op == "start"]
