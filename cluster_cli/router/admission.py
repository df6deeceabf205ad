"""Admission: a bounded per-model wait queue for when every endpoint is saturated.

A request that finds every eligible endpoint full waits here, first come first
served, until an endpoint frees a slot. A full queue or a wait past ``max_wait_s``
is rejected (429 with ``Retry-After``); both overflows are counted for ``/metrics``.
The queue is a plain data structure: the balancer decides when to hand out slots.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from cluster_cli.router.worker import Worker


@dataclass(frozen=True)
class QueueLimits:
    max_queue: int = 256
    max_wait_s: float = 30.0


class Rejected(Exception):
    """The request cannot be admitted; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason  # constant, for metrics: queue_full, queue_timeout, no_endpoint
        self.message = message
        self.retry_after = retry_after


class Waiter:
    __slots__ = ("deadline", "fut")

    def __init__(self, fut: asyncio.Future[Worker], deadline: float) -> None:
        self.fut = fut
        self.deadline = deadline


class ModelQueue:
    __slots__ = ("limits", "rejected_full", "rejected_timeout", "waiters")

    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        self.waiters: deque[Waiter] = deque()
        self.rejected_full = 0
        self.rejected_timeout = 0

    def __len__(self) -> int:
        return len(self.waiters)

    def has_room(self) -> bool:
        return len(self.waiters) < self.limits.max_queue

    def push(self, fut: asyncio.Future[Worker], now: float) -> Waiter:
        w = Waiter(fut, now + self.limits.max_wait_s)
        self.waiters.append(w)
        return w

    def pop_live(self) -> Waiter | None:
        """The oldest waiter whose client is still waiting, or None."""
        q = self.waiters
        while q:
            w = q.popleft()
            if not w.fut.done():
                return w
        return None

    def peek_live(self) -> bool:
        q = self.waiters
        while q and q[0].fut.done():
            q.popleft()
        return bool(q)

    def expired(self, now: float) -> list[Waiter]:
        """Remove and return the waiters past their deadline (FIFO, so only the head can be)."""
        out: list[Waiter] = []
        q = self.waiters
        while q and (q[0].fut.done() or q[0].deadline <= now):
            w = q.popleft()
            if not w.fut.done():
                out.append(w)
        return out

    def retry_after(self) -> float:
        return max(1.0, min(self.limits.max_wait_s, 1.0 + len(self.waiters) / 100.0))
