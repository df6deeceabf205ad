"""Prometheus metrics of the router (``prometheus-client``, one registry per router).

Per request: requests by model, endpoint and status; time to first byte and total
latency histograms of the requests that reached an endpoint; retries; admission rejections
(all plain counters in memory, exposed through a collector: no locks or label lookups on
the request path). Live state (in-flight, breaker
state, draining, drain rate, scrape age, learned capacity, queue length, retry budget
overflows) is read when ``/metrics`` is scraped, so it costs nothing per request.
Label values come from the config only (model, replica name as ``endpoint``, its URL as
``url``); unknown models count as "".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from cluster_cli.router.registry import Table
    from cluster_cli.router.retry import RetryBudget

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Why a cut stream was not continued: the model's switch or resume_limit 0 (``disabled``), its
# continuations used up (``limit``), a request or stream no continuation reproduces
# (``unsupported``: n > 1, logprobs, a tool call...), no other replica or no retry budget
# (``no_endpoint``, ``budget``), the engine's refusal (``engine_refused``), the router stopping.
RESUME_FAILURES = ("disabled", "limit", "unsupported", "no_endpoint", "engine_refused", "shutdown")
# Bounds as prometheus-client's own histograms write them ("1.0", not "1"): Prometheus joins
# series on the label's text, so the same bound must be spelt the same everywhere.
_BOUNDS = (*map(floatToGoString, LATENCY_BUCKETS), "+Inf")


class Observed(Protocol):
    """What the metrics read of the router they describe (``lifecycle.Lifecycle`` is one)."""

    budget: RetryBudget
    reloads_ok: int
    reloads_rejected: int
    keys_reloads_ok: int
    keys_reloads_rejected: int
    clock: Callable[[], float]

    @property
    def table(self) -> Table: ...


class _StateCollector(Collector):
    def __init__(self, router: Callable[[], Observed]) -> None:
        self._router = router

    def collect(self) -> Iterator[object]:
        r = self._router()
        now = r.clock()
        # ``endpoint`` is the replica's name, as on the per-request series (so the two join);
        # ``url`` says where it is.
        labels = ["endpoint", "url"]
        inflight = GaugeMetricFamily(
            "clusterctl_router_endpoint_inflight", "Requests in flight per endpoint.", labels=labels
        )
        breaker = GaugeMetricFamily(
            "clusterctl_router_endpoint_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.", labels=labels
        )
        draining = GaugeMetricFamily(
            "clusterctl_router_endpoint_draining", "1 while the endpoint drains.", labels=labels
        )
        drain = GaugeMetricFamily(
            "clusterctl_router_endpoint_drain_rate", "Requests completed per second (moving average).", labels=labels
        )
        age = GaugeMetricFamily(
            "clusterctl_router_endpoint_scrape_age_seconds", "Seconds since the last good metric scrape.", labels=labels
        )
        cap = GaugeMetricFamily(
            "clusterctl_router_endpoint_capacity_estimate", "Learned concurrent-request capacity.", labels=labels
        )
        loadm = GaugeMetricFamily(
            "clusterctl_router_endpoint_scraped",
            "Scraped engine load by signal (absent = unknown).",
            labels=[*labels, "signal"],
        )
        endpoints = list(r.table.endpoints.values()) + list(r.table.retired)
        for w in endpoints:
            lv = [w.view.replica, w.url]
            inflight.add_metric(lv, w.inflight)
            breaker.add_metric(lv, int(w.breaker.current()))
            draining.add_metric(lv, 1 if (w.view.draining or w.removed) else 0)
            drain.add_metric(lv, round(w.drain_rate, 6))  # an average decaying to 0: no 1e-16 tails
            if w.scraped.at > -1e17:
                age.add_metric(lv, now - w.scraped.at)
            if w.cap is not None:
                cap.add_metric(lv, w.cap)
            s = w.scraped
            for sig, v in (("running", s.running), ("waiting", s.waiting), ("kv_cache_usage", s.kv)):
                if v is not None:
                    loadm.add_metric([*lv, sig], v)
            if s.cache is not None:
                loadm.add_metric([*lv, "prompt_cached_tokens"], s.cache[0])
                loadm.add_metric([*lv, "prompt_tokens"], s.cache[1])
        yield from (inflight, breaker, draining, drain, age, cap, loadm)
        ratio = GaugeMetricFamily(
            "clusterctl_router_engine_cache_hit_ratio",
            "Prompt tokens the model's engines served from their prefix caches, over all their prompt"
            " tokens, since they started (engines that export it: vLLM, llama-server).",
            labels=["model"],
        )
        for name, entry in r.table.models.items():
            seen = [c for w in entry.endpoints if (c := w.scraped.cache) is not None]
            total = sum(q for _, q in seen)
            if total > 0:
                ratio.add_metric([name], sum(h for h, _ in seen) / total)
        yield ratio
        ql = GaugeMetricFamily(
            "clusterctl_router_queue_length", "Requests waiting for a slot, per model.", labels=["model"]
        )
        for name, entry in r.table.models.items():
            ql.add_metric([name], len(entry.queue))
        yield ql
        ov = CounterMetricFamily(
            "clusterctl_router_retry_budget_overflows", "Retries refused by the retry budget.", labels=[]
        )
        ov.add_metric([], r.budget.overflows)
        yield ov
        rel = CounterMetricFamily("clusterctl_router_config_reloads", "Config reloads by result.", labels=["result"])
        rel.add_metric(["ok"], r.reloads_ok)
        rel.add_metric(["rejected"], r.reloads_rejected)
        yield rel
        kr = CounterMetricFamily(
            "clusterctl_router_api_keys_reloads", "API keys file reloads by result.", labels=["result"]
        )
        kr.add_metric(["ok"], r.keys_reloads_ok)
        kr.add_metric(["rejected"], r.keys_reloads_rejected)
        yield kr


class _Hist:
    """A Prometheus histogram without locks or label lookups (the router is single-threaded)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, v)] += 1
        self.sum += v

    def buckets(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        acc = 0
        for bound, n in zip(_BOUNDS, self.counts, strict=True):
            acc += n
            out.append((bound, acc))
        return out


class _RequestCollector(Collector):
    """Per-request counters and histograms, kept as plain numbers and exposed on scrape."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = {}
        self.cut: dict[tuple[str, str], int] = {}  # responses cut by their engine after they started
        self.retries: dict[tuple[str, str], int] = {}  # (model, reason)
        self.rejections: dict[tuple[str, str], int] = {}  # (model, reason)
        self.ttfb: dict[str, _Hist] = {}
        self.latency: dict[str, _Hist] = {}
        self.resumed: dict[str, int] = {}  # cut streams continued elsewhere that ended whole
        self.resume_failures: dict[tuple[str, str], int] = {}  # (model, reason)
        self.seam: dict[str, _Hist] = {}  # a cut to the continuation's first relayed byte
        self.affinity: dict[tuple[str, str], int] = {}  # (model, outcome): the prefix policy's decisions
        self.prefix_chars: dict[str, list[int]] = {}  # model -> [chars matched, chars of prompts]

    def collect(self) -> Iterator[object]:
        req = CounterMetricFamily(
            "clusterctl_router_requests",
            "Requests by model, endpoint and status.",
            labels=["model", "endpoint", "status"],
        )
        for (model, endpoint, status), n in list(self.requests.items()):
            req.add_metric([model, endpoint, str(status)], n)
        yield req
        cut = CounterMetricFamily(
            "clusterctl_router_responses_cut",
            "Responses cut by their engine after they had started (counted in requests_total under "
            "the status already sent, 200 for a stream): the client got an SSE error event or a reset.",
            labels=["model", "endpoint"],
        )
        for (model, endpoint), n in list(self.cut.items()):
            cut.add_metric([model, endpoint], n)
        yield cut
        resumed = CounterMetricFamily(
            "clusterctl_router_requests_resumed",
            "Streams cut by their engine, continued on another replica, that ended whole.",
            labels=["model"],
        )
        for model, n in list(self.resumed.items()):
            resumed.add_metric([model], n)
        yield resumed
        for name, doc, counts in (
            ("clusterctl_router_retries", "Retries by model and reason.", self.retries),
            ("clusterctl_router_admission_rejections", "Requests refused by admission, by reason.", self.rejections),
            (
                "clusterctl_router_resume_failures",
                "Cut streams that were not continued (or whose continuation failed), by reason.",
                self.resume_failures,
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model", "reason"])
            for (model, reason), n in list(counts.items()):
                fam.add_metric([model, reason], n)
            yield fam
        aff = CounterMetricFamily(
            "clusterctl_router_prefix_decisions",
            "The prefix policy's decisions: session, matched (longest prefix), overridden (by the load"
            " guard), full (a saturated replica held more of the prompt), short (match below"
            " min_match_chars), miss.",
            labels=["model", "outcome"],
        )
        for (model, outcome), n in list(self.affinity.items()):
            aff.add_metric([model, outcome], n)
        yield aff
        for name, doc, i in (
            ("clusterctl_router_prefix_matched_chars", "Prompt characters found on the chosen replica.", 0),
            ("clusterctl_router_prefix_prompt_chars", "Prompt characters indexed (whole blocks).", 1),
        ):
            fam = CounterMetricFamily(name, doc, labels=["model"])
            for model, pair in list(self.prefix_chars.items()):
                fam.add_metric([model], pair[i])
            yield fam
        for name, doc, hists in (
            (
                "clusterctl_router_time_to_first_byte_seconds",
                "Request start to first byte sent to the client.",
                self.ttfb,
            ),
            ("clusterctl_router_request_duration_seconds", "Request start to response end.", self.latency),
            (
                "clusterctl_router_seam_seconds",
                "A stream's cut to the next byte relayed from the replica continuing it.",
                self.seam,
            ),
        ):
            fam = HistogramMetricFamily(name, doc, labels=["model"])
            for model, h in list(hists.items()):
                fam.add_metric([model], h.buckets(), h.sum)
            yield fam


class RouterMetrics:
    def __init__(self, router: Callable[[], Observed]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self._req = _RequestCollector()
        reg.register(self._req)
        reg.register(_StateCollector(router))

    def request(self, model: str, endpoint: str, status: int, ttfb: float | None, total: float) -> None:
        """A proxied request's answer. Its latency counts only when it went to an endpoint: the
        histograms measure the engines, and a refusal (no endpoint, queue full, unknown model)
        taking a millisecond must not make them look faster while a model is down."""
        r = self._req
        key = (model, endpoint, status)
        r.requests[key] = r.requests.get(key, 0) + 1
        if not endpoint:
            return
        if ttfb is not None:
            h = r.ttfb.get(model)
            if h is None:
                h = r.ttfb[model] = _Hist()
            h.observe(ttfb)
        h = r.latency.get(model)
        if h is None:
            h = r.latency[model] = _Hist()
        h.observe(total)

    def cut(self, model: str, endpoint: str) -> None:
        """A response its engine cut after it had started reaching the client."""
        key = (model, endpoint)
        self._req.cut[key] = self._req.cut.get(key, 0) + 1

    def resumed(self, model: str) -> None:
        """A cut stream was continued elsewhere and ended whole (once per request)."""
        self._req.resumed[model] = self._req.resumed.get(model, 0) + 1

    def resume_failure(self, model: str, reason: str) -> None:
        """A cut stream ended with an error event: ``reason`` is one of ``RESUME_FAILURES``."""
        key = (model, reason)
        self._req.resume_failures[key] = self._req.resume_failures.get(key, 0) + 1

    def seam(self, model: str, seconds: float) -> None:
        """A continuation's first byte reached the client ``seconds`` after the cut."""
        h = self._req.seam.get(model)
        if h is None:
            h = self._req.seam[model] = _Hist()
        h.observe(seconds)

    def affinity(self, model: str, outcome: str, matched_chars: int, prompt_chars: int) -> None:
        """The prefix policy chose a replica for a request of ``model``."""
        r = self._req
        key = (model, outcome)
        r.affinity[key] = r.affinity.get(key, 0) + 1
        pair = r.prefix_chars.get(model)
        if pair is None:
            pair = r.prefix_chars[model] = [0, 0]
        pair[0] += matched_chars
        pair[1] += prompt_chars

    def answered(self, status: int) -> None:
        """A request the router answered itself (a route of its own, a refusal): counted under
        ``model=""`` and ``endpoint=""``, with no latency (it measures the engines)."""
        key = ("", "", status)
        r = self._req
        r.requests[key] = r.requests.get(key, 0) + 1

    def retry(self, model: str, reason: str) -> None:
        key = (model, reason)
        self._req.retries[key] = self._req.retries.get(key, 0) + 1

    def rejection(self, model: str, reason: str) -> None:
        key = (model, reason)
        self._req.rejections[key] = self._req.rejections.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
