"""Power of two choices: sample two candidates, take the less loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence

from cluster_cli.router.affinity import Affinity
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.policy.base import score


class PowerOfTwo:
    name = "p2c"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, endpoints: Sequence[Endpoint], now: float, hint: Affinity | None = None) -> Endpoint | None:
        n = len(endpoints)
        if n == 0:
            return None
        if n == 1:
            return endpoints[0]
        a, b = self._rng.sample(range(n), 2)
        wa, wb = endpoints[a], endpoints[b]
        use_cap = bool(wa.cap and wb.cap)
        return wa if score(wa, now, use_cap) <= score(wb, now, use_cap) else wb
