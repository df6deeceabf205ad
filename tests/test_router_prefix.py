"""The prefix policy's pieces: prompt normalisation, chained blocks, the bounded index, the
session map, and the policy's decisions (affinity, guard, sessions, caches that are gone)."""

from __future__ import annotations

import io
import json
import logging
import random
import urllib.request

import openai
from helpers import Clock, endpoint, router_config
from hypothesis import given, settings
from hypothesis import strategies as st
from simengine import Fleet

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.affinity import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Affinity,
    PrefixIndex,
    Sessions,
    blocks,
    prompt_text,
)
from cluster_cli.router.balancer import Balancer
from cluster_cli.router.breaker import State
from cluster_cli.router.config import PrefixSpec
from cluster_cli.router.policy import LeastLoad, PrefixAffinity
from cluster_cli.router.registry import build_table

B = 8  # block characters in these tests


# ---------------------------------------------------------------------------- prompts
def test_a_conversation_turn_extends_the_last_ones_text() -> None:
    sys_ = {"role": "system", "content": "You are terse."}
    t1 = [sys_, {"role": "user", "content": "hi"}]
    t2 = [*t1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    a, b = prompt_text(CHAT_PATH, {"messages": t1}), prompt_text(CHAT_PATH, {"messages": t2})
    assert a is not None and b is not None and b.startswith(a)


def test_message_boundaries_and_roles_are_part_of_the_text() -> None:
    one = prompt_text(CHAT_PATH, {"messages": [{"role": "user", "content": "ab"}]})
    two = prompt_text(CHAT_PATH, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    other = prompt_text(CHAT_PATH, {"messages": [{"role": "system", "content": "ab"}]})
    assert len({one, two, other}) == 3


def test_content_parts_and_tools_are_read() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]}
    plain = {"messages": [{"role": "user", "content": "xy"}]}
    assert prompt_text(CHAT_PATH, parts) == prompt_text(CHAT_PATH, plain)
    tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert prompt_text(CHAT_PATH, tools) != prompt_text(CHAT_PATH, plain)


def test_completions_prompts() -> None:
    assert prompt_text(COMPLETIONS_PATH, {"prompt": "abc"}) == "abc"
    assert prompt_text(COMPLETIONS_PATH, {"prompt": ["abc"]}) == "abc"
    assert prompt_text(COMPLETIONS_PATH, {"prompt": [1, 2, 3]}) == "1 2 3"
    assert prompt_text(COMPLETIONS_PATH, {"prompt": ["a", "b"]}) is None  # a batch: no one prefix
    assert prompt_text(CHAT_PATH, {"messages": "x"}) is None
    assert prompt_text(b"/v1/embeddings", {"input": "x"}) is None


# ---------------------------------------------------------------------------- blocks
@given(st.text(max_size=80), st.text(max_size=80))
def test_a_prefix_has_the_first_blocks_of_its_extensions(a: str, b: str) -> None:
    whole = blocks(a + b, B, 1000)
    assert whole[: len(a) // B] == blocks(a, B, 1000)
    assert len(whole) == len(a + b) // B


def test_blocks_differ_once_the_text_does() -> None:
    a, b = blocks("x" * 32, B, 100), blocks("x" * 8 + "y" + "x" * 23, B, 100)
    assert a[0] == b[0] and all(p != q for p, q in zip(a[1:], b[1:], strict=True))  # chained: all later ones differ
    assert len(blocks("x" * 1000, B, 5)) == 5


# ---------------------------------------------------------------------------- the index
@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.text(alphabet="ab", min_size=0, max_size=40), st.sampled_from("uvw")), max_size=30),
    st.text(alphabet="ab", max_size=40),
)
def test_the_index_matches_the_longest_whole_block_prefix_served(served: list[tuple[str, str]], probe: str) -> None:
    """Against a brute force over every prompt each endpoint served (no eviction)."""
    index = PrefixIndex(10_000)
    for text, url in served:
        index.insert(blocks(text, 4, 100), url, 0)
    depth, holders = index.match(blocks(probe, 4, 100), {"u": 0, "v": 0, "w": 0})

    def common(x: str, y: str) -> int:
        n = 0
        while n + 4 <= min(len(x), len(y)) and x[n : n + 4] == y[n : n + 4]:
            n += 4
        return n // 4

    best = {u: max((common(t, probe) for t, v in served if v == u), default=0) for u in "uvw"}
    assert depth == max(best.values())
    assert sorted(holders) == ([] if depth == 0 else sorted(u for u in "uvw" if best[u] == depth))


