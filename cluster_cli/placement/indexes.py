"""The fleet indexes the planner keeps, so that a replica finds its node without a scan.

``Buckets`` holds the nodes of one group by their count of free GPUs, ``DomainIndex`` the
nodes of one GPU class by the free GPUs of their roomiest NVLink domain, and ``CpuHeap`` the
nodes a CPU request may still use, in spread order. A plan only takes resources away, so
each index is lazy: an entry gone stale is dropped or re-filed when it surfaces.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from cluster_cli.placement.verdict import PlacementMetrics


class Buckets:
    """Nodes of one group (a GPU class, maybe one fabric) by their count of free GPUs.

    ``heaps[k]`` holds node order numbers (name order) with lazy deletion: during a
    plan a node's count only goes down, so an entry is current iff ``count[i] == k``.
    """

    __slots__ = ("count", "heaps", "size")

    def __init__(self, maxk: int) -> None:
        self.heaps: list[list[int]] = [[] for _ in range(maxk + 1)]
        self.size = [0] * (maxk + 1)
        self.count: dict[int, int] = {}

    def add(self, i: int, k: int) -> None:
        self.count[i] = k
        self.size[k] += 1
        if k:
            heapq.heappush(self.heaps[k], i)

    def move(self, i: int, k: int) -> None:
        old = self.count[i]
        self.size[old] -= 1
        self.add(i, k)

    def at_least(self, k: int) -> int:
        return sum(self.size[k:]) if k < len(self.size) else 0

    def below(self, k: int) -> int:
        return sum(self.size[: min(k, len(self.size))])

    def _top(self, k: int) -> int | None:
        h = self.heaps[k]
        while h and self.count[h[0]] != k:
            heapq.heappop(h)
        return h[0] if h else None

    def best_fit(self, k: int) -> int | None:
        """First node (name order) of the smallest bucket with at least ``k`` free."""
        for j in range(max(k, 1), len(self.heaps)):
            top = self._top(j)
            if top is not None:
                return top
        return None

    def emptiest(self, k: int, m: int) -> list[int]:
        """Up to ``m`` nodes with at least ``k`` free, most free first, then name order."""
        out: list[int] = []
        for j in range(len(self.heaps) - 1, max(k, 1) - 1, -1):
            h = self.heaps[j]
            taken: list[int] = []
            while h and len(out) < m:
                i = heapq.heappop(h)
                if self.count[i] == j:
                    taken.append(i)
                    out.append(i)
            for i in taken:
                heapq.heappush(h, i)
            if len(out) >= m:
                break
        return out


class DomainIndex:
    """The nodes of one GPU class with a known NVLink topology, by (free GPUs in their
    roomiest domain, free GPUs of the class), for a tensor-parallel group that the best-fit
    node would split: the best-fitting node that keeps it in one domain, over the whole
    group, in O(G² + log N). Lazy deletion as in ``Buckets``: ``at[i]`` is current."""

    __slots__ = ("at", "heaps", "maxk")

    def __init__(self, maxk: int) -> None:
        self.maxk = maxk
        self.heaps: dict[tuple[int, int], list[int]] = {}
        self.at: dict[int, tuple[int, int]] = {}

    def put(self, i: int, room: int, free: int) -> None:
        self.at[i] = (room, free)
        if room >= 2:
            heapq.heappush(self.heaps.setdefault((room, free), []), i)

    def best(self, k: int) -> int | None:
        """First node (name order) of the smallest free count whose roomiest domain holds ``k``."""
        for j in range(k, self.maxk + 1):
            found: int | None = None
            for d in range(k, j + 1):
                h = self.heaps.get((d, j))
                while h and self.at.get(h[0]) != (d, j):
                    heapq.heappop(h)
                if h and (found is None or h[0] < found):
                    found = h[0]
            if found is not None:
                return found
        return None


@dataclass
class CpuHeap:
    """The nodes a CPU request may still use, in spread order (lazy: a key that went stale is
    re-filed when it surfaces), shared by every model that asks for it; the nodes dropped as
    not fitting (resources only shrink), counted as the capacity check counts them; and, for
    a model with a replica on every node that fits, a heap of its own led by its replicas there."""

    heap: list[tuple[tuple[int, int, int], int]] = field(default_factory=list)
    rejected: PlacementMetrics = field(default_factory=PlacementMetrics)
    dropped: set[int] = field(default_factory=set)
    by_model: dict[str, list[tuple[tuple[int, int, int, int], int]]] = field(default_factory=dict)
