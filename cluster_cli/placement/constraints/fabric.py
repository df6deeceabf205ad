"""A multi-node replica lives on one InfiniBand fabric, over that fabric's Active ports.

Single-node replicas do not use the fabric and pass. Before a fabric is chosen a node
needs an Active InfiniBand port on some fabric; after, on that one.
"""

from __future__ import annotations

from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Verdict


class Fabric:
    name = "fabric"

    def check(self, node: NodeState, req: Request) -> Verdict:
        if not req.multi_node:
            return Verdict.passed(self.name)
        if not node.attachments:
            ports = node.facts.hcas
            if not ports:
                detail = "no InfiniBand port, profile spans nodes"
            else:
                conflicts = [p.removeprefix("fabric-conflict: ") for p in node.facts.problems
                             if p.startswith("fabric-conflict:")]  # fmt: skip
                if conflicts:  # Active ports, taken off a fabric their subnet contradicts
                    n = sum(1 for h in ports if h.state == "Active" and h.link_layer == "InfiniBand")
                    detail = (
                        f"{n} Active InfiniBand port{'s' if n != 1 else ''} in fabric conflict, so on no fabric: "
                        + "; ".join(conflicts)
                        + "; profile spans nodes"
                    )
                    return Verdict.reject(self.name, "fabric conflict", detail)
                states = ", ".join(sorted({f"{h.ca} {h.state or '?'} {h.link_layer or '?'}" for h in ports}))
                detail = f"no Active InfiniBand port with a fabric ({states}), profile spans nodes"
            return Verdict.reject(self.name, "no active ib port", detail)
        if req.fabric is not None and req.fabric not in node.attachments:
            return Verdict.reject(
                self.name, "other ib fabric", f"not on fabric {req.fabric} (on {', '.join(node.attachments)})"
            )
        return Verdict.passed(self.name)
