"""Every GPU of a replica is of the profile's class: nodes without one are filtered."""

from __future__ import annotations

from functools import lru_cache

from cluster_cli.facts import UNREAD
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Verdict


@lru_cache(maxsize=4096)
def _rejection(gpu_class: str, have: tuple[tuple[str, int], ...], gpu_problem: str) -> Verdict:
    """Identical nodes get the identical verdict: built once (Nomad's computed-class cache)."""
    reason = f"no {gpu_class} gpu"
    if not have:
        why = f" ({gpu_problem})" if gpu_problem else ""
        return Verdict.reject(GpuClass.name, reason, f"no GPU{why}, profile needs {gpu_class}")
    # A lost GPU whose product could not be read has the placeholder class: it is "lost".
    listed = ", ".join(f"{n} {'lost' if c == UNREAD else c}" for c, n in have)
    return Verdict.reject(GpuClass.name, reason, f"no {gpu_class} GPU (has {listed})")


class GpuClass:
    name = "gpu-class"

    def check(self, node: NodeState, req: Request) -> Verdict:
        if not req.gpu_class or node.class_total.get(req.gpu_class):
            return Verdict.passed(self.name)
        problem = ""
        if not node.class_total:
            problem = next((p for p in node.facts.problems if p.split(":", 1)[0] in ("nvidia-smi", "gpu")), "")
        return _rejection(req.gpu_class, tuple(sorted(node.class_total.items())), problem)
