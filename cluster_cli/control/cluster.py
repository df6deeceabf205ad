"""A cluster's control plane, opened once: its state, inventory, SSH sessions and router
config, and the operations every command calls (and ``supervise``'s loop will, every tick).

``up`` is one :meth:`Cluster.reconcile`; ``down`` and ``status`` are :meth:`Cluster.down` and
:meth:`Cluster.status`. A command opens the cluster, calls one operation and renders its
result; nothing here prints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.control import discovery
from cluster_cli.control.nodes import Nodes, SSHNodes
from cluster_cli.ssh.pool import Sessions
from cluster_cli.state.aio import AsyncStore

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.lifecycle import Report
    from cluster_cli.control.replicas import Downed
    from cluster_cli.control.runs import Runs
    from cluster_cli.control.status import StatusView
    from cluster_cli.control.up import UpResult
    from cluster_cli.launch.observe import Observed
    from cluster_cli.ssh.session import Connector
    from cluster_cli.state.records import ReplicaRecord
    from cluster_cli.state.store import Store


def _quiet(name: str, phase: str, detail: str) -> None:
    pass


@dataclass
class Cluster:
    """One cluster for one command or one long-running loop. Open with :meth:`open`."""

    inv: Inventory
    inventory_path: Path
    store: AsyncStore
    sessions: Sessions
    router_config: Path
    runs: Runs | None = None
    parallel: int = 64
    drain_s: float = 60.0  # how long a replica being stopped may finish what is in flight on it
    nodes: Nodes | None = None  # the nodes as operations act on them; over ``sessions`` when None

    def __post_init__(self) -> None:
        if self.nodes is None:
            self.nodes = SSHNodes(self.sessions)

    @property
    def on(self) -> Nodes:
        assert self.nodes is not None
        return self.nodes

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        inv: Inventory,
        inventory_path: Path,
        store: Store,
        connector: Connector | None,
        router_config: Path,
        *,
        pinned_known_hosts: Path | None = None,
        runs: Runs | None = None,
        parallel: int = 64,
        drain_s: float = 60.0,
        retry_failed: bool = False,
        max_backoff_s: float | None = None,
    ) -> AsyncIterator[Cluster]:
        """The cluster, its SSH sessions and its state's database thread open for the block
        (``store`` is not to be used directly meanwhile). ``connector`` None: SSH to the
        inventory's nodes (:func:`ssh_connector`), pinning ``accept-new`` keys in
        ``pinned_known_hosts``. ``retry_failed``: a node that failed to connect is tried again
        after a backoff (a loop that runs for long), not failed for good; at most ``max_backoff_s``
        apart."""
        if connector is None:
            connector = ssh_connector(pinned_known_hosts)
        backoff = {"max_backoff_s": max_backoff_s} if max_backoff_s is not None else {}
        async with (
            Sessions(inv, connector, retry_failed=retry_failed, **backoff) as sessions,
            AsyncStore(store) as astore,
        ):
            yield cls(inv, inventory_path, astore, sessions, router_config, runs, parallel, drain_s)

    # ---- observe ----------------------------------------------------------
    async def observe(
        self,
        *,
        steady: bool = False,
        report: Report = _quiet,
        on_done: Callable[[Any], None] | None = None,
        models: Sequence[str] = (),
    ) -> Observed:
        """Probe every node and save its facts (discover's probe), and what the same batch saw
        of the recorded shards and (unless ``steady``) the ports listening. ``steady``: only
        the running replicas are checked; the hardware is as the state last saw it."""
        from cluster_cli.launch.observe import Observed

        report("nodes", "probing", f"{len(self.inv.nodes)} node(s)")
        observed = Observed()
        facts = await discovery.probe(self.inv, connector=self.sessions.connector_view(), parallel=self.parallel,
                                      store=self.store, observed=observed, ports=not steady, hardware=not steady,
                                      on_done=on_done, models=models)  # fmt: skip
        await discovery.save(self.store, facts, self.inventory_path, observed)
        down = [f.name for f in facts if not f.reachable]
        report("nodes", "probed", f"{len(facts) - len(down)} answered" + (f", not: {', '.join(down)}" if down else ""))
        return observed

    async def fleet(self) -> discovery.Fleet:
        """The nodes as placement takes them, the replicas held and the state version, from one
        snapshot of the state."""
        return await discovery.fleet(self.inv, self.store, placeable=True)

    # ---- reconcile --------------------------------------------------------
    async def reconcile(
        self,
        cat: Catalog,
        *,
        expect_version: int | None = None,
        timeout_s: float = 600.0,
        report: Report = _quiet,
        catalog_source: str | None = None,
        max_surge: int = 1,
    ) -> UpResult:
        """One pass: probe (only the running replicas where the catalog asks for nothing new),
        check what runs, place what is missing, stop what is not wanted, start, wait until
        ready, publish. What ``up`` runs once. With ``expect_version`` nothing is probed: the
        plan is the one ``place`` made from that state version.

        Ready replicas whose profile the catalog changed (compared with the catalog the last
        ``up`` applied) are replaced first, ``max_surge`` at a time, make before break
        (``control/handover.py``); with ``expect_version``, after the checked plan is applied."""
        from cluster_cli.control.checks import HealthChecks, expects_new
        from cluster_cli.control.handover import changed, roll
        from cluster_cli.control.statefile import stored_catalog
        from cluster_cli.control.up import up

        before = await stored_catalog(self.store) if await self.store.catalog() is not None else None

        async def rolled() -> list[Any]:
            ready = [r for r in await self.store.records() if r.status == "ready"]
            todo = changed(before, cat, ready)
            if not todo:
                return []
            if expect_version is None:  # replacements are placed: on facts of every kind, read now
                await self.observe(report=report)
            hs = await roll(self, cat, todo, max_surge=max_surge, drain_s=self.drain_s, timeout_s=timeout_s,
                            report=report)  # fmt: skip
            return [o for h in hs for o in _replaced(h)]

        early = await rolled() if expect_version is None else []

        from cluster_cli.control.modelsize import read_sizes, unsized

        models = unsized(cat)  # listed by the probe's batch; read apart only when changed
        seen_by: list[Any] = []

        async def sizes(c: Catalog, facts: list[Any]) -> dict[str, Any]:
            listings = seen_by[-1].models if seen_by else None
            got, notes = await read_sizes(c, facts, self.sessions, self.store, listings=listings, models=models)
            for note in notes:
                report(note.split(":", 1)[0], "size", f"not checked for memory: {note}")
            return got

        records = await self.store.records()
        health = HealthChecks(records, self.on)
        observed = None
        reprobe = None

        async def full() -> Any:
            seen = await self.observe(report=report, models=models)
            seen_by.append(seen)
            return await self.fleet(), seen

        if expect_version is None:
            # Every replica the catalog asks for is held: check them, without reading the
            # hardware again unless something has to be placed after all.
            steady = not expects_new(cat, records)
            observed = await self.observe(steady=steady, report=report, on_done=health.node_done, models=models)
            seen_by.append(observed)
            reprobe = full if steady else None
        res = await up(
            self.inv,
            cat,
            self.store,
            self.on,
            self.fleet,
            router_config=self.router_config,
            expect_version=expect_version,
            timeout_s=timeout_s,
            report=report,
            observed=observed,
            runs=self.runs,
            health=health,
            reprobe=reprobe,
            catalog_doc=cat.to_doc(),
            catalog_source=catalog_source,
            drain_s=self.drain_s,
            sizes=None if expect_version is not None else sizes,
        )
        late = await rolled() if expect_version is not None else []
        replaced = {o.name for o in early + late}
        res.outcomes = [o for o in res.outcomes if o.name not in replaced] + early + late
        res.outcomes.sort(key=lambda o: (o.model, int(o.name.rpartition("/")[2])))
        return res

    # ---- down, status -----------------------------------------------------
    async def down(self, targets: list[ReplicaRecord], *, report: Callable[[str], None]) -> list[Downed]:
        """Take ``targets`` down (see :func:`cluster_cli.control.replicas.down`)."""
        from cluster_cli.control.replicas import down

        runs = self.runs
        return await down(self.store, self.on, targets, router_config=self.router_config, report=report,
                          owner=runs.id if runs is not None else None,
                          alive=runs.alive if runs is not None else (lambda _: False), drain_s=self.drain_s)  # fmt: skip

    async def status(self, *, check: bool = True) -> StatusView:
        """Every replica as seen now (``check``: on its node) or as last recorded, the fences,
        the nodes' liveness and the supervisor."""
        from cluster_cli.control.replicas import status

        def cap(node: str) -> int | None:
            n = self.inv.node(node)
            return self.inv.log_max_bytes(n) if n is not None else None

        from cluster_cli.control.status import around

        return await around(self.store, await status(self.store, self.on if check else None, log_cap=cap))


def ssh_connector(pinned_known_hosts: Path | None = None) -> Connector:
    """The SSH connector every command reaches the nodes with (host keys always verified);
    ``accept-new`` pins first-contact keys in ``pinned_known_hosts``."""
    from cluster_cli.ssh.connect import AsyncsshConnector

    return AsyncsshConnector(pinned_known_hosts=pinned_known_hosts)


def _replaced(h: Any) -> list[Any]:
    """A handover as ``up`` reports a replica: the new generation's outcome (action replace),
    and the old one's stop where it failed (it is fenced)."""
    from dataclasses import replace as copy

    from cluster_cli.control.lifecycle import Outcome

    if h.new is None:
        return [Outcome(h.name, h.name.rpartition("/")[0], "replace", "failed", h.old_nodes, reason=h.reason)]
    out = [copy(h.new, action="replace", reason=h.new.reason or f"replaced (was on {', '.join(h.old_nodes)})")]
    if h.stopped is not None and h.stopped.state == "failed":
        out.append(h.stopped)
    return out
