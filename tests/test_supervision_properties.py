"""The supervisor's decisions (``control/supervision.py``) under any sequence of heartbeats,
failures and clock steps: properties, not examples."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_cli.control import supervision as sv

pytestmark = pytest.mark.hypothesis

NODES = ("a", "b", "c", "d", "e")
GRACE, INTERVAL = 30.0, 2.0

# One round: the time step, and per node whether it answered (and its boot id).
rounds = st.lists(
    st.tuples(
        st.floats(0.1, 20.0),
        st.lists(st.tuples(st.booleans(), st.sampled_from(["b1", "b2"])), min_size=len(NODES), max_size=len(NODES)),
    ),
    min_size=1,
    max_size=60,
)


def _play(seq: list[tuple[float, list[tuple[bool, str]]]], *, braked: bool = False):  # type: ignore[no-untyped-def]
    nodes: dict[str, sv.NodeState] = {}
    now = 0.0
    history: list[tuple[float, list[sv.Change]]] = []
    answered_since: dict[str, float | None] = dict.fromkeys(NODES)
    first_miss: dict[str, float | None] = dict.fromkeys(NODES)
    for step, beats in seq:
        now += step
        seen = {n: (ok, boot if ok else None, "" if ok else "x") for n, (ok, boot) in zip(NODES, beats, strict=True)}
        changes = sv.expire(nodes, now, grace_s=GRACE, braked=braked)  # at the tick's start, as supervise does
        changes += sv.observe(nodes, seen, now, interval_s=INTERVAL, grace_s=GRACE, braked=braked)
        for n in seen:
            if nodes[n].state == sv.FENCING:  # the caller fences it at once
                ch = sv.fenced(nodes, n, now, interval_s=INTERVAL, grace_s=GRACE)
                if ch is not None:
                    changes.append(ch)
        history.append((now, changes))
        for n, (ok, _, _) in seen.items():
            if ok:
                answered_since[n] = answered_since[n] if answered_since[n] is not None else now
            else:
                answered_since[n] = None
                first_miss[n] = first_miss[n] if first_miss[n] is not None else now
            if nodes[n].state == sv.READY:
                first_miss[n] = None
    return nodes, history


@settings(max_examples=300, deadline=None)
@given(seq=rounds)
def test_a_node_is_lost_only_after_the_grace_and_never_while_braked(seq) -> None:  # type: ignore[no-untyped-def]
    _, history = _play(seq)
    # When each node last answered while trusted (ready), or was first seen: a flapping node
    # that answers now and then but is never trusted again counts from then (it is damped).
    heard: dict[str, float] = {}
    state = dict.fromkeys(NODES, sv.READY)
    t = 0.0
    for (step, beats), (now, changes) in zip(seq, history, strict=True):
        t += step
        for n, (ok, _) in zip(NODES, beats, strict=True):
            if n not in heard or (ok and state[n] == sv.READY):
                heard[n] = t
        for ch in changes:
            state[ch.node] = ch.new
            if ch.new == sv.LOST:
                assert ch.old == sv.UNREACHABLE
                assert now - heard[ch.node] >= GRACE - 1e-9  # not trusted for a whole grace
            if ch.new == sv.READY and ch.old != sv.READY:
                assert ch.old == sv.FENCING  # never straight from away: fenced first
    _, braked = _play(seq, braked=True)
    assert not any(ch.new == sv.LOST for _, changes in braked for ch in changes)


@settings(max_examples=300, deadline=None)
@given(seq=rounds)
def test_a_node_that_always_answers_stays_ready(seq) -> None:  # type: ignore[no-untyped-def]
    always = [(step, [(True, "b1")] * len(NODES)) for step, _ in seq]
    nodes, history = _play(always)
    assert all(ns.state == sv.READY for ns in nodes.values())
    assert not any(ch.old != ch.new for _, changes in history for ch in changes)


@settings(max_examples=300, deadline=None)
@given(seq=rounds)
def test_every_answer_or_miss_puts_a_node_in_the_state_it_should_be(seq) -> None:  # type: ignore[no-untyped-def]
    nodes, _ = _play(seq)
    last = seq[-1][1]
    for n, (ok, _) in zip(NODES, last, strict=True):
        if ok:
            assert nodes[n].state in (sv.READY, sv.FENCING)  # fencing: damped, not yet trusted
        else:
            assert nodes[n].state in (sv.UNREACHABLE, sv.LOST)


@settings(max_examples=300, deadline=None)
@given(away=st.sets(st.sampled_from(NODES)), share=st.floats(0.1, 1.0))
def test_the_brake_holds_exactly_when_enough_nodes_went_away_together(away: set[str], share: float) -> None:
    nodes = {n: sv.NodeState(since=0.0) for n in NODES}
    sv.observe(nodes, {n: (n not in away, "b", "x") for n in NODES}, 10.0, interval_s=INTERVAL, grace_s=GRACE)
    why = sv.braking(nodes, 10.0, grace_s=GRACE, share=share)
    expect = len(away) == len(NODES) or (len(away) > 1 and len(away) >= share * len(NODES))
    assert (why is not None) == expect


@settings(max_examples=300, deadline=None)
@given(gaps=st.lists(st.floats(0.0, 400.0), min_size=1, max_size=12))
def test_restart_delays_grow_are_capped_and_a_replica_moves_only_after_repeated_failures(gaps: list[float]) -> None:
    r = sv.Restarts()
    now, delays = 0.0, []
    for g in gaps:
        now += g
        sv.failed(r, now, "n1")
        recent = [t for t, _ in r.failures if now - t <= sv.RESTART_WINDOW_S]
        what, wait = sv.next_restart(r, now)
        assert what == ("move" if len(recent) > sv.MOVE_AFTER else "wait")  # just failed: never at once
        if what == "wait":
            assert 0 < wait <= sv.RESTART_MAX_S
            delays.append((len(recent), sv.delay_s(sv.Restarts([(t, "n1") for t in recent]))))
        assert sv.failed_on(r, now) == {"n1"}
    for (n1, d1), (n2, d2) in itertools.pairwise(delays):
        if n2 > n1:
            assert d2 >= d1  # more recent failures: never a shorter wait


def test_healthy_for_the_window_forgets_the_failures() -> None:
    r = sv.Restarts()
    sv.failed(r, 0.0, "n1")
    sv.healthy(r, 10.0)
    sv.healthy(r, 10.0 + sv.RESTART_WINDOW_S)
    assert r.failures == [] and sv.next_restart(r, 700.0) == ("restart", 0.0)


@settings(max_examples=200, deadline=None)
@given(seq=rounds)
def test_one_slow_heartbeat_takes_no_node_out_but_two_in_a_row_do(seq) -> None:  # type: ignore[no-untyped-def]
    nodes = {n: sv.NodeState(since=0.0) for n in NODES}
    now = 0.0
    for step, _ in seq:
        now += step
        sv.observe(nodes, {n: (True, "b", "") for n in NODES}, now, interval_s=INTERVAL, grace_s=GRACE)
    sv.observe(nodes, {n: (False, None, "slow") for n in NODES}, now + 1, interval_s=INTERVAL, grace_s=GRACE,
               timed_out=set(NODES))  # fmt: skip
    assert all(ns.state == sv.READY for ns in nodes.values())
    sv.observe(nodes, {n: (False, None, "slow") for n in NODES}, now + 2, interval_s=INTERVAL, grace_s=GRACE,
               timed_out=set(NODES))  # fmt: skip
    assert all(ns.state == sv.UNREACHABLE for ns in nodes.values())
