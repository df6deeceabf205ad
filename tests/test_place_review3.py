"""Review fixes of placement (twelfth session): NVLink locality over the whole fleet, explanations
of the moment each replica was tried, CPU replicas beyond the node count, the counts of CPU
placements, nodes held out for several reasons, kept replicas whose HCAs went away, and facts
files with missing classes or values of the wrong type."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_cli_place import write_inputs
from test_placement_clusters import catalog, cpu_node, dgx, node, profile
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.placement import plan, render_plan

runner = CliRunner()
PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7)]


# --------------------------------------------------------------------------- NVLink, whole fleet


@pytest.mark.parametrize("before", [1, 63, 64, 200])
def test_a_tp_group_is_not_split_while_any_node_has_a_whole_domain(before: int) -> None:
    """``before`` nodes whose two free GPUs sit in different NVLink pairs come first in
    best-fit order; the last node has its two free GPUs in one pair: the group goes there,
    however many split-only nodes come before it."""
    split = {1: "ecc", 3: "ecc", 4: "ecc", 5: "ecc", 6: "ecc", 7: "ecc"}  # free: 0, 2
    whole = {2: "ecc", 3: "ecc", 4: "ecc", 5: "ecc", 6: "ecc", 7: "ecc"}  # free: 0, 1
    nodes = [node(f"n{i:03d}", cls="A100", gpus=8, problems=split, domains=PAIRS) for i in range(before)]
    nodes.append(node("z-last", cls="A100", gpus=8, problems=whole, domains=PAIRS))
    p = plan(nodes, catalog(("m", 1, [profile("tp2", gpu_class="A100", gpus=2)])))
    (start,) = p.starts
    assert [(s.node, s.gpus) for s in start.replica.shards] == [("z-last", (0, 1))]
    assert start.note == ""


def test_the_domain_index_follows_allocations() -> None:
    """Once the roomy node's pair is taken, the next TP-2 group has no whole pair anywhere and
    goes to the best fit, split (with its note); a third finds nothing."""
    split = {1: "ecc", 3: "ecc", 4: "ecc", 5: "ecc", 6: "ecc", 7: "ecc"}
    whole = {2: "ecc", 3: "ecc", 4: "ecc", 5: "ecc", 6: "ecc", 7: "ecc"}
    nodes = [node(f"n{i:03d}", cls="A100", gpus=8, problems=split, domains=PAIRS) for i in range(70)]
    nodes.append(node("z-last", cls="A100", gpus=8, problems=whole, domains=PAIRS))
    p = plan(nodes, catalog(("m", 3, [profile("tp2", gpu_class="A100", gpus=2)])))
    got = [(s.node, s.gpus) for st in p.starts for s in st.replica.shards]
    assert got == [("z-last", (0, 1)), ("n000", (0, 2)), ("n001", (0, 2))]
    assert [bool(st.note) for st in p.starts] == [False, True, True]


# --------------------------------------------------------------------------- explanations of the moment


def test_an_unplaced_replica_is_explained_by_the_allocations_when_it_was_tried() -> None:
    """a's tp8 fails on gpu-01 (4 ECC) and a falls back to tp4 there; b's tp8 (the same
    request) is tried after that: its reason counts a's 4 GPUs as allocated."""
    nodes = [dgx("gpu-01", problems={0: "ecc", 1: "ecc", 2: "ecc", 3: "ecc"})]
    cat = catalog(
        ("a", 1, [profile("tp8", gpu_class="H100", gpus=8, priority=10), profile("tp4", gpu_class="H100", gpus=4)]),
        ("b", 1, [profile("tp8", gpu_class="H100", gpus=8)]),
    )
    p = plan(nodes, cat)
    (a,) = p.starts
    assert a.attempts[0].profile == "tp8" and not a.attempts[0].placed
    (u,) = p.unplaced
    assert [r.detail for r in u.reasons] == ["0 of 8 H100 free (4 ECC, 4 allocated), profile needs 8"]
    assert "      gpu-01: 0 of 8 H100 free (4 ECC, 4 allocated), profile needs 8" in render_plan(p)
    # a's own fallback line still says how tp8 failed for a: 4 free then.
    assert a.attempts[0].metrics.reasons == {"insufficient gpus": 1}


