"""The simulated engine's prefix cache (tests/simengine.py): off by default; when on, cached
prompt tokens (whole 16-token blocks, LRU), prefill time for the rest, usage and counters."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from simengine import LoopThread, SimEngine, prompt_blocks, prompt_of

SYSTEM = "You are a careful assistant. " * 140  # 4,060 characters: ~1,015 tokens


def chat(url: str, messages: list[dict], **extra: object) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra}, timeout=20)
    assert r.status_code == 200
    return r.json()


def conv(user: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = float(value)
    return out


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.close()


def start(lt: LoopThread, **kw: object) -> SimEngine:
    eng = SimEngine(**kw)  # type: ignore[arg-type]
    lt.run(eng.start())
    return eng


def test_prompt_tokens_and_blocks():
    text = prompt_of(b"/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 95}]})
    assert text == "user\n" + "x" * 95 + "\x1e"  # 101 characters: 26 tokens
    tokens, hashes = prompt_blocks(text, 16)
    assert tokens == 26 and len(hashes) == 1
    assert prompt_blocks("y" * 64, 16) == (16, [])  # the last token is always computed: no whole block
    assert prompt_of(b"/v1/completions", {"prompt": ["abc"]}) == "abc"
    a, b = prompt_blocks("a" * 256, 16)[1], prompt_blocks("a" * 192 + "b" * 64 + "c", 16)[1]
    assert a[:3] == b[:3] and a[:3] != prompt_blocks("b" + "a" * 255, 16)[1][:3]  # chained


def test_off_by_default(lt: LoopThread):
    eng = start(lt, token_delay_s=0.001)
    body = chat(eng.url, conv("hi"), stream_options={"include_usage": True})
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    with httpx.stream(
        "POST",
        eng.url + "/v1/chat/completions",
        json={"messages": conv("hi"), "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert not any('"usage"' in ln for ln in r.iter_lines())
    assert not any(k.startswith("vllm:prefix_cache") for k in metrics(eng.url))
    lt.run(eng.stop())


def test_a_repeated_prompt_is_found_in_the_cache(lt: LoopThread):
    eng = start(lt, token_delay_s=0.001, prefix_cache_tokens=100_000)
    first = chat(eng.url, conv("first question"))["usage"]
    tokens = first["prompt_tokens"]
    assert tokens == -(-len(prompt_of(b"chat", {"messages": conv("first question")})) // 4)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    again = chat(eng.url, conv("first question"))["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == (tokens - 1) // 16 * 16
    # Another question after the same system prompt: the system prompt's whole blocks.
    other = chat(eng.url, conv("a different one"))["usage"]
    shared = len("system\n" + SYSTEM + "\x1euser\n")
    assert other["prompt_tokens_details"]["cached_tokens"] == shared // 64 * 16
    m = metrics(eng.url)
    assert m["vllm:prefix_cache_queries_total"] == tokens * 2 + other["prompt_tokens"]
    assert m["vllm:prefix_cache_hits_total"] == (tokens - 1) // 16 * 16 + shared // 64 * 16
    lt.run(eng.stop())


def test_lru_evicts_the_least_recently_used_prompt(lt: LoopThread):
    # Room for two of these prompts exactly: 1,002 tokens each, 62 whole blocks (a one-token
    # reply adds none: prompt and reply 1,006 tokens, 62 blocks too).
    eng = start(lt, token_delay_s=0.001, prefix_cache_tokens=2 * 62 * 16)

    def cached(messages: list[dict]) -> int:
        return chat(eng.url, messages, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"]

    a = [{"role": "user", "content": "A" * 4000}]
    b = [{"role": "user", "content": "B" * 4000}]
    c = [{"role": "user", "content": "C" * 4000}]
    cached(a)
    cached(b)
    assert cached(a) > 900  # a: the most recent now
    cached(c)  # evicts b, not a
    assert cached(a) > 900
    assert cached(b) == 0
    # Now a, then b (c went for b). A prompt of 31 blocks evicts a's last 31: its first 31 still match.
    cached([{"role": "user", "content": "D" * 2000}])
    assert cached(a) == 31 * 16
    lt.run(eng.stop())


def test_the_next_turn_finds_the_reply_cached_too(lt: LoopThread):
    eng = start(lt, token_delay_s=0.001, prefix_cache_tokens=100_000, tokens=40)
    msgs = conv("first question")
    reply = chat(eng.url, msgs, max_tokens=40)["choices"][0]["message"]["content"]
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    u = chat(eng.url, msgs)["usage"]
    before_question = len(prompt_of(b"chat", {"messages": msgs[:-1]}))
    assert u["prompt_tokens_details"]["cached_tokens"] == before_question // 64 * 16
    assert u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] < 16 + 5  # the question and a block
    lt.run(eng.stop())


def ttft(url: str, messages: list[dict]) -> tuple[float, dict]:
    """Seconds to the first content chunk of a stream, and its usage chunk."""
    t0 = time.perf_counter()
    first = None
    usage = None
    body = {"messages": messages, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20) as r:
        lines = []
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                obj = json.loads(ln[6:])
                if first is None and obj["choices"] and obj["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
                if obj.get("usage"):
                    assert obj["choices"] == []
                    usage = obj["usage"]
            lines.append(ln)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    assert first is not None and usage is not None
    return first, usage


def test_uncached_tokens_cost_prefill_time(lt: LoopThread):
    eng = start(lt, token_delay_s=0.005, prefix_cache_tokens=100_000, prefill_ms_per_1k=200.0)
    cold, usage = ttft(eng.url, conv("q"))
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["prompt_tokens"] > 1000
    warm, usage2 = ttft(eng.url, conv("q"))
    assert usage2["prompt_tokens_details"]["cached_tokens"] > 1000
    assert cold >= 0.2  # ~1,020 tokens at 200 ms per 1,000
    assert warm < 0.1, (cold, warm)
    lt.run(eng.stop())


def test_prefill_without_a_cache_counts_every_token_as_processed(lt: LoopThread):
    eng = start(lt, token_delay_s=0.002, prefill_ms_per_1k=100.0, metrics_style="llamacpp")
    _, u1 = ttft(eng.url, conv("q"))
    _, u2 = ttft(eng.url, conv("q"))
    assert u1["prompt_tokens_details"]["cached_tokens"] == u2["prompt_tokens_details"]["cached_tokens"] == 0
    m = metrics(eng.url)
    assert m["llamacpp:prompt_tokens_total"] == u1["prompt_tokens"] * 2
    assert m["llamacpp:prompt_tokens_cached_total"] == 0
    lt.run(eng.stop())


def test_prefills_take_turns_in_chunks_beside_the_decoding(lt: LoopThread):
    """Two long prompts at once: the second's first token waits for both prefills; a stream
    already decoding goes on, its steps as long as the prefill chunk."""
    eng = start(
        lt, token_delay_s=0.005, tokens=400, prefix_cache_tokens=100_000, prefill_ms_per_1k=100.0,
        prefill_chunk_tokens=256,
    )  # fmt: skip
    gaps: list[float] = []

    async def decoder() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", eng.port)
        body = json.dumps({"messages": [{"role": "user", "content": "d"}], "max_tokens": 150, "stream": True})
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
            % (len(body), body.encode())
        )
        last = None
        while True:
            data = await r.read(65536)
            if not data or b"[DONE]" in data:
                break
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        w.close()

    fut = asyncio.run_coroutine_threadsafe(decoder(), lt.loop)
    time.sleep(0.1)
    out: dict[str, float] = {}

    def one(name: str, content: str) -> None:
        out[name] = ttft(eng.url, [{"role": "user", "content": content * 4000}])[0]

    ts = [threading.Thread(target=one, args=(n, n)) for n in ("x", "y")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    fut.result(20)
    # ~1,000 tokens each at 100 ms per 1,000: the first ~0.1 s, the later one ~0.2 s.
    assert min(out.values()) >= 0.09 and max(out.values()) >= 0.19, out
    # 256-token chunks at 100 ms per 1,000: the decoding stream's steps grew to ~26 ms.
    assert max(gaps) >= 0.02 and max(gaps) < 0.08, max(gaps)
    lt.run(eng.stop())


def test_instant_engine_sleeps_its_prefill(lt: LoopThread):
    eng = start(lt, token_delay_s=0.0, prefix_cache_tokens=100_000, prefill_ms_per_1k=200.0)
    t0 = time.perf_counter()
    u = chat(eng.url, conv("q"))["usage"]
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    u2 = chat(eng.url, conv("q"))["usage"]
    warm = time.perf_counter() - t0
    assert u["prompt_tokens_details"]["cached_tokens"] == 0 < u2["prompt_tokens_details"]["cached_tokens"]
    assert cold >= 0.2 and warm < cold / 2, (cold, warm)
    lt.run(eng.stop())


def test_command_line_flags():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sim = Path(__file__).with_name("simengine.py")
    argv = [sys.executable, str(sim), "--port", str(port), "--token-delay-ms", "1", "--prefix-cache-tokens", "5000",
            "--prefill-ms-per-1k", "10", "--cache-block-tokens", "8"]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "simengine did not start"
                time.sleep(0.05)
        chat(url, conv("q"))
        u = chat(url, conv("q"))["usage"]
        assert u["prompt_tokens_details"]["cached_tokens"] == (u["prompt_tokens"] - 1) // 8 * 8
        assert metrics(url)["vllm:prefix_cache_hits_total"] == u["prompt_tokens_details"]["cached_tokens"]
    finally:
        p.terminate()
        p.wait(10)
