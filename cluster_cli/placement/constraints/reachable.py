"""A node that did not answer its last probe (or was never probed) takes nothing."""

from __future__ import annotations

from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Kind, Verdict


class Reachable:
    name = "reachable"

    def check(self, node: NodeState, req: Request) -> Verdict:
        f = node.facts
        if f.reachable:
            return Verdict.passed(self.name)
        detail = f"unreachable: {f.error}" if f.error else "unreachable"
        return Verdict.reject(self.name, "unreachable", detail, Kind.ERROR)
