"""Table-driven placement rules on realistic clusters, and how the plan explains them (see helpers.py
for the nodes)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from helpers import a100_pcie, catalog, cpu_node, dgx, ib, l40s, node, profile, rep

from cluster_cli.facts import UNREAD, Gpu, NodeFacts
from cluster_cli.placement import Plan, filter_lines, fit_message, plan, render_plan, render_trace
from cluster_cli.placement.constraints import choose_gpus

H100x8 = profile("h100-tp8", gpu_class="H100", gpus=8, priority=100)
A100_2x8 = profile("a100-2x8", gpu_class="A100", gpus=8, nodes=2, priority=50)
CPU32 = profile("cpu", engine="llamacpp", cpus=32, memory_gib=64, priority=1)


def where(p: Plan) -> dict[tuple[str, int], tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    return {
        (x.replica.model, x.replica.replica): (x.replica.profile, [(s.node, s.gpus) for s in x.replica.shards])
        for x in p.placements
        if x.action != "stop"
    }


# --------------------------------------------------------------------------- priority


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        ([dgx("gpu-01"), a100_pcie("a-1", "ib-b"), a100_pcie("a-2", "ib-b"), cpu_node("cpu-1")], "h100-tp8"),
        (
            [dgx("gpu-01", cordoned=True), a100_pcie("a-1", "ib-b"), a100_pcie("a-2", "ib-b"), cpu_node("cpu-1")],
            "a100-2x8",
        ),
        (
            [dgx("gpu-01", problems={3: "ecc"}), a100_pcie("a-1", "ib-b"), a100_pcie("a-2", "ib-c"), cpu_node("cpu-1")],
            "cpu",
        ),
        ([dgx("gpu-01", reachable=False), a100_pcie("a-1", "ib-b"), cpu_node("cpu-1", cpus=64)], "cpu"),
    ],
    ids=["best-fits", "h100-cordoned", "h100-ecc-and-a100-split-fabrics", "h100-unreachable"],
)
def test_highest_priority_profile_that_fits(nodes: list[NodeFacts], expected: str) -> None:
    p = plan(nodes, catalog(("llama", 1, [CPU32, A100_2x8, H100x8])), [])  # written out of order on purpose
    assert where(p)[("llama", 0)][0] == expected
    assert p.complete


def test_equal_priority_takes_the_profile_written_first() -> None:
    cat = catalog(
        ("m", 1, [profile("l40s", gpu_class="L40S", priority=5), profile("h100", gpu_class="H100", priority=5)])
    )
    p = plan([dgx("gpu-01"), l40s("l40s-01")], cat, [])
    assert where(p)[("m", 0)] == ("l40s", [("l40s-01", (0,))])


def test_each_missing_replica_gets_its_own_best_profile() -> None:
    p = plan([dgx("gpu-01"), cpu_node("cpu-1", cpus=64, memory_gib=256)], catalog(("llama", 2, [H100x8, CPU32])), [])
    assert [where(p)[("llama", i)][0] for i in (0, 1)] == ["h100-tp8", "cpu"]


# --------------------------------------------------------------------------- hard constraints


def test_only_gpus_of_the_class_on_a_mixed_node() -> None:
    mixed = node("mixed", cls="A100", gpus=4, domains=[])
    mixed = replace(mixed, gpus=mixed.gpus + tuple(replace(g, index=g.index + 4, gpu_class="H100") for g in mixed.gpus))
    p = plan([mixed], catalog(("m", 1, [profile("h", gpu_class="H100", gpus=4)])), [])
    assert where(p)[("m", 0)] == ("h", [("mixed", (4, 5, 6, 7))])


@pytest.mark.parametrize("problem", ["ecc", "foreign", "lost", "mig", "retired", "remap"])
def test_never_a_gpu_with_a_problem(problem: str) -> None:
    n = dgx("gpu-01", problems={0: problem, 5: problem})
    p = plan([n], catalog(("m", 6, [profile("one", gpu_class="H100")])), [])
    used = sorted(g for (_, shards) in where(p).values() for _, gs in shards for g in gs)
    assert used == [1, 2, 3, 4, 6, 7]
    assert len(p.unplaced) == 0
    p = plan([n], catalog(("m", 7, [profile("one", gpu_class="H100")])), [])
    assert [u.replica for u in p.unplaced] == [6]


def test_multi_node_uses_one_fabric_and_only_its_active_ports() -> None:
    # a-1 has a rail down and one HCA overridden onto ib-b: neither may appear in the shard.
    rails = [ib(f"mlx5_{i}", "ib-a") for i in range(6)] + [ib("mlx5_6", "ib-a", state="Down"), ib("mlx5_7", "ib-b")]
    nodes = [
        dgx("a-1", "H100", "ib-a", hcas=rails),
        dgx("a-2", "H100", "ib-a"),
        dgx("b-1", "H100", "ib-b"),
    ]
    p = plan(nodes, catalog(("big", 1, [profile("2x8", gpu_class="H100", gpus=8, nodes=2)])), [])
    (r,) = [x.replica for x in p.starts]
    assert r.fabric == "ib-a" and [s.node for s in r.shards] == ["a-1", "a-2"]
    assert r.shards[0].hcas == tuple(f"mlx5_{i}" for i in range(6))
    assert r.shards[1].hcas == tuple(f"mlx5_{i}" for i in range(8))


def test_multi_node_never_mixes_fabrics_and_says_why() -> None:
    nodes = [a100_pcie("a-1", "ib-a"), a100_pcie("a-2", "ib-b"), a100_pcie("a-3", None)]
    p = plan(nodes, catalog(("big", 1, [A100_2x8])), [])
    (u,) = p.unplaced
    by_node = {r.node: r for r in u.reasons}
    assert by_node["a-1"].constraint == "fabric" and "no fabric has 2 such nodes" in by_node["a-1"].detail
    assert by_node["a-3"].constraint == "fabric" and "no InfiniBand port" in by_node["a-3"].detail
    assert u.attempts[0].metrics.fabrics == {"ib-a": 1, "ib-b": 1}


def test_cordoned_and_unreachable_nodes_take_nothing() -> None:
    nodes = [dgx("gpu-01", cordoned=True), dgx("gpu-02", reachable=False), cpu_node("cpu-1", cordoned=True)]
    p = plan(nodes, catalog(("m", 1, [H100x8, CPU32])), [])
    assert not p.starts
    kinds = {(r.node, r.constraint) for r in p.unplaced[0].reasons}
    assert ("gpu-01", "cordoned") in kinds and ("gpu-02", "reachable") in kinds and ("cpu-1", "cordoned") in kinds


# --------------------------------------------------------------------------- bin packing


def test_single_node_replicas_fill_partly_used_nodes_first() -> None:
    nodes = [dgx("gpu-01"), dgx("gpu-02", problems={i: "foreign" for i in range(5)}), dgx("gpu-03")]
    p = plan(nodes, catalog(("small", 3, [profile("h1", gpu_class="H100")]), ("big", 2, [H100x8])), [])
    w = where(p)
    assert {w[("small", i)][1][0][0] for i in range(3)} == {"gpu-02"}  # the 3 free GPUs of gpu-02
    assert {w[("big", i)][1][0][0] for i in range(2)} == {"gpu-01", "gpu-03"}  # whole nodes stayed whole


def test_best_fit_prefers_the_node_left_fullest() -> None:
    nodes = [dgx("gpu-01", problems={i: "ecc" for i in range(4)}), dgx("gpu-02", problems={i: "ecc" for i in range(6)})]
    p = plan(nodes, catalog(("m", 1, [profile("tp2", gpu_class="H100", gpus=2)])), [])
    assert where(p)[("m", 0)][1] == [("gpu-02", (6, 7))]


def test_multi_node_takes_the_emptiest_nodes() -> None:
    nodes = [
        dgx("n-1", problems={0: "ecc"}),
        dgx("n-2"),
        dgx("n-3", problems={0: "ecc", 1: "ecc"}),
        dgx("n-4"),
    ]
    p = plan(nodes, catalog(("m", 1, [profile("2x4", gpu_class="H100", gpus=4, nodes=2)])), [])
    assert [s.node for s in p.starts[0].replica.shards] == ["n-2", "n-4"]


def test_multi_node_picks_the_fabric_with_the_emptier_nodes() -> None:
    nodes = [
        dgx("a-1", fabric="ib-a", problems={0: "ecc"}),
        dgx("a-2", fabric="ib-a", problems={0: "ecc"}),
        dgx("b-1", fabric="ib-b"),
        dgx("b-2", fabric="ib-b"),
    ]
    p = plan(nodes, catalog(("m", 1, [profile("2x4", gpu_class="H100", gpus=4, nodes=2)])), [])
    assert p.starts[0].replica.fabric == "ib-b"


def test_cpu_replicas_spread_and_respect_cpus_and_memory() -> None:
    nodes = [
        cpu_node("cpu-1", cpus=64, memory_gib=256),
        cpu_node("cpu-2", cpus=64, memory_gib=100),
        cpu_node("cpu-3", cpus=16),
    ]
    p = plan(nodes, catalog(("m", 4, [CPU32])), [])
    w = where(p)
    assert [w[("m", i)][1][0][0] for i in range(3)] == ["cpu-1", "cpu-2", "cpu-1"]
    (u,) = p.unplaced  # cpu-1 full (64 cpus), cpu-2 has memory for one, cpu-3 too small
    detail = {r.node: r.detail for r in u.reasons}
    assert detail["cpu-1"] == "0 of 64 CPUs unreserved (64 reserved by 2 CPU replicas), profile needs 32"
    assert detail["cpu-2"] == "36 of 100 GiB memory unreserved (64 reserved by 1 CPU replica), profile needs 64"
    assert detail["cpu-3"].startswith("16 of 16 CPUs unreserved")


def test_cpu_replicas_prefer_nodes_without_gpus() -> None:
    p = plan([dgx("gpu-01"), cpu_node("cpu-1", cpus=64), cpu_node("cpu-2", cpus=64)], catalog(("m", 2, [CPU32])), [])
    assert [n for (_, shards) in where(p).values() for n, _ in shards] == ["cpu-1", "cpu-2"]
    p = plan([dgx("gpu-01"), cpu_node("cpu-1", cpus=64)], catalog(("m", 1, [CPU32]), ("n", 1, [CPU32])), [])
    assert [n for (_, shards) in where(p).values() for n, _ in shards] == ["cpu-1", "cpu-1"]  # other models share


def test_a_models_cpu_replicas_take_different_nodes_before_doubling_up() -> None:
    """A second replica on the same node adds no availability: it goes to another node that
    fits, even one with GPUs, and doubles up only when every node that fits has one."""
    p = plan([dgx("gpu-01"), cpu_node("cpu-1", cpus=128)], catalog(("m", 3, [CPU32])), [])
    assert [n for (_, shards) in where(p).values() for n, _ in shards] == ["cpu-1", "gpu-01", "cpu-1"]
    running = [p.placements[0].replica]  # replica 0 runs on cpu-1 already
    p = plan([dgx("gpu-01"), cpu_node("cpu-1", cpus=128)], catalog(("m", 2, [CPU32])), running)
    assert [(pl.action, pl.replica.shards[0].node) for pl in p.placements] == [("keep", "cpu-1"), ("start", "gpu-01")]


def test_cpu_profile_without_resources_fits_any_node_and_unknown_cpus_is_explained() -> None:
    p = plan([cpu_node("c", cpus=None)], catalog(("m", 1, [profile("cpu", engine="llamacpp")])), [])
    assert p.complete
    p = plan([cpu_node("c", cpus=None)], catalog(("m", 1, [CPU32])), [])
    assert p.unplaced[0].reasons[0].detail.startswith("CPU count unknown")


# --------------------------------------------------------------------------- NVLink


@pytest.mark.parametrize(
    ("problems", "gpus", "expected"),
    [
        ({}, 2, (0, 1)),
        ({0: "ecc"}, 2, (2, 3)),  # pair 0-1 is broken: take a whole pair, not 1+2
        ({0: "ecc"}, 1, (1,)),  # best-fitting domain: the broken pair's survivor
        ({0: "ecc", 2: "ecc", 4: "ecc", 6: "ecc"}, 2, (1, 3)),  # no pair left: lowest free indices
        ({}, 4, (0, 1, 2, 3)),  # no domain of 4: lowest free indices
    ],
)
def test_a100_pairs(problems: dict[int, str], gpus: int, expected: tuple[int, ...]) -> None:
    p = plan([a100_pcie("a-1", problems=problems)], catalog(("m", 1, [profile("p", gpu_class="A100", gpus=gpus)])), [])
    assert where(p)[("m", 0)][1] == [("a-1", expected)]


def test_unknown_topology_takes_lowest_free_indices() -> None:
    n = a100_pcie("a-1", domains=None, problems={0: "ecc"})
    p = plan([n], catalog(("m", 1, [profile("p", gpu_class="A100", gpus=2)])), [])
    assert where(p)[("m", 0)][1] == [("a-1", (1, 2))]


def test_two_domains_of_four_choose_the_best_fitting() -> None:
    n = node("h", cls="H100", gpus=8, domains=[(0, 1, 2, 3), (4, 5, 6, 7)], problems={4: "ecc", 5: "ecc"})
    p = plan([n], catalog(("m", 1, [profile("p", gpu_class="H100", gpus=2)])), [])
    assert where(p)[("m", 0)][1] == [("h", (6, 7))]


# --------------------------------------------------------------------------- current allocations


def test_keep_valid_and_stop_what_the_catalog_no_longer_wants() -> None:
    nodes = [dgx("gpu-01"), dgx("gpu-02", cordoned=True), dgx("gpu-03")]
    cat = catalog(("llama", 2, [H100x8]))
    current = [
        rep("llama", 0, "h100-tp8", [("gpu-02", tuple(range(8)))], gpu_class="H100"),  # cordoned: kept
        rep("llama", 5, "h100-tp8", [("gpu-01", tuple(range(8)))], gpu_class="H100"),  # beyond replicas
        rep("gone", 0, "x", [("gpu-03", (0,))], gpu_class="H100"),  # model removed
    ]
    p = plan(nodes, cat, current)
    actions = {(x.replica.model, x.replica.replica): x.action for x in p.placements}
    assert actions == {("llama", 0): "keep", ("llama", 1): "start", ("llama", 5): "stop", ("gone", 0): "stop"}
    assert "cordoned" in p.keeps[0].note
    assert where(p)[("llama", 1)][1][0][0] in {"gpu-01", "gpu-03"}  # freed by the stops


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda n: replace(n, reachable=False, error="timeout"), "unreachable"),
        (lambda n: dgx(n.name, problems={3: "lost"}), "lost"),
        (lambda n: replace(n, gpus=n.gpus[:4]), "gone"),
        (lambda n: dgx(n.name, problems={5: "ecc"}), "unhealthy (ecc:"),
        (lambda n: dgx(n.name, problems={0: "remap"}), "unhealthy (remap:"),
    ],
)
def test_multi_node_replica_is_released_whole(mutate, why: str) -> None:
    nodes = [dgx("a-1"), dgx("a-2"), dgx("a-3"), dgx("a-4")]
    cur = rep("big", 0, "2x8", [("a-1", tuple(range(8))), ("a-2", tuple(range(8)))], gpu_class="H100", fabric="ib-a",
              hcas=[f"mlx5_{i}" for i in range(8)])  # fmt: skip
    nodes[1] = mutate(nodes[1])
    p = plan(nodes, catalog(("big", 1, [profile("2x8", gpu_class="H100", gpus=8, nodes=2)])), [cur])
    (stop,) = p.stops
    assert why in stop.note and len(stop.replica.shards) == 2
    (start,) = p.starts
    assert "a-2" not in [s.node for s in start.replica.shards]
    assert "a-1" in [s.node for s in start.replica.shards]  # both shards' GPUs were freed together


def test_kept_gpus_are_not_handed_out_again() -> None:
    cur = rep("m", 0, "tp4", [("gpu-01", (0, 1, 2, 3))], gpu_class="H100")
    p = plan([dgx("gpu-01")], catalog(("m", 3, [profile("tp4", gpu_class="H100", gpus=4)])), [cur])
    assert where(p)[("m", 1)][1] == [("gpu-01", (4, 5, 6, 7))]
    assert [u.replica for u in p.unplaced] == [2]
    assert "4 of 8 H100 free" not in p.unplaced[0].reasons[0].detail
    assert p.unplaced[0].reasons[0].detail == "0 of 8 H100 free (8 allocated), profile needs 4"


def test_double_claimed_gpus_keep_the_first_only() -> None:
    a = rep("a", 0, "p", [("gpu-01", (0, 1))], gpu_class="H100")
    b = rep("b", 0, "p", [("gpu-01", (1, 2))], gpu_class="H100")
    cat = catalog(
        ("a", 1, [profile("p", gpu_class="H100", gpus=2)]), ("b", 1, [profile("p", gpu_class="H100", gpus=2)])
    )
    p = plan([dgx("gpu-01")], cat, [b, a])
    assert [x.action for x in p.placements if x.replica.model == "b"] == ["stop", "start"]
    assert "also held by a/0" in p.stops[0].note


# --------------------------------------------------------------------------- explanations


def test_a_lost_gpu_of_unknown_class_is_mentioned_in_the_reason() -> None:
    from cluster_cli.facts import Gpu

    n = dgx("gpu-01")
    lost = Gpu(index=7, uuid="", product="unknown", gpu_class="unknown", lost=True,
               problems=("lost: GPU 00000000:9D:00.0 has fallen off the bus",))  # fmt: skip
    n = replace(n, gpus=(*n.gpus[:7], lost))
    p = plan([n], catalog(("llama", 1, [H100x8])))
    (u,) = p.unplaced
    # Its other GPUs are all H100: the lost one is counted as one of them, as discover's table does.
    assert u.reasons[0].detail == "7 of 8 H100 free (1 lost), profile needs 8"
    # On a node of two classes it could have been either: said apart.
    mixed = replace(n, gpus=(*n.gpus[:6], replace(n.gpus[6], product="NVIDIA L40S", gpu_class="L40S"), lost))
    (u,) = plan([mixed], catalog(("llama", 1, [H100x8]))).unplaced
    assert u.reasons[0].detail == "6 of 6 H100 free, profile needs 8; also 1 lost GPU of unknown class"


def test_exact_node_reason_and_nomad_summary() -> None:
    gpu03 = dgx("gpu-03", problems={0: "ecc", 1: "ecc", 2: "ecc", 3: "foreign"})
    cur = rep("other", 0, "tp2", [("gpu-03", (4, 5))], gpu_class="H100")
    nodes = [gpu03, dgx("gpu-01", cordoned=True), a100_pcie("a-1"), l40s("l-1")]
    cat = catalog(("other", 1, [profile("tp2", gpu_class="H100", gpus=2)]), ("llama", 1, [H100x8]))
    p = plan(nodes, cat, [cur])
    (u,) = p.unplaced
    detail = {r.node: r.detail for r in u.reasons}
    assert (
        f"gpu-03: {detail['gpu-03']}"
        == "gpu-03: 2 of 8 H100 free (3 ECC, 2 allocated, 1 foreign process pid 4414), profile needs 8"
    )
    m = u.attempts[0].metrics
    assert filter_lines(m) == ["3 nodes filtered: cordoned 1, gpu-class 2", "1 node exhausted: gpus 1"]
    assert fit_message(m) == "0/4 nodes are available: 1 cordoned, 1 insufficient gpus, 2 no H100 gpu."
    assert detail["a-1"] == "no H100 GPU (has 8 A100)"
    assert detail["gpu-01"] == "cordoned (maintenance)"


def test_every_profile_of_an_unplaced_replica_has_a_reason() -> None:
    p = plan([], catalog(("m", 1, [H100x8, CPU32])), [])
    assert {r.profile for r in p.unplaced[0].reasons} == {"h100-tp8", "cpu"}
    p = plan([cpu_node("c", cpus=8)], catalog(("m", 2, [H100x8, A100_2x8, CPU32])), [])
    for u in p.unplaced:
        assert {r.profile for r in u.reasons} == {"h100-tp8", "a100-2x8", "cpu"}


def test_successes_carry_counts_too() -> None:
    p = plan([dgx("gpu-01"), dgx("gpu-02", cordoned=True), cpu_node("c")], catalog(("m", 1, [H100x8])), [])
    m = p.starts[0].attempts[-1].metrics
    assert (m.evaluated, m.filtered_by, m.exhausted_by) == (3, {"cordoned": 1, "gpu-class": 1}, {})
    assert m.scores["gpu-01"]["binpack"] == 1.0 and m.scores["gpu-01"]["nvlink"] == 1.0


# --------------------------------------------------------------------------- determinism


def test_same_inputs_in_any_order_give_the_same_plan() -> None:
    nodes = (
        [dgx(f"gpu-{i:02d}", problems={i % 8: "ecc"}) for i in range(6)]
        + [a100_pcie(f"a-{i}", "ib-b") for i in range(4)]
        + [cpu_node(f"cpu-{i}") for i in range(3)]
    )
    cat = catalog(("llama", 3, [H100x8, A100_2x8, CPU32]), ("small", 9, [profile("h1", gpu_class="H100", gpus=3)]))
    first = plan(nodes, cat, []).to_dict()
    for seed in range(5):
        shuffled = nodes[:]
        random.Random(seed).shuffle(shuffled)
        assert plan(shuffled, cat, []).to_dict() == first


def test_a_tp_group_goes_to_a_node_with_a_whole_nvlink_domain_before_splitting() -> None:
    # Best fit alone picks a-1 (2 free GPUs, one in each NVLink pair); a-2 has whole pairs free.
    frag = a100_pcie("a-1", problems={0: "ecc", 3: "foreign", 4: "ecc", 5: "ecc", 6: "ecc", 7: "ecc"})
    p = plan([frag, a100_pcie("a-2")], catalog(("m", 1, [profile("tp2", gpu_class="A100", gpus=2)])))
    assert where(p)[("m", 0)][1] == [("a-2", (0, 1))]
    # With no whole pair anywhere, best fit still places it (split, lowest free indices).
    p = plan([frag], catalog(("m", 1, [profile("tp2", gpu_class="A100", gpus=2)])))
    assert where(p)[("m", 0)][1] == [("a-1", (1, 2))]


def test_a_gpu_uuid_on_two_nodes_is_planned_once() -> None:
    from dataclasses import replace

    from cluster_cli.placement.constraints import mark_duplicate_gpus

    h1 = dgx("h1", cpus=64)
    h2 = replace(dgx("h2", cpus=64), gpus=h1.gpus)  # the same box under a second name
    cat = catalog(("m", 2, [profile("tp8", gpu_class="H100", gpus=8)]))
    result = plan([h2, h1], cat)
    assert [(p.replica.shards[0].node, p.replica.replica) for p in result.starts] == [("h1", 0)]
    (u,) = result.unplaced
    (why,) = [r for r in u.reasons if r.node == "h2"]
    assert why.constraint == "duplicate" and "8 GPUs (GPU-h1-0, GPU-h1-1, GPU-h1-2 and 5 more)" in why.detail
    assert "also node h1's" in why.detail and "not a placement candidate" in why.detail
    assert u.attempts[0].metrics.filtered_by == {"duplicate": 1}
    # CPU work is not doubled either; and the inventory's order (view) decides who keeps the box.
    cpu = catalog(("c", 2, [profile("cpu", engine="llamacpp", cpus=40)]))
    assert {p.replica.shards[0].node for p in plan([h1, h2], cpu).starts} == {"h1"}
    first, second = mark_duplicate_gpus([h2, h1])
    assert not first.problems and second.problems[0].startswith("duplicate-gpu: 8 GPUs")
    assert {p.replica.shards[0].node for p in plan([first, second], cpu).starts} == {"h2"}
    # An unreachable node's last known GPUs claim nothing.
    away = replace(h1, reachable=False, error="timeout")
    assert [f.problems for f in mark_duplicate_gpus([away, h2])] == [(), ()]


def test_a_replica_kept_under_one_name_holds_its_gpus_under_the_other() -> None:
    """One box under two names: while h1 was unreachable, h2 (not yet marked duplicate)
    took a replica. When h1 is back, h2 is the duplicate; its replica is kept, and the
    same physical GPUs must not be handed out again as h1's."""
    h1 = dgx("h1", cpus=64)
    h2 = replace(dgx("h2", cpus=64), gpus=h1.gpus)
    cat = catalog(("m", 2, [profile("tp8", gpu_class="H100", gpus=8)]))
    first = plan([replace(h1, reachable=False, error="timeout"), h2], cat)
    assert [(p.replica.shards[0].node, p.replica.replica) for p in first.starts] == [("h2", 0)]
    second = plan([h1, h2], cat, first.allocations())
    assert [(p.action, p.replica.shards[0].node) for p in second.placements] == [("keep", "h2")]
    (u,) = second.unplaced
    assert any(r.node == "h1" and "0 of 8 H100 free (8 allocated)" in r.detail for r in u.reasons)
    # Two replicas recorded on the same GPUs under the two names: the second is stopped.
    (kept,) = first.allocations()
    both = (kept, replace(kept, replica=1, shards=(replace(kept.shards[0], node="h1"),)))
    third = plan([h1, h2], cat, both)
    assert [(p.action, p.replica.replica) for p in third.placements] == [("keep", 0), ("stop", 1)]
    stop = third.placements[1].note
    assert "(GPU-h1-0) is also held by m/0, on h2: the same machine" in stop


