"""One upstream engine as the router sees it: identity, live load, breaker, learned capacity.

Live state (in-flight, breaker, drain rate, scraped load, learned capacity, pooled
connections) survives config reloads: ``update_view`` swaps the static part only.

Load signals:
- ``inflight``: the router's own count of requests on this endpoint (exact, immediate);
- the engine's scraped ``running`` / ``waiting`` / ``kv_cache_usage`` through its metric
  mapping. A metric the mapping leaves blank, or the engine does not export, is
  ``None`` (unknown), never 0. A scrape older than ``stale_s`` is ignored: the load
  falls back to the in-flight count.
- ``capacity``: learned, not configured. When a scrape shows more requests waiting than
  the router sent the engine from ``ADMIT_WINDOW_S`` before the scrape on, the engine is
  full at its ``running`` count. Requests sent that recently may only be waiting for the
  engine's next scheduler step (an engine admits new requests between steps, so at
  moderate load a scrape often shows one or two waiting with slots free); counting them
  made a busy engine look full at whatever it ran, and the router then held requests back
  from it. When those fresh requests would take the engine to the estimate, they confirm
  it (no probe past it) without being a reading (unless the engine's KV-cache use,
  projected to the estimate, is well short of full: an estimate learned too low must
  still be probed). The estimate is the highest "full" reading of the last
  ``CAP_WINDOW_S`` seconds, and at least what the engine was seen running at once (an
  endpoint with no estimate beside endpoints of its model that have one starts at the
  largest of theirs: ``registry.adopt_peer_capacity``, at the reload). When
  the engine runs at the estimate with nothing else waiting for ``probe_s`` after the
  last confirmation, the estimate grows by one; the probe holds once the engine runs
  that many, and is dropped when it shows fewer with requests waiting. ``max_inflight``
  caps it; a reload that changes ``max_inflight`` restarts the estimate from the new limit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster_cli.router.breaker import Breaker, BreakerConfig, State
from cluster_cli.router.config import EndpointView
from cluster_cli.router.http import bearer_line, host_header

CAP_WINDOW_S = 30.0
ADMIT_WINDOW_S = 0.15  # a request sent this recently may still wait for its engine's next step (10-100 ms)
SENDS_KEPT_S = ADMIT_WINDOW_S + 2.0  # the window before a scrape's start, plus its longest timeout
KV_FULL = 0.9  # KV-cache use, projected to the estimate, from which the engine counts as full there


@dataclass
class Scraped:
    running: float | None = None
    waiting: float | None = None
    kv: float | None = None
    at: float = -1e18
    inflight_then: int = 0
    error: str | None = None
    cache: tuple[float, float] | None = None  # the engine's (prompt tokens from its cache, prompt tokens)


class Endpoint:
    __slots__ = (
        "_cap_obs",
        "_clock",
        "_prompt_tokens_seen",
        "_rate_mark",
        "_sent",
        "breaker",
        "cache_gen",
        "cap",
        "cap_confirmed_at",
        "completed",
        "drain_rate",
        "engine_gen",
        "failed",
        "head_lines",
        "health_ok",
        "host_header",
        "inflight",
        "pool",
        "probe_s",
        "removed",
        "scraped",
        "stale_s",
        "url",
        "view",
    )

    def __init__(
        self,
        view: EndpointView,
        *,
        breaker_cfg: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        stale_s: float = 3.0,
        probe_s: float = 5.0,
    ) -> None:
        self._clock = clock
        self.url = view.url
        self.view = view
        self.host_header = host_header(view.host, view.port)  # "[::1]:8000": "::1:8000" is refused by nginx
        # What every proxied request's head gets after "Host: ": the host, then the engine's own key
        # when it has one (the client's Authorization is never relayed: http.REQUEST_DROP).
        self.head_lines = self.host_header + b"\r\n" + bearer_line(view.api_key)
        self.breaker = Breaker(breaker_cfg, clock=clock, name=view.replica, on_change=self._breaker_changed)
        # Bumped whenever the engine's cache must be taken as gone (it restarted, failed,
        # was drained or removed): what the prefix policy learned of it before no longer holds.
        self.cache_gen = 0
        self._prompt_tokens_seen: float | None = None  # the engine's prompt-token counter, last read
        self.inflight = 0
        self.completed = 0
        self.failed = 0
        self.drain_rate = 0.0
        self._rate_mark = (clock(), 0)
        self.scraped = Scraped()
        self.engine_gen = 0
        self.cap: int | None = view.max_inflight
        self.cap_confirmed_at = -1e18
        self._cap_obs: deque[tuple[float, int, bool]] = deque()
        self._sent: deque[float] = deque()  # when the router sent requests here, the last SENDS_KEPT_S
        self.stale_s = stale_s
        self.probe_s = probe_s
        self.removed = False
        self.health_ok: bool | None = None
        self.pool = None  # set by the router (UpstreamPool); kept across reloads

    # ---------------------------------------------------------------- config
    def update_view(self, view: EndpointView, *, breaker_cfg: BreakerConfig, stale_s: float, probe_s: float) -> bool:
        """Take a reloaded config's static fields; keep every piece of live state.

        The exceptions are what was learned of the engine: when ``max_inflight`` changes,
        every capacity estimate so far was clipped to the old limit, so it restarts from the
        new one (None: unknown); when the engine, its metric mapping or its key changes (the same
        URL now serves another engine, or another generation of it), the scraped load is dropped too. Returns whether the
        capacity estimate started over."""
        # Another key at the same URL is another engine too: a new generation of the replica.
        new_engine = (
            view.engine != self.view.engine or view.metrics != self.view.metrics or view.api_key != self.view.api_key
        )
        restart = new_engine or view.max_inflight != self.view.max_inflight
        if restart:
            self.cap = view.max_inflight
            self._cap_obs.clear()
            self.cap_confirmed_at = -1e18
        if new_engine:
            self.scraped = Scraped()
            self._prompt_tokens_seen = None  # another engine's counters: nothing to compare with
            self.engine_gen += 1  # a scrape started before this is the old engine's: dropped
        if new_engine or (view.draining and not self.view.draining):
            self.cache_gen += 1
        self.view = view
        self.head_lines = self.host_header + b"\r\n" + bearer_line(view.api_key)  # a new engine here: its own key
        self.breaker.cfg = breaker_cfg
        self.breaker.name = view.replica
        self.stale_s = stale_s
        self.probe_s = probe_s
        self.removed = False
        return restart

    def retire(self) -> None:
        """Removed from the config: no new requests; those in flight finish."""
        self.removed = True
        self.cache_gen += 1

    def _breaker_changed(self, old: State, new: State) -> None:
        if new is State.OPEN:
            self.cache_gen += 1  # failing: it may come back as a new process with an empty cache

    # ---------------------------------------------------------------- eligibility
    def unavailable_reason(self) -> str | None:
        """Why no new request may go here now, or None. Constant strings so they aggregate."""
        if self.removed:
            return "removed"
        if self.view.draining:
            return "draining"
        if self.breaker.current() is State.OPEN:
            return "circuit open"
        return None  # half-open with its probe out counts as full (``saturated``): requests wait for it

    def fresh(self, now: float) -> bool:
        return now - self.scraped.at <= self.stale_s

    def external(self, now: float) -> float:
        """Load on the engine that is not ours (other routers or clients), from a fresh scrape."""
        s = self.scraped
        if s.running is None or not self.fresh(now):
            return 0.0
        seen = s.running + (s.waiting or 0.0)
        return max(0.0, seen - s.inflight_then)

    def load(self, now: float) -> float:
        return self.inflight + self.external(now)

    def kv(self, now: float) -> float | None:
        return self.scraped.kv if self.fresh(now) else None

    def saturated(self, now: float) -> bool:
        """Full: a new request would wait inside the engine rather than start (or, half-open,
        the breaker's probe is out: requests wait in the admission queue for its answer)."""
        if self.breaker.state is State.HALF_OPEN and not self.breaker.allows():
            return True
        mi = self.view.max_inflight
        if mi is not None and self.inflight >= mi:
            return True
        return self.cap is not None and self.load(now) >= self.cap

    # ---------------------------------------------------------------- bookkeeping
    def acquire(self) -> None:
        self.inflight += 1
        now = self._clock()
        sent = self._sent
        sent.append(now)
        while sent[0] < now - SENDS_KEPT_S:
            sent.popleft()

    def sent_since(self, since: float) -> int:
        """Requests the router sent here at or after ``since`` (at most ``SENDS_KEPT_S`` ago)."""
        n = 0
        for t in reversed(self._sent):
            if t < since:
                break
            n += 1
        return n

    def release(self, ok: bool | None) -> None:
        """One request left this endpoint: ok True/False feeds drain stats, None = abandoned."""
        if self.inflight > 0:
            self.inflight -= 1
        if ok:
            self.completed += 1
        elif ok is False:
            self.failed += 1

    def update_rates(self, now: float, alpha: float = 0.3) -> None:
        t0, c0 = self._rate_mark
        dt = now - t0
        if dt <= 0:
            return
        rate = (self.completed - c0) / dt
        self.drain_rate = rate if self.drain_rate == 0 else (1 - alpha) * self.drain_rate + alpha * rate
        self._rate_mark = (now, self.completed)

    def on_scrape(
        self,
        running: float | None,
        waiting: float | None,
        kv: float | None,
        now: float,
        started: float | None = None,
        cache: tuple[float, float] | None = None,
    ) -> None:
        """A scrape's readings, taken between ``started`` (when it was asked for) and ``now``;
        ``cache``: the engine's prompt-cache counters (tokens from its cache, prompt tokens).
        Those counters going back mean a new process, with an empty cache, however many failed
        scrapes came between."""
        self.scraped = Scraped(running, waiting, kv, now, self.inflight, None, cache)
        if cache is not None:
            if self._prompt_tokens_seen is not None and cache[1] < self._prompt_tokens_seen:
                self.cache_gen += 1
            self._prompt_tokens_seen = cache[1]
        if running is None or waiting is None:
            return
        obs = self._cap_obs
        while obs and now - obs[0][0] > CAP_WINDOW_S:
            obs.popleft()
        # Requests the router sent in the last moment may be waiting only for the engine's
        # next scheduler step: waiting beyond them is what shows the engine full. Fresh ones
        # taking it to the estimate are "at the estimate", unless the KV cache, where the
        # engine exports it, says the estimate would leave it well short of full.
        recent = self.sent_since((now if started is None else started) - ADMIT_WINDOW_S)
        ours = min(waiting, recent)
        cap = self.cap
        at_estimate = (
            cap is not None and running + ours >= cap and (kv is None or running <= 0 or kv * cap >= KV_FULL * running)
        )
        if running >= 1 and waiting > recent:
            # Full at ``running``. A single low reading must not shrink the estimate: it is
            # the highest such reading over the last CAP_WINDOW_S seconds. A probe above
            # what the engine now shows did not hold: drop it.
            obs = self._drop_probes_above(int(running))
            obs.append((now, int(running), False))
            self.cap_confirmed_at = now
        elif running >= 1 and waiting > 0 and at_estimate:
            # Held at the estimate, only fresh requests waiting: no reason to probe past it.
            # What runs is the estimate minus those just sent, so it is no reading to keep
            # (the estimate would creep down), but a probe above it has not been shown to hold.
            obs = self._drop_probes_above(int(running))
            self.cap_confirmed_at = now
        elif cap is not None and running > cap:
            obs.append((now, int(running), False))  # it ran that many at once: it can
        elif cap is not None and running + ours >= cap and now - self.cap_confirmed_at >= self.probe_s:
            # Ran at the estimate with nothing waiting but what was just sent: try one more.
            obs.append((now, cap + 1, True))  # (running <= cap here)
            self.cap_confirmed_at = now
        if obs:
            cap = max(c for _, c, _ in obs)
            mi = self.view.max_inflight
            self.cap = cap if mi is None else min(cap, mi)

    def _drop_probes_above(self, running: int) -> deque[tuple[float, int, bool]]:
        """Probes above what the engine now runs, with requests waiting, did not hold."""
        obs = self._cap_obs
        if any(probe and c > running for _, c, probe in obs):
            self._cap_obs = obs = deque(o for o in obs if not (o[2] and o[1] > running))
        return obs

    def on_scrape_error(self, error: str) -> None:
        """A failed scrape: its engine's load is unknown from now on (the balancer falls back to
        in-flight counts at once, not when the last good reading goes stale)."""
        s = self.scraped
        self.scraped = Scraped(None, None, None, s.at, s.inflight_then, error)

    def snapshot(self, now: float) -> dict[str, object]:
        s = self.scraped
        return {
            "url": self.url,
            "replica": self.view.replica,
            "engine": self.view.engine,
            "models": list(self.view.models),
            "inflight": self.inflight,
            "draining": self.view.draining,
            "removed": self.removed,
            "drain_rate": round(self.drain_rate, 3),
            "completed": self.completed,
            "failed": self.failed,
            "breaker": self.breaker.stats(),
            "capacity_estimate": self.cap,
            "scrape": {
                "age_s": None if s.at < -1e17 else round(now - s.at, 3),
                "fresh": self.fresh(now) and s.error is None,  # a failed last scrape: nothing is known
                "running": s.running,
                "waiting": s.waiting,
                "kv_cache_usage": s.kv,
                "error": s.error,
            },
        }
