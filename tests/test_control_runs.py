"""Run locks: a run is alive exactly while its process holds its lock file, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster_cli.control.runs import Runs

_HOLD = """
import sys, time
from pathlib import Path
from cluster_cli.control.runs import Runs
with Runs(Path(sys.argv[1])) as r:
    print(r.id, flush=True)
    time.sleep(300)
"""


def _holder(state: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, p.stdout.readline().strip()


def test_a_run_in_another_process_is_alive_until_it_is_killed(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    proc, rid = _holder(state)
    try:
        with Runs(state) as me:
            assert me.alive(me.id) and me.alive(rid) and rid != me.id
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            assert not me.alive(rid)  # the kernel dropped its lock; its file is still there
            assert (me.dir / f"{rid}.lock").exists()
        with Runs(state) as later:
            assert not (later.dir / f"{rid}.lock").exists()  # swept by the next run
            assert [p.name for p in later.dir.iterdir()] == [f"{later.id}.lock"]
    finally:
        proc.kill()
        proc.wait()


def test_a_run_that_ends_removes_its_file_and_is_no_longer_alive(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    with Runs(state) as a:
        rid = a.id
        with Runs(state) as b:
            assert b.alive(rid)
    with Runs(state) as c:
        assert not c.alive(rid)
        assert not c.alive(None) and not c.alive("") and not c.alive("../x") and not c.alive(".hidden")
    assert list(c.dir.iterdir()) == []


def test_a_state_folder_it_cannot_write_holds_no_lock_and_fails_nothing(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")  # unwritable even for root: nothing can be created under it
    with Runs(not_a_folder / "state.db") as r:
        assert r.alive(r.id) and not r.alive("0123abcd")


def test_several_runs_at_once_each_see_all_the_others(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    procs = [_holder(state) for _ in range(4)]
    try:
        with Runs(state) as me:
            deadline = time.monotonic() + 5
            while len(list(me.dir.glob("*.lock"))) < 5 and time.monotonic() < deadline:
                time.sleep(0.02)
            names = {p.name.removesuffix(".lock") for p in me.dir.glob("*.lock")}
            assert names == {rid for _, rid in procs} | {me.id}
            assert all(me.alive(rid) for _, rid in procs)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
