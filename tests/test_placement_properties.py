"""Property tests: the issue's invariants on every plan over hundreds of random clusters.

The checks are written independently of the placer: a naive reference ``fits`` decides
whether a profile could have been placed, and the plan is replayed in the order the
placer works (models in catalog order, replicas in number order) so that "fit at the
time" is checked exactly, not against the final state.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

from helpers import gpu, ib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.config.catalog import Catalog, Profile
from cluster_cli.facts import NodeFacts, Replica
from cluster_cli.placement import Plan, plan

CLASSES = ["H100", "A100", "L40S"]
FABRICS = ["ib-a", "ib-b"]
PROBLEMS = [None] * 6 + ["ecc", "foreign", "lost", "mig", "retired", "remap"]


@st.composite
def nodes_st(draw: Any) -> list[NodeFacts]:
    n = draw(st.integers(0, 10))
    if n == 0 and draw(st.booleans()):
        n = 6  # empty fleets are interesting once, not in half the runs
    out = []
    main_class = draw(st.sampled_from(CLASSES))  # most fleets are mostly one kind of box
    for i in range(n):
        name = f"n{i}"
        node_fabric = draw(st.sampled_from([*FABRICS, None]))
        kind = draw(st.sampled_from(["gpu", "gpu", "gpu", "gpu", "cpu"]))
        gpus: tuple = ()
        domains = None
        if kind == "gpu":
            cls = draw(st.sampled_from([main_class, main_class, *CLASSES]))
            count = draw(st.sampled_from([8, 1, 2, 4, 8, 8]))
            classes = [cls] * count
            if draw(st.integers(0, 9)) == 0:  # a rare mixed node
                classes[-1] = draw(st.sampled_from(CLASSES))
            faulty = draw(st.booleans())  # half the boxes are clean
            gpus = tuple(
                replace(gpu(name, g, c, draw(st.sampled_from(PROBLEMS)) if faulty else None, pid=5000 + g), gpu_class=c)
                for g, c in enumerate(classes)
            )
            topo = draw(st.sampled_from(["pairs", "unknown", "none", "pairs", "all", "halves", "halves"]))
            idx = list(range(count))
            domains = {
                "unknown": None,
                "none": (),
                "pairs": tuple(tuple(idx[j : j + 2]) for j in range(0, count, 2)),
                "all": (tuple(idx),),
                "halves": tuple(tuple(idx[j : j + max(1, count // 2)]) for j in range(0, count, max(1, count // 2))),
            }[topo]
        hcas = tuple(
            ib(
                f"mlx5_{k}",
                draw(st.sampled_from([node_fabric, node_fabric, node_fabric, *FABRICS, None])),
                state=draw(st.sampled_from(["Active", "Active", "Active", "Down"])),
                link=draw(st.sampled_from(["InfiniBand", "InfiniBand", "InfiniBand", "Ethernet"])),
            )
            for k in range(draw(st.sampled_from([2, 0, 1, 2, 3])))
        )
        reachable = draw(st.integers(0, 9)) > 0
        out.append(
            NodeFacts(
                name=name,
                reachable=reachable,
                error=None if reachable else "timeout",
                cpus=draw(st.sampled_from([None, 8, 32, 64])),
                memory_mib=draw(st.sampled_from([None, 16384, 131072])),
                gpus=gpus,
                nvlink_domains=domains,
                hcas=hcas,
                cordoned=draw(st.integers(0, 9)) == 0,
            )
        )
    return out


@st.composite
def catalog_st(draw: Any, common: str = "H100") -> Catalog:
    models = []
    for m in range(draw(st.integers(1, 3))):
        profiles = []
        for p in range(draw(st.integers(1, 3))):
            if draw(st.integers(0, 3)) == 0:
                prof = {"engine": "llamacpp"}
                if draw(st.booleans()):
                    prof["cpus"] = draw(st.sampled_from([4, 16, 32]))
                if draw(st.booleans()):
                    prof["memory_gib"] = draw(st.sampled_from([8, 64]))
            else:
                prof = {
                    "engine": "vllm",
                    "gpu_class": draw(st.sampled_from([common, common, *CLASSES])),
                    "gpus": draw(st.sampled_from([2, 1, 2, 3, 4, 8])),
                    "nodes": draw(st.sampled_from([1, 2, 1, 2, 3])),
                }
            profiles.append({"name": f"p{p}", "model": "/m", "priority": draw(st.integers(0, 3)), **prof})
        models.append({"name": f"m{m}", "replicas": draw(st.integers(1, 4)), "profiles": profiles})
    return Catalog.model_validate({"models": models})


@st.composite
def scenario_st(draw: Any) -> tuple[list[NodeFacts], Catalog, list[Replica]]:
    nodes = draw(nodes_st())
    classes = [g.gpu_class for n in nodes for g in n.gpus]
    common = max(sorted(set(classes)), key=classes.count) if classes else "H100"
    cat = draw(catalog_st(common))
    current: list[Replica] = []
    if nodes and draw(st.booleans()):
        # What a previous plan allocated, then the world changed: a node went away or lost
        # its ports, a GPU was lost, faulted or picked up a foreign process, a node was
        # cordoned, the catalog shrank. The change hits a node that holds a replica, if any.
        prev = plan(nodes, cat, []).allocations()
        current = prev
        held = {s.node: s.gpus for r in prev for s in r.shards}
        targets = [i for i, n in enumerate(nodes) if n.name in held] or list(range(len(nodes)))
        i = draw(st.sampled_from(targets))
        node = nodes[i]
        k = next((j for j, g in enumerate(node.gpus) if g.index in held.get(node.name, ())), 0)
        change = draw(
            st.sampled_from(
                ["unreachable", "gone", "ports", "port", "lost", "ecc", "foreign", "cordon", "fewer", "none"]
            )
        )
        if change == "unreachable":
            nodes[i] = replace(node, reachable=False, error="timeout")
        elif change == "gone":
            del nodes[i]
        elif change == "ports":
            nodes[i] = replace(node, hcas=tuple(replace(h, state="Down") for h in node.hcas))
        elif change == "port" and node.hcas:  # one rail down: a shard using it must go
            nodes[i] = replace(node, hcas=(replace(node.hcas[0], state="Down"), *node.hcas[1:]))
        elif change in ("lost", "ecc", "foreign") and node.gpus:
            g = node.gpus[k]
            bad = {
                "lost": replace(g, lost=True, problems=("lost: gone",)),
                "ecc": replace(g, ecc_uncorrected=2, problems=("ecc: 2 uncorrected ECC errors",)),
                "foreign": replace(g, problems=("foreign-process: pid 77 (python)",)),  # not a fault
            }[change]
            nodes[i] = replace(node, gpus=(*node.gpus[:k], bad, *node.gpus[k + 1 :]))
        elif change == "cordon":
            nodes[i] = replace(node, cordoned=True)
        elif change == "fewer":
            ms = [m.model_copy(update={"replicas": max(1, m.replicas - 1)}) for m in cat.models]
            cat = cat.model_copy(update={"models": ms})
        if current and nodes and draw(st.booleans()):
            # A second allocation of one replica, elsewhere (a record written twice), in any order.
            dup = draw(st.sampled_from(current))
            other = draw(st.sampled_from(nodes)).name
            current = [*current, replace(dup, shards=tuple(replace(s, node=other) for s in dup.shards))]
        current = list(draw(st.permutations(current)))
    return nodes, cat, current


# --------------------------------------------------------------------------- reference


def usable(node: NodeFacts) -> bool:
    return node.reachable and not node.cordoned


def free_gpus(node: NodeFacts, cls: str, taken: set[tuple[str, int]]) -> list[int]:
    return [g.index for g in node.gpus if g.gpu_class == cls and g.free and (node.name, g.index) not in taken]


def fits(p: Profile, nodes: list[NodeFacts], taken: set[tuple[str, int]], cpu: dict[str, list[int]]) -> bool:
    """Could ``p`` be placed right now? Written the obvious way, over every node."""
    if p.gpu_class:
        ok = [n for n in nodes if usable(n) and len(free_gpus(n, p.gpu_class, taken)) >= p.gpus_per_node]
        if p.nodes == 1:
            return bool(ok)
        for fab in FABRICS:
            if sum(1 for n in ok if any(h.is_ib_attachment and h.fabric == fab for h in n.hcas)) >= p.nodes:
                return True
        return False
    for n in nodes:
        if not usable(n):
            continue
        used_cpu, used_mib = cpu.get(n.name, [0, 0])
        if p.cpus and (n.cpus is None or n.cpus - used_cpu < p.cpus):
            continue
        if p.memory_mib and (n.memory_mib is None or n.memory_mib - used_mib < p.memory_mib):
            continue
        return True
    return False


def still_valid(r: Replica, by_name: dict[str, NodeFacts], cat: Catalog, held: set[tuple[str, int]]) -> bool:
    """May a running replica stay? The placer's rule for current allocations, written out:
    its model, replica number and profile are in the catalog and the profile still asks for
    what it holds; every node has facts and is reachable; every GPU exists, is healthy (not
    lost, no ECC or pending retirement/remap) and of the class, and no replica kept before it
    holds it; a multi-node replica's nodes still have an Active port on its fabric, and every
    HCA a shard uses still is one. A cordon
    does not stop a running replica, nor does a foreign process or MIG on its GPUs."""
    model = cat.model(r.model)
    if model is None or not 0 <= r.replica < model.replicas:
        return False
    prof = model.profile(r.profile)
    if prof is None or prof.engine != r.engine or (prof.gpu_class or None) != (r.gpu_class or None):
        return False
    if len(r.shards) != prof.nodes or len({s.node for s in r.shards}) != prof.nodes:
        return False
    if not prof.gpu_class and (r.cpus, r.memory_mib) != (prof.cpus, prof.memory_mib):
        return False
    for s in r.shards:
        n = by_name.get(s.node)
        if n is None or not n.reachable:
            return False
        if len(s.gpus) != prof.gpus_per_node or len(set(s.gpus)) != len(s.gpus):
            return False
        for i in s.gpus:
            g = next((g for g in n.gpus if g.index == i), None)
            if g is None or g.lost or not g.healthy or g.gpu_class != prof.gpu_class or (s.node, i) in held:
                return False
        if prof.nodes > 1:
            active = {h.ca for h in n.hcas if h.is_ib_attachment and h.fabric == r.fabric}
            if not active or not set(s.hcas) <= active:
                return False
    return True


def check_keeps_and_stops(nodes: list[NodeFacts], cat: Catalog, current: list[Replica], result: Plan) -> None:
    """Every current replica is kept if still valid (no churn) and stopped otherwise (no
    needless stop); of two allocations of one replica, the first valid one (in an order
    that does not depend on the input's: by model, number, then the whole allocation) is kept."""
    by_name = {n.name: n for n in nodes}
    held: set[tuple[str, int]] = set()
    seen: set[tuple[str, int]] = set()
    keep: list[Replica] = []
    stop: list[Replica] = []
    canonical = {id(r): json.dumps(r.to_dict(), sort_keys=True, default=str) for r in current}
    for r in sorted(current, key=lambda r: (r.model, r.replica, canonical[id(r)])):
        ok = r.key not in seen and still_valid(r, by_name, cat, held)
        if ok:
            seen.add(r.key)
        (keep if ok else stop).append(r)
        if ok:
            held.update((s.node, g) for s in r.shards for g in s.gpus)

    def ordered(rs: list[Replica]) -> list[Replica]:
        return sorted(rs, key=repr)

    def short(rs: list[Replica]) -> list[str]:
        return [f"{r.model}/{r.replica} {r.profile} on {'+'.join(s.node for s in r.shards)}" for r in rs]

    got_keep = ordered([p.replica for p in result.keeps])
    got_stop = ordered([p.replica for p in result.stops])
    assert got_keep == ordered(keep), f"kept {short(got_keep)}, should keep {short(ordered(keep))}"
    assert got_stop == ordered(stop), f"stopped {short(got_stop)}, should stop {short(ordered(stop))}"


def check_idempotent(nodes: list[NodeFacts], cat: Catalog, result: Plan) -> None:
    """The plan applied and nothing changed: planning again starts and stops nothing."""
    again = plan(nodes, cat, result.allocations())
    assert not again.starts, f"re-plan starts {[p.replica.key for p in again.starts]}"
    assert not again.stops, f"re-plan stops {[(p.replica.key, p.note) for p in again.stops]}"
    assert [(u.model, u.replica) for u in again.unplaced] == [(u.model, u.replica) for u in result.unplaced]


def check_invariants(nodes: list[NodeFacts], cat: Catalog, current: list[Replica], result: Plan) -> None:
    check_keeps_and_stops(nodes, cat, current, result)
    check_idempotent(nodes, cat, result)
    by_name = {n.name: n for n in nodes}
    taken: set[tuple[str, int]] = set()
    cpu: dict[str, list[int]] = {}

    def hold(r: Replica) -> None:
        for s in r.shards:
            for g in s.gpus:
                assert (s.node, g) not in taken, f"double allocation of {s.node} GPU {g}"
                taken.add((s.node, g))
            if not r.gpu_class:
                c = cpu.setdefault(s.node, [0, 0])
                c[0] += r.cpus or 0
                c[1] += r.memory_mib or 0

    for p in result.keeps:
        for s in p.replica.shards:
            n = by_name[s.node]
            assert n.reachable
            assert all(not g.lost and g.healthy for g in n.gpus if g.index in s.gpus), "kept on an unhealthy GPU"
        hold(p.replica)

    # Replay starts and failures in the placer's order.
    order = {m.name: i for i, m in enumerate(cat.models)}
    events: list[tuple[int, int, Any]] = [(order[p.replica.model], p.replica.replica, p) for p in result.starts]
    events += [(order[u.model], u.replica, u) for u in result.unplaced]
    for _, _, ev in sorted(events, key=lambda e: (e[0], e[1])):
        model = cat.model(ev.replica.model if hasattr(ev, "action") else ev.model)
        assert model is not None
        profiles = model.ordered_profiles()
        if not hasattr(ev, "action"):  # unplaced: nothing fit, and each profile is explained
            assert not any(fits(p, nodes, taken, cpu) for p in profiles)
            assert {r.profile for r in ev.reasons} == {p.name for p in profiles}
            continue
        r: Replica = ev.replica
        prof = model.profile(r.profile)
        assert prof is not None
        rank = profiles.index(prof)
        for higher in profiles[:rank]:
            assert not fits(higher, nodes, taken, cpu), f"{r.model}/{r.replica} got {prof.name}, {higher.name} fit"
        assert fits(prof, nodes, taken, cpu)
        assert len(r.shards) == prof.nodes and len({s.node for s in r.shards}) == prof.nodes
        for s in r.shards:
            n = by_name[s.node]
            assert usable(n), f"{s.node} cordoned or unreachable"
            gpus = {g.index: g for g in n.gpus}
            assert len(s.gpus) == prof.gpus_per_node
            for i in s.gpus:
                g = gpus[i]
                assert g.gpu_class == prof.gpu_class == r.gpu_class, "one GPU class per replica"
                assert g.free and g.healthy and not g.lost, f"{s.node} GPU {i}: {g.problems}"
            if prof.gpu_class and n.nvlink_domains and len(s.gpus) > 1:
                before = set(free_gpus(n, prof.gpu_class, taken))
                if any(len(before & set(d)) >= len(s.gpus) for d in n.nvlink_domains):
                    assert any(set(s.gpus) <= set(d) for d in n.nvlink_domains), f"TP group {s.gpus} spans domains"
            if prof.nodes > 1:
                assert r.fabric is not None and s.hcas
                active = {h.ca for h in n.hcas if h.is_ib_attachment and h.fabric == r.fabric}
                assert set(s.hcas) <= active, f"{s.node}: {s.hcas} not all Active on {r.fabric}"
            else:
                active = {h.ca for h in n.hcas if h.is_ib_attachment and h.fabric}
                assert r.fabric is None and set(s.hcas) <= active
        hold(r)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario_st(), st.randoms(use_true_random=False))
