"""``clusterctl discover``: probe every node of the inventory and save the facts."""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.common import INVENTORY_ENV, INVENTORY_HELP, inventory_or_abort
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode
from cluster_cli.facts import NodeFacts, problem_key
from cluster_cli.ssh.preflight import pinned_hosts_path

if TYPE_CHECKING:  # asyncssh and asyncio load only when discover runs
    from cluster_cli.control.discover import DiscoverResult

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
TERMINATED = 143  # 128 + SIGTERM
_T = TypeVar("_T")


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a supervisor, ``timeout``, ``kill``): ends the run as Ctrl-C does."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises _Terminated meanwhile (the main thread only: elsewhere it stays as it is)."""
    try:
        before = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


async def _cancelled_by_sigterm(coro: Coroutine[Any, Any, _T]) -> _T:
    """``coro``, cancelled by SIGTERM as ``asyncio.run`` cancels it on Ctrl-C (an exception
    raised from a signal handler could land inside the loop's own bookkeeping); then raises
    _Terminated for the caller to end the run as on Ctrl-C."""
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[bool] = []

    def on_term() -> None:
        got.append(True)
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_term)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread: leave it as it is
        return await coro
    try:
        return await coro
    except asyncio.CancelledError:
        if got:
            raise _Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _interrupted_code(e: BaseException) -> int:
    return TERMINATED if isinstance(e, _Terminated) else INTERRUPTED


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

    from cluster_cli.control.discover import Discovery

    state: App = ctx.obj
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    try:
        run = Discovery.open(inv, inventory, state.state_path, node, pinned_known_hosts=pinned_hosts_path(state.state_path),
                             parallel=parallel, node_timeout_s=timeout, say=ui.info if state.verbose else None)  # fmt: skip
    except ClusterctlError as e:
        ui.fail(e)
    with _sigterm_interrupts():  # in-process callers (tests) get their own handler back
        try:
            with _progress(len(run.nodes), output) as done:
                asyncio.run(_cancelled_by_sigterm(run.probe(on_done=done)))
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the loop's own handler went with it
                with contextlib.suppress(ValueError):  # (not the main thread)
                    signal.signal(signal.SIGTERM, _on_sigterm)
        except KeyboardInterrupt as e:
            # Ctrl-C (or SIGTERM) while probing: facts are saved only after every node is done, in
            # one transaction, so none were. (Host keys pinned on first contact stay pinned.)
            run.close()
            ui.info("interrupted: nothing saved")
            raise typer.Exit(_interrupted_code(e)) from None
        try:
            result = asyncio.run(run.save())
        except ClusterctlError as e:
            ui.fail(e)
        except KeyboardInterrupt as e:  # the save is one transaction: rolled back whole, or done
            ui.info("interrupted: the facts were saved" if run.saved() else "interrupted: nothing saved")
            raise typer.Exit(_interrupted_code(e)) from None
        finally:
            run.close()
    _show(result, output, state.state_path)


