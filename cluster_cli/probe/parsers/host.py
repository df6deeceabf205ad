"""Pure parsers for host facts: ``nproc --all`` and ``/proc/meminfo``."""

from __future__ import annotations

import re

__all__ = ["parse_meminfo", "parse_nproc"]

_COUNT = re.compile(r"[0-9]{1,9}")
_MEMTOTAL = re.compile(r"MemTotal:\s*([0-9]{1,18})\s*(kB|KiB)?", re.IGNORECASE)


def parse_nproc(text: str) -> int | None:
    """CPU count from ``nproc`` (first non-blank line, a positive integer), else None."""
    if not isinstance(text, str):
        return None
    for line in text.replace("\r", "").split("\n"):
        if line.strip():
            value = line.strip()
            return (int(value) or None) if _COUNT.fullmatch(value) else None
    return None


def parse_meminfo(text: str) -> int | None:
    """``MemTotal`` in MiB (the kernel's kB are KiB, so ``kB // 1024``); missing or zero -> None."""
    if not isinstance(text, str):
        return None
    for line in text.replace("\r", "").split("\n"):
        m = _MEMTOTAL.fullmatch(line.strip())
        if m:
            return int(m.group(1)) // 1024 or None
    return None


_MARKER = "CLUSTERCTL_RUN="


def parse_launched(text: str) -> dict[int, str]:
    """PID -> launch marker (``CLUSTERCTL_RUN``'s value), from ``grep -Hazo`` over the nodes'
    ``/proc/PID/environ``: ``/proc/PID/environ:CLUSTERCTL_RUN=TOKEN`` records, NUL or newline
    ended. Records that do not read so are skipped; never raises."""
    out: dict[int, str] = {}
    for rec in text.replace("\x00", "\n").splitlines():
        path, sep, value = rec.partition(":" + _MARKER)
        if not sep or not path.startswith("/proc/") or not path.endswith("/environ"):
            continue
        pid = path[len("/proc/") : -len("/environ")]
        if pid.isdigit() and value and value.isprintable():
            out[int(pid)] = value
    return out
