"""Active health checks: GET the engine's health path and feed the breaker.

Every endpoint is checked on its own schedule (``scrape.poll_each``): one whose health path
hangs neither delays nor thins out the checks of the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from cluster_cli.router.breaker import State
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.http import fetch
from cluster_cli.router.scrape import poll_each


async def check_one(w: Endpoint, timeout: float, interval: float = 0.0) -> bool:
    try:
        key = w.view.api_key  # the engine's own key, when it has one
        auth = {"api_key": key} if key else {}
        status, _ = await fetch(w.view.host, w.view.port, w.view.health_path, timeout, max_bytes=65536, **auth)
        ok = status == 200
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        ok = False
    w.health_ok = ok
    w.breaker.on_health(ok)
    if not ok and w.breaker.state is State.OPEN and w.pool is not None:
        # Judged dead (frozen, hung): requests still waiting there for a first byte would wait
        # out the whole idle timeout; they fail now and are retried on another endpoint, if
        # nothing came from the engine on any connection while its checks were failing.
        silent_for = w.breaker.cfg.health_failure_threshold * interval + timeout
        w.pool.fail_unanswered("the engine failed its health checks before answering", silent_for, time.monotonic())
    return ok


async def health_loop(
    endpoints: Callable[[], Iterable[Endpoint]],
    interval: Callable[[], float],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Check every (not removed) endpoint each ``interval()`` seconds, each on its own schedule,
    each check bounded by the interval (0.5 to 5 s)."""

    def one(w: Endpoint, iv: float) -> Coroutine[Any, Any, bool]:
        return check_one(w, max(0.5, min(iv, 5.0)), iv)

    await poll_each("health check", lambda: [w for w in endpoints() if not w.removed], interval, one, after)
