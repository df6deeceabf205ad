"""Everything of clusterctl on a node, listed and fenced (``node.list_runs``, ``node.fence``),
by the real scripts under every common ``sh``: marked processes found by one ``grep -z``
over /proc, shard folders read by the same awk, and a fence that stops only what carries a
marker not kept.

Each test runs its "node" in a PID namespace of its own, with its own /proc (``unshare``):
the scripts there see only what the test started, so a fence never reaches another test's
shard on this machine (a testbed node's engines are processes here too), and everything
in it ends with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from test_batch import SHELLS, _need
from test_launch_scripts import Ran

from cluster_cli.facts import Replica, Shard
from cluster_cli.launch import node, remote
from cluster_cli.launch.remote import StartScript, TokenParts, parse_token
from cluster_cli.launch.shards import _token, folder
from cluster_cli.state.records import ReplicaRecord

# What the scripts run besides the shell: under "busybox sh" these are busybox's applets too,
# as on a busybox node (its grep's -z, its awk, its tr).
APPLETS = ("awk", "cat", "cp", "date", "env", "grep", "head", "kill", "mkdir", "mv", "rm", "sed", "setsid", "sleep",
           "tail", "tr")  # fmt: skip
NSENTER = shutil.which("nsenter")
UNSHARE = shutil.which("unshare")
_INIT = "import os, time\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n        time.sleep(0.05)\n"


def tok(model: str = "m", replica: int = 0, gen: int = 1, rank: int = 0) -> str:
    return f"{model}/{replica}.g{gen}.s{rank}.{secrets.token_hex(8)}"


def shell_env(shell: str, bin_dir: Path) -> dict[str, str]:
    """The environment a script runs in under ``shell``: busybox's own tools for busybox."""
    env = dict(os.environ)
    env.pop(remote.RUN_ENV, None)
    if shell.split()[0] == "busybox":
        bin_dir.mkdir(exist_ok=True)
        bb = shutil.which("busybox")
        assert bb
        for a in APPLETS:
            if not (bin_dir / a).exists():
                (bin_dir / a).symlink_to(bb)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


