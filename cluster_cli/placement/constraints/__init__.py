"""Placement constraints, one small class each, run cheapest first.

``STATIC`` never changes while a plan is computed (the placer groups nodes by them
once); ``Capacity`` runs last and depends on what is already allocated. ``nvlink`` is
a preference (it picks GPUs) and never rejects.
"""

from __future__ import annotations

from cluster_cli.placement.constraints.base import Constraint, NodeState, Request
from cluster_cli.placement.constraints.capacity import Capacity, gpu_breakdown
from cluster_cli.placement.constraints.cordon import Cordon
from cluster_cli.placement.constraints.duplicate import DistinctGpus, mark_duplicate_gpus
from cluster_cli.placement.constraints.fabric import Fabric
from cluster_cli.placement.constraints.gpu_class import GpuClass
from cluster_cli.placement.constraints.nvlink import NvlinkDomain, choose_gpus, fits_one_domain
from cluster_cli.placement.constraints.reachable import Reachable
from cluster_cli.placement.verdict import Verdict

STATIC: tuple[Constraint, ...] = (Cordon(), Reachable(), DistinctGpus(), GpuClass(), Fabric())
CHAIN: tuple[Constraint, ...] = (*STATIC, Capacity())
# The constraints that judge the node itself, the same for every request (the placer indexes by them).
NODE_LEVEL: tuple[Constraint, ...] = STATIC[:3]
_NODE_LEVEL_NAMES = frozenset(c.name for c in NODE_LEVEL)
_GPU_CLASS = STATIC[3]


def lacks_class(node: NodeState, req: Request) -> bool:
    """The node's GPUs are known and none is of the profile's class."""
    return bool(req.gpu_class) and bool(node.class_total) and not node.class_total.get(req.gpu_class or "")


def first_failure(node: NodeState, req: Request, chain: tuple[Constraint, ...] = CHAIN) -> Verdict | None:
    """The verdict of the first constraint that rejects ``node``, or None if all pass.

    A cordoned, unreachable or duplicate node whose GPUs are known and of another class is
    explained by its class: uncordoning or reviving it would not help this profile."""
    for c in chain:
        v = c.check(node, req)
        if not v.ok:
            if c.name in _NODE_LEVEL_NAMES and lacks_class(node, req):
                return _GPU_CLASS.check(node, req)
            return v
    return None


__all__ = [
    "CHAIN",
    "NODE_LEVEL",
    "STATIC",
    "Capacity",
    "Constraint",
    "Cordon",
    "DistinctGpus",
    "Fabric",
    "GpuClass",
    "NodeState",
    "NvlinkDomain",
    "Reachable",
    "Request",
    "choose_gpus",
    "first_failure",
    "fits_one_domain",
    "gpu_breakdown",
    "lacks_class",
    "mark_duplicate_gpus",
]
