"""Round robin over the candidates, blind to load (a baseline for the benchmark)."""

from __future__ import annotations

from collections.abc import Sequence

from cluster_cli.router.worker import Worker


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: Sequence[Worker], now: float) -> Worker | None:
        if not workers:
            return None
        w = workers[self._next % len(workers)]
        self._next += 1
        return w
