"""The node-side scripts of launch, run here by a real ``sh``: start detaches a shard, stop
ends every process that carries its marker (one that left the session and was reparented
to init included) and never signals a stranger whose PID was recorded."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_batch import SHELLS, _need

from cluster_cli.launch import remote
from cluster_cli.launch.remote import ShardRef, StartScript


@dataclass(frozen=True)
class Ran:
    """A script's output, read as node.py reads it."""

    script: remote.Script
    out: str

    def answers(self, tag: str) -> list[str]:
        return self.script.answers(self.out, tag)

    @property
    def log(self) -> list[str]:
        return self.script.log_lines(self.out)


def sh(script: remote.Script, timeout: float = 60, env: dict[str, str] | None = None, shell: str = "sh") -> Ran:
    """Run ``script`` with ``SHELL -s`` (``busybox sh``: two words), as node.py runs it over SSH."""
    p = subprocess.run([*shell.split(), "-s"], input=script.text.encode(), capture_output=True, timeout=timeout,
                       env=env)  # fmt: skip
    return Ran(script, p.stdout.decode("utf-8", "replace"))


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


def _start(tmp: Path, argv: list[str], env: dict[str, str] | None = None, shell: str = "sh",
           **kw: object) -> tuple[str, int, int]:  # fmt: skip
    token = remote.new_token()
    script = remote.start_script(StartScript(str(tmp / "run"), argv, {"SECRET": "s3cr3t v"}, token, **kw))  # type: ignore[arg-type]
    out = sh(script, env=env, shell=shell)
    (ok,) = out.answers("OK") or [None]
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
    assert out.answers("STOPPED"), out
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
        (why,) = out.answers("ERR")
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
    stop = remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=2)
    out = sh(remote.Script(spy + stop.text, stop.nonce))
    assert out.answers("STOPPED") and marked(token) == []
    (term,) = [ln.split()[1:] for ln in sent.read_text().splitlines() if ln.startswith("-TERM")]
    assert str(pid) in term and len(term) == len(set(term)) == 2, term  # the leader and its sleep


def test_stop_kills_what_ignores_term_after_the_grace(tmp_path: Path) -> None:
    token, pid, st = _start(tmp_path, ["sh", "-c", "trap '' TERM; while :; do sleep 0.1; done"])
    t0 = time.monotonic()
    out = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))
    assert out.answers("STOPPED") and marked(token) == []
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
    assert out.answers("STOPPED") and marked(token) == []
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
    assert out.answers("ERR") == [reason]
    assert marked(token) == []


def test_start_refuses_a_port_something_listens_on(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = sh(remote.start_script(StartScript(str(tmp_path / "run"), ["sleep", "1"], {}, "t", ports=[port])))
        assert out.answers("ERR") == [f"port {port} is in use on the node"]
        listening = {int(h, 16) for h in sh(remote.listening_script()).answers("PORT")}
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
    assert out.answers("ALIVE") == ["0", "2"] and out.answers("DEAD") == ["1"]


# ---- every write of the start script is checked --------------------------------------


def running(word: str) -> list[int]:
    """The processes with ``word`` in their command line (an engine that started without its
    marker would carry none)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and word.encode() in (p / "cmdline").read_bytes().split(b"\0"):
                out.append(int(p.name))
        except OSError:
            continue
    return out


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (tests run as root), unmounted after the test."""
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(fs: Path, *, leave_pages: int = 0) -> None:
    """Fill the tmpfs ``fs``, then free ``leave_pages`` pages of it (tmpfs gives a file its
    room a page at a time)."""
    page = os.sysconf("SC_PAGE_SIZE")
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * page)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    os.truncate(filler, filler.stat().st_size - leave_pages * page)
    st = os.statvfs(fs)
    assert st.f_bavail * st.f_frsize == leave_pages * page


@pytest.mark.slow
@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("room,unwritten", [(0, "env"), (1, "cmd"), (2, "run"), (3, "pid"), (4, "log")])
def test_a_start_on_a_full_disk_answers_which_file_and_starts_nothing(
    tiny_fs: Path, shell: str, room: int, unwritten: str
) -> None:
    """Room for none of the files, or for the env file (its GPU pinning and marker) but not
    for the command, and so on: the start answers the file it could not write and no process
    of the shard runs, with its marker or without."""
    _need(shell)
    run = tiny_fs / "run"
    run.mkdir()
    fill(tiny_fs, leave_pages=room)
    token, word = remote.new_token(), f"{3000 + room}.{os.getpid()}"
    env = {"CUDA_VISIBLE_DEVICES": "GPU-0b1c"}
    out = sh(remote.start_script(StartScript(str(run), ["sleep", word], env, token)), shell=shell)
    time.sleep(0.2)
    try:
        assert out.answers("ERR") == [f"cannot write {unwritten} in {run} (disk full or read-only?)"], out
        assert out.answers("OK") == []
        assert marked(token) == [] and running(word) == []
    finally:
        for pid in set(marked(token) + running(word)):
            os.kill(pid, signal.SIGKILL)
    if room >= 1:  # the env file was written whole, the rest was not
        assert (run / "env").read_text().endswith(f"export {remote.RUN_ENV}={token}\n")


