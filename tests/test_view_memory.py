"""What discover remembers across runs where a probe failed: ports down and GPUs seen stay said.

Each run is what ``clusterctl discover`` does with one node's new facts: ``note_changes``
against the stored facts, then those facts are what the store keeps (JSON round trip).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from helpers import cpu_node, dgx

from cluster_cli.cli.discover import gpu_summary
from cluster_cli.facts import NodeFacts, problem_key
from cluster_cli.state.store import Store
from cluster_cli.state.view import note_changes

IBSTAT_FAILED = "ibstat: failed (rc 255): ibpanic: [12] main: stat of IB device 'mlx5_0' failed"
SMI_FAILED = "nvidia-smi: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver (rc 9)"


def discover_runs(*runs: NodeFacts) -> list[NodeFacts]:
    """The facts stored after each run, as ``discover`` computes them from the ones before."""
    stored: NodeFacts | None = None
    out = []
    for t, new in enumerate(runs):
        f = note_changes(replace(new, probed_at=60.0 * t), stored)
        stored = NodeFacts.from_dict(f.to_dict())  # what the store keeps
        out.append(stored)
    return out


def keyed(f: NodeFacts, key: str) -> list[str]:
    return [p for p in f.problems if problem_key(p) == key]


def four_a100(name: str = "g") -> NodeFacts:
    g = dgx(name, cls="A100")
    return replace(g, gpus=g.gpus[:4], nvlink_domains=((0, 1, 2, 3),))


def smi_failing(f: NodeFacts) -> NodeFacts:
    """nvidia-smi installed but failing (rc 9): no GPU listed, a problem says why."""
    return replace(f, gpus=(), nvlink_domains=None, problems=(*f.problems, SMI_FAILED))


def smi_missing(f: NodeFacts) -> NodeFacts:
    """nvidia-smi not found (rc 127): reads as a CPU node."""
    return replace(f, gpus=(), nvlink_domains=())


# ---- bug 3: ib-port-down through runs where ibstat fails ------------------------------


def test_ports_down_stay_said_while_ibstat_keeps_failing_and_go_once_they_are_active() -> None:
    good = dgx("g")  # 8 Active ports
    failing = replace(good, hcas=(), problems=(IBSTAT_FAILED,))
    runs = discover_runs(good, failing, failing, failing, good)
    first = keyed(runs[1], "ib-port-down")
    assert len(first) == 8
    assert first[0] == "ib-port-down: mlx5_0 port 1 was Active on ib-a at the last discover, now missing from ibstat"
    assert keyed(runs[2], "ib-port-down") == first  # the old facts had no ports: still said
    assert keyed(runs[3], "ib-port-down") == first
    assert runs[4].problems == ()  # Active again: gone


def test_ports_carried_through_a_failed_ibstat_go_one_by_one_as_each_is_active_again() -> None:
    good = dgx("g")
    failing = replace(good, hcas=(), problems=(IBSTAT_FAILED,))
    down = replace(good.hcas[5], state="Down", physical_state="Polling")
    partly = replace(good, hcas=(*good.hcas[:5], down, *good.hcas[6:7]))  # mlx5_5 Down, mlx5_7 missing
    runs = discover_runs(good, failing, partly, partly, good)
    said = [p.split(" was ")[0] for p in keyed(runs[2], "ib-port-down")]
    assert said == ["ib-port-down: mlx5_5 port 1", "ib-port-down: mlx5_7 port 1"]
    assert keyed(runs[3], "ib-port-down") == keyed(runs[2], "ib-port-down")
    assert runs[4].problems == ()


def test_a_port_down_before_ibstat_failed_is_still_said_after() -> None:
    good = dgx("g")
    down = replace(good.hcas[2], state="Down", physical_state="Disabled")
    one_down = replace(good, hcas=(*good.hcas[:2], down, *good.hcas[3:]))
    failing = replace(good, hcas=(), problems=(IBSTAT_FAILED,))
    runs = discover_runs(good, one_down, failing, failing, one_down, good)
    (problem,) = keyed(runs[1], "ib-port-down")
    assert problem == "ib-port-down: mlx5_2 port 1 was Active on ib-a at the last discover, now Down (Disabled)"
    for r in runs[2:4]:
        assert problem in r.problems and len(set(keyed(r, "ib-port-down"))) == len(keyed(r, "ib-port-down"))
    assert keyed(runs[4], "ib-port-down") == [problem]  # listed again, still Down: the same words
    assert runs[5].problems == ()


def test_a_node_without_infiniband_gets_no_port_problem_when_ibstat_fails() -> None:
    c = cpu_node("c")
    runs = discover_runs(c, replace(c, problems=(IBSTAT_FAILED,)), replace(c, problems=(IBSTAT_FAILED,)), c)
    assert [keyed(r, "ib-port-down") for r in runs] == [[], [], [], []]


# ---- bug 4: GPUs seen are not forgotten through a failed nvidia-smi -------------------


def test_a_gpu_node_does_not_quietly_turn_cpu_only_after_a_failed_nvidia_smi() -> None:
    g = four_a100()
    runs = discover_runs(g, smi_failing(g), smi_missing(g), smi_missing(g))
    assert gpu_summary(runs[1]) == "unknown" and SMI_FAILED in runs[1].problems
    (gone,) = keyed(runs[2], "gpus-gone")
    assert gone == (
        "gpus-gone: nvidia-smi shows no GPU here (not installed, or not on PATH, or no driver), "
        "but an earlier discover (1970-01-01 00:00 UTC) saw 4 A100"
    )
    assert gpu_summary(runs[2]) == "none (gone)"
    assert keyed(runs[3], "gpus-gone") == [gone]  # said on every discover until they are back


def test_gpus_stay_remembered_through_several_failed_discovers_and_after_gpus_gone() -> None:
    g = four_a100()
    runs = discover_runs(g, smi_failing(g), smi_failing(g), smi_missing(g), smi_failing(g), smi_missing(g))
    assert all(gpu_summary(r) == "unknown" for r in (runs[1], runs[2], runs[4]))
    assert all("saw 4 A100" in keyed(r, "gpus-unlisted")[0] for r in (runs[1], runs[2], runs[4]))
    for r in (runs[3], runs[5]):
        (gone,) = keyed(r, "gpus-gone")
        assert gone.endswith("discover (1970-01-01 00:00 UTC) saw 4 A100"), gone


def test_gpus_gone_after_a_good_discover_keeps_its_words_then_survives_a_failed_one() -> None:
    g = dgx("g", cls="H200")
    runs = discover_runs(g, smi_missing(g), smi_failing(g), smi_missing(g))
    (gone,) = keyed(runs[1], "gpus-gone")
    assert gone == (
        "gpus-gone: nvidia-smi shows no GPU here (not installed, or not on PATH, or no driver), "
        "but the last discover (1970-01-01 00:00 UTC) saw 8 H200"
    )  # the words of a gpus-gone straight after a good discover
    assert gpu_summary(runs[2]) == "unknown" and keyed(runs[2], "gpus-unlisted")
    (again,) = keyed(runs[3], "gpus-gone")
    assert again.endswith("discover (1970-01-01 00:00 UTC) saw 8 H200"), again


def test_the_problems_go_away_once_nvidia_smi_lists_the_gpus_again() -> None:
    g = four_a100()
    runs = discover_runs(g, smi_failing(g), g, smi_failing(g), smi_missing(g), g)
    assert runs[2].problems == () and gpu_summary(runs[2]) == "4/4 A100"
    assert runs[5].problems == () and gpu_summary(runs[5]) == "4/4 A100"


def test_a_node_that_was_always_cpu_only_never_gets_a_gpu_problem() -> None:
    c = cpu_node("c")
    runs = discover_runs(c, smi_failing(c), smi_missing(c), smi_failing(c), c, smi_missing(c))
    for r in runs:
        assert not keyed(r, "gpus-gone") and not keyed(r, "gpus-unlisted"), r.problems
    assert [gpu_summary(r) for r in runs] == ["-", "unknown", "-", "unknown", "-", "-"]


def test_through_the_store_the_cordon_stays_and_the_gpus_are_remembered(tmp_path: Path) -> None:
    g, other = four_a100("g"), dgx("h")
    with Store(tmp_path / "s.db") as s:
        for t, (a, b) in enumerate([(g, other), (smi_failing(g), other), (smi_missing(g), other)]):
            before = {f.name: f for f in s.nodes(["g", "h"])}
            s.save_discovery([note_changes(replace(f, probed_at=60.0 * t), before.get(f.name)) for f in (a, b)])
            if t == 0:
                s.cordon("g", "bad fan")
        by = {f.name: f for f in s.nodes()}
    assert by["g"].cordoned and by["g"].cordon_reason == "bad fan"
    assert not by["h"].cordoned and by["h"].problems == ()
    (gone,) = keyed(by["g"], "gpus-gone")
    assert gone.endswith("saw 4 A100")
