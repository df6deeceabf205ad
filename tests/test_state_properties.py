"""The state store (schema 3) as a state machine: two writers on one file interleave
reservations, observed-state writes, claims, releases (fenced or not), downs, unfences and
cordons, checked against a model of what was committed; and two processes writing hundreds
of times each at once, losing and doubling nothing."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster_cli.errors import StateError
from cluster_cli.facts import Gpu, NodeFacts, Replica, Shard
from cluster_cli.state.launches import StaleRecord, StaleVersion
from cluster_cli.state.records import (
    DOWN,
    FENCED,
    PLANNED,
    READY,
    STARTING,
    STOPPED,
    STOPPING,
    UNHEALTHY,
    UP,
    ReplicaRecord,
    ShardRun,
)
from cluster_cli.state.store import Store

Key = tuple[str, int, int]

NODES = ("n1", "n2")  # n1's facts give its GPUs UUIDs (held by UUID); n2 has none (held by index)
LAYOUTS = (("n1",), ("n2",), ("n1", "n2"))  # a replica's shards: one per node, the same GPU indices on each
NAMES = (("a", 0), ("a", 1), ("b", 0))  # the MODEL/N a reservation picks from
PORTS = (8100, 8101, 8102)
ACTORS = ("up", "supervise")
UP_STATES = (PLANNED, STARTING, READY, UNHEALTHY)  # what an observe, a claim or a down starts from
RELEASABLE = (*UP_STATES, STOPPING)  # what a release starts from


def _uuid(node: str, index: int) -> str | None:
    return f"GPU-{node}-{index}" if node == "n1" else None


def _facts(name: str, probed_at: float) -> NodeFacts:
    gpus = tuple(
        Gpu(index=i, uuid=_uuid(name, i) or "", product="NVIDIA H100", gpu_class="H100", memory_total_mib=81559)
        for i in range(4)
    )
    return NodeFacts(name=name, host="198.18.0.1", cpus=8, memory_mib=1024, gpus=gpus, nvlink_domains=(),
                     probed_at=probed_at)  # fmt: skip


def _replica(model: str, n: int, nodes: tuple[str, ...], gpus: frozenset[int]) -> Replica:
    shards = tuple(Shard(node, tuple(sorted(gpus))) for node in nodes)
    return Replica(model, n, "p", "vllm", shards, gpu_class="H100")


@dataclass
class Row:
    """The model's replica row: what the last committed write of it said."""

    nodes: tuple[str, ...]
    gpus: frozenset[int]
    port: int  # on nodes[0]
    status: str = PLANNED
    desired: str = UP
    owner: str | None = None
    restarts: int = 0
    revision: int = 1
    tokens: tuple[str, ...] = ()  # the shard tokens recorded in the row, by rank

    @property
    def held(self) -> bool:
        """Not released: live, being stopped or fenced (a stopped row holds nothing)."""
        return self.status != STOPPED

    @property
    def gpu_holds(self) -> set[tuple[str, int]]:
        return {(node, g) for node in self.nodes for g in self.gpus}


WRITER = st.integers(0, 1)
PICK = st.integers(0, 7)
SPEC = st.tuples(st.sampled_from(NAMES), st.sampled_from(LAYOUTS),
                 st.frozensets(st.integers(0, 3), min_size=1, max_size=2), st.sampled_from(PORTS))  # fmt: skip