def test_one_replica_cannot_hold_one_box_twice_and_a_uuid_repeated_on_one_node_is_not_an_alias() -> None:
    h1 = dgx("h1", cpus=64)
    h2 = replace(dgx("h2", cpus=64), gpus=h1.gpus)  # the same box under a second name
    big = catalog(("big", 1, [profile("2x8", gpu_class="H100", gpus=8, nodes=2)]))
    both = rep("big", 0, "2x8", [("h1", tuple(range(8))), ("h2", tuple(range(8)))], gpu_class="H100",
               fabric="ib-a", hcas=[f"mlx5_{i}" for i in range(8)])  # fmt: skip
    (stop,) = plan([h1, h2], big, [both]).placements
    assert stop.action == "stop"  # its two shards are the same 8 GPUs
    assert stop.note == "GPU 0 of h2 (GPU-h1-0) is also this replica's on h1: the same machine"
    # Hand-written facts with one UUID on every GPU of a node: the node is not its own alias.
    n = replace(dgx("h1"), gpus=tuple(replace(g, uuid="GPU-00000000") for g in dgx("h1").gpus))
    tp2 = catalog(("m", 2, [profile("tp2", gpu_class="H100", gpus=2)]))
    p = plan([n], tp2, [rep("m", 0, "tp2", [("h1", (0, 1))], gpu_class="H100")])
    assert [(x.action, x.replica.replica) for x in p.placements] == [("keep", 0), ("start", 1)]


