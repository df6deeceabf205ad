"""``clusterctl discover``: probe every node of the inventory and save the facts."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.common import INVENTORY_ENV, INVENTORY_HELP, inventory_or_abort, open_store, pinned_hosts_path
from cluster_cli.cli.main import App, app
from cluster_cli.errors import ClusterctlError, ExitCode, SSHError
from cluster_cli.facts import NodeFacts, lost_gpus_problem, printable, problem_key
from cluster_cli.state.aio import using
from cluster_cli.state.store import Store

if TYPE_CHECKING:  # asyncssh and asyncio load only when discover runs
    from cluster_cli.config.inventory import SSHTarget
    from cluster_cli.probe.runner import CommandResult, Connector, Session

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


def _holds(store: Store, facts: list[NodeFacts]) -> bool:
    """Whether the state holds this run's facts (its first node, probed at the same moment)."""
    if not facts:
        return False
    try:
        got = store.nodes([facts[0].name], unreadable=[])
    except (ClusterctlError, KeyboardInterrupt):
        return False
    return bool(got) and got[0].probed_at == facts[0].probed_at


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

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from cluster_cli.control import discovery
    from cluster_cli.probe.fabric import distrust_conflicting_ports, fabric_conflicts, fabric_warnings
    from cluster_cli.probe.runner import AsyncsshConnector

    state: App = ctx.obj
    inv = inventory_or_abort(inventory, check_files=True, state_path=state.state_path)
    nodes = inv.nodes
    if node:
        unknown = [n for n in node if inv.node(n) is None]
        if unknown:
            ui.abort(f"{inventory}: no node named {', '.join(map(repr, unknown))} in the inventory")
        nodes = [n for n in inv.nodes if n.name in set(node)]
    # A state that cannot be written is found now, before probing. A new one is made only to
    # save the facts: until then another command (a cordon) may make it, and keep what it wrote.
    store = open_store(state.state_path, actor="discover") if state.state_path.exists() else None
    if store is None:
        try:
            Store.check_creatable(state.state_path)
        except ClusterctlError as e:
            ui.fail(e)
    connector: Connector = AsyncsshConnector(pinned_known_hosts=pinned_hosts_path(state.state_path))
    trace = Trace(connector) if state.verbose else None
    with _sigterm_interrupts():  # in-process callers (tests) get their own handler back
        try:
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
                    if trace is not None:
                        trace.done(f)

                facts = asyncio.run(_cancelled_by_sigterm(using(store, lambda astore: discovery.probe(
                    inv, nodes, connector=trace or connector, parallel=parallel, node_timeout_s=timeout, store=astore,
                    on_done=done,
                ))))  # fmt: skip
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # the loop's own handler went with it
                with contextlib.suppress(ValueError):  # (not the main thread)
                    signal.signal(signal.SIGTERM, _on_sigterm)
        except KeyboardInterrupt as e:
            # Ctrl-C (or SIGTERM) while probing: facts are saved only after every node is done, in
            # one transaction, so none were. (Host keys pinned on first contact stay pinned.)
            if store is not None:
                store.close()
            ui.info("interrupted: nothing saved")
            raise typer.Exit(_interrupted_code(e)) from None

        saved = False
        try:
            if store is None:
                store = open_store(state.state_path, actor="discover")
            probed = facts
            facts = asyncio.run(using(store, lambda astore: discovery.save(astore, probed, inventory)))
            saved = True
            # Every node of the inventory, as it declares them now (fabrics, classes, labels): the
            # fabric cross-check also covers nodes probed by an earlier run (``--node``). The facts
            # are saved by now: a node not probed this time whose row cannot be read is warned of.
            bad: list[str] = []
            fleet = asyncio.run(using(store, lambda astore: discovery.fleet(inv, astore, bad))).nodes
            for name in bad:
                ui.warn(
                    f"{store.path}: node {name}: its stored facts cannot be read; 'clusterctl discover --node {name}' replaces them"
                )
        except ClusterctlError as e:
            ui.fail(e)
        except KeyboardInterrupt as e:  # the save is one transaction: rolled back whole, or done
            # (A signal during the COMMIT itself lands after it, before ``saved`` is set: ask the state.)
            saved = saved or (store is not None and _holds(store, facts))
            ui.info("interrupted: the facts were saved" if saved else "interrupted: nothing saved")
            raise typer.Exit(_interrupted_code(e)) from None
        finally:
            if store is not None:
                store.close()
    prefixes = inv.declared_prefixes()
    reachable = [f for f in fleet if f.reachable]
    # A port whose subnet contradicts its declared fabric is shown off it, with the problem on its node.
    shown = {f.name: f for f in distrust_conflicting_ports(fleet, prefixes)}
    result = [shown[n.name] for n in nodes]

    if output is ui.Output.table:
        render(result)
        for c in fabric_warnings(reachable, prefixes):  # one line per fabric
            ui.warn(c)
    else:
        conflicts = fabric_conflicts(reachable, prefixes)  # every one, for scripts
        ui.emit_data({"nodes": [f.to_dict() for f in result], "fabric_conflicts": conflicts}, output)
        for f in result:  # stdout is for scripts; a person running it still sees what went wrong
            for problem in f.problems:
                ui.warn(f"{f.name}: {problem}")
    failed = [f for f in result if not f.reachable]
    if output is not ui.Output.table:  # the table's own lines say it (a report saved to a file keeps it)
        for f in failed:
            ui.err.print(f"[red]{f.name}[/]: {escape(f.error or '')}", highlight=False)
    raise typer.Exit(ExitCode.PARTIAL if failed else ExitCode.OK)


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


