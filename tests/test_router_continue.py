"""Continuing a cut stream through the router (cluster_cli.router.forward, proxy, resume).

Scripted engines speak vLLM's or llama-server's stream shapes (``test_router_resume.Engine``:
asked to continue, they check the continuation and stream the rest). A script, shared by
the engines of one router, says what each proxied request in turn gets: the whole stream,
a stream cut after some bytes (the connection reset, possibly in the middle of an event),
a stall (the connection held open, silent), a refusal, or an answer held back. The client
must read one stream: one id, the text once, one finish_reason, one [DONE].
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from simengine import LoopThread
from test_router_resume import MESSAGES, PROMPT_TOKENS, TOKENS, Engine, body_for, check_stream, events_of

from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.resume import CHAT_PATH, COMPLETIONS_PATH, LLAMACPP, VLLM

MODEL = "m"  # the scripted engines' model name


@dataclass
class Step:
    """What one proxied request gets. ``cut``: reset after this many bytes of the stream (or of
    a non-streamed body); ``stall``: go silent after this many bytes; ``hold``: answer nothing;
    ``status``: answer this error; ``first_delay``: seconds before the stream's first event."""

    cut: int | None = None
    stall: int | None = None
    hold: bool = False
    status: int | None = None
    first_delay: float = 0.0


@dataclass
class Script:
    steps: list[Step] = field(default_factory=list)
    log: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # (engine, path, body)
    dropped: list[int] = field(default_factory=list)  # engines whose held request's connection was closed

    def next(self, engine: int, path: str, body: dict[str, Any]) -> tuple[Step, int]:
        self.log.append((engine, path, body))
        return (self.steps.pop(0) if self.steps else Step()), len(self.log) - 1


class Scripted:
    """One scripted engine: /health and /metrics answer 200; completions follow the script."""

    def __init__(self, index: int, script: Script, style: str) -> None:
        self.index = index
        self.script = script
        self.engine = Engine(style)
        self.url = ""
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                target = lines[0].split(" ")[1]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                path = target.split("?")[0]
                if path not in (CHAT_PATH, COMPLETIONS_PATH):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
                    continue
                if not await self._answer(reader, writer, path, json.loads(body)):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str, req: dict[str, Any]
    ) -> bool:
        """Answer one request as the script says; False when the connection is done."""
        step, serial = self.script.next(self.index, path, req)
        if step.hold:
            await reader.read()  # until the router closes it
            self.script.dropped.append(self.index)
            return False
        if step.status is not None:
            msg = json.dumps({"error": {"message": "continue_final_message is not supported", "code": 400}})
            writer.write(
                b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (step.status, len(msg), msg.encode())
            )
            return True
        if req.get("stream") is not True:
            text = "".join(TOKENS)
            obj = {
                "id": f"chatcmpl-{serial}",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(TOKENS), "total_tokens": 20},
                "padding": "x" * 2000,  # more than one read
            }
            data = json.dumps(obj).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data))
            if step.cut is not None:
                writer.write(data[: step.cut])
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.transport.abort()
                return False
            writer.write(data)
            return True
        stream = self.engine.stream(req, path, serial)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if step.first_delay:
            await asyncio.sleep(step.first_delay)
        stop = step.cut if step.cut is not None else step.stall
        sent = 0
        for ev in _events(stream):
            if stop is not None and sent + len(ev) > stop:
                if stop > sent:
                    writer.write(b"%x\r\n%b\r\n" % (stop - sent, ev[: stop - sent]))
                await writer.drain()
                await asyncio.sleep(0.05)
                if step.cut is not None:
                    writer.transport.abort()
                else:
                    await reader.read()  # silent until the router gives up on it
                    self.script.dropped.append(self.index)
                return False
            writer.write(b"%x\r\n%b\r\n" % (len(ev), ev))
            await writer.drain()
            await asyncio.sleep(0.001)
            sent += len(ev)
        writer.write(b"0\r\n\r\n")
        return True


def _events(stream: bytes) -> Iterator[bytes]:
    sep = b"\r\n\r\n" if b"\r\n\r\n" in stream else b"\n\n"
    for part in stream.split(sep):
        if part:
            yield part + sep


