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

from cluster_cli.router.affinity import Affinity
from cluster_cli.router.endpoint import Endpoint


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
    __slots__ = ("deadline", "exclude", "fut", "hint", "live", "queued_at")

    def __init__(
        self,
        fut: asyncio.Future[Endpoint],
        queued_at: float,
        deadline: float,
        exclude: tuple[Endpoint, ...] = (),
        hint: Affinity | None = None,
    ) -> None:
        self.fut = fut
        self.queued_at = queued_at
        self.deadline = deadline
        self.exclude = exclude  # a retry: the endpoints that already failed it
        self.hint = hint  # what its prompt shares with earlier requests (the prefix policy)
        self.live = True  # counted in its queue's ``live`` (until resolved, cancelled or removed)


class ModelQueue:
    """FIFO of waiters. A client that gives up leaves its (cancelled) entry in place until it
    reaches the head, so the length that matters (room, ``/metrics``, Retry-After) is ``live``:
    the waiters still waiting, kept exact by each future's done-callback and by the pops."""

    __slots__ = ("_limits", "live", "rejected_full", "rejected_timeout", "waiters")

    def __init__(self, limits: QueueLimits) -> None:
        self._limits = limits
        self.waiters: deque[Waiter] = deque()
        self.live = 0
        self.rejected_full = 0
        self.rejected_timeout = 0

    @property
    def limits(self) -> QueueLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: QueueLimits) -> None:
        """A reload's limits. A shorter ``max_wait_s`` also shortens the wait of those already
        queued (to ``queued_at + max_wait_s``); a longer one leaves them as they are. Either
        way deadlines stay in FIFO order, which ``expired`` (looking at the head) relies on."""
        if limits.max_wait_s < self._limits.max_wait_s:
            for w in self.waiters:
                w.deadline = min(w.deadline, w.queued_at + limits.max_wait_s)
        self._limits = limits

    def __len__(self) -> int:
        return self.live

    def has_room(self) -> bool:
        return self.live < self.limits.max_queue

    def _gone(self, w: Waiter) -> None:
        if w.live:
            w.live = False
            self.live -= 1

    def push(
        self,
        fut: asyncio.Future[Endpoint],
        now: float,
        exclude: tuple[Endpoint, ...] = (),
        hint: Affinity | None = None,
    ) -> Waiter:
        q = self.waiters
        if len(q) > 2 * self.live + 16:  # mostly clients that gave up: drop them (amortised O(1))
            keep: deque[Waiter] = deque()
            for old in q:
                if old.fut.done():
                    self._gone(old)
                else:
                    keep.append(old)
            self.waiters = q = keep
        w = Waiter(fut, now, now + self.limits.max_wait_s, exclude, hint)
        q.append(w)
        self.live += 1
        fut.add_done_callback(lambda _f, w=w: self._gone(w))
        return w

    def pop_live(self) -> Waiter | None:
        """The oldest waiter whose client is still waiting, or None."""
        q = self.waiters
        while q:
            w = q.popleft()
            self._gone(w)
            if not w.fut.done():
                return w
        return None

    def remove(self, w: Waiter) -> None:
        """Take ``w`` out from anywhere in the queue (a retry served ahead of its turn)."""
        self.waiters.remove(w)
        self._gone(w)

    def peek_live(self) -> bool:
        q = self.waiters
        while q and q[0].fut.done():
            self._gone(q.popleft())
        return bool(q)

    def expired(self, now: float) -> list[Waiter]:
        """Remove and return the waiters past their deadline (FIFO, so only the head can be)."""
        out: list[Waiter] = []
        q = self.waiters
        while q and (q[0].fut.done() or q[0].deadline <= now):
            w = q.popleft()
            self._gone(w)
            if not w.fut.done():
                out.append(w)
        return out

    def retry_after(self) -> float:
        return max(1.0, min(self.limits.max_wait_s, 1.0 + self.live / 100.0))
