"""The policy interface and the load score the load-aware policies share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from cluster_cli.router.affinity import Affinity
from cluster_cli.router.endpoint import Endpoint

KV_WEIGHT = 0.25  # a full KV cache counts like a quarter of the endpoint's slots being busy


def score(w: Endpoint, now: float, use_capacity: bool) -> float:
    """Lower is better: the share of the endpoint's slots in use once this request joins.

    With every candidate's capacity known, load is a fraction of that capacity, so a
    bigger engine takes proportionally more; otherwise it is the plain count (router
    in-flight + other clients' load from a fresh scrape). KV-cache usage, when known and
    fresh, adds a penalty; unknown adds nothing.
    """
    load = w.load(now) + 1.0
    s = load / w.cap if use_capacity and w.cap else load
    kv = w.kv(now)
    if kv is not None:
        s += KV_WEIGHT * kv * (1.0 if use_capacity else load)
    return s


class Policy(Protocol):
    name: str

    def select(self, endpoints: Sequence[Endpoint], now: float, hint: Affinity | None = None) -> Endpoint | None:
        """Pick one of ``endpoints`` (all eligible, unsaturated); None only when empty.
        ``hint``: what the request shares with earlier ones (only ``prefix`` uses it)."""
        ...
