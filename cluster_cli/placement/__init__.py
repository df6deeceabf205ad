"""Placement: where each replica runs, and why the others cannot.

Public API::

    from cluster_cli.placement import plan
    result = plan(nodes, catalog, current)      # pure: NodeFacts, Catalog, Replica -> Plan
    result.starts, result.keeps, result.stops   # Placement(replica, action, note, attempts)
    result.unplaced                             # Unplaced(model, replica, attempts, reasons)
    render_plan(result)                         # nomad-job-plan-like text lines
    render_trace(plan(..., trace=True))         # place -v: every node's verdict per attempt
    result.to_dict()                            # the JSON of 'place --dry-run -o json'
"""

from __future__ import annotations

from cluster_cli.placement.constraints import CHAIN, Constraint, NodeState, Request
from cluster_cli.placement.explain import explain_request, filter_lines, node_verdicts, render_plan, render_trace
from cluster_cli.placement.planner import plan
from cluster_cli.placement.results import Attempt, Considered, Placement, Plan, Unplaced
from cluster_cli.placement.verdict import Kind, PlacementMetrics, Reason, Verdict, fit_message

__all__ = [
    "CHAIN",
    "Attempt",
    "Considered",
    "Constraint",
    "Kind",
    "NodeState",
    "Placement",
    "PlacementMetrics",
    "Plan",
    "Reason",
    "Request",
    "Unplaced",
    "Verdict",
    "explain_request",
    "filter_lines",
    "fit_message",
    "node_verdicts",
    "plan",
    "render_plan",
    "render_trace",
]
