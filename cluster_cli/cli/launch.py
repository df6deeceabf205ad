"""``clusterctl up``, ``down``, ``status``, ``logs``: engines running on the nodes."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.common import (
    INVENTORY_ENV,
    RECORDED_INVENTORY_HELP,
    inventory_or_abort,
    open_store,
    pinned_hosts_path,
    recorded_inventory,
)
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory

ROUTER_CONFIG_HELP = "Router config to write (default: router.yaml beside the state, .clusterctl/router.yaml)."
DRAIN_HELP = "Seconds a replica being stopped may finish the requests in flight on it (its router drains it first)."

UP_EXAMPLE = """
Examples:

  clusterctl up -i inventory.yaml -c catalog.yaml
  clusterctl place --dry-run -c catalog.yaml      # prints "state version N"
  clusterctl up -c catalog.yaml --check-version N # applies exactly that plan
  clusterctl up -c catalog.yaml -o json --timeout 1200

Starts what the catalog asks for and is not running, restarts what died, stops what the
catalog no longer asks for (a replica whose profile changed is replaced make before
break, --max-surge at a time), then writes the router config that 'clusterctl serve-router'
reloads live. A second 'up' with nothing to do changes nothing.
Exit codes: 0 every replica ready, 3 some could not be placed or started (the rest
stay up), 2 bad input or --check-version out of date.
"""


class _Progress:
    """One line per replica: its phase and time; a live view in a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.live: Any = None
        self.rows: dict[str, tuple[str, str, float]] = {}  # name -> (phase, detail, when it ended or 0)
        self.started: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.enabled = enabled
        if enabled and ui.err.is_terminal:
            from rich.live import Live

            self.live = Live(console=ui.err, transient=True, refresh_per_second=8)
            self.live.__enter__()

    def __call__(self, name: str, phase: str, detail: str) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        self.started.setdefault(name, now)
        done = phase in ("ready", "failed", "unplaced", "stopped")
        self.rows[name] = (phase, detail, now if done else 0.0)
        if self.live is None:
            ui.info(f"{name}: {phase}{' ' + detail if detail else ''}")
            return
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        now = time.monotonic()
        for n, (ph, d, ended) in sorted(self.rows.items()):
            colour = {"ready": "green", "failed": "red", "unplaced": "red"}.get(ph, "yellow")
            took = (ended or now) - self.started[n]
            t.add_row(escape(n), f"[{colour}]{ph}[/]", f"{took:5.1f}s", escape(d[:80]))
        self.live.update(t)

    def close(self) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)


