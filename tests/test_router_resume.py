"""Continuing a cut stream on another replica (cluster_cli.router.resume).

A scripted engine streams a fixed answer in vLLM's and llama-server's chunk shapes and, asked
to continue, checks the continuation request (the streamed text as the final assistant
message, or after the prompt; max_tokens reduced) and streams the rest. A stream is cut at
every byte offset, or at random ones over several continuations and random read splits,
and the client's stream must read as one response: one id, the whole text once, one
finish_reason, one [DONE], usage summed across the seams.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from cluster_cli.router.http import sse_error_event
from cluster_cli.router.resume import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    LLAMACPP,
    RESUME_LIMIT,
    VLLM,
    Seam,
    SSEParser,
    StreamState,
    can_resume,
    continuation,
    cut_event,
    ending,
    parse_event,
    refusal,
    upstream_body,
)

TOKENS = ("Hel", "lo", ",", " wör", "ld", "!\n\n", "✓", " done", ".")
PROMPT_TOKENS = 11  # the original request's, as the engine counts them
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
PROMPT = "Say hi:"


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "messages": [dict(m) for m in MESSAGES], **extra}


def completions_body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "stream": True, "prompt": PROMPT, **extra}


def body_for(path: str, **extra: Any) -> dict[str, Any]:
    return chat_body(**extra) if path == CHAT_PATH else completions_body(**extra)


def _tokens_of(prefix: str) -> int:
    """How many of TOKENS make ``prefix``; fails unless it ends at a token boundary."""
    text = ""
    for k, tok in enumerate(TOKENS):
        if text == prefix:
            return k
        text += tok
    assert text == prefix, f"{prefix!r} is not a run of whole tokens"
    return len(TOKENS)


@dataclass(frozen=True)
class Engine:
    """A scripted engine: streams TOKENS (or their rest, when asked to continue them)."""

    style: str  # VLLM or LLAMACPP chunk shapes
    crlf: bool = False  # end lines with CRLF
    group: tuple[int, ...] = ()  # tokens per content chunk, cycled (none: one each)
    usage_on_finish: bool = False  # older llama-server: usage rides on the finish chunk

    def stream(self, body: dict[str, Any], path: str, serial: int) -> bytes:
        return _stream(self, json.dumps(body, sort_keys=True), path, serial)

    def _stream(self, body: dict[str, Any], path: str, serial: int) -> bytes:
        chat = path == CHAT_PATH
        if chat:
            msgs = body["messages"]
            if body.get("continue_final_message"):
                assert body.get("add_generation_prompt") is False
                assert msgs[:-1] == MESSAGES and msgs[-1]["role"] == "assistant"
                prefix = msgs[-1]["content"]
            else:
                assert msgs == MESSAGES
                prefix = ""
        else:
            prompt = body["prompt"][0] if isinstance(body["prompt"], list) else body["prompt"]
            assert prompt.startswith(PROMPT)
            prefix = prompt[len(PROMPT) :]
        assert body["stream"] is True
        k = _tokens_of(prefix)
        rest = list(TOKENS[k:])
        caps = [body[c] for c in ("max_tokens", "max_completion_tokens") if c in body]
        finish = "stop"
        if caps and min(caps) <= len(rest):  # its end-of-text token would be one more
            rest, finish = rest[: min(caps)], "length"
        so = body.get("stream_options") or {}
        include = so.get("include_usage") is True
        vllm = self.style == VLLM
        continuous = vllm and include and so.get("continuous_usage_stats") is True
        timings = not vllm and body.get("timings_per_token") is True
        prompt = PROMPT_TOKENS + k
        ident: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{self.style}-{serial}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1_700_000_000 + serial,
            "model": "m",
        }
        if not vllm:
            ident["system_fingerprint"] = f"b{serial}"

        def usage(done: int) -> dict[str, int]:
            return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

        def choice(piece: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if piece is not None or vllm:
                    delta["content"] = piece if piece is not None else ("" if vllm else None)
                c: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                c = {"index": 0, "text": piece or ""}
            c.update(logprobs=None, finish_reason=reason)
            if vllm:
                c["stop_reason"] = None
            return c

        chunks: list[dict[str, Any]] = []

        def emit(c: dict[str, Any] | None, done: int, final: bool = False) -> None:
            obj: dict[str, Any] = {**ident, "choices": [c] if c is not None else []}
            if continuous:
                obj["usage"] = usage(done)
            if timings or (final and not vllm):
                obj["timings"] = {"prompt_n": 3, "predicted_n": done}
            chunks.append(obj)

        if chat:
            emit(choice(None, None, role=True), 0)
        done = 0
        sizes = self.group or (1,)
        i = 0
        while done < len(rest):
            n = sizes[i % len(sizes)]
            i += 1
            piece = "".join(rest[done : done + n])
            done += len(rest[done : done + n])
            emit(choice(piece, None), done)
        emit(choice("" if vllm else None, finish), done, final=True)
        if include:
            if self.usage_on_finish and not vllm:
                chunks[-1]["usage"] = usage(done)
            else:
                emit(None, done, final=True)
                chunks[-1]["usage"] = usage(done)
        nl = "\r\n" if self.crlf else "\n"
        out = "".join(f"data: {json.dumps(c, ensure_ascii=False, separators=(',', ':'))}{nl}{nl}" for c in chunks)
        return (out + f"data: [DONE]{nl}{nl}").encode()


@functools.lru_cache(maxsize=64)
def _stream(engine: Engine, body: str, path: str, serial: int) -> bytes:
    return engine._stream(json.loads(body), path, serial)


def _event_end(data: bytes) -> int:
    """Offset past the last blank line in ``data`` (how the router's relay holds back a partial event)."""
    a, b = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(a + 2 if a >= 0 else 0, b + 4 if b >= 0 else 0)


def _split(data: bytes, reads: list[int]) -> list[bytes]:
    if not reads:
        return [data] if data else []
    out, i, j = [], 0, 0
    while i < len(data):
        n = reads[j % len(reads)]
        j += 1
        out.append(data[i : i + n])
        i += n
    return out


@dataclass
class Run:
    client: bytes = b""
    refused: str | None = None
    tries: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    state: StreamState = field(default_factory=StreamState)


def drive(
    engine: Engine,
    path: str,
    body: dict[str, Any],
    cuts: list[int],
    reads: list[int] | None = None,
    *,
    raw_first: bool = False,
    limit: int = RESUME_LIMIT,
) -> Run:
    """Relay ``body``'s stream to a client as the router would, cutting the n-th upstream
    response after ``cuts[n]`` bytes (modulo its length + 1) and continuing it elsewhere.

    ``raw_first``: the first upstream gets the client's body and its bytes are relayed as
    sent (whole events only), fed to StreamState; otherwise every upstream goes through a Seam.
    """
    reads = reads or []
    run = Run()
    state = run.state
    request = body if raw_first else upstream_body(body, engine.style)
    seam: Seam | None = None if raw_first else Seam(state, body)
    for serial in range(len(cuts) + 1):
        run.requests.append(request)
        stream = engine.stream(request, path, serial)
        cut = cuts[serial] % (len(stream) + 1) if serial < len(cuts) else None
        data = stream if cut is None else stream[:cut]
        before = len(run.client)
        if seam is None:
            tail = b""
            for piece in _split(data, reads):
                tail += piece
                end = _event_end(tail)
                relayed, tail = tail[:end], tail[end:]
                run.client += relayed
                state.feed(relayed)
            if cut is None and tail:
                run.client += tail
                state.feed(tail + b"\n\n")
        else:
            for piece in _split(data, reads):
                run.client += seam.feed(piece)
            if cut is None:
                run.client += seam.end()
        if cut is None or state.done:
            break
        if not run.client:  # nothing reached the client: an ordinary retry, from scratch
            assert len(run.client) == before
            state = run.state = StreamState()
            seam = None if raw_first else Seam(state, body)
            continue
        closing = seam.close() if seam is not None else ending(state, body)
        if closing:
            run.client += closing
            break
        why = can_resume(body, path, state, run.tries, limit)
        if why is not None:
            run.refused = why
            run.client += cut_event("upstream closed the connection mid-event", why)
            break
        run.tries += 1
        request = continuation(body, path, state, engine.style)
        seam = Seam(state, body)
    return run


def events_of(client: bytes) -> list[dict[str, Any] | str]:
    """The client's stream, parsed independently: each event's JSON object, or "[DONE]"."""
    text = client.replace(b"\r\n", b"\n")
    assert text.endswith(b"\n\n"), "the stream ends in the middle of an event"
    out: list[dict[str, Any] | str] = []
    for block in text[:-2].split(b"\n\n"):
        lines = [ln for ln in block.split(b"\n") if ln]
        assert lines, "an empty event"
        assert all(ln.startswith(b"data: ") for ln in lines), block
        payload = b"\n".join(ln[6:] for ln in lines)
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def check_stream(
    client: bytes,
    path: str,
    *,
    refused: bool,
    cap: int | None = None,
    usage: bool = False,
    continuous: bool = False,
    usage_required: bool = True,
) -> str:
    """Assert the client's stream reads as one response; returns its text."""
    evs = events_of(client)
    generated = TOKENS[:cap] if cap is not None else TOKENS
    expect_finish = "length" if cap is not None and cap <= len(TOKENS) else "stop"
    chunks = [e for e in evs if isinstance(e, dict) and "error" not in e]
    assert chunks, "no chunk reached the client"
    first = chunks[0]
    for c in chunks:
        for key in ("id", "object", "created", "model"):
            assert c[key] == first[key], (key, c, first)
        assert c.get("system_fingerprint") == first.get("system_fingerprint")
    chat = path == CHAT_PATH
    assert first["object"] == ("chat.completion.chunk" if chat else "text_completion")
    pieces: list[str] = []
    finishes: list[str] = []
    roles = 0
    for c in chunks:
        for ch in c["choices"]:
            assert ch["index"] == 0
            piece = ch["delta"].get("content") if chat else ch["text"]
            pieces.append(piece or "")
            roles += bool(chat and ch["delta"].get("role"))
            if ch.get("finish_reason"):
                finishes.append(ch["finish_reason"])
        if "timings" in c:  # llama-server's own final timings only: none asked per token
            assert not c["choices"] or c["choices"][0].get("finish_reason")
    text = "".join(pieces)
    if chat:
        assert roles == 1 and first["choices"][0]["delta"].get("role") == "assistant"
    if refused:
        last = evs[-1]
        assert isinstance(last, dict) and last["error"]["code"] == "upstream_stream_cut"
        assert "[DONE]" not in evs and not finishes
        _tokens_of(text)  # whole tokens: no event was relayed in part
        assert "".join(generated).startswith(text)
        return text
    assert text == "".join(generated), "text repeated or lost at a seam"
    assert finishes == [expect_finish]
    assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in evs)
    assert all("usage" in c for c in chunks if not c["choices"])
    if not usage:
        assert not any("usage" in c for c in chunks)
        return text
    # The final report: its own chunk, or (relayed as an older llama-server sent it) the
    # finish chunk's usage; with continuous usage, every chunk's is a running total.
    reports = [c for c in chunks if "usage" in c and (not c["choices"] or (not continuous and c is not first))]
    assert len(reports) <= 1
    if usage_required:
        assert len(reports) == 1
    if reports:
        assert evs[-2] is reports[0], "the usage comes last, before [DONE]"
        u = reports[0]["usage"]
        assert u["prompt_tokens"] == PROMPT_TOKENS
        assert u["completion_tokens"] == len(generated)
        assert u["total_tokens"] == PROMPT_TOKENS + len(generated)
    running = [c for c in chunks if c["choices"] and "usage" in c and c not in reports]
    if continuous:
        counts = [c["usage"]["completion_tokens"] for c in running]
        assert counts == sorted(counts) and all(c["usage"]["prompt_tokens"] == PROMPT_TOKENS for c in running)
        assert not counts or counts[-1] <= len(generated)
    else:
        assert not running
    return text


