"""``clusterctl drain``: move every replica off a node while it serves, then leave it cordoned."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.common import (
    INVENTORY_ENV,
    RECORDED_INVENTORY_HELP,
    inventory_or_abort,
    open_store,
    recorded_inventory,
)
from cluster_cli.cli.launch import _cluster
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ConfigError, ExitCode

DRAIN_EXAMPLE = """
Examples:

  clusterctl drain gpu-07 --reason "Xid 79 on GPU 3"
  clusterctl drain gpu-07 --deadline 600     # wait at most 10 min for requests in flight
  clusterctl drain gpu-07 --force            # stop each old replica at once
  clusterctl uncordon gpu-07                 # back in service afterwards

Cordons the node, then replaces its replicas one at a time, make before break: the new
generation is placed on another node, started and published; then the old one is published
draining, stopped once the router has no request in flight on it (or after --deadline), and
released. Where no other node has room, the old one is drained and stopped first. The node
stays cordoned until 'clusterctl uncordon'. Exit codes: 0 every replica moved, 3 not all.
"""


@app.command(epilog=DRAIN_EXAMPLE)
def drain(
    ctx: typer.Context,
    node: str = typer.Argument(..., help="The node to empty."),
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    deadline: float = typer.Option(3600.0, "--deadline", min=0, help="Seconds to wait for requests in flight."),
    force: bool = typer.Option(False, "--force", help="Stop each old replica at once (no wait for requests)."),
    reason: str = typer.Option("drained", "--reason", help="The cordon's reason."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds a replacement may take to be ready."),
    router_config: Path | None = typer.Option(None, "--router-config", help="Router config to write."),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Move every replica off NODE (make before break), and keep it cordoned."""
    from cluster_cli.control.runs import Runs

    state: App = ctx.obj
    inventory = recorded_inventory(inventory, state.state_path)
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    if inv.node(node) is None:
        ui.fail(ConfigError(f"{node}: no such node in {inventory}"))
    store = open_store(state.state_path, actor="drain", create=False)
    runs = Runs(state.state_path)

    def report(name: str, phase: str, detail: str) -> None:
        if output is ui.Output.table:
            ui.info(f"{name}: {phase}{' ' + detail if detail else ''}")

    async def go() -> Any:
        from cluster_cli.control.handover import drain_or_ask

        async with _cluster(state.state_path, inv, inventory, store, router_config, runs=runs) as c:
            return await drain_or_ask(c, node, reason=reason, drain_s=deadline, force=force, timeout_s=timeout,
                                      report=report)  # fmt: skip

    try:
        with runs:
            result = asyncio.run(go())
    except ClusterctlError as e:
        ui.fail(e)
    finally:
        store.close()
    ok = bool(result.get("complete"))
    if output is ui.Output.table:
        rows = [[escape(h["name"]), escape(",".join(h["from"])), escape(",".join(h["to"]) or "-"),
                 "[green]replaced[/]" if h["state"] == "replaced" else "[red]failed[/]", escape(h["reason"] or "")]
                for h in result["replicas"]]  # fmt: skip
        if rows:
            ui.print_table([("REPLICA", None), ("FROM", None), ("TO", None), ("STATE", None), ("REASON", None)], rows)
        if result.get("error"):
            ui.warn(f"{node}: {result['error']}")
        ui.info(f"{node}: cordoned ({reason}); {len(rows)} replica(s) moved off it" if ok
                else f"{node}: cordoned; not every replica could be moved")  # fmt: skip
    else:
        ui.emit_data(result, output)
    raise typer.Exit(ExitCode.OK if ok else ExitCode.UNPLACED)