def test_placeholder_gpu_uuids_do_not_make_two_nodes_one_machine() -> None:
    from dataclasses import replace

    from cluster_cli.placement.constraints import mark_duplicate_gpus

    def placeholders(f: NodeFacts, uuid: str) -> NodeFacts:
        return replace(f, gpus=tuple(replace(g, uuid=uuid) for g in f.gpus))

    for uuid in ("[N/A]", "unknown", "N/A"):  # hand-written facts
        a, b = placeholders(dgx("a"), uuid), placeholders(dgx("b"), uuid)
        assert [f.problems for f in mark_duplicate_gpus([a, b])] == [a.problems, b.problems]


def test_a_node_whose_ports_are_all_in_fabric_conflict_is_explained_as_such() -> None:
    node = dgx("f3", cpus=64)
    off = tuple(replace(h, fabric=None) for h in node.hcas)  # taken off their declared fabric
    problems = tuple(
        f"fabric-conflict: {h.ca} port 1 sees SM 0x2 but fabric ib-b is declared and most of it sees SM 0x1"
        for h in node.hcas
    )
    node = replace(node, hcas=off, problems=problems)
    p = plan([node], catalog(("m", 1, [profile("2x8", gpu_class="H100", gpus=8, nodes=2)])))
    (u,) = p.unplaced
    (why,) = [r for r in u.reasons if r.node == "f3"]
    assert why.constraint == "fabric"
    assert why.detail.startswith("8 Active InfiniBand ports in fabric conflict, so on no fabric: mlx5_0 port 1 sees")
    assert why.detail.endswith("; profile spans nodes") and "no Active InfiniBand port" not in why.detail


