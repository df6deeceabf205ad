"""Explanations: why a profile found no room, and the plan as a diff.

* ``explain_request`` runs the full constraint chain over every node for one profile
  and returns the counts plus one exact reason per node. The placer calls it only
  for profiles that failed, once each, against the allocations at the moment it failed.
* ``filter_lines`` is the Nomad-style breakdown ("3 nodes filtered: cordoned 1, gpu-class 2").
* ``render_plan`` prints a plan like ``nomad job plan``: a diff, then a dry-run block.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from cluster_cli.placement.constraints import CHAIN, first_failure
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.results import Considered, Placement, Plan, Unplaced
from cluster_cli.placement.verdict import Kind, PlacementMetrics, Reason, Verdict, fit_message

# --------------------------------------------------------------------------- explain


def explain_request(states: Sequence[NodeState], req: Request) -> tuple[PlacementMetrics, tuple[Reason, ...]]:
    """Counts and one reason per node for a request that could not be placed."""
    m = PlacementMetrics(evaluated=len(states))
    reasons: list[Reason] = []
    passing: list[NodeState] = []
    for node in states:
        v = first_failure(node, req, CHAIN)
        if v is None:
            passing.append(node)
            continue
        m.record(v)
        reasons.append(Reason(req.profile, node.name, v.constraint, v.detail, v.kind, v.reason))
    if req.multi_node:
        # Every node here fits on its own; no fabric has enough of them together.
        per_fabric: dict[str, list[str]] = defaultdict(list)
        for node in passing:
            for fab in node.attachments:
                per_fabric[fab].append(node.name)
        m.fabrics = {f: len(v) for f, v in sorted(per_fabric.items())}
        for node in passing:
            have = ", ".join(f"{f} has {len(per_fabric[f])}" for f in node.attachments)
            detail = (
                f"fits alone, but no fabric has {req.nodes} such nodes ({have} with {req.gpus} free "
                f"{req.gpu_class} and an Active port), profile needs {req.nodes} on one fabric"
            )
            m.add("exhausted", "fabric", "fabric too small", 1)
            reasons.append(Reason(req.profile, node.name, "fabric", detail, Kind.EXHAUSTED, "fabric too small"))
        passing = []
    reasons.sort(key=lambda r: r.node or "")  # one order (node name) whatever the constraint
    if not states:
        reasons.append(
            Reason(
                req.profile, None, "nodes", "no nodes: none of the inventory's nodes has facts", Kind.ERROR, "no nodes"
            )
        )
    elif passing:  # cannot happen for a request the placer gave up on; never answer with no reason
        for node in passing:
            reasons.append(
                Reason(
                    req.profile,
                    node.name,
                    "capacity",
                    "fits now, but not when this replica was placed",
                    Kind.EXHAUSTED,
                    "raced",
                )
            )
    return m, tuple(reasons)


def node_verdicts(states: Sequence[NodeState], req: Request) -> list[tuple[str, Verdict]]:
    """Per node, the first constraint that rejects it for ``req``, or (it fits) the capacity
    check's pass, which says what is free. O(N); for ``place -v``."""
    out: list[tuple[str, Verdict]] = []
    for node in states:
        v = first_failure(node, req, CHAIN)
        out.append((node.name, v if v is not None else CHAIN[-1].check(node, req)))
    return out


# --------------------------------------------------------------------------- summaries


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def filter_lines(m: PlacementMetrics) -> list[str]:
    """Nomad's breakdown: filtered by constraint, exhausted by dimension."""
    out = []
    if m.filtered:
        out.append(f"{m.filtered} node{'s' if m.filtered != 1 else ''} filtered: {_counts(m.filtered_by)}")
    if m.exhausted:
        out.append(f"{m.exhausted} node{'s' if m.exhausted != 1 else ''} exhausted: {_counts(m.exhausted_by)}")
    if m.fabrics:
        out.append("nodes that fit, per fabric: " + _counts(m.fabrics))
    return out


# --------------------------------------------------------------------------- the plan as text