ENGINES = [
    Engine(VLLM),
    Engine(LLAMACPP),
    Engine(LLAMACPP, crlf=True, usage_on_finish=True),
    Engine(VLLM, crlf=True),
]


# ------------------------------------------------------------------ the parser


def test_events_split_anywhere_come_out_whole_and_in_order() -> None:
    stream = Engine(LLAMACPP, crlf=True).stream(chat_body(), CHAT_PATH, 0) + b": keep-alive\n\n"
    whole = SSEParser().feed(stream)
    assert b"".join(whole) == stream
    for size in (1, 2, 3, 7, 64):
        p = SSEParser()
        got = [ev for piece in _split(stream, [size]) for ev in p.feed(piece)]
        assert got == whole
        assert p.remainder() == b""


@given(
    parts=st.lists(st.sampled_from([b"data: x", b"\n", b"\r\n", b"\r", b": c", b"data: [DONE]"]), max_size=30),
    reads=st.lists(st.integers(1, 9), max_size=4),
)
def test_the_parser_loses_no_byte_however_the_reads_fall(parts: list[bytes], reads: list[int]) -> None:
    data = b"".join(parts)
    p = SSEParser()
    events = [ev for piece in _split(data, reads) for ev in p.feed(piece)]
    assert events == SSEParser().feed(data)
    assert b"".join(events) + p.remainder() == data
    for ev in events:  # each ends with a blank line, and holds no other
        body = ev.replace(b"\r\n", b"\n")
        assert body.endswith(b"\n") and (body == b"\n" or body.endswith(b"\n\n"))
        assert b"\n\n" not in body[:-2]


