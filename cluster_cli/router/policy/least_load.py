"""Least loaded over every candidate; ties broken at random (no herd on equal scores)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cluster_cli.router.affinity import Affinity
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.policy.base import score


class LeastLoad:
    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, endpoints: Sequence[Endpoint], now: float, hint: Affinity | None = None) -> Endpoint | None:
        n = len(endpoints)
        if n == 0:
            return None
        if n == 1:
            return endpoints[0]
        use_cap = all(w.cap for w in endpoints)
        start = self._rng.randrange(n)  # scanning from a random offset breaks ties at random
        best = None
        best_s = 0.0
        for i in range(n):
            w = endpoints[(start + i) % n]
            s = score(w, now, use_cap)
            if best is None or s < best_s:
                best, best_s = w, s
        return best
