"""A stream cut by a killed ``llama-server`` is continued on the other replica (CPU, tiny model).

Two replicas of the tiny model behind the router; a long reply at temperature 0 is streamed
with the official openai client, and the process serving it is killed (SIGKILL) after its
first chunks. The client must read one well-formed stream (one id, one finish_reason, no
exception). Whether the continued text equals an uncut run's is printed, not asserted: the
seam is re-tokenized text, and the model may tokenize it otherwise.

Skipped when no ``llama-server`` binary is found (see ``tests/llama.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gguf_tiny import make_tiny_gguf
from llama import find_llama_server, free_port, router_config, router_running, run_llama_server
from simengine import LoopThread

from cluster_cli.router.app import Router

pytestmark = pytest.mark.llama
ALIAS = "tiny"
MSG = [{"role": "user", "content": "Tell a long story."}]
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int], Router, LoopThread]]:
    """The router's URL, each replica's URL -> its process id, the router and its loop."""
    if find_llama_server() is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    tmp = tmp_path_factory.mktemp("continue")
    model = make_tiny_gguf(tmp / "tiny.gguf")
    pids: dict[str, int] = {}
    try:
        for i in range(2):
            pidfile = tmp / f"pid{i}"
            with run_llama_server(
                Path(model),
                port=free_port(),
                alias=ALIAS,
                n_parallel=1,
                ctx=2048,
                n_predict=MAX_TOKENS,
                log_path=tmp / f"server{i}.log",
                leave_running=pidfile,
            ) as url:
                pids[url] = int(pidfile.read_text().split()[0])
        with router_running(router_config(list(pids))) as (base, router, lt):
            yield base, pids, router, lt
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _stream(c: openai.OpenAI, on_chunk=None) -> tuple[str, list[str], set[str]]:
    """The streamed text, the finish reasons and the ids seen."""
    text, reasons, ids = [], [], set()
    stream = c.chat.completions.create(
        model=ALIAS, messages=MSG, max_tokens=MAX_TOKENS, temperature=0, stream=True, seed=1
    )
    for n, ch in enumerate(stream):
        ids.add(ch.id)
        for choice in ch.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
        if on_chunk is not None:
            on_chunk(n)
    return "".join(text), reasons, ids


def test_a_stream_whose_replica_is_killed_goes_on_elsewhere(replicas) -> None:
    base, pids, router, lt = replicas
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
    whole, reasons, _ = _stream(c)
    assert len(reasons) == 1

    killed: list[str] = []

    def kill_the_server(n: int) -> None:
        if n != 5 or killed:
            return
        busy = lt.call(lambda: [u for u, w in router.table.endpoints.items() if w.inflight])
        assert len(busy) == 1, busy
        os.killpg(pids[busy[0]], signal.SIGKILL)
        killed.append(busy[0])

    text, reasons, ids = _stream(c, kill_the_server)
    assert killed, "the stream ended before its replica could be killed"
    assert len(ids) == 1 and len(reasons) == 1
    resumed = lt.call(lambda: sum(router.metrics._req.resumed.values()))
    print(
        f"\ncontinued stream: {len(text)} chars, finish_reason {reasons[0]}, resumed {resumed};"
        f" equal to the uncut run: {text == whole}"
        + ("" if text == whole else f" (first difference at char {_diff(text, whole)})")
        + f"\n  uncut:     {whole[:80]!r}\n  continued: {text[:80]!r}"
    )
    assert resumed == 1


def _diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
