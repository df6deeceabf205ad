"""The supervisor's heartbeat: one script per node per tick (boot id, each recorded shard's
process, every marked process and folder) that starts the same few processes on a node
however many shards run there, and ``control.heartbeat.beat``, which asks every node at
once and turns a node that fails into its error line."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_batch import SHELLS
from test_node_runs import Node, node_maker, shard_folder, tok

from cluster_cli.config.inventory import load_inventory
from cluster_cli.control.heartbeat import beat
from cluster_cli.control.nodes import SSHNodes
from cluster_cli.errors import SSHError
from cluster_cli.launch import node, remote
from cluster_cli.launch.node import Beat
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.pool import Sessions
from cluster_cli.state.records import ShardRun

BOOT = Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """Nodes of the test's own: PID namespaces (see test_node_runs)."""
    yield from node_maker(tmp_path)


@pytest.mark.parametrize("shell", SHELLS)
def test_a_heartbeat_tells_each_shard_alive_or_dead_and_lists_the_node(make_node, tmp_path: Path, shell: str) -> None:
    n: Node = make_node(shell)
    run = tmp_path / "run"
    a, b = tok("a"), tok("b")
    pa, pb = n.start(a), n.start(b, "sleep 301")
    sa, sb = n.start_time(pa), n.start_time(pb)
    shard_folder(run, "a-0.g1", a, pa, sa)
    shard_folder(run, "b-0.g1", b, pb, sb)
    n.sh(f"kill -KILL {pb}")
    runs = [
        ShardRun("n", str(run / "a-0.g1"), a, pa, sa, boot_id=BOOT),  # runs
        ShardRun("n", str(run / "b-0.g1"), b, pb, sb, boot_id=BOOT),  # killed
        ShardRun("n", str(run / "a-0.g1"), a, pa, sa + 1, boot_id=BOOT),  # its PID, another process
        ShardRun("n", str(run / "a-0.g1"), a, pa, sa, boot_id="another-boot"),  # before a reboot
        ShardRun("n", str(run / "c-0.g1"), tok("c")),  # never recorded a process
        ShardRun("n", str(run / "a-0.g1"), a, pa, sa),  # no boot id recorded: PID and start time
    ]
    got = asyncio.run(node.heartbeat(n.session(), runs, str(run)))
    assert got.boot_id == BOOT
    assert got.alive == [True, False, False, False, False, True]
    assert [(p.pid, p.start_time, p.token) for p in got.runs.processes] == [(pa, sa, a)]
    assert sorted(f.name for f in got.runs.folders) == ["a-0.g1", "b-0.g1"]
    assert got.runs.folders_of(b)[0].pid == pb  # its folder stays, its process is gone


def _forks(n: Node, script: remote.Script, strace: str, log: Path) -> tuple[int, int, str]:
    """(processes the script forked, programs it executed besides the shell, its output)."""
    ran = n.run(remote.Script(script.text, script.nonce), prefix=[strace, "-f", "-qq", "-o", str(log),
                "-e", "trace=fork,vfork,clone,clone3,execve"])  # fmt: skip
    calls = log.read_text().splitlines()
    forks = sum(1 for c in calls if re.search(r"\b(v?fork|clone3?)\(", c))
    execs = sum(1 for c in calls if re.search(r"\bexecve\(", c)) - 1
    return forks, execs, ran.out


