"""``control.up.up`` where nothing is started: what it reports and records, with no node
contacted (nothing is placed, so no session is ever asked for)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from helpers import catalog, cpu_node, profile

from cluster_cli.config.inventory import Inventory
from cluster_cli.control import discovery
from cluster_cli.control.up import up
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.store import Store


class _NoSessions:
    async def get(self, node: str) -> Any:
        raise AssertionError(f"no node should be contacted ({node})")


def test_a_replica_no_node_can_take_is_reported_unplaced_in_places_words(tmp_path: Path) -> None:
    inv = Inventory.model_validate({"nodes": [{"name": "cpu-01", "host": "h1"}, {"name": "cpu-02", "host": "h2"}]})
    cat = catalog(("big", 1, [profile("h100-tp8", gpu_class="H100", gpus=8)]))
    with Store(tmp_path / "s.db", actor="up") as s:
        s.save_discovery([replace(cpu_node("cpu-01"), probed_at=1.0), replace(cpu_node("cpu-02"), probed_at=1.0)])

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await up(inv, cat, astore, _NoSessions(), lambda: discovery.fleet(inv, astore, placeable=True),  # type: ignore[arg-type]
                                router_config=tmp_path / "router.yaml", catalog_doc=cat.model_dump(mode="json"))  # fmt: skip

        result = asyncio.run(go())
        (o,) = result.outcomes
        assert (o.name, o.action, o.state) == ("big/0", "unplaced", "unplaced")
        assert o.reason == "h100-tp8: 0/2 nodes are available: 2 no H100 gpu.", o.reason
        assert not result.complete and (tmp_path / "router.yaml").exists()
        stored = s.catalog()
        assert stored is not None and stored.doc["models"][0]["name"] == "big"  # the desired state, kept
