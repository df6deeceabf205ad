"""Background metric scrapes: each engine's ``/metrics`` read through its metric mapping.

How the text becomes readings (sums, maxima, what is unknown) is ``engines/metrics.py``'s,
shared with ``clusterctl status``. A failed scrape makes the engine's load unknown at once
(``Endpoint.on_scrape_error``), and a stale scrape is ignored: the balancer then uses
in-flight counts only. A scrape that answers 200 without any of the mapped metrics (an HTML
page, a typo in a mapped name) is a failed scrape, not a reading of "nothing known".

Every endpoint is scraped on its own schedule (``poll_each``): one whose ``/metrics`` is
slow or hangs holds up no other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from cluster_cli.engines.metrics import CACHE_COUNTERS, cache_reading, mapped_names, parse_metrics, resolve_checked
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.http import fetch

log = logging.getLogger("clusterctl.router")

_warned: set[tuple[str, str]] = set()  # (endpoint URL, signal) already warned about an unusable value


async def scrape_one(w: Endpoint, timeout: float, now: Callable[[], float]) -> None:
    mapping = w.view.metrics
    gen = w.engine_gen
    if mapping.running is None and mapping.waiting is None and mapping.kv_cache_usage is None:
        return
    started = now()
    try:
        key = w.view.api_key  # the engine's own key: llama-server wants it for /metrics
        auth = {"api_key": key} if key else {}
        status, body = await fetch(w.view.host, w.view.port, "/metrics", timeout, **auth)
        if status != 200:
            raise ValueError(f"HTTP {status}")
        names = mapped_names(mapping)
        counters = CACHE_COUNTERS.get(w.view.engine)
        values = parse_metrics(body.decode("utf-8", "replace"), names + (counters.names() if counters else []))
        (running, waiting, kv), bad = resolve_checked(values, mapping)
        cache = cache_reading(values, counters) if counters else None
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        if w.engine_gen == gen:
            w.on_scrape_error(f"{type(e).__name__}: {e}"[:200])
        return
    if w.engine_gen != gen:
        return  # a reload changed the engine while this scrape ran: its numbers are the old engine's
    if not values:
        # An HTML page, JSON, an empty body, a mapped name with a typo: nothing here tells the
        # load, and a fresh scrape of nothing would hide that load-aware balancing is off.
        w.on_scrape_error(f"none of the mapped metrics ({', '.join(names)}) in /metrics"[:500])
        return
    if running is None and waiting is None and kv is None:
        w.on_scrape_error(f"no usable value in /metrics: {'; '.join(bad)}"[:500])
        return
    for note in bad:
        key = (w.url, note.partition(":")[0])
        if key not in _warned:
            _warned.add(key)
            log.warning("%s: unusable value in /metrics, taken as unknown: %s", w.url, note)
    w.on_scrape(running, waiting, kv, now(), started, cache)


def _retrieve(what: str, w: Endpoint, task: asyncio.Task[object]) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        log.error("%s of %s failed", what, w.url, exc_info=e)


async def poll_each(
    what: str,
    endpoints: Callable[[], Iterable[Endpoint]],
    interval: Callable[[], float],
    one: Callable[[Endpoint, float], Coroutine[Any, Any, object]],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Run ``one(w, iv)`` for every endpoint every ``iv = interval()`` seconds, each endpoint on
    its own schedule.

    The loop ticks every ``iv`` and starts each listed endpoint's ``one`` as a task of its own:
    one that is slow or hangs holds up no other endpoint. A endpoint whose previous run is
    still going at a tick is not run twice at once: its next run starts as soon as that one
    ends. Once per tick, when every run in flight has ended or the tick's time is up,
    ``after()`` is called (the balancer re-dispatches on what was learned). A endpoint no
    longer listed has its run in flight cancelled; cancelling the loop cancels, and awaits,
    every run in flight.
    """
    loop = asyncio.get_running_loop()
    tasks: dict[Endpoint, asyncio.Task[object]] = {}
    owed: set[Endpoint] = set()  # ticked while still running: to run again as soon as it ends
    listed: set[Endpoint] = set()
    closing = False

    def start(w: Endpoint, iv: float) -> None:
        task = loop.create_task(one(w, iv))
        tasks[w] = task
        task.add_done_callback(functools.partial(ended, w))

    def ended(w: Endpoint, task: asyncio.Task[object]) -> None:
        if tasks.get(w) is task:
            del tasks[w]
        _retrieve(what, w, task)
        if w in owed:
            owed.discard(w)
            if not closing and w in listed and w not in tasks:
                start(w, interval())

    try:
        while True:
            iv = interval()
            tick = loop.time()
            ws = list(endpoints())
            listed = set(ws)
            for w in [w for w in tasks if w not in listed]:
                tasks.pop(w).cancel()  # removed: its result no longer matters
            owed &= listed
            for w in ws:
                if w in tasks:
                    owed.add(w)
                else:
                    start(w, iv)
            if ws:
                if tasks:
                    await asyncio.wait(list(tasks.values()), timeout=iv)
                after()
            await asyncio.sleep(max(0.0, tick + iv - loop.time()))
    finally:
        closing = True
        pending = list(tasks.values())
        tasks.clear()
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def scrape_loop(
    endpoints: Callable[[], Iterable[Endpoint]],
    interval: Callable[[], float],
    now: Callable[[], float],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Scrape every endpoint each ``interval()`` seconds, each on its own schedule (``poll_each``),
    each scrape bounded by twice the interval (0.2 to 2 s)."""

    def one(w: Endpoint, iv: float) -> Coroutine[Any, Any, None]:
        return scrape_one(w, max(0.2, min(iv * 2, 2.0)), now)

    await poll_each("metric scrape", endpoints, interval, one, after)