def node_problems(f: NodeFacts) -> list[str]:
    """The GPUs' problems, then the node's, less the count of lost GPUs each listed already."""
    summary = lost_gpus_problem(sum(g.lost for g in f.gpus))
    return [f"gpu{g.index} {x}" for g in f.gpus for x in g.problems] + [p for p in f.problems if p != summary]


def render(facts: list[NodeFacts]) -> None:
    rows = [
        [
            escape(f.name),
            "[green]yes[/]" if f.reachable else "[red]no[/]",
            escape(gpu_summary(f)),
            nvlink_summary(f),
            escape(", ".join(sorted(f.fabrics)) or "-"),
            str(f.cpus) if f.cpus is not None else "?",
            f"{f.memory_mib / 1024:.0f}" if f.memory_mib else "?",
            "[yellow]yes[/]" if f.cordoned else "-",
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


# The record table that starts a probe batch's output (see probe/batch.py).
_BATCH_TOKEN = re.compile(rb"@@CC ([0-9a-f]+) RC\n")


class Trace:
    """``discover -v``: lines on stderr, per node, for an operator finding the slow or failing
    nodes of a fleet: how long connecting took, each remote command (the probes a batch ran,
    with their exit codes) and how long it took, then the outcome and any problem. Wraps
    the connector; stdout is left alone (``-o json`` stays clean)."""

    def __init__(self, inner: Connector, say: Callable[[str], None] = ui.info) -> None:
        self._inner = inner
        self._say = lambda line: say(printable(line))  # errors and record names come from the node
        self._started: dict[str, float] = {}
        self._connect: dict[str, float] = {}
        self._probe: dict[str, float] = {}

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[Session]:
        name = target.name
        t0 = self._started[name] = time.monotonic()  # after the --parallel wait: its own time only
        # A failed connect is told by ``done``: the node's whole time was spent on it.
        async with self._inner.session(target) as s:
            took = self._connect[name] = time.monotonic() - t0
            self._say(f"{name}: connected to {target.host} in {took:.2f}s")
            yield _TracedSession(s, name, self)

    async def aclose(self) -> None:
        aclose = getattr(self._inner, "aclose", None)
        if aclose is not None:
            await aclose()

    def ran(self, name: str, command: str, took: float, outcome: str) -> None:
        self._probe[name] = self._probe.get(name, 0.0) + took
        self._say(f"{name}: ran {command!r} in {took:.2f}s: {outcome}")

    def done(self, f: NodeFacts) -> None:
        t0 = self._started.get(f.name)
        total = f" after {time.monotonic() - t0:.2f}s" if t0 is not None else ""
        if not f.reachable:
            self._say(f"{f.name}: unreachable{total}: {f.error}")
            return
        steps = f"connect {self._connect.get(f.name, 0.0):.2f}s, probe {self._probe.get(f.name, 0.0):.2f}s"
        problems = node_problems(f)
        found = f"; {len(problems)} problem(s): {'; '.join(problems)}" if problems else "; no problems"
        self._say(f"{f.name}: ok{total} ({steps}){found}")


class _TracedSession:
    def __init__(self, inner: Session, name: str, trace: Trace) -> None:
        self._inner = inner
        self._name = name
        self._trace = trace

    async def run(self, command: str, *, timeout: float) -> CommandResult:
        from cluster_cli.probe.runner import decoded

        return decoded(*await self.run_raw(command, timeout=timeout))

    async def run_raw(
        self, command: str, *, timeout: float, input: bytes | None = None
    ) -> tuple[int | None, bytes, bytes]:
        t0 = time.monotonic()
        try:
            rc, out, err = await self._inner.run_raw(command, timeout=timeout, input=input)
        except SSHError as e:
            self._trace.ran(self._name, command, time.monotonic() - t0, f"failed: {_own(e.message, self._name)}")
            raise
        self._trace.ran(self._name, command, time.monotonic() - t0, f"rc {rc}, {len(out)} bytes{_records(out)}")
        return rc, out, err


def _records(out: bytes) -> str:
    """The probes a batch ran and their exit codes, from its output (none if it is not one)."""
    from cluster_cli.probe.batch import TIMED_OUT, parse_records

    m = _BATCH_TOKEN.search(out)
    if m is None:
        return ""
    rcs = {n: r.rc for n, r in parse_records({}, out, m.group(1).decode()).items()}
    shown = ("no result" if rc is None else "timed out" if rc == TIMED_OUT else f"rc {rc}" for rc in rcs.values())
    return "; " + ", ".join(f"{n} {how}" for n, how in zip(rcs, shown, strict=True)) if rcs else ""


def _own(message: str, name: str) -> str:
    return message.removeprefix(f"{name}: ")
