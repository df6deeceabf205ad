"""The engine adapter interface: what clusterctl needs to know about an inference engine.

An adapter validates a profile, builds the command line and environment of one
replica shard, names the health path, and maps the engine's Prometheus metric names
onto the three load signals the router balances on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

# vLLM's names, the default for an empty mapping (as the router config promises).
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE = "vllm:kv_cache_usage_perc"
VLLM_KV_CACHE_LEGACY = "vllm:gpu_cache_usage_perc"  # the only name before 0.9.2; since removed (vLLM PR #29330)

METRIC_KEYS = ("running", "waiting", "kv_cache_usage")
RAY_PORT = 6379  # a Ray head's GCS port by default (Ray's and vLLM's multi-node docs)


@dataclass(frozen=True)
class MetricMapping:
    """Metric names for the load signals; ``None`` means the engine does not export it.

    A signal whose name is ``None`` is *unknown*, never zero.
    ``fallbacks`` lists alternative names per signal, tried in order when the primary
    name is absent from a scrape (e.g. vLLM's pre-0.9.2 KV-cache gauge).
    """

    running: str | None
    waiting: str | None
    kv_cache_usage: str | None
    fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def vllm(cls) -> MetricMapping:
        return cls(VLLM_RUNNING, VLLM_WAITING, VLLM_KV_CACHE, {"kv_cache_usage": (VLLM_KV_CACHE_LEGACY,)})

    @classmethod
    def from_config(cls, mapping: Mapping[str, str | None] | None) -> MetricMapping:
        """Resolve a config mapping.

        Empty -> vLLM's names. A mapping that names its own ``running`` metric is a
        complete statement: what it leaves out stays unknown; so is one that gives
        ``running`` as null or "" (the engine exports none: the router's own in-flight
        count stands in). A mapping without ``running`` overrides single names on top
        of vLLM's.
        """
        mapping = dict(mapping or {})
        unknown = set(mapping) - set(METRIC_KEYS)
        if unknown:
            raise ValueError(f"unknown metric key(s): {', '.join(sorted(unknown))}; use {', '.join(METRIC_KEYS)}")
        if not mapping:
            return cls.vllm()
        if "running" in mapping:
            return cls(
                mapping["running"] or None, mapping.get("waiting") or None, mapping.get("kv_cache_usage") or None
            )
        base = cls.vllm()
        return cls(
            base.running,
            mapping.get("waiting", base.waiting) or None,
            mapping.get("kv_cache_usage", base.kv_cache_usage) or None,
            {} if "kv_cache_usage" in mapping else base.fallbacks,
        )

    @classmethod
    def checked(cls, mapping: dict[str, str | None] | None) -> dict[str, str | None] | None:
        """``mapping`` as given, once ``from_config`` reads it (a config field's validator)."""
        if mapping is not None:
            cls.from_config(mapping)  # raises ValueError naming the bad key
        return mapping

    def names(self, signal: str) -> tuple[str, ...]:
        primary = getattr(self, signal)
        if primary is None:
            return ()
        return (primary, *self.fallbacks.get(signal, ()))

    def to_config(self) -> dict[str, str | None]:
        """What ``from_config`` reads back as this mapping (a blank running metric stays blank)."""
        base = MetricMapping.vllm()
        if self.fallbacks and self.running == base.running:
            # Overrides on top of vLLM's names (only those have fallbacks): written as such, so
            # that the names left as vLLM's keep their fallbacks when read back.
            return {k: v for k in METRIC_KEYS if (v := getattr(self, k)) != getattr(base, k)}
        out: dict[str, str | None] = {k: v for k in METRIC_KEYS if (v := getattr(self, k)) is not None}
        if self.running is None:
            out["running"] = None
        return out


@dataclass(frozen=True)
class LaunchSpec:
    """One shard of one replica, as the launcher starts it."""

    model: str  # path or hub id the engine loads
    served_name: str  # the model id clients ask for
    host: str
    port: int
    gpus: tuple[int, ...] = ()
    # The same GPUs by UUID (nvidia-smi's "GPU-..."): what CUDA_VISIBLE_DEVICES names when known,
    # as indices move when a GPU falls off the bus.
    gpu_uuids: tuple[str, ...] = ()
    tensor_parallel: int = 1
    nodes: int = 1
    node_rank: int = 0
    head_address: str | None = None  # multi-node: the rank-0 shard's address
    # Multi-node: the port of this replica's Ray head. Two replicas whose shards share a node
    # must have their own (a second head on a port in use fails, and its workers would join
    # the first replica's cluster): the launcher hands each replica one, as it does HTTP ports.
    ray_port: int = RAY_PORT
    # Multi-node: the port of this replica's Ray Client server, on a head whose Ray has
    # ray[client] (10001 for every head otherwise: two on one node would collide).
    ray_client_port: int | None = None
    cpus: int | None = None
    extra_args: tuple[str, ...] = ()
    hcas: tuple[str, ...] = ()  # multi-node: this shard's InfiniBand CA names on the replica's fabric
    # Multi-node: this node's address as the other nodes reach it. On a machine with several
    # networks, Ray and vLLM may each pick another one and never find each other (vLLM's
    # troubleshooting guide: set VLLM_HOST_IP per node); given, both are told.
    node_address: str | None = None
    # The API key the engine's API server demands (``Authorization: Bearer KEY``): given to it in
    # its environment only (VLLM_API_KEY, LLAMA_API_KEY), never on its command line, where any
    # user of the node could read it (ps, /proc/PID/cmdline). None: the engine is open.
    api_key: str | None = field(default=None, repr=False)


def cuda_env(gpus: tuple[int, ...], uuids: tuple[str, ...] = ()) -> dict[str, str]:
    """Make exactly ``gpus`` (nvidia-smi indices) visible to CUDA, and nothing else.

    By UUID when ``uuids`` (the same GPUs, in order) are known: an index names another GPU
    once one falls off the bus. nvidia-smi numbers GPUs in PCI bus order while CUDA's default
    order is fastest first, so indices only name the same devices under
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (set either way: it also orders the UUIDs' devices).
    No GPUs gives ``CUDA_VISIBLE_DEVICES=""``: no device visible at all.
    """
    if not gpus:
        return {"CUDA_VISIBLE_DEVICES": ""}
    names = uuids if len(uuids) == len(gpus) else tuple(str(g) for g in gpus)
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(names)}


class Engine(Protocol):
    name: str
    supports_cpu: bool
    health_path: str
    metrics: MetricMapping
    api_key_env: str  # the variable the engine reads its API key from (LaunchSpec.api_key goes there)

    def validate_profile(self, *, gpu_class: str | None, gpus: int, nodes: int) -> str | None:
        """Return a one-line reason the profile cannot run on this engine, or None."""
        ...

    def command(self, spec: LaunchSpec, *, binary: str) -> list[str]:
        """argv of this shard's process (each element is one shlex.quote-able argument)."""
        ...

    def env(self, spec: LaunchSpec) -> dict[str, str]:
        """Extra environment of the shard's process; an empty value is meaningful and must be kept.
        It carries ``spec.api_key`` (in the engine's own variable) for the shard that serves HTTP."""
        ...
