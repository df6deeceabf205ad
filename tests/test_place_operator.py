"""What ``place --dry-run`` tells an operator: TP groups split across NVLink domains are
noted, hand-written facts are believed, rejections name what would help first, and catalog
slips (a class in the wrong case, a product name, an odd tensor-parallel size) are warned
about with their line."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import a100_pcie, catalog, cpu_node, dgx, ib, l40s, node, profile, write_inputs
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.facts import Gpu, NodeFacts
from cluster_cli.placement import plan, render_plan

runner = CliRunner()
A100x2 = profile("tp2", gpu_class="A100", gpus=2)
H100x8 = profile("tp8", gpu_class="H100", gpus=8)


def _notes(p) -> dict[tuple[str, int], str]:
    return {(x.replica.model, x.replica.replica): x.note for x in p.placements}


# --------------------------------------------------------------------------- NVLink split


def test_a_tp_group_split_across_known_nvlink_domains_is_noted() -> None:
    """Pairs [0,1] [2,3] with GPUs 1 and 3 busy: the only room is 0 and 2, across pairs. The
    plan says so, as it does for an unknown topology (a known split is worse, not better)."""
    n = node("a-1", cls="A100", gpus=4, domains=[(0, 1), (2, 3)], problems={1: "foreign", 3: "foreign"})
    p = plan([n], catalog(("m", 1, [A100x2])))
    (x,) = p.placements
    assert x.replica.shards[0].gpus == (0, 2)
    assert x.note == "GPUs 0,2 of a-1 are not in one NVLink domain ([0,1] [2,3]): none had 2 free"
    assert "(GPUs 0,2 of a-1 are not in one NVLink domain" in "\n".join(render_plan(p))
    assert p.to_dict()["replicas"][0]["note"] == x.note


def test_a_tp_group_inside_one_domain_or_on_a_node_without_nvlink_has_no_note() -> None:
    pair = plan([a100_pcie("a-1")], catalog(("m", 1, [A100x2])))
    pcie = plan([l40s("l-1")], catalog(("m", 1, [profile("p", gpu_class="L40S", gpus=2)])))  # known: no NVLink
    assert _notes(pair) == {("m", 0): ""}
    assert _notes(pcie) == {("m", 0): ""}


# --------------------------------------------------------------------------- hand-written facts


def _gpu(**kw: object) -> dict[str, object]:
    return {"index": 0, "uuid": "GPU-x", "product": "NVIDIA A100-PCIE-40GB", "class": "A100", **kw}


def test_hand_written_flags_and_processes_keep_a_gpu_from_being_used() -> None:
    busy = Gpu.from_dict(_gpu(processes=[{"pid": 4411, "name": "python", "used_mib": 70000}]))
    not_free = Gpu.from_dict(_gpu(free=False))
    sick = Gpu.from_dict(_gpu(healthy=False))
    assert busy.problems == ("foreign-process: pid 4411 (python)",) and not busy.free
    assert not_free.problems == ("busy: marked not free in the facts",) and not not_free.free and not_free.healthy
    assert sick.problems == ("unhealthy: marked unhealthy in the facts",) and not sick.healthy and not sick.free


def test_facts_discover_wrote_read_back_unchanged() -> None:
    """discover leaves its own replicas' processes out of the problems: such a GPU stays free
    when read back, and every GPU reads back as it was written."""
    own = Gpu.from_dict(_gpu(processes=[{"pid": 7, "name": "vllm"}], problems=[], free=True, healthy=True))
    assert own.free and own.problems == ()
    for g in dgx("h", problems={0: "ecc", 1: "foreign", 2: "lost"}).gpus:
        assert Gpu.from_dict(g.to_dict()) == g


def test_place_with_a_hand_edited_facts_file_uses_only_the_free_gpu(tmp_path: Path) -> None:
    gpus = [
        _gpu(index=0, uuid="GPU-0", processes=[{"pid": 4411, "name": "python"}]),
        _gpu(index=1, uuid="GPU-1", free=False),
        _gpu(index=2, uuid="GPU-2", healthy=False),
        _gpu(index=3, uuid="GPU-3"),
    ]
    inv, cat, facts = write_inputs(tmp_path, [], inventory_nodes=["a-1"], catalog=(
        "models:\n  - {name: m, replicas: 2, profiles: [{name: one, engine: vllm, gpu_class: A100, gpus: 1, model: /m}]}\n"
    ))  # fmt: skip
    facts.write_text(json.dumps({"nodes": [{"name": "a-1", "reachable": True, "gpus": gpus, "nvlink_domains": None}]}))
    r = runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(cat),
                            "--facts", str(facts), "-o", "json"])  # fmt: skip
    assert r.exit_code == 3, r.output
    doc = json.loads(r.stdout)
    assert [s["gpus"] for x in doc["replicas"] for s in x["shards"]] == [[3]]
    (reason,) = doc["unplaced"][0]["reasons"]
    assert (
        reason["detail"]
        == "0 of 4 A100 free (1 allocated, 1 foreign process pid 4411, 1 busy, 1 unhealthy), profile needs 1"
    )


# --------------------------------------------------------------------------- what would help first


def test_a_cordoned_or_unreachable_node_of_another_class_is_explained_by_its_class() -> None:
    """Uncordoning an A100 node would not help an H100 profile: its reason is the class. A
    cordoned H100 node, and a node never reached (GPUs unknown), keep theirs."""
    nodes = [
        a100_pcie("a-cordoned", cordoned=True),
        a100_pcie("a-down", reachable=False),
        dgx("h-cordoned", cordoned=True),
        node("never", reachable=False, cpus=None, memory_gib=None),
        dgx("h-busy", problems={i: "foreign" for i in range(8)}),
    ]
    p = plan(nodes, catalog(("m", 1, [H100x8])))
    (u,) = p.unplaced
    got = {r.node: (r.constraint, r.detail) for r in u.reasons}
    assert got["a-cordoned"] == ("gpu-class", "no H100 GPU (has 8 A100)")
    assert got["a-down"] == ("gpu-class", "no H100 GPU (has 8 A100)")
    assert got["h-cordoned"] == ("cordoned", "cordoned (maintenance)")
    assert got["never"][0] == "reachable"
    assert u.attempts[0].metrics.filtered_by == {"cordoned": 1, "gpu-class": 2, "reachable": 1}


def test_success_counts_agree_with_the_explanation() -> None:
    """The counts of a placed profile come from the index, not the constraint chain: they must
    say the same (a cordoned A100 node is filtered by class for an H100 profile)."""
    nodes = [a100_pcie("a-cordoned", cordoned=True), dgx("h-cordoned", cordoned=True), dgx("h-1")]
    p = plan(nodes, catalog(("m", 1, [H100x8])))
    (x,) = p.placements
    (won,) = [a for a in x.attempts if a.placed]
    assert won.metrics.filtered_by == {"cordoned": 1, "gpu-class": 1}
    # The same nodes with no room at all: the failure's explanation counts them alike.
    p = plan([*nodes[:2], dgx("h-1", problems={0: "ecc"})], catalog(("m", 1, [H100x8])))
    assert p.unplaced[0].attempts[0].metrics.filtered_by == {"cordoned": 1, "gpu-class": 1}


def test_the_table_shows_the_node_that_could_help_before_class_mismatches() -> None:
    """Twelve A100 nodes and one cordoned H100 node: the 10-line table lists the cordoned H100
    node (uncordoning it would place the replica) before nodes that have no H100 at all."""
    nodes = [a100_pcie(f"a-{i:02}") for i in range(12)] + [dgx("z-h100", cordoned=True)]
    lines = render_plan(plan(nodes, catalog(("m", 1, [H100x8]))))
    listed = [ln.strip().split(":")[0] for ln in lines if ln.startswith("      ") and " nodes filtered" not in ln]
    assert listed[0] == "z-h100", lines
    assert "      ... and 3 more nodes (-o json lists every one)" in lines


def test_json_reasons_are_in_node_order_whatever_the_constraint() -> None:
    """A 2-node profile: a-1 and b-1 each fit alone but sit on different fabrics (fabric
    verdicts, found after the per-node checks), c-1 is cordoned: the JSON lists a-1, b-1, c-1."""
    nodes = [
        dgx("a-1"),
        dgx("b-1", fabric="ib-b", hcas=[ib(f"mlx5_{i}", "ib-b") for i in range(8)]),
        dgx("c-1", cordoned=True),
    ]
    p = plan(nodes, catalog(("m", 1, [profile("mn", gpu_class="H100", gpus=8, nodes=2)])))
    reasons = p.to_dict()["unplaced"][0]["reasons"]
    assert [(r["node"], r["constraint"]) for r in reasons] == [
        ("a-1", "fabric"),
        ("b-1", "fabric"),
        ("c-1", "cordoned"),
    ]


def test_a_replica_bigger_than_any_node_says_so() -> None:
    p = plan([dgx("h-1")], catalog(("m", 1, [profile("p", gpu_class="H100", gpus=12)])))
    (r,) = p.unplaced[0].reasons
    assert r.detail == "8 of 8 H100 free, profile needs 12: more than the node's 8, set nodes: to split it"
    # Per node of a multi-node replica there is no such advice: it already spans nodes.
    p = plan([dgx("h-1"), dgx("h-2")], catalog(("m", 1, [profile("p", gpu_class="H100", gpus=12, nodes=2)])))
    assert {r.detail for r in p.unplaced[0].reasons} == {"8 of 8 H100 free, profile needs 12: more than the node's 8"}


# --------------------------------------------------------------------------- catalog slips


def _place(tmp_path: Path, nodes: list[NodeFacts], cat: str) -> object:
    inv, c, facts = write_inputs(tmp_path, nodes, catalog=cat)
    return runner.invoke(app, ["--state", str(tmp_path / "s.db"), "place", "--dry-run", "-i", str(inv), "-c", str(c),
                               "--facts", str(facts)])  # fmt: skip


def test_a_class_in_the_wrong_case_or_a_product_name_gets_a_suggestion_and_its_line(tmp_path: Path) -> None:
    cat = (
        "models:\n"
        "  - name: a\n"
        "    replicas: 1\n"
        "    profiles:\n"
        "      - {name: p, engine: vllm, gpu_class: h100, gpus: 8, model: /m}\n"
        "      - {name: q, engine: vllm, gpus: 8, model: /m, gpu_class: 'NVIDIA H100 80GB HBM3'}\n"
    )
    r = _place(tmp_path, [dgx("h-1", cpus=224)], cat)
    assert r.exit_code == 3, r.output
    err = r.stderr
    assert (
        "catalog.yaml: line 5: models.0.profiles.0.gpu_class: no GPU of class 'h100' in the inventory or the facts; did you mean 'H100'?"
        in err
    )
    assert (
        "line 6: models.0.profiles.1.gpu_class: no GPU of class 'NVIDIA H100 80GB HBM3' in the inventory or the facts; 'NVIDIA H100 80GB HBM3' is a product: its class is 'H100'"
        in err
    )


def test_a_vllm_tensor_parallel_size_that_is_not_a_power_of_two_is_warned_about(tmp_path: Path) -> None:
    cat = (
        "models:\n"
        "  - name: a\n"
        "    replicas: 1\n"
        "    profiles:\n"
        "      - name: p\n"
        "        engine: vllm\n"
        "        gpu_class: H100\n"
        "        gpus: 3\n"
        "        model: /m\n"
        "  - {name: b, replicas: 1, profiles: [{name: p, engine: vllm, gpu_class: H100, gpus: 4, model: /m}]}\n"
        "  - {name: c, replicas: 1, profiles: [{name: p, engine: llamacpp, model: /m.gguf}]}\n"
    )
    r = _place(tmp_path, [dgx("h-1"), cpu_node("c-1")], cat)
    assert r.exit_code == 0, r.output
    warned = [ln for ln in r.stderr.splitlines() if "tensor-parallel" in ln]
    assert len(warned) == 1
    assert "catalog.yaml: line 8: models.0.profiles.0.gpus: 3 is vLLM's tensor-parallel size" in warned[0]


def test_a_group_bigger_than_every_nvlink_domain_has_no_note() -> None:
    """TP-8 on A100 PCIe pairs: the hardware splits it, on every such replica; nothing to say."""
    p = plan([a100_pcie("a-1")], catalog(("m", 1, [profile("tp8", gpu_class="A100", gpus=8)])))
    assert _notes(p) == {("m", 0): ""}