@pytest.mark.slow
def test_a_start_in_a_read_only_folder_answers_and_starts_nothing(tiny_fs: Path) -> None:
    run = tiny_fs / "run"
    run.mkdir()
    r = subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip() or r.returncode}")
    token = remote.new_token()
    out = sh(remote.start_script(StartScript(str(run), ["sleep", "300"], {}, token)))
    assert out.answers("ERR") == [f"cannot write env in {run} (disk full or read-only?)"], out
    assert marked(token) == []


# ---- logs: the previous one kept, the current one capped ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shell", SHELLS)
def test_a_restart_in_place_keeps_the_previous_log(tmp_path: Path, shell: str) -> None:
    _need(shell)
    token, pid, st = _start(tmp_path, ["sh", "-c", "echo first instance; exec sleep 300"], shell=shell)
    time.sleep(0.3)
    stop = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1, remove=False))
    assert stop.answers("STOPPED") == ["1"]
    token, pid, st = _start(tmp_path, ["sh", "-c", "echo second instance; exec sleep 300"], shell=shell)
    try:
        time.sleep(0.3)
        run = tmp_path / "run"
        assert "first instance" in (run / "log.1").read_text()
        log = (run / "log").read_text()
        assert "second instance" in log and "first instance" not in log
        cmd = remote.log_command(str(run), lines=5, follow=False, previous=True)
        shown = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=10).stdout
        assert "first instance" in shown and "second" not in shown
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))


def test_log_command_reads_the_log_or_the_previous_one() -> None:
    assert remote.log_command("~/r/m-0.g1", lines=5, follow=True) == 'tail -n 5 -f -- "$HOME"/r/m-0.g1/log'
    assert remote.log_command("/r/it's", lines=5, follow=False, previous=True) == "tail -n 5 -- '/r/it'\"'\"'s'/log.1"


def _size_over(path: Path, n: int, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not (path.exists() and path.stat().st_size > n):
        assert time.monotonic() < deadline, f"{path} did not grow past {n} bytes"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("shell", SHELLS)
def test_a_trimmed_log_goes_on_from_its_start(tmp_path: Path, shell: str) -> None:
    """copytruncate: the engine appends (>>), so after the log is emptied its next line lands
    at offset 0, not at its old offset past a hole of zeros."""
    _need(shell)
    writer = "head -c 300000 /dev/zero | tr '\\0' x; echo; i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.05; done"
    token, pid, st = _start(tmp_path, ["sh", "-c", writer], shell=shell)
    run = tmp_path / "run"
    try:
        _size_over(run / "log", 300_000)
        refs = [ShardRef(str(tmp_path / "gone"), "t"), ShardRef(str(run), token, pid, st)]
        out = sh(remote.trim_script(refs, 100_000), shell=shell)
        assert out.answers("TRIMMED") == ["1"] and out.answers("TRIM_FAILED") == [], out
        assert (run / "log.1").stat().st_size > 300_000
        time.sleep(0.3)  # a few more ticks
        data = (run / "log").read_bytes()
        assert 0 < len(data) < 1000 and b"\0" not in data and data.startswith(b"tick "), data[:80]
        assert os.path.exists(f"/proc/{pid}")  # it writes on
        again = sh(remote.trim_script(refs, 100_000), shell=shell)  # under the cap now: left alone
        assert again.answers("TRIMMED") == [] and (run / "log.1").stat().st_size > 300_000
    finally:
        sh(remote.stop_script(ShardRef(str(run), token, pid, st), grace_s=1))


@pytest.mark.slow
def test_inspect_trims_in_the_same_exec(tmp_path: Path) -> None:
    token, pid, st = _start(tmp_path, ["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' y; echo; exec sleep 300"])
    run = tmp_path / "run"
    ref = ShardRef(str(run), token, pid, st)
    try:
        _size_over(run / "log", 5000)
        out = sh(remote.inspect_script([ref], trim_bytes=10_000))
        assert out.answers("ALIVE") == ["0"] and out.answers("TRIMMED") == [] and not (run / "log.1").exists()
        out = sh(remote.inspect_script([ref, ref], trim_bytes=1000))  # one folder: trimmed once
        assert out.answers("ALIVE") == ["0", "1"] and out.answers("TRIMMED") == ["0"]
        assert (run / "log").stat().st_size == 0 and (run / "log.1").stat().st_size > 5000
    finally:
        sh(remote.stop_script(ref, grace_s=1))


def test_a_log_that_cannot_be_copied_is_left_whole(tiny_fs: Path) -> None:
    run = tiny_fs / "run"
    run.mkdir()
    (run / "log").write_bytes(b"z" * 20_000)
    fill(tiny_fs)
    out = sh(remote.trim_script([ShardRef(str(run), "t")], 1000))
    (failed,) = out.answers("TRIM_FAILED")
    assert failed == f"0 cannot copy {run}/log to {run}/log.1 (disk full or read-only?)"
    assert out.answers("TRIMMED") == [] and (run / "log").stat().st_size == 20_000
