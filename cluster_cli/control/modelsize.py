"""Read the size of the catalog's models on the nodes, for the memory-fit check.

For each model a profile names without giving its size (``weights_gib``), one node that has
it answers (``probe.modelfiles``): its files are listed, and read only when the listing
differs from the one the state cached. A model found on no node, or unreadable, has no size:
it is not checked (and said so). Without a session pool (a test fleet), the cache alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from cluster_cli.config.catalog import Catalog
from cluster_cli.facts import ModelSize, NodeFacts
from cluster_cli.probe.modelfiles import ModelFileError, parse_stat, read_command, size_of, stat_command

TRIES = 3  # nodes asked per model before it is taken as absent
TIMEOUT_S = 20.0


def unsized(cat: Catalog) -> list[str]:
    """The models profiles name without giving their size, once each, in catalog order."""
    out: dict[str, None] = {}
    for m in cat.models:
        for p in m.profiles:
            if p.weights_gib is None and p.model:
                out.setdefault(p.model, None)
    return list(out)


async def read_sizes(
    cat: Catalog,
    nodes: Sequence[NodeFacts],
    sessions: Any,
    store: Any,
    *,
    listings: dict[str, dict[int, str]] | None = None,
    models: Sequence[str] | None = None,
) -> tuple[dict[str, ModelSize], list[str]]:
    """Sizes of ``cat``'s unsized models (read on ``nodes``, reachable ones first, through
    ``sessions``; cached in ``store``), and a line for each model that could not be read.
    ``listings``: what the probe's batch listed of ``models`` on each node (node -> the
    model's number -> its listing): the nodes that have a model are asked first, and its
    files are read only when the cache lacks that listing."""
    cached = await store.model_sizes()
    reachable = [n.name for n in nodes if n.reachable]
    order = list(models) if models is not None else unsized(cat)
    sizes: dict[str, ModelSize] = {}
    notes: list[str] = []

    async def one(i: int, model: str) -> None:
        last = f"{model}: no reachable node to read it on"
        listed: dict[str, str] = {}
        if listings is not None:
            answered = [out[i] for out in listings.values() if i in out]
            listed = {n: out[i] for n, out in listings.items() if i in out and not out[i].startswith("N")}
            if answered and not listed:
                notes.append(f"{model}: not found on any node")
                return
        names = [n for n in reachable if n in listed] + [n for n in reachable if n not in listed]
        for node in names[:TRIES]:
            try:
                session = await sessions.get(node)
                out = listed.get(node)
                if out is None:
                    out = (await session.run(stat_command(model), timeout=TIMEOUT_S)).stdout
                listing = parse_stat(out, model)
                hit = cached.get(model)
                if hit is not None and hit[0] == listing.key():
                    sizes[model] = hit[1]
                    return
                rc, content, err = await session.run_raw(read_command(listing), timeout=TIMEOUT_S)
                if rc != 0 and not content:
                    raise ModelFileError(f"{model}: {err.decode('utf-8', 'replace').strip()[:200] or f'rc {rc}'}")
                size = size_of(listing, content, model)
            except ModelFileError as e:
                last = f"{e} ({node})"
                continue
            except Exception as e:  # a node that fails says so, and the next is asked
                last = f"{model}: {node}: {type(e).__name__}: {e}"[:300]
                continue
            sizes[model] = size
            await store.save_model_size(model, listing.key(), size)
            return
        notes.append(last)

    await asyncio.gather(*(one(i, m) for i, m in enumerate(order)))
    return sizes, notes