def _ranges(ix: Sequence[int]) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    out: list[str] = []
    s = list(ix)
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(out)


def where(p: Placement) -> str:
    """``gpu-01 GPU 0-7`` / ``gpu-01 GPU 0-7 [mlx5_0..] + gpu-02 ... on ib-a`` / ``cpu-01 (32 cpus)``."""
    r = p.replica
    parts = []
    for s in r.shards:
        txt = s.node
        if s.gpus:
            txt += f" GPU {_ranges(s.gpus)}"
        if s.hcas:
            txt += f" via {','.join(s.hcas)}"
        parts.append(txt)
    out = " + ".join(parts)
    if r.fabric:
        out += f" on {r.fabric}"
    if not r.gpu_class:
        res = [f"{r.cpus} cpus"] if r.cpus else []
        if r.memory_mib:
            res.append(f"{r.memory_mib / 1024:g} GiB")
        if res:
            out += f" ({', '.join(res)})"
    return out


def _reason_order(r: Reason) -> tuple[int, str]:
    """What an operator can act on first: nodes that nearly fit (full), then nodes of the right
    kind held out by a cordon or an outage, then other mismatches (fabric, no IB port), and
    last the nodes that lack the GPU class (nothing to be done about them for this profile)."""
    if r.kind == Kind.EXHAUSTED:
        rank = 0
    elif r.constraint in ("cordoned", "reachable", "duplicate"):
        rank = 1
    elif r.constraint == "gpu-class":
        rank = 3
    else:
        rank = 2
    return (rank, r.node or "")


SIGN = {"start": "+", "keep": "=", "stop": "-"}


def render_plan(plan: Plan, *, header: str = "", max_nodes: int = 10) -> list[str]:
    """The plan as lines of text: diff per model, then the dry-run block."""
    lines: list[str] = []
    if header:
        lines += [header, ""]
    by_model: dict[str, list[Placement]] = defaultdict(list)
    for p in plan.placements:
        by_model[p.replica.model].append(p)
    unplaced_by_model: dict[str, list[Unplaced]] = defaultdict(list)
    for u in plan.unplaced:
        unplaced_by_model[u.model].append(u)
    models = list(dict.fromkeys([*by_model, *unplaced_by_model]))
    for model in models:
        ps = by_model.get(model, [])
        counts = {a: sum(1 for p in ps if p.action == a) for a in ("start", "keep", "stop")}
        n_un = len(unplaced_by_model.get(model, []))
        tally = ", ".join(f"{n} {a}" for a, n in counts.items() if n)
        if n_un:
            tally = f"{tally}, {n_un} unplaced" if tally else f"{n_un} unplaced"
        sign = (
            "+/-" if counts["start"] and counts["stop"] else "+" if counts["start"] else "-" if counts["stop"] else ""
        )
        sign = sign or ("!" if n_un else "=")
        lines.append(f"{sign} model {model!r} ({tally})")
        for p in ps:
            r = p.replica
            note = f"  ({p.note})" if p.note else ""
            lines.append(f"  {SIGN[p.action]} replica {r.replica}: {r.profile} ({r.engine}) {where(p)}{note}")
            if p.need is not None and p.action != "stop":
                lines.append(f"      memory: {p.need.describe()}")
        for u in unplaced_by_model.get(model, []):
            lines.append(f"  ! replica {u.replica}: unplaced")
        lines.append("")

    lines.append("Scheduler dry-run:")
    if plan.complete:
        lines.append("- All replicas successfully placed.")
    else:
        lines.append(f"- WARNING: Failed to place all replicas ({len(plan.unplaced)} unplaced).")
    # Successes: one line per model and profile, with the counts of its first start.
    firsts: dict[tuple[str, str], list[Placement]] = defaultdict(list)
    for p in plan.placements:
        if p.action == "start":
            firsts[(p.replica.model, p.replica.profile)].append(p)
    for (model, prof), ps in firsts.items():
        won = [a for a in ps[0].attempts if a.placed]
        counts = "; ".join(filter_lines(won[0].metrics)) if won else ""
        ids = ",".join(str(p.replica.replica) for p in ps)
        n = won[0].metrics.evaluated if won else 0
        partial = "; capacity checked up to the first node that fits, in spread order"
        lines.append(
            f"  {model} [{ids}] on {prof}: {n} node{'s' if n != 1 else ''} evaluated"
            + (f"; {counts}" if counts else "")
            + (partial if won and won[0].metrics.partial else "")
        )
        # A fallback: why each profile of higher priority did not fit (place -v: every node).
        for a in ps[0].attempts:
            if not a.placed:
                lines.append(f"    not {a.profile} ({a.describe}): {fit_message(a.metrics)}")
    # Failures: one block per model (its unplaced replicas share the explanation).
    for model, us in unplaced_by_model.items():
        ids = ", ".join(str(u.replica) for u in us)
        lines.append("")
        lines.append(f"  Model {model!r}: replica{'s' if len(us) > 1 else ''} {ids} unplaced")
        first = us[0]
        for a in first.attempts:
            lines.append(f"    profile {a.profile} ({a.describe}): {fit_message(a.metrics)}")
            for s in filter_lines(a.metrics):
                lines.append(f"      {s}")
            reasons = sorted((r for r in first.reasons if r.profile == a.profile), key=_reason_order)
            for r in reasons[:max_nodes]:
                lines.append(f"      {r.node or '(fleet)'}: {r.detail}")
            if len(reasons) > max_nodes:
                more = len(reasons) - max_nodes
                lines.append(f"      ... and {more} more node{'s' if more > 1 else ''} (-o json lists every one)")
    return lines


