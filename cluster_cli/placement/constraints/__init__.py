"""Placement constraints, one small class each, run cheapest first.

``STATIC`` never changes while a plan is computed (the placer groups nodes by them
once); ``Fit`` (memory for the weights and KV cache) depends on the request's estimate;
``Capacity`` runs last and depends on what is already allocated. ``nvlink`` is
a preference (it picks GPUs) and never rejects.
"""

from __future__ import annotations

import dataclasses

from cluster_cli.facts import problem_key
from cluster_cli.placement.constraints.base import Constraint, NodeState, Request
from cluster_cli.placement.constraints.capacity import Capacity, gpu_breakdown
from cluster_cli.placement.constraints.cordon import Cordon
from cluster_cli.placement.constraints.duplicate import DistinctGpus, mark_duplicate_gpus
from cluster_cli.placement.constraints.fabric import Fabric
from cluster_cli.placement.constraints.fit import Fit
from cluster_cli.placement.constraints.gpu_class import GpuClass
from cluster_cli.placement.constraints.nvlink import NvlinkDomain, choose_gpus, fits_one_domain
from cluster_cli.placement.constraints.reachable import Reachable
from cluster_cli.placement.verdict import Verdict

STATIC: tuple[Constraint, ...] = (Cordon(), Reachable(), DistinctGpus(), GpuClass(), Fabric())
FIT = Fit()
CAPACITY = Capacity()
CHAIN: tuple[Constraint, ...] = (*STATIC, FIT, CAPACITY)
# The constraints that judge the node itself, the same for every request (the placer indexes by them).
NODE_LEVEL: tuple[Constraint, ...] = STATIC[:3]
_NODE_LEVEL_NAMES = frozenset(c.name for c in NODE_LEVEL)
_GPU_CLASS = STATIC[3]


# Problems that say nvidia-smi could not list a node's GPUs: it may have some after all.
_BLIND = frozenset({"gpu", "nvidia-smi", "gpus-gone", "gpus-unlisted"})


def gpus_known(node: NodeState) -> bool:
    """What GPUs the node has is known: it listed some, or it answered its probe and
    nvidia-smi said nothing was wrong (a CPU-only node)."""
    if node.class_total:
        return True
    f = node.facts
    return f.reachable and not any(problem_key(p) in _BLIND for p in f.problems)


def lacks_class(node: NodeState, req: Request) -> bool:
    """The node's GPUs are known and none is of the profile's class."""
    return bool(req.gpu_class) and not node.class_total.get(req.gpu_class or "") and gpus_known(node)


def first_failure(node: NodeState, req: Request, chain: tuple[Constraint, ...] = CHAIN) -> Verdict | None:
    """The verdict of the first constraint that rejects ``node``, or None if all pass.

    A cordoned, unreachable or duplicate node whose GPUs are known and of another class (or
    none) is explained by its class: uncordoning or reviving it would not help this profile.
    One held out for several node-level reasons names them all ("cordoned (...); also
    unreachable: ..."): lifting the first alone would not bring it back."""
    for j, c in enumerate(chain):
        v = c.check(node, req)
        if not v.ok:
            if c.name in _NODE_LEVEL_NAMES:
                if lacks_class(node, req):
                    return _GPU_CLASS.check(node, req)
                also = [
                    w.detail for d in chain[j + 1 :] if d.name in _NODE_LEVEL_NAMES and not (w := d.check(node, req)).ok
                ]
                if also:
                    v = dataclasses.replace(v, detail=f"{v.detail}; also {'; '.join(also)}")
            return v
    return None


__all__ = [
    "CAPACITY",
    "CHAIN",
    "FIT",
    "NODE_LEVEL",
    "STATIC",
    "Capacity",
    "Constraint",
    "Cordon",
    "DistinctGpus",
    "Fabric",
    "Fit",
    "GpuClass",
    "NodeState",
    "NvlinkDomain",
    "Reachable",
    "Request",
    "choose_gpus",
    "first_failure",
    "fits_one_domain",
    "gpu_breakdown",
    "gpus_known",
    "lacks_class",
    "mark_duplicate_gpus",
]