# --------------------------------------------------------------------------- CPU replicas


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of the planner's ``name`` (a method of ``_Planner`` or a function it imported)."""
    from cluster_cli.placement import placer

    calls = [0]
    owner = placer._Planner if hasattr(placer._Planner, name) else placer
    real = getattr(owner, name)

    def counted(*a: object, **kw: object) -> object:
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_cpu_replicas_beyond_the_node_count_spread_evenly(monkeypatch: pytest.MonkeyPatch) -> None:
    """More replicas of one model than nodes: every node gets one before any gets a second,
    and so on (not all extra ones on the first node), each replica looking at a few nodes (the
    old placer looked at every node for each replica past the node count: 50 x 80 here)."""
    fits = _counting(monkeypatch, "_cpu_fits")
    nodes = [cpu_node(f"n{i:03d}", cpus=1024) for i in range(50)]
    p = plan(nodes, catalog(("m", 130, [profile("c", engine="llamacpp", cpus=1)])))
    per: dict[str, int] = {}
    for st in p.starts:
        per[st.replica.shards[0].node] = per.get(st.replica.shards[0].node, 0) + 1
    assert sorted(per.values()) == [2] * 20 + [3] * 30
    assert not p.unplaced
    assert fits[0] <= 3 * 130 + 50, fits[0]


def test_cpu_replicas_on_a_mixed_fleet_take_every_node_then_the_gpu_less_ones_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU-less nodes come first in spread order, so once each has a replica they stand before
    every GPU host without one: set aside for each further replica, that was quadratic. Now
    the model gets a heap of its own: each node once, then the GPU-less ones again."""
    fits = _counting(monkeypatch, "_cpu_fits")
    nodes = [cpu_node(f"c{i:03d}", cpus=1024) for i in range(100)] + [dgx(f"g{i:03d}") for i in range(100)]
    p = plan(nodes, catalog(("m", 300, [profile("c", engine="llamacpp", cpus=1)])))
    per: dict[str, int] = {}
    for st in p.starts:
        per[st.replica.shards[0].node] = per.get(st.replica.shards[0].node, 0) + 1
    assert {n: k for n, k in per.items() if n.startswith("c")} == {f"c{i:03d}": 2 for i in range(100)}
    assert {n: k for n, k in per.items() if n.startswith("g")} == {f"g{i:03d}": 1 for i in range(100)}
    assert fits[0] < 2000, fits[0]  # set aside 100 nodes per replica: 20,000


def test_nodes_too_small_are_looked_at_once_per_request_not_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many CPU models asking for the same: a node that cannot take it is dropped once for all."""
    from cluster_cli.placement import placer

    checks = [0]
    real = placer.CAPACITY

    class Counting:
        name = real.name

        def check(self, node: object, req: object) -> object:
            checks[0] += 1
            return real.check(node, req)  # type: ignore[arg-type]

    monkeypatch.setattr(placer, "CAPACITY", Counting())
    nodes = [cpu_node(f"c{i:04d}", cpus=1024 if i % 100 == 0 else 8) for i in range(1000)]
    p = plan(nodes, catalog(*[(f"m{j}", 2, [profile("cpu", engine="llamacpp", cpus=16)]) for j in range(20)]))
    assert len(p.starts) == 40 and not p.unplaced
    assert checks[0] == 990  # each small node once (the big ones fit)
    # Each model's counts still name the small ones it skipped.
    assert p.starts[-1].attempts[-1].metrics.exhausted_by == {"cpus": 990}


def test_an_unplaced_model_is_explained_again_only_after_allocations_of_its_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A B200 model no node can take is explained once: H100 replicas placed between its
    replicas' attempts cannot change why (each explanation is a pass over the whole fleet)."""
    calls = _counting(monkeypatch, "explain_request")
    models = []
    for j in range(5):
        models += [(f"big{j}", 1, [profile("b200", gpu_class="B200", gpus=8)])]
        models += [(f"small{j}", 1, [profile("tp1", gpu_class="H100", gpus=1)])]
    p = plan([dgx(f"g{i:02d}") for i in range(10)], catalog(*models))
    assert len(p.unplaced) == 5 and len(p.starts) == 5
    assert calls[0] == 1