# --------------------------------------------------------------------------- place -v


def _scores(scores: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in scores.items())


def render_trace(plan: Plan) -> list[str]:
    """``place -v``: per model, every replica's profiles in the order tried, and for each the
    verdict on every node: chosen (with its scores), fits but not chosen (and how the placer
    picks), or the constraint that rejected it and why. Needs ``plan(..., trace=True)``."""
    lines: list[str] = []
    by_model: dict[str, list[Considered]] = defaultdict(list)
    for c in plan.trace:
        by_model[c.model].append(c)
    held: dict[str, list[Placement]] = defaultdict(list)
    for p in plan.placements:
        if p.action != "start":
            held[p.replica.model].append(p)
    for model in dict.fromkeys([*held, *by_model]):
        lines.append(f"model {model!r}:")
        for p in held.get(model, []):
            verb = "kept" if p.action == "keep" else "stopped"
            lines.append(f"  replica {p.replica.replica}: {verb}, {p.replica.profile} on {where(p)}"
                         + (f" ({p.note})" if p.note else ""))  # fmt: skip
        for c in by_model.get(model, []):
            head = f"  replica {c.replica}, profile {c.profile} ({c.describe}): "
            if c.skipped:
                lines.append(head + f"skipped: {c.skipped}")
                continue
            fit = [n for n, v in c.verdicts if v.ok]
            if c.placed:
                lines.append(head + f"placed on {', '.join(c.chosen)} ({len(fit)} of {len(c.verdicts)} nodes fit)")
            else:
                lines.append(head + f"not placed ({len(fit)} of {len(c.verdicts)} nodes fit on their own)")
            chosen = set(c.chosen)
            for node, v in c.verdicts:
                if node in chosen:
                    score = _scores(c.scores.get(node, {}))
                    lines.append(f"    {node}: chosen" + (f" ({v.detail})" if v.detail else "")
                                 + (f"; scores {score}" if score else ""))  # fmt: skip
                elif v.ok:
                    also = f" ({v.detail})" if v.detail else ""
                    why = c.strategy if c.placed else "no room for the whole replica together"
                    lines.append(f"    {node}: fits{also}, not chosen: {why}")
                else:
                    by = "" if v.detail.startswith(v.constraint) else f" by {v.constraint}"  # "cordoned (...)"
                    lines.append(f"    {node}: rejected{by}: {v.detail}")
    return lines
