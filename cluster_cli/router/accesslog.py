"""One structured (JSON) access-log line per request, written in batches.

Lines are formatted by hand (JSON-escaping only the strings a client controls) and
buffered; the router's sweeper flushes them (or the buffer does when it grows), so a
request costs one string format, not a write. No headers are logged, so
API keys never appear.
"""

from __future__ import annotations

import time

# C-accelerated JSON string quoting, to ASCII: a lone surrogate a client put in its JSON (which
# json.loads accepts) cannot fail the write of the whole batch its line is in.
from json.encoder import encode_basestring_ascii as _q
from typing import TextIO


class AccessLog:
    def __init__(self, stream: TextIO | None, *, max_buffer: int = 256) -> None:
        self.stream = stream
        self.max_buffer = max_buffer
        self._buf: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def log(
        self,
        rid: int,
        client: str,
        method: str,
        path: str,
        model: str,
        endpoint: str,
        status: int,
        attempts: int,
        ttfb_s: float | None,
        duration_s: float,
        note: str = "",
    ) -> None:
        if self.stream is None:
            return
        ttfb = "null" if ttfb_s is None else f"{ttfb_s * 1000:.3f}"
        line = (
            f'{{"ts":{time.time():.3f},"id":{rid},"client":"{client}","method":{_q(method)},"path":{_q(path)},'
            f'"model":{_q(model)},"endpoint":{_q(endpoint)},"status":{status},"attempts":{attempts},'
            f'"ttfb_ms":{ttfb},"duration_ms":{duration_s * 1000:.3f}'
        )
        self._buf.append(line + (f',"note":{_q(note)}}}' if note else "}"))
        if len(self._buf) >= self.max_buffer:
            self.flush()

    def flush(self) -> None:
        if not self._buf or self.stream is None:
            return
        lines, self._buf = self._buf, []
        try:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass
