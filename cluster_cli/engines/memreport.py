"""What an engine says of its memory once loaded, read from its log (compared with the
placement's estimate by ``placement.fit.misses``).

vLLM logs ``Model loading took 14.9596 GiB and 5.2 seconds`` (per GPU), ``Available KV cache
memory: 53.20 GiB`` and ``GPU KV cache size: 435,728 tokens``. llama.cpp logs each buffer it
allocates: ``CUDA0 model buffer size = 4403.50 MiB``, ``CPU KV buffer size = 1024.00 MiB``
(at ``-v``; a quiet log says nothing, and nothing is compared).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNIT = {"b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
_VLLM_WEIGHTS = re.compile(r"Model loading took ([0-9.]+) ?(GiB|GB|MiB|MB)", re.I)
_VLLM_KV = re.compile(r"Available KV cache memory: ([0-9.]+) ?(GiB|GB|MiB|MB)", re.I)
_VLLM_TOKENS = re.compile(r"GPU KV cache size: ([0-9,]+) tokens", re.I)
_LLAMA_BUFFER = re.compile(r"\b(\w+) (model|KV) buffer size = +([0-9.]+) (MiB|GiB)")


@dataclass(frozen=True)
class EngineMemory:
    """Bytes the engine reports per GPU (per process on the CPU); None: it did not say."""

    weights_bytes: int | None = None
    kv_bytes: int | None = None
    kv_tokens: int | None = None


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNIT[unit.lower()])


def parse_memory_report(log: str) -> EngineMemory:
    """The last report of each kind in ``log`` (an engine restarted in place logs again)."""
    weights = kv = tokens = None
    for m in _VLLM_WEIGHTS.finditer(log):
        weights = _bytes(m.group(1), m.group(2))
    for m in _VLLM_KV.finditer(log):
        kv = _bytes(m.group(1), m.group(2))
    for m in _VLLM_TOKENS.finditer(log):
        tokens = int(m.group(1).replace(",", ""))
    if weights is None:
        model: dict[str, int] = {}
        cache: dict[str, int] = {}
        for m in _LLAMA_BUFFER.finditer(log):
            (model if m.group(2) == "model" else cache)[m.group(1)] = _bytes(m.group(3), m.group(4))
        if model:
            weights = sum(model.values())
        if cache:
            kv = sum(cache.values())
    return EngineMemory(weights, kv, tokens)
