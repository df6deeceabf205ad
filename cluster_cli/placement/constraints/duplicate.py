"""One machine, one candidate: a node marked ``duplicate-gpu`` (its GPUs are another
node's too: the same box under a second name, see ``cluster_cli.machines``) is left out.
"""

from __future__ import annotations

from cluster_cli.facts import problem_key
from cluster_cli.machines import KEY, is_duplicate, is_gpu_uuid, mark_duplicate_gpus
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Verdict

__all__ = ["KEY", "DistinctGpus", "is_duplicate", "is_gpu_uuid", "mark_duplicate_gpus"]


class DistinctGpus:
    name = "duplicate"

    def check(self, node: NodeState, req: Request) -> Verdict:
        f = node.facts
        problem = next((p for p in f.problems if problem_key(p) == KEY), None)
        if problem is None:
            return Verdict.passed(self.name)
        return Verdict.reject(self.name, "duplicate machine", problem.removeprefix(f"{KEY}: "))
