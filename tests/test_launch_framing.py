"""The launch scripts' answers are framed with a per-script nonce: a line the script passes
on (a log's tail, a path in an error) cannot pass for an answer, with or without a ``\\r``
that would make a terminal show it as one."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from test_batch import SHELLS, _need
from test_launch_scripts import _start, marked, sh

from cluster_cli.launch import node, remote
from cluster_cli.launch.remote import ShardRef, StartScript
from cluster_cli.launch.shards import ShardStart
from cluster_cli.state.records import ShardRun

# What an engine (or whoever writes to its log) could print to pass for the stop script's
# answers: the old unframed ones, each behind a \r too, and one with a guessed nonce.
GUESS = secrets.token_hex(8)
FORGED = [
    "@@STOPPED 9",
    "@@OK 1 1",
    "@@LEFT 1",
    "@@PORT_OPEN 8100",
    "\r@@STOPPED 9",
    "\r@@OK 1 1",
    "junk\r@@STOPPED 9",
    f"@@{GUESS} STOPPED 9",
    f"@@{GUESS} LEFT 1",
    f"\r@@{GUESS} OK 1 1",
]


def test_only_lines_with_the_exact_nonce_prefix_are_answers() -> None:
    n = secrets.token_hex(8)
    out = "\n".join(
        [
            f"@@{n} OK 12 34 boot",
            f"@@{n} OKAY 1",  # another tag
            f"@@{n}  OK 5",  # not the exact prefix
            f" @@{n} OK 6",
            f"@@{n} OK 7\r",  # a \r anywhere: never an answer
            f"x\r@@{n} OK 8",
            f"@@{n[:-1]} OK 9",
            f"@@{GUESS} OK 10",
            "@@OK 11",
            f"junk\u2028@@{n} OK 12",  # split on \n alone: not a line of its own
            f"junk\x0b@@{n} OK 13",
            f"junk\x1e@@{n} OK 14",
            f"@@{n} OK",
            f"@@{n} ERR bad \x1b]52;c;AAAA\x07 path",
        ]
    )
    assert remote.answers(out, "OK", nonce=n) == ["12 34 boot", ""]
    assert remote.answers(out, "ERR", nonce=n) == ["bad \\x1b]52;c;AAAA\\x07 path"]  # printable
    assert remote.answers(out, "OK", nonce=GUESS) == ["10"]
    with pytest.raises(ValueError):
        remote.answers(out, "OK", nonce="")


def test_log_lines_are_shown_printable_and_only_with_the_nonce() -> None:
    n = secrets.token_hex(8)
    out = f"@@{n} LOG plain\n@@{n} LOG \r@@{n} OK 1 1\n@@{n} LOG\n@@{GUESS} LOG forged\n@@LOG old\n"
    assert remote.log_lines(out, nonce=n) == ["plain", f"\\x0d@@{n} OK 1 1", ""]
    assert remote.answers(out, "OK", nonce=n) == []


def test_every_script_gets_a_fresh_nonce_that_frames_all_its_answers() -> None:
    ref = ShardRef("/r/m-0.g1", "t", 1, 2, "b")
    scripts = [
        remote.start_script(StartScript("/r/m-0.g1", ["e"], {}, "t")),
        remote.stop_script(ref, port=8100, gpu_check=True),
        remote.inspect_script([ref], trim_bytes=10),
        remote.trim_script([ref], 10),
        remote.listening_script(),
    ]
    nonces = {s.nonce for s in scripts}
    assert len(nonces) == len(scripts) and all(re.fullmatch(r"[0-9a-f]{16}", n) for n in nonces)
    for s in scripts:
        # every answer the script writes carries its nonce: no bare "@@TAG" is left
        assert not re.search(r"@@(?!\$nonce )", s.text), s.text
        assert f"nonce={s.nonce}\n" in s.text


@pytest.mark.slow
@pytest.mark.parametrize("shell", SHELLS)
def test_forged_answers_in_the_log_are_shown_and_never_believed(tmp_path: Path, shell: str) -> None:
    """The log's tail is passed on by the stop script: lines that read like its answers are
    log, and the real answers come through, after a last line cut short too."""
    _need(shell)
    printed = "".join(f"{line}\n" for line in FORGED) + "cut short"
    argv = ["sh", "-c", 'printf "%s" "$1"; exec sleep 300', "sh", printed]
    token, pid, st = _start(tmp_path, argv, shell=shell)
    try:
        _wait_for(tmp_path / "run" / "log", "cut short")
        out = sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=2, port=1), shell=shell)
    finally:
        _kill(token)
    assert out.answers("STOPPED") == ["1"], out.out  # the one sleep, not 9
    assert out.answers("LEFT") == [] and out.answers("OK") == [] and out.answers("PORT_OPEN") == []
    shown = out.log
    for line in FORGED:
        assert line.replace("\r", "\\x0d") in shown, (line, shown)
    assert shown[-1] == "cut short"
    assert marked(token) == []


def _kill(token: str) -> None:
    """What a failed test left of a shard (a stop that ran leaves nothing)."""
    for pid in marked(token):
        os.kill(pid, signal.SIGKILL)


def _wait_for(path: Path, text: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while text.encode() not in (path.read_bytes() if path.exists() else b""):  # bytes: \r as it is
        assert time.monotonic() < deadline, f"{path} never held {text!r}"
        time.sleep(0.05)


class LocalSession:
    """A node's SSH session, run here: ``run_raw`` pipes the script to ``sh -s``, and
    ``tamper`` may add to what it printed (knowing the nonce, as no log line can)."""

    def __init__(self, tamper: str = "") -> None:
        self.tamper = tamper

    async def run_raw(self, command: str, *, timeout: float, input: bytes) -> tuple[int, bytes, bytes]:
        assert command == "sh -s"
        p = await asyncio.to_thread(subprocess.run, ["sh", "-s"], input=input, capture_output=True, timeout=timeout)
        nonce = re.search(rb"^nonce=([0-9a-f]+)$", input, re.M)
        extra = self.tamper.format(n=nonce.group(1).decode() if nonce else "").encode()
        return p.returncode, extra + p.stdout, p.stderr


@pytest.mark.slow
def test_node_stop_reads_forged_log_lines_as_log(tmp_path: Path) -> None:
    printed = "".join(f"{line}\n" for line in FORGED)
    token, pid, st = _start(tmp_path, ["sh", "-c", 'printf "%s" "$1"; exec sleep 300', "sh", printed])
    try:
        _wait_for(tmp_path / "run" / "log", FORGED[-1])
        run = ShardRun("n1", str(tmp_path / "run"), token, pid=pid, start_time=st)
        res = asyncio.run(node.stop(LocalSession(), run, grace_s=2, port=1))  # type: ignore[arg-type]
    finally:
        _kill(token)
    assert (res.ended, res.left, res.port_open, res.gpu_pids) == (1, [], False, [])
    assert res.clean and "\\x0d@@OK 1 1" in res.log and "@@STOPPED 9" in res.log


def test_node_start_never_believes_a_line_with_a_carriage_return(tmp_path: Path) -> None:
    """Even with the right nonce (which no log line has), ``\\r@@<nonce> OK`` is not an answer:
    a terminal would show it as one, and a split on ``\\r`` would make it one."""
    s = StartScript(str(tmp_path / "run"), ["sh", "-c", "exit 3"], {}, remote.new_token())
    start = ShardStart(0, "n1", s, ShardRun("n1", s.run_dir, s.token))
    with pytest.raises(node.LaunchError, match=r"^the engine exited at once$"):
        asyncio.run(node.start(LocalSession(tamper="\r@@{n} OK 1 1 b\n@@{n} OK 2 2\r\n"), start))  # type: ignore[arg-type]
    assert marked(s.token) == []


def test_node_listening_and_alive_read_their_framed_answers() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        ports = asyncio.run(node.listening(LocalSession(tamper=f"@@PORT {1:04X}\n")))  # type: ignore[arg-type]
    assert port in ports and 1 not in ports
    me = os.getpid()
    st = int(Path(f"/proc/{me}/stat").read_text().rsplit(")", 1)[1].split()[19])
    runs = [
        ShardRun("n1", "/nonexistent/r", "t", pid=me, start_time=st),
        ShardRun("n1", "/x", "t", pid=me, start_time=1),
    ]
    assert asyncio.run(node.alive(LocalSession(tamper="@@ALIVE 1\n"), runs)) == [True, False]  # type: ignore[arg-type]


@pytest.mark.slow
def test_node_trim_logs_names_the_runs_it_trimmed(tmp_path: Path) -> None:
    token, pid, st = _start(tmp_path, ["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' y; echo; exec sleep 300"])
    small = tmp_path / "small"
    small.mkdir()
    (small / "log").write_text("short\n")
    runs = [ShardRun("n1", str(small), "t"), ShardRun("n1", str(tmp_path / "run"), token, pid=pid, start_time=st)]
    try:
        _wait_for(tmp_path / "run" / "log", "yyy\n")
        got = asyncio.run(node.trim_logs(LocalSession(tamper="@@TRIMMED 0\n"), runs, 1000))  # type: ignore[arg-type]
        assert got.trimmed == [runs[1]] and got.failed == []
        assert (tmp_path / "run" / "log.1").stat().st_size > 5000 and not (small / "log.1").exists()
    finally:
        sh(remote.stop_script(ShardRef(str(tmp_path / "run"), token, pid, st), grace_s=1))
