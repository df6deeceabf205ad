"""A conversation's turns reuse an engine's prompt cache through the router (real ``llama-server``).

Two replicas of the tiny model, each with one slot and no host-memory prompt cache (so that
a turn sent to the other replica finds nothing). Under ``prefix``, every turn after the first
takes the whole previous prompt from its engine's cache (``timings.cache_n``); under
``round_robin`` the turns alternate and each finds at most what its replica saw two turns
before. The engines' own counters reach ``clusterctl_router_engine_cache_hit_ratio``.

Skipped when no ``llama-server`` binary is found (see ``tests/llama.py``).
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gguf_tiny import make_tiny_gguf
from llama import find_llama_server, free_port, router_config, router_running, run_llama_server
from simengine import LoopThread

from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig

pytestmark = pytest.mark.llama
ALIAS = "tiny"
TURNS = 5


def _config(urls: list[str], policy: str) -> RouterConfig:
    return router_config(urls, router={"policy": policy})


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], Router, LoopThread]]:
    if find_llama_server() is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    model = make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(
                run_llama_server(
                    Path(model),
                    port=free_port(),
                    alias=ALIAS,
                    n_parallel=1,
                    ctx=4096,
                    n_predict=8,
                    extra_args=["--cache-ram", "0"],
                )
            )
            for _ in range(2)
        ]
        with router_running(_config(urls, "prefix")) as (base, router, lt):
            yield base, urls, router, lt


def _conversation(c: openai.OpenAI, topic: str) -> list[tuple[int, int]]:
    """(cache_n, prompt tokens) of each turn, as the engine that served it reports them."""
    msgs = [
        {"role": "system", "content": f"You are an assistant for {topic}. " + "Answer briefly and politely. " * 12},
        {"role": "user", "content": f"Tell me about {topic}."},
    ]
    out = []
    for turn in range(TURNS):
        r = c.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=8, temperature=0)
        timings = (r.model_extra or {}).get("timings") or {}
        out.append((int(timings.get("cache_n", -1)), r.usage.prompt_tokens))
        msgs += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"and {turn}?"},
        ]
    return out


def test_a_conversation_finds_its_prompt_in_the_engines_cache(routed) -> None:
    base, urls, router, lt = routed
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    turns = _conversation(c, "gardening")
    assert all(n >= 0 for n, _ in turns), f"llama-server reported no timings.cache_n: {turns}"
    for (cached, _), (_, before) in zip(turns[1:], turns, strict=False):
        assert cached >= before - 1, f"a turn found {cached} of the previous prompt's {before} tokens: {turns}"

    lt.call(lambda: router.reload(_config(urls, "round_robin")))
    rr = _conversation(c, "astronomy")
    reused = sum(n for n, _ in turns[1:]) / sum(p for _, p in turns[1:])
    reused_rr = sum(n for n, _ in rr[1:]) / sum(p for _, p in rr[1:])
    print(f"\nshare of prompt tokens from the cache, turns 2-{TURNS}: prefix {reused:.2f}, round_robin {reused_rr:.2f}")
    assert reused > reused_rr + 0.2

    def ratio() -> float | None:
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        line = next((x for x in text.splitlines() if x.startswith("clusterctl_router_engine_cache_hit_ratio{")), None)
        return float(line.rsplit(" ", 1)[1]) if line else None

    deadline = time.monotonic() + 5
    while (r := ratio()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r is not None and 0 < r < 1