def test_an_event_without_its_blank_line_is_held_until_the_end() -> None:
    p = SSEParser()
    assert p.feed(b'data: {"a":1}\n\ndata: [DO') == [b'data: {"a":1}\n\n']
    assert p.feed(b"NE]\n") == []
    assert p.remainder() == b"data: [DONE]\n"


def test_events_are_classified_as_the_engines_send_them() -> None:
    assert parse_event(b"data: [DONE]\r\n\r\n").kind == "done"
    assert parse_event(b": ping\n\n").kind == "other"
    assert parse_event(b"\n").kind == "blank"
    assert parse_event(b'error: {"code":500,"message":"x"}\n\n').kind == "error"  # llama-server
    assert parse_event(b'data: {"error":{"message":"x"}}\n\n').kind == "error"
    assert parse_event(b'data: {"object":"error","message":"x"}\n\n').kind == "error"  # vLLM
    assert parse_event(b"data: not json\n\n").kind == "unreadable"
    ev = parse_event(b'data:{"choices":[]}\n\n')
    assert ev.kind == "chunk" and ev.obj == {"choices": []}


# ------------------------------------------------------------------ the state


@pytest.mark.parametrize("engine", ENGINES, ids=repr)
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_the_state_of_a_whole_stream(engine: Engine, path: str) -> None:
    state = StreamState()
    state.feed(engine.stream(body_for(path, stream_options={"include_usage": True}), path, 7))
    assert state.text == "".join(TOKENS) and state.tokens == len(TOKENS)
    assert state.finish_reason == "stop" and state.done and state.usage_sent
    assert state.prompt_tokens == PROMPT_TOKENS and state.unresumable is None
    assert state.id is not None and state.id.endswith("-7") and state.model == "m"
    assert state.role_sent == (path == CHAT_PATH)


