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
    """Local SSH mistakes are configuration errors (exit 2, nothing saved), not 64 unreachable nodes."""
    import asyncssh  # only the commands that connect pay for it

    if inv.ssh_config:
        cfg = inv.resolve_path(inv.ssh_config)
        if not os.path.isfile(cfg):
            raise ConfigError(f"{path}: ssh_config: not a readable file: {cfg}")
    keys_ok: set[str] = set()
    for i, n in enumerate(inv.nodes):
        t = inv.ssh_target(n)
        where = f"{path}: nodes.{i} ({n.name})"
        key = t.identity_file
        if key and key not in keys_ok:
            if not os.path.exists(key):
                raise ConfigError(f"{where}: identity file not found: {key}")
            if not os.path.isfile(key):
                raise ConfigError(f"{where}: identity file is not a file: {key}")
            try:
                asyncssh.read_private_key(key)
            except asyncssh.KeyImportError as e:
                why = str(e)
                if "passphrase" in why.lower():
                    why = "it is passphrase-protected: load it into ssh-agent and leave identity_file unset"
                raise ConfigError(f"{where}: identity file {key} unusable: {why}") from None
            except OSError as e:
                raise ConfigError(f"{where}: identity file {key}: {e.strerror or e}") from None
            keys_ok.add(key)
        if t.known_hosts != ACCEPT_NEW and not os.path.isfile(t.known_hosts):
            raise ConfigError(
                f"{where}: known_hosts file not found: {t.known_hosts} "
                "(create it, or set known_hosts: accept-new to pin keys on first contact)"
            )


def pinned_hosts_path(state_path: Path) -> Path:
    """Where ``known_hosts: accept-new`` pins keys: beside the state, named after it
    (``.clusterctl/state.known_hosts``), so it never mixes with an OpenSSH known_hosts."""
    return state_path.with_suffix(".known_hosts")


def open_store(path: Path, *, create: bool = True) -> Store:
    try:
        return Store(path, create=create)
    except ClusterctlError as e:
        ui.fail(e)
