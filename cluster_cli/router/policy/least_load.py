"""Least loaded over every candidate; ties broken at random (no herd on equal scores)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cluster_cli.router.policy.base import score
from cluster_cli.router.worker import Worker


class LeastLoad:
    name = "least_load"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Worker], now: float) -> Worker | None:
        n = len(workers)
        if n == 0:
            return None
        if n == 1:
            return workers[0]
        use_cap = all(w.cap for w in workers)
        start = self._rng.randrange(n)  # scanning from a random offset breaks ties at random
        best = None
        best_s = 0.0
        for i in range(n):
            w = workers[(start + i) % n]
            s = score(w, now, use_cap)
            if best is None or s < best_s:
                best, best_s = w, s
        return best