@app.command(epilog=UP_EXAMPLE)
def up(
    ctx: typer.Context,
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    catalog: Path = typer.Option(..., "--catalog", "-c", help="Catalog YAML (models, replicas, profiles)."),
    router_config: Path | None = typer.Option(None, "--router-config", help=ROUTER_CONFIG_HELP),
    check_version: int | None = typer.Option(
        None, "--check-version", help="Apply only if the state is still at this version (from 'place --dry-run')."
    ),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds each replica may take to become ready."),
    parallel: int = typer.Option(64, "--parallel", "-p", min=1, help="Nodes probed at once."),
    drain_timeout: float = typer.Option(60.0, "--drain-timeout", min=0, help=DRAIN_HELP),
    max_surge: int = typer.Option(
        1, "--max-surge", min=1, help="Replicas whose profile changed replaced at once (make before break)."
    ),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Start the catalog's replicas on the nodes and publish them to the router."""
    import asyncio

    from cluster_cli.config.catalog import load_catalog
    from cluster_cli.control.runs import Runs

    state: App = ctx.obj
    inventory = recorded_inventory(inventory, state.state_path)
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    try:
        cat = load_catalog(catalog)
    except ClusterctlError as e:
        ui.fail(e)
    store = open_store(state.state_path, actor="up")
    runs = Runs(state.state_path)
    progress = _Progress(output is ui.Output.table or ui.err.is_terminal)

    async def go() -> Any:
        async with _cluster(state.state_path, inv, inventory, store, router_config, runs=runs, parallel=parallel,
                            drain_s=drain_timeout) as c:  # fmt: skip
            return await c.reconcile(cat, expect_version=check_version, timeout_s=timeout, report=progress,
                                     max_surge=max_surge,
                                     catalog_source=str(catalog.resolve()))  # fmt: skip

    try:
        with runs:
            result = asyncio.run(go())
    except ClusterctlError as e:
        progress.close()
        ui.fail(e)
    except KeyboardInterrupt:
        progress.close()
        ui.info("interrupted: replicas already started stay recorded; 'clusterctl up' again resumes")
        raise typer.Exit(130) from None
    finally:
        store.close()
    progress.close()
    if output is ui.Output.table:
        _render_up(result)
    else:
        ui.emit_data(result.to_dict(), output)
    raise typer.Exit(ExitCode.OK if result.complete else ExitCode.UNPLACED)


def _cluster(
    state_path: Path, inv: Inventory, inventory: Path, store: Any, router_config: Path | None, **kw: Any
) -> Any:
    """The cluster's control plane for this command (``Cluster.open``)."""
    from cluster_cli.control.cluster import Cluster
    from cluster_cli.launch.routerconf import default_path

    rc_path = router_config or default_path(state_path)
    return Cluster.open(
        inv, inventory.resolve(), store, None, rc_path, pinned_known_hosts=pinned_hosts_path(state_path), **kw
    )


def _render_up(result: Any) -> None:
    rows = []
    for o in result.outcomes:
        colour = {"ready": "green", "stopped": "yellow"}.get(o.state, "red")
        rows.append(
            [
                escape(o.name),
                o.action,
                f"[{colour}]{o.state}[/]",
                escape(",".join(o.nodes) or "-"),
                escape(o.endpoint or "-"),
                f"{o.seconds:.1f}s" if o.seconds else "-",
            ]
        )
    ui.print_table(
        [("REPLICA", 12), ("ACTION", 0), ("STATE", 0), ("NODES", None), ("ENDPOINT", None), ("TOOK", 0)], rows
    )
    for o in result.outcomes:
        if o.reason and o.state not in ("ready", "stopped"):
            ui.out.print(f"[red]{escape(o.name)}[/]: {escape(o.reason)}", highlight=False)
            for line in o.log[-10:]:
                ui.out.print(f"    {escape(line)}", highlight=False)
        elif o.reason:
            ui.out.print(f"{escape(o.name)}: {escape(o.reason)}", highlight=False)
    ui.out.print(f"router config: {escape(str(result.router_config))} (state version {result.state_version})")


DOWN_EXAMPLE = """
Examples:

  clusterctl down tiny/0            # one replica
  clusterctl down llama-70b         # every replica of a model
  clusterctl down --all

A replica taken down leaves the router config first, then every process of it is stopped
(TERM, then KILL) and checked gone, with its port; nothing brings it back until the next 'up'.
"""


@app.command(epilog=DOWN_EXAMPLE)
def down(
    ctx: typer.Context,
    names: list[str] = typer.Argument(None, help="Replicas (MODEL/N) or models to stop."),
    all_: bool = typer.Option(False, "--all", help="Stop every replica."),
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    catalog: Path | None = typer.Option(None, "--catalog", "-c", help="Accepted for symmetry with up; not needed."),
    router_config: Path | None = typer.Option(None, "--router-config", help=ROUTER_CONFIG_HELP),
    drain_timeout: float = typer.Option(60.0, "--drain-timeout", min=0, help=DRAIN_HELP),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """Stop replicas and release their GPUs and ports."""
    import asyncio

    from cluster_cli.control.replicas import select
    from cluster_cli.control.runs import Runs

    if not names and not all_:
        ui.abort("name the replicas (MODEL/N) or models to stop, or give --all")
    if names and all_:
        ui.abort("give replica names or --all, not both")
    state: App = ctx.obj
    store = open_store(state.state_path, actor="down", create=False)
    inv_path = recorded_inventory(inventory, state.state_path)
    inv = inventory_or_abort(inv_path, state_path=state.state_path)
    try:
        # Those wanted up, the fenced ones (their stop was not confirmed: it is tried again),
        # and those an interrupted down left stopping.
        records = [r for r in store.records(include_down=True, include_fenced=True)
                   if r.desired == "up" or r.status in ("fenced", "stopping")]  # fmt: skip
        targets = records if all_ else select(records, names)
    except ClusterctlError as e:
        store.close()
        ui.fail(e)
    say = ui.info if output is ui.Output.table else (lambda _: None)
    runs = Runs(state.state_path)

    async def go() -> Any:
        async with _cluster(state.state_path, inv, inv_path, store, router_config, runs=runs,
                            drain_s=drain_timeout) as c:  # fmt: skip
            return await c.down(targets, report=say)

    try:
        with runs:
            done = asyncio.run(go())
    except ClusterctlError as e:
        ui.fail(e)
    finally:
        store.close()
    if output is not ui.Output.table:
        ui.emit_data({"replicas": [d.to_dict() for d in done]}, output)
    elif not done:
        ui.info("nothing to stop")
    raise typer.Exit(ExitCode.OK if all(d.clean for d in done) else ExitCode.PARTIAL)


STATUS_EXAMPLE = """
Examples:

  clusterctl status
  clusterctl status -o json | jq '.replicas[] | select(.state != "ready")'

Each replica is checked through its node's SSH session (process, health check, /metrics):
no engine port needs to be reachable from here. --no-check shows what the state recorded.
"""


@app.command(epilog=STATUS_EXAMPLE)
def status(
    ctx: typer.Context,
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    check: bool = typer.Option(True, "--check/--no-check", help="Check each replica on its node now."),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """One row per replica: where it runs, its state, uptime, restarts and load."""
    import asyncio

    from cluster_cli.control.status import recorded_status

    state: App = ctx.obj
    store = open_store(state.state_path, actor="status", create=False)

    async def go() -> Any:
        if not check:  # what the state recorded: no node, no inventory needed
            return await recorded_status(store)
        inv_path = recorded_inventory(inventory, state.state_path)
        inv = inventory_or_abort(inv_path, state_path=state.state_path)
        async with _cluster(state.state_path, inv, inv_path, store, None) as c:
            return await c.status(check=True)

    try:
        view = asyncio.run(go())
    except ClusterctlError as e:
        ui.fail(e)
    finally:
        store.close()
    if output is not ui.Output.table:
        ui.emit_data(view.to_dict(), output)
    else:
        _render_status([r.to_dict() for r in view.rows], view.fences)
        _render_nodes(view)


def _render_nodes(view: Any) -> None:
    """The nodes' liveness (one line, the odd ones first) and who supervises."""
    if view.supervisor is not None:
        s = view.supervisor
        ui.out.print(f"supervised by {escape(s.holder)} (pid {s.pid} on {escape(s.host)})", highlight=False)
    odd = [n for n in view.nodes if n.status != "ready"]
    for n in odd:
        since = time.strftime("%H:%M:%S", time.localtime(n.since))
        ui.out.print(f"[red]node {escape(n.node)}[/] {n.status} since {since}"
                     + (f": {escape(n.detail)}" if n.detail else ""), highlight=False)  # fmt: skip
    if view.nodes and not odd:
        ui.out.print(f"nodes: {len(view.nodes)} ready", highlight=False)


def _render_status(data: list[dict[str, Any]], fences: list[Any]) -> None:
    if not data:
        ui.info("no replicas (clusterctl up starts them)")
        return
    table = []
    for d in data:
        colour = {"ready": "green", "stopped": "dim"}.get(d["state"], "red")
        load = d["load"]
        table.append(
            [
                escape(d["name"]),
                escape(d["profile"]),
                d["engine"],
                escape(",".join(d["nodes"])),
                escape(" ".join(f"{n}:{','.join(map(str, g))}" for n, g in d["gpus"].items()) or "-"),
                escape(d["endpoint"] or "-"),
                f"[{colour}]{d['state']}[/]",
                _ago(d["uptime_s"]),
                str(d["restarts"]),
                _num(load["running"]),
                _num(load["waiting"]),
                _num(load["kv_cache_usage"], pct=True),
            ]
        )
    cols = [("REPLICA", 12), ("PROFILE", None), ("ENGINE", 0), ("NODES", None), ("GPUS", None), ("ENDPOINT", None),
            ("STATE", 0), ("UP", 0), ("RESTARTS", 0), ("RUN", 0), ("WAIT", 0), ("KV", 0)]  # fmt: skip
    ui.print_table(cols, table)
    for d in data:
        if d["state"] not in ("ready", "stopped") and d["detail"]:
            ui.out.print(f"[red]{escape(d['name'])}[/]: {escape(d['detail'])}", highlight=False)
    for f in fences:  # what may still run although released: its GPUs stay held
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(f.since))
        ui.out.print(f"[red]fenced[/] {escape(f.name)} g{f.generation} on {escape(f.node)} since {since}: "
                     f"{escape(f.reason)}", highlight=False)  # fmt: skip


def _num(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "unknown"
    return f"{v * 100:.0f}%" if pct else f"{v:g}"


def _ago(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


LOGS_EXAMPLE = """
Examples:

  clusterctl logs tiny/0
  clusterctl logs llama-70b/1 --shard 1 -n 200
  clusterctl logs tiny/0 -f        # follow until Ctrl-C
  clusterctl logs tiny/0 --previous # the instance before the last restart: why it died
"""


@app.command(epilog=LOGS_EXAMPLE)
def logs(
    ctx: typer.Context,
    replica: str = typer.Argument(..., help="The replica (MODEL/N)."),
    shard: int = typer.Option(0, "--shard", help="Which shard of a multi-node replica (0 = the head)."),
    lines: int = typer.Option(100, "-n", "--lines", min=0, help="Lines from the end."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Keep printing new lines until Ctrl-C."),
    previous: bool = typer.Option(
        False, "--previous", "-p", help="The log of the instance before the last start (why it died)."
    ),
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
) -> None:
    """The engine's log, read from its node."""
    import asyncio

    from cluster_cli.control.logs import shard_log
    from cluster_cli.control.replicas import find

    state: App = ctx.obj
    store = open_store(state.state_path, actor="logs", create=False)
    try:
        rec = find(store, replica, shard)
    except ClusterctlError as e:
        ui.fail(e)
    finally:
        store.close()
    inv = inventory_or_abort(recorded_inventory(inventory, state.state_path), state_path=state.state_path)

    def write(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    try:
        rc = asyncio.run(shard_log(inv, rec, shard=shard, lines=lines, follow=follow, write=write, previous=previous,
                                   pinned_known_hosts=pinned_hosts_path(state.state_path)))  # fmt: skip
    except ClusterctlError as e:
        ui.fail(e)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    raise typer.Exit(0 if rc in (0, None) else 1)
