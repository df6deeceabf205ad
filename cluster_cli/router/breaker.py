"""Per-endpoint circuit breaker: closed -> open -> half-open probe -> closed.

Passive signals (connect errors, 5xx, timeouts on real requests) and active ones
(the engine's health endpoint) both feed it. ``failure_threshold`` consecutive
request failures, or ``health_failure_threshold`` consecutive failed health checks,
open it. It stays open for ``open_for_s`` x the number of openings in a row (capped
by ``max_open_for_s``), then lets ``half_open_max`` probe request(s) through at a
time; ``success_threshold`` successes close it, one failure reopens it. A passing
health check moves a breaker that failed health checks opened to half-open at once
(the engine is back); one opened by failed requests waits out its open time, since
an engine can pass ``/health`` and still fail requests. While its health checks fail, a
breaker they opened (or that they found open) stays open past its open time: only a
passing check half-opens it.
Each half-open period has its own number (``generation``); ``on_send`` returns it for a
probe and the caller hands it back with the result. Only the current period's probes
count towards closing (and towards the probes in flight): a probe sent before a re-open,
or a request sent while closed, must not close the breaker while the new probe is out.
A failure seen while half-open still reopens it, whatever its age.
The clock is injected so tests never sleep.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("clusterctl.router")


class State(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 5
    success_threshold: int = 2
    open_for_s: float = 5.0
    max_open_for_s: float = 60.0
    health_failure_threshold: int = 2
    half_open_max: int = 1


class Breaker:
    __slots__ = (
        "_clock",
        "_on_change",
        "cfg",
        "failures",
        "generation",
        "health_failures",
        "name",
        "opened_at",
        "opened_by_health",
        "openings",
        "probes",
        "state",
        "successes",
    )

    def __init__(
        self,
        cfg: BreakerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
        on_change: Callable[[State, State], None] | None = None,
    ) -> None:
        self.cfg = cfg or BreakerConfig()
        self._clock = clock
        self._on_change = on_change
        self.name = name
        self.state = State.CLOSED
        self.failures = 0  # consecutive request failures while closed
        self.health_failures = 0  # consecutive failed health checks
        self.successes = 0  # successes while half-open
        self.openings = 0  # openings in a row (reset when closed)
        self.opened_at = 0.0
        self.opened_by_health = False
        self.probes = 0  # half-open requests in flight (of the current generation)
        self.generation = 0  # number of the current (or last) half-open period

    # ---------------------------------------------------------------- queries
    def open_for(self) -> float:
        return min(self.cfg.max_open_for_s, self.cfg.open_for_s * max(1, self.openings))

    def reopens_in(self) -> float | None:
        """Seconds until an open breaker lets a probe through (0 when that is due); None when not open."""
        if self.state is not State.OPEN:
            return None
        # The same arithmetic as _tick's, so that 0 here means a probe is let through now.
        left = max(0.0, self.open_for() - (self._clock() - self.opened_at))
        # Held open by failing health checks: not before the next one could pass.
        return max(left, 1.0) if self._held_by_health() else left

    def _open_time_over(self) -> bool:
        return self.state is State.OPEN and self._clock() - self.opened_at >= self.open_for()

    def _held_by_health(self) -> bool:
        """Open with its health checks failing now: it stays open past its open time, and the
        first passing check half-opens it (no real request is sent to a dead engine as a probe,
        and /health does not read it as up for the moment between its open time and the next
        failed check)."""
        return self.opened_by_health and self.health_failures > 0

    def _tick(self) -> None:
        if self._open_time_over() and not self._held_by_health():
            self._set(State.HALF_OPEN)

    def allows(self) -> bool:
        """Whether a new request may be sent now (no side effect beyond the lazy open -> half-open)."""
        st = self.state
        if st is State.CLOSED:
            return True
        self._tick()
        if self.state is State.HALF_OPEN:
            return self.probes < self.cfg.half_open_max
        return False

    def current(self) -> State:
        self._tick()
        return self.state

    # ---------------------------------------------------------------- request outcomes
    def on_send(self) -> int:
        """A request goes out. Returns 0 for an ordinary request; for a half-open probe, the
        half-open period's ``generation`` (>= 1). Pass it back to ``on_result`` / ``on_abandon``."""
        if self.state is State.CLOSED:
            return 0
        self._tick()
        if self.state is State.HALF_OPEN:
            self.probes += 1
            return self.generation
        return 0

    def _current_probe(self, probe: int) -> bool:
        return bool(probe) and self.state is State.HALF_OPEN and probe == self.generation

    def on_result(self, ok: bool, probe: int = 0, holds_slot: bool = True) -> None:
        """``probe``: what ``on_send`` returned for this request; ``holds_slot`` False once
        ``on_answered`` has given its probe slot back."""
        self._tick()  # an open time that is over counts whether or not anyone has looked since
        current = self._current_probe(probe)
        if current and holds_slot and self.probes > 0:
            self.probes -= 1
        if ok:
            if self.state is not State.HALF_OPEN or current:  # stale results cannot close it
                self._success()
        else:
            self._failure()

    def on_abandon(self, probe: int, holds_slot: bool = True) -> None:
        """The request ended without telling anything about the endpoint (client went away)."""
        if holds_slot and self._current_probe(probe) and self.probes > 0:
            self.probes -= 1

    def on_answered(self, probe: int) -> None:
        """A probe's engine answered (its status line came): its slot goes to the next probe,
        so requests are not held back for as long as a whole generation takes; the probe
        still counts towards closing only when it has been served whole."""
        if self._current_probe(probe) and self.probes > 0:
            self.probes -= 1

    def _success(self) -> None:
        if self.state is State.CLOSED:
            self.failures = 0
        elif self.state is State.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.cfg.success_threshold:
                self._set(State.CLOSED)

    def _failure(self) -> None:
        if self.state is State.CLOSED:
            self.failures += 1
            if self.failures >= self.cfg.failure_threshold:
                self._open()
        elif self.state is State.HALF_OPEN:
            self._open()

    # ---------------------------------------------------------------- active health
    def on_health(self, ok: bool) -> None:
        if ok:
            self._tick()
            self.health_failures = 0
            if self.state is State.OPEN and self.opened_by_health:
                self._set(State.HALF_OPEN)
            return
        self.health_failures += 1
        if self._open_time_over():
            # Its open time is over, yet its health still fails: open for another period.
            # No probe failed, so it is no new opening (the open time does not grow), the
            # same whether or not something looked (and half-opened it) in between.
            self.opened_at = self._clock()
            self.opened_by_health = True
        elif self.state is State.OPEN:  # down by its health too: its recovery will show there first
            self.opened_by_health = True
        elif self.state is State.HALF_OPEN and self.probes == 0:
            self._open(by_health=True, new_opening=False)
        elif self.state is State.HALF_OPEN or (
            self.state is State.CLOSED and self.health_failures >= self.cfg.health_failure_threshold
        ):
            self._open(by_health=True)

    # ---------------------------------------------------------------- transitions
    def _open(self, by_health: bool = False, new_opening: bool = True) -> None:
        self.opened_by_health = by_health
        if new_opening:
            self.openings += 1
        self.opened_at = self._clock()
        self._set(State.OPEN)

    def _set(self, new: State) -> None:
        old = self.state
        if old is new and new is not State.OPEN:
            return
        self.state = new
        self.successes = 0
        self.failures = 0
        if new is State.CLOSED:
            self.openings = 0
        if new is State.HALF_OPEN:
            self.generation += 1
        else:
            self.probes = 0
        if old is not new:
            log.warning("breaker %s: %s -> %s", self.name, old.name.lower(), new.name.lower())
            if self._on_change is not None:
                self._on_change(old, new)

    def stats(self) -> dict[str, object]:
        return {
            "state": self.current().name.lower(),
            "consecutive_failures": self.failures,
            "openings": self.openings,
            "health_failures": self.health_failures,  # consecutive failed health checks
            "probes": self.probes,
        }
