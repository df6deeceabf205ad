"""What the state records of a launched replica: enough for any later command (``status``,
``down``, ``supervise``) to find each of its processes on its node again, and to tell them
from a stranger that took the same PID."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster_cli.facts import Replica

# Observed states of a replica (the ``status`` column). ``stopping``: being stopped (taken
# down, or released); ``fenced``: its stop could not be confirmed, so its GPUs and ports stay
# held and a fence record names what may still run, until a later stop confirms it gone.
PLANNED, STARTING, READY, UNHEALTHY, FAILED = "planned", "starting", "ready", "unhealthy", "failed"
STOPPING, STOPPED, FENCED = "stopping", "stopped", "fenced"
STATES = (PLANNED, STARTING, READY, UNHEALTHY, FAILED, STOPPING, STOPPED, FENCED)
UP, DOWN = "up", "down"  # desired
DESIRED = (UP, DOWN)


def replica_name(model: str, replica: int) -> str:
    """``MODEL/N``: how a replica is named everywhere (state, status, logs, down, router config)."""
    return f"{model}/{replica}"


@dataclass(frozen=True)
class ShardRun:
    """One shard's process on its node. ``start_time`` is the process's start in clock ticks
    since boot (``/proc/PID/stat`` field 22): a PID is signalled only while it still matches.
    ``token`` is in the environment of every process of the shard (its workers included)."""

    node: str
    run_dir: str  # the per-replica folder on the node, as the node's shell writes it ("~/..." allowed)
    token: str
    pid: int | None = None
    start_time: int | None = None
    gpu_uuids: tuple[str, ...] = ()
    boot_id: str | None = None  # the node's /proc/sys/kernel/random/boot_id when it started

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "run_dir": self.run_dir,
            "token": self.token,
            "pid": self.pid,
            "start_time": self.start_time,
            "gpu_uuids": list(self.gpu_uuids),
            "boot_id": self.boot_id,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardRun:
        return cls(
            node=str(d["node"]),
            run_dir=str(d["run_dir"]),
            token=str(d["token"]),
            pid=d.get("pid"),
            start_time=d.get("start_time"),
            gpu_uuids=tuple(d.get("gpu_uuids") or ()),
            boot_id=d.get("boot_id"),
        )


@dataclass(frozen=True)
class ReplicaRecord:
    """A replica as the state holds it: its placement, generation, desired and observed state,
    where it serves, and its shards' processes."""

    replica: Replica
    generation: int = 1
    status: str = PLANNED
    desired: str = UP
    endpoint: str | None = None  # http://HOST:PORT, once started
    port: int | None = None  # the HTTP port on shard 0's node
    shards: tuple[ShardRun, ...] = ()
    started_at: float | None = None
    restarts: int = 0
    detail: str | None = None
    updated_at: float | None = None
    extra_ports: tuple[int, ...] = field(default=())  # other ports held on shard 0's node (a Ray head's)
    owner: str | None = None  # the run (control.runs) that last set it planned or starting
    revision: int = 0  # the row's revision when read: a write of an older one is refused

    @property
    def name(self) -> str:
        return replica_name(self.replica.model, self.replica.replica)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.replica.model, self.replica.replica, self.generation)

    def runtime(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "extra_ports": list(self.extra_ports),
            "shards": [s.to_dict() for s in self.shards],
            "owner": self.owner,
        }

    @staticmethod
    def parse_runtime(doc: dict[str, Any] | None) -> dict[str, Any]:
        doc = doc or {}
        return {
            "port": doc.get("port"),
            "extra_ports": tuple(doc.get("extra_ports") or ()),
            "shards": tuple(ShardRun.from_dict(s) for s in doc.get("shards") or ()),
            "owner": doc.get("owner"),
        }


@dataclass(frozen=True)
class Fence:
    """A shard that may still run although its replica was released: its stop could not be
    confirmed (its node did not answer, or processes, its port or GPU processes were left).
    Kept until a later stop on ``node`` finds nothing of ``token`` left."""

    node: str
    run_dir: str
    token: str
    model: str
    replica: int
    generation: int
    since: float
    reason: str
    pid: int | None = None
    start_time: int | None = None
    checked_at: float | None = None

    @property
    def name(self) -> str:
        return replica_name(self.model, self.replica)

    @property
    def run(self) -> ShardRun:
        return ShardRun(self.node, self.run_dir, self.token, self.pid, self.start_time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "run_dir": self.run_dir,
            "token": self.token,
            "replica": self.name,
            "generation": self.generation,
            "since": self.since,
            "reason": self.reason,
            "pid": self.pid,
            "checked_at": self.checked_at,
        }
