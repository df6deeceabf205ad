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


def first_failure(node: NodeState, req: Request, chain: tuple[Constraint, ...] = CHAIN) -> Verdict | None:
    """The verdict of the first constraint that rejects ``node``, or None if all pass."""
    for c in chain:
        v = c.check(node, req)
        if not v.ok:
            return v
    return None


__all__ = [
    "CHAIN",
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
    "mark_duplicate_gpus",
]
