"""Cordoned nodes take no new replicas (replicas already there are kept; draining is separate)."""

from __future__ import annotations

from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Verdict


class Cordon:
    name = "cordoned"

    def check(self, node: NodeState, req: Request) -> Verdict:
        f = node.facts
        if not f.cordoned:
            return Verdict.passed(self.name)
        detail = f"cordoned ({f.cordon_reason})" if f.cordon_reason else "cordoned"
        return Verdict.reject(self.name, "cordoned", detail)
