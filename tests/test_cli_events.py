"""``clusterctl events``: the state's events, newest last, filtered, as a table, JSON or YAML;
``-f`` follows new ones until Ctrl-C; ``--keep``/``--keep-max`` set the retention."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from helpers import dgx
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.state.store import Store

runner = CliRunner()
KEYS = ["at", "kind", "node", "replica", "generation", "actor", "message", "detail"]


def run(tmp_path: Path, *args: str):
    return runner.invoke(app, ["--state", str(tmp_path / "state.db"), *args])


def events_json(tmp_path: Path, *args: str) -> list[dict]:
    r = run(tmp_path, "events", "-o", "json", *args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert list(doc) == ["events"]
    return doc["events"]


def populate(tmp_path: Path) -> Path:
    """A state holding, oldest first: discover (and node-ready for gpu-01), a cordon of gpu-03,
    then tiny/0 g3 failed, tiny/1 g1 ready, big/0 g2 starting (on gpu-01)."""
    path = tmp_path / "state.db"
    with Store(path, actor="tester") as s:
        s.save_discovery([dgx("gpu-01")])
        s.cordon("gpu-03", "ECC storm")
        s.record_event("failed", "tiny/0 exited 1", node="gpu-02", model="tiny", replica=0, generation=3,
                       detail={"rc": 1})  # fmt: skip
        s.record_event("ready", "tiny/1 ready", node="gpu-02", model="tiny", replica=1, generation=1)
        s.record_event("starting", "big/0 starting", node="gpu-01", model="big", replica=0, generation=2)
    return path


def backdate(path: Path, messages: dict[str, float]) -> None:
    """Move the events with these messages that many seconds into the past."""
    with Store(path, actor="tester") as s, s._b.write():
        for message, age in messages.items():
            ids = [e.id for e in s.events(None) if e.message == message]
            assert ids, message
            for i in ids:
                s._b._db.execute("UPDATE events SET at = at - ? WHERE id=?", (age, i))


def test_json_is_the_events_newest_last_with_exactly_their_fields(tmp_path: Path) -> None:
    populate(tmp_path)
    got = events_json(tmp_path)
    assert [e["kind"] for e in got] == ["node-ready", "discover", "cordon", "failed", "ready", "starting"]
    assert all(list(e) == KEYS for e in got)
    assert [e["at"] for e in got] == sorted(e["at"] for e in got)
    assert all(isinstance(e["at"], float) and abs(e["at"] - time.time()) < 60 for e in got)
    assert {e["actor"] for e in got} == {"tester"}
    cordon, failed = got[2], got[3]
    assert cordon == {**cordon, "node": "gpu-03", "replica": None, "generation": None, "message": "ECC storm"}
    assert failed == {
        "at": failed["at"], "kind": "failed", "node": "gpu-02", "replica": "tiny/0", "generation": 3,
        "actor": "tester", "message": "tiny/0 exited 1", "detail": {"rc": 1},
    }  # fmt: skip
    assert got[0]["node"] == "gpu-01" and got[0]["replica"] is None


def test_yaml_holds_the_same_events(tmp_path: Path) -> None:
    populate(tmp_path)
    r = run(tmp_path, "events", "-o", "yaml")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout) == {"events": events_json(tmp_path)}


def test_lines_gives_the_newest_n(tmp_path: Path) -> None:
    populate(tmp_path)
    assert [e["message"] for e in events_json(tmp_path, "-n", "2")] == ["tiny/1 ready", "big/0 starting"]
    assert [e["kind"] for e in events_json(tmp_path, "--lines", "1")] == ["starting"]
    assert events_json(tmp_path, "-n", "0") == []
    assert len(events_json(tmp_path, "-n", "100")) == 6


def test_lines_defaults_to_the_last_50(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with Store(path, actor="tester") as s:
        for i in range(60):
            s.record_event("note", f"note {i}")
    got = events_json(tmp_path)
    assert [e["message"] for e in got] == [f"note {i}" for i in range(10, 60)]


def test_since_a_duration_or_an_iso_time(tmp_path: Path) -> None:
    path = populate(tmp_path)
    backdate(path, {"ECC storm": 3 * 3600, "tiny/0 exited 1": 20 * 60})
    assert [e["kind"] for e in events_json(tmp_path, "--since", "10m")] == ["node-ready", "discover", "ready",
                                                                              "starting"]  # fmt: skip
    assert [e["kind"] for e in events_json(tmp_path, "--since", "2h")] == ["node-ready", "discover", "failed",
                                                                             "ready", "starting"]  # fmt: skip
    assert len(events_json(tmp_path, "--since", "1d")) == 6
    assert len(events_json(tmp_path, "--since", "7d")) == 6
    assert len(events_json(tmp_path, "--since", "30s")) == 4
    # An ISO-8601 time: local when it names no zone, or with its zone.
    ten_minutes_ago = datetime.fromtimestamp(time.time() - 600)
    assert [e["kind"] for e in events_json(tmp_path, "--since", ten_minutes_ago.isoformat(timespec="seconds"))] == [
        "node-ready", "discover", "ready", "starting"
    ]  # fmt: skip
    utc = datetime.fromtimestamp(time.time() - 4 * 3600).astimezone().isoformat()
    assert len(events_json(tmp_path, "--since", utc)) == 6
    # The oldest of the window is still the newest-last order, and -n still counts from the newest.
    assert [e["kind"] for e in events_json(tmp_path, "--since", "2h", "-n", "2")] == ["ready", "starting"]


@pytest.mark.parametrize("bad", ["5x", "yesterday", "10", "-1h", "2h30m", ""])
def test_a_bad_since_is_one_error_line_exit_2(tmp_path: Path, bad: str) -> None:
    populate(tmp_path)
    r = run(tmp_path, "events", "--since", bad)
    assert r.exit_code == 2
    assert r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: --since ") and repr(bad) in line


def test_node_filter(tmp_path: Path) -> None:
    populate(tmp_path)
    assert [e["kind"] for e in events_json(tmp_path, "--node", "gpu-01")] == ["node-ready", "starting"]
    assert [e["message"] for e in events_json(tmp_path, "--node", "gpu-03")] == ["ECC storm"]
    assert events_json(tmp_path, "--node", "gpu-99") == []


def test_replica_filter_by_model_or_model_slash_n(tmp_path: Path) -> None:
    populate(tmp_path)
    assert [e["replica"] for e in events_json(tmp_path, "--replica", "tiny")] == ["tiny/0", "tiny/1"]
    assert [e["message"] for e in events_json(tmp_path, "--replica", "tiny/1")] == ["tiny/1 ready"]
    assert [e["replica"] for e in events_json(tmp_path, "--replica", "big/0")] == ["big/0"]
    assert events_json(tmp_path, "--replica", "tiny/7") == []
    # Filters combine.
    assert events_json(tmp_path, "--replica", "tiny", "--node", "gpu-01") == []
    assert [e["kind"] for e in events_json(tmp_path, "--replica", "tiny", "--node", "gpu-02", "-n", "1")] == ["ready"]
    r = run(tmp_path, "events", "--replica", "tiny/x")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "--replica 'tiny/x'" in r.stderr


def test_kind_filter_counts_n_among_matching_events(tmp_path: Path) -> None:
    path = populate(tmp_path)
    with Store(path, actor="tester") as s:
        for i in range(30):
            s.record_event("note", f"note {i}")
    assert [e["kind"] for e in events_json(tmp_path, "--kind", "cordon", "--kind", "failed")] == ["cordon", "failed"]
    assert [e["kind"] for e in events_json(tmp_path, "--kind", "cordon,failed", "-n", "1")] == ["failed"]
    assert [e["message"] for e in events_json(tmp_path, "--kind", "note", "-n", "2")] == ["note 28", "note 29"]
    r = run(tmp_path, "events", "--kind", "bogus")
    assert r.exit_code == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: --kind 'bogus'") and "cordon" in line


def test_table_columns_local_time_and_dashes(tmp_path: Path) -> None:
    path = populate(tmp_path)
    r = run(tmp_path, "events")
    assert r.exit_code == 0, r.output
    head, _rule, *rows = r.stdout.splitlines()
    assert head.split() == ["TIME", "KIND", "NODE", "REPLICA", "ACTOR", "MESSAGE"]
    assert len(rows) == 6
    with Store(path, readonly=True) as s:
        failed = next(e for e in s.events(None) if e.kind == "failed")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failed.at))
    assert rows[3].split() == [*when.split(), "failed", "gpu-02", "tiny/0", "g3", "tester", "tiny/0", "exited", "1"]
    cordon = rows[2].split()
    assert cordon[2:] == ["cordon", "gpu-03", "-", "tester", "ECC", "storm"]


def test_table_shows_hostile_text_as_text(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    with Store(path, actor="tester") as s:
        s.record_event("note", "[bold red]fake[/] \x1b[2Jcleared\nsecond line", node="[n]")
    r = run(tmp_path, "events")
    assert r.exit_code == 0, r.output
    (row,) = r.stdout.splitlines()[2:]
    assert "[bold red]fake[/]" in row and "[n]" in row
    assert "\x1b" not in r.stdout and "\\x1b[2Jcleared\\nsecond line" in row


def test_an_empty_log_says_so(tmp_path: Path) -> None:
    Store(tmp_path / "state.db").close()
    r = run(tmp_path, "events")
    assert r.exit_code == 0 and r.stdout == ""
    assert r.stderr.strip() == "no events yet"
    assert events_json(tmp_path) == []


def test_no_state_is_one_error_line_exit_2_and_creates_nothing(tmp_path: Path) -> None:
    for args in (["events"], ["events", "-o", "json"], ["events", "-f"], ["events", "--keep", "7d"]):
        r = run(tmp_path, *args)
        assert r.exit_code == 2, args
        assert r.stdout == ""
        (line,) = r.stderr.splitlines()
        assert line.startswith("error: ") and str(tmp_path / "state.db") in line and "no state" in line
    assert not (tmp_path / "state.db").exists()


def test_keep_and_keep_max_set_the_retention_and_prune(tmp_path: Path) -> None:
    path = populate(tmp_path)
    backdate(path, {"ECC storm": 3 * 86400})
    r = run(tmp_path, "events", "--keep", "2d")
    assert r.exit_code == 0, r.output
    assert "2d" in r.stdout
    with Store(path, readonly=True) as s:
        assert s.retention().days == 2
        assert "ECC storm" not in [e.message for e in s.events(None)]
    r = run(tmp_path, "events", "--keep-max", "2", "-o", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"retention": {"days": 2.0, "max_events": 2}}
    assert [e["kind"] for e in events_json(tmp_path)] == ["ready", "starting"]
    r = run(tmp_path, "events", "--keep", "forever")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1 and "--keep 'forever'" in r.stderr
    with Store(path, readonly=True) as s:
        assert s.retention().days == 2 and s.retention().max_events == 2


def test_help_has_examples_and_says_json_lines() -> None:
    r = runner.invoke(app, ["events", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "Examples:" in r.output and "clusterctl events -f" in r.output
    assert "JSON Lines" in r.output
    for option in ("--follow", "--lines", "--since", "--node", "--replica", "--kind", "--keep", "--output"):
        assert option in r.output


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


@pytest.mark.slow
def test_follow_prints_new_events_as_json_lines_until_ctrl_c(tmp_path: Path) -> None:
    path = populate(tmp_path)
    p = subprocess.Popen(
        [sys.executable, "-m", "cluster_cli", "--state", str(path), "events", "-f", "-o", "json", "-n", "1",
         "--replica", "tiny", "--kind", "ready,restarted,stopped"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # even under a shell that ignores it
    )  # fmt: skip
    got: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(p.stdout, got), daemon=True).start()
    try:
        first = json.loads(got.get(timeout=30))  # the newest before it started: it is following now
        assert first["message"] == "tiny/1 ready"
        with Store(path, actor="writer") as s:
            s.record_event("note", "not about tiny", node="gpu-09")
            s.record_event("note", "about tiny, not of those kinds", model="tiny", replica=0)
            s.record_event("restarted", "tiny/0 restarted", node="gpu-02", model="tiny", replica=0, generation=4)
        new = json.loads(got.get(timeout=15))
        assert new == {**new, "kind": "restarted", "replica": "tiny/0", "generation": 4, "actor": "writer"}
        with Store(path, actor="writer") as s:
            s.record_event("stopped", "tiny/1 stopped", model="tiny", replica=1, generation=1)
        assert json.loads(got.get(timeout=15))["message"] == "tiny/1 stopped"
    finally:
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    stderr = p.stderr.read()
    assert rc == 0, stderr
    assert "Traceback" not in stderr and stderr == ""
    assert got.empty()  # nothing else: neither note matched


def test_follow_refuses_a_state_of_an_older_schema_it_could_only_read_a_copy_of(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript((Path(__file__).parent / "fixtures" / "state" / "v2-landed.sql").read_text())
    db.close()
    r = CliRunner().invoke(app, ["--state", str(path), "events", "-f"])
    assert r.exit_code == 2 and "the state is at schema 2" in r.output, r.output
    r = CliRunner().invoke(app, ["--state", str(path), "events", "-o", "json"])  # without -f: read as it is
    assert r.exit_code == 0 and json.loads(r.stdout)["events"][0]["kind"] == "discover"
