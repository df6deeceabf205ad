"""``clusterctl discover``: probe every node of the inventory and save the facts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.common import INVENTORY_ENV, INVENTORY_HELP, inventory_or_abort, open_store, pinned_hosts_path
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode
from cluster_cli.facts import NodeFacts

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
    inventory: Path = typer.Option(..., "--inventory", "-i", envvar=INVENTORY_ENV, help=INVENTORY_HELP),
    node: list[str] = typer.Option(None, "--node", "-n", help="Probe only this node (repeatable)."),
    parallel: int = typer.Option(64, "--parallel", "-p", min=1, help="Nodes probed at once."),
    timeout: float = typer.Option(
        None, "--timeout", min=0.1, help="Per-node deadline in seconds (default connect + command timeouts)."
    ),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Probe nodes over SSH (GPUs, NVLink, InfiniBand, CPU, memory) and save the facts."""
    # Imported here so that other commands (and --help) don't pay for asyncio and asyncssh.
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster_cli.probe.collect import discover as run_discover
    from cluster_cli.probe.fabric import distrust_conflicting_ports, fabric_conflicts
    from cluster_cli.probe.runner import AsyncsshConnector
    from cluster_cli.state.view import for_inventory

    state: App = ctx.obj
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    nodes = inv.nodes
    if node:
        unknown = [n for n in node if inv.node(n) is None]
        if unknown:
            ui.abort(f"{inventory}: no node named {', '.join(map(repr, unknown))} in the inventory")
        nodes = [n for n in inv.nodes if n.name in set(node)]
    store = open_store(state.state_path)
    connector = AsyncsshConnector(pinned_known_hosts=pinned_hosts_path(state.state_path))

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

    try:
        store.save_discovery(facts, inventory=inventory.resolve())
        # Every node of the inventory, as it declares them now (fabrics, classes, labels): the
        # fabric cross-check also covers nodes probed by an earlier run (``--node``).
        fleet = for_inventory(inv, store.nodes([n.name for n in inv.nodes]), from_state=True)
    except ClusterctlError as e:
        ui.fail(e)
    finally:
        store.close()
    prefixes = inv.declared_prefixes()
    conflicts = fabric_conflicts([f for f in fleet if f.reachable], prefixes)
    # A port whose subnet contradicts its declared fabric is shown off it, with the problem on its node.
    shown = {f.name: f for f in distrust_conflicting_ports(fleet, prefixes)}
    result = [shown[n.name] for n in nodes]

    if output is ui.Output.table:
        render(result)
        for c in conflicts:
            ui.warn(c)
    else:
        ui.emit_data({"nodes": [f.to_dict() for f in result], "fabric_conflicts": conflicts}, output)
        for f in result:  # stdout is for scripts; a person running it still sees what went wrong
            for problem in f.problems:
                ui.warn(f"{f.name}: {problem}")
    failed = [f for f in result if not f.reachable]
    for f in failed:
        ui.err.print(f"[red]{f.name}[/]: {escape(f.error or '')}", highlight=False)
    raise typer.Exit(ExitCode.PARTIAL if failed else ExitCode.OK)


def gpu_summary(f: NodeFacts) -> str:
    if not f.gpus:
        return "-"
    total = Counter(g.gpu_class for g in f.gpus)
    free = Counter(g.gpu_class for g in f.gpus if g.free and f.reachable)  # away: nothing is free
    return ", ".join(f"{free[c]}/{n} {c}" for c, n in sorted(total.items()))


def _ranges(ids: tuple[int, ...]) -> str:
    ids = tuple(sorted(ids))
    if len(ids) > 2 and ids == tuple(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def nvlink_summary(f: NodeFacts) -> str:
    if f.nvlink_domains is None:
        return "unknown" if f.reachable else "?"
    if not f.nvlink_domains:
        return "-"
    return " ".join("{" + _ranges(d) + "}" for d in f.nvlink_domains)


def node_problems(f: NodeFacts) -> list[str]:
    return [f"gpu{g.index} {x}" for g in f.gpus for x in g.problems] + list(f.problems)


def render(facts: list[NodeFacts]) -> None:
    from rich import box
    from rich.table import Table

    t = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("NODE", "UP", "GPUS FREE/TOTAL", "NVLINK", "FABRICS", "CPUS", "MEM GiB", "CORDON", "PROBLEMS"):
        t.add_column(col, no_wrap=col != "PROBLEMS")
    for f in facts:
        t.add_row(
            f.name,
            "[green]yes[/]" if f.reachable else "[red]no[/]",
            escape(gpu_summary(f)),
            nvlink_summary(f),
            escape(", ".join(sorted(f.fabrics)) or "-"),
            str(f.cpus) if f.cpus is not None else "?",
            f"{f.memory_mib / 1024:.0f}" if f.memory_mib else "?",
            "[yellow]cordoned[/]" if f.cordoned else "-",
            "[red]unreachable[/]" if not f.reachable else str(len(node_problems(f))) if node_problems(f) else "-",
        )
    ui.out.print(t)
    for f in facts:
        if f.cordoned:
            ui.out.print(f"[yellow]{f.name}[/] cordoned: {escape(f.cordon_reason or '')}", highlight=False)
        for p in node_problems(f):
            ui.out.print(f"[bold]{f.name}[/] {escape(p)}", highlight=False)