def test_engine_counts_keep_tokens_right_when_a_chunk_holds_several() -> None:
    engine = Engine(VLLM, group=(3, 1, 2))
    body = upstream_body(chat_body(), VLLM)
    stream = engine.stream(body, CHAT_PATH, 0)
    state = StreamState()
    seam = Seam(state, chat_body())
    seam.feed(stream[: stream.index(b'"content":"ld')])  # chunks "Hello," and " wör"
    assert state.text == "Hello, wör" and state.tokens == 4  # two chunks, four tokens

    plain = StreamState()  # no engine counts: one token per chunk, a lower bound
    bare = engine.stream(chat_body(), CHAT_PATH, 0)
    plain.feed(bare[: bare.index(b'"content":"ld')])
    assert plain.text == "Hello, wör" and plain.tokens == 2


def test_llama_server_timings_count_tokens_too() -> None:
    engine = Engine(LLAMACPP, group=(2,))
    body = upstream_body(completions_body(), LLAMACPP)
    assert body["timings_per_token"] is True and "continuous_usage_stats" not in body["stream_options"]
    stream = engine.stream(body, COMPLETIONS_PATH, 0)
    state = StreamState()
    out = Seam(state, completions_body()).feed(stream[: stream.index(b'"text":"ld!')])
    assert state.text == "Hello, wör" and state.tokens == 4
    assert b"timings" not in out and b"usage" not in out  # asked for by the router, not the client


