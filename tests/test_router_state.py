"""Hypothesis state machines: the breaker, the balancer's in-flight bookkeeping, reload carry-over."""

from __future__ import annotations

import asyncio
import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster_cli.router.admission import Rejected
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
class BreakerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.cfg = BreakerConfig(failure_threshold=3, success_threshold=2, open_for_s=5, max_open_for_s=20)
        self.b = Breaker(self.cfg, clock=self.clock)
        self.outstanding: list[bool] = []  # probe flags of requests in flight
        self.consecutive_failures = 0

    @rule()
    def send(self) -> None:
        if self.b.allows():
            self.outstanding.append(self.b.on_send())

    @rule(ok=st.booleans(), data=st.data())
    @precondition(lambda self: self.outstanding)
    def finish(self, ok: bool, data: st.DataObject) -> None:
        probe = self.outstanding.pop(data.draw(st.integers(0, len(self.outstanding) - 1)))
        before = self.b.state
        self.b.on_result(ok, probe)
        if before is State.CLOSED and not ok:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.cfg.failure_threshold:
                assert self.b.state is State.OPEN
        if before is State.HALF_OPEN and not ok:
            assert self.b.state is State.OPEN  # one failure in half-open reopens
        if self.b.state is not State.CLOSED or ok:
            self.consecutive_failures = 0 if (ok or self.b.state is not State.CLOSED) else self.consecutive_failures

    @rule(data=st.data())
    @precondition(lambda self: self.outstanding)
    def abandon(self, data: st.DataObject) -> None:
        probe = self.outstanding.pop(data.draw(st.integers(0, len(self.outstanding) - 1)))
        self.b.on_abandon(probe)

    @rule(ok=st.booleans())
    def health(self, ok: bool) -> None:
        self.b.on_health(ok)
        if self.b.state is not State.CLOSED:
            self.consecutive_failures = 0

    @rule(dt=st.floats(0, 30))
    def tick(self, dt: float) -> None:
        before = self.b.state
        opened_at = self.b.opened_at
        open_for = self.b.open_for()
        self.clock.t += dt
        allowed = self.b.allows()
        if before is State.OPEN:
            if self.clock.t - opened_at < open_for:
                assert not allowed and self.b.state is State.OPEN
            else:
                assert self.b.state is State.HALF_OPEN

    @invariant()
    def probes_bounded(self) -> None:
        b = self.b
        assert 0 <= b.probes <= b.cfg.half_open_max
        if b.state is not State.HALF_OPEN:
            assert b.probes == 0
        assert b.probes <= sum(self.outstanding)

    @invariant()
    def open_time_capped(self) -> None:
        assert self.b.open_for() <= self.cfg.max_open_for_s
        if self.b.state is State.CLOSED:
            assert self.b.openings == 0 and self.b.failures < self.cfg.failure_threshold


TestBreaker = BreakerMachine.TestCase
TestBreaker.settings = SETTINGS


# ---------------------------------------------------------------------------- balancer bookkeeping
URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def config(urls: list[str], draining: set[str] = frozenset(), max_queue: int = 3) -> RouterConfig:
    eps = [{"url": u, "engine": "vllm", "replica": u[-4:], "draining": u in draining} for u in urls]
    return RouterConfig.model_validate(
        {"models": {"m": {"endpoints": eps}}, "router": {"admission": {"max_queue": max_queue, "max_wait_s": 60}}}
    )


