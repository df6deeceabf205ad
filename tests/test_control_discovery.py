"""What a probe that only checks running replicas leaves out, per node (``discovery.carried``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from helpers import cpu_node, dgx, node

from cluster_cli.control.discovery import carried
from cluster_cli.facts import NodeFacts, Replica, Shard
from cluster_cli.state.records import ReplicaRecord, ShardRun
from cluster_cli.state.store import Store

HARDWARE = {"cpus", "meminfo", "topo"}


def _record(model: str, shards: list[str]) -> ReplicaRecord:
    rep = Replica(model, 0, "p", "vllm", tuple(Shard(n, (0,), ("mlx5_0",)) for n in shards), "ib-a")
    runs = tuple(ShardRun(n, "~/r", "t", pid=10 + i, start_time=1) for i, n in enumerate(shards))
    return ReplicaRecord(rep, port=8100, shards=runs)


def _cpu(name: str, **kw: Any) -> NodeFacts:
    return replace(cpu_node(name, **kw), nvlink_domains=())  # as a probe finds a CPU node: no NVLink


def test_what_each_node_leaves_out(tmp_path: Path) -> None:
    cpu = _cpu("cpu")
    gpu = dgx("gpu-a")
    fabric = dgx("gpu-b")
    broken = replace(
        node("gpu-c"), problems=("nvidia-smi: Failed to initialize NVML: Driver/library version mismatch",)
    )
    no_ib = replace(dgx("gpu-d"), problems=("ibstat: failed (rc 1): mad error",))
    unknown = _cpu("cpu-unknown", cpus=None, memory_gib=None)
    away = _cpu("cpu-away", reachable=False, error="no route")
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([cpu, gpu, fabric, broken, no_ib, unknown, away])
        records = [_record("big", ["gpu-b", "gpu-d"])]
        got = {name: left for name, (_, left) in carried(s.nodes(unreadable=[]), records).items()}
    assert got["cpu"] == HARDWARE | {"ibstat", "gpus", "apps"}  # a CPU node: nvidia-smi found nothing
    assert got["gpu-a"] == HARDWARE | {"ibstat"}  # its GPUs read again: their health keeps replicas
    assert got["gpu-b"] == HARDWARE  # a multi-node replica's shard: its ports are read again
    assert got["gpu-d"] == HARDWARE
    assert "gpus" not in got["gpu-c"] and "apps" not in got["gpu-c"]  # nvidia-smi failed: asked again
    assert got["cpu-unknown"] == {"topo", "ibstat", "gpus", "apps"}  # no CPU count or memory to take
    assert "cpu-away" not in got  # no facts to take: probed in full
