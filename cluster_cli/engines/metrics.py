"""Reading an engine's load out of its Prometheus ``/metrics`` text, through its metric mapping.

Samples of one metric are summed over their label sets (``kv_cache_usage`` takes the
maximum). A name the mapping leaves blank, or that the text does not contain, is ``None``:
unknown, never 0. So is a value no engine can mean: NaN, an infinity, a negative count or
KV-cache use, a KV-cache use above 1 (see ``resolve``). Pure functions of the text: the
router's periodic scrapes (``router/scrape.py``) and ``clusterctl status`` read through them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from cluster_cli.engines.base import MetricMapping

SIGNALS = ("running", "waiting", "kv_cache_usage")


@dataclass(frozen=True)
class CacheCounters:
    """Where an engine counts the prompt tokens its prefix cache served (counters, in tokens):
    ``hits``, and either ``queries`` (every prompt token looked up) or ``misses`` (those it
    processed). Each is a list of names, the first the scrape has decides."""

    hits: tuple[str, ...]
    queries: tuple[str, ...] = ()
    misses: tuple[str, ...] = ()

    def names(self) -> list[str]:
        return [*self.hits, *self.queries, *self.misses]


# By engine name, as the router config spells it. vLLM >= 0.8 (V1), then its older gauge names;
# llama-server exports prompt_tokens_total without the cached ones, since late 2025.
CACHE_COUNTERS = {
    "vllm": CacheCounters(
        hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    ),
    "llamacpp": CacheCounters(hits=("llamacpp:prompt_tokens_cached_total",), misses=("llamacpp:prompt_tokens_total",)),
}


def cache_reading(values: dict[str, list[float]], counters: CacheCounters) -> tuple[float, float] | None:
    """(prompt tokens served from the cache, prompt tokens in all) since the engine started,
    or None where the engine exports no such counters (or unusable values)."""

    def first(names: tuple[str, ...]) -> float | None:
        for name in names:
            samples = values.get(name)
            if samples:
                v = sum(samples)
                return v if math.isfinite(v) and v >= 0 and all(x >= 0 for x in samples) else None
        return None

    hits = first(counters.hits)
    if hits is None:
        return None
    queries = first(counters.queries)
    if queries is None:
        misses = first(counters.misses)
        if misses is None:
            return None
        queries = hits + misses
    return (hits, queries) if queries >= hits else None


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