# ------------------------------------------------------------------ continuation bodies


def test_a_chat_continuation_asks_to_continue_the_streamed_text() -> None:
    body = chat_body(max_tokens=20, max_completion_tokens=30, min_tokens=4, stream_options={"include_usage": False})
    state = StreamState()
    stream = Engine(VLLM).stream(body, CHAT_PATH, 0)
    state.feed(stream[: stream.index(b'"content":"ld"')])
    assert state.text == "Hello, wör" and state.tokens == 4
    assert can_resume(body, CHAT_PATH, state, 0, 3) is None
    new = continuation(body, CHAT_PATH, state, VLLM)
    assert new["messages"] == [*MESSAGES, {"role": "assistant", "content": "Hello, wör"}]
    assert new["continue_final_message"] is True and new["add_generation_prompt"] is False
    assert (new["max_tokens"], new["max_completion_tokens"], new["min_tokens"]) == (16, 26, 0)
    assert new["stream"] is True
    assert new["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == MESSAGES and body["max_tokens"] == 20  # the client's body is kept
    assert body["stream_options"] == {"include_usage": False}


def test_a_clients_own_prefill_is_extended_not_repeated() -> None:
    prefill = {"role": "assistant", "content": "Sure: "}
    body = chat_body(continue_final_message=True, add_generation_prompt=False)
    body["messages"].append(prefill)
    state = StreamState()
    state.feed(
        b'data: {"id":"a","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"ok"}}]}\n\n'
    )
    new = continuation(body, CHAT_PATH, state, LLAMACPP)
    assert new["messages"][-1] == {"role": "assistant", "content": "Sure: ok"}
    assert len(new["messages"]) == 3 and new["timings_per_token"] is True
    assert body["messages"][-1] is not new["messages"][-1] and prefill["content"] == "Sure: "


def test_a_completions_continuation_extends_the_prompt() -> None:
    for prompt in (PROMPT, [PROMPT]):
        body = completions_body(prompt=prompt, max_tokens=9)
        state = StreamState()
        stream = Engine(LLAMACPP).stream(body, COMPLETIONS_PATH, 0)
        state.feed(stream[: stream.index(b'"text":","')])
        new = continuation(body, COMPLETIONS_PATH, state, LLAMACPP)
        assert new["prompt"] == (PROMPT + "Hello" if isinstance(prompt, str) else [PROMPT + "Hello"])
        assert new["max_tokens"] == 7


def test_nothing_streamed_yet_continues_as_the_request_itself() -> None:
    state = StreamState()
    state.feed(b": ping\n\n")
    body = chat_body(max_tokens=5)
    assert can_resume(body, CHAT_PATH, state, 0, 3) is None
    new = continuation(body, CHAT_PATH, state, VLLM)
    assert new["messages"] == MESSAGES and new["max_tokens"] == 5 and "continue_final_message" not in new


def test_upstream_body_leaves_a_plain_request_alone() -> None:
    body = {"model": "m", "messages": MESSAGES}
    assert upstream_body(body, VLLM) is body
    assert upstream_body({**body, "stream": True}, "sglang")["stream_options"] == {"include_usage": True}


# ------------------------------------------------------------------ every cut


def _cases() -> list[tuple[Engine, str, dict[str, Any], bool]]:
    out = []
    for engine in ENGINES[:3]:  # vLLM's CRLF variant adds nothing a cut at every byte would find
        for path in (CHAT_PATH, COMPLETIONS_PATH):
            for opts in ({}, {"stream_options": {"include_usage": True}}):
                for raw_first in (False, True):
                    out.append((engine, path, opts, raw_first))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "path", "opts", "raw_first"), _cases())