class Routed:
    """Scripted engines behind a router, on one loop thread."""

    def __init__(self, n: int = 2, style: str = VLLM, router: dict | None = None, model: dict | None = None) -> None:
        self.script = Script()
        self.lt = LoopThread()
        self.engines = [Scripted(i, self.script, style) for i in range(n)]
        for e in self.engines:
            self.lt.run(e.start())
        eps = [{"url": e.url, "engine": style, "replica": f"e{e.index}"} for e in self.engines]
        cfg = {
            "models": {MODEL: {"endpoints": eps, **(model or {})}},
            "router": {"scrape_interval_s": 0.1, "health_interval_s": 0.2, **(router or {})},
        }
        self.router = Router(RouterConfig.model_validate(cfg))
        self.port = self.lt.run(self.router.start("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.port}"

    def stream(self, path: str, body: dict[str, Any]) -> bytes:
        with httpx.stream("POST", self.url + path, json=body, timeout=20) as r:
            assert r.status_code == 200
            return r.read()

    def metric(self, name: str, **labels: str) -> float:
        """A metric's value once the requests in flight are done (summed over other labels)."""
        self.lt.wait_for(lambda: self.router.inflight_total == 0, what="the router's requests to end")
        total = 0.0
        for fam in self.router.metrics.registry.collect():
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def close(self) -> None:
        self.lt.run(self.router.stop(0.5), 15)
        self.lt.close()


@pytest.fixture
def routed() -> Iterator[Any]:
    made: list[Routed] = []

    def make(*args: Any, **kw: Any) -> Routed:
        made.append(Routed(*args, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _first_stream(style: str, path: str, body: dict[str, Any]) -> bytes:
    return Engine(style).stream(body, path, 0)


def _offset(style: str, path: str, body: dict[str, Any], marker: bytes, shift: int = 0) -> int:
    return _first_stream(style, path, body).index(marker) + shift


# ------------------------------------------------------------------ the seam


@pytest.mark.parametrize("style", [VLLM, LLAMACPP])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize("where", ["mid-event", "between-events"])
def test_a_cut_stream_is_continued_on_the_other_replica_as_one_stream(routed, style, path, where) -> None:
    r = routed(style=style)
    body = body_for(path, stream_options={"include_usage": True})
    marker = b'"ld"' if path == CHAT_PATH else b'"text":"ld"'
    cut = _offset(style, path, body, marker)
    if where == "between-events":
        stream = _first_stream(style, path, body)
        cut = stream.rindex(b"data: ", 0, cut)  # just before the event holding "ld"
    r.script.steps = [Step(cut=cut)]
    client = r.stream(path, body)
    text = check_stream(client, path, refused=False, usage=True, usage_required=style == VLLM)
    assert text == "".join(TOKENS)
    (e0, _, first), (e1, _, cont) = r.script.log
    assert e0 != e1, "continued on the replica that failed"
    assert first == body  # the first request goes as the client sent it
    if path == CHAT_PATH:
        assert cont["messages"][:-1] == MESSAGES and cont["messages"][-1]["content"] == "Hello, wör"
        assert cont["continue_final_message"] is True
    assert r.metric("clusterctl_router_requests_resumed_total", model=MODEL) == 1
    assert r.metric("clusterctl_router_seam_seconds_count", model=MODEL) == 1
    assert r.metric("clusterctl_router_responses_cut_total", model=MODEL) == 1


def test_the_usage_adds_up_across_the_seam(routed) -> None:
    r = routed()
    body = body_for(CHAT_PATH, stream_options={"include_usage": True})
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"!\\n\\n"'))]
    evs = events_of(r.stream(CHAT_PATH, body))
    usage = [e["usage"] for e in evs if isinstance(e, dict) and e.get("usage")]
    assert usage == [
        {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(TOKENS), "total_tokens": PROMPT_TOKENS + len(TOKENS)}
    ]


def test_the_openai_client_reads_one_stream(routed) -> None:
    r = routed(n=3)
    body = body_for(CHAT_PATH)
    stream = _first_stream(VLLM, CHAT_PATH, body)
    r.script.steps = [Step(cut=stream.index(b'"lo"') + 2), Step(cut=700)]  # two cuts, two seams
    c = openai.OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=20)
    chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "".join(TOKENS)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]
    assert len({e for e, _, _ in r.script.log}) == 3
    assert r.metric("clusterctl_router_seam_seconds_count") == 2


def test_a_cut_after_the_finish_ends_the_stream_here(routed) -> None:
    r = routed()
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_first_stream(VLLM, CHAT_PATH, body).rindex(b"data: [DONE]"))]
    check_stream(r.stream(CHAT_PATH, body), CHAT_PATH, refused=False)
    assert len(r.script.log) == 1


# ------------------------------------------------------------------ what is not continued


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "n > 1"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "constrained"),
    ],
)
def test_a_request_that_cannot_be_continued_ends_with_the_error_event(routed, extra, why) -> None:
    r = routed()
    body = body_for(CHAT_PATH, **extra)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"'))]
    evs = events_of(r.stream(CHAT_PATH, body))
    err = evs[-1]["error"]  # type: ignore[index]
    assert err["code"] == "upstream_stream_cut" and why in err["message"]
    assert "[DONE]" not in evs and len(r.script.log) == 1


def test_an_engine_that_refuses_the_continuation_ends_the_stream_with_its_reason(routed) -> None:
    r = routed()
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"')), Step(status=400)]
    client = r.stream(CHAT_PATH, body)
    text = check_stream(client, CHAT_PATH, refused=True)
    assert text == "Hello, wör"
    msg = events_of(client)[-1]["error"]["message"]  # type: ignore[index]
    assert "refused the continuation (HTTP 400: continue_final_message is not supported)" in msg
    assert r.metric("clusterctl_router_resume_failures_total", reason="engine_refused") == 1