@given(st.lists(st.text(alphabet="abc", max_size=60), max_size=60), st.integers(1, 20))
def test_the_index_never_holds_more_than_its_bound(texts: list[str], bound: int) -> None:
    index = PrefixIndex(bound)
    for i, t in enumerate(texts):
        index.insert(blocks(t, 4, 100), f"u{i % 3}", 0)
        assert len(index) <= bound


def test_the_most_recent_prompt_survives_eviction_whole() -> None:
    index = PrefixIndex(8)
    rng = random.Random(1)
    for _ in range(100):
        index.insert(blocks("".join(rng.choice("xyz") for _ in range(64)), 8, 100), "u", 0)
    last = blocks("q" * 64, 8, 100)
    index.insert(last, "u", 0)
    assert index.match(last, {"u": 0}) == (8, ["u"])


def test_an_endpoint_in_another_cache_generation_matches_nothing() -> None:
    index = PrefixIndex(100)
    h = blocks("a" * 32, B, 100)
    index.insert(h, "u", 3)
    assert index.match(h, {"u": 3}) == (4, ["u"])
    assert index.match(h, {"u": 4}) == (0, [])
    index.forget(["u"])
    assert index.match(h, {"u": 3}) == (0, []) and len(index) == 0


def test_sessions_are_bounded_least_recently_used() -> None:
    s = Sessions(2)
    s.put("a", "u", 0)
    s.put("b", "v", 0)
    assert s.get("a") == ("u", 0)  # a is now the most recent
    s.put("c", "w", 0)
    assert s.get("b") is None and s.get("a") == ("u", 0) and len(s) == 2


# ---------------------------------------------------------------------------- the policy
SPEC = PrefixSpec(block_chars=B, min_match_chars=16, balance_abs=2, balance_rel=1.5)


def hint(text: str, session: str | None = None) -> Affinity:
    return Affinity("m", blocks(text, B, 1000), session)


def fleet(n: int = 3):
    c = Clock()
    return c, [endpoint(i, c) for i in range(n)], PrefixAffinity(SPEC, random.Random(0))


def test_a_conversation_stays_on_the_replica_holding_it() -> None:
    c, eps, p = fleet()
    text = "system prompt, long enough " * 4
    first = p.select(eps, c(), h := hint(text))
    assert first is not None and h.outcome == "miss"
    for turn in range(5):
        text += f" turn {turn} of the chat"
        h = hint(text)
        assert p.select(eps, c(), h) is first and h.outcome == "matched" and h.matched >= len(blocks(text, B, 1000)) - 3


def test_the_guard_sends_a_request_elsewhere_when_its_replica_is_busy() -> None:
    c, eps, p = fleet()
    text = "a shared prefix of many characters " * 3
    first = p.select(eps, c(), hint(text))
    assert first is not None
    first.inflight = 3  # 3 above the others, not 1.5x of 0: load decides
    h = hint(text + " and more")
    other = p.select(eps, c(), h)
    assert other is not first and h.outcome == "overridden"
    first.inflight = 2  # within balance_abs: affinity holds (against the one replica not holding it)
    third = next(w for w in eps if w is not first and w is not other)
    h = hint(text + " and more")
    assert p.select([first, third], c(), h) is first and h.outcome == "matched"


def test_a_short_match_is_decided_by_load() -> None:
    c, eps, p = fleet()
    p.select(eps, c(), hint("abcdefgh" * 4))
    h = hint("abcdefgh" + "z" * 40)  # one block in common, under min_match_chars
    p.select(eps, c(), h)
    assert h.outcome == "short"


def test_a_session_sticks_to_its_replica_until_it_is_busy() -> None:
    c, eps, p = fleet()
    first = p.select(eps, c(), hint("x" * 40, "s1"))
    for i in range(5):  # unrelated prompts, same session
        h = hint(f"{i}" * 40, "s1")
        assert p.select(eps, c(), h) is first and h.outcome == "session"
    first.inflight = 5
    h = hint("y" * 40, "s1")
    assert p.select(eps, c(), h) is not first