def test_cpu_counts_say_unknown_resources_as_the_explanation_does_and_that_they_are_partial() -> None:
    cat = catalog(("m", 1, [profile("c", engine="llamacpp", cpus=32, memory_gib=64)]))
    nodes = [cpu_node("a-small", cpus=4), cpu_node("b-unknown", cpus=None), cpu_node("c-big", cpus=64)]
    p = plan(nodes, cat)
    (start,) = p.starts
    m = start.attempts[-1].metrics
    assert m.filtered_by == {"capacity": 1} and m.exhausted_by == {"cpus": 1}
    assert m.reasons == {"resources unknown": 1, "insufficient cpus": 1}
    line = next(x for x in render_plan(p) if " on c:" in x)
    assert line == (
        "  m [0] on c: 3 nodes evaluated; 1 node filtered: capacity 1; 1 node exhausted: cpus 1; "
        "capacity checked up to the first node that fits, in spread order"
    )
    # The same shape, where the first node in spread order fits: nothing counted past it, and said so.
    nodes = [cpu_node("a-big", cpus=64), cpu_node("b-small", cpus=4), cpu_node("c-unknown", cpus=None)]
    line = next(x for x in render_plan(plan(nodes, cat)) if " on c:" in x)
    assert line.endswith("3 nodes evaluated; capacity checked up to the first node that fits, in spread order")


def test_one_node_evaluated_is_singular() -> None:
    p = plan([dgx("h1")], catalog(("m", 1, [profile("tp8", gpu_class="H100", gpus=8)])))
    assert "  m [0] on tp8: 1 node evaluated" in render_plan(p)


# --------------------------------------------------------------------------- several reasons


def test_a_node_held_out_for_several_reasons_names_them_all_and_a_known_cpu_node_its_class() -> None:
    nodes = [
        cpu_node("cpu-1", cordoned=True),
        dgx("gpu-1", cls="A100", cordoned=True),
        dgx("gpu-2", problems={0: "ecc"}, cordoned=True, reachable=False),
    ]
    p = plan(nodes, catalog(("m", 1, [profile("h", gpu_class="H100", gpus=8)])))
    (u,) = p.to_dict()["unplaced"]
    got = {r["node"]: (r["constraint"], r["detail"]) for r in u["reasons"]}
    assert got["cpu-1"] == ("gpu-class", "no GPU, profile needs H100")
    assert got["gpu-1"] == ("gpu-class", "no H100 GPU (has 8 A100)")
    assert got["gpu-2"][0] == "cordoned"
    assert got["gpu-2"][1].startswith("cordoned (maintenance); also unreachable")
    (a,) = u["attempts"]
    assert a["metrics"]["filtered_by"] == {"cordoned": 1, "gpu-class": 2}
    # The same counts for a profile that fits elsewhere (the index counts as the explanation does).
    nodes.append(dgx("h100-1"))
    p = plan(nodes, catalog(("m", 1, [profile("h", gpu_class="H100", gpus=8)])))
    assert p.starts[0].attempts[0].metrics.filtered_by == {"cordoned": 1, "gpu-class": 2}


def test_a_cpu_node_whose_nvidia_smi_failed_is_not_taken_for_one_without_gpus() -> None:
    blind = replace(cpu_node("c1", cordoned=True), problems=("nvidia-smi: NVIDIA-SMI has failed (no driver)",))
    p = plan([blind], catalog(("m", 1, [profile("h", gpu_class="H100", gpus=8)])))
    (r,) = p.unplaced[0].reasons
    assert r.constraint == "cordoned"


# --------------------------------------------------------------------------- kept replicas' HCAs


@pytest.mark.parametrize("change", [{"state": "Down"}, {"fabric": "ib-b"}])
def test_a_kept_multi_node_replica_whose_hca_went_away_is_released_whole(change: dict[str, str]) -> None:
    cat = catalog(("m", 1, [profile("mn", gpu_class="H100", gpus=8, nodes=2)]))
    nodes = [dgx("a1"), dgx("a2")]
    rep = plan(nodes, cat).starts[0].replica
    assert "mlx5_3" in rep.shards[0].hcas
    nodes[0] = replace(nodes[0], hcas=tuple(replace(h, **change) if h.ca == "mlx5_3" else h for h in nodes[0].hcas))
    p = plan(nodes, cat, [rep])
    (stop,) = p.stops
    assert stop.note == "mlx5_3 of a1 is no longer Active on fabric ib-a"
    (start,) = p.starts
    assert "mlx5_3" not in start.replica.shards[0].hcas and not p.keeps


