"""The router's live state: the breaker, the balancer's in-flight bookkeeping and leases, the admission
queue, reload carry-over. Hypothesis state machines, and the rules they check shown by example."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cluster_cli.router.admission import ModelQueue, QueueLimits, Rejected
from cluster_cli.router.balancer import Balancer, Lease
from cluster_cli.router.breaker import Breaker, BreakerConfig, State
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.policy import LeastLoad
from cluster_cli.router.registry import build_table

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------- breaker
BREAKER_CONFIGS = st.builds(
    BreakerConfig,
    failure_threshold=st.integers(1, 2),
    success_threshold=st.sampled_from([2, 1, 3]),
    open_for_s=st.sampled_from([1.0, 5.0]),
    max_open_for_s=st.sampled_from([3.0, 20.0]),
    health_failure_threshold=st.integers(1, 2),
    half_open_max=st.integers(1, 3),
)
# how a request in flight ends; mostly well, or half-open periods seldom last until they close
OUTCOMES = st.sampled_from(["ok", "failed", "ok", "abandoned"])


class BreakerMachine(RuleBasedStateMachine):
    """The breaker against a small reference model (the ``m_*`` fields). Requests outlive
    re-opens: each request in flight keeps what ``on_send`` returned (0, or its half-open
    period's generation), so results of stale probes and of requests sent while closed come
    back in later half-open periods."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.outstanding: list[int] = []  # what on_send returned, per request in flight

    @initialize(cfg=BREAKER_CONFIGS)
    def start(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self.b = Breaker(cfg, clock=self.clock)
        self.m_state = State.CLOSED
        self.m_gen = 0  # number of the current (or last) half-open period
        self.m_successes = 0  # current-generation successes in this half-open period
        self.m_failures = 0  # consecutive request failures while closed
        self.m_health_failures = 0  # consecutive failed health checks
        self.m_openings = 0  # openings in a row
        self.m_opened_at = 0.0
        self.m_by_health = False

    # -------------------------------------------------------------- reference model
    def m_open_for(self) -> float:
        return min(self.cfg.max_open_for_s, self.cfg.open_for_s * max(1, self.m_openings))

    def m_open(self, by_health: bool, new_opening: bool = True) -> None:
        self.m_state, self.m_by_health = State.OPEN, by_health
        self.m_openings += new_opening
        self.m_opened_at = self.clock.t

    def m_half_open(self) -> None:
        self.m_state, self.m_successes = State.HALF_OPEN, 0
        self.m_gen += 1

    def m_close(self) -> None:
        self.m_state, self.m_failures, self.m_openings = State.CLOSED, 0, 0

    def m_tick(self) -> None:
        # open -> half-open happens lazily, on the breaker's next call (allows, on_send, current,
        # on_result, on_health), whichever it is: the same outcome whether anyone looked or not
        # not while its health checks fail, once they opened it or found it open: a passing
        # check half-opens it then
        held = self.m_by_health and self.m_health_failures > 0
        if self.m_state is State.OPEN and self.clock.t - self.m_opened_at >= self.m_open_for() and not held:
            self.m_half_open()

    def m_probes(self) -> int:
        return sum(g == self.m_gen for g in self.outstanding) if self.m_state is State.HALF_OPEN else 0

    def in_flight(self) -> tuple[list[int], list[int], list[int]]:
        """Indexes of the requests in flight while half-open: this period's probes, older periods'
        probes, requests sent while closed."""
        if self.m_state is not State.HALF_OPEN:
            return [], [], []
        gens = list(enumerate(self.outstanding))
        return (
            [i for i, g in gens if g == self.m_gen],
            [i for i, g in gens if 0 < g < self.m_gen],
            [i for i, g in gens if g == 0],
        )

    # -------------------------------------------------------------- rules
    @rule()
    def send(self) -> None:
        allowed = self.b.allows()
        self.m_tick()
        assert allowed == (
            self.m_state is State.CLOSED
            or (self.m_state is State.HALF_OPEN and self.m_probes() < self.cfg.half_open_max)
        )
        if allowed:
            gen = self.b.on_send()
            assert gen == (self.m_gen if self.m_state is State.HALF_OPEN else 0)
            self.outstanding.append(gen)

    @rule(outcome=OUTCOMES, data=st.data())
    @precondition(lambda self: self.outstanding)
    def finish(self, outcome: str, data: st.DataObject) -> None:
        """A request in flight ends. While half-open, picked among the probes of this period, the
        probes of older ones, the requests sent while closed, or all."""
        pools = [p for p in self.in_flight() if p]
        pool = data.draw(st.sampled_from([*pools, range(len(self.outstanding))]), label="pool")
        gen = self.outstanding.pop(data.draw(st.sampled_from(pool), label="request"))
        if outcome == "abandoned":  # tells nothing about the endpoint: only the probes in flight change
            self.b.on_abandon(gen)
            assert self.b.state is self.m_state
            return
        ok = outcome == "ok"
        self.m_tick()
        before = self.m_state
        current = before is State.HALF_OPEN and gen == self.m_gen
        self.b.on_result(ok, gen)
        if before is State.CLOSED:
            self.m_failures = 0 if ok else self.m_failures + 1
            if self.m_failures >= self.cfg.failure_threshold:
                self.m_open(by_health=False)
                assert self.b.state is State.OPEN, "failure_threshold failures in a row must open it"
        elif before is State.HALF_OPEN and not ok:  # any failure reopens it, whatever its age
            self.m_open(by_health=False)
            assert self.b.state is State.OPEN, "a failure while half-open must reopen it"
        elif before is State.HALF_OPEN and current:
            self.m_successes += 1
            if self.m_successes >= self.cfg.success_threshold:
                self.m_close()
                event("closed by probes")
                assert self.b.state is State.CLOSED, "success_threshold current probes succeeded"
            else:
                assert self.b.state is State.HALF_OPEN, "closed before success_threshold successes"
        elif before is State.HALF_OPEN:
            event("stale success while half-open")
            assert self.b.state is State.HALF_OPEN, "a stale success changed the state"
        assert self.b.state is self.m_state

    @rule(ok=st.booleans())
    def health(self, ok: bool) -> None:
        self.b.on_health(ok)
        if ok:
            self.m_tick()
            self.m_health_failures = 0
            if self.m_state is State.OPEN and self.m_by_health:  # the engine is back: probe now
                self.m_half_open()
        else:
            self.m_health_failures += 1
            over = self.m_state is State.OPEN and self.clock.t - self.m_opened_at >= self.m_open_for()
            if over or (self.m_state is State.HALF_OPEN and self.m_probes() == 0):
                # still down by its health after its open time, no probe failed: another
                # period of the same length, whether or not something half-opened it meanwhile
                event("health failure after the open time")
                self.m_open(by_health=True, new_opening=False)
            elif self.m_state is State.OPEN:
                self.m_by_health = True
            elif self.m_state is State.HALF_OPEN or self.m_health_failures >= self.cfg.health_failure_threshold:
                self.m_open(by_health=True)
        assert self.b.state is self.m_state

    @rule(dt=st.floats(0, 30), until_half_open=st.booleans())
    def wait(self, dt: float, until_half_open: bool) -> None:
        """Time passes: dt seconds, or, while open, just until the open time is over (so that
        half-open periods, and probes outliving a re-open, come up often)."""
        if until_half_open and self.m_state is State.OPEN and not (self.m_by_health and self.m_health_failures > 0):
            due = self.m_opened_at + self.m_open_for()
            assert self.b.reopens_in() == max(0.0, self.m_open_for() - (self.clock.t - self.m_opened_at))
            self.clock.t = max(self.clock.t, due)
            while self.clock.t - self.m_opened_at < self.m_open_for():  # opened_at + open_for rounded down
                self.clock.t = math.nextafter(self.clock.t, math.inf)
            self.m_tick()
            assert self.b.current() is self.m_state is State.HALF_OPEN
            assert self.b.generation == self.m_gen and self.b.probes == 0
            return
        self.clock.t += dt
        self.b.allows()
        self.m_tick()

    # -------------------------------------------------------------- invariants
    @invariant()
    def matches_model(self) -> None:
        b = self.b
        assert b.state is self.m_state
        assert b.generation == self.m_gen
        assert b.openings == self.m_openings
        assert b.open_for() == self.m_open_for() <= self.cfg.max_open_for_s
        # the counters behind the thresholds: consecutive failures while closed (stats() shows them),
        # current-generation successes while half-open; both 0 in the other states
        assert b.failures == (self.m_failures if b.state is State.CLOSED else 0)
        assert b.successes == (self.m_successes if b.state is State.HALF_OPEN else 0)
        if b.state is State.OPEN:
            assert b.opened_at == self.m_opened_at

    @invariant()
    def probes_are_the_current_generations_in_flight(self) -> None:
        # exact: probes of older half-open periods (and requests sent while closed) do not count
        assert self.b.probes == self.m_probes() <= self.cfg.half_open_max
        assert all(0 <= g <= self.m_gen for g in self.outstanding)


TestBreaker = BreakerMachine.TestCase
# more examples than the other machines: hypothesis switches rules off at random per example (swarm
# testing), and the stale-probe paths need send, finish, health and the clock all in one example
TestBreaker.settings = settings(SETTINGS, max_examples=300)


# ---------------------------------------------------------------------------- balancer bookkeeping
URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def config(urls: list[str], draining: set[str] = frozenset(), max_queue: int = 3) -> RouterConfig:
    eps = [{"url": u, "engine": "vllm", "replica": u[-4:], "draining": u in draining} for u in urls]
    return RouterConfig.model_validate(
        {"models": {"m": {"endpoints": eps}}, "router": {"admission": {"max_queue": max_queue, "max_wait_s": 60}}}
    )


class BalancerMachine(RuleBasedStateMachine):
    """Requests start, queue, finish, fail, get cancelled (also just as a slot is handed over) and
    reloads change the fleet: every endpoint's in-flight equals the leases outstanding on it, never < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.urls = URLS[:3]
        self.table = build_table(config(self.urls), clock=self.clock)
        self.bal = Balancer(self.table, LeastLoad(random.Random(0)), self.clock)
        for w in self.table.endpoints.values():
            w.cap = 2  # learned capacity: a third request on an endpoint queues in the router
        self.tasks: list[asyncio.Task[Lease]] = []
        self.held: list[Lease] = []
        self.all_endpoints = {id(w): w for w in self.table.endpoints.values()}
        self.retries: dict[asyncio.Task[Lease], tuple[list, list]] = {}  # task -> (excluded, others)

    def teardown(self) -> None:
        for t in self.tasks:
            t.cancel()
        self.settle()
        self.loop.close()

    def settle(self) -> None:
        for _ in range(5):
            self.loop.run_until_complete(asyncio.sleep(0))
        done = [t for t in self.tasks if t.done()]
        for t in done:
            self.tasks.remove(t)
            excluded, others = self.retries.pop(t, ([], []))
            if not t.cancelled() and t.exception() is None:
                lease = t.result()
                self.held.append(lease)
                if lease.endpoint in excluded:  # back to a failed endpoint only when no other could serve
                    assert not any(w.unavailable_reason() is None and not w.removed for w in others), lease.endpoint.url
            elif not t.cancelled():
                assert isinstance(t.exception(), Rejected)

    @rule()
    def start(self) -> None:
        entry = self.bal.table.models["m"]
        self.tasks.append(self.loop.create_task(self.bal.acquire(entry)))
        self.settle()

    @rule(data=st.data())
    def start_retry(self, data: st.DataObject) -> None:
        """A retry: it avoids the endpoints that failed it while another one is eligible."""
        entry = self.bal.table.models["m"]
        exclude = data.draw(st.lists(st.sampled_from(list(entry.endpoints)), unique=True, max_size=3))
        task = self.loop.create_task(self.bal.acquire(entry, exclude))
        self.tasks.append(task)
        self.retries[task] = (exclude, [w for w in entry.endpoints if w not in exclude])
        self.settle()

    @rule(data=st.data(), outcome=st.sampled_from([True, False, None]))
    @precondition(lambda self: self.held)
    def finish(self, data: st.DataObject, outcome: bool | None) -> None:
        lease = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        lease.release(outcome)
        lease.release(outcome)  # idempotent
        self.settle()

    @rule(data=st.data())
    @precondition(lambda self: self.tasks)
    def cancel_waiting(self, data: st.DataObject) -> None:
        self.tasks[data.draw(st.integers(0, len(self.tasks) - 1))].cancel()
        self.settle()

    @rule(data=st.data())
    @precondition(lambda self: self.held and self.tasks)
    def cancel_right_after_handover(self, data: st.DataObject) -> None:
        """A slot frees, goes to the oldest waiter, whose client leaves before it runs."""
        lease = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        lease.release(True)
        for t in self.tasks:
            t.cancel()
        self.settle()

    @rule(url=st.sampled_from(URLS))
    def break_endpoint(self, url: str) -> None:
        w = self.bal.table.endpoints.get(url)
        if w is not None:
            w.breaker._open()
            self.bal.kick()
            self.settle()

    @rule(
        urls=st.lists(st.sampled_from(URLS), min_size=1, max_size=4, unique=True), drain=st.sets(st.sampled_from(URLS))
    )
    def reload(self, urls: list[str], drain: set[str]) -> None:
        old = self.bal.table
        table = build_table(config(urls, drain), old, clock=self.clock)
        for w in table.endpoints.values():
            if w.cap is None:
                w.cap = 2
            self.all_endpoints[id(w)] = w
        self.bal.swap(table)
        self.settle()

    @rule(dt=st.floats(0, 120))
    def tick(self, dt: float) -> None:
        self.clock.t += dt
        self.bal.kick()
        self.settle()

    @invariant()
    def inflight_matches_leases(self) -> None:
        per: dict[int, int] = {}
        for lease in self.held:
            per[id(lease.endpoint)] = per.get(id(lease.endpoint), 0) + 1
        for wid, w in self.all_endpoints.items():
            assert w.inflight >= 0
            assert w.inflight == per.get(wid, 0), (w.url, w.inflight, per.get(wid, 0))
        assert self.bal.active_leases == len(self.held)

    @invariant()
    def no_waiter_while_a_slot_it_may_take_is_free(self) -> None:
        entry = self.bal.table.models["m"]
        now = self.clock()
        eligible = [w for w in entry.endpoints if w.unavailable_reason() is None]
        free = [w for w in eligible if not w.saturated(now)]
        for waiter in entry.queue.waiters:
            if waiter.fut.done():
                continue
            untried = [w for w in eligible if w not in waiter.exclude]
            assert not any(w not in waiter.exclude or not untried for w in free), [w.url for w in free]


TestBalancer = BalancerMachine.TestCase
TestBalancer.settings = SETTINGS


# ---------------------------------------------------------------------------- reload carry-over
class ReloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.table = build_table(config(URLS[:2]), clock=self.clock)
        self.expected: dict[str, tuple[int, int, float]] = {}
        self.objs = dict(self.table.endpoints)

    @rule(url=st.sampled_from(URLS), n=st.integers(0, 3), f=st.integers(0, 2), rate=st.floats(0, 50))
    def mutate(self, url: str, n: int, f: int, rate: float) -> None:
        w = self.table.endpoints.get(url)
        if w is not None:
            w.inflight, w.breaker.failures, w.drain_rate = n, f, rate

    @rule(
        urls=st.lists(st.sampled_from(URLS), min_size=1, max_size=4, unique=True), drain=st.sets(st.sampled_from(URLS))
    )
    def reload(self, urls: list[str], drain: set[str]) -> None:
        before = {u: (w, w.inflight, w.breaker.failures, w.drain_rate) for u, w in self.table.endpoints.items()}
        retiring = {w.url: w for w in self.table.retired}
        self.table = build_table(config(urls, drain), self.table, clock=self.clock)
        for u, w in self.table.endpoints.items():
            assert w.view.draining == (u in drain)
            assert not w.removed
            if u in before:
                obj, n, f, rate = before[u]
                assert w is obj and (w.inflight, w.breaker.failures, w.drain_rate) == (n, f, rate)
            elif u in retiring:
                assert w is retiring[u]  # came back before it finished draining: same live state
            else:
                assert (w.inflight, w.breaker.state, w.cap, w.drain_rate) == (0, State.CLOSED, None, 0.0)
            self.objs[u] = w
        for u, (obj, *_rest) in before.items():
            if u not in self.table.endpoints:
                assert obj.removed and obj in self.table.retired

    @rule()
    def sweep(self) -> None:
        """What the router's sweeper does: drop retired endpoints with nothing in flight."""
        self.table.retired[:] = [w for w in self.table.retired if w.inflight > 0]

    @invariant()
    def nothing_in_flight_is_forgotten(self) -> None:
        live = set(map(id, self.table.endpoints.values())) | set(map(id, self.table.retired))
        for w in self.objs.values():
            if w.inflight > 0:
                assert id(w) in live
        assert set(self.table.models["m"].endpoints) <= set(self.table.endpoints.values())


TestReload = ReloadMachine.TestCase
TestReload.settings = SETTINGS


def test_a_retry_waits_for_an_untried_endpoint_rather_than_going_back_to_the_one_that_failed() -> None:
    async def go() -> None:
        clock = Clock()
        table = build_table(config(URLS[:2]), clock=clock)
        bal = Balancer(table, LeastLoad(random.Random(0)), clock)
        a, b = table.endpoints[URLS[0]], table.endpoints[URLS[1]]
        a.cap = b.cap = 1
        entry = table.models["m"]
        held_b = bal._pick_now(entry, [a])  # b is busy with a long stream
        assert held_b is not None and held_b.endpoint is b
        # a request failed on a (now free again): its retry must not go back to a while b exists
        assert bal.try_acquire(entry, [a]) is None
        retry = asyncio.ensure_future(bal.acquire(entry, [a]))
        plain = asyncio.ensure_future(bal.acquire(entry))  # a newcomer behind it may still use a
        await asyncio.sleep(0)
        assert not retry.done() and plain.done() and plain.result().endpoint is a
        held_b.release(True)  # b frees up: the retry gets it
        await asyncio.sleep(0)
        assert retry.done() and retry.result().endpoint is b
        retry.result().release(True)
        plain.result().release(True)
        # with b gone (breaker open), a is the only one left: the retry may go back to it
        b.breaker._open()
        lease = await bal.acquire(entry, [a])
        assert lease.endpoint is a
        lease.release(True)
        assert a.inflight == b.inflight == 0

    asyncio.run(go())


def test_what_a_breaker_does_after_its_open_time_does_not_depend_on_whether_anyone_looked() -> None:
    """Open -> half-open is lazy. A failed health check, or a failed request, arriving once
    the open time is over used to count as arriving while open, unless a metrics scrape
    (``current()``) had looked at the breaker first: then it reopened it."""
    for event_ in ("health", "request"):
        outcomes = []
        for looked in (False, True):
            clock = Clock()
            b = Breaker(BreakerConfig(failure_threshold=1, open_for_s=5), clock=clock)
            b.on_result(False, b.on_send())  # opened by a failed request
            clock.t += 6  # its open time is over
            if looked:
                b.current()
            stale = 0  # a request sent while closed, failing now
            if event_ == "health":
                b.on_health(False)
            else:
                b.on_result(False, stale)
            outcomes.append((b.state, b.openings, b.allows(), b.reopens_in()))
        # A request that fails now reopens it for twice as long; a failed health check keeps it
        # open for another period of the same length (no probe failed).
        want = (State.OPEN, 1, False, 5.0) if event_ == "health" else (State.OPEN, 2, False, 10.0)
        assert outcomes[0] == outcomes[1] == want, event_


def test_a_slot_of_an_endpoint_two_models_share_goes_to_the_longest_waiting_request() -> None:
    """One endpoint (room for one) serves models a and b. A b request queued before a stream
    of a requests must get the next free slot: the queues used to be served in the order the
    endpoint lists its models, so while a's queue was never empty, b waited until it timed out."""

    async def go() -> None:
        clock = Clock()
        ep = {"url": URLS[0], "engine": "vllm", "replica": "r0", "max_inflight": 1}
        cfg = RouterConfig.model_validate(
            {
                "models": {"a": {"endpoints": [ep]}, "b": {"endpoints": [ep]}},
                "router": {"admission": {"max_wait_s": 60}},
            }
        )
        table = build_table(cfg, clock=clock)
        bal = Balancer(table, LeastLoad(random.Random(0)), clock)
        a, b = table.models["a"], table.models["b"]
        running = await bal.acquire(a)
        clock.t += 1
        waiting_b = asyncio.ensure_future(bal.acquire(b))
        await asyncio.sleep(0)
        order = []
        for _ in range(3):  # a's queue is kept busy by requests that came after b's
            clock.t += 1
            order.append(asyncio.ensure_future(bal.acquire(a)))
        await asyncio.sleep(0)
        running.release(True)
        await asyncio.sleep(0)
        assert waiting_b.done() and not any(f.done() for f in order)
        waiting_b.result().release(True)  # then a's, in their order
        for f in order:
            await asyncio.sleep(0)
            assert f.done()
            f.result().release(True)
        assert table.endpoints[URLS[0]].inflight == 0

    asyncio.run(go())


def test_an_endpoint_of_unknown_capacity_beside_known_ones_does_not_take_the_whole_burst() -> None:
    """Re-added (or its limit changed), an endpoint has no capacity estimate: never full, it
    took every request the others had no room for, which then waited inside its engine while
    the router's queue stayed empty. It starts at the largest estimate its model's other
    endpoints learned before it came back; at the router's start each learns its own."""

    async def go() -> None:
        clock = Clock()
        table = build_table(config(URLS[:2], max_queue=64), clock=clock)
        warm_a, warm_b = (table.endpoints[u] for u in URLS[:2])
        warm_a.cap = 2  # learned while warm_b has not yet: warm_b does not take it
        bal = Balancer(table, LeastLoad(random.Random(0)), clock)
        entry = table.models["m"]
        probe = bal.try_acquire(entry)
        assert probe is not None and warm_b.cap is None
        probe.release(True)
        warm_b.cap = 2
        clock.t += 60
        table = build_table(config(URLS[:3], max_queue=64), table, clock=clock)  # the third comes back
        bal.swap(table)
        cold = table.endpoints[URLS[2]]
        entry = table.models["m"]
        leases = [lease for _ in range(18) if (lease := bal.try_acquire(entry)) is not None]
        per = [w.inflight for w in (warm_a, warm_b, cold)]
        assert per == [2, 2, 2], per  # the rest wait in the router's queue, not inside one engine
        assert cold.cap == 2  # an estimate like any other: probed upwards from here
        for lease in leases:
            lease.release(True)

    asyncio.run(go())


# ---------------------------------------------------------------------------- the breaker's half-open periods, by example
# (BreakerMachine above: probes outliving re-opens under random interleavings.)


def _half_open(b: Breaker, clock: Clock) -> None:
    b.on_result(False)
    clock.t += b.open_for() + 0.1
    assert b.current() is State.HALF_OPEN


def test_probe_from_before_a_reopen_cannot_close_the_breaker():
    clock = Clock()
    b = Breaker(BreakerConfig(failure_threshold=1, success_threshold=1, open_for_s=1), clock=clock)
    _half_open(b, clock)
    p1 = b.on_send()
    b.on_health(False)  # re-opened while probe 1 is out
    clock.t += 3
    assert not b.allows()  # held open while its health checks fail, past its open time
    b.on_health(True)  # the engine is back: half-open at once, a new period
    assert b.allows()
    p2 = b.on_send()
    assert p1 and p2 and p1 != p2
    b.on_result(True, p1)
    assert b.state is State.HALF_OPEN and b.probes == 1 and not b.allows()
    b.on_result(True, p2)
    assert b.state is State.CLOSED


def test_stale_probe_does_not_free_the_current_probe_slot():
    clock = Clock()
    b = Breaker(BreakerConfig(failure_threshold=1, success_threshold=2, open_for_s=1), clock=clock)
    _half_open(b, clock)
    q1 = b.on_send()
    b.on_health(False)
    clock.t += 3
    b.on_health(True)
    assert b.allows()
    q2 = b.on_send()
    b.on_result(True, q1)
    assert (b.state, b.probes, b.successes) == (State.HALF_OPEN, 1, 0)
    assert not b.allows()  # half_open_max=1 and probe 2 is still out
    b.on_abandon(q1)
    assert b.probes == 1
    b.on_result(True, q2)
    assert (b.state, b.probes, b.successes) == (State.HALF_OPEN, 0, 1)


def test_request_sent_while_closed_does_not_count_as_a_probe_success():
    clock = Clock()
    b = Breaker(BreakerConfig(failure_threshold=2, success_threshold=1, open_for_s=1), clock=clock)
    old = b.on_send()  # a long request, sent while closed
    assert old == 0
    b.on_result(False)
    b.on_result(False)
    clock.t += 2
    probe = b.on_send()
    b.on_result(True, old)
    assert b.state is State.HALF_OPEN and b.probes == 1
    b.on_result(True, probe)
    assert b.state is State.CLOSED


def test_a_breaker_its_failing_health_checks_opened_stays_open_until_one_passes():
    """An engine that stays dead: its breaker read half-open for the moment between the end of
    each open time and the next failed check, so /health flapped between degraded and ok and
    a real request was sent to the dead engine as a probe every few seconds."""
    clock = Clock()
    b = Breaker(BreakerConfig(open_for_s=1, health_failure_threshold=2), clock=clock)
    b.on_health(False)
    b.on_health(False)
    assert b.state is State.OPEN
    for _ in range(20):  # 10 s of failed checks every 0.5 s, the state looked at in between
        clock.t += 0.25
        assert b.current() is State.OPEN and not b.allows()
        assert b.reopens_in() is not None and b.reopens_in() > 0  # Retry-After stays >= 1 s
        clock.t += 0.25
        b.on_health(False)
    assert b.stats()["health_failures"] == 22
    b.on_health(True)  # back: a probe may go at once
    assert b.current() is State.HALF_OPEN and b.allows()


# ---------------------------------------------------------------------------- the admission queue and the balancer's leases, by example


URL = "http://127.0.0.1:9100"


def one_endpoint(max_inflight: int | None = None, max_queue: int = 3) -> RouterConfig:
    ep = {"url": URL, "engine": "vllm", "replica": "r0"}
    if max_inflight is not None:
        ep["max_inflight"] = max_inflight
    return RouterConfig.model_validate(
        {"models": {"m": {"endpoints": [ep]}}, "router": {"admission": {"max_queue": max_queue, "max_wait_s": 60}}}
    )


async def _turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_cancelled_waiters_do_not_count_against_the_queue():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        q = ModelQueue(QueueLimits(max_queue=3, max_wait_s=30))
        futs = [loop.create_future() for _ in range(3)]
        for f in futs:
            q.push(f, 0.0)
        assert len(q) == 3 and not q.has_room()
        futs[1].cancel()  # two clients behind a live head give up
        futs[2].cancel()
        await _turn()
        assert len(q) == 1 and q.has_room()
        assert q.retry_after() == pytest.approx(1.01)  # from 1 waiter, not 3
        assert q.pop_live() is not None and len(q) == 0  # the pops keep the count too
        assert q.pop_live() is None and len(q) == 0

    asyncio.run(main())


def test_balancer_queues_instead_of_429_when_queued_clients_left():
    async def main() -> None:
        clock = Clock()
        table = build_table(one_endpoint(max_inflight=1, max_queue=3), clock=clock)
        bal = Balancer(table, LeastLoad(random.Random(0)), clock)
        entry = table.models["m"]
        held = bal.try_acquire(entry)
        assert held is not None  # the only slot
        head = asyncio.ensure_future(bal.acquire(entry))  # a live waiter at the head
        ghosts = [asyncio.ensure_future(bal.acquire(entry)) for _ in range(2)]
        await _turn()
        for t in ghosts:
            t.cancel()
        await _turn()
        assert len(entry.queue) == 1
        nxt = asyncio.ensure_future(bal.acquire(entry))
        await _turn()
        assert not nxt.done(), nxt.exception() if nxt.done() else None  # queued, not "queue full"
        assert len(entry.queue) == 2 and entry.queue.rejected_full == 0
        held.release(True)
        await _turn()
        (await head).release(True)
        await _turn()
        (await nxt).release(True)
        assert len(entry.queue) == 0 and bal.active_leases == 0

    asyncio.run(main())


def test_lease_carries_the_half_open_generation():
    clock = Clock()
    table = build_table(one_endpoint(), clock=clock)
    bal = Balancer(table, LeastLoad(random.Random(0)), clock)
    entry = table.models["m"]
    w = table.endpoints[URL]
    b = w.breaker
    b.cfg = BreakerConfig(failure_threshold=1, success_threshold=1, open_for_s=1)
    _half_open(b, clock)
    old = bal.try_acquire(entry)
    assert old is not None and old.probe and old.gen == b.generation
    b.on_health(False)
    clock.t += 3
    assert bal.try_acquire(entry) is None  # held open by its failing health checks
    b.on_health(True)
    new = bal.try_acquire(entry)
    assert new is not None and new.probe and new.gen == b.generation != old.gen
    old.release(True)
    assert b.state is State.HALF_OPEN and bal.try_acquire(entry) is None  # probe 2 still out
    new.release(True)
    assert b.state is State.CLOSED and w.inflight == 0 and bal.active_leases == 0


class QueueMachine(RuleBasedStateMachine):
    """Waiters pushed, cancelled, handed a slot, expired: ``len(queue)`` is always the number still waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.q = ModelQueue(QueueLimits(max_queue=4, max_wait_s=10))
        self.futs: list[asyncio.Future] = []

    def teardown(self) -> None:
        self.loop.close()

    def settle(self) -> None:
        self.loop.run_until_complete(asyncio.sleep(0))

    @rule()
    def push(self) -> None:
        if self.q.has_room():
            fut = self.loop.create_future()
            self.q.push(fut, self.now)
            self.futs.append(fut)
        self.settle()

    @rule(data=st.data())
    @precondition(lambda self: self.futs)
    def client_leaves(self, data: st.DataObject) -> None:
        self.futs[data.draw(st.integers(0, len(self.futs) - 1))].cancel()
        self.settle()

    @rule()
    def hand_slot(self) -> None:
        w = self.q.pop_live()
        if w is not None:
            w.fut.set_result(None)
        self.settle()

    @rule(dt=st.floats(0, 15))
    def expire(self, dt: float) -> None:
        self.now += dt
        for w in self.q.expired(self.now):
            w.fut.set_exception(Rejected(429, "queue_timeout", "late"))
            w.fut.exception()  # retrieved: no "never retrieved" warning
        self.settle()

    @invariant()
    def length_is_live_waiters(self) -> None:
        live = sum(not w.fut.done() for w in self.q.waiters)
        assert len(self.q) == live
        assert self.q.has_room() == (live < self.q.limits.max_queue)


TestQueue = QueueMachine.TestCase
TestQueue.settings = SETTINGS


# ---------------------------------------------------------------------------- max_inflight across a reload


def _learn(w, running: int, now: float) -> None:
    w.on_scrape(float(running), 1.0, None, now)  # requests waiting: full at ``running``


@pytest.mark.parametrize("new_limit", [6, None])
def test_reload_raising_or_removing_max_inflight_resets_the_cap(new_limit):
    clock = Clock()
    table = build_table(one_endpoint(max_inflight=2), clock=clock)
    w = table.endpoints[URL]
    _learn(w, 2, clock())
    assert w.cap == 2
    w.inflight = 2
    w.breaker.on_result(False)
    table = build_table(one_endpoint(max_inflight=new_limit), table, clock=clock)
    assert table.endpoints[URL] is w
    assert w.cap == new_limit
    assert not w.saturated(clock())  # a third request may go now
    assert (w.inflight, w.breaker.failures) == (2, 1)  # other live state carried over
    clock.t += 1
    _learn(w, 5, clock())  # learning starts again from the new limit, not from the old readings
    assert w.cap == 5


def test_reload_lowering_max_inflight_and_unchanged_limit():
    clock = Clock()
    table = build_table(one_endpoint(max_inflight=8), clock=clock)
    w = table.endpoints[URL]
    _learn(w, 5, clock())
    table = build_table(one_endpoint(max_inflight=8), table, clock=clock)
    assert w.cap == 5  # same limit: the learned estimate is kept
    table = build_table(one_endpoint(max_inflight=3), table, clock=clock)
    assert w.cap == 3
    _learn(w, 7, clock())
    assert w.cap == 3  # still capped by the configured limit