def test_a_stream_cut_at_every_byte_reads_as_one_stream(
    engine: Engine, path: str, opts: dict[str, Any], raw_first: bool
) -> None:
    body = body_for(path, **opts)
    first = upstream_body(body, engine.style) if not raw_first else body
    size = len(engine.stream(first, path, 0))
    usage = bool(opts)
    for cut in range(size + 1):
        run = drive(engine, path, body, [cut], raw_first=raw_first)
        # The engine reports prompt tokens on every chunk only when the router asked (vLLM);
        # otherwise a cut between the finish and the usage chunk leaves them unknown.
        check_stream(
            run.client, path, refused=False, usage=usage, usage_required=not raw_first and engine.style == VLLM
        )
        assert run.tries == (0 if run.state.segment == 0 else 1)


def test_a_cut_just_before_done_ends_the_stream_without_another_engine() -> None:
    body = chat_body(stream_options={"include_usage": True})
    engine = Engine(VLLM)
    stream = engine.stream(upstream_body(body, VLLM), CHAT_PATH, 0)
    run = drive(engine, CHAT_PATH, body, [stream.rindex(b"data: [DONE]")])
    assert run.tries == 0 and len(run.requests) == 1
    check_stream(run.client, CHAT_PATH, refused=False, usage=True)


def test_a_stream_that_used_its_max_tokens_is_finished_here() -> None:
    body = chat_body(max_tokens=4, stream_options={"include_usage": True})
    engine = Engine(VLLM)
    stream = engine.stream(upstream_body(body, VLLM), CHAT_PATH, 0)
    cut = stream.index(b'"finish_reason":"length"')  # 4 tokens relayed, no finish yet
    run = drive(engine, CHAT_PATH, body, [cut])
    assert run.tries == 0
    assert check_stream(run.client, CHAT_PATH, refused=False, cap=4, usage=True) == "Hello, wör"


def test_llama_server_after_a_seam_reports_the_original_prompt() -> None:
    body = chat_body(stream_options={"include_usage": True})
    engine = Engine(LLAMACPP)
    run = drive(engine, CHAT_PATH, body, [300], raw_first=True)
    assert run.tries == 1
    check_stream(run.client, CHAT_PATH, refused=False, usage=True)


# ------------------------------------------------------------------ random cuts, reads and limits


