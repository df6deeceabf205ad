"""How the start script detaches a shard: in a systemd scope of its own where the node runs
systemd, with setsid elsewhere, and with setsid when systemd-run cannot make the scope.

The choice is made on the node, so the script is run under each shell with stand-ins on
PATH: a ``systemd-run`` that records its arguments and then acts as ``systemd-run --scope``
does (moves itself into the scope, then execs the command: the same PID), or fails as it does
without a bus; and an ``id`` that says which user runs the script. The systemd marker folder
and logind's linger folder are the script's paths, pointed at temporary ones here.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import pytest
from test_batch import SHELLS, _need
from test_launch_scripts import marked, sh

from cluster_cli.launch import remote
from cluster_cli.launch.remote import ShardRef, StartScript, unit_name

pytestmark = pytest.mark.slow

# Records its arguments, then execs what follows "--" (systemd-run --scope execs in place).
SCOPE_OK = """#!/bin/sh
printf '%s\\n' "$*" >>"$STUB_LOG"
[ -n "${STUB_XDG+x}" ] && printf 'XDG_RUNTIME_DIR=%s\\n' "${XDG_RUNTIME_DIR-unset}" >>"$STUB_LOG"
while [ $# -gt 0 ] && [ "$1" != -- ]; do shift; done
shift
exec "$@"
"""
# Fails before running anything, as systemd-run does where it reaches no bus.
SCOPE_FAILS = """#!/bin/sh
printf '%s\\n' "$*" >>"$STUB_LOG"
echo "Failed to connect to bus: No such file or directory" >&2
exit 1
"""
# Never answers (a bus that hangs): the start gives up on it and uses setsid.
SCOPE_HANGS = """#!/bin/sh
printf '%s\\n' "$*" >>"$STUB_LOG"
exec sleep 300
"""


def _node(tmp: Path, *, systemd: bool, stub: str | None, uid: int = 0, user: str = "root",
          linger: bool = False) -> tuple[dict[str, str], dict[str, str]]:  # fmt: skip
    """The environment and StartScript paths of a node: ``systemd`` (its marker folder exists),
    ``stub`` (the systemd-run on PATH, None: none), the user running the script."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    sd = tmp / "run-systemd-system"
    if systemd:
        sd.mkdir()
    lg = tmp / "linger"
    lg.mkdir()
    if linger:
        (lg / user).touch()
    (bin_dir / "id").write_text(
        f'#!/bin/sh\ncase "$*" in "-u") echo {uid};; "-un") echo {shlex.quote(user)};; *) exit 1;; esac\n'
    )
    if stub is not None:
        (bin_dir / "systemd-run").write_text(stub)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    # The stand-in systemd-run comes first on PATH. With none, the PATH is a folder of links to
    # every other command this machine has, so that its own systemd-run is not found either.
    path = [str(bin_dir), *os.environ["PATH"].split(":")]
    if stub is None:
        for d in path[1:]:
            for f in Path(d).glob("*") if Path(d).is_dir() else ():
                link = bin_dir / f.name
                if f.name != "systemd-run" and not link.exists() and not link.is_symlink():
                    link.symlink_to(f)
        path = [str(bin_dir)]
    env = {**os.environ, "PATH": ":".join(path), "STUB_LOG": str(tmp / "systemd-run.args")}
    env.pop("XDG_RUNTIME_DIR", None)
    return env, {"systemd_dir": str(sd), "linger_dir": str(lg)}


def _start(tmp: Path, env: dict[str, str], paths: dict[str, str], shell: str) -> tuple[str, int, int, str]:
    token = f"tiny/0.g1.s0.{remote.new_token()}"
    script = remote.start_script(StartScript(str(tmp / "run"), ["sleep", "300"], {"SECRET": "s"}, token, **paths))
    out = sh(script, env=env, shell=shell)
    (ok,) = out.answers("OK") or [None]
    assert ok, out.out
    pid, st, _ = ok.split()
    (via,) = out.answers("VIA")
    return token, int(pid), int(st), via


def _stop(tmp: Path, token: str, pid: int, st: int) -> None:
    sh(remote.stop_script(ShardRef(str(tmp / "run"), token, pid, st), grace_s=1))


def _args(tmp: Path) -> list[str]:
    f = tmp / "systemd-run.args"
    return f.read_text().splitlines() if f.exists() else []


def _one_shard(token: str, pid: int) -> None:
    """One engine runs, the recorded one: in a session of its own, with the marker."""
    assert marked(token) == [pid]
    assert os.getsid(pid) == pid
    assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"300"]