def test_invariants_hold_on_random_clusters(
    scenario: tuple[list[NodeFacts], Catalog, list[Replica]], rnd: random.Random
) -> None:
    nodes, cat, current = scenario
    result = plan(nodes, cat, current)
    check_invariants(nodes, cat, current, result)
    # Released whole: a stopped replica is stopped with all its shards.
    for p in result.stops:
        assert p.replica in current
    # Determinism, whatever the order of the inputs.
    shuffled = nodes[:]
    rnd.shuffle(shuffled)
    cur = current[:]
    rnd.shuffle(cur)
    assert plan(shuffled, cat, cur).to_dict() == result.to_dict()


@st.composite
def dgx_fleet_st(draw: Any) -> tuple[list[NodeFacts], Catalog, list[Replica]]:
    """DGX boxes on two fabrics with rails down and faults, asked for multi-node replicas."""
    nodes = []
    for i in range(draw(st.integers(2, 10))):
        fab = draw(st.sampled_from(FABRICS))
        rails = tuple(
            ib(
                f"mlx5_{k}",
                draw(st.sampled_from([fab, fab, fab, "ib-a", "ib-b"])),
                state=draw(st.sampled_from(["Active"] * 5 + ["Down"])),
            )
            for k in range(8)
        )
        faults = {g: draw(st.sampled_from(PROBLEMS)) for g in range(8)} if draw(st.booleans()) else {}
        gpus = tuple(gpu(f"d{i}", g, "H100", faults.get(g)) for g in range(8))
        nodes.append(NodeFacts(f"d{i}", cpus=224, memory_mib=2 << 20, gpus=gpus, nvlink_domains=(tuple(range(8)),),
                               hcas=rails, cordoned=draw(st.integers(0, 9)) == 0))  # fmt: skip
    profiles = [
        {"name": "multi", "engine": "vllm", "model": "/m", "gpu_class": "H100", "gpus": draw(st.sampled_from([2, 4, 8])),
         "nodes": draw(st.integers(2, 3)), "priority": 10},
        {"name": "single", "engine": "vllm", "model": "/m", "gpu_class": "H100", "gpus": draw(st.sampled_from([4, 8])), "priority": 1},
    ]  # fmt: skip
    cat = Catalog.model_validate(
        {"models": [{"name": "big", "replicas": draw(st.integers(1, 4)), "profiles": profiles}]}
    )
    return nodes, cat, []


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dgx_fleet_st())
def test_invariants_hold_on_dgx_fleets_with_multi_node_replicas(
    scenario: tuple[list[NodeFacts], Catalog, list[Replica]],
) -> None:
    nodes, cat, current = scenario
    check_invariants(nodes, cat, current, plan(nodes, cat, current))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes_st(), st.sampled_from(CLASSES), st.sampled_from([2, 3, 4]))
def test_one_tp_group_is_split_only_when_no_node_has_a_whole_domain(nodes: list[NodeFacts], cls: str, k: int) -> None:
    cat = Catalog.model_validate({"models": [{"name": "m", "profiles": [{"name": "tp", "engine": "vllm", "model": "/m",
                                                                            "gpu_class": cls, "gpus": k}]}]})  # fmt: skip
    p = plan(nodes, cat)
    if not p.placements:
        return
    (shard,) = p.placements[0].replica.shards
    by = {n.name: n for n in nodes}
    chosen = by[shard.node]
    domains = chosen.nvlink_domains
    in_one = domains is None or any(set(shard.gpus) <= set(d) for d in domains)
    if in_one:
        return

    def free(n: NodeFacts) -> list[int]:
        return [g.index for g in n.gpus if g.gpu_class == cls and g.free]

    def whole_domain(n: NodeFacts) -> bool:  # some NVLink domain of n has k free GPUs of the class
        return n.nvlink_domains is not None and any(len(set(d) & set(free(n))) >= k for d in n.nvlink_domains)

    whole = [n.name for n in nodes if n.reachable and not n.cordoned and whole_domain(n)]
    assert not whole, f"{shard.node} split {shard.gpus} while {whole} had a whole domain"