def test_a_replica_whose_cache_is_gone_loses_its_affinity() -> None:
    c, eps, p = fleet()
    text = "the same long prompt again and again"
    first = p.select(eps, c(), hint(text))
    assert first is not None
    for _ in range(first.breaker.cfg.failure_threshold):
        first.breaker.on_result(False)
    assert first.breaker.state is State.OPEN
    first.breaker.state = State.CLOSED  # back at once, a new process: its cache is empty
    h = hint(text)
    p.select(eps, c(), h)
    assert h.outcome == "miss"


def test_without_a_hint_it_is_least_load() -> None:
    c, eps, p = fleet()
    eps[0].inflight, eps[1].inflight = 3, 1
    assert p.select(eps, c(), None) is eps[2]
    assert LeastLoad(random.Random(0)).select(eps, c()) is eps[2]


def test_a_reload_keeps_what_was_learned_and_takes_new_thresholds() -> None:
    models = {"m": {"endpoints": [{"url": f"http://127.0.0.1:{9000 + i}"} for i in range(2)]}}
    cfg = router_config(models, {"policy": "prefix"})
    table = build_table(cfg)
    bal = Balancer(table, PrefixAffinity(cfg.router.prefix))
    bal.configure(cfg)
    p = bal.policy
    assert isinstance(p, PrefixAffinity)
    lease = bal.try_acquire(table.models["m"], (), Affinity("m", blocks("z" * 1024, 64, 100)))
    assert lease is not None and len(p.indexes["m"]) == 16
    cfg2 = router_config(models, {"policy": "prefix", "prefix": {"balance_abs": 9}})
    bal.configure(cfg2)
    assert bal.policy is p and p.spec.balance_abs == 9 and len(p.indexes["m"]) == 16
    bal.configure(router_config({}, {"policy": "prefix"}))  # the model is gone: so is its index
    assert "m" not in p.indexes


def test_a_model_may_have_its_own_policy() -> None:
    models = {
        "m": {"endpoints": [{"url": "http://127.0.0.1:9000"}], "policy": "prefix"},
        "n": {"endpoints": [{"url": "http://127.0.0.1:9001"}]},
    }
    cfg = router_config(models, {"policy": "least_load"})
    bal = Balancer(build_table(cfg), LeastLoad())
    bal.configure(cfg)
    assert bal.policy_for("m").name == "prefix" and bal.policy_for("n").name == "least_load"


# ---------------------------------------------------------------------------- through the router
def _served(f: Fleet) -> list[int]:
    return [e.requests for e in f.engines]


def test_through_the_router_a_conversation_keeps_its_replica_and_others_spread() -> None:
    f = Fleet(3, capacity=8, token_delay_s=0.001, tokens=4).start(
        router={"policy": "prefix", "prefix": {"min_match_chars": 128}}
    )
    try:
        c = openai.OpenAI(base_url=f.base, api_key="x", max_retries=0)
        system = {"role": "system", "content": "You answer in one line. " * 20}
        for conv in range(6):
            msgs = [system, {"role": "user", "content": f"conversation {conv}: first question"}]
            before = _served(f)
            for turn in range(4):
                c.chat.completions.create(model="sim", messages=msgs, max_tokens=4)
                msgs += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": f"turn {turn}"}]
            grew = [a - b for a, b in zip(_served(f), before, strict=True)]
            assert sorted(grew) == [0, 0, 4], f"conversation {conv}: its turns went to {grew}"
        text = urllib.request.urlopen(f.url + "/metrics", timeout=5).read().decode()
        assert 'clusterctl_router_prefix_decisions_total{model="sim",outcome="matched"}' in text
    finally:
        f.close()


