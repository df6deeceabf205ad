"""Cross-check declared InfiniBand fabrics against what each port sees (pure).

The evidence per Active InfiniBand port is the master SM it sees: ``sm_guid`` when
known (strong), else ``sm_lid`` (weak: small per-subnet integers collide across
fabrics and change on failover), and the subnet prefix of its GID (one per subnet,
but the default ``fe80:0000:0000:0000`` is shared by every subnet left at it). So:

* within one declared fabric, different SM GUIDs, or different SM lids, or different
  subnet prefixes, are a conflict;
* across declared fabrics, the same SM GUID is a conflict, and so is the same subnet
  prefix unless it is the default; the same SM lid is not;
* a port whose subnet prefix is not the one the inventory declares for its fabric
  (``fabrics.NAME.subnet_prefix``) is a conflict.

Comparison is per port (rail), never per node.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from cluster_cli.facts import DEFAULT_SUBNET_PREFIX, NodeFacts, prefix_text

__all__ = ["distrust_conflicting_ports", "fabric_conflicts"]


@dataclass(frozen=True)
class _Seen:
    node: str
    ca: str
    port: int
    fabric: str
    sm_guid: int | None
    sm_lid: int | None
    prefix: int | None = None

    @property
    def label(self) -> str:
        return f"{self.node} {self.ca}" if self.port == 1 else f"{self.node} {self.ca} port {self.port}"


def _natural(s: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"([0-9]+)", s))


def _sort_key(s: _Seen) -> tuple[object, ...]:
    return (_natural(s.node), s.node, _natural(s.ca), s.ca, s.port)


def _guid(g: int) -> str:
    return f"0x{g:016x}"


def _group(ports: list[_Seen], key: str) -> dict[int, list[_Seen]]:
    groups: dict[int, list[_Seen]] = {}
    for p in ports:
        groups.setdefault(getattr(p, key), []).append(p)
    return groups


def _largest(groups: dict[int, list[_Seen]]) -> list[_Seen]:
    return max(groups.values(), key=len)  # first of the largest: groups are in sorted-port order


def _same_fabric(fabric: str, ports: list[_Seen]) -> list[str]:
    out: list[str] = []
    ref: _Seen | None = None
    by_guid = _group([p for p in ports if p.sm_guid is not None], "sm_guid")
    if by_guid:
        ref_group = _largest(by_guid)
        ref = ref_group[0]
        for grp in by_guid.values():
            if grp is not ref_group:
                a, b = ref, grp[0]
                out.append(
                    f"fabric {fabric}: {a.label} sees SM {_guid(a.sm_guid or 0)} but {b.label} "
                    f"sees SM {_guid(b.sm_guid or 0)} (declared the same fabric)"
                )
    by_lid = _group([p for p in ports if p.sm_guid is None and p.sm_lid is not None], "sm_lid")
    if by_lid and (ref is None or ref.sm_lid is None):
        ref = _largest(by_lid)[0]
    if ref is not None and ref.sm_lid is not None:
        for lid, grp in by_lid.items():
            if lid != ref.sm_lid:
                b = grp[0]
                out.append(
                    f"fabric {fabric}: {ref.label} sees SM lid {ref.sm_lid} but {b.label} "
                    f"sees SM lid {lid} (declared the same fabric)"
                )
    by_prefix = _group([p for p in ports if p.prefix is not None], "prefix")
    if len(by_prefix) > 1:
        ref_group = _largest(by_prefix)
        a = ref_group[0]
        for grp in by_prefix.values():
            if grp is not ref_group:
                b = grp[0]
                out.append(
                    f"fabric {fabric}: {a.label} has subnet prefix {prefix_text(a.prefix or 0)} but {b.label} "
                    f"has {prefix_text(b.prefix or 0)} (declared the same fabric)"
                )
    return out


def _declared_prefix(ports: list[_Seen], declared: Mapping[str, int]) -> list[str]:
    out: list[str] = []
    for p in ports:
        want = declared.get(p.fabric)
        if want is not None and p.prefix is not None and p.prefix != want:
            out.append(
                f"fabric {p.fabric}: {p.label} has subnet prefix {prefix_text(p.prefix)} "
                f"but the inventory declares {prefix_text(want)}"
            )
    return out


def _cross_fabric(ports: list[_Seen]) -> list[str]:
    out: list[str] = []
    by_guid = _group([p for p in ports if p.sm_guid is not None], "sm_guid")
    for guid in sorted(by_guid):
        first_per_fabric: dict[str, _Seen] = {}
        for p in by_guid[guid]:
            first_per_fabric.setdefault(p.fabric, p)
        fabrics = sorted(first_per_fabric)
        a = first_per_fabric[fabrics[0]]
        for f in fabrics[1:]:
            b = first_per_fabric[f]
            out.append(
                f"{a.label} (fabric {a.fabric}) and {b.label} (fabric {b.fabric}) "
                f"see the same SM {_guid(guid)} (declared different fabrics)"
            )
    by_prefix = _group([p for p in ports if p.prefix not in (None, DEFAULT_SUBNET_PREFIX)], "prefix")
    for prefix in sorted(by_prefix):
        first: dict[str, _Seen] = {}
        for p in by_prefix[prefix]:
            first.setdefault(p.fabric, p)
        names = sorted(first)
        for f in names[1:]:
            a, b = first[names[0]], first[f]
            out.append(
                f"{a.label} (fabric {a.fabric}) and {b.label} (fabric {b.fabric}) "
                f"have the same subnet prefix {prefix_text(prefix)} (declared different fabrics)"
            )
    return out


def fabric_conflicts(nodes: Sequence[NodeFacts], declared: Mapping[str, int] | None = None) -> list[str]:
    """One line per contradiction between declared fabrics and observed subnets.

    Only Active InfiniBand ports of reachable nodes with a declared ``fabric`` count;
    SM lid 0 counts as unknown. ``declared`` maps a fabric to the subnet prefix the
    inventory gives it. Same-fabric conflicts come first (by fabric name), then ports
    off their declared prefix, then cross-fabric ones (by SM GUID, then prefix).
    """
    seen: list[_Seen] = []
    for node in nodes:
        if not node.reachable:
            continue
        for h in node.hcas:
            if not h.is_ib_attachment or not h.fabric:
                continue
            seen.append(_Seen(node.name, h.ca, h.port, h.fabric, h.sm_guid or None, h.sm_lid or None, h.subnet_prefix))
    seen.sort(key=_sort_key)

    out: list[str] = []
    by_fabric: dict[str, list[_Seen]] = {}
    for s in seen:
        by_fabric.setdefault(s.fabric, []).append(s)
    for fabric in sorted(by_fabric):
        out.extend(_same_fabric(fabric, by_fabric[fabric]))
    out.extend(_declared_prefix(seen, declared or {}))
    out.extend(_cross_fabric(seen))
    return out


def distrust_conflicting_ports(
    nodes: Sequence[NodeFacts], declared: Mapping[str, int] | None = None
) -> list[NodeFacts]:
    """Take ports whose subnet contradicts their declared fabric off that fabric.

    First, a port whose subnet prefix is not the one ``declared`` for its fabric is off it.
    Then, among the rest, within one declared fabric, Active InfiniBand ports are grouped
    by the SM GUID they see, and then (for a fabric with no declared prefix) by their
    subnet prefix. When a grouping disagrees, the one largest group is trusted and every
    other port is taken off the fabric (``fabric=None``) with a ``fabric-conflict`` problem
    on its node, so a multi-node replica never spans two physical subnets. When the largest
    groups tie, none of them can be trusted. A port with neither piece of evidence is left
    as declared. Pure; nodes come back in the same order.
    """
    declared = declared or {}
    bad: dict[tuple[str, str, int], str] = {}
    attached = [(n, h) for n in nodes if n.reachable for h in n.hcas if h.is_ib_attachment and h.fabric]
    for node, h in attached:
        want = declared.get(h.fabric or "")
        if want is not None and h.subnet_prefix is not None and h.subnet_prefix != want:
            bad[(node.name, h.ca, h.port)] = (
                f"fabric-conflict: {h.ca} port {h.port} has subnet prefix {prefix_text(h.subnet_prefix)} but "
                f"fabric {h.fabric} is declared with {prefix_text(want)}; not used for multi-node replicas"
            )

    def vote(evidence: str, show: Callable[[int], str], what: str, one: str, many: str) -> None:
        """Per fabric, group the ports not already taken off by ``evidence``; the minority goes."""
        groups: dict[str, list[tuple[str, str, int, int]]] = {}
        for node, h in attached:
            value = getattr(h, evidence)
            if (
                value
                and (node.name, h.ca, h.port) not in bad
                and (evidence != "subnet_prefix" or h.fabric not in declared)
            ):
                groups.setdefault(h.fabric or "", []).append((node.name, h.ca, h.port, value))
        for fabric, seen in groups.items():
            counts = Counter(v for *_, v in seen)
            if len(counts) < 2:
                continue
            top = max(counts.values())
            leaders = [v for v, c in counts.items() if c == top]
            trusted = leaders[0] if len(leaders) == 1 else None
            for name, ca, port, v in seen:
                if v == trusted:
                    continue
                why = (
                    f"most of its ports {many} {what} {show(trusted)}"
                    if trusted is not None
                    else f"its ports split evenly between {what}s {', '.join(show(x) for x in sorted(leaders))}"
                )
                bad[(name, ca, port)] = (
                    f"fabric-conflict: {ca} port {port} {one} {what} {show(v)} but fabric {fabric} is declared "
                    f"and {why}; not used for multi-node replicas"
                )

    vote("sm_guid", _guid, "SM", "sees", "see")
    vote("subnet_prefix", prefix_text, "subnet prefix", "has", "have")
    if not bad:
        return list(nodes)
    out = []
    for node in nodes:
        mine = [(h, bad.get((node.name, h.ca, h.port))) for h in node.hcas]
        if not any(why for _, why in mine):
            out.append(node)
            continue
        hcas = tuple(replace(h, fabric=None) if why else h for h, why in mine)
        out.append(replace(node, hcas=hcas, problems=node.problems + tuple(why for _, why in mine if why)))
    return out
