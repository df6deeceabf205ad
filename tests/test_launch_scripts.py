"""The node-side scripts of launch, run here by a real ``sh``: start detaches a shard, stop
ends every process that carries its marker (one that left the session and was reparented
to init included) and never signals a stranger whose PID was recorded."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster_cli.launch import remote
from cluster_cli.launch.remote import ShardRef, StartScript


def sh(script: str, timeout: float = 60, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=timeout,
                          env=env).stdout  # fmt: skip


def marked(token: str) -> list[int]:
    """The processes whose environment holds the shard's marker."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{remote.RUN_ENV}={token}".encode() in env:
            out.append(int(p.name))
    return out


def _start(tmp: Path, argv: list[str], env: dict[str, str] | None = None, **kw: object) -> tuple[str, int, int]:
    token = remote.new_token()
    script = remote.start_script(StartScript(str(tmp / "run"), argv, {"SECRET": "s3cr3t v"}, token, **kw))  # type: ignore[arg-type]
    out = sh(script, env=env)
    (ok,) = remote.answers(out, "OK") or [None]
    assert ok, out
    pid, st, boot = ok.split()
    assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # the node's boot, recorded
    return token, int(pid), int(st)


@pytest.mark.slow
def test_a_shard_runs_detached_in_its_own_session_with_its_files(tmp_path: Path) -> None:
    token, pid, st = _start(tmp_path, ["sh", "-c", 'echo "token=$SECRET"; exec sleep 300'])
    try:
        assert os.getsid(pid) == pid  # a session of its own
        run = tmp_path / "run"
        assert (run / "pid").read_text().split() == [str(pid), str(st)]
        assert (run / "env").stat().st_mode & 0o777 == 0o600
        assert "s3cr3t" not in (run / "cmd").read_text()
        assert "s3cr3t" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        time.sleep(0.3)
        assert "token=s3cr3t v" in (run / "log").read_text()
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=2))


@pytest.mark.slow
def test_start_answers_only_once_the_shard_has_left_the_session(tmp_path: Path) -> None:
    # A slow setsid (a loaded node) stands between the fork and the new session: the answer
    # must wait for it, or the SSH session's end could still reach the shard.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("setsid")
    assert real
    (bin_dir / "setsid").write_text(f'#!/bin/sh\nsleep 0.5\nexec {shlex.quote(real)} "$@"\n')
    (bin_dir / "setsid").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    token, pid, st = _start(tmp_path, ["sleep", "300"], env=env)
    try:
        assert os.getsid(pid) == pid
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))


@pytest.mark.slow
def test_stop_ends_a_worker_that_left_the_session_and_was_reparented(tmp_path: Path) -> None:
    # The shard forks a worker into a session of its own (as Ray's and vLLM's do), then dies:
    # the worker is reparented to init, outside the shard's session and process group.
    argv = ["sh", "-c", "(setsid sleep 301 &); exec sleep 300"]
    token, pid, st = _start(tmp_path, argv)
    deadline = time.monotonic() + 5
    while len(marked(token)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = set(marked(token)) - {pid}
    assert workers, "the worker did not start"
    os.kill(pid, signal.SIGKILL)  # the API server dies; its worker lives on
    time.sleep(0.2)
    assert set(marked(token)) == workers
    out = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=2))
    assert remote.answers(out, "STOPPED"), out
    assert marked(token) == []
    assert not (tmp_path / "run").exists()  # the folder goes with it


@pytest.mark.slow
def test_start_refuses_a_folder_whose_earlier_run_left_a_worker_behind(tmp_path: Path) -> None:
    # An earlier run's API server died, its worker (in a session of its own) still holds the
    # GPUs: a new start there must not pile a second engine on top of it.
    token, pid, st = _start(tmp_path, ["sh", "-c", "(setsid sleep 302 &); exec sleep 300"])
    deadline = time.monotonic() + 5
    while len(marked(token)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    try:
        again = remote.new_token()
        out = sh(remote.start_script(StartScript(str(tmp_path / "run"), ["sleep", "300"], {}, again)))
        (why,) = remote.answers(out, "ERR")
        assert why.startswith("processes of an earlier run of this shard still run here"), out
        assert marked(again) == []
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))
    assert marked(token) == []
    token2, pid2, st2 = _start(tmp_path, ["sleep", "300"])  # once it is gone, the folder is free again
    sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token2, pid2, st2), grace_s=1))


