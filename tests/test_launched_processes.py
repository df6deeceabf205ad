"""discover knows the engines clusterctl launched: a GPU process carrying the launch marker
of a replica the state records (an engine's worker, whatever its PID) is that replica's own,
not a foreign process; one with another marker, or none, stays foreign."""

from __future__ import annotations

import os
import subprocess
import time

from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.config.inventory import Inventory, Node
from cluster_cli.probe.batch import BATCH_SHELL, build_script, parse_records
from cluster_cli.probe.collect import facts_from_outputs
from cluster_cli.probe.commands import LAUNCHED_AFTER_APPS
from cluster_cli.probe.parsers.host import parse_launched
from cluster_cli.ssh.session import CommandResult

INV = Inventory(gpu_classes={"A100": ["NVIDIA A100 80GB PCIe"]}, nodes=[Node(name="gpu-01", host="198.18.0.10")])
GPUS = "".join(
    f"{i}, GPU-aaaa0000-0000-0000-0000-00000000000{i}, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:{17 + i}:00.0, "
    "0, Disabled, No, No\n"
    for i in range(2)
)
APPS = "GPU-aaaa0000-0000-0000-0000-000000000001, 4411, 40960, VLLM::Worker_TP1\n"
TOKEN = "llama/0.g1.s0.0123456789abcdef"


def _facts(launched: str | None, tokens: frozenset[str]):
    outs = {
        "gpus": CommandResult(0, GPUS),
        "apps": CommandResult(0, APPS),
        "cpus": CommandResult(0, "64\n"),
        "meminfo": CommandResult(0, "MemTotal: 1000000 kB\n"),
    }
    if launched is not None:
        outs["launched"] = CommandResult(0, launched)
    return facts_from_outputs(INV, INV.nodes[0], outs, own_tokens=tokens)


def test_a_worker_with_a_recorded_marker_is_the_replicas_own() -> None:
    rec = f"/proc/4411/environ:CLUSTERCTL_RUN={TOKEN}\0/proc/99/environ:CLUSTERCTL_RUN=other\0"
    gpu = _facts(rec, frozenset({TOKEN})).gpus[1]
    assert not any(p.startswith("foreign-process") for p in gpu.problems), gpu.problems


def test_a_marker_the_state_does_not_record_or_none_leaves_it_foreign() -> None:
    for launched, tokens in (
        (f"/proc/4411/environ:CLUSTERCTL_RUN={TOKEN}\0", frozenset({"someone/else"})),
        ("/proc/12/environ:CLUSTERCTL_RUN=x\0", frozenset({TOKEN})),
        (None, frozenset({TOKEN})),
    ):
        gpu = _facts(launched, tokens).gpus[1]
        assert any(p.startswith("foreign-process: pid 4411") for p in gpu.problems), (launched, gpu.problems)


def test_parse_launched_reads_grep_records_and_skips_the_rest() -> None:
    text = (
        "/proc/12/environ:CLUSTERCTL_RUN=a/0.g1.s0.x\0"
        "/proc/13/environ:CLUSTERCTL_RUN=b/1.g2.s1.y\n"
        "/proc/xx/environ:CLUSTERCTL_RUN=bad-pid\0"
        "garbage\0/proc/14/environ:OTHER=1\0/proc/15/environ:CLUSTERCTL_RUN=\0"
    )
    assert parse_launched(text) == {12: "a/0.g1.s0.x", 13: "b/1.g2.s1.y"}


@given(st.text())
def test_parse_launched_never_raises(text: str) -> None:
    got = parse_launched(text)
    assert all(isinstance(k, int) and v for k, v in got.items())


def test_the_probe_batch_reads_the_markers_of_the_nodes_processes() -> None:
    """The snippet runs in the real batch (a local sh here): it lists a marked process."""
    env = {**os.environ, "CLUSTERCTL_RUN": TOKEN}
    proc = subprocess.Popen(["sleep", "30"], env=env)
    try:
        time.sleep(0.1)
        commands = {"apps": f"echo {APPS.strip()!r}"}
        script, token = build_script(commands, per_command_timeout_s=5, then={"apps": LAUNCHED_AFTER_APPS})
        out = subprocess.run(BATCH_SHELL, shell=True, input=script.encode(), capture_output=True, timeout=30).stdout
        records = parse_records(commands, out, token)
        assert records["launched"].rc in (0, 2)  # 2: a process ended while grep read it
        assert parse_launched(records["launched"].stdout).get(proc.pid) == TOKEN
    finally:
        proc.kill()
        proc.wait()