@pytest.mark.parametrize("shell", SHELLS)
def test_root_on_a_systemd_node_runs_the_shard_in_a_system_scope(tmp_path: Path, shell: str) -> None:
    _need(shell)
    env, paths = _node(tmp_path, systemd=True, stub=SCOPE_OK)
    token, pid, st, via = _start(tmp_path, env, paths, shell)
    try:
        unit = unit_name(token)
        assert via == f"scope {unit}"
        assert _args(tmp_path) == [f"--scope --quiet --collect --unit={unit} -- setsid sh ./run"]
        _one_shard(token, pid)  # systemd-run execs in place: the PID recorded is the engine's
    finally:
        _stop(tmp_path, token, pid, st)
    assert marked(token) == []  # stop finds it by its marker, as without systemd


@pytest.mark.parametrize("shell", SHELLS)
def test_a_lingering_user_gets_a_scope_of_their_own_manager(tmp_path: Path, shell: str) -> None:
    _need(shell)
    env, paths = _node(tmp_path, systemd=True, stub="#!/bin/sh\nSTUB_XDG=1; export STUB_XDG\n" + SCOPE_OK[10:],
                       uid=1234, user="ann", linger=True)  # fmt: skip
    token, pid, st, via = _start(tmp_path, env, paths, shell)
    try:
        unit = unit_name(token)
        assert via == f"scope {unit}"
        assert _args(tmp_path) == [
            f"--user --scope --quiet --collect --unit={unit} -- setsid sh ./run",
            "XDG_RUNTIME_DIR=/run/user/1234",  # where the user's bus is, when the session set none
        ]
        _one_shard(token, pid)
    finally:
        _stop(tmp_path, token, pid, st)


@pytest.mark.parametrize("shell", SHELLS)
def test_a_user_who_does_not_linger_keeps_setsid(tmp_path: Path, shell: str) -> None:
    """Without lingering, systemd stops the user's manager, scopes and all, at their last
    logout: a scope there would end the engine where setsid keeps it."""
    _need(shell)
    env, paths = _node(tmp_path, systemd=True, stub=SCOPE_OK, uid=1234, user="ann", linger=False)
    token, pid, st, via = _start(tmp_path, env, paths, shell)
    try:
        assert via == "setsid" and _args(tmp_path) == []
        _one_shard(token, pid)
    finally:
        _stop(tmp_path, token, pid, st)


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("systemd,stub", [(False, SCOPE_OK), (True, None)], ids=["no-systemd", "no-systemd-run"])
def test_a_node_without_systemd_uses_setsid(tmp_path: Path, shell: str, systemd: bool, stub: str | None) -> None:
    _need(shell)
    env, paths = _node(tmp_path, systemd=systemd, stub=stub)
    token, pid, st, via = _start(tmp_path, env, paths, shell)
    try:
        assert via == "setsid" and _args(tmp_path) == []
        _one_shard(token, pid)
    finally:
        _stop(tmp_path, token, pid, st)


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("stub", [SCOPE_FAILS, SCOPE_HANGS], ids=["fails", "hangs"])
def test_a_systemd_run_that_cannot_make_the_scope_falls_back_to_setsid(tmp_path: Path, shell: str, stub: str) -> None:
    """It is tried once; the shard then starts with setsid, once: one engine, the recorded one."""
    _need(shell)
    if stub is SCOPE_HANGS and shell != "dash":
        pytest.skip("10 s each: one shell is enough")
    env, paths = _node(tmp_path, systemd=True, stub=stub)
    token, pid, st, via = _start(tmp_path, env, paths, shell)
    try:
        assert via == "setsid"
        assert len(_args(tmp_path)) == 1
        _one_shard(token, pid)
        time.sleep(0.3)
        _one_shard(token, pid)
        log = (tmp_path / "run" / "log").read_text()
        assert "no systemd scope (see above), started with setsid" in log
        if stub is SCOPE_FAILS:
            assert "Failed to connect to bus" in log
    finally:
        _stop(tmp_path, token, pid, st)


def test_unit_names_are_valid_for_systemd_and_unique_per_run() -> None:
    a, b = remote.new_token(), remote.new_token()
    names = {unit_name(f"llama-70b/1.g3.s0.{a}"), unit_name(f"llama-70b/1.g3.s0.{b}")}
    assert len(names) == 2
    for n in names:
        assert n.startswith("clusterctl-llama-70b-1.g3.s0.") and n.endswith(".scope")
        assert all(c.isascii() and (c.isalnum() or c in ":_.-") for c in n)
    odd = unit_name("we ird/0.g1.s0.$(x)")
    assert odd == "clusterctl-we_ird-0.g1.s0.__x_.scope" and len(unit_name("m" * 400)) <= 255
