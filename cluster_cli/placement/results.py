"""What ``plan()`` returns: the plan, its parts, and their JSON (``place --dry-run -o json``).

A ``Plan`` holds a ``Placement`` for every replica to start, keep or stop and an ``Unplaced``
for every replica no profile could place, each with the ``Attempt`` of every profile tried;
with ``plan(..., trace=True)`` also a ``Considered`` for every profile tried.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster_cli.facts import Replica
from cluster_cli.placement.fit import Estimate
from cluster_cli.placement.verdict import PlacementMetrics, Reason, Verdict, fit_message

# A placement's action; a plan lists one replica's placements in this order.
ACTIONS = ("stop", "keep", "start")


@dataclass(frozen=True)
class Attempt:
    """One profile tried for one replica, with its counts."""

    profile: str
    describe: str
    placed: bool
    metrics: PlacementMetrics

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"profile": self.profile, "placed": self.placed, "metrics": self.metrics.to_dict()}
        if not self.placed:  # why it did not fit, as the table says it (place -v: every node)
            d["summary"] = fit_message(self.metrics)
        return d


@dataclass(frozen=True)
class Placement:
    """A replica in the plan: ``start`` (new), ``keep`` (already there) or ``stop``."""

    replica: Replica
    action: str
    note: str = ""
    attempts: tuple[Attempt, ...] = ()
    need: Estimate | None = None  # the memory estimate its profile was checked against

    def to_dict(self) -> dict[str, Any]:
        r = self.replica
        d: dict[str, Any] = {
            "model": r.model,
            "replica": r.replica,
            "profile": r.profile,
            "engine": r.engine,
            "action": self.action,
            "fabric": r.fabric,
            "gpu_class": r.gpu_class,
            "cpus": r.cpus,
            "memory_mib": r.memory_mib,
            "shards": [s.to_dict() for s in r.shards],
        }
        if self.note:
            d["note"] = self.note
        if self.need is not None:
            d["memory"] = self.need.to_dict()
        if self.attempts:
            d["attempts"] = [a.to_dict() for a in self.attempts]
        return d


@dataclass(frozen=True)
class Unplaced:
    """A replica no profile could place, with at least one reason per profile."""

    model: str
    replica: int
    attempts: tuple[Attempt, ...]
    reasons: tuple[Reason, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "replica": self.replica,
            "reasons": [r.to_dict() for r in self.reasons],
            # The same shape as a placed replica's attempts (placed: false, with the summary).
            "attempts": [a.to_dict() for a in self.attempts],
        }


@dataclass(frozen=True)
class Considered:
    """One profile tried for one replica (``plan(..., trace=True)``): the verdict on every
    node just before the placer chose, and the nodes it chose. ``skipped`` says why a profile
    was not tried at all. For ``place -v``; never part of the plan's JSON."""

    model: str
    replica: int
    profile: str
    describe: str
    placed: bool = False
    chosen: tuple[str, ...] = ()
    verdicts: tuple[tuple[str, Verdict], ...] = ()  # node -> first failing verdict, or capacity's pass
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    strategy: str = ""
    skipped: str = ""


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    unplaced: tuple[Unplaced, ...]
    nodes: int = 0
    trace: tuple[Considered, ...] = ()  # only with plan(..., trace=True)

    @property
    def complete(self) -> bool:
        return not self.unplaced

    def of(self, action: str) -> list[Placement]:
        return [p for p in self.placements if p.action == action]

    @property
    def starts(self) -> list[Placement]:
        return self.of("start")

    @property
    def keeps(self) -> list[Placement]:
        return self.of("keep")

    @property
    def stops(self) -> list[Placement]:
        return self.of("stop")

    def allocations(self) -> list[Replica]:
        """What is allocated once the plan is applied: kept and started replicas."""
        return [p.replica for p in self.placements if p.action != "stop"]

    def summary(self) -> dict[str, int]:
        return {
            "start": len(self.starts),
            "keep": len(self.keeps),
            "stop": len(self.stops),
            "unplaced": len(self.unplaced),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "nodes": self.nodes,
            "summary": self.summary(),
            "replicas": [p.to_dict() for p in self.placements],
            "unplaced": [u.to_dict() for u in self.unplaced],
        }
