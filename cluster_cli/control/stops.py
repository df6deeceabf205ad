"""Stopping a replica whole, and what the state keeps when a stop cannot be confirmed.

A stop is confirmed when, on every shard's node, no process carries the shard's marker, its
port is closed and nvidia-smi lists none of its processes. A shard whose node does not
answer, or where something was left, is *left*: its replica is released as ``fenced`` (its
GPUs and ports stay held) with a fence record, and a later stop on that node (``clear``,
which ``up`` and ``down`` run) confirms it gone and frees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from cluster_cli.errors import SSHError
from cluster_cli.state.launches import StaleRecord
from cluster_cli.state.records import FENCED, STOPPED, Fence, ReplicaRecord, ShardRun

if TYPE_CHECKING:
    from cluster_cli.control.nodes import Nodes
    from cluster_cli.state.aio import AsyncStore

STOP_GRACE_S = 10.0
T = TypeVar("T")


@dataclass
class StopResult:
    """What stopping every shard of a replica found."""

    left: list[tuple[ShardRun, str]] = field(default_factory=list)  # shards that may still run, with why
    log: list[str] = field(default_factory=list)  # shard 0's log tail

    @property
    def confirmed(self) -> bool:
        return not self.left

    def problem(self) -> str:
        return "; ".join(f"{run.node}: {why}" for run, why in self.left)


async def stop_shards(rec: ReplicaRecord, nodes: Nodes, *, grace_s: float = STOP_GRACE_S) -> StopResult:
    """Stop every shard of ``rec`` at once and check that nothing of it is left (processes,
    shard 0's port, GPU processes); a shard whose node does not answer is left."""
    out = StopResult()

    async def one(i: int, run: ShardRun) -> None:
        port = rec.port if i == 0 else None
        try:
            node = await nodes.get(run.node)
            res = await node.stop(run, grace_s=grace_s, port=port, gpu_check=bool(run.gpu_uuids))
        except (SSHError, OSError) as e:
            out.left.append((run, f"its node did not answer the stop ({e})"))
            return
        if i == 0:
            out.log.extend(res.log)
        if not res.clean:
            out.left.append((run, res.problem()))

    await asyncio.gather(*(one(i, run) for i, run in enumerate(rec.shards)))
    return out


async def release(
    store: AsyncStore, rec: ReplicaRecord, stopped: StopResult, *, why: str, wanted_down: bool = False
) -> ReplicaRecord | None:
    """Release ``rec`` after its stop: whole, or fenced with what was left. A row another
    writer touched meanwhile (a ``status`` that recorded its health) is read again and
    released at its new revision, unless that writer changed what runs (another start) or
    what is wanted of it (a ``down``, a release): then it is that writer's, and left as it
    is (None)."""
    return await cas(
        store,
        rec,
        lambda cur: store.release(cur, wanted_down=wanted_down, why=why, left=stopped.left),
        same=lambda cur: (
            cur.shards == rec.shards and cur.desired == rec.desired and cur.status not in (STOPPED, FENCED)
        ),
    )


async def cas(
    store: AsyncStore,
    rec: ReplicaRecord,
    write: Callable[[ReplicaRecord], Awaitable[T]],
    *,
    same: Callable[[ReplicaRecord], bool],
    tries: int = 5,
) -> T | None:
    """``write(rec)``; when the row moved on meanwhile, read it again and, while ``same(row)``
    says the change is not one that matters to this write, write at the new revision.
    None when the row went, or changed in a way that does."""
    cur = rec
    for _ in range(tries):
        try:
            return await write(cur)
        except StaleRecord:
            got = await store.record(*rec.key)
            if got is None or not same(got):
                return None
            cur = got
    return None


async def clear(store: AsyncStore, nodes: Nodes, fences: list[Fence]) -> list[Fence]:
    """Stop every fenced shard again, on the nodes that answer; those confirmed gone are
    unfenced (their replica's GPUs and ports freed once none of it is left). The fences
    still standing."""

    async def one(f: Fence) -> Fence | None:
        try:
            res = await (await nodes.get(f.node)).stop(f.run, grace_s=STOP_GRACE_S, gpu_check=True)
        except (SSHError, OSError):
            return f
        if res.clean:
            await store.unfence(f.token)
            return None
        await store.fence_checked(f.token, res.problem())
        return f

    left = await asyncio.gather(*(one(f) for f in fences))
    return [f for f in left if f is not None]
