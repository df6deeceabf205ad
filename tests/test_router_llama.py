"""The official openai client through the router in front of two real ``llama-server`` processes (CPU).

Skipped when no ``llama-server`` binary is found (see ``tests/llama.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gguf_tiny import make_tiny_gguf
from llama import find_llama_server, free_port, router_config, router_running, run_llama_server
from simengine import LoopThread

from cluster_cli.router.app import Router

pytestmark = pytest.mark.llama
ALIAS = "tiny"
MSG = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str], Router, LoopThread]]:
    if find_llama_server() is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    model = make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(
                run_llama_server(Path(model), port=free_port(), alias=ALIAS, n_parallel=2, n_predict=64)
            )
            for _ in range(2)
        ]
        mapping = {"running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred"}
        cfg = router_config(urls, engines={"llamacpp": {"metrics": mapping}})
        with router_running(cfg) as (base, router, lt):
            yield base, urls, router, lt


def test_openai_client_non_stream_and_stream(routed):
    base, _urls, _router, _lt = routed
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=8)
    assert r.choices[0].message.content and r.usage.completion_tokens == 8
    pieces = [
        ch.choices[0].delta.content
        for ch in c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=8, stream=True)
        if ch.choices
    ]
    assert len([p for p in pieces if p]) >= 2
    t = c.completions.create(model=ALIAS, prompt="hello", max_tokens=4)
    assert t.choices[0].text is not None
    assert [m.id for m in c.models.list()] == [ALIAS]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="other", messages=MSG, max_tokens=2)


def test_both_replicas_serve_and_metrics_are_scraped(routed):
    base, urls, router, lt = routed
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    endpoints = [router.table.endpoints[u] for u in urls]
    # Idle replicas tie, and ties are broken at random: six in a row to one is 1 in 32.
    for _ in range(40):
        c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=2)
        if lt.call(lambda: all(w.completed > 0 for w in endpoints)):
            break
    assert lt.call(lambda: all(w.completed > 0 for w in endpoints))
    lt.wait_for(lambda: all(w.scraped.running is not None for w in endpoints), what="scrapes", timeout=20)
    assert all(w.scraped.kv is None for w in endpoints)  # this llama.cpp exports no KV gauge: unknown
    assert "clusterctl_router_requests_total" in httpx.get(base + "/metrics").text


def test_disconnect_frees_the_llama_slot(routed):
    base, urls, router, lt = routed
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = c.chat.completions.create(model=ALIAS, messages=MSG, max_tokens=4000, stream=True)
    next(iter(stream))
    stream.close()
    lt.wait_for(
        lambda: all(router.table.endpoints[u].inflight == 0 for u in urls), what="router in-flight 0", timeout=20
    )

    def processing() -> float:
        total = 0.0
        for u in urls:
            for line in httpx.get(u + "/metrics", timeout=5).text.splitlines():
                if line.startswith("llamacpp:requests_processing"):
                    total += float(line.split()[-1])
        return total

    for _ in range(200):  # bounded poll: llama-server notices the closed connection at its next token
        if processing() == 0:
            break
        time.sleep(0.05)
    assert processing() == 0