@pytest.mark.slow
def test_stop_sends_each_process_one_term(tmp_path: Path) -> None:
    """The leader is found both by its marker and as the recorded PID: it still gets one TERM
    (a second one, if it lands after the first was handled, cuts an engine's clean shutdown
    short: llama-server then hangs in its exit until the KILL)."""
    token, pid, st = _start(tmp_path, ["sh", "-c", "sleep 300 & wait"])
    sent = tmp_path / "kills"
    spy = f'kill() {{ echo "$*" >>{shlex.quote(str(sent))}; command kill "$@"; }}\n'  # the builtin, noted
    out = sh(spy + remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=2))
    assert remote.answers(out, "STOPPED") and marked(token) == []
    (term,) = [ln.split()[1:] for ln in sent.read_text().splitlines() if ln.startswith("-TERM")]
    assert str(pid) in term and len(term) == len(set(term)) == 2, term  # the leader and its sleep


def test_stop_kills_what_ignores_term_after_the_grace(tmp_path: Path) -> None:
    token, pid, st = _start(tmp_path, ["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
    t0 = time.monotonic()
    out = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))
    assert remote.answers(out, "STOPPED") and marked(token) == []
    assert time.monotonic() - t0 >= 1.0  # TERM first, KILL only after the grace


@pytest.mark.slow
def test_a_frozen_shard_gets_its_term_and_acts_on_it(tmp_path: Path) -> None:
    # SIGSTOPped, a process only queues TERM: stop continues it, so it shuts down cleanly
    # instead of being killed after the grace.
    got = tmp_path / "got"
    argv = ["sh", "-c", f"trap 'echo term >{shlex.quote(str(got))}; exit 0' TERM; while :; do sleep 0.1; done"]
    token, pid, st = _start(tmp_path, argv)
    time.sleep(0.2)  # its trap is set
    os.kill(pid, signal.SIGSTOP)
    out = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=5))
    assert remote.answers(out, "STOPPED") and marked(token) == []
    assert got.read_text() == "term\n"


def test_a_recorded_pid_whose_start_time_differs_is_never_signalled(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        (tmp_path / "run").mkdir()
        ref = ShardRef(str(tmp_path / "run"), remote.new_token(), stranger.pid, 1)  # not its start time
        sh(remote.stop_script(ref, grace_s=0.5))
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"binaries": ["/nonexistent/engine"]}, "engine binary not found: /nonexistent/engine"),
        ({"files": ["/nonexistent/m.gguf"]}, "model file not found: /nonexistent/m.gguf"),
    ],
)
def test_start_refuses_before_anything_runs(tmp_path: Path, kw: dict, reason: str) -> None:
    token = remote.new_token()
    out = sh(remote.start_script(StartScript(str(tmp_path / "run"), ["sleep", "300"], {}, token, **kw)))
    assert remote.answers(out, "ERR") == [reason]
    assert marked(token) == []


def test_start_refuses_a_port_something_listens_on(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = sh(remote.start_script(StartScript(str(tmp_path / "run"), ["sleep", "1"], {}, "t", ports=[port])))
        assert remote.answers(out, "ERR") == [f"port {port} is in use on the node"]
        listening = {int(h, 16) for h in remote.answers(sh(remote.listening_script()), "PORT")}
        assert port in listening


@pytest.mark.slow
def test_hostile_arguments_reach_the_process_verbatim(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    weird = ["it's", '"q"', "a;b", f"$(touch {marker})", f"`touch {marker}`", "$HOME", "x\ny"]
    token, pid, st = _start(tmp_path, ["sh", "-c", 'printf "[%s]\\n" "$@"; exec sleep 300', "sh", *weird])
    try:
        time.sleep(0.3)
        log = (tmp_path / "run" / "log").read_text()
        for w in weird:
            assert f"[{w}]" in log
        assert not marker.exists()
        assert shlex.split((tmp_path / "run" / "cmd").read_text())[-len(weird) :] == weird
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))


def test_a_recorded_process_is_alive_only_on_the_boot_it_started_on() -> None:
    """After a reboot PIDs are handed out again: a PID with the recorded start time may be
    another process. The node's boot id, recorded at start, tells them apart."""
    me, boot = os.getpid(), Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    st = int(Path(f"/proc/{me}/stat").read_text().rsplit(")", 1)[1].split()[19])
    refs = [ShardRef("/x", "t", me, st, boot), ShardRef("/x", "t", me, st, "another-boot"), ShardRef("/x", "t", me, st)]
    out = sh(remote.inspect_script(refs))
    assert remote.answers(out, "ALIVE") == ["0", "2"] and remote.answers(out, "DEAD") == ["1"]
