"""Background metric scrapes: each engine's ``/metrics`` read through its metric mapping.

Samples of one metric are summed over their label sets (``kv_cache_usage`` takes the
maximum). A name the mapping leaves blank, or that the scrape does not contain, is
``None``: unknown, never 0. So is a value no engine can mean: NaN, an infinity, a negative
count or KV-cache use, a KV-cache use above 1 (see ``resolve``). A failed scrape makes the
engine's load unknown at once (``Worker.on_scrape_error``), and a stale scrape is ignored:
the balancer then uses in-flight counts only. A scrape that answers 200 without any of the mapped metrics (an HTML
page, a typo in a mapped name) is a failed scrape, not a reading of "nothing known".

Every endpoint is scraped on its own schedule (``poll_each``): one whose ``/metrics`` is
slow or hangs holds up no other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from cluster_cli.engines import MetricMapping
from cluster_cli.router.http import fetch
from cluster_cli.router.worker import Worker

log = logging.getLogger("clusterctl.router")

SIGNALS = ("running", "waiting", "kv_cache_usage")

# Text exposition format (Prometheus 0.0.4, and OpenMetrics' sample lines): tokens are
# separated by spaces or tabs, a line may be indented, a label set needs no blank after its
# "}", a label value is a quoted string that may hold "}", blanks and escaped quotes, and
# the value may be followed by a timestamp (or an OpenMetrics exemplar). A UTF-8 metric
# name (Prometheus 3) is written quoted, as the first item of the braces: {"my.metric",a="b"}.
_HEAD = re.compile(r"([^\s{]*)\s*")
_STRING = r'"(?:[^"\\]|\\.)*"'
_LABELS = re.compile(r'\{(?:[^"}]|' + _STRING + r")*\}")
_QUOTED_NAME = re.compile(r'\{\s*("(?:[^"\\]|\\.)*")\s*[,}]')
_ESCAPE = re.compile(r"\\(.)")

# KV-cache use is a fraction of the cache. A reading a hair above 1 is rounding (used/total
# in floating point) and counts as full; one clearly above 1 is no fraction at all (most
# likely a 0-100 percentage mapped by mistake): clamped to 1 it would make the engine look
# full at every reading and steer traffic off it for ever, which is worse than not knowing
# (an unknown KV-cache use adds nothing to the load score), so it is unknown.
KV_ROUNDING = 1.01

_warned: set[tuple[str, str]] = set()  # (endpoint URL, signal) already warned about an unusable value


def _unquote(s: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), s[1:-1])


def parse_metrics(text: str, wanted: Iterable[str]) -> dict[str, list[float]]:
    """The samples of each ``wanted`` metric name in a Prometheus text exposition.

    Every value that reads as a float is kept, NaN and infinities included (``resolve``
    judges them); lines that are comments, malformed, or of other metrics are skipped.
    Never raises on any text.
    """
    want = set(wanted)
    out: dict[str, list[float]] = {}
    for line in text.split("\n"):  # only LF ends a line: a label value may hold any other character
        s = line.lstrip()
        if not s or s[0] == "#":
            continue
        head = _HEAD.match(s)
        assert head is not None  # the pattern matches the empty string
        name = head.group(1)
        if name and name not in want:
            continue  # the common case, decided before any label set is read
        pos = head.end()
        if s.startswith("{", pos):
            labels = _LABELS.match(s, pos)
            if labels is None:
                continue  # an unterminated label set
            if not name:
                quoted = _QUOTED_NAME.match(s, pos)
                if quoted is None:
                    continue
                name = _unquote(quoted.group(1))
                if name not in want:
                    continue
            pos = labels.end()
        elif not name:
            continue
        rest = s[pos:].split(None, 1)
        if not rest:
            continue
        try:
            v = float(rest[0])
        except ValueError:
            continue
        out.setdefault(name, []).append(v)
    return out


def _usable(signal: str, v: float) -> float | None:
    if not math.isfinite(v) or v < 0:
        return None
    if signal == "kv_cache_usage" and v > 1.0:
        return 1.0 if v <= KV_ROUNDING else None
    return v


def resolve_checked(
    values: dict[str, list[float]], mapping: MetricMapping
) -> tuple[tuple[float | None, float | None, float | None], list[str]]:
    """``resolve``'s readings, and a note for each metric found with an unusable value."""
    got: list[float | None] = []
    bad: list[str] = []
    for signal in SIGNALS:
        reading: float | None = None
        for name in mapping.names(signal):
            samples = values.get(name)
            if not samples:
                continue
            agg = max(samples) if signal == "kv_cache_usage" else sum(samples)
            # One unusable sample makes the signal unknown: a sum or maximum without it
            # would be a number the engine did not report.
            if any(_usable(signal, x) is None for x in samples) or (reading := _usable(signal, agg)) is None:
                reading = None
                shown = ", ".join(f"{x:g}" for x in samples[:5]) + (", ..." if len(samples) > 5 else "")
                bad.append(f"{signal}: {name} = {shown}")
            break  # the first name the scrape has decides
        got.append(reading)
    return (got[0], got[1], got[2]), bad