def test_through_the_router_a_session_header_keeps_its_replica() -> None:
    f = Fleet(3, capacity=8, token_delay_s=0.001, tokens=2).start(router={"policy": "prefix"})
    try:
        c = openai.OpenAI(base_url=f.base, api_key="x", max_retries=0)
        before = _served(f)
        for i in range(6):  # short prompts, no common prefix: the session alone keeps them together
            c.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": str(i)}], max_tokens=2,
                extra_headers={"X-Session-ID": "agent-7"},
            )  # fmt: skip
        grew = sorted(a - b for a, b in zip(_served(f), before, strict=True))
        assert grew == [0, 0, 6]
        before = _served(f)
        for i in range(6):
            c.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": str(i)}], max_tokens=2, user="u1"
            )
        assert sorted(a - b for a, b in zip(_served(f), before, strict=True)) == [0, 0, 6]
    finally:
        f.close()


def test_at_debug_level_the_access_log_shows_each_decision(caplog) -> None:
    buf = io.StringIO()
    f = Fleet(2, capacity=8, token_delay_s=0.001, tokens=2).start(
        router={"policy": "prefix", "prefix": {"min_match_chars": 64}}, access_log=AccessLog(buf)
    )
    try:
        c = openai.OpenAI(base_url=f.base, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "a question long enough to be matched " * 4}]
        c.chat.completions.create(model="sim", messages=msgs, max_tokens=2)  # not at debug: no field
        with caplog.at_level(logging.DEBUG, logger="clusterctl.router"):
            c.chat.completions.create(model="sim", messages=msgs, max_tokens=2)
        f.lt.call(f.router.access.flush)
        lines = [json.loads(x) for x in buf.getvalue().splitlines() if '"path":"/v1/chat/completions"' in x]
        assert "affinity" not in lines[0]
        assert (
            lines[1]["affinity"].startswith("affinity matched: 128/") and lines[1]["endpoint"] == lines[0]["endpoint"]
        )
        assert any("affinity matched" in r.getMessage() for r in caplog.records)
    finally:
        f.close()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("send"), st.integers(0, 3), st.sampled_from([None, "s1", "s2"])),
            st.tuples(st.just("done"), st.integers(0, 1000), st.none()),
        ),
        max_size=120,
    )
)
def test_concurrent_requests_never_pass_the_guard_for_affinity(ops) -> None:
    """Requests in flight on each replica as they come and go: a replica chosen for its cache
    or session was within the guard of the least loaded one at that moment; the index stays
    within its bound; every choice is one of the candidates."""
    c = Clock()
    eps = [endpoint(i, c) for i in range(3)]
    spec = PrefixSpec(block_chars=B, min_match_chars=16, balance_abs=2, balance_rel=1.5, max_nodes=40)
    p = PrefixAffinity(spec, random.Random(0))
    prompts = ["shared system prompt " * 3 + str(k) * 20 for k in range(4)]
    flight: list = []
    for op, arg, session in ops:
        if op == "done":
            if flight:
                flight.pop(arg % len(flight)).inflight -= 1
            continue
        loads = {w.url: w.load(c()) for w in eps}
        h = hint(prompts[arg], session)
        w = p.select(eps, c(), h)
        assert w in eps
        if h.outcome in ("matched", "session"):
            least = min(loads.values())
            assert loads[w.url] - least <= spec.balance_abs or loads[w.url] <= spec.balance_rel * least
        w.inflight += 1
        flight.append(w)
        assert len(p.indexes["m"]) <= spec.max_nodes


def test_affinity_lost_to_a_full_replica_is_counted_as_full() -> None:
    models = {"m": {"endpoints": [{"url": f"http://127.0.0.1:{9000 + i}", "max_inflight": 1} for i in range(2)]}}
    cfg = router_config(models, {"policy": "prefix"})
    table = build_table(cfg)
    bal = Balancer(table, PrefixAffinity(cfg.router.prefix))
    bal.configure(cfg)
    prompt = "a long shared conversation " * 40
    first = bal.try_acquire(table.models["m"], (), h1 := Affinity("m", blocks(prompt, 64, 100)))
    assert first is not None and h1.outcome == "miss"
    again = bal.try_acquire(table.models["m"], (), h2 := Affinity("m", blocks(prompt + " more", 64, 100)))
    assert again is not None and again.endpoint is not first.endpoint  # the holder is full
    assert h2.outcome == "full" and h2.matched == 0
    first.release(True)
    third = bal.try_acquire(table.models["m"], (), h3 := Affinity("m", blocks(prompt + " more", 64, 100)))
    assert third is not None and h3.outcome == "matched" and third.endpoint is first.endpoint
