"""``discover`` as one operation: pick the nodes, probe them, save their facts in one
transaction and cross-check the fabrics, for a command to render.

A :class:`Discovery` runs in two steps, :meth:`Discovery.probe` then :meth:`Discovery.save`,
so that a command interrupted between or during them can tell whether the facts were
saved (:meth:`Discovery.saved`). Nothing here prints; ``say`` (``-v``) gets the trace.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.control import discovery
from cluster_cli.errors import ClusterctlError, ConfigError, SSHError
from cluster_cli.facts import NodeFacts, lost_gpus_problem, printable
from cluster_cli.state.aio import using
from cluster_cli.state.store import Store

if TYPE_CHECKING:
    from cluster_cli.config.inventory import Inventory, Node, SSHTarget
    from cluster_cli.ssh.session import CommandResult, Connector, Session


def select(inv: Inventory, inventory: Path, names: Sequence[str] | None) -> list[Node]:
    """The inventory's nodes named in ``names`` (all when none is), in inventory order; a
    ConfigError naming those the inventory does not have."""
    if not names:
        return list(inv.nodes)
    unknown = [n for n in names if inv.node(n) is None]
    if unknown:
        raise ConfigError(f"{inventory}: no node named {', '.join(map(repr, unknown))} in the inventory")
    wanted = set(names)
    return [n for n in inv.nodes if n.name in wanted]


def node_problems(f: NodeFacts) -> list[str]:
    """The GPUs' problems, then the node's, less the count of lost GPUs each listed already."""
    summary = lost_gpus_problem(sum(g.lost for g in f.gpus))
    return [f"gpu{g.index} {x}" for g in f.gpus for x in g.problems] + [p for p in f.problems if p != summary]


@dataclass(frozen=True)
class DiscoverResult:
    """What one discover found: the nodes it probed, as the state now holds them (a port
    whose subnet contradicts its declared fabric shown off it, with the problem on its
    node), the fabric cross-check over every node of the inventory, and the nodes whose
    stored facts could not be read."""

    nodes: list[NodeFacts]
    fabric_warnings: list[str]  # for a person: ports off a declared prefix summed up per fabric
    fabric_conflicts: list[str]  # for scripts: every one
    unreadable: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[NodeFacts]:
        """The nodes that did not answer."""
        return [f for f in self.nodes if not f.reachable]

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [f.to_dict() for f in self.nodes], "fabric_conflicts": self.fabric_conflicts}


class Discovery:
    """One discover of ``nodes``: open with :meth:`open`, then :meth:`probe`, :meth:`save`,
    and :meth:`close` in every case. The state is opened (or only checked creatable, when
    there is none yet) before anything is probed; a new one is made only to save the facts,
    so that another command (a cordon) may make it meanwhile and keep what it wrote."""

    def __init__(
        self,
        inv: Inventory,
        inventory: Path,
        state_path: Path,
        nodes: list[Node],
        connector: Connector,
        store: Store | None,
        *,
        parallel: int,
        node_timeout_s: float | None,
        trace: Trace | None,
    ) -> None:
        self.inv = inv
        self.inventory = inventory
        self.state_path = state_path
        self.nodes = nodes
        self.connector = connector
        self.store = store
        self.parallel = parallel
        self.node_timeout_s = node_timeout_s
        self.trace = trace
        self.facts: list[NodeFacts] = []
        self._saved = False

    @classmethod
    def open(
        cls,
        inv: Inventory,
        inventory: Path,
        state_path: Path,
        names: Sequence[str] | None = None,
        *,
        pinned_known_hosts: Path | None = None,
        connector: Connector | None = None,
        parallel: int = 64,
        node_timeout_s: float | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Discovery:
        """A discover of the nodes ``names`` (all when none), over ``connector`` (default
        SSH, pinning ``accept-new`` keys in ``pinned_known_hosts``); ``say``: a trace line
        per connect, command and node done. Raises a ClusterctlError for an unknown node, or
        a state that cannot be opened or created, before anything is probed."""
        nodes = select(inv, inventory, names)
        store = Store(state_path, actor="discover") if state_path.exists() else None
        if store is None:
            Store.check_creatable(state_path)
        if connector is None:
            from cluster_cli.control.cluster import ssh_connector

            connector = ssh_connector(pinned_known_hosts)
        trace = Trace(connector, say) if say is not None else None
        return cls(inv, inventory, state_path, nodes, trace or connector, store,
                   parallel=parallel, node_timeout_s=node_timeout_s, trace=trace)  # fmt: skip

    async def probe(self, on_done: Callable[[NodeFacts], None] | None = None) -> list[NodeFacts]:
        """Probe the nodes, the state's launched processes known as its own; ``on_done`` gets
        each node's facts as it is done. Saves nothing."""

        def done(f: NodeFacts) -> None:
            if on_done is not None:
                on_done(f)
            if self.trace is not None:
                self.trace.done(f)

        self.facts = await using(self.store, lambda astore: discovery.probe(
            self.inv, self.nodes, connector=self.connector, parallel=self.parallel,
            node_timeout_s=self.node_timeout_s, store=astore, on_done=done,
        ))  # fmt: skip
        return self.facts

    async def save(self) -> DiscoverResult:
        """Save the probed facts (one transaction; the state is made if there is none), then
        read back every node of the inventory as it declares them now (fabrics, classes,
        labels): the fabric cross-check also covers nodes probed by an earlier run
        (``--node``). A node not probed this time whose stored row cannot be read is in
        ``unreadable``."""
        if self.store is None:
            self.store = Store(self.state_path, actor="discover")
        store = self.store
        bad: list[str] = []

        async def run(astore: Any) -> list[NodeFacts]:
            self.facts = await discovery.save(astore, self.facts, self.inventory)
            self._saved = True
            return (await discovery.fleet(self.inv, astore, bad)).nodes

        fleet = await using(store, run)
        return _result(self.inv, fleet, self.nodes, bad)

    def saved(self) -> bool:
        """After an interrupt: whether the facts were saved (a signal during the COMMIT itself
        lands after it, before :meth:`save` could note it: the state is asked)."""
        return self._saved or (self.store is not None and _holds(self.store, self.facts))

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def _result(inv: Inventory, fleet: list[NodeFacts], nodes: list[Node], unreadable: list[str]) -> DiscoverResult:
    from cluster_cli.probe.fabric import distrust_conflicting_ports, fabric_conflicts, fabric_warnings

    prefixes = inv.declared_prefixes()
    reachable = [f for f in fleet if f.reachable]
    shown = {f.name: f for f in distrust_conflicting_ports(fleet, prefixes)}
    return DiscoverResult(
        nodes=[shown[n.name] for n in nodes],
        fabric_warnings=fabric_warnings(reachable, prefixes),
        fabric_conflicts=fabric_conflicts(reachable, prefixes),
        unreadable=unreadable,
    )


def _holds(store: Store, facts: list[NodeFacts]) -> bool:
    """Whether the state holds this run's facts (its first node, probed at the same moment)."""
    if not facts:
        return False
    try:
        got = store.nodes([facts[0].name], unreadable=[])
    except (ClusterctlError, KeyboardInterrupt):
        return False
    return bool(got) and got[0].probed_at == facts[0].probed_at


# The record table that starts a probe batch's output (see probe/batch.py).
_BATCH_TOKEN = re.compile(rb"@@CC ([0-9a-f]+) RC\n")


class Trace:
    """``discover -v``: lines for ``say``, per node, for an operator finding the slow or
    failing nodes of a fleet: how long connecting took, each remote command (the probes a
    batch ran, with their exit codes) and how long it took, then the outcome and any
    problem. Wraps the connector."""

    def __init__(self, inner: Connector, say: Callable[[str], None]) -> None:
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
        from cluster_cli.ssh.session import decoded

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