def test_a_tp_group_placed_without_known_topology_says_so() -> None:
    unknown = replace(dgx("a", cls="A100", cpus=64), nvlink_domains=None)  # e.g. a GPU was lost
    known = dgx("b", cls="A100", cpus=64)
    p = plan([unknown], catalog(("m", 1, [profile("tp2", gpu_class="A100", gpus=2)])))
    (start,) = p.starts
    assert start.note == "NVLink topology of a unknown: GPUs 0,1 chosen by index"
    assert start.to_dict()["note"] == start.note
    p = plan([known], catalog(("m", 1, [profile("tp2", gpu_class="A100", gpus=2)])))
    assert p.starts[0].note == ""  # known topology: nothing to say
    p = plan([unknown], catalog(("m", 1, [profile("one", gpu_class="A100", gpus=1)])))
    assert p.starts[0].note == ""  # one GPU: no group to keep together


# --------------------------------------------------------------------------- explanations of the moment each replica was tried


def test_unplaced_is_explained_by_the_state_it_failed_on_not_the_final_one() -> None:
    """a (8x H100) fails on h1 (2 ECC); b (4x H100) is placed there afterwards: a's reason is
    6 free, as -v says, not the 2 left after b."""
    cat = catalog(
        ("a", 1, [profile("tp8", gpu_class="H100", gpus=8)]), ("b", 1, [profile("tp4", gpu_class="H100", gpus=4)])
    )
    p = plan([dgx("h1", problems={0: "ecc", 1: "ecc"})], cat, trace=True)
    want = "6 of 8 H100 free (2 ECC), profile needs 8"
    (u,) = p.to_dict()["unplaced"]
    assert [r["detail"] for r in u["reasons"]] == [want]
    assert f"      h1: {want}" in render_plan(p)
    assert f"    h1: rejected by capacity: {want}" in render_trace(p)


