"""Continue a stream that its engine cut, on another replica, as one stream to the client.

Pure pieces, no I/O: the forwarding loop feeds them bytes and sends what they return.

* :class:`StreamState` records what the client has been sent: the response's ``id``,
  ``model``, ``created`` and ``object``, the text of choice 0, the tokens relayed, whether
  a ``finish_reason`` and ``data: [DONE]`` went out, and whatever makes the stream
  impossible to continue faithfully (several choices, logprobs, a tool call, reasoning).
* :class:`Seam` rewrites one upstream response's SSE events into the client's stream. The
  first upstream's events pass as sent, less the usage the router asked for on its own
  behalf; a continuation's events get the first response's ``id``, ``model``, ``created``
  and ``object``, lose the role chunk and leading empty chunks the client already had, and
  the usage the client asked for comes once, at the end, summed across the seams.
* :func:`upstream_body` is the first upstream request (usage asked for, to count tokens);
  :func:`can_resume` says whether a cut stream may be continued (``None``) or why not;
  :func:`continuation` is the request that continues it; :func:`cut_event` is the SSE
  error event a stream that cannot go on ends with (the shape the router sends today).

A cut stream is handled so::

    state = StreamState()                           # a retry before any byte went out: a new one
    seam = Seam(state, body)                        # one Seam per upstream response
    send(upstream_body(body, engine))
    for data in reads: client.write(seam.feed(data))
    # clean end of the upstream body: client.write(seam.end())
    # a cut, once a byte reached the client:
    if tail := seam.close(): client.write(tail)     # it needed no more tokens: ended here
    elif (why := can_resume(body, path, state, tries, limit)) is None:
        tries += 1; seam = Seam(state, body); send(continuation(body, path, state, engine))
    else: client.write(cut_event(cause, why))

How tokens are counted. The router never tokenizes text. :func:`upstream_body` and
:func:`continuation` ask the engine for its own count as it goes: vLLM's
``stream_options.continuous_usage_stats`` (usage on every chunk) and llama-server's
``timings_per_token`` (``timings.predicted_n`` on every chunk), plus ``include_usage``
(the final usage chunk) from both. Where a chunk carries no count (an engine that ignores
these, or a first request sent as the client wrote it), each chunk with content counts as
one token: exact for engines that send one token per chunk (llama-server, vLLM by
default), a lower bound where a chunk holds several (vLLM's ``stream_interval``, text
held back across a stop string or a split UTF-8 character). A lower bound errs towards
more tokens than ``max_tokens`` over the whole stream, never fewer, and never ends a
stream early. The original prompt's tokens are the first engine's report; when the cut
came before it reported them, they are the continuation's prompt tokens less the tokens
already relayed (the engine's count of the same text, give or take the tokenizer's
merges at the seam). An engine's count may include tokens whose text it still holds back
(a possible stop string): the continuation writes that text again, within a slightly
smaller ``max_tokens``.

Known limits, each left to the engines: a chat template that trims the final assistant
message drops trailing whitespace of the text so far, and the model may write it again;
a stop string that straddles the seam is not seen (its first part is in the prompt);
penalties over generated tokens (presence, frequency) restart at the seam.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster_cli.router.http import sse_error_event

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESUME_LIMIT = 3  # continuations per request, by default
DONE_EVENT = b"data: [DONE]\n\n"

# Engine names as the router config spells them (EndpointSpec.engine).
VLLM = "vllm"
LLAMACPP = "llamacpp"

# Kinds of SSE event.
CHUNK = "chunk"  # a JSON object with choices or usage
DONE = "done"  # data: [DONE]
ERROR = "error"  # the engine's error, in any of the shapes engines send it
OTHER = "other"  # comments, unknown fields: no data
UNREADABLE = "unreadable"  # data that is not a JSON object
BLANK = "blank"  # a stray blank line: no fields at all

# Request fields that constrain the whole output: the continuation would restart the
# constraint from its first token (a JSON schema from "{"), so it cannot be continued.
_GUIDED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "grammar",
    "json_schema",
)
_MAX_KEYS = ("max_tokens", "max_completion_tokens")
_REASONING_KEYS = ("reasoning_content", "reasoning")
_REFUSAL_CHARS = 300  # an engine's refusal is quoted in the client's error event at most this long


@dataclass(slots=True)
class Event:
    """One SSE event: its bytes as received (blank line included) and what they say."""

    raw: bytes
    kind: str
    obj: dict[str, Any] | None = None  # the JSON object of a CHUNK or an ERROR sent as data


class SSEParser:
    """Splits a byte stream into SSE events, whatever the reads' boundaries.

    Lines end with LF or CRLF (the engines' and the router's own framing; a bare CR, which
    no engine sends, is not a line end here). An event ends at a blank line; the bytes of
    an unfinished event are held until the rest comes, and :meth:`remainder` hands them
    over when the body ends.
    """

    __slots__ = ("_buf", "_line")

    def __init__(self) -> None:
        self._buf = b""
        self._line = 0  # offset in _buf where the line not yet ended starts

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        start = 0  # where the current event starts
        line = self._line
        while (nl := buf.find(b"\n", line)) >= 0:
            if nl == line or (nl == line + 1 and buf[line] == 13):  # a blank line: the event ends
                out.append(buf[start : nl + 1])
                start = nl + 1
            line = nl + 1
        self._buf = buf[start:]
        self._line = line - start
        return out

    def remainder(self) -> bytes:
        """The bytes of the event not ended by a blank line; the parser is left empty."""
        rest, self._buf, self._line = self._buf, b"", 0
        return rest


def parse_event(raw: bytes) -> Event:
    """Classify one event's bytes (see :class:`SSEParser`)."""
    data: list[bytes] = []
    fields = 0
    error = False
    for line in raw.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            continue
        fields += 1
        if line.startswith(b":"):
            continue  # a comment (keep-alive)
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"error" or (name == b"event" and value == b"error"):
            error = True  # llama-server writes "error: {...}"; others name the event
    if not fields:
        return Event(raw, BLANK)
    if not data:
        return Event(raw, ERROR if error else OTHER)
    payload = b"\n".join(data)
    if payload.strip() == b"[DONE]":
        return Event(raw, DONE)
    try:
        obj = json.loads(payload)
    except ValueError:
        return Event(raw, ERROR if error else UNREADABLE)
    if not isinstance(obj, dict):
        return Event(raw, ERROR if error else UNREADABLE)
    if error or ("error" in obj and "choices" not in obj) or obj.get("object") == "error":
        return Event(raw, ERROR, obj)
    return Event(raw, CHUNK, obj)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class StreamState:
    """What the client has been sent of one streamed response, across its upstreams.

    Feed it, in order, every event the client was sent: :meth:`feed` with the relayed
    bytes (they may split events anywhere), or :meth:`observe` with parsed events (what a
    :class:`Seam` does). Events relayed before the first chunk fix nothing; the first chunk
    fixes the response's ``id``, ``model``, ``created``, ``object`` and
    ``system_fingerprint`` for the rest of the stream.

    ``tokens`` is the completion tokens relayed: per upstream, the engine's own latest
    count (``usage.completion_tokens``, or llama-server's ``timings.predicted_n``) plus one
    for each chunk with content after it; summed over upstreams. ``prompt_tokens`` is the
    original request's (see the module's notes), ``None`` until an engine reported any.
    ``unresumable`` is the first thing seen that a continuation could not reproduce.
    """

    __slots__ = (
        "_before",
        "_parser",
        "_pieces",
        "_prompt0",
        "_prompt_est",
        "_seg_after",
        "_seg_reported",
        "created",
        "done",
        "events",
        "finish_reason",
        "id",
        "model",
        "object",
        "role_sent",
        "segment",
        "started",
        "system_fingerprint",
        "unresumable",
        "usage",
        "usage_sent",
    )

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: Any = None
        self.object: str | None = None
        self.system_fingerprint: Any = None  # None: the first chunk had none (the key is absent)
        self.started = False  # a chunk was relayed: the response's identity is fixed
        self.role_sent = False
        self.finish_reason: str | None = None
        self.done = False  # "data: [DONE]" was relayed
        self.usage_sent = False  # the stream's final usage reached the client
        self.usage: dict[str, Any] | None = None  # the engine's latest usage object, as sent
        self.unresumable: str | None = None
        self.events = 0  # events observed, all upstreams
        self.segment = 0  # which upstream the events come from: 0 is the first
        self._pieces: list[str] = []
        self._parser = SSEParser()
        self._before = 0  # tokens relayed by earlier upstreams
        self._seg_reported: int | None = None  # this upstream's latest own count
        self._seg_after = 0  # content chunks of this upstream after that count
        self._prompt0: int | None = None  # the first upstream's prompt tokens
        self._prompt_est: int | None = None  # the same, from a continuation's

    @property
    def text(self) -> str:
        """The text of choice 0 relayed so far (chat: the content; completions: the text)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def tokens(self) -> int:
        return self._before + (self._seg_reported or 0) + self._seg_after

    @property
    def prompt_tokens(self) -> int | None:
        return self._prompt0 if self._prompt0 is not None else self._prompt_est

    @property
    def finished(self) -> bool:
        """A finish_reason was relayed: the client has the whole text."""
        return self.finish_reason is not None

    def next_segment(self) -> None:
        """The following events come from another upstream (a continuation)."""
        self._before = self.tokens
        self._seg_reported = None
        self._seg_after = 0
        self.segment += 1
        self._parser = SSEParser()  # an event cut short by the failure never reached the client

    def feed(self, data: bytes) -> None:
        """Observe bytes relayed to the client as they were sent (no :class:`Seam`)."""
        for raw in self._parser.feed(data):
            ev = parse_event(raw)
            self.observe(ev)
            if ev.kind == CHUNK and ev.obj is not None and _is_final_usage(ev.obj):
                self.usage_sent = True

    def observe(self, ev: Event) -> None:
        """Record one event, in stream order."""
        self.events += 1
        if ev.kind == DONE:
            self.done = True
            return
        if ev.kind == ERROR:
            self._refuse("the engine reported an error in the stream")
            return
        if ev.kind == UNREADABLE:  # it may hold text the client got
            self._refuse("the stream held an event the router cannot read")
            return
        obj = ev.obj
        if ev.kind != CHUNK or obj is None:
            return
        if not self.started:
            self.started = True
            self.id = obj.get("id")
            self.model = obj.get("model")
            self.created = obj.get("created")
            self.object = obj.get("object")
            self.system_fingerprint = obj.get("system_fingerprint")
        counted = self._take_count(obj)
        choices = obj.get("choices")
        if choices is None:
            return
        if not isinstance(choices, list):
            self._refuse("the stream held a chunk the router cannot read")
            return
        content = False
        for choice in choices:
            if not isinstance(choice, dict):
                self._refuse("the stream held a chunk the router cannot read")
                continue
            if choice.get("index", 0) != 0:
                self._refuse("the stream holds several choices")
                continue
            if choice.get("logprobs") is not None:
                self._refuse("logprobs were streamed")
            content |= self._take_choice(choice)
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish_reason = reason
        if content and not counted:
            self._seg_after += 1

    def _take_count(self, obj: dict[str, Any]) -> bool:
        """Take the engine's own token counts from a chunk; whether it had a completion count."""
        usage = obj.get("usage")
        done: int | None = None
        if isinstance(usage, dict):
            self.usage = usage
            done = _count(usage.get("completion_tokens"))
            prompt = _count(usage.get("prompt_tokens"))
            if prompt is not None:
                if self.segment == 0:
                    self._prompt0 = prompt
                elif self._prompt0 is None:
                    self._prompt_est = max(prompt - self._before, 0)
        if done is None:
            timings = obj.get("timings")
            if isinstance(timings, dict):
                done = _count(timings.get("predicted_n"))
        if done is None:
            return False
        self._seg_reported = done
        self._seg_after = 0
        return True

    def _take_choice(self, choice: dict[str, Any]) -> bool:
        """Record one choice-0 entry; whether it carried anything generated."""
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("role"):
                self.role_sent = True
            piece = delta.get("content")
            generated = False
            if delta.get("tool_calls") or delta.get("function_call"):
                self._refuse("a tool call was being streamed")
                generated = True
            if any(isinstance(delta.get(k), str) and delta.get(k) for k in _REASONING_KEYS):
                self._refuse("reasoning was being streamed (an engine does not continue it)")
                generated = True
        else:
            piece = choice.get("text")
            generated = False
        if isinstance(piece, str) and piece:
            self._pieces.append(piece)
            return True
        if piece is not None and not isinstance(piece, str):
            self._refuse("the stream held a chunk the router cannot read")
        return generated

    def _refuse(self, why: str) -> None:
        if self.unresumable is None:
            self.unresumable = why

    def usage_totals(self) -> dict[str, Any] | None:
        """The usage of the whole stream, or None while no engine reported prompt tokens.

        The engine's latest usage object with its token counts replaced; once the stream
        has a seam, without the engine's ``*_details`` (they describe one upstream only).
        """
        prompt = self.prompt_tokens
        if prompt is None:
            return None
        base = dict(self.usage or {})
        if self.segment:
            for key in [k for k in base if k.endswith("_details")]:
                del base[key]
        done = self.tokens
        base.update(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
        return base


def _is_final_usage(obj: dict[str, Any]) -> bool:
    """Whether a chunk is the stream's usage report (its own chunk, or on the finish chunk)."""
    if not isinstance(obj.get("usage"), dict):
        return False
    choices = obj.get("choices")
    if not choices:
        return True
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _path(path: str | bytes) -> str:
    if isinstance(path, bytes):
        path = path.decode("latin-1")
    return path.split("?", 1)[0]


def _client_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the client asked for usage at the end, and for usage on every chunk."""
    so = body.get("stream_options")
    if not isinstance(so, dict) or so.get("include_usage") is not True:
        return False, False
    return True, so.get("continuous_usage_stats") is True


def _int_field(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def upstream_body(request_body: dict[str, Any], engine: str = VLLM) -> dict[str, Any]:
    """The request to send upstream for a stream: the client's, asking the engine for its
    token counts as it goes (see the module's notes). A :class:`Seam` keeps from the
    client what the client did not ask for (so a vLLM chunk, then carrying usage, is
    re-encoded without it). Not a stream: the body unchanged."""
    if request_body.get("stream") is not True:
        return request_body
    body = dict(request_body)
    so = body.get("stream_options")
    so = dict(so) if isinstance(so, dict) else {}
    so["include_usage"] = True
    if engine == VLLM:
        so["continuous_usage_stats"] = True
    elif engine == LLAMACPP:
        body["timings_per_token"] = True  # vLLM would log every unknown field it ignores
    body["stream_options"] = so
    return body


def can_resume(
    request_body: dict[str, Any],
    path: str | bytes,
    state: StreamState,
    tries: int,
    limit: int = RESUME_LIMIT,
    *,
    enabled: bool = True,
) -> str | None:
    """Whether a stream cut after bytes reached the client may be continued elsewhere.

    ``None``: :func:`continuation` continues it faithfully. Otherwise the reason, for the
    client's error event (:func:`cut_event`). ``tries`` is the continuations already made
    for this request; ``limit`` the most allowed (``resume_limit``); ``enabled`` the model's
    switch. A stream that needs no more tokens (:meth:`Seam.close` ends it) gets a reason too.
    """
    if not enabled:
        return "continuing cut streams is off for this model"
    if limit <= 0:
        return "continuing cut streams is off (resume_limit 0)"
    if tries >= limit:
        return f"it was continued {tries} times already (resume_limit {limit})"
    p = _path(path)
    if p not in (CHAT_PATH, COMPLETIONS_PATH):
        return f"only chat and text completion streams are continued, not {p[:100]}"
    if request_body.get("stream") is not True:
        return "not a stream"
    if state.done:
        return "the stream had ended"
    if state.finished:
        return "the stream had finished"
    n = request_body.get("n")
    if n is not None and n != 1:
        return "n > 1: several choices cannot be continued"
    best_of = request_body.get("best_of")
    if best_of is not None and best_of != 1:
        return "best_of > 1 cannot be continued"
    logprobs = request_body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or request_body.get("top_logprobs"):
        return "logprobs were asked for"
    if request_body.get("prompt_logprobs") is not None:
        return "prompt logprobs were asked for"
    if request_body.get("echo"):
        return "echo was asked for"
    rf = request_body.get("response_format")
    if (isinstance(rf, dict) and rf.get("type", "text") != "text") or any(
        request_body.get(k) is not None for k in _GUIDED
    ):
        return "the output is constrained (a schema or grammar restarts at a continuation)"
    if state.unresumable is not None:
        return state.unresumable
    done = state.tokens
    for key in _MAX_KEYS:
        cap = _int_field(request_body, key)
        if cap is not None and cap - done < 1:
            return f"no tokens left of {key} ({cap})"
    if p == CHAT_PATH:
        msgs = request_body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "the request has no messages"
        if request_body.get("continue_final_message") is True and state.text:
            last = msgs[-1]
            if not (
                isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str)
            ):
                return "the final message to continue is not assistant text"
    else:
        prompt = request_body.get("prompt")
        if isinstance(prompt, list) and not all(isinstance(x, str) for x in prompt):
            return "a prompt of token ids cannot be continued with text"
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return "several prompts: several choices cannot be continued"
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return "a prompt of token ids cannot be continued with text"
    return None


def continuation(
    request_body: dict[str, Any], path: str | bytes, state: StreamState, engine: str = VLLM
) -> dict[str, Any]:
    """The upstream request that continues the text relayed so far (check :func:`can_resume`).

    Chat: the messages, then an assistant message holding the text, with
    ``continue_final_message: true`` and ``add_generation_prompt: false`` (a client's own
    final assistant message, if it asked to continue one, gets the text appended instead).
    Completions: the prompt followed by the text. ``max_tokens``, ``max_completion_tokens``
    and ``min_tokens`` lose the tokens relayed; the stream is forced on, with the engine's
    token counts (:func:`upstream_body`). The client's body is not modified.
    """
    body = upstream_body({**request_body, "stream": True}, engine)
    done = state.tokens
    for key in _MAX_KEYS:
        cap = _int_field(body, key)
        if cap is not None:
            body[key] = max(cap - done, 1)
    floor = _int_field(body, "min_tokens")
    if floor is not None:
        body["min_tokens"] = max(floor - done, 0)
    text = state.text
    if not text:
        return body  # nothing to continue from: the request as it was
    if _path(path) == CHAT_PATH:
        msgs = list(body["messages"])
        last = msgs[-1]
        if body.get("continue_final_message") is True and isinstance(last, dict) and last.get("role") == "assistant":
            msgs[-1] = {**last, "content": last["content"] + text}
        else:
            msgs.append({"role": "assistant", "content": text})
        body["messages"] = msgs
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    else:
        prompt = body["prompt"]
        body["prompt"] = [prompt[0] + text] if isinstance(prompt, list) else prompt + text
    return body


def cut_event(cause: str, reason: str | None = None) -> bytes:
    """The SSE error event that ends a cut stream: today's ``upstream_stream_cut`` event, with
    why it was not continued when ``reason`` is given."""
    msg = f"the upstream stream was cut: {cause}"
    if reason:
        msg += f"; it could not be continued: {reason}"
    return sse_error_event(msg, "upstream_stream_cut")


def refusal(status: int, body: bytes) -> str:
    """A reason for :func:`cut_event` from an engine that answered a continuation with an
    error instead of a stream (an engine or template that does not take it)."""
    detail = ""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(msg, str):
            detail = msg
    if not detail:
        detail = body.decode("utf-8", "replace")
    detail = " ".join(detail.split())[:_REFUSAL_CHARS]
    return f"the engine refused the continuation (HTTP {status}{': ' + detail if detail else ''})"


def _dump(obj: dict[str, Any]) -> bytes:
    """One ``data:`` event, compact and in UTF-8 as the engines write theirs."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape: kept escaped
        text = json.dumps(obj, separators=(",", ":")).encode()
    return b"data: " + text + b"\n\n"


class Seam:
    """Rewrites one upstream response's SSE events into the client's single stream.

    Make one per upstream response, in order, all on the same :class:`StreamState` (made
    once the upstream answers 200 with a stream). The first response's events pass as
    sent; a continuation's (any later one, once the client got an event) are made to read
    as the same response. For the client, throughout:

    * every chunk has the ``id``, ``model``, ``created``, ``object`` and
      ``system_fingerprint`` of the first chunk it was sent;
    * a continuation's role-only chunk and empty chunks before its first text are dropped
      (the client already had the role);
    * usage appears only as the client asked: with ``stream_options.include_usage``, one
      usage chunk (``choices: []``) right before ``data: [DONE]``, its completion tokens
      summed over the upstreams and its prompt tokens the original request's; with
      ``continuous_usage_stats`` too, every chunk's usage is the stream's running total;
    * llama-server's per-token ``timings`` appear only if the client asked for them, and
      then only from the first upstream;
    * exactly one ``finish_reason`` and one ``data: [DONE]``; nothing after it.

    Engine errors and comments pass as sent. An event cut short by the upstream is never
    returned: a new Seam starts clean.
    """

    __slots__ = (
        "_caps",
        "_held",
        "_leading",
        "_parser",
        "client_continuous",
        "client_timings",
        "client_usage",
        "state",
    )

    def __init__(self, state: StreamState, request_body: dict[str, Any]) -> None:
        if state.events:
            state.next_segment()
        self._setup(state, request_body)

    def _setup(self, state: StreamState, request_body: dict[str, Any]) -> None:
        self.state = state
        self.client_usage, self.client_continuous = _client_options(request_body)
        self.client_timings = request_body.get("timings_per_token") is True
        self._parser = SSEParser()
        self._leading = state.segment > 0  # dropping empty chunks until the continuation's first text
        self._held: dict[str, Any] | None = None  # this upstream's usage chunk, sent with [DONE]
        # The client's caps, not the continuation's: they bound the whole stream.
        self._caps = [v for k in _MAX_KEYS if (v := _int_field(request_body, k)) is not None]

    def feed(self, data: bytes) -> bytes:
        """Upstream bytes in, client bytes out: only whole events, rewritten."""
        out = [piece for raw in self._parser.feed(data) if (piece := self._event(raw))]
        return b"".join(out)

    def end(self) -> bytes:
        """The upstream body ended cleanly (its framing said so): its last event, even without
        its blank line, and the stream's end if the engine left it out (see :meth:`close`)."""
        rest = self._parser.remainder()
        out = self._event(rest.rstrip(b"\r\n") + b"\n\n") if rest.strip() else b""
        return out + self.close()

    def close(self) -> bytes:
        """End the client's stream here if it needs no more tokens, else b"".

        A stream whose ``finish_reason`` went out gets its usage chunk (if asked and not yet
        sent) and ``data: [DONE]``; one that used all of its ``max_tokens`` (counted as the
        module's notes say: never more than were generated) also gets a finish chunk with
        ``finish_reason: "length"`` first. Anything else needs a continuation or an error.
        """
        st = self.state
        if st.done or not st.started:
            return b""
        out = b""
        if not st.finished:
            if not self._exhausted():
                return b""
            choice: dict[str, Any] = {"index": 0}
            if st.object == "text_completion":
                choice["text"] = ""
            else:
                choice["delta"] = {}
            choice.update(logprobs=None, finish_reason="length")
            chunk = self._frame({"choices": [choice]})
            if self.client_continuous and (usage := st.usage_totals()) is not None:
                chunk["usage"] = usage
            st.finish_reason = "length"
            out = _dump(chunk)
        st.done = True
        return out + self._usage_event() + DONE_EVENT

    def _exhausted(self) -> bool:
        return bool(self._caps) and self.state.tokens >= min(self._caps)

    def _frame(self, body: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        ident = {"id": st.id, "object": st.object, "created": st.created, "model": st.model}
        obj = {k: v for k, v in ident.items() if v is not None}
        if st.system_fingerprint is not None:
            obj["system_fingerprint"] = st.system_fingerprint
        obj.update(body)
        return obj

    def _usage_event(self) -> bytes:
        st = self.state
        if not self.client_usage or st.usage_sent:
            return b""
        usage = st.usage_totals()
        if usage is None:
            return b""
        st.usage_sent = True
        held = self._held
        if held is not None and st.segment == 0:
            obj = {**held, "usage": usage}  # the engine's own chunk (llama-server's timings included)
        else:
            obj = self._frame({"choices": [], "usage": usage})
        return _dump(obj)

    def _event(self, raw: bytes) -> bytes:
        st = self.state
        if st.done:
            return b""  # nothing follows [DONE]
        ev = parse_event(raw)
        if ev.kind == BLANK:
            return b""
        had_role, had_finish = st.role_sent, st.finished
        st.observe(ev)
        if ev.kind == DONE:
            return self._usage_event() + raw
        if ev.kind != CHUNK or ev.obj is None:
            return raw
        obj = ev.obj
        changed = False
        choices = obj.get("choices")
        if isinstance(obj.get("usage"), dict):  # an engine's "usage": null is left as sent
            if not choices:
                self._held = obj
                return b""  # the usage chunk: sent, summed, with [DONE]
            if self.client_continuous and (usage := st.usage_totals()) is not None:
                obj["usage"] = usage
            else:
                del obj["usage"]
            changed = True
        if "timings" in obj and (st.segment > 0 or not (self.client_timings or _has_finish(choices))):
            del obj["timings"]
            changed = True
        if isinstance(choices, list) and choices:
            first = choices[0]
            if had_finish and _has_finish(choices):
                return b""  # a second finish_reason: the client has the whole text already
            if self._leading:
                if _empty(first) and not (not had_role and _has_role(first)):
                    return b""
                self._leading = False
        elif not changed:
            return raw
        if st.segment > 0:
            changed |= self._reframe(obj)
        return _dump(obj) if changed else raw

    def _reframe(self, obj: dict[str, Any]) -> bool:
        """Give a continuation's chunk the first chunk's identity; whether it changed."""
        st = self.state
        want = {"id": st.id, "object": st.object, "created": st.created, "model": st.model}
        changed = False
        for key, value in want.items():
            if value is not None and obj.get(key) != value:
                obj[key] = value
                changed = True
        if st.system_fingerprint is None:
            if "system_fingerprint" in obj:
                del obj["system_fingerprint"]
                changed = True
        elif obj.get("system_fingerprint") != st.system_fingerprint:
            obj["system_fingerprint"] = st.system_fingerprint
            changed = True
        return changed


def ending(state: StreamState, request_body: dict[str, Any]) -> bytes:
    """:meth:`Seam.close` for a stream relayed as sent, its bytes fed to :meth:`StreamState.feed`."""
    seam = Seam.__new__(Seam)
    seam._setup(state, request_body)  # no new segment: it only ends what was relayed
    return seam.close()


def _has_finish(choices: object) -> bool:
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _has_role(choice: object) -> bool:
    return isinstance(choice, dict) and isinstance(choice.get("delta"), dict) and bool(choice["delta"].get("role"))


def _empty(choice: object) -> bool:
    """A choice entry that carries nothing: no text, tool call, reasoning or finish."""
    if not isinstance(choice, dict) or choice.get("finish_reason"):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return not any(delta.get(k) for k in ("content", "tool_calls", "function_call", *_REASONING_KEYS))
    return not choice.get("text")