def resolve(values: dict[str, list[float]], mapping: MetricMapping) -> tuple[float | None, float | None, float | None]:
    """(running, waiting, kv_cache_usage) with None for what the engine does not export.

    The first of a signal's names (primary, then fallbacks) that the scrape has decides:
    running and waiting are the sum over its samples, kv_cache_usage their maximum. A
    value no engine can mean is unknown, never used: a NaN or infinite or negative sample,
    or a KV-cache use above 1 (``KV_ROUNDING``: up to 1.01 is rounding and reads as 1).
    """
    return resolve_checked(values, mapping)[0]


def mapped_names(mapping: MetricMapping) -> list[str]:
    """Every metric name the mapping reads, primary names and fallbacks, in order, once each."""
    return list(dict.fromkeys(n for s in SIGNALS for n in mapping.names(s)))


async def scrape_one(w: Worker, timeout: float, now: Callable[[], float]) -> None:
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
        values = parse_metrics(body.decode("utf-8", "replace"), names)
        (running, waiting, kv), bad = resolve_checked(values, mapping)
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
    w.on_scrape(running, waiting, kv, now(), started)


def _retrieve(what: str, w: Worker, task: asyncio.Task[object]) -> None:
    if task.cancelled():
        return
    e = task.exception()
    if e is not None:
        log.error("%s of %s failed", what, w.url, exc_info=e)


async def poll_each(
    what: str,
    workers: Callable[[], Iterable[Worker]],
    interval: Callable[[], float],
    one: Callable[[Worker, float], Coroutine[Any, Any, object]],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Run ``one(w, iv)`` for every worker every ``iv = interval()`` seconds, each endpoint on
    its own schedule.

    The loop ticks every ``iv`` and starts each listed worker's ``one`` as a task of its own:
    one that is slow or hangs holds up no other endpoint. A worker whose previous run is
    still going at a tick is not run twice at once: its next run starts as soon as that one
    ends. Once per tick, when every run in flight has ended or the tick's time is up,
    ``after()`` is called (the balancer re-dispatches on what was learned). A worker no
    longer listed has its run in flight cancelled; cancelling the loop cancels, and awaits,
    every run in flight.
    """
    loop = asyncio.get_running_loop()
    tasks: dict[Worker, asyncio.Task[object]] = {}
    owed: set[Worker] = set()  # ticked while still running: to run again as soon as it ends
    listed: set[Worker] = set()
    closing = False

    def start(w: Worker, iv: float) -> None:
        task = loop.create_task(one(w, iv))
        tasks[w] = task
        task.add_done_callback(functools.partial(ended, w))

    def ended(w: Worker, task: asyncio.Task[object]) -> None:
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
            ws = list(workers())
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
    workers: Callable[[], Iterable[Worker]],
    interval: Callable[[], float],
    now: Callable[[], float],
    after: Callable[[], None] = lambda: None,
) -> None:
    """Scrape every worker each ``interval()`` seconds, each on its own schedule (``poll_each``),
    each scrape bounded by twice the interval (0.2 to 2 s)."""

    def one(w: Worker, iv: float) -> Coroutine[Any, Any, None]:
        return scrape_one(w, max(0.2, min(iv * 2, 2.0)), now)

    await poll_each("metric scrape", workers, interval, one, after)
