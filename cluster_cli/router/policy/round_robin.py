"""Round robin over the candidates, blind to load (a baseline for the benchmark)."""

from __future__ import annotations

from collections.abc import Sequence

from cluster_cli.router.affinity import Affinity
from cluster_cli.router.endpoint import Endpoint


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, endpoints: Sequence[Endpoint], now: float, hint: Affinity | None = None) -> Endpoint | None:
        if not endpoints:
            return None
        w = endpoints[self._next % len(endpoints)]
        self._next += 1
        return w