@pytest.mark.parametrize("shell", SHELLS)
def test_a_heartbeat_starts_the_same_four_processes_whatever_runs_on_the_node(
    make_node, tmp_path: Path, shell: str
) -> None:
    """strace counts what the script forks: on an empty node, and on one with 8 shards (8
    folders, 8 processes recorded, 16 marked processes, 40 unmarked ones)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace here")
    n: Node = make_node(shell)
    run = tmp_path / "run"
    empty = _forks(n, remote.heartbeat_script([], str(run)), strace, tmp_path / "empty.strace")
    if empty[0] == 0:
        pytest.skip(f"strace saw no fork here: {empty[2][-200:]!r}")
    refs = []
    for i in range(8):
        t = tok("m", i)
        p = n.start(t)
        n.start(t, "sleep 301")  # a worker
        st = n.start_time(p)
        shard_folder(run, f"m-{i}.g1", t, p, st)
        refs.append(remote.ShardRef(str(run / f"m-{i}.g1"), t, p, st, BOOT))
    for _ in range(40):
        n.start(None, "sleep 302")
    script = remote.heartbeat_script(refs, str(run))
    busy = _forks(n, script, strace, tmp_path / "busy.strace")
    assert script.answers(busy[2], "ALIVE") == [str(i) for i in range(8)]
    assert len(script.answers(busy[2], "PROC")) == 16 and len(script.answers(busy[2], "DIR")) == 8
    assert empty[:2] == busy[:2] == (4, 4), (empty[:2], busy[:2])  # grep's -z probe, grep, tr, awk
    assert "nvidia-smi" not in script.text


# ---- beat: every node at once ----------------------------------------------------------------


class Hangs:
    """A session whose command never ends (a frozen node)."""

    async def run_raw(self, command: str, *, timeout: float, input: bytes) -> tuple[int, bytes, bytes]:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class Mumbles:
    """A session whose answer stops before its end (the node ran out of something)."""

    async def run_raw(self, command: str, *, timeout: float, input: bytes) -> tuple[int, bytes, bytes]:
        return 0, b"half an answer\n", b""


class FakeSessions:
    """``Sessions.get``: a session, an error raised, or ``"hang"``: a connect that never ends."""

    def __init__(self, by_node: dict[str, object]) -> None:
        self.by_node = by_node
        self.asked: list[str] = []

    async def get(self, name: str) -> object:
        self.asked.append(name)
        got = self.by_node[name]
        if isinstance(got, BaseException):
            raise got
        if got == "hang":
            await asyncio.sleep(3600)
        return got


def test_beat_answers_for_the_healthy_node_and_turns_the_failing_ones_into_lines(make_node, tmp_path: Path) -> None:
    n: Node = make_node("sh")
    run = tmp_path / "run"
    t = tok()
    p = n.start(t)
    st = n.start_time(p)
    shard_folder(run, "m-0.g1", t, p, st)
    ok_run = ShardRun("ok", str(run / "m-0.g1"), t, p, st, boot_id=BOOT)
    sessions = FakeSessions(
        {
            "ok": n.session(),
            "refused": SSHError("refused: connection refused"),
            "reset": OSError("connection reset by peer"),
            "frozen": Hangs(),
            "unreachable": "hang",
            "cut": Mumbles(),
        }
    )
    nodes = {name: [ok_run] if name == "ok" else [ShardRun(name, "/r/x", tok())] for name in sessions.by_node}
    t0 = time.monotonic()
    got = asyncio.run(beat(SSHNodes(sessions), nodes, {"ok": str(run)}, timeout_s=1.5))  # type: ignore[arg-type]
    took = time.monotonic() - t0
    assert took < 4, took  # at once: the hanging ones cost one timeout together, not one each
    assert set(got) == set(nodes) and sorted(sessions.asked) == sorted(nodes)
    ok = got["ok"]
    assert isinstance(ok, Beat) and ok.alive == [True] and ok.boot_id == BOOT
    assert [(q.pid, q.token) for q in ok.runs.processes] == [(p, t)]
    assert got["refused"] == "refused: connection refused"
    assert got["reset"] == "reset: connection reset by peer"
    assert got["frozen"] == "frozen: no answer within 1.5 s"
    assert got["unreachable"] == "unreachable: no answer within 1.5 s"
    assert isinstance(got["cut"], str) and got["cut"].startswith("cut: listing the node's runs: the node's answer")


def test_beat_of_no_node_is_empty() -> None:
    assert asyncio.run(beat(SSHNodes(FakeSessions({})), {}, {}, timeout_s=1)) == {}  # type: ignore[arg-type]


def test_beat_over_ssh_while_one_node_is_killed(testbed_factory, tmp_path: Path) -> None:
    """Two testbed nodes over real SSH: both answer; then n2 is killed (its sshd and all), and
    the next beat answers n1 as before and n2 as an error line, well within the timeout."""
    cluster = testbed_factory("n1=cpu-only,n2=cpu-only")
    inv = load_inventory(cluster.inventory_path)
    run_dirs = {name: inv.run_dir(inv.node(name)) for name in ("n1", "n2")}  # type: ignore[arg-type]
    t = tok("tb")
    started = cluster.ssh("n1", f"env CLUSTERCTL_RUN={t} setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!")
    pid = int(started.stdout.decode().strip())

    async def go() -> tuple[dict[str, Beat | str], dict[str, Beat | str], float]:
        connector = AsyncsshConnector(pinned_known_hosts=tmp_path / "pins")
        async with Sessions(inv, connector) as sessions:
            first = await beat(SSHNodes(sessions), {"n1": [], "n2": []}, run_dirs, timeout_s=20)
            b1 = first["n1"]
            assert isinstance(b1, Beat), first
            (mine,) = [q for q in b1.runs.processes if q.token == t]
            shard = ShardRun("n1", f"{run_dirs['n1']}/tb-0.g1", t, pid, mine.start_time, boot_id=b1.boot_id)
            cluster.kill("n2")
            t0 = time.monotonic()
            second = await beat(SSHNodes(sessions), {"n1": [shard], "n2": []}, run_dirs, timeout_s=20)
            return first, second, time.monotonic() - t0

    try:
        first, second, took = asyncio.run(go())
    finally:
        cluster.ssh("n1", f"kill {pid}")
    assert isinstance(first["n2"], Beat), first
    b1 = second["n1"]
    assert isinstance(b1, Beat) and b1.alive == [True], second
    assert pid in {q.pid for q in b1.runs.processes}
    assert isinstance(second["n2"], str) and second["n2"].startswith("n2: "), second
    assert took < 10, took
