"""Server-sent events as the engines stream them: split a byte stream into events, whatever
the reads' boundaries, and say what each one is (a chunk, the end, an error, nothing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Kinds of SSE event.
CHUNK = "chunk"  # a JSON object with choices or usage
DONE = "done"  # data: [DONE]
ERROR = "error"  # the engine's error, in any of the shapes engines send it
OTHER = "other"  # comments, unknown fields: no data
UNREADABLE = "unreadable"  # data that is not a JSON object
BLANK = "blank"  # a stray blank line: no fields at all


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
