"""``clusterctl cordon`` / ``uncordon``: keep new work off a node, or allow it again.

Cordons live in their own table, so a later ``discover`` never clears them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from cluster_cli.cli import ui
from cluster_cli.cli.common import (
    INVENTORY_ENV,
    RECORDED_INVENTORY_HELP,
    inventory_or_abort,
    open_store,
    recorded_inventory,
    stored_inventory,
)
from cluster_cli.cli.main import App, app
from cluster_cli.control import cordon as ops
from cluster_cli.errors import ClusterctlError

CORDON_EXAMPLE = """
Examples:

  clusterctl cordon gpu-03 --reason "ECC storm, RMA ticket 4411"
  clusterctl cordon gpu-03 -i inventory.yaml --reason "before the first discover"
  clusterctl cordon gpu-03 --gpu 3 --reason "Xid 79"     # one GPU; the rest stays in service

Without -i the node is checked against the inventory recorded in the state
(by the last discover, or the first cordon -i).
A missing state is created (with a note on stderr).
"""
UNCORDON_EXAMPLE = """
Examples:

  clusterctl uncordon gpu-03
  clusterctl uncordon gpu-03 -i inventory.yaml
  clusterctl uncordon gpu-03 --gpu 3
"""


def _check_node(inventory: Path, node: str) -> None:
    """The node must be in the inventory."""
    if inventory_or_abort(inventory).node(node) is None:
        ui.abort(f"{inventory}: no node named {node!r} in the inventory")


def _cordoned_in_state(path: Path, node: str) -> bool:
    try:
        return ops.is_cordoned(path, node)
    except ClusterctlError as e:
        ui.fail(e)


@app.command(epilog=CORDON_EXAMPLE)
def cordon(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="Node name, as in the inventory."),
    reason: str = typer.Option(..., "--reason", "-r", help="Why (shown by discover and place)."),
    gpu: int | None = typer.Option(
        None, "--gpu", min=0, help="Cordon only this GPU (its index, as nvidia-smi numbers it).", show_default=False
    ),
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
) -> None:
    """Cordon a node, or one GPU of it: placement puts nothing new there. Survives re-discovery."""
    try:
        reason = ops.check_reason(reason)
    except ClusterctlError as e:
        ui.fail(e)
    state: App = ctx.obj
    # A cordon may come before the first discover (keep a node out from the start), so a
    # missing state is created, and said so: a typo in --state shows at once.
    inv = recorded_inventory(inventory, state.state_path)
    _check_node(inv, node)
    recorded = stored_inventory(state.state_path) if inventory is not None else None
    with open_store(state.state_path, actor="cordon", say_new=True) as store:
        try:
            if gpu is None:
                done = ops.cordon(store, node, reason, inventory=inv, recorded=recorded)
            else:
                done = ops.cordon_gpu(store, node, gpu, reason)
        except ClusterctlError as e:
            ui.fail(e)
    ui.info(cordon_message(done.node, done.reason, done.was))


def cordon_message(node: str, reason: str, was: dict[str, Any] | None) -> str:
    """``h1 cordoned: why``, or for a node already cordoned, since when and its old reason."""
    if was is None:
        return f"{node} cordoned: {reason}"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(was["created_at"]))
    now = "unchanged" if was["reason"] == reason else f"now {json.dumps(reason, ensure_ascii=False)}"
    return f"{node} was already cordoned (since {since}: {json.dumps(was['reason'], ensure_ascii=False)}); reason {now}"


@app.command(epilog=UNCORDON_EXAMPLE)
def uncordon(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="Node name, as in the inventory."),
    gpu: int | None = typer.Option(
        None, "--gpu", min=0, help="Lift only this GPU's cordon (its index).", show_default=False
    ),
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
) -> None:
    """Lift a node's cordon, or one GPU's."""
    state: App = ctx.obj
    what = node if gpu is None else f"{node} GPU {gpu}"
    if not state.state_path.exists():  # nothing can be cordoned there; and nothing is created
        if inventory is not None:
            _check_node(inventory, node)
        ui.info(f"{what} was not cordoned (no state at {state.state_path})")
        return
    if gpu is not None:
        with open_store(state.state_path, actor="uncordon", create=False) as store:
            lifted = ops.uncordon_gpu(store, node, gpu)
        ui.info(f"{what} uncordoned" if lifted else f"{what} was not cordoned")
        return
    # A cordon outlives the node's removal from the inventory, so it can always be lifted,
    # whatever the inventory says or whether it can be read; only a node with no cordon is
    # checked (a typo), against the inventory given or recorded (whose file must then still
    # be there), when there is one: a state with none recorded has nothing to check against.
    if not _cordoned_in_state(state.state_path, node) and (inventory is not None or stored_inventory(state.state_path)):
        _check_node(recorded_inventory(inventory, state.state_path), node)
    with open_store(state.state_path, actor="uncordon", create=False) as store:
        try:
            was = ops.uncordon(store, node)
        except ClusterctlError as e:
            ui.fail(e)
    ui.info(f"{node} uncordoned" if was else f"{node} was not cordoned")
