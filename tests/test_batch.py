"""The probe batch: many commands as one remote exec, split back exactly (run locally with sh)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_cli.probe.batch import build_command, parse_records


def run_local(commands: dict[str, str], timeout: float = 5.0):
    command, token = build_command(commands, per_command_timeout_s=timeout)
    p = subprocess.run(command, shell=True, capture_output=True, timeout=30)
    return p.returncode, parse_records(commands, p.stdout, token)


def test_results_rc_stdout_stderr_per_command() -> None:
    rc, res = run_local(
        {
            "ok": "printf 'a, b\\nc'",
            "err": "echo oops >&2; exit 3",
            "missing": "definitely-not-a-command-xyz",
            "quote": "echo \"it's\" '$HOME'",
        }
    )
    assert rc == 0
    assert (res["ok"].rc, res["ok"].stdout, res["ok"].stderr) == (0, "a, b\nc", "")
    assert (res["err"].rc, res["err"].stdout, res["err"].stderr) == (3, "", "oops\n")
    assert res["missing"].rc == 127
    assert res["quote"].stdout == "it's $HOME\n"


def test_a_hung_command_times_out_alone() -> None:
    _, res = run_local({"hang": "sleep 30", "fine": "echo fine"}, timeout=1)
    assert res["hang"].rc in (124, 137) and "timed out" in res["hang"].stderr
    assert res["fine"].rc == 0 and res["fine"].stdout == "fine\n"


def test_commands_run_in_parallel() -> None:
    # Three commands that each wait for the others' marker files can only finish if run at once.
    d = "/tmp/clusterctl-batch-par"
    cmds = {
        str(i): f"mkdir -p {d}; touch {d}/{i}; n=0; while [ $(ls {d} | wc -l) -lt 3 ] && [ $n -lt 50 ]; "
        f"do sleep 0.1; n=$((n+1)); done; [ $n -lt 50 ] && echo together"
        for i in range(3)
    }
    subprocess.run(["rm", "-rf", d], check=True)
    _, res = run_local(cmds)
    assert [r.stdout for r in res.values()] == ["together\n"] * 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_arbitrary_bytes_split_exactly(tmp_path_factory, payloads: list[bytes]) -> None:
    d: Path = tmp_path_factory.mktemp("payloads")
    cmds = {}
    for i, data in enumerate(payloads):
        (d / str(i)).write_bytes(data)
        cmds[f"c{i}"] = f"cat {d / str(i)}"
    _, res = run_local(cmds)
    for i, data in enumerate(payloads):
        assert res[f"c{i}"].stdout == data.decode("utf-8", "replace")


@settings(max_examples=300)
@given(st.binary(max_size=2000), st.text(alphabet="0123456789abcdef", min_size=1, max_size=16))
def test_parse_never_raises(blob: bytes, token: str) -> None:
    res = parse_records({"a": "x", "b": "y"}, blob, token)
    assert set(res) == {"a", "b"}


def test_cut_short_output_means_no_result() -> None:
    cmds = {"a": "echo 1", "b": "echo 2"}
    command, token = build_command(cmds, per_command_timeout_s=5)
    out = subprocess.run(command, shell=True, capture_output=True, timeout=30).stdout
    res = parse_records(cmds, out[: len(out) - 1], token)  # the node died during the last byte
    assert res["a"].rc == 0 and res["b"].rc is None


def test_a_cut_in_an_early_record_never_shifts_output_into_later_ones() -> None:
    cmds = {"a": "echo first-output", "b": "echo 2", "c": "echo 3"}
    command, token = build_command(cmds, per_command_timeout_s=5)
    out = subprocess.run(command, shell=True, capture_output=True, timeout=30).stdout
    cut = out.index(b"first-output") + 5
    res = parse_records(cmds, out[:cut], token)
    assert all(r.rc is None for r in res.values())
