"""One upstream response's events rewritten into the client's stream, across seams."""

from __future__ import annotations

import json
from typing import Any

from cluster_cli.router.resume.requests import _client_options, _int_field
from cluster_cli.router.resume.state import _MAX_KEYS, _REASONING_KEYS, DONE_EVENT, StreamState
from cluster_cli.router.sse import BLANK, CHUNK, DONE, SSEParser, parse_event


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
