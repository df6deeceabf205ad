"""Regressions: ghost waiters filling the admission queue, ``max_inflight`` raised/removed on
reload ignored, and a half-open probe from before a re-open counted in the next half-open period."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from simengine import Fleet

from cluster_cli.router.admission import ModelQueue, QueueLimits, Rejected
from cluster_cli.router.balancer import Balancer
from cluster_cli.router.breaker import Breaker, BreakerConfig, State
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.policy import LeastLoad
from cluster_cli.router.registry import build_table

SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
URL = "http://127.0.0.1:9100"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def config(max_inflight: int | None = None, max_queue: int = 3) -> RouterConfig:
    ep = {"url": URL, "engine": "vllm", "replica": "r0"}
    if max_inflight is not None:
        ep["max_inflight"] = max_inflight
    return RouterConfig.model_validate(
        {"models": {"m": {"endpoints": [ep]}}, "router": {"admission": {"max_queue": max_queue, "max_wait_s": 60}}}
    )


async def _turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


# ---------------------------------------------------------------------------- 1. ghost waiters
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
        table = build_table(config(max_inflight=1, max_queue=3), clock=clock)
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


def test_router_does_not_answer_queue_full_for_clients_that_left():
    f = Fleet(1, capacity=1, token_delay_s=0.01, tokens=1)
    f.start(
        cfg=f.config(router={"admission": {"max_queue": 3, "max_wait_s": 30}}, endpoint_extra={0: {"max_inflight": 1}})
    )
    f.lt.call(lambda: setattr(f.engines[0], "hang", True))
    q = f.router.table.models["sim"].queue
    w = f.router.table.workers[f.engines[0].url]
    body = {"model": "sim", "messages": []}

    def post(timeout: float) -> int | str:
        try:
            return httpx.post(f.base + "/chat/completions", json=body, timeout=timeout).status_code
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:  # the fleet closing under the ones still waiting
            return "closed"

    try:
        for _ in range(2):  # one in the engine (hangs), one live waiter at the head of the queue
            threading.Thread(target=post, args=(30,), daemon=True).start()
        f.lt.wait_for(lambda: w.inflight == 1 and len(q) == 1, what="one in flight, one queued")
        assert post(0.3) == "timeout" and post(0.3) == "timeout"  # two queued clients give up
        f.lt.wait_for(lambda: len(q) == 1, what="the clients that left no longer counted")
        assert post(0.5) == "timeout"  # queued behind the live waiter, not 429 "queue full"
        assert f.lt.call(lambda: q.rejected_full) == 0
    finally:
        f.close()


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


# ---------------------------------------------------------------------------- 5. max_inflight on reload
def _learn(w, running: int, now: float) -> None:
    w.on_scrape(float(running), 1.0, None, now)  # requests waiting: full at ``running``


@pytest.mark.parametrize("new_limit", [6, None])
def test_reload_raising_or_removing_max_inflight_resets_the_cap(new_limit):
    clock = Clock()
    table = build_table(config(max_inflight=2), clock=clock)
    w = table.workers[URL]
    _learn(w, 2, clock())
    assert w.cap == 2
    w.inflight = 2
    w.breaker.on_result(False)
    table = build_table(config(max_inflight=new_limit), table, clock=clock)
    assert table.workers[URL] is w
    assert w.cap == new_limit
    assert not w.saturated(clock())  # a third request may go now
    assert (w.inflight, w.breaker.failures) == (2, 1)  # other live state carried over
    clock.t += 1
    _learn(w, 5, clock())  # learning starts again from the new limit, not from the old readings
    assert w.cap == 5


def test_reload_lowering_max_inflight_and_unchanged_limit():
    clock = Clock()
    table = build_table(config(max_inflight=8), clock=clock)
    w = table.workers[URL]
    _learn(w, 5, clock())
    table = build_table(config(max_inflight=8), table, clock=clock)
    assert w.cap == 5  # same limit: the learned estimate is kept
    table = build_table(config(max_inflight=3), table, clock=clock)
    assert w.cap == 3
    _learn(w, 7, clock())
    assert w.cap == 3  # still capped by the configured limit


# ---------------------------------------------------------------------------- 6. half-open generations
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


def test_lease_carries_the_half_open_generation():
    clock = Clock()
    table = build_table(config(), clock=clock)
    bal = Balancer(table, LeastLoad(random.Random(0)), clock)
    entry = table.models["m"]
    w = table.workers[URL]
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


# Probes outliving re-opens under random interleavings: BreakerMachine in test_router_state.py.


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
