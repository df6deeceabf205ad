"""What up reads of its nodes inside the probe batch: shard processes by PID and start time,
and listening ports, parsed from /proc (here, this machine's own)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.launch.observe import STAT, TCP, Observed, node_commands, parse_listening, parse_stat
from cluster_cli.probe.runner import CommandResult
from cluster_cli.state.records import ShardRun


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_start_times_are_read_from_real_stat_lines_whatever_the_command_name() -> None:
    odd = subprocess.Popen(["sh", "-c", "exec -a 'we (ird) ) name' sleep 30"])
    try:
        pids = [os.getpid(), odd.pid]
        text = subprocess.run(["cat", *(f"/proc/{p}/stat" for p in pids), "/proc/999999999/stat"],
                              capture_output=True, text=True).stdout  # fmt: skip
        assert parse_stat(text) == {p: _start_time(p) for p in pids}
    finally:
        odd.kill()
        odd.wait()


def test_listening_ports_are_read_from_the_tcp_tables() -> None:
    with socket.socket() as s, socket.socket(socket.AF_INET6) as s6:
        s.bind(("127.0.0.1", 0))
        s.listen()
        s6.bind(("::1", 0))
        s6.listen()
        text = Path("/proc/net/tcp").read_text() + Path("/proc/net/tcp6").read_text()
        got = parse_listening(text)
        assert s.getsockname()[1] in got and s6.getsockname()[1] in got
    with socket.socket() as c:
        c.bind(("127.0.0.1", 0))  # bound, not listening: not taken as a listener
        assert c.getsockname()[1] not in parse_listening(Path("/proc/net/tcp").read_text())


@given(st.text())
def test_the_parsers_never_raise(text: str) -> None:
    assert isinstance(parse_stat(text), dict)
    assert isinstance(parse_listening(text), set)


def test_a_shard_is_alive_only_while_its_pid_has_its_start_time() -> None:
    me = os.getpid()
    run = ShardRun("n1", "~/r", "t", pid=me, start_time=_start_time(me))
    stale = ShardRun("n1", "~/r", "t", pid=me, start_time=1)
    elsewhere = ShardRun("n2", "~/r", "t", pid=me, start_time=_start_time(me))
    cmds = node_commands([run, stale])
    assert cmds[STAT] == f"cat /proc/{me}/stat" and TCP in cmds
    out = subprocess.run(cmds[STAT].split(), capture_output=True, text=True).stdout
    seen = Observed()
    seen.record("n1", {STAT: CommandResult(0, out), TCP: CommandResult(0, Path("/proc/net/tcp").read_text())})
    assert seen.alive(run) is True and seen.alive(stale) is False
    assert seen.alive(elsewhere) is None  # that node's batch said nothing: asked for later
    timed_out = Observed()
    timed_out.record("n1", {STAT: CommandResult(124, "")})
    assert timed_out.alive(run) is None  # a cut batch is no news of death
