"""``clusterctl place --dry-run``: where every replica would go, and why the rest cannot.

Reads the inventory, the catalog, the nodes' facts (the state store, or ``--facts``)
and the current allocations (the state store, when there is one); prints the plan as
a diff and a scheduler dry-run block, like ``nomad job plan``. It never writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from cluster_cli.cli import ui
from cluster_cli.cli.common import INVENTORY_ENV, RECORDED_INVENTORY_HELP, recorded_inventory
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode

if TYPE_CHECKING:
    from cluster_cli.control.place import PlaceResult

EXAMPLE = """
Examples:

  clusterctl place --dry-run -i inventory.yaml -c catalog.yaml
  clusterctl place --dry-run -c catalog.yaml       # the inventory the last discover used
  clusterctl place --dry-run -i inv.yaml -c cat.yaml --facts f.json -o json

--facts takes what 'clusterctl discover -o json' prints.
Exit codes: 0 all replicas placed, 3 some unplaced (plan still printed),
2 bad input. To apply exactly that plan: 'clusterctl up -c catalog.yaml
--check-version N' with the state version it prints.
"""


@app.command(epilog=EXAMPLE)
def place(
    ctx: typer.Context,
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    catalog: Path = typer.Option(..., "--catalog", "-c", help="Catalog YAML (models, replicas, profiles)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Compute and print the plan; change nothing."),
    facts: Path = typer.Option(
        None, "--facts", help="Node facts JSON (as printed by 'discover -o json') instead of the state store."
    ),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Plan where each replica runs, with the reason for every node a profile could not use."""
    # Imported here so that other commands don't pay for the planner at start-up.
    from cluster_cli.control.place import place as make_plan

    if not dry_run:
        ui.abort(
            "place only plans: preview with 'clusterctl place --dry-run', apply with 'clusterctl up' "
            "(--check-version N applies exactly the plan made at state version N)"
        )
    state: App = ctx.obj
    inventory = recorded_inventory(inventory, state.state_path)
    try:
        result = make_plan(inventory, catalog, state.state_path, facts, trace=state.verbose)
    except ClusterctlError as e:
        ui.fail(e)
    for line in result.warnings:
        ui.warn(line)
    if state.verbose:  # stderr: stdout stays the plan (and clean JSON)
        for line in result.trace_lines():
            ui.info(line)
    if output is ui.Output.table:
        _render(result)
    else:
        ui.emit_data(result.to_dict(), output)
    raise typer.Exit(ExitCode.OK if result.complete else ExitCode.UNPLACED)


# --------------------------------------------------------------------------- output


def _render(result: PlaceResult) -> None:
    version, nodes = result.version, result.nodes
    where = f"state version {version}" if version is not None else "no state store"
    header = f"Plan for {nodes} node{'s' if nodes != 1 else ''} (facts: {result.source}; {where})"
    for line in result.lines(header=header):
        ui.out.print(Text(line, style=_style(line)), highlight=False)
    if version is not None:
        ui.out.print(
            Text(f"\nState version: {version} (a plan applied later must be computed from this version)", style="dim"),
            highlight=False,
        )


def _style(line: str) -> str:
    s = line.lstrip()
    if s.startswith("+/-"):
        return "yellow"
    if s.startswith("+"):
        return "green"
    if s.startswith("-") and not s.startswith("- All") and not s.startswith("- WARN"):
        return "red"
    if s.startswith("=") or s.startswith("0/") or s.startswith("nodes that fit"):
        return ""
    if s.startswith("!") or "WARNING" in s:
        return "bold yellow"
    if s.startswith("- All"):
        return "green"
    return ""
