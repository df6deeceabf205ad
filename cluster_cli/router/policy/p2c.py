"""Power of two choices: sample two candidates, take the less loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cluster_cli.router.policy.base import score
from cluster_cli.router.worker import Worker


class PowerOfTwo:
    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Worker], now: float) -> Worker | None:
        n = len(workers)
        if n == 0:
            return None
        if n == 1:
            return workers[0]
        a, b = self._rng.sample(range(n), 2)
        wa, wb = workers[a], workers[b]
        use_cap = bool(wa.cap and wb.cap)
        return wa if score(wa, now, use_cap) <= score(wb, now, use_cap) else wb
