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
