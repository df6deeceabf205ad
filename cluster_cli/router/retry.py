"""Retry limits: a per-request attempt cap, a fleet-wide retry budget, and jittered backoff.

A request is retried only while nothing has reached its client. The budget follows
Envoy's ``retry_budget``: at most ``max(min_concurrency, ratio x active requests)``
retries in flight at once, so a failing fleet sheds load instead of multiplying it.
Overflows are counted for ``/metrics``; metrics live in the caller's hooks, not here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    budget_ratio: float = 0.2
    min_retry_concurrency: int = 10
    backoff_base_s: float = 0.005
    backoff_max_s: float = 0.25

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Delay before attempt number ``attempt`` (2 = first retry): exponential, capped, +-50% jitter."""
        if attempt <= 1 or self.backoff_base_s <= 0:
            return 0.0
        base = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 2)))
        r = (rng or random).random()
        return base * (0.5 + r)


class RetryBudget:
    """Concurrent retries allowed across the router."""

    __slots__ = ("active", "overflows", "policy")

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.active = 0
        self.overflows = 0

    def try_acquire(self, active_requests: int) -> bool:
        limit = max(self.policy.min_retry_concurrency, int(self.policy.budget_ratio * active_requests))
        if self.active >= limit:
            self.overflows += 1
            return False
        self.active += 1
        return True

    def release(self) -> None:
        if self.active > 0:
            self.active -= 1
