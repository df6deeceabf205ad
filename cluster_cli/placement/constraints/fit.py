"""The replica's weights and KV cache fit in the memory of the GPUs (or the node) it would get.

What one GPU needs is the request's estimate (``placement.fit``), made once per profile; a
profile without one (no size read on the nodes nor given in the catalog) is not checked. A
node passes when ``gpus`` of its free GPUs of the class can each hold it: their memory does
not change while a plan is made, so a node that fails is filtered, not exhausted, except
where only memory in use by others stands in the way (vLLM needs its share free at start).
"""

from __future__ import annotations

from cluster_cli.facts import Gpu
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.fit import MIB, Estimate, shortfall
from cluster_cli.placement.verdict import Kind, Verdict

REASON_PREFIX = "weights do not fit"


def gpus_shortfall(gpus: list[Gpu], k: int, est: Estimate) -> str | None:
    """Why ``k`` of ``gpus`` (those the replica may get) cannot each hold ``est``, or None. The
    ``k``-th roomiest decides: the replica could be given the roomiest ``k``."""
    if len(gpus) < k:
        return None  # too few free GPUs at all: capacity says so
    g = sorted(gpus, key=lambda g: (g.memory_used_mib or 0) - (g.memory_total_mib or 0))[k - 1]
    if g.memory_total_mib is None:
        return None  # unknown memory is no reason
    return shortfall(est, g.memory_total_mib * MIB, (g.memory_used_mib or 0) * MIB)


def gpu_shortfall(node: NodeState, req: Request, est: Estimate) -> str | None:
    """Why ``req.gpus`` of the node's free GPUs of the class cannot each hold ``est``, or None."""
    free = set(node.free.get(req.gpu_class or "", ()))
    return gpus_shortfall([g for g in node.facts.gpus if g.index in free], req.gpus, est)


def node_shortfall(node: NodeState, est: Estimate) -> str | None:
    """Why a CPU node's memory, less what other CPU replicas reserved there, cannot hold ``est``."""
    total = node.facts.memory_mib
    if total is None:
        return None
    return shortfall(est, total * MIB, node.reserved_mib * MIB)


class Fit:
    name = "fit"

    def check(self, node: NodeState, req: Request) -> Verdict:
        est = req.need
        if est is None:
            return Verdict.passed(self.name)
        why = gpu_shortfall(node, req, est) if req.uses_gpus else node_shortfall(node, est)
        if why is None:
            return Verdict.passed(self.name)
        return verdict(why)


def verdict(why: str) -> Verdict:
    """A shortfall as a verdict. ``weights do not fit (needs 38.2 GiB per GPU, 22.5 free)`` is
    counted as it is (GPUs of one kind give one figure); memory others hold now differs from
    GPU to GPU, so it is counted as ``not enough free memory``, its figures in the detail."""
    if why.startswith(REASON_PREFIX):
        return Verdict.reject(Fit.name, why, why, Kind.REJECT)
    return Verdict.exhausted(Fit.name, "memory", why.split(" (", 1)[0], why)
