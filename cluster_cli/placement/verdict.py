"""What a constraint says about one node, and what a placement attempt counted.

A ``Verdict`` carries two texts: ``reason`` is short and constant ("cordoned",
"insufficient gpus") so it can be counted across nodes; ``detail`` is the exact
sentence for this node ("2 of 8 H100 free (3 ECC, 2 allocated), profile needs 8").

``PlacementMetrics`` follows Nomad's AllocMetric: nodes that fail a constraint are
*filtered* (a retry will not help), nodes that pass every constraint but lack room
right now are *exhausted* (by dimension: gpus, cpus, memory, fabric). ``fit_message`` says
an attempt's counts in one line ("0/12 nodes are available: ...").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """How a rejection should be read (after Kubernetes' status codes)."""

    OK = "ok"
    REJECT = "reject"  # spec or hardware mismatch: waiting will not fix it
    EXHAUSTED = "exhausted"  # fits in principle, no room now
    ERROR = "error"  # facts missing or the node unreachable: an outage, not a mismatch


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    constraint: str
    reason: str = ""
    detail: str = ""
    kind: Kind = Kind.OK
    dimension: str | None = None  # set for EXHAUSTED

    @classmethod
    def passed(cls, constraint: str, detail: str = "") -> Verdict:
        if detail:
            return cls(True, constraint, "", detail, Kind.OK)
        v = _PASSED.get(constraint)
        if v is None:
            v = _PASSED[constraint] = cls(True, constraint, "", "", Kind.OK)
        return v

    @classmethod
    def reject(cls, constraint: str, reason: str, detail: str, kind: Kind = Kind.REJECT) -> Verdict:
        return cls(False, constraint, reason, detail or reason, kind)

    @classmethod
    def exhausted(cls, constraint: str, dimension: str, reason: str, detail: str) -> Verdict:
        return cls(False, constraint, reason, detail or reason, Kind.EXHAUSTED, dimension)

    @property
    def filtered(self) -> bool:
        return not self.ok and self.kind is not Kind.EXHAUSTED


_PASSED: dict[str, Verdict] = {}


def _bump(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


@dataclass
class PlacementMetrics:
    """Counts of one profile's attempt over the fleet (successes and failures alike)."""

    evaluated: int = 0
    filtered_by: dict[str, int] = field(default_factory=dict)  # constraint -> nodes
    exhausted_by: dict[str, int] = field(default_factory=dict)  # dimension -> nodes
    reasons: dict[str, int] = field(default_factory=dict)  # short reason -> nodes (FitError line)
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> scorer -> score
    fabrics: dict[str, int] = field(default_factory=dict)  # multi-node: fabric -> nodes that fit
    partial: bool = False  # counts are a cheap lower bound (see the placer), not a full scan

    def record(self, v: Verdict) -> None:
        if v.ok:
            return
        if v.kind is Kind.EXHAUSTED:
            _bump(self.exhausted_by, v.dimension or v.constraint)
        else:
            _bump(self.filtered_by, v.constraint)
        _bump(self.reasons, v.reason)

    def add(self, kind: str, key: str, reason: str, n: int) -> None:
        """Count ``n`` nodes at once: ``kind`` is "filtered" or "exhausted"."""
        if n:
            _bump(self.filtered_by if kind == "filtered" else self.exhausted_by, key, n)
            _bump(self.reasons, reason, n)

    def merge(self, other: PlacementMetrics) -> None:
        """Add ``other``'s filtered and exhausted counts to these."""
        for mine, theirs in (
            (self.filtered_by, other.filtered_by),
            (self.exhausted_by, other.exhausted_by),
            (self.reasons, other.reasons),
        ):
            for k, n in theirs.items():
                _bump(mine, k, n)

    def copy(self) -> PlacementMetrics:
        return PlacementMetrics(
            self.evaluated, dict(self.filtered_by), dict(self.exhausted_by), dict(self.reasons),
            {}, dict(self.fabrics), self.partial,
        )  # fmt: skip

    @property
    def filtered(self) -> int:
        return sum(self.filtered_by.values())

    @property
    def exhausted(self) -> int:
        return sum(self.exhausted_by.values())

    @property
    def feasible(self) -> int:
        return max(0, self.evaluated - self.filtered - self.exhausted)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "evaluated": self.evaluated,
            "filtered": self.filtered,
            "exhausted": self.exhausted,
            "filtered_by": dict(sorted(self.filtered_by.items())),
            "exhausted_by": dict(sorted(self.exhausted_by.items())),
        }
        if self.fabrics:
            d["fabrics"] = dict(sorted(self.fabrics.items()))
        if self.scores:
            d["scores"] = self.scores
        if self.partial:
            d["partial"] = True
        return d


def fit_message(m: PlacementMetrics) -> str:
    """``0/12 nodes are available: 1 cordoned, 2 no H100 gpu, 9 insufficient gpus.``"""
    parts = sorted(f"{n} {reason}" for reason, n in m.reasons.items())
    tail = f": {', '.join(parts)}" if parts else ""
    return f"{m.feasible}/{m.evaluated} nodes are available{tail}."


@dataclass(frozen=True, slots=True)
class Reason:
    """Why one profile could not use one node (``node`` is None for fleet-wide reasons)."""

    profile: str
    node: str | None
    constraint: str
    detail: str
    kind: Kind = Kind.REJECT
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "node": self.node,
            "constraint": self.constraint,
            "detail": self.detail,
            "kind": self.kind.value,
        }
