"""Cordons of single GPUs (a part of ``Store``): placement puts nothing new on a GPU an
operator took out (an Xid storm, a flaky NVLink), the rest of its node stays in service.
Kept in the ``meta`` table, one row per GPU (``gpu-cordon:NODE:INDEX``), so no migration is
needed; like a node's cordon, discover never writes them, and each change is an event and a
new state version."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cluster_cli.facts import NodeFacts
from cluster_cli.state.backend import Tx
from cluster_cli.state.meta import bump, get_meta, set_meta

_KEY = "gpu-cordon:"
PROBLEM = "cordoned"  # the GPU problem's key: not free, yet healthy (its replicas stay)


def _key(node: str, gpu: int) -> str:
    return f"{_KEY}{node}:{gpu}"


def gpu_cordons_of(tx: Tx) -> dict[tuple[str, int], dict[str, Any]]:
    rows = tx.execute("SELECT key, value FROM meta WHERE key LIKE ?", (_KEY + "%",)).fetchall()
    out = {}
    for key, value in rows:
        node, _, gpu = key[len(_KEY) :].rpartition(":")
        out[(node, int(gpu))] = json.loads(value)
    return out


def apply_gpu_cordons(f: NodeFacts, cordons: dict[tuple[str, int], dict[str, Any]]) -> NodeFacts:
    """``f`` with each cordoned GPU carrying the problem ``cordoned: REASON``."""
    mine = {gpu: c for (node, gpu), c in cordons.items() if node == f.name}
    if not mine:
        return f
    gpus = tuple(
        replace(g, problems=(*g.problems, f"{PROBLEM}: {mine[g.index]['reason']}")) if g.index in mine else g
        for g in f.gpus
    )
    return replace(f, gpus=gpus)


class GpuCordons:
    """Mixed into ``Store``."""

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...

    def cordon_gpu(self, node: str, gpu: int, reason: str) -> dict[str, Any] | None:
        """Cordon GPU ``gpu`` of ``node``; the cordon it replaced (``reason``, ``created_at``), if any.
        The same reason again changes nothing."""
        with self._tx() as tx:
            found = get_meta(tx, _key(node, gpu))
            was = json.loads(found) if found is not None else None
            if was is not None and was["reason"] == reason:
                return was
            doc = {"reason": reason, "created_at": was["created_at"] if was else time.time()}
            set_meta(tx, _key(node, gpu), json.dumps(doc))
            bump(tx)
            said = f"GPU {gpu}: {reason}" + (f" (was: {was['reason']})" if was else "")
            self._event(tx, "cordon", said, node=node)
        return was

    def uncordon_gpu(self, node: str, gpu: int) -> bool:
        """Lift the cordon of GPU ``gpu`` of ``node``; whether it had one."""
        with self._tx() as tx:
            n = tx.execute("DELETE FROM meta WHERE key=?", (_key(node, gpu),)).rowcount
            if n:
                bump(tx)
                self._event(tx, "uncordon", f"GPU {gpu}: cordon lifted", node=node)
        return n > 0

    def gpu_cordons(self) -> dict[tuple[str, int], dict[str, Any]]:
        with self._read() as tx:
            return gpu_cordons_of(tx)
