"""What up reads of its nodes inside the probe batch: shard processes by PID and start time,
and listening ports, parsed from /proc (here, this machine's own)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.launch.observe import BOOT, STAT, Observed, node_commands, parse_listening, parse_stat
from cluster_cli.probe.batch import build_script, parse_records
from cluster_cli.ssh.session import CommandResult
from cluster_cli.state.records import ShardRun


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _odd_name() -> subprocess.Popen[bytes]:
    """A running process whose command name holds parentheses and spaces."""
    code = "open('/proc/self/comm', 'w').write('we (ird) ) nm'); print(flush=True); import time; time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"\n"
    assert Path(f"/proc/{p.pid}/comm").read_text() == "we (ird) ) nm\n"
    return p


def test_start_times_are_read_from_real_stat_lines_whatever_the_command_name() -> None:
    odd = _odd_name()
    try:
        pids = [os.getpid(), odd.pid]
        text = subprocess.run(["cat", *(f"/proc/{p}/stat" for p in pids), "/proc/999999999/stat"],
                              capture_output=True, text=True).stdout  # fmt: skip
        assert parse_stat(text) == {p: _start_time(p) for p in pids}
    finally:
        odd.kill()
        odd.wait()


def test_a_zombie_is_not_a_running_process() -> None:
    z = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while Path(f"/proc/{z.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert parse_stat(Path(f"/proc/{z.pid}/stat").read_text()) == {}
    finally:
        z.wait()


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


def _batch(cmds: dict[str, str], shell: str = "sh") -> dict[str, CommandResult]:
    """``cmds`` run by the probe's real batch script, here."""
    script, token = build_script(cmds, per_command_timeout_s=10)
    out = subprocess.run([shell, "-s"], input=script.encode(), capture_output=True, timeout=30).stdout
    return parse_records(cmds, out, token)


def test_a_shard_is_alive_only_while_its_pid_has_its_start_time() -> None:
    odd = _odd_name()
    try:
        me = os.getpid()
        run = ShardRun("n1", "~/r", "t", pid=me, start_time=_start_time(me))
        weird = ShardRun("n1", "~/r", "t", pid=odd.pid, start_time=_start_time(odd.pid))
        stale = ShardRun("n1", "~/r", "t", pid=me, start_time=1)
        gone = ShardRun("n1", "~/r", "t", pid=999999999, start_time=5)
        elsewhere = ShardRun("n2", "~/r", "t", pid=me, start_time=_start_time(me))
        seen = Observed()
        seen.record("n1", _batch(node_commands([run, weird, stale, gone])))
        assert seen.alive(run) is True and seen.alive(weird) is True
        assert seen.alive(stale) is False and seen.alive(gone) is False
        assert seen.alive(elsewhere) is None  # that node's batch said nothing: asked for later
    finally:
        odd.kill()
        odd.wait()
    timed_out = Observed()
    timed_out.record("n1", {STAT: CommandResult(124, "")})
    assert timed_out.alive(run) is None  # a cut batch is no news of death


def test_every_recorded_shard_gone_is_news_of_death_not_silence() -> None:
    gone = ShardRun("n1", "~/r", "t", pid=999999999, start_time=5)
    seen = Observed()
    seen.record("n1", _batch(node_commands([gone], ports=False)))
    assert seen.alive(gone) is False


def test_a_shard_that_started_on_another_boot_is_not_alive() -> None:
    me = os.getpid()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    now = ShardRun("n1", "~/r", "t", pid=me, start_time=_start_time(me), boot_id=boot)
    before = replace(now, boot_id="0d6b0a1e-reboot")
    seen = Observed()
    seen.record("n1", _batch(node_commands([now, before], ports=False)))
    assert seen.boot_ids == {"n1": boot}
    assert (seen.alive(now), seen.alive(before), seen.alive(replace(now, boot_id=None))) == (True, False, True)


def test_ports_are_read_only_when_asked_for() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        seen = Observed()
        seen.record("n1", _batch(node_commands([], ports=True)))
        assert s.getsockname()[1] in seen.listening["n1"]
    assert set(node_commands([], ports=False)) == {BOOT}  # the boot id only: read by the shell, no process
    quiet = Observed()
    quiet.record("n1", _batch(node_commands([ShardRun("n1", "~/r", "t", pid=1, start_time=1)], ports=False)))
    assert "n1" not in quiet.listening  # not read: a new replica's up asks the node then
