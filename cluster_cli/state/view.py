"""Stored node facts as the current inventory sees them (pure).

Facts are what a node's hardware said when it was probed; which fabric a port is on, the
GPU class names and the labels are what the inventory says now. Commands that read
facts back from the state (discover's fabric cross-check, place) look through this.
"""

from __future__ import annotations

from dataclasses import replace

from cluster_cli.config.inventory import Inventory
from cluster_cli.facts import Gpu, NodeFacts
from cluster_cli.placement.constraints.duplicate import mark_duplicate_gpus

__all__ = ["for_inventory"]


def for_inventory(inv: Inventory, facts: list[NodeFacts], *, from_state: bool = False) -> list[NodeFacts]:
    """Only the inventory's nodes, with its fabric assignments, GPU classes and labels applied.

    The inventory is the source of truth for fabrics: on a node it puts on a fabric, every
    Active InfiniBand port's fabric is the one it gives now (node default or per-HCA
    override), whatever the facts recorded. Facts of a node it puts on no fabric keep their
    own when they were written by hand; ``from_state`` facts were recorded by discover from
    an older inventory, so there the inventory rules alone (no fabric declared: none).
    Labels: ``from_state``, the inventory's alone; else both, the inventory winning a key both give.

    A node the inventory names but that has no facts is listed as unreachable, so
    explanations say so instead of leaving it out. A node showing a GPU UUID that a node
    earlier in the inventory shows is the same machine under a second name: it gets a
    ``duplicate-gpu`` problem, and placement leaves it out.
    """
    by_name = {f.name: f for f in facts}
    listed = {p for names in inv.gpu_classes.values() for p in names}
    out = []
    for n in inv.nodes:
        f = by_name.get(n.name)
        if f is None:
            out.append(NodeFacts(n.name, host=n.host, reachable=False, error="no facts (not discovered yet)"))
            continue
        # The inventory says which fabric a port is on, now: a fabric stored with the facts is
        # what the inventory said when the node was probed, and a node may have moved since.
        # Only for a node the inventory puts on no fabric at all do the facts' fabrics stand.
        declared = from_state or n.fabric is not None or bool(n.hca_fabrics)
        hcas = tuple(
            replace(h, fabric=inv.fabric_for(n, h.ca) if h.is_ib_attachment else None) if declared else h
            for h in f.hcas
        )
        gpus = tuple(_reclass(g, inv) if g.product in listed else g for g in f.gpus)
        fabric = n.fabric if declared else f.fabric
        labels = dict(n.labels) if from_state else {**f.labels, **n.labels}  # stored labels were the inventory's
        out.append(replace(f, hcas=hcas, gpus=gpus, fabric=fabric, labels=labels))
    return mark_duplicate_gpus(out)


def _reclass(g: Gpu, inv: Inventory) -> Gpu:
    return replace(g, gpu_class=inv.gpu_class(g.product))