@settings(max_examples=300)
@given(
    engine=st.sampled_from([*ENGINES, Engine(VLLM, group=(2, 1, 3)), Engine(LLAMACPP, group=(1, 4))]),
    path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]),
    usage=st.sampled_from(["none", "final", "continuous"]),
    cap=st.one_of(st.none(), st.integers(1, len(TOKENS) + 2)),
    cap_key=st.sampled_from(["max_tokens", "max_completion_tokens"]),
    cuts=st.lists(st.integers(0, 10**6), max_size=RESUME_LIMIT + 1),
    reads=st.lists(st.integers(1, 80), max_size=5),
    raw_first=st.booleans(),
)
def test_random_cuts_and_reads_read_as_one_stream(
    engine: Engine,
    path: str,
    usage: str,
    cap: int | None,
    cap_key: str,
    cuts: list[int],
    reads: list[int],
    raw_first: bool,
) -> None:
    if raw_first and engine.group:
        raw_first = False  # counted per chunk, several-token chunks undercount (the documented caveat)
    opts: dict[str, Any] = {}
    if usage != "none":
        opts["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage == "continuous"}
    if cap is not None:
        opts[cap_key] = cap
    body = body_for(path, **opts)
    run = drive(engine, path, body, cuts, reads, raw_first=raw_first)
    event(f"continued {run.tries} times" + (", then refused" if run.refused else ""))
    continuous = usage == "continuous"
    check_stream(
        run.client,
        path,
        refused=run.refused is not None,
        cap=cap,
        usage=usage != "none",
        continuous=continuous,
        usage_required=not raw_first and engine.style == VLLM,
    )
    if run.refused is not None:
        assert run.tries == RESUME_LIMIT and "resume_limit 3" in run.refused
    assert run.tries <= RESUME_LIMIT
    for request in run.requests[1:]:  # every continuation asks for no more than is left
        if cap is not None:
            assert request[cap_key] >= 1
    assert body == body_for(path, **opts)  # never modified


# ------------------------------------------------------------------ refusals


def _cut_state(body: dict[str, Any], path: str = CHAT_PATH, stream: bytes | None = None) -> StreamState:
    state = StreamState()
    stream = stream if stream is not None else Engine(VLLM).stream(body, path, 0)
    state.feed(stream[: _event_end(stream[: len(stream) // 2])])
    return state


@pytest.mark.parametrize(
    ("extra", "path", "reason"),
    [
        ({"n": 2}, CHAT_PATH, "n > 1"),
        ({"logprobs": True, "top_logprobs": 2}, CHAT_PATH, "logprobs"),
        ({"logprobs": 0}, COMPLETIONS_PATH, "logprobs"),
        ({"echo": True}, COMPLETIONS_PATH, "echo"),
        ({"best_of": 3}, COMPLETIONS_PATH, "best_of"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, CHAT_PATH, "constrained"),
        ({"guided_regex": "a+"}, COMPLETIONS_PATH, "constrained"),
        ({"prompt": [PROMPT, PROMPT]}, COMPLETIONS_PATH, "several prompts"),
        ({"prompt": [1, 2, 3]}, COMPLETIONS_PATH, "token ids"),
    ],
)
def test_what_cannot_be_continued_faithfully_is_refused(extra: dict[str, Any], path: str, reason: str) -> None:
    state = _cut_state(body_for(path), path)
    assert state.text and not state.finished
    body = body_for(path, **extra)
    why = can_resume(body, path, state, 0, 3)
    assert why is not None and reason in why


def test_limits_switches_and_paths_are_refused() -> None:
    body = chat_body()
    state = _cut_state(body)
    assert can_resume(body, CHAT_PATH, state, 0, 3) is None
    assert can_resume(body, b"/v1/chat/completions", state, 2, 3) is None
    assert "resume_limit 3" in (can_resume(body, CHAT_PATH, state, 3, 3) or "")
    assert "resume_limit 0" in (can_resume(body, CHAT_PATH, state, 0, 0) or "")
    assert "off for this model" in (can_resume(body, CHAT_PATH, state, 0, 3, enabled=False) or "")
    assert "only chat" in (can_resume(body, "/v1/embeddings", state, 0, 3) or "")
    assert "not a stream" in (can_resume({**body, "stream": False}, CHAT_PATH, state, 0, 3) or "")
    assert "max_tokens" in (can_resume({**body, "max_tokens": state.tokens}, CHAT_PATH, state, 0, 3) or "")


def _chunk(delta: dict[str, Any], **choice: Any) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, **choice}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (_chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a'}}]}), "tool call"),
        (_chunk({"content": "x"}, logprobs={"content": []}), "logprobs"),
        (_chunk({"reasoning_content": "hmm"}), "reasoning"),
        (_chunk({"reasoning": "hmm"}), "reasoning"),
        (b'data: {"id":"x","choices":[{"index":1,"delta":{"content":"y"}}]}\n\n', "several choices"),
        (b'error: {"code":500,"message":"boom"}\n\n', "error"),
        (b"data: {truncated\n\n", "cannot read"),
    ],
)
def test_what_the_stream_showed_can_refuse_it(event: bytes, reason: str) -> None:
    body = chat_body()
    state = StreamState()
    state.feed(_chunk({"role": "assistant", "content": ""}) + _chunk({"content": "Hi"}) + event)
    why = can_resume(body, CHAT_PATH, state, 0, 3)
    assert why is not None and reason in why


def test_an_engine_that_rejects_the_continuation_mid_stream_ends_it_with_its_error() -> None:
    body = chat_body()
    engine = Engine(VLLM)
    stream = engine.stream(upstream_body(body, VLLM), CHAT_PATH, 0)
    state = StreamState()
    client = Seam(state, body).feed(stream[: _event_end(stream[:400])])
    assert can_resume(body, CHAT_PATH, state, 0, 3) is None
    seam = Seam(state, body)
    client += seam.feed(b'data: {"object":"error","message":"continue_final_message is not supported"}\n\n')
    assert client.endswith(b'is not supported"}\n\n') and seam.end() == b""
    assert "error" in (can_resume(body, CHAT_PATH, state, 1, 3) or "")


def test_the_error_event_is_the_routers_cut_event() -> None:
    cause = "upstream closed the connection mid-event"
    assert cut_event(cause) == sse_error_event(f"the upstream stream was cut: {cause}", "upstream_stream_cut")
    ev = parse_event(cut_event(cause, "n > 1: several choices cannot be continued"))
    assert ev.kind == "error" and ev.obj is not None
    err = ev.obj["error"]
    assert err["code"] == "upstream_stream_cut" and err["message"].endswith(
        "could not be continued: n > 1: several choices cannot be continued"
    )


def test_an_engines_refusal_is_quoted_short_and_on_one_line() -> None:
    why = refusal(400, b'{"error":{"message":"continue_final_message\\nis not supported","code":400}}')
    assert why == "the engine refused the continuation (HTTP 400: continue_final_message is not supported)"
    assert refusal(400, b'{"object":"error","message":"no"}').endswith("(HTTP 400: no)")
    assert len(refusal(500, b"x" * 5000)) < 400
    assert refusal(502, b"") == "the engine refused the continuation (HTTP 502)"


# ------------------------------------------------------------------ the seam itself


def test_a_continuation_reads_as_the_first_response() -> None:
    body = chat_body(stream_options={"include_usage": True, "continuous_usage_stats": True})
    state = StreamState()
    first = Engine(LLAMACPP).stream(upstream_body(body, LLAMACPP), CHAT_PATH, 0)
    client = Seam(state, body).feed(first[: first.index(b'"content":"ld"') - 40])
    new = continuation(body, CHAT_PATH, state, VLLM)  # another engine kind: vLLM's chunk shape
    client += Seam(state, body).feed(Engine(VLLM).stream(new, CHAT_PATH, 1))
    evs = events_of(client)
    assert {e["id"] for e in evs if isinstance(e, dict)} == {"chatcmpl-llamacpp-0"}
    assert {e.get("system_fingerprint") for e in evs if isinstance(e, dict)} == {"b0"}
    check_stream(client, CHAT_PATH, refused=False, usage=True, continuous=True)


@pytest.mark.parametrize("engine", [Engine(VLLM), Engine(LLAMACPP), Engine(LLAMACPP, crlf=True)], ids=repr)
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize("opts", [{}, {"stream_options": {"include_usage": True}}])
def test_a_stream_never_cut_reaches_the_client_as_the_engine_sent_it(
    engine: Engine, path: str, opts: dict[str, Any]
) -> None:
    body = body_for(path, **opts)
    stream = engine.stream(body, path, 0)
    seam = Seam(StreamState(), body)
    out = b"".join(seam.feed(piece) for piece in _split(stream, [5])) + seam.end()
    assert events_of(out) == events_of(stream)
    if not engine.crlf:
        assert out == stream


def test_an_engines_null_usage_is_left_as_sent() -> None:
    chunk = b'data: {"id":"a","object":"text_completion","choices":[{"index":0,"text":"x"}],"usage":null}\n\n'
    seam = Seam(StreamState(), completions_body())
    assert seam.feed(chunk) == chunk and seam.state.text == "x" and seam.state.tokens == 1
