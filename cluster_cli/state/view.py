"""Stored node facts as the current inventory sees them (pure).

Facts are what a node's hardware said when it was probed; which fabric a port is on, the
GPU class names and the labels are what the inventory says now. Commands that read
facts back from the state (discover's fabric cross-check, place) look through this.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from cluster_cli.config.inventory import Inventory
from cluster_cli.facts import Gpu, NodeFacts, problem_key
from cluster_cli.machines import mark_duplicate_gpus

__all__ = [
    "FENCED",
    "for_inventory",
    "note_changes",
    "note_lost_ports",
    "note_unlisted_gpus",
    "note_vanished_gpus",
    "with_fenced",
]


def for_inventory(
    inv: Inventory,
    facts: list[NodeFacts],
    *,
    from_state: bool = False,
    cordons: Mapping[str, str | None] | None = None,
) -> list[NodeFacts]:
    """Only the inventory's nodes, with its fabric assignments, GPU classes and labels applied
    (a GPU whose facts give a product but no class gets the product's class).

    The inventory is the source of truth for fabrics: on a node it puts on a fabric, every
    Active InfiniBand port's fabric is the one it gives now (node default or per-HCA
    override), whatever the facts recorded. Facts of a node it puts on no fabric keep their
    own when they were written by hand; ``from_state`` facts were recorded by discover from
    an older inventory, so there the inventory rules alone (no fabric declared: none).
    Labels: ``from_state``, the inventory's alone; else both, the inventory winning a key both give.

    A node the inventory names but that has no facts is listed as unreachable, so
    explanations say so instead of leaving it out; when ``cordons`` (node -> reason, from
    the state store) cordons it, it is listed cordoned too, with its reason, and placement
    says that first. A node showing a GPU UUID that a node
    earlier in the inventory shows is the same machine under a second name: it gets a
    ``duplicate-gpu`` problem, and placement leaves it out.
    """
    by_name = {f.name: f for f in facts}
    listed = {p for names in inv.gpu_classes.values() for p in names}
    out = []
    for n in inv.nodes:
        f = by_name.get(n.name)
        if f is None:
            cordoned = cordons is not None and n.name in cordons
            reason = cordons.get(n.name) if cordons is not None else None
            placeholder = NodeFacts(n.name, host=n.host, reachable=False, error="no facts (not discovered yet)")
            out.append(replace(placeholder, cordoned=cordoned, cordon_reason=reason) if cordoned else placeholder)
            continue
        # The inventory says which fabric a port is on, now: a fabric stored with the facts is
        # what the inventory said when the node was probed, and a node may have moved since.
        # Only for a node the inventory puts on no fabric at all do the facts' fabrics stand.
        declared = from_state or n.fabric is not None or bool(n.hca_fabrics)
        hcas = tuple(
            replace(h, fabric=inv.fabric_for(n, h.ca) if h.is_ib_attachment else None) if declared else h
            for h in f.hcas
        )
        # A class left out of hand-written facts is the product's, as discover would name it.
        gpus = tuple(_reclass(g, inv) if g.product in listed or (not g.gpu_class and g.product) else g for g in f.gpus)
        fabric = n.fabric if declared else f.fabric
        labels = dict(n.labels) if from_state else {**f.labels, **n.labels}  # stored labels were the inventory's
        out.append(replace(f, hcas=hcas, gpus=gpus, fabric=fabric, labels=labels))
    return mark_duplicate_gpus(out)


FENCED = "fenced"


def with_fenced(facts: list[NodeFacts], fenced: Mapping[str, Mapping[int, str]]) -> list[NodeFacts]:
    """``facts`` with a ``fenced`` problem on every GPU a replica no longer wanted still holds
    (``fenced``: node -> index -> who, and why): its stop is not done or was not confirmed,
    so its engine may still use the GPU, and placement must not give it to another. Pure."""
    if not fenced:
        return facts
    out = []
    for f in facts:
        held = fenced.get(f.name)
        if not held:
            out.append(f)
            continue
        gpus = tuple(
            replace(g, problems=(*g.problems, f"{FENCED}: held by {held[g.index]}")) if g.index in held else g
            for g in f.gpus
        )
        out.append(replace(f, gpus=gpus))
    return out


def _reclass(g: Gpu, inv: Inventory) -> Gpu:
    return replace(g, gpu_class=inv.gpu_class(g.product))


VANISHED = "gpus-gone"
UNLISTED = "gpus-unlisted"
_FAILED = ("gpu", "nvidia-smi")  # keys of the problems that say nvidia-smi could not list the GPUs
# The end of a gpus-gone or gpus-unlisted problem: when the GPUs were last listed, and what they were.
_SEEN = re.compile(r"discover(?P<when> \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\))? saw (?P<had>.+)$")


def _when(t: float | None) -> str:
    return f" ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t))})" if t is not None else ""


def _had(old: NodeFacts) -> str:
    seen = Counter(g.gpu_class for g in old.gpus if not g.lost)
    return ", ".join(f"{n} {cls}" for cls, n in sorted(seen.items())) or f"{len(old.gpus)} GPUs"


def _remembered(old: NodeFacts) -> tuple[str, str] | None:
    """``(when, had)`` of the GPUs an earlier discover listed, as a ``gpus-gone`` or
    ``gpus-unlisted`` problem of ``old`` keeps them; None when it keeps none."""
    for p in old.problems:
        if problem_key(p) in (VANISHED, UNLISTED):
            m = _SEEN.search(p)
            return (m["when"] or "", m["had"]) if m else ("", "GPUs")
    return None


def note_vanished_gpus(new: NodeFacts, old: NodeFacts | None) -> NodeFacts:
    """``new``, with a ``gpus-gone`` problem when it answered with no GPU and no GPU problem
    (nvidia-smi not found, or listing nothing) although the last discover (``old``) saw GPUs
    on it, or could not list them but remembered an earlier discover that did (a
    ``gpus-unlisted`` problem): a driver removed or a PATH changed must not turn a GPU node
    into a CPU-only one without a word. The problem stays, run after run, until GPUs show
    again. Pure."""
    if old is None or not new.reachable or new.gpus:
        return new
    if any(problem_key(p) in (*_FAILED, VANISHED) for p in new.problems):
        return new  # nvidia-smi failing already says why
    carried = next((p for p in old.problems if problem_key(p) == VANISHED), None)
    if carried is not None:  # still gone: said again on every discover until they come back
        return replace(new, problems=(*new.problems, carried))
    if not old.gpus:
        remembered = _remembered(old)  # nvidia-smi failed last time: what was listed before that
        if remembered is None:
            return new  # never seen with GPUs: a CPU node
        when, had = remembered
        problem = (
            f"{VANISHED}: nvidia-smi shows no GPU here (not installed, or not on PATH, or no driver), "
            f"but an earlier discover{when} saw {had}"
        )
        return replace(new, problems=(*new.problems, problem))
    problem = (
        f"{VANISHED}: nvidia-smi shows no GPU here (not installed, or not on PATH, or no driver), "
        f"but the last discover{_when(old.probed_at)} saw {_had(old)}"
    )
    return replace(new, problems=(*new.problems, problem))


def note_unlisted_gpus(new: NodeFacts, old: NodeFacts | None) -> NodeFacts:
    """``new``, with a ``gpus-unlisted`` problem when nvidia-smi failed (a ``gpu`` or
    ``nvidia-smi`` problem, no GPU listed) on a node that had GPUs at the last discover, or
    still remembers them (``gpus-gone``, ``gpus-unlisted``): the stored facts then hold no
    GPU, and this keeps what was seen, so that a next discover that finds no nvidia-smi at
    all says ``gpus-gone`` instead of taking the node for a CPU-only one. Said on every
    discover until GPUs are listed again. A node never seen with GPUs gets nothing. Pure."""
    if old is None or not new.reachable or new.gpus:
        return new
    if not any(problem_key(p) in _FAILED for p in new.problems):
        return new
    if old.gpus:
        seen = f"the last discover{_when(old.probed_at)} saw {_had(old)}"
    else:
        remembered = _remembered(old)
        if remembered is None:
            return new
        when, had = remembered
        seen = f"an earlier discover{when} saw {had}"
    return replace(new, problems=(*new.problems, f"{UNLISTED}: nvidia-smi cannot list the GPUs now, but {seen}"))


PORT_DOWN = "ib-port-down"
_PORT = re.compile(rf"{PORT_DOWN}: (?P<ca>\S+) port (?P<port>\d+) ")


def note_lost_ports(new: NodeFacts, old: NodeFacts | None) -> NodeFacts:
    """``new``, with an ``ib-port-down`` problem for each InfiniBand port that was Active at
    the last discover and is not now (a cable, a switch port, a rail gone: placement quietly
    uses one HCA fewer). Said on every discover until the port is Active again, also through
    discovers where ibstat lists no port at all (failing: ``old`` then holds no port, only
    the problems carried). Ports that were never Active (unused ports of a dual-port card)
    are not a problem. Pure."""
    if not new.reachable:
        return new
    now = {(h.ca, h.port): h for h in new.hcas}
    carried = [p for p in old.problems if problem_key(p) == PORT_DOWN] if old is not None else []
    problems: list[str] = []
    for h in old.hcas if old is not None else ():
        cur = now.get((h.ca, h.port))
        if cur is not None and cur.is_ib_attachment:
            continue
        was = next((p for p in carried if p.startswith(f"{PORT_DOWN}: {h.ca} port {h.port} ")), None)
        if was is not None:
            problems.append(was)
        elif h.is_ib_attachment:
            state = "missing from ibstat" if cur is None else f"{cur.state} ({cur.physical_state or 'unknown'})"
            fabric = f" on {h.fabric}" if h.fabric else ""
            problems.append(f"{PORT_DOWN}: {h.ca} port {h.port} was Active{fabric} at the last discover, now {state}")
    problems += _dead_rails(new, problems)
    if old is None:
        return replace(new, problems=(*new.problems, *problems)) if problems else new
    # A port down at the last discover that it did not list at all (ibstat failed, or the card
    # vanished from it): still down until ibstat shows it Active again.
    known = {(h.ca, h.port) for h in old.hcas}
    for p in carried:
        m = _PORT.match(p)
        if m is None or (m["ca"], int(m["port"])) in known or p in problems:
            continue
        cur = now.get((m["ca"], int(m["port"])))
        if cur is None or not cur.is_ib_attachment:
            problems.append(p)
    if not problems:
        return new
    return replace(new, problems=(*new.problems, *problems))


def _dead_rails(f: NodeFacts, said: list[str]) -> list[str]:
    """An InfiniBand card with no Active port while other cards of its kind on the node have
    one: a rail whose cable, switch port or card is down, also on a node's first discover
    (nothing was seen Active before to compare with). The unused second port of a dual-port
    card is not one: its card has an Active port. Ports ``said`` reports already are skipped."""
    active_cas = {h.ca for h in f.hcas if h.is_ib_attachment}
    kind_of = {h.ca: h.ca_type for h in f.hcas if h.ca_type}
    kinds = Counter(kind_of[ca] for ca in active_cas if ca in kind_of)  # cards (not ports) with an Active port
    out = []
    for h in f.hcas:
        if h.ca in active_cas or h.link_layer != "InfiniBand" or not h.ca_type or not kinds.get(h.ca_type):
            continue
        if any(p.startswith(f"{PORT_DOWN}: {h.ca} port {h.port} ") for p in said):
            continue
        n = kinds[h.ca_type]
        out.append(
            f"{PORT_DOWN}: {h.ca} port {h.port} is {h.state} ({h.physical_state or 'unknown'}) while "
            f"{n} other {h.ca_type} card{'s' if n != 1 else ''} on this node {'are' if n != 1 else 'is'} Active"
        )
    return out


def note_changes(new: NodeFacts, old: NodeFacts | None) -> NodeFacts:
    """What went missing since the last discover (GPUs, InfiniBand ports), as problems; and
    the GPUs seen before, kept while nvidia-smi cannot list them."""
    return note_lost_ports(note_unlisted_gpus(note_vanished_gpus(new, old), old), old)
