"""``clusterctl supervise``: the reconcile loop that keeps the cluster as the catalog asks."""

from __future__ import annotations

import asyncio
import signal
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
    pinned_hosts_path,
    recorded_inventory,
)
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode

SUPERVISE_EXAMPLE = """
Examples:

  clusterctl supervise                       # the catalog the last 'up' applied
  clusterctl supervise -c catalog.yaml --interval 2 --grace 30
  clusterctl supervise --once                # one pass: exit 0 converged, 3 not
  clusterctl supervise --standby             # wait for the running one's lease

Heartbeats every node every --interval seconds. A node that misses one leaves the router at
once (unreachable); unreachable for --grace seconds it is lost, and its replicas are rebuilt
on the others (at most --max-rebuilds at once). A dead engine is restarted in place with a
backoff (1, 2, 4 ... 60 s), and placed elsewhere after 3 failed restarts within 10 minutes.
When most nodes go unreachable at once, nothing is rebuilt (the storm brake). A node that
answers again is fenced first: engines not assigned to it are stopped. SIGTERM or Ctrl-C
ends it cleanly. One supervisor per state: a second one refuses, naming the first.
"""


@app.command(epilog=SUPERVISE_EXAMPLE)
def supervise(
    ctx: typer.Context,
    inventory: Path | None = typer.Option(
        None, "--inventory", "-i", envvar=INVENTORY_ENV, help=RECORDED_INVENTORY_HELP
    ),
    catalog: Path | None = typer.Option(
        None, "--catalog", "-c", help="Catalog YAML to keep applied (default: the one the last 'up' stored)."
    ),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="Seconds between heartbeats."),
    grace: float = typer.Option(30.0, "--grace", min=1, help="Seconds a node may stay unreachable before it is lost."),
    max_rebuilds: int = typer.Option(2, "--max-rebuilds", min=1, help="Replacements started at once, at most."),
    once: bool = typer.Option(False, "--once", help="One pass, then exit: 0 converged, 3 not."),
    standby: bool = typer.Option(False, "--standby", help="Wait for the lease another supervisor holds."),
    router_config: Path | None = typer.Option(None, "--router-config", help="Router config to write."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds a replica may take to become ready."),
    drain_timeout: float = typer.Option(60.0, "--drain-timeout", min=0, help="Seconds a stopped replica may drain."),
) -> None:
    """Keep the cluster as the catalog asks: heal what dies, rebuild what is lost."""
    from cluster_cli.config.catalog import load_catalog
    from cluster_cli.control.runs import Runs
    from cluster_cli.control.supervise import Settings

    state: App = ctx.obj
    inventory = recorded_inventory(inventory, state.state_path)
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    cat = None
    if catalog is not None:
        try:
            cat = load_catalog(catalog)
        except ClusterctlError as e:
            ui.fail(e)
    store = open_store(state.state_path, actor="supervise")
    settings = Settings(interval_s=interval, grace_s=grace, max_rebuilds=max_rebuilds, start_timeout_s=timeout)
    runs = Runs(state.state_path)
    try:
        with runs:
            job = _supervise(state.state_path, inv, inventory, store, router_config, cat, settings, runs,
                             once=once, standby=standby, drain_s=drain_timeout)  # fmt: skip
            converged = asyncio.run(job)
    except ClusterctlError as e:
        ui.fail(e)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        store.close()
    if once and not converged:
        raise typer.Exit(ExitCode.UNPLACED)  # 3: not converged, as up's


def _log(line: str) -> None:
    ui.info(f"{time.strftime('%H:%M:%S')} {line}")


async def _supervise(
    state_path: Path, inv: Any, inventory: Path, store: Any, router_config: Path | None, cat: Any, settings: Any,
    runs: Any, *, once: bool, standby: bool, drain_s: float,
) -> bool:  # fmt: skip
    """Hold the lease, then run the loop (or one pass) until SIGTERM/SIGINT."""
    from cluster_cli.control.cluster import Cluster
    from cluster_cli.control.lease import hold_lease
    from cluster_cli.control.supervise import Supervisor
    from cluster_cli.launch.routerconf import default_path

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with hold_lease(store, settings, standby=standby, stop=stop, log=_log) as held:
        if held is None:
            return False
        async with Cluster.open(inv, inventory.resolve(), store, None, router_config or default_path(state_path),
                                pinned_known_hosts=pinned_hosts_path(state_path), runs=runs, drain_s=drain_s,
                                retry_failed=not once, max_backoff_s=settings.reconnect_s) as c:  # fmt: skip
            sup = Supervisor(c, cat, settings, _log)
            if once:
                return await sup.once()
            _log(f"supervising {len(inv.nodes)} node(s) every {settings.interval_s:g} s (grace {settings.grace_s:g} s)")
            await sup.run(stop)
            _log("stopped")
            return True
