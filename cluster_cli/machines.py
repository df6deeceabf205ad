"""One machine, one name: a node whose GPUs another node also reports is the same box twice.

Two inventory names for one machine (two addresses, or an alias) would have its GPUs
planned twice. discover warns of two nodes with the same host and port; this is the
guard, from the facts: a GPU UUID is unique to one physical GPU, so the same UUID
on two reachable nodes means one machine seen twice. The first node (in the order given:
the inventory's, or names in the placer) keeps it; each later one gets a ``duplicate-gpu``
problem, and placement leaves it out (``placement.constraints.duplicate``). Pure; outside
the placement package so that discover marks nodes without importing the placer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from cluster_cli.facts import NodeFacts, problem_key

KEY = "duplicate-gpu"
# Only a UUID as nvidia-smi prints one identifies a GPU: a placeholder in hand-written facts
# ("[N/A]", "unknown") must not make two nodes one machine.
_UUID = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]+")
_SHOWN = 3  # UUIDs named in a problem; the rest are counted


def is_gpu_uuid(u: str) -> bool:
    """A UUID as nvidia-smi prints one, not a placeholder ("[N/A]", "unknown")."""
    return _UUID.fullmatch(u) is not None


def is_duplicate(f: NodeFacts) -> bool:
    return any(problem_key(p) == KEY for p in f.problems)


def mark_duplicate_gpus(nodes: Sequence[NodeFacts]) -> list[NodeFacts]:
    """``nodes`` in the same order, each later node that shows a GPU UUID an earlier
    reachable node showed given a ``duplicate-gpu`` problem. Pure.

    Unreachable nodes neither claim nor lose UUIDs (their GPUs are last known, not seen
    now), nor do nodes already marked; lost GPUs have no UUID and are skipped."""
    owner: dict[str, str] = {}
    out: list[NodeFacts] = []
    for f in nodes:
        if not f.reachable or is_duplicate(f):
            out.append(f)
            continue
        uuids = list(dict.fromkeys(g.uuid for g in f.gpus if g.uuid and is_gpu_uuid(g.uuid)))
        taken = [u for u in uuids if u in owner]
        if not taken:
            for u in uuids:
                owner[u] = f.name
            out.append(f)
            continue
        others = ", ".join(f"{o}'s" for o in dict.fromkeys(owner[u] for u in taken))
        shown = ", ".join(taken[:_SHOWN]) + (f" and {len(taken) - _SHOWN} more" if len(taken) > _SHOWN else "")
        what = f"GPU {shown} is" if len(taken) == 1 else f"{len(taken)} GPUs ({shown}) are"
        problem = f"{KEY}: {what} also node {others} (the same machine under two names?); not a placement candidate"
        out.append(replace(f, problems=(*f.problems, problem)))
    return out
