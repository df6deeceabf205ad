"""A supervisor's heartbeat: one cheap look at every node at once.

Each node runs one script over its kept-open session (``launch.node.heartbeat``: its boot id, whether
each recorded shard still runs, every marked process and shard folder; 4 processes started
there, no nvidia-smi), so that a tick every 2 s costs each node a few milliseconds. What it
returns is data only: nothing is written to the state, nothing is started or stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from cluster_cli.errors import ClusterctlError
from cluster_cli.launch.shards import DEFAULT_RUN_DIR

if TYPE_CHECKING:
    from cluster_cli.control.nodes import Nodes
    from cluster_cli.launch.node import Beat
    from cluster_cli.state.records import ShardRun


NO_ANSWER = "no answer within"  # how a heartbeat that timed out is told from a refused connection


def timed_out(why: str) -> bool:
    """Whether ``beat``'s line for a node says it did not answer in time (it may be slow, not
    gone), rather than that its connection failed."""
    return NO_ANSWER in why


async def beat(
    nodes: Nodes,
    shards: Mapping[str, Sequence[ShardRun]],
    run_dirs: Mapping[str, str],
    timeout_s: float,
) -> dict[str, Beat | str]:
    """Every node of ``shards`` (node -> the shards recorded there) at once, reached
    through ``nodes``: its ``Beat``, or
    why there is none, as one line (it did not answer within ``timeout_s``, connecting
    included; its SSH connection failed or was lost; its answer was cut short). A node that
    fails never holds up nor fails the others. ``run_dirs``: each node's run folder
    (``Inventory.run_dir``; the default where a node has none)."""

    async def one(node: str, runs: list[ShardRun]) -> Beat | str:
        run_dir = run_dirs.get(node, DEFAULT_RUN_DIR)
        try:
            async with asyncio.timeout(timeout_s):
                return await (await nodes.get(node)).heartbeat(runs, run_dir, timeout=timeout_s)
        except TimeoutError:
            return f"{node}: {NO_ANSWER} {timeout_s:g} s"
        except (ClusterctlError, OSError, asyncio.IncompleteReadError) as e:
            why = str(e) or type(e).__name__
            return why if why.startswith(f"{node}:") else f"{node}: {why}"

    names = list(shards)
    got = await asyncio.gather(*(one(n, list(shards[n])) for n in names))
    return dict(zip(names, got, strict=True))
