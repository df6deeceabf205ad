"""Engine adapters, looked up by the name used in catalogs and router configs."""

from __future__ import annotations

from cluster_cli.engines.base import Engine, LaunchSpec, MetricMapping
from cluster_cli.engines.llamacpp import LlamaCpp
from cluster_cli.engines.vllm import VLLM

ENGINES: dict[str, Engine] = {"vllm": VLLM(), "llamacpp": LlamaCpp()}


def get_engine(name: str) -> Engine | None:
    return ENGINES.get(name)


__all__ = ["ENGINES", "Engine", "LaunchSpec", "MetricMapping", "get_engine"]