def test_fallback_summary_is_taken_when_the_better_profile_failed() -> None:
    """m's 2-node profile fails for want of a second node on ib-a (h1 fits alone); its
    replicas then fill h1 and h2 with tp8. The "not ..." line and the JSON summary say why it
    failed (fabric too small), not what the nodes look like at the end (full)."""
    nodes = [dgx("h1"), dgx("h2", fabric="ib-b", hcas=[ib("mlx5_0", "ib-b")])]
    cat = catalog(
        (
            "m",
            2,
            [profile("mn", gpu_class="H100", gpus=8, nodes=2, priority=10), profile("tp8", gpu_class="H100", gpus=8)],
        )
    )
    p = plan(nodes, cat)
    assert p.complete and len(p.starts) == 2
    line = "    not mn (2 nodes x 8x H100): 0/2 nodes are available: 2 fabric too small."
    assert line in render_plan(p)
    first = p.to_dict()["replicas"][0]["attempts"][0]
    assert first["summary"] == line.split(": ", 1)[1]
    assert first["metrics"]["exhausted_by"] == {"fabric": 2}


def test_explanations_stay_deterministic() -> None:
    cat = catalog(
        ("a", 2, [profile("tp8", gpu_class="H100", gpus=8)]), ("b", 1, [profile("tp4", gpu_class="H100", gpus=4)])
    )
    nodes = [dgx("h1", problems={0: "ecc"}), dgx("h2", problems={3: "ecc"})]
    assert plan(nodes, cat).to_dict() == plan(list(reversed(nodes)), cat).to_dict()


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


