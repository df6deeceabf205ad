"""One structured (JSON) access-log line per request, written in batches.

Lines are formatted by hand (JSON-escaping only the strings a client controls) and
buffered; the router's sweeper flushes them (or the buffer does when it grows), so a
request costs one string format, not a write. No headers are logged, so
API keys never appear.
"""

from __future__ import annotations

import contextlib
import time

# C-accelerated JSON string quoting, to ASCII: a lone surrogate a client put in its JSON (which
# json.loads accepts) cannot fail the write of the whole batch its line is in.
from json.encoder import encode_basestring_ascii as _q
from typing import TextIO


def _text(s: str) -> str:
    """``s`` as a JSON string that every parser takes: a lone surrogate (a client may send
    ``"\\ud800"`` as its model name, and ``json.loads`` keeps it) becomes U+FFFD."""
    if s.isascii():
        return _q(s)
    return _q(s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace"))


class AccessLog:
    def __init__(self, stream: TextIO | None, *, max_buffer: int = 256, path: str | None = None) -> None:
        self.stream = stream
        self.max_buffer = max_buffer
        self.path = path  # the file ``stream`` writes, reopened by ``reopen`` (log rotation)
        self._buf: list[str] = []

    @classmethod
    def to_file(cls, path: str) -> AccessLog:
        """Appending to ``path`` (raises OSError)."""
        return cls(open(path, "a", encoding="utf-8"), path=path)

    def reopen(self) -> None:
        """After a log rotation moved the file away (SIGHUP, as logrotate's postrotate sends):
        what is buffered goes to the old file, what follows to a new one at ``path``. A file
        that cannot be opened keeps the old one."""
        if self.path is None or self.stream is None:
            return
        self.flush()
        try:
            new = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept as the log's stream
        except OSError:
            return
        old, self.stream = self.stream, new
        with contextlib.suppress(OSError):
            old.close()

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
        affinity: str = "",
    ) -> None:
        if self.stream is None:
            return
        ttfb = "null" if ttfb_s is None else f"{ttfb_s * 1000:.3f}"
        line = (
            f'{{"ts":{time.time():.3f},"id":{rid},"client":"{client}","method":{_q(method)},"path":{_q(path)},'
            f'"model":{_text(model)},"endpoint":{_q(endpoint)},"status":{status},"attempts":{attempts},'
            f'"ttfb_ms":{ttfb},"duration_ms":{duration_s * 1000:.3f}'
        )
        if affinity:
            line += f',"affinity":{_text(affinity)}'
        self._buf.append(line + (f',"note":{_text(note)}}}' if note else "}"))
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