class BalancerMachine(RuleBasedStateMachine):
    """Requests start, queue, finish, fail, get cancelled (also just as a slot is handed over) and
    reloads change the fleet: every worker's in-flight equals the leases outstanding on it, never < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.urls = URLS[:3]
        self.table = build_table(config(self.urls), clock=self.clock)
        self.bal = Balancer(self.table, LeastLoad(random.Random(0)), self.clock)
        for w in self.table.workers.values():
            w.cap = 2  # learned capacity: a third request on a worker queues in the router
        self.tasks: list[asyncio.Task[Lease]] = []
        self.held: list[Lease] = []
        self.all_workers = {id(w): w for w in self.table.workers.values()}
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
                if lease.worker in excluded:  # back to a failed endpoint only when no other could serve
                    assert not any(w.unavailable_reason() is None and not w.removed for w in others), lease.worker.url
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
        exclude = data.draw(st.lists(st.sampled_from(list(entry.workers)), unique=True, max_size=3))
        task = self.loop.create_task(self.bal.acquire(entry, exclude))
        self.tasks.append(task)
        self.retries[task] = (exclude, [w for w in entry.workers if w not in exclude])
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
        w = self.bal.table.workers.get(url)
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
        for w in table.workers.values():
            if w.cap is None:
                w.cap = 2
            self.all_workers[id(w)] = w
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
            per[id(lease.worker)] = per.get(id(lease.worker), 0) + 1
        for wid, w in self.all_workers.items():
            assert w.inflight >= 0
            assert w.inflight == per.get(wid, 0), (w.url, w.inflight, per.get(wid, 0))
        assert self.bal.active_leases == len(self.held)

    @invariant()
    def no_waiter_while_a_slot_it_may_take_is_free(self) -> None:
        entry = self.bal.table.models["m"]
        now = self.clock()
        eligible = [w for w in entry.workers if w.unavailable_reason() is None]
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
        self.objs = dict(self.table.workers)

    @rule(url=st.sampled_from(URLS), n=st.integers(0, 3), f=st.integers(0, 2), rate=st.floats(0, 50))
    def mutate(self, url: str, n: int, f: int, rate: float) -> None:
        w = self.table.workers.get(url)
        if w is not None:
            w.inflight, w.breaker.failures, w.drain_rate = n, f, rate

    @rule(
        urls=st.lists(st.sampled_from(URLS), min_size=1, max_size=4, unique=True), drain=st.sets(st.sampled_from(URLS))
    )
    def reload(self, urls: list[str], drain: set[str]) -> None:
        before = {u: (w, w.inflight, w.breaker.failures, w.drain_rate) for u, w in self.table.workers.items()}
        retiring = {w.url: w for w in self.table.retired}
        self.table = build_table(config(urls, drain), self.table, clock=self.clock)
        for u, w in self.table.workers.items():
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
            if u not in self.table.workers:
                assert obj.removed and obj in self.table.retired

    @rule()
    def sweep(self) -> None:
        """What the router's sweeper does: drop retired endpoints with nothing in flight."""
        self.table.retired[:] = [w for w in self.table.retired if w.inflight > 0]

    @invariant()
    def nothing_in_flight_is_forgotten(self) -> None:
        live = set(map(id, self.table.workers.values())) | set(map(id, self.table.retired))
        for w in self.objs.values():
            if w.inflight > 0:
                assert id(w) in live
        assert set(self.table.models["m"].workers) <= set(self.table.workers.values())


TestReload = ReloadMachine.TestCase
TestReload.settings = SETTINGS


def test_a_retry_waits_for_an_untried_endpoint_rather_than_going_back_to_the_one_that_failed() -> None:
    async def go() -> None:
        clock = Clock()
        table = build_table(config(URLS[:2]), clock=clock)
        bal = Balancer(table, LeastLoad(random.Random(0)), clock)
        a, b = table.workers[URLS[0]], table.workers[URLS[1]]
        a.cap = b.cap = 1
        entry = table.models["m"]
        held_b = bal._pick_now(entry, [a])  # b is busy with a long stream
        assert held_b is not None and held_b.worker is b
        # a request failed on a (now free again): its retry must not go back to a while b exists
        assert bal.try_acquire(entry, [a]) is None
        retry = asyncio.ensure_future(bal.acquire(entry, [a]))
        plain = asyncio.ensure_future(bal.acquire(entry))  # a newcomer behind it may still use a
        await asyncio.sleep(0)
        assert not retry.done() and plain.done() and plain.result().worker is a
        held_b.release(True)  # b frees up: the retry gets it
        await asyncio.sleep(0)
        assert retry.done() and retry.result().worker is b
        retry.result().release(True)
        plain.result().release(True)
        # with b gone (breaker open), a is the only one left: the retry may go back to it
        b.breaker._open()
        lease = await bal.acquire(entry, [a])
        assert lease.worker is a
        lease.release(True)
        assert a.inflight == b.inflight == 0

    asyncio.run(go())
