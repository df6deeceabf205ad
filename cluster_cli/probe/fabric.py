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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cluster_cli.facts import DEFAULT_SUBNET_PREFIX, HcaPort, NodeFacts, prefix_text

__all__ = ["distrust_conflicting_ports", "fabric_conflicts", "fabric_warnings"]


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


def _off_declared(ports: list[_Seen], declared: Mapping[str, int]) -> list[_Seen]:
    """Ports whose subnet prefix is not the one the inventory declares for their fabric."""
    return [
        p for p in ports if (want := declared.get(p.fabric)) is not None and p.prefix is not None and p.prefix != want
    ]


def _declared_prefix(ports: list[_Seen], declared: Mapping[str, int]) -> list[str]:
    return [
        f"fabric {p.fabric}: {p.label} has subnet prefix {prefix_text(p.prefix or 0)} "
        f"but the inventory declares {prefix_text(declared[p.fabric])}"
        for p in _off_declared(ports, declared)
    ]


def _declared_prefix_summary(ports: list[_Seen], declared: Mapping[str, int], most: int = 5) -> list[str]:
    """``_declared_prefix`` with one line per fabric: a wrong ``subnet_prefix`` in the
    inventory puts every port of the fabric off it, and that is one mistake, not 16."""
    by_fabric: dict[str, list[_Seen]] = {}
    for p in _off_declared(ports, declared):
        by_fabric.setdefault(p.fabric, []).append(p)
    out: list[str] = []
    for fabric, off in by_fabric.items():
        if len(off) == 1:
            out.extend(_declared_prefix(off, declared))
            continue
        nodes = list(dict.fromkeys(p.node for p in off))
        shown = ", ".join(nodes[:most]) + (f" and {len(nodes) - most} more" if len(nodes) > most else "")
        seen = Counter(p.prefix or 0 for p in off)
        have = (
            prefix_text(next(iter(seen)))
            if len(seen) == 1
            else ", ".join(f"{prefix_text(x)} ({n})" for x, n in sorted(seen.items()))
        )
        out.append(
            f"fabric {fabric}: {len(off)} ports on {len(nodes)} node{'s' if len(nodes) > 1 else ''} ({shown}) "
            f"have subnet prefix {have} but the inventory declares {prefix_text(declared[fabric])} "
            f"(fabrics.{fabric}.subnet_prefix)"
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
    return _conflicts(nodes, declared or {}, summary=False)


def fabric_warnings(nodes: Sequence[NodeFacts], declared: Mapping[str, int] | None = None) -> list[str]:
    """``fabric_conflicts`` for a person to read: the same lines, except that ports off
    their fabric's declared subnet prefix are one line per fabric, with the ports and
    nodes counted (``fabric_conflicts`` still lists every port, for scripts)."""
    return _conflicts(nodes, declared or {}, summary=True)


def _conflicts(nodes: Sequence[NodeFacts], declared: Mapping[str, int], *, summary: bool) -> list[str]:
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
    out.extend((_declared_prefix_summary if summary else _declared_prefix)(seen, declared))
    out.extend(_cross_fabric(seen))
    return out


_Key = tuple[str, int]  # ("sm", GUID) or ("prefix", subnet prefix): the subnet a port shows


def _show(key: _Key) -> str:
    return f"SM {_guid(key[1])}" if key[0] == "sm" else f"subnet prefix {prefix_text(key[1])}"


def _verb(key: _Key, many: bool) -> str:
    return ("see" if many else "sees") if key[0] == "sm" else ("have" if many else "has")


def distrust_conflicting_ports(
    nodes: Sequence[NodeFacts], declared: Mapping[str, int] | None = None
) -> list[NodeFacts]:
    """Take ports whose subnet contradicts their declared fabric off that fabric.

    Per declared fabric, among Active InfiniBand ports of reachable nodes; a port taken off
    gets ``fabric=None`` and a ``fabric-conflict`` problem on its node, so a multi-node
    replica never spans two physical subnets. Evidence is the master SM a port sees and
    its subnet prefix; a port with neither (or, on a fabric with a declared prefix, with
    no SM but the declared prefix) is left as declared.

    With a prefix ``declared`` for the fabric: a port on another prefix is off; so is one
    that sees an SM only such ports see. If the ports on the declared prefix see one SM,
    that SM is the fabric's and a port seeing another is off; otherwise the largest group
    by SM is trusted.

    Without: a port with no SM joins the SM that the ports with its prefix see (when they
    all see one); ports are grouped by SM (or prefix, for those with no SM to join), the one
    largest group is trusted and the others are off (a tie trusts none); within the
    trusted group, ports off its most common prefix are off too. Pure; same node order.
    """
    declared = declared or {}
    bad: dict[tuple[str, str, int], str] = {}
    by_fabric: dict[str, list[tuple[str, HcaPort]]] = {}
    for n in nodes:
        if n.reachable:
            for h in n.hcas:
                if h.is_ib_attachment and h.fabric:
                    by_fabric.setdefault(h.fabric, []).append((n.name, h))

    def off(name: str, h: HcaPort, why: str) -> None:
        bad[(name, h.ca, h.port)] = f"fabric-conflict: {h.ca} port {h.port} {why}; not used for multi-node replicas"

    def vote(fabric: str, members: list[tuple[str, HcaPort, _Key]]) -> list[tuple[str, HcaPort, _Key]]:
        """The largest group by key stays (returned); the others go."""
        counts = Counter(k for *_, k in members)
        if len(counts) < 2:
            return members
        top = max(counts.values())
        leaders = sorted(k for k, c in counts.items() if c == top)
        trusted = leaders[0] if len(leaders) == 1 else None
        for name, h, k in members:
            if k == trusted:
                continue
            why = (
                f"most of its ports {_verb(trusted, True)} {_show(trusted)}"
                if trusted is not None
                else f"its ports split evenly between {', '.join(_show(x) for x in leaders)}"
            )
            off(name, h, f"{_verb(k, False)} {_show(k)} but fabric {fabric} is declared and {why}")
        return [m for m in members if m[2] == trusted]

    for fabric, ports in sorted(by_fabric.items()):
        want = declared.get(fabric)
        if want is not None:
            wrong_sms: set[int] = set()
            right_sms: set[int] = set()
            for name, h in ports:
                if h.subnet_prefix is not None and h.subnet_prefix != want:
                    off(name, h, f"has subnet prefix {prefix_text(h.subnet_prefix)} but fabric {fabric} is declared "
                                 f"with {prefix_text(want)}")  # fmt: skip
                    if h.sm_guid:
                        wrong_sms.add(h.sm_guid)
                elif h.subnet_prefix == want and h.sm_guid:
                    right_sms.add(h.sm_guid)
            wrong_sms -= right_sms
            rest = [(name, h) for name, h in ports if (name, h.ca, h.port) not in bad and h.sm_guid]
            for name, h in rest:
                if h.sm_guid in wrong_sms:
                    off(name, h, f"sees SM {_guid(h.sm_guid)}, which only ports off fabric {fabric}'s declared "
                                 f"subnet prefix {prefix_text(want)} see")  # fmt: skip
                elif len(right_sms) == 1 and h.sm_guid not in right_sms:
                    (sm,) = right_sms
                    off(name, h, f"sees SM {_guid(h.sm_guid)} but fabric {fabric}'s ports on its declared subnet "
                                 f"prefix {prefix_text(want)} see SM {_guid(sm)}")  # fmt: skip
            if len(right_sms) != 1:
                keyed = [(n, h, ("sm", h.sm_guid)) for n, h in rest if (n, h.ca, h.port) not in bad]
                vote(fabric, keyed)  # type: ignore[arg-type]
            continue
        # No declared prefix: the SM a prefix belongs to, where its ports agree on one.
        sms_of: dict[int, set[int]] = {}
        for _, h in ports:
            if h.sm_guid and h.subnet_prefix is not None:
                sms_of.setdefault(h.subnet_prefix, set()).add(h.sm_guid)
        keyed: list[tuple[str, HcaPort, _Key]] = []
        for name, h in ports:
            if h.sm_guid:
                keyed.append((name, h, ("sm", h.sm_guid)))
            elif h.subnet_prefix is not None:
                joined = sms_of.get(h.subnet_prefix, set())
                keyed.append((name, h, ("sm", next(iter(joined))) if len(joined) == 1 else ("prefix", h.subnet_prefix)))
        kept = vote(fabric, keyed)
        prefixes = Counter(h.subnet_prefix for _, h, _ in kept if h.subnet_prefix is not None)
        if len(prefixes) > 1:  # one SM, two prefixes: keep the ports on the most common one
            top = max(prefixes.values())
            leaders = sorted(p for p, c in prefixes.items() if c == top)
            for name, h, k in kept:
                if h.subnet_prefix is not None and (len(leaders) > 1 or h.subnet_prefix != leaders[0]):
                    off(name, h, f"has subnet prefix {prefix_text(h.subnet_prefix)} but the other ports of fabric "
                                 f"{fabric} that {_verb(k, True)} {_show(k)} do not")  # fmt: skip
    if not bad:
        return list(nodes)
    out = []
    for node in nodes:
        mine = [(h, bad.get((node.name, h.ca, h.port))) for h in node.hcas]
        if not any(why for _, why in mine):
            out.append(node)
            continue
        hcas = tuple(replace(h, fabric=None) if why else h for h, why in mine)
        out.append(replace(node, hcas=hcas, problems=node.problems + _per_reason(mine)))
    return out


def _per_reason(mine: list[tuple[HcaPort, str | None]]) -> tuple[str, ...]:
    """A node's port conflicts, one line per reason: a node declared on the wrong fabric has
    all its ports contradict it the same way, and says so once, not once per port."""
    groups: dict[str, list[HcaPort]] = {}
    for h, why in mine:
        if why:
            groups.setdefault(why.removeprefix(f"fabric-conflict: {h.ca} port {h.port} "), []).append(h)
    lines = []
    for reason, ports in groups.items():
        if len(ports) == 1:
            lines.append(f"fabric-conflict: {ports[0].ca} port {ports[0].port} {reason}")
        else:
            names = ", ".join(f"{h.ca}/{h.port}" for h in ports)
            lines.append(f"fabric-conflict: {len(ports)} ports ({names}) each {reason}")
    return tuple(lines)