def test_lost_gpu_of_unread_class_is_called_lost() -> None:
    n = dgx("g3")
    gpus = (*n.gpus[:7], replace(n.gpus[7], lost=True, product=UNREAD, gpu_class=UNREAD, uuid=""))
    p = plan([replace(n, gpus=gpus)], catalog(("m", 1, [profile("p", gpu_class="H200", gpus=1)])))
    assert [r.detail for r in p.unplaced[0].reasons] == ["no H200 GPU (has 7 H100, 1 lost)"]


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


def test_one_node_evaluated_is_singular() -> None:
    p = plan([dgx("h1")], catalog(("m", 1, [profile("tp8", gpu_class="H100", gpus=8)])))
    assert "  m [0] on tp8: 1 node evaluated" in render_plan(p)


def test_one_more_node_is_singular() -> None:
    nodes = [a100_pcie(f"a-{i:02}") for i in range(11)]
    lines = render_plan(plan(nodes, catalog(("m", 1, [profile("p", gpu_class="H100", gpus=8)]))))
    assert "      ... and 1 more node (-o json lists every one)" in lines


# --------------------------------------------------------------------------- NVLink over the whole fleet


PAIRS = [(0, 1), (2, 3), (4, 5), (6, 7)]


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


def test_nvlink_choice_keeps_whole_domains_and_lone_gpus_first() -> None:
    # Fewest free GPUs left over in the chosen domain: the broken domain's pair, not a whole one.
    assert choose_gpus([0, 1, 8, 9, 10, 11], 2, (tuple(range(8)), (8, 9, 10, 11))) == ((0, 1), True)
    # One GPU: a GPU in no NVLink domain before breaking into a pair.
    assert choose_gpus([0, 1, 2], 1, ((0, 1),)) == ((2,), True)


