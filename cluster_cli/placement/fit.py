"""Will a replica fit? The memory one GPU (or a CPU node) needs for a profile: pure arithmetic.

Per GPU of a replica: its share of the weights (the weights over tensor-parallel GPUs times
pipeline stages: a multi-node replica runs one stage per node), plus the KV cache of one
full context (``--max-model-len`` for vLLM, ``-c`` for llama.cpp) shared the same way, plus
the engine's own overhead (CUDA context, activations, graphs: ``ENGINE_OVERHEAD_GIB`` unless
the catalog says otherwise). vLLM takes ``--gpu-memory-utilization`` (0.9) of the GPU's total
memory at start, and refuses to start when that much is not free: the need must fit in that
share, and that share in what is free. llama.cpp allocates what it needs: the need must fit
in what is free. A CPU replica needs the same of its node's memory.

The model's size comes from the node (its files: ``probe.parsers.gguf``/``hfmodel``) or the
catalog (``weights_gib``, ``kv_gib_per_1k_tokens``); without either there is no estimate and
no check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster_cli.engines.memreport import EngineMemory
from cluster_cli.facts import ModelSize

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Profile

GIB = 1024**3
MIB = 1024**2
# What an engine holds beyond weights and KV cache: the CUDA context (~0.5 GiB), activations
# of a full batch and CUDA graphs for vLLM; llama.cpp's compute buffers. Measured defaults,
# overridden per engine in the catalog (engines.NAME.overhead_gib).
ENGINE_OVERHEAD_GIB = {"vllm": 2.0, "llamacpp": 0.5}
DEFAULT_OVERHEAD_GIB = 1.0
VLLM_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default
LLAMACPP_CONTEXT = 4096  # llama-server's -c default
# KV-cache element sizes by the engines' cache-type names (llama.cpp's quantised types carry
# a scale per block of 32: q8_0 is 34 bytes per 32 values).
KV_DTYPE_BYTES = {
    "auto": None,
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}


@dataclass(frozen=True)
class Estimate:
    """What one GPU of the replica (or its CPU node) needs, and of what."""

    need_bytes: int
    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int
    context: int
    shards: int  # GPUs (or nodes) the weights are divided over
    utilization: float | None  # vLLM's share of a GPU's total memory; None: what it needs
    source: str
    cpu: bool = False  # needed of a node's memory, not of a GPU's

    @property
    def per(self) -> str:
        return "node" if self.cpu else "GPU"

    def to_dict(self) -> dict[str, object]:
        return {
            "need_gib": round(self.need_bytes / GIB, 2),
            "weights_gib": round(self.weights_bytes / GIB, 2),
            "kv_gib": round(self.kv_bytes / GIB, 2),
            "overhead_gib": round(self.overhead_bytes / GIB, 2),
            "context": self.context,
            "shards": self.shards,
            "gpu_memory_utilization": self.utilization,
            "source": self.source,
            "per": self.per,
        }

    def describe(self) -> str:
        return (
            f"{self.need_bytes / GIB:.1f} GiB per {self.per}"
            f" (weights {self.weights_bytes / GIB:.1f} + KV {self.kv_bytes / GIB:.1f} at {self.context} tokens"
            f" + overhead {self.overhead_bytes / GIB:.1f})"
        )


def _option(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--x V`` or ``--x=V``), else None."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a[len(n) + 1 :]
    return found


def _positive(v: str | None, cast: type) -> float | int | None:
    try:
        x = cast(v) if v is not None else None
    except ValueError:
        return None
    return x if x is not None and x > 0 and math.isfinite(x) else None


def context_for(engine: str, args: Sequence[str], size: ModelSize) -> int:
    """The context the engine will allocate a KV cache for, from its arguments."""
    if engine == "llamacpp":
        c = _option(args, "-c", "--ctx-size")
        if c is not None and c.strip() == "0":
            return size.max_context or LLAMACPP_CONTEXT  # 0: the model's own
        return int(_positive(c, int) or LLAMACPP_CONTEXT)
    given = _positive(_option(args, "--max-model-len"), int)
    return int(given or size.max_context or LLAMACPP_CONTEXT)


def kv_element_bytes(engine: str, args: Sequence[str]) -> float | None:
    """The KV cache's bytes per element where the arguments change it, else None (the model's)."""
    if engine == "llamacpp":
        k = KV_DTYPE_BYTES.get((_option(args, "-ctk", "--cache-type-k") or "f16").lower(), 2.0)
        v = KV_DTYPE_BYTES.get((_option(args, "-ctv", "--cache-type-v") or "f16").lower(), 2.0)
        return ((k or 2.0) + (v or 2.0)) / 2
    return KV_DTYPE_BYTES.get((_option(args, "--kv-cache-dtype") or "auto").lower())


def utilization_for(engine: str, args: Sequence[str]) -> float | None:
    if engine != "vllm":
        return None
    u = _positive(_option(args, "--gpu-memory-utilization"), float)
    return min(float(u), 1.0) if u is not None else VLLM_UTILIZATION


def estimate(
    size: ModelSize,
    *,
    engine: str,
    gpus_per_node: int,
    nodes: int,
    args: Sequence[str] = (),
    overhead_gib: float | None = None,
) -> Estimate:
    """What each GPU of a replica (each node, for a CPU replica) needs (module notes)."""
    shards = max(1, gpus_per_node) * max(1, nodes)
    context = context_for(engine, args, size)
    kv_total = 0.0
    if size.kv_bytes_per_token is not None:
        per = size.kv_bytes_per_token
        elem = kv_element_bytes(engine, args)
        if elem is not None:
            per = per * elem / 2.0  # the size is at 2 bytes an element (f16/bf16)
        kv_total = per * context
    over = ENGINE_OVERHEAD_GIB.get(engine, DEFAULT_OVERHEAD_GIB) if overhead_gib is None else overhead_gib
    weights = math.ceil(size.weights_bytes / shards)
    kv = math.ceil(kv_total / shards)
    overhead = round(over * GIB)
    util = utilization_for(engine, args) if gpus_per_node > 0 else None
    cpu = gpus_per_node <= 0
    return Estimate(weights + kv + overhead, weights, kv, overhead, context, shards, util, size.source, cpu)


def shortfall(est: Estimate, total_bytes: int | None, used_bytes: int | None) -> str | None:
    """Why one GPU (or node) with this memory cannot hold ``est``, or None when it can.

    Unknown memory is no reason: the check is skipped (as every constraint treats the unknown).
    """
    if total_bytes is None:
        return None
    free = total_bytes - (used_bytes or 0)
    if est.utilization is not None:
        budget = est.utilization * total_bytes
        if est.need_bytes > budget:
            return (
                f"weights do not fit (needs {est.need_bytes / GIB:.1f} GiB per GPU,"
                f" {budget / GIB:.1f} at gpu_memory_utilization {est.utilization:g})"
            )
        if budget > free:
            return f"not enough free memory (vLLM takes {budget / GIB:.1f} GiB per GPU at start, {free / GIB:.1f} free)"
        return None
    if est.need_bytes > free:
        return f"weights do not fit (needs {est.need_bytes / GIB:.1f} GiB per {est.per}, {free / GIB:.1f} free)"
    return None


def catalog_size(p: Profile) -> ModelSize | None:
    """The size a profile gives itself (``weights_gib``, ``kv_gib_per_1k_tokens``), if any."""
    if p.weights_gib is None:
        return None
    kv = None if p.kv_gib_per_1k_tokens is None else p.kv_gib_per_1k_tokens * GIB / 1000
    return ModelSize(round(p.weights_gib * GIB), kv, None, "catalog")


def need_of(p: Profile, size: ModelSize | None, overhead_gib: float | None = None) -> Estimate | None:
    """What one GPU (or the node) of a replica of ``p`` needs, for a model of ``size``."""
    if size is None:
        return None
    return estimate(
        size, engine=p.engine, gpus_per_node=p.gpus_per_node, nodes=p.nodes, args=p.args, overhead_gib=overhead_gib
    )


MISS = 0.25  # an engine's reading off the estimate by more than this share is worth telling


def misses(est: Estimate, got: EngineMemory) -> list[str]:
    """What the engine reported of its memory (``engines.memreport``) that is off the estimate by
    more than ``MISS``, so that the defaults can be tuned from real runs (empty: none)."""
    out = []

    def off(estimated: float, reported: float) -> bool:
        return estimated > 0 and abs(reported - estimated) > MISS * estimated

    if got.weights_bytes is not None and off(est.weights_bytes, got.weights_bytes):
        out.append(
            f"weights: estimated {est.weights_bytes / GIB:.2f} GiB per {est.per}, "
            f"the engine loaded {got.weights_bytes / GIB:.2f}"
        )
    if got.kv_bytes is not None and est.kv_bytes:
        if got.kv_tokens:  # vLLM fills what is left: compare per token
            mine = est.kv_bytes / est.context
            theirs = got.kv_bytes / got.kv_tokens
            if off(mine, theirs):
                out.append(f"KV cache: estimated {mine:.0f} bytes a token per {est.per}, the engine {theirs:.0f}")
        elif off(est.kv_bytes, got.kv_bytes):
            out.append(
                f"KV cache: estimated {est.kv_bytes / GIB:.2f} GiB, the engine allocated {got.kv_bytes / GIB:.2f}"
            )
    return out