# --------------------------------------------------------------------------- order of the input


def test_two_nodes_of_one_name_give_one_plan_whatever_their_order() -> None:
    a, b = dgx("n1"), dgx("n1", cls="A100")
    cat = catalog(
        ("m", 1, [profile("h", gpu_class="H100", gpus=8, priority=2), profile("a", gpu_class="A100", gpus=8)])
    )
    assert plan([a, b], cat).to_dict() == plan([b, a], cat).to_dict()


def test_of_two_allocations_of_one_replica_the_valid_one_is_kept_whatever_their_order() -> None:
    """The invalid one (on a0, whose GPU 0 has an ECC error) comes first in the placer's own
    order: it is stopped for its fault, and the valid one is kept, not stopped as a duplicate."""
    cat = catalog(("m", 1, [profile("tp8", gpu_class="H100", gpus=8)]))
    nodes = [dgx("h1"), dgx("a0", problems={0: "ecc"})]
    good = plan(nodes[:1], cat).starts[0].replica
    bad = replace(good, shards=(replace(good.shards[0], node="a0"),))
    for current in ([good, bad], [bad, good]):
        p = plan(nodes, cat, current)
        assert [k.replica for k in p.keeps] == [good]
        ((stopped, note),) = [(s.replica, s.note) for s in p.stops]
        assert stopped == bad and note.startswith("GPU 0 of a0 is unhealthy (ecc")
        assert not p.starts


# --------------------------------------------------------------------------- facts files


def _facts(tmp_path: Path, doc: object, cat: str) -> object:
    inv, catp, _ = write_inputs(tmp_path, [cpu_node("n1")], catalog=cat)
    f = tmp_path / "f.json"
    f.write_text(json.dumps(doc))
    return runner.invoke(
        app,
        ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(catp), "--facts", str(f)],
    )


H100_CAT = """
engines: {vllm: {command: vllm}}
models:
  - name: m
    replicas: 1
    profiles:
      - {name: h, engine: vllm, gpu_class: H100 80GB HBM3, gpus: 8, model: /m}
"""


def test_facts_without_a_class_get_the_products_class(tmp_path: Path) -> None:
    gpus = [{"index": i, "uuid": f"GPU-{i}", "product": "NVIDIA H100 80GB HBM3"} for i in range(8)]
    r = _facts(tmp_path, {"nodes": [{"name": "n1", "cpus": 64, "memory_mib": 1 << 20, "gpus": gpus}]}, H100_CAT)
    assert r.exit_code == 0, r.output
    assert "n1 GPU 0-7" in r.stdout


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"name": "n1", "cpus": 16, "memory_mib": 65536, "problems": [5]}, "problems"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "state": "Active", "link_layer": "InfiniBand", "fabric": 5}]}, "fabric"),
        ({"name": "n1", "labels": {"rack": 3}}, "labels"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "problems": [1]}]}, "problems"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_lid": "x"}]}, "sm_lid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_guid": [1]}]}, "sm_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "sm_guid": 1.5}]}, "sm_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "port_guid": 1.5}]}, "port_guid"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "port_guid": "0xzz"}]}, "port_guid"),
        ({"name": "n1", "nvlink_domains": "0123"}, "nvlink_domains"),
        ({"name": "n1", "cordoned": True, "cordon_reason": 5}, "cordon_reason"),
        ({"name": "n1", "reachable": False, "error": 5}, "error"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "class": 5}]}, "class"),
        ({"name": "n1", "gpus": [{"index": 0, "uuid": "G", "product": "P", "processes": [{"pid": "x"}]}]}, "processes"),
        ({"name": "n1", "hcas": [{"name": "mlx5_0", "port": 1, "rate_gbps": "x"}]}, "rate_gbps"),
        ({"name": "n1", "nvlink_domains": [[0, True]]}, "nvlink_domains"),
    ],
)  # fmt: skip
def test_facts_of_the_wrong_type_are_a_one_line_error(tmp_path: Path, doc: dict, field: str) -> None:
    r = _facts(tmp_path, {"nodes": [doc]}, H100_CAT)
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert "f.json: nodes.0 (n1): invalid facts: " in line and f"{field}: expected" in line
