"""Tests for cluster_cli.probe.fabric.fabric_conflicts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.facts import DEFAULT_SUBNET_PREFIX, HcaPort, NodeFacts
from cluster_cli.probe.fabric import distrust_conflicting_ports, fabric_conflicts, fabric_warnings
from cluster_cli.probe.parsers.ibstat import parse_ibstat, parse_sminfo

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HGX = parse_ibstat((FIXTURES / "ibstat.hgx-h100-12ca-ib-plus-roce.txt").read_text())
SM_A = parse_sminfo((FIXTURES / "sminfo.master.txt").read_text())
assert SM_A is not None
SM_B = 0x0002C90200259202
SM_C = 0x0002C90200259203
IB_CAS = [p.ca for p in HGX if p.is_ib_attachment]


def node(
    name: str,
    *,
    fabric: str | None = "ib-a",
    sm: int | None = SM_A,
    reachable: bool = True,
    overrides: dict[str, dict[str, object]] | None = None,
) -> NodeFacts:
    """An HGX node from the real ibstat capture, every port declared `fabric` and seeing `sm`."""
    overrides = overrides or {}
    hcas = tuple(replace(p, **{"fabric": fabric, "sm_guid": sm, **overrides.get(p.ca, {})}) for p in HGX)
    return NodeFacts(name=name, hcas=hcas, reachable=reachable)


def test_consistent_fabric_has_no_conflicts() -> None:
    assert fabric_conflicts([node("gpu-01"), node("gpu-02")]) == []
    assert fabric_conflicts([]) == []


def test_same_fabric_different_sm() -> None:
    nodes = [node("gpu-01"), node("gpu-02", overrides={"mlx5_3": {"sm_guid": SM_B}})]
    assert fabric_conflicts(nodes) == [
        "fabric ib-a: gpu-01 mlx5_0 sees SM 0x0002c90200259201 but gpu-02 mlx5_3 sees SM 0x0002c90200259202 "
        "(declared the same fabric)"
    ]


def test_different_fabrics_same_sm() -> None:
    nodes = [node("gpu-01"), node("gpu-05", fabric="ib-b")]
    assert fabric_conflicts(nodes) == [
        "gpu-01 mlx5_0 (fabric ib-a) and gpu-05 mlx5_0 (fabric ib-b) see the same SM 0x0002c90200259201 "
        "(declared different fabrics)"
    ]


def test_different_fabrics_different_sms_is_fine() -> None:
    assert fabric_conflicts([node("gpu-01"), node("gpu-05", fabric="ib-b", sm=SM_B)]) == []


def test_equal_sm_lid_across_fabrics_is_not_a_conflict() -> None:
    """Every IB port of the capture has SM lid 1024: lids collide across fabrics."""
    assert {p.sm_lid for p in HGX if p.is_ib_attachment} == {1024}
    assert fabric_conflicts([node("gpu-01", sm=None), node("gpu-05", fabric="ib-b", sm=None)]) == []


def test_differing_sm_lid_within_fabric_is_a_conflict() -> None:
    seven = {ca: {"sm_lid": 7} for ca in IB_CAS}
    assert fabric_conflicts([node("gpu-01", sm=None), node("gpu-02", sm=None, overrides=seven)]) == [
        "fabric ib-a: gpu-01 mlx5_0 sees SM lid 1024 but gpu-02 mlx5_0 sees SM lid 7 (declared the same fabric)"
    ]


def test_lid_only_ports_compare_with_guid_ports_lid() -> None:
    nodes = [
        node("gpu-01"),
        node("gpu-02", sm=None),  # same lid 1024: consistent
        node("gpu-03", sm=None, overrides={"mlx5_9": {"sm_lid": 5}}),
    ]
    assert fabric_conflicts(nodes) == [
        "fabric ib-a: gpu-01 mlx5_0 sees SM lid 1024 but gpu-03 mlx5_9 sees SM lid 5 (declared the same fabric)"
    ]


def test_per_port_not_per_node() -> None:
    """Rails on separate fabrics: each node has ports on both; nothing conflicts."""
    rails = {ca: {"fabric": "ib-b", "sm_guid": SM_B} for ca in IB_CAS[4:]}
    nodes = [node("gpu-01", overrides=rails), node("gpu-02", overrides=rails)]
    assert fabric_conflicts(nodes) == []
    # ... but one rail port of gpu-02 seeing ib-a's SM is flagged on that port only.
    bad = dict(rails, **{IB_CAS[7]: {"fabric": "ib-b", "sm_guid": SM_A}})
    assert fabric_conflicts([node("gpu-01", overrides=rails), node("gpu-02", overrides=bad)]) == [
        f"fabric ib-b: gpu-01 {IB_CAS[4]} sees SM 0x0002c90200259202 but gpu-02 {IB_CAS[7]} sees SM "
        "0x0002c90200259201 (declared the same fabric)",
        f"gpu-01 mlx5_0 (fabric ib-a) and gpu-02 {IB_CAS[7]} (fabric ib-b) see the same SM 0x0002c90200259201 "
        "(declared different fabrics)",
    ]


def test_three_sms_in_one_fabric_reference_is_majority() -> None:
    nodes = [
        node("gpu-01", overrides={"mlx5_0": {"sm_guid": SM_C}}),
        node("gpu-02", sm=SM_B),
        node("gpu-03", sm=SM_B),
    ]
    # SM_B is seen by 16 ports, so gpu-02 mlx5_0 is the reference; groups follow port order.
    assert fabric_conflicts(nodes) == [
        "fabric ib-a: gpu-02 mlx5_0 sees SM 0x0002c90200259202 but gpu-01 mlx5_0 sees SM 0x0002c90200259203 "
        "(declared the same fabric)",
        "fabric ib-a: gpu-02 mlx5_0 sees SM 0x0002c90200259202 but gpu-01 mlx5_3 sees SM 0x0002c90200259201 "
        "(declared the same fabric)",
    ]


def test_ignored_ports_and_nodes() -> None:
    roce = {ca: {"sm_guid": SM_B} for ca in ("mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8")}
    nodes = [
        node("gpu-01", overrides=roce),  # Ethernet / Down ports never attach
        node("gpu-02", sm=SM_C, reachable=False),
        node("gpu-03", fabric=None, sm=SM_C),
        node("gpu-04", sm=SM_C, overrides={ca: {"state": "Down"} for ca in IB_CAS}),
    ]
    assert fabric_conflicts(nodes) == []


def test_zero_guid_and_zero_lid_are_unknown() -> None:
    assert fabric_conflicts([node("gpu-01"), node("gpu-02", sm=0)]) == []
    zero = {ca: {"sm_lid": 0} for ca in IB_CAS}
    assert fabric_conflicts([node("gpu-01", sm=None), node("gpu-02", sm=None, overrides=zero)]) == []


def test_multi_port_label_and_natural_order() -> None:
    p1 = HcaPort("mlx4_0", 1, "Active", "LinkUp", "InfiniBand", 40.0, 1, 3, 1, fabric="f", sm_guid=SM_A)
    nodes = [
        NodeFacts("node-10", hcas=(p1,)),
        NodeFacts("node-9", hcas=(replace(p1, port=2, sm_guid=SM_B),)),
        NodeFacts("node-2", hcas=(p1,)),
    ]
    assert fabric_conflicts(nodes) == [
        "fabric f: node-2 mlx4_0 sees SM 0x0002c90200259201 but node-9 mlx4_0 port 2 sees SM 0x0002c90200259202 "
        "(declared the same fabric)"
    ]


# ----------------------------------------------------------------------------- properties

_fabrics = st.sampled_from(["ib-a", "ib-b", "ib-c", None])
_sms = st.one_of(st.none(), st.sampled_from([SM_A, SM_B, SM_C]))
P1, P2 = 0xFEC0_0000_0000_0001, 0xFEC0_0000_0000_0002
_prefixes = st.sampled_from([None, DEFAULT_SUBNET_PREFIX, P1, P2])


@st.composite
def fleets(draw: st.DrawFn) -> list[NodeFacts]:
    out = []
    for i in range(draw(st.integers(0, 5))):
        hcas = []
        for p in HGX:
            hcas.append(
                replace(
                    p,
                    fabric=draw(_fabrics),
                    sm_guid=draw(_sms),
                    sm_lid=draw(st.sampled_from([0, 1, 1024, p.sm_lid])),
                    state=draw(st.sampled_from(["Active", p.state])),
                    subnet_prefix=draw(_prefixes),
                )
            )
        out.append(NodeFacts(name=f"gpu-{i:02d}", hcas=tuple(hcas), reachable=draw(st.booleans())))
    return out


@FUZZ
@given(fleets(), st.randoms(use_true_random=False))
def test_order_independent(nodes: list[NodeFacts], rnd: object) -> None:
    shuffled = [replace(n, hcas=tuple(rnd.sample(n.hcas, len(n.hcas)))) for n in nodes]  # type: ignore[attr-defined]
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    result = fabric_conflicts(nodes)
    assert fabric_conflicts(shuffled) == result
    assert all(isinstance(m, str) and "\n" not in m for m in result)
    assert len(result) == len(set(result))


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["ib-a", "ib-b", "ib-c"]), st.booleans()), min_size=1, max_size=6))
def test_one_sm_per_fabric_is_consistent(layout: list[tuple[str, bool]]) -> None:
    sm_of = {"ib-a": SM_A, "ib-b": SM_B, "ib-c": SM_C}
    nodes = [node(f"n{i}", fabric=f, sm=sm_of[f] if known else None) for i, (f, known) in enumerate(layout)]
    assert fabric_conflicts(nodes) == []


@FUZZ
@given(st.lists(st.sampled_from(["ib-a", "ib-b", "ib-c"]), min_size=2, max_size=6, unique=True))
def test_one_sm_shared_by_fabrics_is_flagged(fabrics: list[str]) -> None:
    nodes = [node(f"n{i}", fabric=f) for i, f in enumerate(fabrics)]
    result = fabric_conflicts(nodes)
    assert len(result) == len(fabrics) - 1
    assert all(m.endswith("(declared different fabrics)") for m in result)


# ---- ports taken off a fabric they contradict (what `place` plans with) -------------------


def test_minority_ports_leave_the_fabric_with_a_reason() -> None:
    nodes = [node("gpu-01"), node("gpu-02"), node("gpu-03", overrides={"mlx5_3": {"sm_guid": SM_B}})]
    out = distrust_conflicting_ports(nodes)
    assert out[:2] == nodes[:2]  # the majority is untouched, the very same objects
    bad = {h.ca: h.fabric for h in out[2].hcas if h.is_ib_attachment}
    assert bad["mlx5_3"] is None and all(f == "ib-a" for ca, f in bad.items() if ca != "mlx5_3")
    (why,) = out[2].problems
    assert why == (
        "fabric-conflict: mlx5_3 port 1 sees SM 0x0002c90200259202 but fabric ib-a is declared and most of "
        "its ports see SM 0x0002c90200259201; not used for multi-node replicas"
    )


def test_an_even_split_trusts_neither_side_and_unknown_sms_stay() -> None:
    nodes = [node("gpu-01"), node("gpu-02", sm=SM_B), node("gpu-03", sm=None)]
    out = distrust_conflicting_ports(nodes)
    assert all(h.fabric is None for n in out[:2] for h in n.hcas if h.is_ib_attachment)
    assert out[2] == nodes[2]  # no evidence either way: left as declared
    assert distrust_conflicting_ports([node("a"), node("b", fabric="ib-b")]) == [node("a"), node("b", fabric="ib-b")]


@FUZZ
@given(fleets())
def test_after_distrust_every_fabric_sees_one_sm(nodes: list[NodeFacts]) -> None:
    out = distrust_conflicting_ports(nodes)
    assert [n.name for n in out] == [n.name for n in nodes]
    by_fabric: dict[str, set[int]] = {}
    for before, after in zip(nodes, out, strict=True):
        for b, a in zip(before.hcas, after.hcas, strict=True):
            assert a.fabric in (b.fabric, None)  # only ever taken off, never moved
            if a.fabric and a.is_ib_attachment and a.sm_guid and after.reachable:
                by_fabric.setdefault(a.fabric, set()).add(a.sm_guid)
    assert all(len(sms) == 1 for sms in by_fabric.values())
    # No conflict among the declared same-fabric SM GUIDs is left for a multi-node replica to span.
    same = [c for c in fabric_conflicts(out) if "declared the same fabric" in c]
    assert not [c for c in same if "SM lid" not in c]  # SM GUIDs and subnet prefixes agree within a fabric


@FUZZ
@given(fleets(), st.dictionaries(st.sampled_from(["ib-a", "ib-b"]), _prefixes.filter(bool), max_size=2))
def test_after_distrust_no_port_is_off_its_fabrics_declared_prefix(nodes: list[NodeFacts], declared) -> None:
    out = distrust_conflicting_ports(nodes, declared)
    for before, n in zip(nodes, out, strict=True):
        for b, h in zip(before.hcas, n.hcas, strict=True):
            if n.reachable and h.is_ib_attachment and h.fabric in declared and h.subnet_prefix is not None:
                assert h.subnet_prefix == declared[h.fabric]
            if n.reachable and b.is_ib_attachment and b.fabric in declared and b.subnet_prefix is not None:
                # a port on its declared prefix is taken off only by the SM vote among such ports
                on_prefix = b.subnet_prefix == declared[b.fabric]
                if on_prefix and h.fabric is None:
                    assert any(
                        f"{b.ca} port {b.port} sees SM" in p
                        or (") each sees SM" in p and any(f"{c}{b.ca}/{b.port}{d}" in p for c in "( " for d in ",)"))
                        for p in n.problems
                    ), n.problems  # one port's line, or a line for several ports that includes it
    assert not [c for c in fabric_conflicts(out, declared) if "the inventory declares" in c]
    assert fabric_conflicts(nodes, declared) == fabric_conflicts(list(reversed(nodes)), declared)


def test_subnet_prefixes_same_fabric_declared_and_across_fabrics() -> None:
    def pre(n: NodeFacts, prefix: int) -> NodeFacts:
        return replace(n, hcas=tuple(replace(h, subnet_prefix=prefix) for h in n.hcas))

    a, b = pre(node("gpu-01"), P1), pre(node("gpu-02", overrides={"mlx5_3": {"sm_guid": SM_A}}), P1)
    assert fabric_conflicts([a, b]) == []
    b2 = replace(b, hcas=tuple(replace(h, subnet_prefix=P2) if h.ca == "mlx5_3" else h for h in b.hcas))
    assert fabric_conflicts([a, b2]) == [
        "fabric ib-a: gpu-01 mlx5_0 has subnet prefix fec0:0000:0000:0001 but gpu-02 mlx5_3 has "
        "fec0:0000:0000:0002 (declared the same fabric)"
    ]
    lines = fabric_conflicts([a, b2], {"ib-a": P1})
    assert lines[-1] == (
        "fabric ib-a: gpu-02 mlx5_3 has subnet prefix fec0:0000:0000:0002 but the inventory declares fec0:0000:0000:0001"
    )
    out = distrust_conflicting_ports([a, b2], {"ib-a": P1})
    assert out[0] == a and [h.ca for h in out[1].hcas if h.is_ib_attachment and h.fabric is None] == ["mlx5_3"]
    assert out[1].problems == (
        "fabric-conflict: mlx5_3 port 1 has subnet prefix fec0:0000:0000:0002 but fabric ib-a is declared with "
        "fec0:0000:0000:0001; not used for multi-node replicas",
    )

    # the wrong-prefix majority does not outvote the ports on the declared prefix (SM vote)
    def sm(n: NodeFacts, guid: int) -> NodeFacts:
        return replace(n, hcas=tuple(replace(h, sm_guid=guid) for h in n.hcas))

    right = [sm(pre(node(f"r{i}"), P1), SM_A) for i in range(2)]
    wrong = [sm(pre(node(f"w{i}"), P2), SM_B) for i in range(3)]
    out = distrust_conflicting_ports(right + wrong, {"ib-a": P1})
    assert out[:2] == right and all(h.fabric is None for n in out[2:] for h in n.hcas if h.is_ib_attachment)
    # with no prefix declared, the prefix vote alone settles a fabric whose SMs are unknown
    split = [pre(node(f"s{i}", sm=None), P1 if i < 3 else P2) for i in range(5)]
    out = distrust_conflicting_ports(split)
    assert out[:3] == split[:3]
    (line,) = out[3].problems  # one line for the node's ports that contradict it the same way
    assert line.startswith("fabric-conflict: 8 ports (mlx5_0/1, ") and " each has subnet prefix " in line
    assert "most of its ports have subnet prefix fec0:0000:0000:0001" in line
    # across fabrics: a shared non-default prefix is a conflict, the shared default is not
    c = pre(node("gpu-03", fabric="ib-b", sm=SM_B), P1)
    assert fabric_conflicts([a, c])[-1].endswith(
        "have the same subnet prefix fec0:0000:0000:0001 (declared different fabrics)"
    )
    d, e = (
        pre(node("gpu-04", sm=SM_A), DEFAULT_SUBNET_PREFIX),
        pre(node("gpu-05", fabric="ib-b", sm=SM_B), DEFAULT_SUBNET_PREFIX),
    )
    assert fabric_conflicts([d, e]) == []


def _port(name: str, *, sm: int | None, prefix: int | None, fabric: str = "ib") -> NodeFacts:
    h = HcaPort("mlx5_0", 1, "Active", link_layer="InfiniBand", fabric=fabric, sm_guid=sm, subnet_prefix=prefix)
    return NodeFacts(name=name, hcas=(h,))


def _kept(out: list[NodeFacts]) -> list[str]:
    return [n.name for n in out if n.hcas[0].fabric is not None]


def test_ports_on_the_declared_prefix_decide_the_fabrics_sm() -> None:
    ok = [_port(f"ok{i}", sm=SM_A, prefix=P1) for i in range(2)]
    wrong = [_port(f"bad{i}", sm=SM_B, prefix=P2) for i in range(2)]
    unknown = [_port(f"u{i}", sm=SM_B, prefix=None) for i in range(3)]
    out = distrust_conflicting_ports(ok + wrong + unknown, {"ib": P1})
    assert _kept(out) == ["ok0", "ok1"]  # SM_B is the wrong subnet's: its majority does not win
    assert "which only ports off fabric ib's declared subnet prefix" in out[-1].problems[0]
    out = distrust_conflicting_ports(ok + unknown[:2], {"ib": P1})  # 2 against 2: the declared prefix decides
    assert _kept(out) == ["ok0", "ok1"]
    assert "ports on its declared subnet prefix fec0:0000:0000:0001 see SM" in out[-1].problems[0]
    nosm = _port("n", sm=None, prefix=P1)  # the declared prefix and no SM: nothing against it
    assert _kept(distrust_conflicting_ports([*ok, *unknown, nosm], {"ib": P1}))[-1] == "n"


def test_without_a_declared_prefix_the_sm_and_prefix_votes_are_one() -> None:
    g1 = [_port(f"a{i}", sm=SM_A, prefix=P1) for i in range(2)]
    g2 = [_port("c1", sm=SM_B, prefix=P2)]
    nosm = [_port(f"n{i}", sm=None, prefix=P2) for i in range(3)]
    out = distrust_conflicting_ports(g1 + g2 + nosm)  # P2's ports join SM_B: 4 against 2
    assert _kept(out) == ["c1", "n0", "n1", "n2"]
    out = distrust_conflicting_ports(g1 + g2 + nosm[:2])  # 3 against 2
    assert _kept(out) == ["c1", "n0", "n1"]
    zero = [_port(f"z{i}", sm=None, prefix=0) for i in range(3)]  # a prefix of 0 is evidence too
    assert _kept(distrust_conflicting_ports(g1 + zero)) == ["z0", "z1", "z2"]


def test_a_wrong_declared_prefix_is_one_warning_per_fabric() -> None:
    def pre(n: NodeFacts, prefix: int) -> NodeFacts:
        return replace(n, hcas=tuple(replace(h, subnet_prefix=prefix) for h in n.hcas))

    nodes = [pre(node("gpu-01"), P1), pre(node("gpu-02"), P1)]  # the inventory's subnet_prefix is a typo
    ports = len(IB_CAS)
    assert len(fabric_conflicts(nodes, {"ib-a": P2})) == 2 * ports  # scripts still get every port
    assert fabric_warnings(nodes, {"ib-a": P2}) == [
        f"fabric ib-a: {2 * ports} ports on 2 nodes (gpu-01, gpu-02) have subnet prefix fec0:0000:0000:0001 "
        "but the inventory declares fec0:0000:0000:0002 (fabrics.ib-a.subnet_prefix)"
    ]
    one = [
        replace(nodes[0], hcas=tuple(replace(h, subnet_prefix=P1 if h.ca == "mlx5_0" else P2) for h in nodes[0].hcas))
    ]
    assert fabric_warnings(one, {"ib-a": P2}) == fabric_conflicts(one, {"ib-a": P2})  # a single port: as before
    assert fabric_warnings(nodes) == fabric_conflicts(nodes)