@contextlib.contextmanager
def _progress(total: int, output: ui.Output) -> Iterator[Callable[[NodeFacts], None]]:
    """A progress bar on a terminal's stderr for the table output; yields what to call per node done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
        task = progress.add_task("discover", total=total, last="")
        yield lambda f: progress.update(task, advance=1, last=f"{f.name} {'ok' if f.reachable else 'unreachable'}")


def _show(result: DiscoverResult, output: ui.Output, state_path: Path) -> NoReturn:
    """The result as a table (with the fabric warnings) or data, then the exit code: 0 every
    node answered, 1 some did not."""
    for name in result.unreadable:  # saved by now: a node not probed this time is warned of
        ui.warn(
            f"{state_path}: node {name}: its stored facts cannot be read; 'clusterctl discover --node {name}' replaces them"
        )
    if output is ui.Output.table:
        render(result.nodes)
        for c in result.fabric_warnings:  # one line per fabric
            ui.warn(c)
    else:
        ui.emit_data(result.to_dict(), output)
        for f in result.nodes:  # stdout is for scripts; a person running it still sees what went wrong
            for problem in f.problems:
                ui.warn(f"{f.name}: {problem}")
        for f in result.failed:  # the table's own lines say it (a report saved to a file keeps it)
            ui.err.print(f"[red]{f.name}[/]: {escape(f.error or '')}", highlight=False)
    raise typer.Exit(ExitCode.PARTIAL if result.failed else ExitCode.OK)


def gpu_summary(f: NodeFacts) -> str:
    """``8/8 H200``; ``3/4 A100 (1 lost)``; ``unknown`` when nvidia-smi failed (not a CPU node's
    ``-``); ``?`` for a node never reached."""
    if not f.gpus:
        if not f.reachable and f.cpus is None:  # never reached: what it has is not known
            return "?"
        keys = {problem_key(p) for p in f.problems}
        if "nvidia-smi" in keys:
            return "unknown"
        return "none (gone)" if "gpus-gone" in keys else "-"
    live = [g for g in f.gpus if not g.lost]
    lost = len(f.gpus) - len(live)
    total = Counter(g.gpu_class for g in live)
    free = Counter(g.gpu_class for g in live if g.free and f.reachable)  # away: nothing is free
    if lost and len(total) == 1:  # a lost GPU has no product name: it is one of the node's class
        ((c, n),) = total.items()
        return f"{free[c]}/{n + lost} {c} ({lost} lost)"
    parts = [f"{free[c]}/{n} {c}" for c, n in sorted(total.items())]
    return ", ".join([*parts, f"{lost} lost"] if lost else parts)


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


def _gpu_cordons(f: NodeFacts) -> str:
    """``gpu 3`` or ``gpus 1,3`` where only some GPUs of the node are cordoned, else ``-``."""
    ids = [g.index for g in f.gpus if any(problem_key(p) == "cordoned" for p in g.problems)]
    return f"[yellow]gpu{'s' if len(ids) > 1 else ''} {','.join(map(str, ids))}[/]" if ids else "-"


def render(facts: list[NodeFacts]) -> None:
    from cluster_cli.control.discover import node_problems

    rows = [
        [
            escape(f.name),
            "[green]yes[/]" if f.reachable else "[red]no[/]",
            escape(gpu_summary(f)),
            nvlink_summary(f),
            escape(", ".join(sorted(f.fabrics)) or "-"),
            str(f.cpus) if f.cpus is not None else "?",
            f"{f.memory_mib / 1024:.0f}" if f.memory_mib else "?",
            "[yellow]yes[/]" if f.cordoned else _gpu_cordons(f),
            # Not reached: UP says so, and its error follows the table.
            "?" if not f.reachable else str(len(node_problems(f))) if node_problems(f) else "-",
        ]
        for f in facts
    ]
    # A narrow terminal wraps long values onto more lines, never cuts them to "…" (a cut node
    # name cannot be read): names keep up to 32 characters (12 if it must), short columns all.
    columns = [("NODE", 12), ("UP", 0), ("GPUS\nFREE/TOTAL", None), ("NVLINK", None), ("FABRICS", None),
               ("CPUS", 0), ("MEM\nGiB", 0), ("CORDON", 0), ("PROBLEMS", None)]  # fmt: skip
    ui.print_table(columns, rows)
    now = time.time()
    for f in facts:
        if f.cordoned:
            ui.out.print(f"[yellow]{f.name}[/] cordoned: {escape(f.cordon_reason or '')}", highlight=False)
        # A node not reached this time: why, on stdout with the rest of the report; what it
        # showed before is as of the last time it answered, and said to be.
        stale = ""
        if not f.reachable:
            ui.out.print(f"[red]{f.name}[/] unreachable: {escape(f.error or 'no answer')}", highlight=False)
            stale = f" (as last seen, {_ago(now - f.last_seen_at)})" if f.last_seen_at else ""
        for p in node_problems(f):
            ui.out.print(f"[bold]{f.name}[/] {escape(p)}{stale}", highlight=False)


def _ago(seconds: float) -> str:
    """``40 s ago``, ``12 min ago``, ``3 h ago``, ``2 days ago``."""
    seconds = max(0.0, seconds)
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if unit == 'day' and n != 1 else ''} ago"
    return f"{int(seconds)} s ago"
