"""The state database as commands open it: for one command, or to read what it recorded."""

from __future__ import annotations

from pathlib import Path

from cluster_cli.state.store import Store


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
