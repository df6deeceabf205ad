"""The upstream requests of a stream that may be continued: the first one, whether a cut one
may go on, the request that continues it, and the error event when it may not."""

from __future__ import annotations

import json
from typing import Any

from cluster_cli.router.http import sse_error_event
from cluster_cli.router.resume.state import (
    _MAX_KEYS,
    CHAT_PATH,
    COMPLETIONS_PATH,
    LLAMACPP,
    RESUME_LIMIT,
    VLLM,
    StreamState,
)

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
_REFUSAL_CHARS = 300  # an engine's refusal is quoted in the client's error event at most this long


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
