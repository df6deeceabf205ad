"""``clusterctl discover``: probe every node of the inventory and save the facts."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster_cli.cli import ui
from cluster_cli.cli.common import INVENTORY_HELP, inventory_or_abort, open_store
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ExitCode
from cluster_cli.facts import NodeFacts
from cluster_cli.probe.collect import discover as run_discover
from cluster_cli.probe.fabric import fabric_conflicts
from cluster_cli.probe.runner import AsyncsshConnector

EXAMPLE = """
Examples:

  clusterctl discover -i inventory.yaml
  clusterctl discover -i inventory.yaml --node gpu-01 --node gpu-02 -o json
  clusterctl discover -i inventory.yaml --parallel 128 --timeout 20

Exit codes: 0 every node answered, 1 some did not (their facts are marked
unreachable, the rest saved), 2 bad inventory or state.
"""


@app.command(epilog=EXAMPLE)
def discover(
    ctx: typer.Context,
    inventory: Path = typer.Option(..., "--inventory", "-i", help=INVENTORY_HELP),
    node: list[str] = typer.Option(None, "--node", "-n", help="Probe only this node (repeatable)."),
    parallel: int = typer.Option(64, "--parallel", "-p", min=1, help="Nodes probed at once."),
    timeout: float = typer.Option(None, "--timeout", help="Per-node deadline in seconds (default connect + command timeouts)."),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Probe nodes over SSH (GPUs, NVLink, InfiniBand, CPU, memory) and save the facts."""
    state: App = ctx.obj
    inv = inventory_or_abort(inventory, check_files=True)
    nodes = inv.nodes
    if node:
        unknown = [n for n in node if inv.node(n) is None]
        if unknown:
            ui.abort(f"{inventory}: no node named {', '.join(map(repr, unknown))} in the inventory")
        nodes = [n for n in inv.nodes if n.name in set(node)]
    store = open_store(state.state_path)
    connector = AsyncsshConnector(pinned_known_hosts=state.state_path.parent / "known_hosts")

    with Progress(
        TextColumn("[bold]discover"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=ui.err,
        transient=True,
        disable=output is not ui.Output.table or not ui.err.is_terminal,
    ) as progress:
        task = progress.add_task("discover", total=len(nodes), last="")

        def done(f: NodeFacts) -> None:
            progress.update(task, advance=1, last=f"{f.name} {'ok' if f.reachable else 'unreachable'}")

        facts = asyncio.run(run_discover(inv, nodes, connector=connector, parallel=parallel,
                                         node_timeout_s=timeout, on_done=done))  # fmt: skip

    store.save_discovery(facts)
    saved = {f.name: f for f in store.nodes([n.name for n in nodes])}
    result = [saved[n.name] for n in nodes]
    conflicts = fabric_conflicts([f for f in store.nodes([n.name for n in inv.nodes]) if f.reachable])
    store.close()

    if output is ui.Output.table:
        render(result)
        for c in conflicts:
            ui.warn(c)
    else:
        ui.emit_data({"nodes": [f.to_dict() for f in result], "fabric_conflicts": conflicts}, output)
    failed = [f for f in result if not f.reachable]
    for f in failed:
        ui.err.print(f"[red]{f.name}[/]: {f.error}", highlight=False)
    raise typer.Exit(ExitCode.PARTIAL if failed else ExitCode.OK)


def gpu_summary(f: NodeFacts) -> str:
    if not f.gpus:
        return "-"
    total = Counter(g.gpu_class for g in f.gpus)
    free = Counter(g.gpu_class for g in f.gpus if g.free)
    return ", ".join(f"{free[c]}/{n} {c}" for c, n in sorted(total.items()))


def nvlink_summary(f: NodeFacts) -> str:
    if f.nvlink_domains is None:
        return "unknown"
    if not f.nvlink_domains:
        return "-"
    return " ".join("[" + ",".join(map(str, d)) + "]" for d in f.nvlink_domains)


def render(facts: list[NodeFacts]) -> None:
    t = Table(title=None, header_style="bold", show_lines=False)
    for col in ("node", "reachable", "GPUs free/total", "NVLink domains", "fabrics", "cpus", "mem GiB",
                "cordon", "problems"):  # fmt: skip
        t.add_column(col, overflow="fold")
    for f in facts:
        problems = [p for g in f.gpus for p in (f"gpu{g.index}: {x}" for x in g.problems)] + list(f.problems)
        t.add_row(
            f.name,
            "[green]yes[/]" if f.reachable else f"[red]no[/] ({f.error})",
            gpu_summary(f),
            nvlink_summary(f),
            ", ".join(sorted(f.fabrics)) or "-",
            str(f.cpus) if f.cpus is not None else "?",
            f"{f.memory_mib / 1024:.0f}" if f.memory_mib else "?",
            f"[yellow]yes[/]: {f.cordon_reason}" if f.cordoned else "-",
            "; ".join(problems) or "-",
        )
    ui.out.print(t)
