"""Room on the node right now: free GPUs of the class, or unreserved CPUs and memory.

This runs last: a node that reaches it matches the profile and is merely full, so
a failure here counts as *exhausted* (by dimension), not filtered.
"""

from __future__ import annotations

import re
from collections import Counter

from cluster_cli.facts import UNREAD, Gpu, problem_key
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Kind, Verdict

# Why a GPU is not free, in the order a GPU with several problems is attributed.
_ORDER = ("lost", "ecc", "retired-pages", "remap", "cordoned", "allocated", "fenced", "mig", "foreign-process")
_LABEL = {
    "lost": "lost",
    "ecc": "ECC",
    "retired-pages": "retired pages pending",
    "remap": "row remap pending",
    "cordoned": "cordoned",
    "allocated": "allocated",
    "fenced": "held by a replica being stopped",
    "mig": "MIG",
}
_PID = re.compile(r"\bpid (\d+)")


def _cause(g: Gpu, allocated: bool) -> tuple[str, list[int]]:
    keys = {problem_key(p) for p in g.problems}
    if allocated:
        keys.add("allocated")
    for k in _ORDER:
        if k in keys:
            pids = (
                [int(m) for p in g.problems if problem_key(p) == k for m in _PID.findall(p)]
                if k == "foreign-process"
                else []
            )
            return k, pids
    return (min(keys) if keys else "busy"), []


def gpu_breakdown(node: NodeState, gpu_class: str) -> str:
    """``3 ECC, 1 foreign process pid 4411, 2 allocated``: why the class's other GPUs are not free."""
    free = set(node.free.get(gpu_class, ()))
    counts: Counter[str] = Counter()
    pids: dict[str, list[int]] = {}
    seen: set[int] = set()
    for g in node.facts.gpus:
        if g.gpu_class != gpu_class or g.index in free or g.index in seen:
            continue
        seen.add(g.index)
        key, ps = _cause(g, g.index in node.allocated)
        counts[key] += 1
        pids.setdefault(key, []).extend(ps)
    parts = []
    for key in sorted(counts, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k)):
        n = counts[key]
        if key == "foreign-process":
            ps = sorted(set(pids[key]))
            label = "foreign process" + ("es" if n > 1 else "")
            if ps:
                label += f" pid{'s' if len(ps) > 1 else ''} {', '.join(map(str, ps))}"
            parts.append(f"{n} {label}")
        else:
            parts.append(f"{n} {_LABEL.get(key, key)}")
    return ", ".join(parts)


def _gib(mib: int) -> str:
    return f"{mib / 1024:g}"


class Capacity:
    name = "capacity"

    def check(self, node: NodeState, req: Request) -> Verdict:
        if req.gpu_class:
            return self._gpus(node, req)
        return self._host(node, req)

    def _gpus(self, node: NodeState, req: Request) -> Verdict:
        cls = req.gpu_class or ""
        free = len(node.free.get(cls, ()))
        if free >= req.gpus:
            return Verdict.passed(self.name, f"{free} {cls} free")
        total = node.class_total.get(cls, 0)
        why = gpu_breakdown(node, cls)
        # A GPU that fell off the bus has no readable product, so no class. On a node whose
        # other GPUs are all of this class it is one of them (as discover's table counts it);
        # elsewhere it may have been.
        unknown = len({g.index for g in node.facts.gpus if g.lost and g.gpu_class == UNREAD})
        mixed = unknown and {g.gpu_class for g in node.facts.gpus if not g.lost} != {cls}
        if unknown and not mixed:
            total += unknown
            why = ", ".join(filter(None, [why, f"{unknown} lost"]))
        detail = f"{free} of {total} {cls} free" + (f" ({why})" if why else "") + f", profile needs {req.gpus}"
        if mixed and cls != UNREAD:
            detail += f"; also {unknown} lost GPU{'s' if unknown > 1 else ''} of unknown class"
        if total < req.gpus and not mixed:  # never fits here, however empty: say so rather than "busy"
            detail += f": more than the node's {total}" + (", set nodes: to split it" if req.nodes == 1 else "")
        return Verdict.exhausted(self.name, "gpus", "insufficient gpus", detail)

    def _host(self, node: NodeState, req: Request) -> Verdict:
        problems: list[str] = []
        dim = None
        unknown = []
        if req.cpus:
            cpus = node.unreserved_cpus()
            if cpus is None:
                unknown.append("CPU count")
            elif cpus < req.cpus:
                dim = dim or "cpus"
                held = (
                    f" ({node.reserved_cpus} reserved by {node.cpu_replicas} CPU replica{'s' if node.cpu_replicas != 1 else ''})"
                    if node.reserved_cpus
                    else ""
                )
                problems.append(f"{max(cpus, 0)} of {node.facts.cpus} CPUs unreserved{held}, profile needs {req.cpus}")
        if req.memory_mib:
            mib = node.unreserved_mib()
            if mib is None:
                unknown.append("memory size")
            elif mib < req.memory_mib:
                dim = dim or "memory"
                total = node.facts.memory_mib or 0
                held = (
                    f" ({_gib(node.reserved_mib)} reserved by {node.cpu_replicas} CPU replica{'s' if node.cpu_replicas != 1 else ''})"
                    if node.reserved_mib
                    else ""
                )
                problems.append(
                    f"{_gib(max(mib, 0))} of {_gib(total)} GiB memory unreserved{held}, profile needs {_gib(req.memory_mib)}"
                )
        if unknown:
            return Verdict.reject(
                self.name,
                "resources unknown",
                f"{' and '.join(unknown)} unknown (probe failed), profile needs them",
                Kind.ERROR,
            )
        if problems:
            reason = "insufficient cpus" if dim == "cpus" else "insufficient memory"
            return Verdict.exhausted(self.name, dim or "cpus", reason, "; ".join(problems))
        return Verdict.passed(self.name)
