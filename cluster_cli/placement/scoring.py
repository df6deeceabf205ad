"""How the placer ranks feasible choices; each scorer is itemised, then averaged.

The placer does not score every node: it keeps nodes indexed so that the best
candidate under each rule is found directly (see ``indexes``). These functions are
the rules, written once, plus the scores recorded for the node that was chosen:

* ``binpack``  single-node GPU replicas: fewest free GPUs of the class left on the
  node afterwards (best fit), so whole nodes stay free for replicas that can't split.
* ``emptiest`` multi-node replicas: the nodes with the most free GPUs of the class,
  on the fabric whose chosen nodes are emptiest together.
* ``spread``   CPU replicas: the nodes running the fewest replicas of the model first
  (a second one on a node adds capacity but no availability, so it goes to a GPU host
  before doubling up on a CPU box); among those, nodes without GPUs first (GPU hosts keep
  their cores for their engines), then fewest replicas already on the node.
* ``nvlink``   1 when the tensor-parallel group sits in one NVLink domain, 0 when the
  topology is known and it could not, 0.5 when the topology is unknown.

Every tie ends on the node's name, so the same inputs always give the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cluster_cli.placement.constraints.base import NodeState


def binpack(free_after: int, total: int) -> float:
    """0..1: how full the node's GPUs of the class are after placing (1 = exactly full)."""
    return 1.0 if total <= 0 else round(1.0 - free_after / total, 4)


def emptiness(free_before: int, total: int) -> float:
    """0..1: how empty the node was before placing (1 = all its GPUs of the class free)."""
    return 0.0 if total <= 0 else round(free_before / total, 4)


def spread_key(node: NodeState) -> tuple[int, int, int]:
    """Sort key of a CPU candidate: GPU-less nodes first, then fewest replicas, then name order."""
    return (1 if node.has_gpus else 0, node.replicas, node.order)


def spread(replicas_before: int) -> float:
    return round(1.0 / (1 + replicas_before), 4)


def nvlink(in_one_domain: bool | None) -> float:
    return 0.5 if in_one_domain is None else (1.0 if in_one_domain else 0.0)


def fabric_key(fabric: str, free_counts: Sequence[int]) -> tuple[int, str]:
    """Sort key of a fabric for a multi-node replica: most free GPUs on its chosen nodes, then name."""
    return (-sum(free_counts), fabric)


def normalise(scores: Mapping[str, float]) -> dict[str, float]:
    """The itemised scores plus ``final``, their mean (Nomad's score normalisation)."""
    out = dict(scores)
    out["final"] = round(sum(scores.values()) / len(scores), 4) if scores else 0.0
    return out