class Node:
    """A node of a test's own: a PID namespace with its own /proc, its init a reaper. Files
    are the machine's (``tmp_path`` is the same folder in there)."""

    def __init__(self, tmp: Path, shell: str = "sh") -> None:
        if NSENTER is None or UNSHARE is None:
            pytest.skip("no unshare/nsenter here")
        self.shell = shell
        self.env = shell_env(shell, tmp / "busybox-bin")
        self.proc = subprocess.Popen(
            [UNSHARE, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", _INIT],
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        kids: list[str] = []
        while not kids:
            if self.proc.poll() is not None:
                why = self.proc.stderr.read().decode() if self.proc.stderr else ""
                pytest.skip(f"cannot start a PID namespace here: {why.strip()}")
            with contextlib.suppress(OSError):
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            assert time.monotonic() < deadline, "the PID namespace did not start"
            time.sleep(0.01)
        self.init = int(kids[0])
        while not Path(f"/proc/{self.init}/root/proc/1/stat").exists():
            assert time.monotonic() < deadline, "the namespace's /proc did not come up"
            time.sleep(0.01)

    def enter(self) -> list[str]:
        assert NSENTER
        return [NSENTER, "-t", str(self.init), "-p", "-m", "--"]

    def sh(self, command: str) -> str:
        p = subprocess.run([*self.enter(), "sh", "-c", command], capture_output=True, text=True, timeout=30,
                           env=self.env)  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stdout

    def start(self, token: str | None, argv: str = "sleep 300", *, uid: int | None = None, **env: str) -> int:
        """A process in a session of its own, with ``CLUSTERCTL_RUN=token`` (none: no marker)
        and ``env`` (``uid``: as that user); its PID here, once it runs ``argv`` with that
        environment."""
        if token is not None:
            env[remote.RUN_ENV] = token
        words = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        user = f"setpriv --reuid={uid} --regid={uid} --clear-groups " if uid is not None else ""
        pid = int(self.sh(f"env -u {remote.RUN_ENV} {words} {user}setsid {argv} </dev/null >/dev/null 2>&1 & echo $!"))
        exe = argv.split()[0].encode()
        deadline = time.monotonic() + 10
        while True:
            try:
                cmd = (self.path(pid) / "cmdline").read_bytes()
                if cmd.split(b"\0")[0] == exe:
                    return pid
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{argv} did not start"
            time.sleep(0.01)

    def path(self, pid: int) -> Path:
        return Path(f"/proc/{self.init}/root/proc/{pid}")

    def start_time(self, pid: int) -> int:
        return int((self.path(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])

    def alive(self, pid: int) -> bool:
        try:
            return (self.path(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def run(self, script: remote.Script, timeout: float = 60, env: dict[str, str] | None = None,
            prefix: Sequence[str] = ()) -> Ran:  # fmt: skip
        """Run ``script`` with the node's ``SHELL -s`` there (``prefix``: under that command)."""
        p = subprocess.run([*self.enter(), *prefix, *self.shell.split(), "-s"], input=script.text.encode(),
                           capture_output=True, timeout=timeout, env=env or self.env)  # fmt: skip
        return Ran(script, p.stdout.decode("utf-8", "replace"))

    def session(self) -> NodeSession:
        return NodeSession(self)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


class NodeSession:
    """The node's SSH session as node.py uses it: ``sh -s`` with the script on stdin (under
    the node's shell)."""

    def __init__(self, n: Node) -> None:
        self.node = n
        self.ran: list[str] = []

    async def run_raw(self, command: str, *, timeout: float, input: bytes) -> tuple[int, bytes, bytes]:
        assert command == "sh -s"
        self.ran.append(input.decode())
        p = await asyncio.to_thread(
            subprocess.run, [*self.node.enter(), *self.node.shell.split(), "-s"], input=input, capture_output=True,
            timeout=timeout, env=self.node.env,
        )  # fmt: skip
        return p.returncode, p.stdout, p.stderr


def node_maker(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    """``make(shell)``: a new Node whose scripts run under ``shell``; all closed at the end."""
    nodes: list[Node] = []

    def make(shell: str = "sh") -> Node:
        _need(shell)
        n = Node(tmp_path, shell)
        nodes.append(n)
        return n

    try:
        yield make
    finally:
        for n in nodes:
            n.close()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    yield from node_maker(tmp_path)


def shard_folder(run_dir: Path, name: str, token: str | None, pid: int | None = None, st: int | None = None) -> Path:
    """A shard's folder as the start script leaves it (``env`` ending with the marker)."""
    d = run_dir / name
    d.mkdir(parents=True)
    if token is not None:
        (d / "env").write_text(f"export HF_TOKEN=secret\nexport {remote.RUN_ENV}={shlex.quote(token)}\n")
    (d / "cmd").write_text("sleep 300\n")
    if pid is not None:
        (d / "pid").write_text(f"{pid} {st}\n")
    return d


# ---- the token ---------------------------------------------------------------------------


def test_parse_token_reads_what_shards_writes() -> None:
    rec = ReplicaRecord(
        Replica("llama-3.1-8b_q4", 12, "p", "llamacpp", (Shard("n1", (0,)), Shard("n2", (1,)))), generation=7
    )
    t = _token(rec, 1)
    parts = parse_token(t)
    assert parts == TokenParts("llama-3.1-8b_q4", 12, 7, 1, t.rsplit(".", 1)[1])
    assert parts.replica_name == "llama-3.1-8b_q4/12"
    assert folder("/r", rec) == "/r/llama-3.1-8b_q4-12.g7"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "0123456789abcdef",  # a bare nonce
        "m/0.g1.s0",
        "m/0.g1.s0.0123456789abcde",  # 15 hex digits
        "m/0.g1.s0.0123456789abcdef0",
        "m/0.g1.s0.0123456789ABCDEF",
        "m/01.g1.s0.0123456789abcdef",  # a leading zero
        "m/-1.g1.s0.0123456789abcdef",
        "m/+1.g1.s0.0123456789abcdef",
        "m/0.g1.s0.0123456789abcdef\n",
        " m/0.g1.s0.0123456789abcdef",
        "m/0.g1.s0.0123456789abcdef x",
        ".m/0.g1.s0.0123456789abcdef",  # not a catalog model name
        "a/b/0.g1.s0.0123456789abcdef",
        "m 1/0.g1.s0.0123456789abcdef",
        "m/0.g.s0.0123456789abcdef",
        "m/0.g1.r0.0123456789abcdef",
        "m/0.g1.s0.\u0660123456789abcdef",  # a non-ASCII digit
        "m\\x01/0.g1.s0.0123456789abcdef",
    ],
)
def test_parse_token_refuses_anything_malformed(token: str) -> None:
    with pytest.raises(ValueError, match="not a clusterctl marker"):
        parse_token(token)


@pytest.mark.parametrize("keep", [[""], ["a b"], ["x\n"], ["t\x01"], [" m/0.g1.s0.0123456789abcdef"]])
def test_a_fence_refuses_a_token_to_keep_it_could_not_compare(keep: list[str]) -> None:
    with pytest.raises(ValueError, match="not a marker to keep"):
        remote.fence_script("/r", keep)


# ---- list_runs -----------------------------------------------------------------------------


@pytest.mark.parametrize("shell", SHELLS)
def test_list_runs_finds_every_marked_process_and_every_folder(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    run = tmp_path / "run"
    a, b, bad = tok("a"), tok("b", 3, 2, 1), "not a token\\x"
    pa = n.start(a)
    pb = n.start(b, "sleep 301", CUDA_VISIBLE_DEVICES="GPU-0b1c")  # a GPU shard: found the same way
    pbad = n.start(bad, "sleep 302")
    plain = n.start(None, "sleep 303")  # no marker: never listed
    empty = n.start("", "sleep 304")  # an empty marker is none (the start script refuses one)
    shard_folder(run, "a-0.g1", a, pa, n.start_time(pa))
    shard_folder(run, "gone-1.g1", tok("gone"), 99999, 1)  # a shard that died: its folder stays
    shard_folder(run, "half", None)  # a start cut short before its env file
    (run / "stray file").write_text("not a folder")

    got = asyncio.run(node.list_runs(n.session(), str(run)))

    procs = {p.pid: p for p in got.processes}
    assert set(procs) == {pa, pb, pbad}
    assert (procs[pa].token, procs[pa].start_time) == (a, n.start_time(pa))
    assert procs[pb].parts == TokenParts("b", 3, 2, 1, b.rsplit(".", 1)[1])
    assert procs[pbad].token == bad and procs[pbad].parts is None
    assert got.malformed == {bad}
    assert plain not in procs and empty not in procs and n.alive(plain) and n.alive(empty)
    folders = {f.name: f for f in got.folders}
    assert set(folders) == {"a-0.g1", "gone-1.g1", "half"}
    assert folders["a-0.g1"] == node.RunFolder("a-0.g1", a, pa, n.start_time(pa))
    assert folders["gone-1.g1"].pid == 99999 and folders["gone-1.g1"].parts is not None
    assert folders["half"] == node.RunFolder("half")
    assert got.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert got.processes_of(a) == [procs[pa]] and got.folders_of(a) == [folders["a-0.g1"]]


@pytest.mark.parametrize("shell", SHELLS)
def test_a_real_shard_is_listed_with_its_worker_and_folder(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    t = tok("real", 0, 4)
    d = tmp_path / "run" / "real-0.g4"
    ran = n.run(remote.start_script(StartScript(str(d), ["sh", "-c", "(setsid sleep 301 &); exec sleep 300"], {}, t)))
    (ok,) = ran.answers("OK")
    pid, st = (int(x) for x in ok.split()[:2])
    deadline = time.monotonic() + 10
    while True:
        got = asyncio.run(node.list_runs(n.session(), str(tmp_path / "run")))
        if len(got.processes) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {p.token for p in got.processes} == {t}
    assert pid in {p.pid for p in got.processes}  # the engine, and its worker in a session of its own
    assert got.folders == [node.RunFolder("real-0.g4", t, pid, st)]


@pytest.mark.parametrize("shell", SHELLS)
def test_the_scripts_own_processes_are_never_marked_ones_even_when_it_carries_a_marker(
    make_node, tmp_path: Path, shell: str
) -> None:
    """A script started with a marker in its environment (its subshells and commands carry it
    until they exec): it lists only the others, and a fence does not end itself."""
    n = make_node(shell)
    t, mine = tok("t"), tok("mine")
    pt = n.start(t)
    env = {**n.env, remote.RUN_ENV: mine}
    ran = n.run(remote.runs_script(str(tmp_path / "run")), env=env)
    assert ran.answers("END") == [""]
    assert [p.split()[2] for p in ran.answers("PROC")] == [t]
    fenced = n.run(remote.fence_script(str(tmp_path / "run"), [t], grace_s=1), env=env)
    assert fenced.answers("END") == [""] and fenced.answers("TARGET") == [] and n.alive(pt)


@pytest.mark.parametrize("shell", ["dash", "busybox sh"])
def test_a_node_whose_grep_has_no_z_lists_the_same(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    t = tok()
    pt = n.start(t)
    shard_folder(tmp_path / "run", "m-0.g1", t, pt, n.start_time(pt))
    fake = tmp_path / "noz"
    fake.mkdir()
    real = shutil.which("grep", path=n.env["PATH"])
    (fake / "grep").write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case $a in -*z*) echo "grep: invalid option -- z" >&2; exit 1;; esac; done\n'
        f'exec {shlex.quote(str(real))} "$@"\n'
    )
    (fake / "grep").chmod(0o755)
    script = remote.runs_script(str(tmp_path / "run"))
    with_z = n.run(script)
    without = n.run(script, env={**n.env, "PATH": f"{fake}:{n.env['PATH']}"})
    assert with_z.answers("PROC") == without.answers("PROC") == [f"{pt} {n.start_time(pt)} {t}"]
    assert with_z.answers("DIR") == without.answers("DIR") and without.answers("END") == [""]


# ---- fence -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shell", SHELLS)
def test_fence_stops_what_is_not_kept_and_removes_its_folders(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    run = tmp_path / "run"
    kept, gone, stale, idle = tok("kept"), tok("gone"), tok("stale"), tok("idle")
    pk = n.start(kept)
    pg = n.start(gone, "sleep 301")
    pw = n.start(gone, "sleep 302")  # a worker of the same shard, in a session of its own
    plain = n.start(None, "sleep 303")  # no marker: never touched
    shard_folder(run, "kept-0.g1", kept, pk, n.start_time(pk))
    shard_folder(run, "gone-0.g1", gone, pg, n.start_time(pg))
    shard_folder(run, "stale-0.g1", stale, 99999, 1)  # nothing of it runs
    shard_folder(run, "idle-0.g1", idle)  # kept though nothing runs
    shard_folder(run, "half", None)  # no marker: not the fence's to judge
    odd = shard_folder(run, "we ird\\name", tok("odd"))

    t0 = time.monotonic()
    got = asyncio.run(node.fence(n.session(), str(run), [kept, idle], grace_s=5))
    assert time.monotonic() - t0 < 5  # sleep ends on its TERM: no waiting out the grace

    assert sorted(p.pid for p in got.stopped) == sorted([pg, pw])
    assert {p.token for p in got.stopped} == {gone} and got.left == [] and got.held == []
    assert sorted(got.removed) == sorted(["gone-0.g1", "stale-0.g1", odd.name]) and got.clean
    assert n.alive(pk) and n.alive(plain) and not n.alive(pg) and not n.alive(pw)
    assert sorted(p.name for p in run.iterdir()) == ["half", "idle-0.g1", "kept-0.g1"]
    assert (run / "kept-0.g1" / "env").exists()
    again = asyncio.run(node.fence(n.session(), str(run), [kept, idle], grace_s=5))
    assert again == node.Fenced()  # nothing more to do


@pytest.mark.parametrize("shell", SHELLS)
def test_fence_kills_what_ignores_term_after_the_grace(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    t = tok()
    p = n.start(t, "sh -c " + shlex.quote("trap '' TERM; while :; do sleep 0.1; done"))
    t0 = time.monotonic()
    got = asyncio.run(node.fence(n.session(), str(tmp_path / "run"), [], grace_s=1))
    assert time.monotonic() - t0 >= 1.0  # TERM first, KILL only after the grace
    assert p in {s.pid for s in got.stopped} and got.left == [] and not n.alive(p)


@pytest.mark.parametrize("shell", SHELLS)
def test_a_token_in_two_folders(make_node, tmp_path: Path, shell: str) -> None:
    """A shard's folder copied under another name: both are its, listed as shared; a fence
    keeps both with it, or stops it and removes both."""
    n = make_node(shell)
    run = tmp_path / "run"
    t = tok("dup")
    p = n.start(t)
    shard_folder(run, "dup-0.g1", t, p, n.start_time(p))
    shard_folder(run, "dup-0.g1.copy", t)

    listed = asyncio.run(node.list_runs(n.session(), str(run)))
    assert {k: sorted(v) for k, v in listed.shared.items()} == {t: ["dup-0.g1", "dup-0.g1.copy"]}
    assert [pr.pid for pr in listed.processes_of(t)] == [p] and len(listed.folders_of(t)) == 2

    kept = asyncio.run(node.fence(n.session(), str(run), [t], grace_s=2))
    assert kept == node.Fenced() and n.alive(p) and len(list(run.iterdir())) == 2

    fenced = asyncio.run(node.fence(n.session(), str(run), [], grace_s=2))
    assert [s.pid for s in fenced.stopped] == [p] and sorted(fenced.removed) == ["dup-0.g1", "dup-0.g1.copy"]
    assert not n.alive(p) and list(run.iterdir()) == []


@pytest.mark.parametrize("shell", SHELLS)
def test_a_process_with_a_malformed_marker_is_listed_and_fenced(make_node, tmp_path: Path, shell: str) -> None:
    """A marker that is no clusterctl token (an older release's bare nonce, or one written by
    hand) still marks the process as clusterctl's: listed, refused by ``parse_token``, and
    stopped by a fence that does not keep it."""
    n = make_node(shell)
    bare, spaced = secrets.token_hex(8), "two words\\n"
    pb, ps = n.start(bare), n.start(spaced, "sleep 301")
    listed = asyncio.run(node.list_runs(n.session(), str(tmp_path / "run")))
    assert {(p.pid, p.token) for p in listed.processes} == {(pb, bare), (ps, spaced)}
    assert listed.malformed == {bare, spaced}
    got = asyncio.run(node.fence(n.session(), str(tmp_path / "run"), [bare], grace_s=2))
    assert [(s.pid, s.token) for s in got.stopped] == [(ps, spaced)]
    assert n.alive(pb) and not n.alive(ps)


@pytest.mark.parametrize("shell", SHELLS)
def test_a_folder_whose_recorded_process_runs_without_its_marker_is_held(make_node, tmp_path: Path, shell: str) -> None:
    """The fence never signals a process without a marker, even the one a folder of a token
    not kept records: that folder stays, answered as held."""
    n = make_node(shell)
    run = tmp_path / "run"
    p = n.start(None)
    shard_folder(run, "lost-0.g1", tok("lost"), p, n.start_time(p))
    got = asyncio.run(node.fence(n.session(), str(run), [], grace_s=1))
    assert got.stopped == [] and got.held == ["lost-0.g1"] and got.removed == [] and not got.clean
    assert n.alive(p) and (run / "lost-0.g1").is_dir()


def test_fence_on_a_node_without_a_run_folder_stops_and_answers(make_node, tmp_path: Path) -> None:
    n = make_node("sh")
    p = n.start(tok())
    got = asyncio.run(node.fence(n.session(), str(tmp_path / "nothing-here"), [], grace_s=1))
    assert [s.pid for s in got.stopped] == [p] and got.removed == [] and got.clean


def test_a_listing_cut_short_is_an_error_not_an_empty_node() -> None:
    script = remote.runs_script("/r")
    with pytest.raises(node.LaunchError, match="cut short"):
        node.read_runs(script, f"@@{script.nonce} BOOT b\n@@{script.nonce} PROC 1 2 m/0.g1.s0.0123456789abcdef\n")
    with pytest.raises(node.LaunchError, match="no awk on the node"):
        node.read_runs(script, f"@@{script.nonce} ERR no awk on the node\n")
    forged = f"@@{secrets.token_hex(8)} END\n@@{script.nonce} END\r\n"
    with pytest.raises(node.LaunchError):
        node.read_runs(script, forged)


# ---- framing: nothing a process or a folder holds can pass for an answer ----------------------


def test_the_new_scripts_frame_every_answer_with_a_fresh_nonce() -> None:
    scripts = [
        remote.runs_script("~/.clusterctl/run"),
        remote.fence_script("~/.clusterctl/run", [tok()], grace_s=1),
        remote.heartbeat_script([remote.ShardRef("/r/m-0.g1", tok(), 1, 2, "b")], "/r"),
    ]
    assert len({s.nonce for s in scripts}) == len(scripts)
    for s in scripts:
        assert not re.search(r"@@(?!\$nonce )", s.text), s.text
        assert f"nonce={s.nonce}\n" in s.text and "nvidia-smi" not in s.text


@pytest.mark.parametrize("shell", SHELLS)
def test_a_newline_in_a_marker_or_a_folder_name_makes_no_line_of_its_own(make_node, tmp_path: Path, shell: str) -> None:
    n = make_node(shell)
    run = tmp_path / "run"
    guess = secrets.token_hex(8)
    forged = f"x\n@@{guess} PROC 1 1 m/0.g1.s0.0123456789abcdef\r"
    p = n.start(forged)
    shard_folder(run, f"f\n@@{guess} DIR 1 1 - fake", tok())
    ran = n.run(remote.runs_script(str(run)))
    assert ran.answers("PROC") == [f"{p} {n.start_time(p)} x\\x01@@{guess} PROC 1 1 m/0.g1.s0.0123456789abcdef\\x01"]
    (d,) = ran.answers("DIR")
    assert d.endswith(f" f\\x01@@{guess} DIR 1 1 - fake")
    assert remote.answers(ran.out, "PROC", nonce=guess) == []  # the forged line is no line at all


@pytest.mark.parametrize("shell", SHELLS)
def test_other_users_processes_are_skipped_quietly(make_node, tmp_path: Path, shell: str) -> None:
    """As an unprivileged user, root's marked process cannot be read: it is left out without a
    word, the user's own is listed, and the listing is whole."""
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv here")
    n = make_node(shell)
    theirs, mine = tok("root"), tok("nobody")
    n.start(theirs)
    pm = n.start(mine, uid=65534)
    script = remote.runs_script(str(tmp_path / "run"))
    p = subprocess.run(
        [*n.enter(), "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *shell.split(), "-s"],
        input=script.text.encode(), capture_output=True, timeout=60, cwd="/", env={**n.env, "HOME": "/"},
    )  # fmt: skip
    out = p.stdout.decode()
    assert script.answers(out, "PROC") == [f"{pm} {n.start_time(pm)} {mine}"]
    assert script.answers(out, "END") == [""] and p.stderr == b""
