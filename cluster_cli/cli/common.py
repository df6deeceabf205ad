"""Small helpers shared by command modules."""

from __future__ import annotations

import os
from pathlib import Path

from cluster_cli.cli import ui
from cluster_cli.config.inventory import ACCEPT_NEW, Inventory, load_inventory
from cluster_cli.errors import ClusterctlError, ConfigError
from cluster_cli.state.store import Store

INVENTORY_HELP = "Inventory YAML (nodes and how to reach them)."


def inventory_or_abort(path: Path, *, check_files: bool = False) -> Inventory:
    """Load the inventory; with ``check_files`` also verify identity and known_hosts files exist."""
    try:
        inv = load_inventory(path)
        if check_files:
            check_ssh_files(inv, path)
        return inv
    except ClusterctlError as e:
        ui.fail(e)


def check_ssh_files(inv: Inventory, path: Path) -> None:
    for i, n in enumerate(inv.nodes):
        t = inv.ssh_target(n)
        if t.identity_file and not os.path.exists(t.identity_file):
            raise ConfigError(f"{path}: nodes.{i} ({n.name}): identity file not found: {t.identity_file}")
        if t.known_hosts != ACCEPT_NEW and not os.path.exists(t.known_hosts):
            raise ConfigError(
                f"{path}: nodes.{i} ({n.name}): known_hosts file not found: {t.known_hosts} "
                "(create it, or set known_hosts: accept-new to pin keys on first contact)"
            )


def open_store(path: Path, *, create: bool = True) -> Store:
    try:
        return Store(path, create=create)
    except ClusterctlError as e:
        ui.fail(e)