def test_resume_limit_bounds_the_continuations(routed) -> None:
    body = body_for(CHAT_PATH)
    cut = _offset(VLLM, CHAT_PATH, body, b'"lo"')
    for limit, whole in ((1, False), (2, True)):
        r = routed(n=3, router={"resume_limit": limit})
        r.script.steps = [Step(cut=cut), Step(cut=160)]
        client = r.stream(CHAT_PATH, body)
        check_stream(client, CHAT_PATH, refused=not whole)
        if not whole:
            assert "resume_limit 1" in events_of(client)[-1]["error"]["message"]  # type: ignore[index]
            assert r.metric("clusterctl_router_resume_failures_total", reason="limit") == 1
        assert len(r.script.log) == 2 + whole


def test_the_models_switch_turns_it_off(routed) -> None:
    r = routed(model={"resume": False})
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"'))]
    client = r.stream(CHAT_PATH, body)
    check_stream(client, CHAT_PATH, refused=True)
    assert "off for this model" in events_of(client)[-1]["error"]["message"]  # type: ignore[index]
    assert len(r.script.log) == 1
    assert r.metric("clusterctl_router_resume_failures_total", reason="disabled") == 1
    assert r.metric("clusterctl_router_responses_cut_total") == 1


def test_a_stream_that_could_never_be_continued_counts_as_unsupported(routed) -> None:
    r = routed()
    body = {**body_for(CHAT_PATH), "logprobs": True}
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body_for(CHAT_PATH), b'"ld"'))]
    check_stream(r.stream(CHAT_PATH, body), CHAT_PATH, refused=True)
    assert r.metric("clusterctl_router_resume_failures_total", reason="unsupported") == 1


def test_a_continuation_takes_no_slot_of_the_retry_budget(routed) -> None:
    """A dead node cuts all its streams at once: each continuation replaces lost work, and
    a budget of retries (none at all here) must not refuse them."""
    r = routed(router={"retry": {"budget_ratio": 0.0, "min_retry_concurrency": 0}})
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"'))]
    check_stream(r.stream(CHAT_PATH, body), CHAT_PATH, refused=False)
    assert r.metric("clusterctl_router_requests_resumed_total") == 1


def test_with_no_other_replica_the_stream_ends_with_the_error_event(routed) -> None:
    r = routed(n=1)
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"'))]
    client = r.stream(CHAT_PATH, body)
    check_stream(client, CHAT_PATH, refused=True)
    assert "no other replica" in events_of(client)[-1]["error"]["message"]  # type: ignore[index]
    assert r.metric("clusterctl_router_resume_failures_total", reason="no_endpoint") == 1


# ------------------------------------------------------------------ stalls


def test_a_stream_that_stalls_is_continued_elsewhere(routed) -> None:
    r = routed(router={"limits": {"stall_timeout_s": 0.3}})
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(stall=_offset(VLLM, CHAT_PATH, body, b'"ld"'))]
    t0 = time.monotonic()
    check_stream(r.stream(CHAT_PATH, body), CHAT_PATH, refused=False)
    assert time.monotonic() - t0 < 5
    r.lt.wait_for(lambda: r.script.dropped == [r.script.log[0][0]], what="the stalled request to be dropped")
    assert r.metric("clusterctl_router_seam_seconds_count") == 1


def test_a_long_wait_for_the_first_token_is_no_stall(routed) -> None:
    r = routed(router={"limits": {"stall_timeout_s": 0.2}})
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(first_delay=0.6)]  # a long prefill: silence before the first byte
    check_stream(r.stream(CHAT_PATH, body), CHAT_PATH, refused=False)
    assert len(r.script.log) == 1


# ------------------------------------------------------------------ the rest of the contract


def test_a_non_streamed_answer_cut_midway_is_retried_whole(routed) -> None:
    r = routed()
    r.script.steps = [Step(cut=700)]
    resp = httpx.post(r.url + CHAT_PATH, json={"model": MODEL, "messages": MESSAGES}, timeout=20)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == "".join(TOKENS)
    assert len(r.script.log) == 2 and r.script.log[0][0] != r.script.log[1][0]


def test_a_client_leaving_during_the_seam_cancels_the_continuation(routed) -> None:
    r = routed()
    body = body_for(CHAT_PATH)
    r.script.steps = [Step(cut=_offset(VLLM, CHAT_PATH, body, b'"ld"')), Step(hold=True)]
    with httpx.stream("POST", r.url + CHAT_PATH, json=body, timeout=20) as resp:
        got = b""
        pieces = resp.iter_raw()  # held: a generator dropped would close the connection now
        for piece in pieces:
            got += piece
            if "wör".encode() in got:
                break
        r.lt.wait_for(lambda: len(r.script.log) == 2, what="the continuation to reach the engine")
        assert not r.script.dropped
        pieces.close()
    held = r.script.log[1][0]
    r.lt.wait_for(lambda: r.script.dropped == [held], what="the continuation's connection to be closed")
    r.lt.wait_for(lambda: all(w.inflight == 0 for w in r.router.table.endpoints.values()), what="no request in flight")