class StateStoreMachine(RuleBasedStateMachine):
    """Two handles on one state file (``up`` and ``supervise``), each with the records it read
    last (its view, which the other's writes make stale), against a model of what committed:
    ``rows`` (per replica, its last committed write), ``gens`` (every generation each MODEL/N
    got), ``fences``, ``running`` (shard tokens recorded with a PID whose stop no release or
    unfence confirmed), ``cordons`` and ``version``."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="state-props-")
        path = Path(self.dir) / "state.db"
        self.stores = [Store(path, actor=a) for a in ACTORS]
        self.clock = 1000.0
        self.stores[0].save_discovery([_facts("n1", self.clock)])
        self.version = self.stores[0].version()
        self.rows: dict[Key, Row] = {}
        self.gens: dict[tuple[str, int], list[int]] = {}
        self.fences: dict[str, Key] = {}  # fence token -> its replica
        self.running: dict[str, Key] = {}
        self.cordons: dict[str, str] = {}
        self.views: list[dict[Key, ReplicaRecord]] = [{}, {}]
        self.seen_version = [self.version, self.version]
        self.n = 0

    def teardown(self) -> None:
        for s in self.stores:
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- helpers ------------------------------------------------------------
    def _next(self) -> int:
        self.n += 1
        return self.n

    def _moved(self, by: int, what: str) -> None:
        """The state version moved by exactly ``by`` (never back)."""
        event(what)  # --hypothesis-show-statistics: how often each outcome was exercised
        now = self.stores[0].version()
        assert now >= self.version, f"{what}: the state version went back ({self.version} -> {now})"
        assert now == self.version + by, f"{what}: the state version moved by {now - self.version}, not {by}"
        self.version = now

    def _has(self, states: tuple[str, ...]) -> bool:
        return any(r.status in states for v in self.views for r in v.values())

    def _pick(self, w: int, i: int, states: tuple[str, ...]) -> tuple[int, ReplicaRecord]:
        """A record writer ``w`` read earlier (or else the other writer), whose status as read
        is one of ``states``: maybe stale."""
        for who in (w, 1 - w):
            recs = [r for _, r in sorted(self.views[who].items()) if r.status in states]
            if recs:
                return who, recs[i % len(recs)]
        raise AssertionError("the rule's precondition should have ruled this out")

    def _cas_ok(self, rec: ReplicaRecord) -> bool:
        row = self.rows.get(rec.key)
        return row is not None and row.revision == rec.revision

    def _stale(self, w: int, rec: ReplicaRecord, what: str) -> None:
        """A compare-and-swap write was refused: it must have been stale, and changed nothing
        (the invariants compare every row with the model); the writer reads the row again."""
        assert not self._cas_ok(rec), f"{what} of {rec.key} at revision {rec.revision} refused, but it was current"
        self._moved(0, what + " (refused)")
        again = self.stores[w].record(*rec.key)
        if again is None:
            self.views[w].pop(rec.key, None)
        else:
            self.views[w][rec.key] = again

    def _committed(self, rec: ReplicaRecord, what: str) -> Row:
        assert self._cas_ok(rec), f"{what} of {rec.key} at revision {rec.revision} committed, but it was stale"
        return self.rows[rec.key]

    def _fresh_runs(self, rec: ReplicaRecord, ranks: list[int]) -> list[ShardRun]:
        """New processes, each with a unique token and PID."""
        out = []
        for rank in ranks:
            i = self._next()
            node = rec.replica.shards[rank].node
            out.append(ShardRun(node, f"~/.clusterctl/run/{rec.name}.g{rec.generation}", f"tok-{i}",
                                pid=10_000 + i, start_time=i))  # fmt: skip
        return out

    def _confirmed_stopped(self, key: Key, tokens: Any = None) -> None:
        """The stop of ``tokens`` (all of ``key``'s by default) was confirmed."""
        for tok in [t for t, k in self.running.items() if k == key and (tokens is None or t in tokens)]:
            del self.running[tok]

    # ---- rules --------------------------------------------------------------
    @rule(w=WRITER)
    def read(self, w: int) -> None:
        s = self.stores[w]
        with s.snapshot():
            recs = s.records(include_down=True, include_fenced=True)
            version = s.version()
        self.views[w] = {r.key: r for r in recs}
        self.seen_version[w] = version

    @rule(w=WRITER, specs=st.lists(SPEC, min_size=1, max_size=2), checked=st.sampled_from([False, False, True]))
    def reserve(self, w: int, specs: list[Any], checked: bool) -> None:
        expect = self.seen_version[w] if checked else None
        recs = [ReplicaRecord(_replica(m, n, nodes, gpus), port=port) for (m, n), nodes, gpus, port in specs]
        # What the store should do: refuse a plan made at another version; else, per record, drop
        # the rows of its MODEL/N released wanted down (stopped: they hold nothing), then refuse a
        # GPU or port held by a row not released (live, being stopped, or fenced).
        predicted, rows = "ok", dict(self.rows)
        if expect is not None and expect != self.version:
            predicted = "stale"
        else:
            for (m, n), nodes, gpus, port in specs:
                for k in [k for k, r in rows.items() if k[:2] == (m, n) and r.status == STOPPED]:
                    del rows[k]
                held_gpus = {h for r in rows.values() if r.held for h in r.gpu_holds}
                held_ports = {(r.nodes[0], r.port) for r in rows.values() if r.held}
                taken = [f"{node} GPU {g}" for node in nodes for g in sorted(gpus) if (node, g) in held_gpus]
                taken += [f"{nodes[0]} port {port}"] if (nodes[0], port) in held_ports else []
                if taken:
                    predicted = f"held: {', '.join(taken)} by a row not released"
                    break
                rows[(m, n, -self._next())] = Row(nodes, gpus, port)  # its generation is not known yet
        try:
            got = self.stores[w].reserve(recs, expect_version=expect)
        except StaleVersion:
            assert predicted == "stale", f"reserve refused as stale at version {expect} = {self.version}"
            self._moved(0, "a stale reservation")
            return
        except StateError as e:
            assert predicted.startswith("held"), f"reserve refused ({e}), predicted {predicted}"
            self._moved(0, "a refused reservation")
            return
        assert predicted == "ok", f"reserve committed, predicted {predicted}"
        self._moved(1, "reserve")
        assert got.version == self.version
        self.rows = {k: r for k, r in rows.items() if k[2] > 0}
        for rec, ((m, n), nodes, gpus, port) in zip(got.records, specs, strict=True):
            assert rec.key[:2] == (m, n) and (rec.status, rec.revision) == (PLANNED, 1)
            before = self.gens.setdefault((m, n), [])
            assert all(rec.generation > g for g in before), f"{m}/{n} got generation {rec.generation} after {before}"
            before.append(rec.generation)
            self.rows[rec.key] = Row(nodes, gpus, port)
            self.views[w][rec.key] = rec

    @precondition(lambda self: self._has(UP_STATES))
    @rule(w=WRITER, i=PICK, status=st.sampled_from([STARTING, READY, UNHEALTHY]))
    def observe(self, w: int, i: int, status: str) -> None:
        w, view = self._pick(w, i, UP_STATES)
        new = replace(view, status=status, endpoint=None, detail=f"seen by {ACTORS[w]}")
        tokens: tuple[str, ...] = ()
        if status == STARTING:
            new = replace(new, owner=f"{ACTORS[w]}-run{self._next()}")
            if view.shards:  # started again: the same processes' shards, one more restart
                new = replace(new, restarts=view.restarts + 1)
            else:
                new = replace(new, shards=tuple(self._fresh_runs(view, list(range(len(view.replica.shards))))))
                tokens = tuple(r.token for r in new.shards)
        elif status == READY:
            new = replace(new, endpoint=f"http://{view.replica.shards[0].node}:{view.port}")
        try:
            got = self.stores[w].observe(new)
        except StaleRecord:
            self._stale(w, view, "observe")
            return
        row = self._committed(view, "observe")
        self._moved(0, "observe")
        assert got.revision == row.revision + 1 and got.desired == row.desired
        row.status, row.owner, row.restarts, row.revision = status, new.owner, new.restarts, got.revision
        if tokens:
            row.tokens = tokens
            self.running.update(dict.fromkeys(tokens, view.key))
        self.views[w][view.key] = got

    @precondition(lambda self: self._has(UP_STATES))
    @rule(w=WRITER, i=PICK)
    def claim(self, w: int, i: int) -> None:
        w, seen = self._pick(w, i, UP_STATES)
        owner = f"{ACTORS[w]}-claim{self._next()}"
        got = self.stores[w].claim(seen, replace(seen, status=UNHEALTHY, owner=owner, restarts=seen.restarts + 1))
        if got is None:
            self._stale(w, seen, "claim")
            return
        row = self._committed(seen, "claim")
        self._moved(0, "claim")
        assert got.revision == row.revision + 1
        row.status, row.owner, row.restarts, row.revision = UNHEALTHY, owner, seen.restarts + 1, got.revision
        self.views[w][seen.key] = got

    @precondition(lambda self: self._has(UP_STATES))
    @rule(w=WRITER, i=PICK)
    def want_down(self, w: int, i: int) -> None:
        """A ``down`` that marked the replica and is still stopping its processes."""
        w, view = self._pick(w, i, UP_STATES)
        owner = f"{ACTORS[w]}-down{self._next()}"  # the down's run, recorded on what it stops
        try:
            got = self.stores[w].want_down(view, owner=owner)
        except StaleRecord:
            self._stale(w, view, "want_down")
            return
        row = self._committed(view, "want_down")
        self._moved(1, "want_down")
        assert (got.status, got.desired, got.revision, got.owner) == (STOPPING, DOWN, row.revision + 1, owner)
        row.status, row.desired, row.revision, row.owner = STOPPING, DOWN, got.revision, owner
        self.views[w][view.key] = got

    @precondition(lambda self: self._has(UP_STATES))
    @rule(w=WRITER, i=PICK)
    def down(self, w: int, i: int) -> None:
        """A whole ``down``: marked, its processes stopped (confirmed), released wanted down."""
        w, view = self._pick(w, i, UP_STATES)
        owner = f"{ACTORS[w]}-down{self._next()}"
        try:
            marked = self.stores[w].want_down(view, owner=owner)
        except StaleRecord:
            self._stale(w, view, "down")
            return
        row = self._committed(view, "down")
        kept = self.stores[w].release(marked, wanted_down=True, why="taken down")
        self._moved(2, "down")
        assert kept is not None and (kept.status, kept.desired, kept.revision) == (STOPPED, DOWN, row.revision + 2)
        row.status, row.desired, row.revision, row.owner = STOPPED, DOWN, kept.revision, owner
        self._confirmed_stopped(view.key)
        self.views[w][view.key] = kept

    @precondition(lambda self: self._has(RELEASABLE))
    @rule(w=WRITER, i=PICK, wanted_down=st.booleans(), fenced=st.booleans(), mask=st.integers(1, 3))
    def release(self, w: int, i: int, wanted_down: bool, fenced: bool, mask: int) -> None:
        """A release; ``fenced``: the stop of the shards in ``mask`` (or of processes that started
        unrecorded there) was not confirmed, that of the others was."""
        w, view = self._pick(w, i, RELEASABLE)
        left: list[tuple[ShardRun, str]] = []
        if fenced:
            ranks = [r for r in range(len(view.replica.shards)) if mask >> r & 1] or [0]
            runs = [view.shards[r] for r in ranks] if view.shards else self._fresh_runs(view, ranks)
            left = [(run, "the node did not answer") for run in runs]
        try:
            kept = self.stores[w].release(view, wanted_down=wanted_down, why="released", left=left)
        except StaleRecord:
            self._stale(w, view, "release")
            return
        row = self._committed(view, "release")
        self._moved(1, "release, fenced" if left else "release, wanted down" if wanted_down else "release")
        if left:
            desired = DOWN if wanted_down else row.desired
            assert kept is not None and (kept.status, kept.desired, kept.revision) == (FENCED, desired,
                                                                                        row.revision + 1)  # fmt: skip
            row.status, row.desired, row.revision = FENCED, desired, kept.revision
            fenced_tokens = {run.token for run, _ in left}
            self._confirmed_stopped(view.key, set(row.tokens) - fenced_tokens)
            for token in fenced_tokens:
                self.fences[token] = view.key
                self.running[token] = view.key
            self.views[w][view.key] = kept
        elif wanted_down:
            assert kept is not None and (kept.status, kept.desired, kept.revision) == (STOPPED, DOWN, row.revision + 1)
            row.status, row.desired, row.revision = STOPPED, DOWN, kept.revision
            self._confirmed_stopped(view.key)
            self.views[w][view.key] = kept
        else:
            assert kept is None
            del self.rows[view.key]
            self._confirmed_stopped(view.key)
            self.views[w].pop(view.key, None)

    @precondition(lambda self: self.fences)
    @rule(w=WRITER, i=PICK, bogus=st.sampled_from([False, False, True]))
    def unfence(self, w: int, i: int, bogus: bool) -> None:
        """A later stop found nothing of a fenced shard left (``bogus``: of a token never fenced)."""
        if bogus:
            assert self.stores[w].unfence(f"nothing-{self._next()}") is False
            self._moved(0, "unfence of no fence")
            return
        token = sorted(self.fences)[i % len(self.fences)]
        assert self.stores[w].unfence(token) is True
        key = self.fences.pop(token)
        self._confirmed_stopped(key, {token})
        row = self.rows.get(key)
        if any(k == key for k in self.fences.values()) or row is None or row.status != FENCED:
            self._moved(0, "unfence of one fence of several")
            return
        self._moved(1, "unfence of the last fence")  # its GPUs are free again
        self._confirmed_stopped(key)
        if row.desired == DOWN:
            row.status, row.revision = STOPPED, row.revision + 1
        else:
            del self.rows[key]

    @rule(w=WRITER, node=st.sampled_from((*NODES, "n3")), op=st.sampled_from(["fan", "psu", "uncordon", "probe"]))
    def operator(self, w: int, node: str, op: str) -> None:
        """A cordon (reason ``fan`` or ``psu``), an uncordon, or a probe of n1 that finds it as it was."""
        s = self.stores[w]
        if op == "probe":
            self.clock += 1
            assert s.save_discovery([_facts("n1", self.clock)]) is False
            self._moved(0, "a probe that changed nothing")
        elif op == "uncordon":
            assert s.uncordon(node) is (node in self.cordons)
            self._moved(1 if self.cordons.pop(node, None) is not None else 0, "uncordon")
        else:
            found = s.cordon(node, op)
            was = self.cordons.get(node)
            assert (found or {}).get("reason") == was
            self.cordons[node] = op
            self._moved(0 if was == op else 1, "cordon")

    # ---- invariants ---------------------------------------------------------
    def _db(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self.stores[1]._b._db.execute(sql, args).fetchall()

    @invariant()
    def no_gpu_booked_twice(self) -> None:
        holds = self._db("SELECT node, kind, item, uuid, model, replica, generation FROM holds")
        gpus = [(n, i, u, (m, r, g)) for n, k, i, u, m, r, g in holds if k == "gpu"]
        twice = [x for x, c in Counter((n, i) for n, i, _, _ in gpus).items() if c > 1]
        assert not twice, f"GPUs booked twice: {twice}"
        uuids = Counter(u for _, _, u, _ in gpus if u is not None)
        assert all(c == 1 for c in uuids.values()), f"UUIDs booked twice: {uuids}"
        assert all(u == _uuid(n, i) for n, i, u, _ in gpus), gpus
        ports = Counter((n, i) for n, k, i, *_ in holds if k == "port")
        assert all(c == 1 for c in ports.values()), f"ports booked twice: {ports}"
        want = {(node, g, k) for k, r in self.rows.items() if r.held for node, g in r.gpu_holds}
        got = {(n, i, k) for n, i, _, k in gpus}
        assert got == want, f"GPUs held and not by a row not released: {got - want}; not held: {want - got}"
        want_ports = {(r.nodes[0], r.port) for r in self.rows.values() if r.held}
        assert {(n, i) for n, k, i, *_ in holds if k == "port"} == want_ports
        recorded = {(sh.node, g, rec.key) for rec in self.stores[0].records(include_down=True, include_fenced=True)
                    if rec.status != STOPPED for sh in rec.replica.shards for g in sh.gpus}  # fmt: skip
        assert recorded == want
        fenced: dict[str, dict[int, str]] = {}
        for k, r in self.rows.items():
            if r.status == FENCED:
                for node, g in r.gpu_holds:
                    fenced.setdefault(node, {})[g] = f"{k[0]}/{k[1]} generation {k[2]}"
        assert self.stores[0].fenced_gpus() == fenced
        for node in NODES:
            assert self.stores[1].held_ports(node) == {p for n, p in want_ports if n == node}

    @invariant()
    def no_generation_reused(self) -> None:
        last = {(m, n): max(gs) for (m, n), gs in self.gens.items()}
        assert {(m, n): g for m, n, g in self._db("SELECT model, replica, last FROM generations")} == last
        for m, n, g in self.rows:
            assert g in self.gens[(m, n)] and g <= last[(m, n)]

    @invariant()
    def no_committed_write_lost(self) -> None:
        for s in self.stores:  # both handles read what either committed
            got = {r.key: r for r in s.records(include_down=True, include_fenced=True)}
            gone, extra = sorted(set(self.rows) - set(got)), sorted(set(got) - set(self.rows))
            assert not gone, f"rows no committed write removed are gone: {[(k, self.rows[k]) for k in gone]}"
            assert not extra, f"rows no committed write made: {extra}"
            for k, row in self.rows.items():
                rec = got[k]
                assert (rec.status, rec.desired, rec.owner, rec.restarts, rec.revision) == (
                    row.status, row.desired, row.owner, row.restarts, row.revision
                ), f"{k}: {rec}, the last committed write said {row}"  # fmt: skip
                assert tuple(r.token for r in rec.shards) == row.tokens, k
                assert rec.replica == _replica(k[0], k[1], row.nodes, row.gpus) and rec.port == row.port
        live = {k for k, r in self.rows.items() if r.desired == UP and r.status != FENCED}
        assert {r.key for r in self.stores[1].records()} == live
        assert {f.token: (f.model, f.replica, f.generation) for f in self.stores[0].fences()} == self.fences
        assert {n: c["reason"] for n, c in self.stores[1].cordons().items()} == self.cordons
        view = self.stores[0].plan_view()
        assert view.version == self.version == self.stores[1].version()
        assert {r.key for r in view.records} == live
        assert [(f.name, f.cordoned, f.cordon_reason) for f in view.nodes] == [
            ("n1", "n1" in self.cordons, self.cordons.get("n1"))
        ]

    @invariant()
    def no_running_shard_unrecorded(self) -> None:
        held = {t for (t,) in self._db(
            "SELECT s.token FROM shards s JOIN replicas r ON r.model = s.model AND r.replica = s.replica "
            "AND r.generation = s.generation WHERE r.status <> ? AND s.token IS NOT NULL", (STOPPED,))}  # fmt: skip
        fenced = {t for (t,) in self._db(
            "SELECT f.token FROM fences f JOIN replicas r ON r.model = f.model AND r.replica = f.replica "
            "AND r.generation = f.generation WHERE r.status = ?", (FENCED,))}  # fmt: skip
        lost = {t: k for t, k in self.running.items() if t not in held | fenced}
        assert not lost, f"shards recorded running, never confirmed stopped, and no longer recorded: {lost}"


# ~6 s on two cores when it passes. No explain phase: on a failure it would run the shrunk steps
# again hundreds of times to say which arguments do not matter, longer than the search itself.
StateStoreMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestStateStore = StateStoreMachine.TestCase


# ---- two processes ---------------------------------------------------------------
A_REPLICAS = 4  # a/0..a/3: process A's, on n1
A_WRITES = 300
B_ROUNDS = 100  # each: a cordon (every third lifted again), and on the first 60 a reservation and an event


def _writer_a(path: str, keys: list[Key], start: Any, out: str) -> None:
    """Observed-state writes to its replicas, each one restart more, compare and set; on a
    stale record it reads the row again and retries."""
    writes, retries = [0] * len(keys), [0] * len(keys)
    last: list[list[str]] = [[]] * len(keys)
    with Store(path, actor="A") as s:
        recs = [s.record(*k) for k in keys]
        start.wait(60)
        for i in range(A_WRITES):
            j = i % len(keys)
            status = READY if i % 2 else UNHEALTHY
            while True:
                rec = recs[j]
                assert rec is not None
                try:
                    recs[j] = s.observe(replace(rec, status=status, owner="A", restarts=rec.restarts + 1,
                                                detail=f"A{i}"))  # fmt: skip
                    break
                except StaleRecord:
                    retries[j] += 1
                    recs[j] = s.record(*keys[j])
            writes[j] += 1
            last[j] = [status, f"A{i}"]
            if i % 10 == 0:
                time.sleep(0.001)  # let B in between
    Path(out).write_text(json.dumps({"writes": writes, "retries": retries, "last": last}))


def _claim(s: Store, keys: list[Key], i: int, wins: list[int], losses: list[int]) -> None:
    """B takes one of A's replicas over: on a fresh read, then again on the same read."""
    j = i % len(keys)
    seen = s.record(*keys[j])
    assert seen is not None
    claimed = replace(seen, status=UNHEALTHY, owner="B", restarts=seen.restarts + 1, detail=f"B{i}")
    if s.claim(seen, claimed) is None:  # A wrote between the read and the claim
        losses[j] += 1
    else:
        wins[j] += 1
        # The same read again: the row moved on (by this very claim), so it must lose.
        assert s.claim(seen, claimed) is None
        losses[j] += 1


def _writer_b(path: str, keys: list[Key], start: Any, out: str) -> None:
    """Cordons, uncordons, reservations of other replicas, events, and claims on A's replicas:
    on a fresh read (they win unless A wrote between), and again on a record already claimed
    from (they always lose)."""
    reserved: list[Key] = []
    cordoned: set[str] = set()
    wins, losses, notes, moves = [0] * len(keys), [0] * len(keys), 0, 0
    with Store(path, actor="B") as s:
        start.wait(60)
        for i in range(B_ROUNDS):
            assert s.cordon(f"c{i}", "maintenance") is None
            cordoned.add(f"c{i}")
            moves += 1
            if i % 3 == 0:
                assert s.uncordon(f"c{i}") is True
                cordoned.discard(f"c{i}")
                moves += 1
            if i < 60:
                rep = Replica("b", i, "p", "vllm", (Shard(f"bn{i % 10}", (i // 10,)),), gpu_class="H100")
                (rec,) = s.reserve([ReplicaRecord(rep, port=9000 + i)]).records
                reserved.append(rec.key)
                moves += 1
                s.record_event("note", f"B note {i}")
                notes += 1
            _claim(s, keys, i, wins, losses)
            time.sleep(0.001)  # let A in between
        i = B_ROUNDS
        while not any(wins):  # A won every race so far (a very busy machine): once A is done, B wins
            _claim(s, keys, i, wins, losses)
            i += 1
    Path(out).write_text(json.dumps({"reserved": reserved, "cordoned": sorted(cordoned), "wins": wins,
                                     "losses": losses, "notes": notes, "moves": moves}))  # fmt: skip


@pytest.mark.slow
def test_two_processes_hundreds_of_writes_each_lose_nothing(tmp_path: Path) -> None:
    """A (a supervisor) writes the observed state of its replicas 300 times, compare and set;
    B (an operator and an ``up``) cordons, reserves, records events and claims A's replicas
    ~300 times. Every write either reports committed is there once, and nothing else is."""
    path = str(tmp_path / "s.db")
    with Store(path, actor="setup") as s:
        booked = s.reserve(
            [ReplicaRecord(_replica("a", n, ("n1",), frozenset({n})), port=8100 + n) for n in range(A_REPLICAS)]
        ).records
        keys = [r.key for r in booked]
        for rec in booked:
            s.observe(replace(rec, status=READY, owner="A"))
        v0 = s.version()
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)  # both have opened the state: go
    outs = [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    procs = [ctx.Process(target=_writer_a, args=(path, keys, start, outs[0])),
             ctx.Process(target=_writer_b, args=(path, keys, start, outs[1]))]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    a = json.loads(Path(outs[0]).read_text())
    b = json.loads(Path(outs[1]).read_text())
    assert sum(a["writes"]) == A_WRITES and sum(b["wins"]) + sum(b["losses"]) >= B_ROUNDS
    assert sum(b["wins"]) >= 1 and sum(b["losses"]) >= 1
    with Store(path) as s:
        recs = {r.key: r for r in s.records(include_down=True, include_fenced=True)}
        events = s._b._db.execute("SELECT kind, model, replica, generation, actor, message FROM events").fetchall()
        restarted = Counter((m, r, actor) for kind, m, r, _, actor, _ in events if kind == "restarted")
        for j, key in enumerate(keys):
            rec = recs[key]
            # Each of A's writes and each of B's winning claims is one restart, one revision, one event.
            assert rec.restarts == a["writes"][j] + b["wins"][j], (key, rec, a, b)
            assert rec.revision == 2 + a["writes"][j] + b["wins"][j]
            assert restarted[(key[0], key[1], "A")] == a["writes"][j]
            assert restarted[(key[0], key[1], "B")] == b["wins"][j]
            # A retried only after B's claims moved the row: at most once per claim won.
            assert a["retries"][j] <= b["wins"][j]
            # The last write is A's last one, or a claim of B's after it.
            assert [rec.status, rec.detail] == a["last"][j] or (rec.status, rec.owner) == (UNHEALTHY, "B")
        assert sorted(s.cordons()) == b["cordoned"]
        reserved = {tuple(k) for k in b["reserved"]}
        assert {k for k in recs if k[0] == "b"} == reserved and len(reserved) == len(b["reserved"]) == 60
        b_reserved = [(m, r, g) for kind, m, r, g, *_ in events if kind == "reserved" and m == "b"]
        assert sorted(b_reserved) == sorted(reserved)  # one event each, none doubled
        notes = [msg for kind, *_, actor, msg in events if kind == "note" and actor == "B"]
        assert sorted(notes) == sorted(f"B note {i}" for i in range(b["notes"]))
        assert s.version() == v0 + b["moves"]  # observes and claims never moved it
