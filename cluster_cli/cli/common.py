"""Small helpers shared by command modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster_cli.cli import ui
from cluster_cli.config.inventory import Inventory, load_inventory
from cluster_cli.control import statefile
from cluster_cli.errors import ClusterctlError
from cluster_cli.ssh.preflight import check_ssh_files, pinned_hosts_path, where

if TYPE_CHECKING:
    from cluster_cli.state.store import Store

INVENTORY_HELP = "Inventory YAML (nodes and how to reach them)."
INVENTORY_ENV = "CLUSTERCTL_INVENTORY"
RECORDED_INVENTORY_HELP = (
    "Inventory YAML (nodes and how to reach them). Default: the one recorded in the state (by discover, or cordon -i)."
)


def stored_inventory(state_path: Path) -> Path | None:
    """The inventory recorded in the state (by ``discover``, or a ``cordon -i`` before it);
    None when there is no state or none is recorded."""
    try:
        return statefile.recorded_inventory(state_path)
    except ClusterctlError as e:
        ui.fail(e)


def recorded_inventory(given: Path | None, state_path: Path) -> Path:
    """``given``, else the inventory recorded in the state; aborts if neither."""
    if given is not None:
        return given
    recorded = stored_inventory(state_path)
    if recorded is None:
        where = f"none recorded in {state_path}" if state_path.exists() else f"no state at {state_path} to take it from"
        ui.abort(
            f"no inventory given (-i INVENTORY or {INVENTORY_ENV}) and {where} "
            "(a 'clusterctl discover -i INVENTORY' records it)"
        )
    if not recorded.is_file():
        ui.abort(
            f"{recorded}: the inventory recorded in {state_path} (by the last discover, or a cordon -i before it) "
            "is gone; pass -i"
        )
    return recorded


def inventory_or_abort(path: Path, *, check_files: bool = False, state_path: Path | None = None) -> Inventory:
    """Load the inventory; with ``check_files`` also verify the local SSH files (keys,
    known_hosts, ssh_config, and the accept-new pin file beside ``state_path``)."""
    try:
        inv = load_inventory(path)
        if check_files:
            pinned = pinned_hosts_path(state_path) if state_path is not None else None
            check_ssh_files(inv, path, pinned, warn=ui.warn)
    except ClusterctlError as e:
        ui.fail(e)
    if check_files:  # about to connect: the same machine twice is worth a word
        for i, message in inv.shared_addresses():
            at = where(path, ("nodes", i, "host"), inv.nodes[i].name)
            ui.warn(f"{at}: {message}: one machine under two names? (placement uses its GPUs once)")
    return inv


def open_store(path: Path, *, actor: str, create: bool = True, say_new: bool = False) -> Store:
    """Open the state database; ``create`` makes a missing one (and its folders).
    ``say_new``: a command that only changes the state (cordon) says so on stderr when the
    state did not exist, so that a typo in --state / CLUSTERCTL_STATE shows at once.
    ``actor`` (the command's name) is who the events it writes name."""
    new = create and not path.exists()
    try:
        store = statefile.open_state(path, create=create, actor=actor)
    except ClusterctlError as e:
        ui.fail(e)
    if new and say_new:
        ui.warn(f"{path}: no state there yet: created a new one (check --state / CLUSTERCTL_STATE if unexpected)")
    return store
