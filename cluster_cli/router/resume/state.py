"""What the client has been sent of one stream: its identity, text, tokens, finish, and what
makes it impossible to continue faithfully."""

from __future__ import annotations

from typing import Any

from cluster_cli.router.sse import CHUNK, DONE, ERROR, UNREADABLE, Event, SSEParser, parse_event

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESUME_LIMIT = 3  # continuations per request, by default
DONE_EVENT = b"data: [DONE]\n\n"

# Engine names as the router config spells them (EndpointSpec.engine).
VLLM = "vllm"
LLAMACPP = "llamacpp"

_MAX_KEYS = ("max_tokens", "max_completion_tokens")
_REASONING_KEYS = ("reasoning_content", "reasoning")


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
