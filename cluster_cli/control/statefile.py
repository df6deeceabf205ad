"""The state database as commands open it: for one command, or to read what it recorded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster_cli.state.store import Store

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.state.aio import AsyncStore


def open_state(path: Path, *, actor: str, create: bool = True) -> Store:
    """The state at ``path``; ``create`` makes a missing one (and its folders). ``actor`` (the
    command's name) is who the events it writes name. Raises ClusterctlError."""
    return Store(path, create=create, actor=actor)


def recorded_inventory(state_path: Path) -> Path | None:
    """The inventory recorded in the state (by ``discover``, or a ``cordon -i`` before it);
    None when there is no state or none is recorded. Raises ClusterctlError."""
    if not state_path.exists():
        return None
    with Store(state_path, readonly=True) as store:
        return store.inventory()


async def stored_catalog(store: AsyncStore) -> Catalog:
    """The catalog the last ``up`` applied, as the state keeps it. Raises ConfigError when
    there is none (no ``up`` yet)."""
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.errors import ConfigError

    stored = await store.catalog()
    if stored is None:
        raise ConfigError(f"{store.store.path}: no catalog applied yet: run 'clusterctl up -c CATALOG' first")
    try:
        return Catalog.model_validate(stored.doc)
    except ValueError as e:
        first = str(e).splitlines()[1:2] or [str(e)]
        raise ConfigError(
            f"{store.store.path}: the catalog the last up stored does not read back ({first[0].strip()}): "
            "run 'clusterctl up -c CATALOG' again, or give -c"
        ) from None
