"""Load signals, learned capacity, the policies, half-open probe slots, Retry-After and queue deadlines,
with an injected clock (no I/O)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import pytest
from helpers import Clock, endpoint, router_config

from cluster_cli.engines import MetricMapping
from cluster_cli.router.admission import ModelQueue, QueueLimits, Rejected
from cluster_cli.router.balancer import Balancer, fit_message, no_endpoint
from cluster_cli.router.breaker import BreakerConfig, State
from cluster_cli.router.config import EndpointView
from cluster_cli.router.endpoint import ADMIT_WINDOW_S, Endpoint
from cluster_cli.router.policy import LeastLoad, PowerOfTwo, RoundRobin, make_policy
from cluster_cli.router.registry import adopt_peer_capacity, build_table
from cluster_cli.router.retry import RetryBudget, RetryPolicy


def test_capacity_is_learned_from_waiting_and_probed_upwards():
    c = Clock()
    w = endpoint(0, c)
    w.on_scrape(3, 0, 0.1, c())
    assert w.cap is None and not w.saturated(c())  # never queued: capacity unknown
    w.on_scrape(4, 2, 0.5, c())
    assert w.cap == 4  # requests waited while 4 ran
    w.inflight = 4
    w.on_scrape(4, 0, 0.5, c())
    assert w.cap == 4 and w.saturated(c())
    c.t += 6  # running at the estimate with nothing waiting for a while: try one more
    w.on_scrape(4, 0, 0.5, c())
    assert w.cap == 5
    w.on_scrape(4, 1, 0.5, c())  # the probe did not hold
    assert w.cap == 4
    c.t += 1
    w.on_scrape(2, 1, 0.5, c())  # a momentary queue between scheduler steps: no shrinking
    assert w.cap == 4
    c.t += 31  # the window has passed: the estimate follows what the engine shows now
    w.on_scrape(3, 2, 0.5, c())
    assert w.cap == 3


def send(w: Endpoint, n: int) -> None:
    for _ in range(n):
        w.acquire()


def test_requests_just_sent_and_still_waiting_do_not_make_the_engine_look_full():
    """An engine admits new requests between scheduler steps: a scrape at moderate load
    often shows the router's latest requests waiting with slots free. Only waiting
    beyond what the router sent in the last ADMIT_WINDOW_S shows the engine full."""
    c = Clock()
    w = endpoint(0, c)
    send(w, 3)
    w.on_scrape(2, 2, 0.1, c())  # 2 waiting, 3 sent a moment ago: not a sign of fullness
    assert w.cap is None and not w.saturated(c())
    w.on_scrape(2, 3, 0.1, c())
    assert w.cap is None
    w.on_scrape(2, 4, 0.1, c())  # one more than the router just sent: someone waits for a slot
    assert w.cap == 2
    c.t += ADMIT_WINDOW_S + 0.01  # those sends are no longer recent: waiting means full
    v = endpoint(1, c)
    send(v, 3)
    c.t += ADMIT_WINDOW_S + 0.01
    v.on_scrape(5, 1, 0.1, c())
    assert v.cap == 5


def test_an_estimate_learned_too_low_grows_back_while_only_fresh_requests_wait():
    """The router holds requests back at a low estimate and sends one whenever one ends,
    so the engine always shows that one waiting for its step. With the KV cache far from
    full at the estimate, that must not confirm it: probes grow it, one per probe_s."""
    c = Clock()
    w = endpoint(0, c)  # probe_s 5
    c.t += 1
    w.on_scrape(2, 1, 0.1, c())
    assert w.cap == 2
    caps = [w.cap]
    for _ in range(6):
        for _ in range(10):  # scrapes every 0.5 s, each right after a request was sent
            c.t += 0.5
            send(w, 1)
            w.on_scrape(w.cap - 1, 1, 0.05 * w.cap, c())  # KV: 5% a request, of 20 possible
        caps.append(w.cap)
    assert caps == [2, 3, 4, 5, 6, 7, 8]
    c.t += 1
    w.on_scrape(7, 3, 0.35, c())  # waiting beyond the one just sent: full at 7
    assert w.cap == 7


def test_a_full_engine_at_its_estimate_is_not_probed_past_it():
    """The same pattern on an engine really full at the estimate (its KV cache full there,
    or not exported): the fresh request waiting confirms the estimate; no probe."""
    for kv in (0.75, None):  # 3 of 4 slots: 75%, so 100% at the estimate of 4
        c = Clock()
        w = endpoint(0, c)
        c.t += 1
        w.on_scrape(4, 1, 1.0, c())
        assert w.cap == 4
        caps = set()
        for _ in range(240):  # two minutes: well past CAP_WINDOW_S, so no old reading props it up
            c.t += 0.5
            send(w, 1)
            w.on_scrape(3, 1, kv, c())
            caps.add(w.cap)
        assert caps == {4}  # confirmed at the estimate (3 running + the one just sent), never lowered
    # A configured max_inflight is confirmed the same way, not lowered to what runs.
    c = Clock()
    m = endpoint(1, c, max_inflight=8)
    send(m, 2)
    m.on_scrape(6, 2, None, c())
    assert m.cap == 8


def test_a_probe_holds_only_once_the_engine_runs_that_many() -> None:
    c = Clock()
    w = endpoint(0, c)
    w.on_scrape(8, 1, None, c())
    assert w.cap == 8
    c.t += 6
    w.on_scrape(8, 0, None, c())  # ran at the estimate, nothing waiting: probe one more
    assert w.cap == 9
    c.t += 0.5
    send(w, 1)
    w.on_scrape(8, 1, None, c())  # the ninth waits (for a step, or a slot): not shown to hold
    assert w.cap == 8
    c.t += 0.5
    w.on_scrape(9, 0, None, c())  # it ran nine at once: it can
    assert w.cap == 9
    c.t += 1
    w.on_scrape(8, 2, None, c())  # nine was its most: a full reading of 8 does not undo that
    assert w.cap == 9


def test_the_send_window_starts_when_the_scrape_was_asked_for() -> None:
    """A scrape reads the engine when it asks; its answer may come later. A request sent just
    before the scrape started is excused by when the scrape started, not by when it ended."""
    c = Clock()
    w = endpoint(0, c)
    started = c.t + 0.05
    send(w, 1)
    c.t += 0.3  # the scrape took 0.25 s: the send is older than ADMIT_WINDOW_S by its end
    w.on_scrape(5, 1, None, c(), started)
    assert w.cap is None
    w.on_scrape(5, 1, None, c(), c())  # a scrape that started now: that send is not recent
    assert w.cap == 5


def test_max_inflight_caps_and_unknown_is_not_zero():
    c = Clock()
    w = endpoint(0, c, max_inflight=2)
    w.on_scrape(10, 5, None, c())
    assert w.cap == 2
    w.inflight = 2
    assert w.saturated(c())
    u = endpoint(1, c)
    u.on_scrape(None, None, None, c())
    assert (u.external(c()), u.kv(c())) == (0.0, None)


def test_other_clients_load_counts_only_while_fresh():
    c = Clock()
    w = endpoint(0, c)
    w.inflight = 1
    w.on_scrape(5, 2, None, c())  # 7 on the engine, 1 of them ours
    assert w.load(c()) == 1 + 6
    c.t += 10  # stale: back to our own in-flight count
    assert w.load(c()) == 1


def test_least_load_prefers_free_capacity_and_breaks_ties_at_random():
    c = Clock()
    a, b = endpoint(0, c), endpoint(1, c)
    a.inflight, b.inflight = 3, 1
    pol = LeastLoad(random.Random(1))
    assert pol.select([a, b], c()) is b
    a.cap, b.cap = 8, 2  # with capacities known, load is a share of them: 4/8 < 2/2
    assert pol.select([a, b], c()) is a
    a.inflight = b.inflight = 0
    a.cap = b.cap = None
    picks = Counter(pol.select([a, b], c()).url for _ in range(200))
    assert len(picks) == 2 and min(picks.values()) > 50  # no herd on the first of equals


def test_p2c_and_round_robin():
    c = Clock()
    ws = [endpoint(i, c) for i in range(3)]
    ws[0].inflight = 100
    p = PowerOfTwo(random.Random(3))
    assert ws[0] not in {p.select(ws, c()) for _ in range(50)}  # never wins a pair against an idle one
    rr = RoundRobin()
    assert [rr.select(ws, c()) for _ in range(4)] == [ws[0], ws[1], ws[2], ws[0]]


def test_fit_message_counts_reasons():
    c = Clock()
    ws = [endpoint(0, c, draining=True), endpoint(1, c, draining=True), endpoint(2, c), endpoint(3, c)]
    for w in ws[2:]:
        w.breaker._open()
    assert fit_message(ws) == "0/4 endpoints available: 2 circuit open, 2 draining"


def test_retry_budget_and_backoff():
    b = RetryBudget(RetryPolicy(budget_ratio=0.5, min_retry_concurrency=1))
    assert b.try_acquire(active_requests=0) and not b.try_acquire(active_requests=0)
    assert b.try_acquire(active_requests=4) and b.overflows == 1
    b.release()
    b.release()
    b.release()
    assert b.active == 0
    pol = RetryPolicy(backoff_base_s=0.01, backoff_max_s=0.05)
    assert pol.backoff(1) == 0
    assert all(0.005 <= pol.backoff(2, random.Random(i)) <= 0.015 for i in range(20))
    assert all(pol.backoff(10, random.Random(i)) <= 0.075 for i in range(20))


def test_a_new_engine_behind_the_same_url_starts_unlearned():
    """Reloaded as another engine (or another metric mapping): the old engine's capacity
    estimate and scraped load no longer say anything; live state (in-flight) stays."""
    import dataclasses

    c = Clock()
    w = endpoint(0, c)
    w.on_scrape(2, 3, 0.9, c())
    w.inflight = 1
    assert w.cap == 2 and w.scraped.running == 2
    same = dataclasses.replace(w.view, replica="renamed")
    w.update_view(same, breaker_cfg=BreakerConfig(), stale_s=3.0, probe_s=5.0)
    assert w.cap == 2 and w.scraped.running == 2  # a rename keeps what was learned
    llama = MetricMapping("llamacpp:requests_processing", "llamacpp:requests_deferred", None)
    w.update_view(dataclasses.replace(same, engine="llamacpp", metrics=llama),
                  breaker_cfg=BreakerConfig(), stale_s=3.0, probe_s=5.0)  # fmt: skip
    assert w.cap is None and w.scraped.running is None and w.scraped.at < 0
    assert w.inflight == 1


def test_a_shorter_queue_wait_after_a_reload_applies_to_those_already_waiting():
    import asyncio

    from cluster_cli.router.admission import ModelQueue, QueueLimits

    async def go() -> None:
        loop = asyncio.get_running_loop()
        q = ModelQueue(QueueLimits(max_queue=8, max_wait_s=6.0))
        first = q.push(loop.create_future(), now=0.0)
        q.limits = QueueLimits(max_queue=8, max_wait_s=0.5)  # reloaded
        second = q.push(loop.create_future(), now=0.1)
        assert q.expired(0.45) == []
        assert q.expired(0.55) == [first]  # pushed at 0 with a wait of 0.5 now
        assert q.expired(0.65) == [second]
        q.limits = QueueLimits(max_queue=8, max_wait_s=10.0)  # a longer wait: those queued keep theirs
        third = q.push(loop.create_future(), now=1.0)
        assert third.deadline == 11.0
        for wait in (30.0, 10.0, 30.0, 10.0):  # cuts do not add up: each is from the queueing time
            q.limits = QueueLimits(max_queue=8, max_wait_s=wait)
        assert third.deadline == 11.0
        q.limits = QueueLimits(max_queue=8, max_wait_s=2.0)
        assert third.deadline == 3.0

    asyncio.run(go())


def _scrape_across_a_reload(monkeypatch, reloaded: Callable[[EndpointView], EndpointView]) -> Endpoint:
    """A endpoint whose scrape (answering vLLM's numbers: 2 running, 3 waiting) is in flight
    while its view is replaced by ``reloaded(view)``; returns it once the scrape has landed."""
    import asyncio

    from cluster_cli.router import scrape

    c = Clock()
    w = endpoint(0, c)
    vm = MetricMapping.vllm()
    body = f"{vm.running} 2\n{vm.waiting} 3\n".encode()

    async def go() -> None:
        gate = asyncio.Event()

        async def fetch(host, port, path, timeout):
            await gate.wait()  # in flight while the config is reloaded
            return 200, body

        monkeypatch.setattr(scrape, "fetch", fetch)
        task = asyncio.create_task(scrape.scrape_one(w, 1.0, c))
        await asyncio.sleep(0)
        w.update_view(reloaded(w.view), breaker_cfg=BreakerConfig(), stale_s=3.0, probe_s=5.0)
        gate.set()
        await task

    asyncio.run(go())
    return w


def test_a_scrape_in_flight_when_the_engine_changes_is_dropped(monkeypatch):
    import dataclasses

    llama = MetricMapping("llamacpp:requests_processing", "llamacpp:requests_deferred", None)
    w = _scrape_across_a_reload(monkeypatch, lambda v: dataclasses.replace(v, engine="llamacpp", metrics=llama))
    assert w.cap is None and w.scraped.running is None and w.scraped.error is None  # the old engine's numbers


def test_a_scrape_in_flight_across_a_reload_that_keeps_the_engine_counts(monkeypatch):
    """Every reload builds new (equal) views and metric mappings: that is not a new engine."""
    import dataclasses

    def reloaded(v: EndpointView) -> EndpointView:
        new = dataclasses.replace(v, metrics=MetricMapping.vllm(), replica="renamed")
        assert new.metrics is not v.metrics and new.metrics == v.metrics
        return new

    w = _scrape_across_a_reload(monkeypatch, reloaded)
    assert w.scraped.running == 2 and w.cap == 2


# --------------------------------------------------------------------------- half-open probe slots, Retry-After and the queue


def test_a_probe_that_was_answered_gives_its_slot_back_once() -> None:
    """Half-open with one probe slot: probe A is answered (its slot goes to B), then A ends.
    A's release must not free B's slot too, or a third request would probe alongside B."""
    c = Clock()
    w = endpoint(0, c)
    b = w.breaker
    for _ in range(b.cfg.failure_threshold):
        b.on_result(False)
    c.t += b.open_for() + 0.1
    assert b.current() is State.HALF_OPEN
    cfg = router_config({"m": {"endpoints": [{"url": w.url}]}})
    table = build_table(cfg)
    table.endpoints = {w.url: w}
    table.models["m"].endpoints = [w]
    bal = Balancer(table, make_policy("least_load"), clock=c)
    a = bal.try_acquire(table.models["m"])
    assert a is not None and a.probe and not b.allows()
    a.answered()
    second = bal.try_acquire(table.models["m"])
    assert second is not None and second.probe and b.probes == 1
    a.release(True)
    assert b.probes == 1 and not b.allows()
    second.release(True)


def test_retry_after_is_the_soonest_breaker_and_never_beyond_the_queue_wait() -> None:
    c = Clock()
    soon, late = endpoint(0, c), endpoint(1, c)
    for w, openings in ((soon, 1), (late, 4)):
        w.breaker.openings = openings - 1
        for _ in range(w.breaker.cfg.failure_threshold):
            w.breaker.on_result(False)
    assert soon.breaker.reopens_in() == pytest.approx(5.0) and late.breaker.reopens_in() == pytest.approx(20.0)
    assert no_endpoint([late, soon]).retry_after == pytest.approx(5.0)
    q = ModelQueue(QueueLimits(max_queue=1000, max_wait_s=1.5))
    q.live = 200  # a long queue: Retry-After grows with it, up to the wait a client would get
    assert q.retry_after() == 1.5


def test_queued_requests_get_503_at_once_when_their_last_endpoint_goes() -> None:
    async def scenario() -> None:
        c = Clock()
        cfg = router_config({"m": {"endpoints": [{"url": "http://10.0.0.1:8000", "max_inflight": 1}]}})
        table = build_table(cfg, clock=c)
        bal = Balancer(table, make_policy("least_load"), clock=c)
        entry = table.models["m"]
        held = bal.try_acquire(entry)
        assert held is not None
        waiting = asyncio.ensure_future(bal.acquire(entry))
        await asyncio.sleep(0)
        assert len(entry.queue) == 1
        (w,) = table.endpoints.values()
        for _ in range(w.breaker.cfg.failure_threshold):
            w.breaker.on_result(False)
        bal.kick()
        with pytest.raises(Rejected) as err:
            await asyncio.wait_for(waiting, 1)
        assert (err.value.status, err.value.reason) == (503, "no_endpoint")
        held.release(None)

    asyncio.run(scenario())


def test_queue_deadlines_only_shrink_and_the_deadline_itself_is_expired() -> None:
    q = ModelQueue(QueueLimits(max_queue=8, max_wait_s=5.0))

    class _Fut:
        def done(self) -> bool:
            return False

        def add_done_callback(self, _cb: object) -> None:
            pass

    w = q.push(_Fut(), 0.0)  # type: ignore[arg-type]
    q.limits = QueueLimits(max_queue=8, max_wait_s=30.0)  # longer: the queued keep theirs
    q.limits = QueueLimits(max_queue=8, max_wait_s=10.0)  # shorter than 30, longer than its 5: still 5
    assert w.deadline == 5.0
    assert q.expired(4.999) == [] and q.expired(5.0) == [w]


# --------------------------------------------------------------------------- learned capacity and scraped load across changes


def test_a_re_added_endpoint_starts_at_the_largest_learned_estimate_not_an_operator_limit() -> None:
    c = Clock()
    a, b, new = endpoint(0, c), endpoint(1, c), endpoint(2, c)
    a.cap, b.cap = 4, 8
    adopt_peer_capacity([a, b, new], {new.url})
    assert new.cap == 8
    c2 = Clock()
    a, limited, new = endpoint(0, c2), endpoint(1, c2, max_inflight=16), endpoint(2, c2)
    a.cap, limited.cap = 4, 16
    adopt_peer_capacity([a, limited, new], {new.url})
    assert new.cap == 4


def test_an_engine_showing_less_than_the_router_sent_adds_no_negative_load() -> None:
    c = Clock()
    w = endpoint(0, c)
    w.inflight = 3
    w.on_scrape(0, 0, None, c())  # the scrape raced ahead of our three requests
    assert w.external(c()) == 0.0 and w.load(c()) == 3


def test_a_reload_with_another_metric_mapping_forgets_the_scraped_load() -> None:
    from dataclasses import replace

    from cluster_cli.router.breaker import BreakerConfig

    c = Clock()
    w = endpoint(0, c)
    w.on_scrape(5, 2, 0.5, c())
    llama = MetricMapping.from_config({"running": "llamacpp:requests_processing"})
    w.update_view(replace(w.view, metrics=llama), breaker_cfg=BreakerConfig(), stale_s=3.0, probe_s=5.0)
    assert w.scraped.running is None and w.external(c()) == 0.0