def test_a_duplicated_gpu_index_is_never_handed_out_twice() -> None:
    n = dgx("h-1")
    twin = Gpu(0, "GPU-other", n.gpus[0].product, "H100")
    one = NodeFacts(name="h-1", gpus=(n.gpus[0], twin), nvlink_domains=None, cpus=8, memory_mib=1024)
    p = plan([one], catalog(("m", 1, [profile("p", gpu_class="H100", gpus=2)])))
    assert not p.starts and p.unplaced


# --------------------------------------------------------------------------- CPU replicas: spread, capacity and the work it takes


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of the planner's ``name`` (a method of ``_Planner`` or a function it imported)."""
    from cluster_cli.placement import planner

    calls = [0]
    owner = planner._Planner if hasattr(planner._Planner, name) else planner
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
    from cluster_cli.placement import planner

    checks = [0]
    real = planner.CAPACITY

    class Counting:
        name = real.name

        def check(self, node: object, req: object) -> object:
            checks[0] += 1
            return real.check(node, req)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "CAPACITY", Counting())
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


def test_exactly_enough_memory_fits() -> None:
    cat = catalog(("tiny", 1, [profile("cpu", engine="llamacpp", memory_gib=128)]))
    assert plan([cpu_node("c-1", memory_gib=128)], cat).complete
    from cluster_cli.placement.constraints import Capacity, NodeState, Request

    req = Request.of(cat.models[0].profiles[0])
    assert Capacity().check(NodeState.build(cpu_node("c-1", memory_gib=128), 0), req).ok  # what place -v says
    assert not Capacity().check(NodeState.build(cpu_node("c-1", memory_gib=127), 0), req).ok


# --------------------------------------------------------------------------- kept replicas


def test_a_cpu_replica_is_restarted_when_its_profile_memory_changes() -> None:
    cat = catalog(("tiny", 1, [profile("cpu", engine="llamacpp", cpus=4, memory_gib=16)]))
    current = [rep("tiny", 0, "cpu", [("c-1", ())], engine="llamacpp", cpus=4, memory_mib=8192)]
    p = plan([cpu_node("c-1")], cat, current)
    assert [(x.action, x.replica.memory_mib) for x in p.placements] == [("stop", 8192), ("start", 16384)]
    assert "now reserves" in p.placements[0].note


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
