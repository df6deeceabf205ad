"""Background metric scrapes: each engine's ``/metrics`` read through its metric mapping.

Samples of one metric are summed over their label sets (``kv_cache_usage`` takes the
maximum). A name the mapping leaves blank, or that the scrape does not contain, is
``None``: unknown, never 0. A failed scrape leaves the previous values to go stale,
and a stale scrape is ignored by the balancer, which then uses in-flight counts only.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable

from cluster_cli.engines import MetricMapping
from cluster_cli.router.http import fetch
from cluster_cli.router.worker import Worker

log = logging.getLogger("clusterctl.router")


def parse_metrics(text: str, wanted: Iterable[str]) -> dict[str, list[float]]:
    """The samples of each ``wanted`` metric name in a Prometheus text exposition."""
    want = set(wanted)
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        sp = line.find(" ")
        if sp < 0:
            continue
        name = line[:brace] if 0 <= brace < sp else line[:sp]
        if name not in want:
            continue
        if brace >= 0 and brace < sp:
            close = line.rfind("}")
            rest = line[close + 1 :].split()
        else:
            rest = line[sp + 1 :].split()
        if not rest:
            continue
        try:
            v = float(rest[0])
        except ValueError:
            continue
        if math.isnan(v):
            continue
        out.setdefault(name, []).append(v)
    return out


def resolve(values: dict[str, list[float]], mapping: MetricMapping) -> tuple[float | None, float | None, float | None]:
    """(running, waiting, kv_cache_usage) with None for what the engine does not export."""

    def one(signal: str, agg: Callable[[list[float]], float]) -> float | None:
        for name in mapping.names(signal):
            if values.get(name):
                return agg(values[name])
        return None

    return one("running", sum), one("waiting", sum), one("kv_cache_usage", max)


def _names(mapping: MetricMapping) -> set[str]:
    return {n for s in ("running", "waiting", "kv_cache_usage") for n in mapping.names(s)}


async def scrape_one(w: Worker, timeout: float, now: Callable[[], float]) -> None:
    mapping = w.view.metrics
    gen = w.engine_gen
    if mapping.running is None and mapping.waiting is None and mapping.kv_cache_usage is None:
        return
    started = now()
    try:
        status, body = await fetch(w.view.host, w.view.port, "/metrics", timeout)
        if status != 200:
            raise ValueError(f"HTTP {status}")
        running, waiting, kv = resolve(parse_metrics(body.decode("utf-8", "replace"), _names(mapping)), mapping)
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        if w.engine_gen == gen:
            w.on_scrape_error(f"{type(e).__name__}: {e}"[:200])
        return
    if w.engine_gen != gen:
        return  # a reload changed the engine while this scrape ran: its numbers are the old engine's
    w.on_scrape(running, waiting, kv, now(), started)


async def scrape_loop(
    workers: Callable[[], Iterable[Worker]],
    interval: Callable[[], float],
    now: Callable[[], float],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Scrape every worker each ``interval()`` seconds, concurrently, each bounded by the interval."""
    while True:
        iv = interval()
        ws = list(workers())
        if ws:
            t = max(0.2, min(iv * 2, 2.0))
            await asyncio.gather(*(scrape_one(w, t, now) for w in ws), return_exceptions=True)
            after()
        await asyncio.sleep(iv)
