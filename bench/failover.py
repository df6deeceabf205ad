#!/usr/bin/env python3
"""Benchmark of ``clusterctl supervise``: how fast a node's failure is noticed, taken out of
the router and its replica rebuilt; what the supervisor costs idle; one pass at 1,000 nodes.

Three parts (``all`` runs them in this order):

``faults``: for each of ``--faults`` (kill, freeze, partition) a fresh scenario on one
testbed of 3 ``cpu-only`` nodes (``testbed/cluster.py``; partition needs netns mode, else it
is skipped): a fresh state, ``serve-router`` started first (its config's
``router.limits.idle_timeout_s`` set to ``--idle-timeout`` so that a frozen engine's streams
end; its access log to a file; ``--watch-interval``), ``up`` of 2 replicas of the tiny GGUF
model of ``tests/gguf_tiny.py`` on real ``llama-server``s (one CPU thread, ``-c 8192``: every
client's stream fits the one KV cache the engine's slots share), then ``clusterctl
supervise --interval I --grace G`` and ``--clients`` openai clients streaming
``--max-tokens``-token chat completions through the router without pause. Once they have
completed ``--warm`` requests the fault is injected on the node of ``tiny/0`` (t0, wall
clock), and the run goes on until the replacement of ``tiny/0`` has completed ``--served``
requests (or ``--settle`` s after it became ready). Meanwhile the router's ``/health`` is
polled every ``--poll`` s: per engine URL its requests in flight, completed and failed (each
attempt counts, those the router retried elsewhere too). Measured from t0:

* (a) the last request the router sent to the dead engine: the latest of the access log's
  requests on its replica that started after t0 (and before the replacement was ready) and of
  the polls in which the dead URL's attempts (in flight + completed + failed) grew (a poll's
  resolution); and when it left the router's table;
* the node marked unreachable, and (b) marked lost: the ``node-unreachable`` and
  ``node-lost`` events of the state (wall-clock times);
* (c) the replacement serving: the first byte of the first request answered by the new
  generation (access log: start + time to first byte; a client's next request may come a
  stream's length later), and its first completion; the first poll with its URL in the
  router's table; the new
  generation's ``starting`` -> ``ready`` events (the engine's start as ``up`` runs it: the
  start script over SSH, the model load, the readiness polls), and a bare ``llama-server``
  start on this machine (spawn to ``/health`` 200, once before the scenarios);
* requests completed and failed from t0 on, each failure with its reason and how long it ran,
  and the streams in flight on the dead engine when the fault went in (the access log:
  requests on its replica that started before the injection's end and ended after t0; a
  kill's SIGKILLs take 0.03-0.4 s), beside its in-flight count on the router's ``/health``
  just before t0.

Targets (the project's issue; printed, never asserted): (a) under 2 s; (b) at most
``--grace`` + one ``--interval``; (c) at most (b) + the engine's start + 2 s; failed requests
no more than the streams in flight on the dead engine. ``--defaults`` adds one kill with
``supervise``'s defaults (interval 2 s, grace 30 s).

``idle``: a testbed of ``--nodes`` (64) ``cpu-only`` nodes, ``discover`` into a fresh state,
then ``clusterctl supervise -c EMPTY --interval 2`` (a catalog of no models: only heartbeats,
no pass) for ``--minutes`` (10); with ``--stored-catalog``, ``up -c EMPTY`` first and
``supervise`` without ``-c``, as it runs after an ``up`` (the stored catalog: a pass at every
tick); its process's CPU time (``/proc/PID/stat``: user + system,
its children's included) and RSS (``VmRSS``) sampled every ``--sample`` s: CPU as a share of
one core, RSS first against last and its peak, and the heartbeat's share of the machine
(every node's sshd and scripts run on these cores too).

``pass``: no SSH: ``--sim-nodes`` (1,000) fake nodes (``tests/fakenodes.py``) with the facts
of a 16-CPU node each in a fresh state, a catalog of ``--sim-replicas`` (200) CPU replicas of
two models, a ``Supervisor`` built as ``tests/test_supervise.py``'s rig builds it (its own
clock). After a first pass starts every replica (timed apart), ``--repeat`` times each: one
``tick()`` (the heartbeat of every fake node, the node states, the lease) and one
``reconcile()`` pass with nothing to do; then one node of a replica killed: the tick that
finds it unreachable (takes its replica out of the router), the tick ``--grace`` later that
finds it lost (releases the replica), and the pass that rebuilds it. The fake nodes answer at
once, so these are the control plane's own times (state reads and writes, placement, the
router config), not the network's.

    python bench/failover.py faults                                   # kill, freeze, partition
    python bench/failover.py faults --faults kill --defaults          # also one with interval 2, grace 30
    python bench/failover.py idle --nodes 64 --minutes 10
    python bench/failover.py idle --nodes 8 --minutes 1               # a quick check
    python bench/failover.py pass --sim-nodes 1000 --sim-replicas 200
    python bench/failover.py all --minutes 3 --json failover.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gguf_tiny import make_tiny_gguf  # noqa: E402
from llama import find_llama_server, llama_server_version  # noqa: E402

from testbed import Cluster, TestbedError, count_specs, unavailable_reason  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from benchlib import LoadSampler, tool  # noqa: E402

PRESET = "cpu-only"
PORT_BASE = 23000
PORTS_PER_NODE = 20
CLK_TCK = os.sysconf("SC_CLK_TCK")
ANCHORS = "GPUStack 300-330 s, Kubernetes about 350 s, Nomad 20-30 s, dstack at least 2 min (before the engine starts)"


def _tool(name: str) -> str:
    return tool(name, "failover")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _fmt(x: float | None, d: int = 2) -> str:
    return f"{x:.{d}f}" if x is not None else "-"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def _wait(pred: Any, timeout: float, what: str, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise TestbedError(f"{what}: not within {timeout:g} s")


def _engine_pids(needle: str) -> list[int]:
    """Every process whose command line names ``needle`` (the model path): the engines, which
    share this machine's kernel with the testbed's nodes."""
    out, key = [], needle.encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with suppress(OSError):
                if key in (d / "cmdline").read_bytes().split(b"\0"):
                    out.append(int(d.name))
    return out


def _kill_engines(needle: str) -> None:
    for pid in _engine_pids(needle):
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGCONT)  # a frozen one must run to die
            os.kill(pid, signal.SIGKILL)


def _commit() -> str:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10, check=False)  # fmt: skip
    except OSError:
        return "?"
    return p.stdout.strip() or "?"


@contextmanager
def testbed(directory: Path, n: int, keep: bool) -> Iterator[Cluster]:
    c = Cluster.start(directory, count_specs(n, PRESET, "cpu"), stop_at_exit=not keep)
    try:
        yield c
    finally:
        if not keep:
            c.stop()


def _inventory(c: Cluster, path: Path) -> Path:
    """The testbed's inventory with a port range per node (in loopback mode every node is one host)."""
    data = yaml.safe_load(c.inventory_path.read_text())
    for i, n in enumerate(data["nodes"]):
        lo = PORT_BASE + PORTS_PER_NODE * i
        n["ports"] = f"{lo}-{lo + PORTS_PER_NODE - 1}"
    p = c.inventory_path.parent / path.name  # beside it: its key paths are relative
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


# ---------------------------------------------------------------------------
# faults


class Load:
    """``n`` clients streaming chat completions through the router without pause (the
    ``openai`` client, no retries); every request's start, end and outcome (wall clock)."""

    def __init__(self, port: int, n: int, max_tokens: int) -> None:
        self.port, self.max_tokens = port, max_tokens
        self.stop = threading.Event()
        self.done: list[tuple[float, float, int]] = []  # (start, end, tokens)
        self.failed: list[tuple[float, float, str]] = []  # (start, end, why)
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]

    def _client(self) -> None:
        from openai import OpenAI

        c = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=30)
        while not self.stop.is_set():
            t0 = time.time()
            try:
                parts = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=self.max_tokens,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                n = sum(1 for p in parts if p.choices and p.choices[0].delta.content)
                self.done.append((t0, time.time(), n))
            except Exception as e:  # every failure is the finding
                self.failed.append((t0, time.time(), f"{type(e).__name__}: {str(e)[:140]}"))
                time.sleep(0.05)  # a router with nothing to send to answers at once: no busy loop

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


class Poller:
    """The router's ``/health`` every ``step`` s: per URL (time, in flight, completed, failed,
    removed, breaker state)."""

    def __init__(self, port: int, step: float) -> None:
        self.url, self.step = f"http://127.0.0.1:{port}/health", step
        self.samples: list[tuple[float, dict[str, dict[str, Any]]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            doc = _get_json(self.url, timeout=1.0)
            if doc is not None:
                self.samples.append((time.time(), {e["url"]: e for e in doc.get("endpoints", [])}))
            self._stop.wait(self.step)

    def __enter__(self) -> Poller:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    def last_send(self, url: str, after: float) -> float | None:
        """The time of the last poll (after ``after``) in which ``url``'s attempts grew."""
        prev, last = None, None
        for t, eps in self.samples:
            e = eps.get(url)
            n = None if e is None else e["inflight"] + e["completed"] + e["failed"]
            if n is not None and prev is not None and n > prev and t > after:
                last = t
            if n is not None:
                prev = n
        return last

    def gone(self, url: str, after: float) -> float | None:
        """The first poll after ``after`` where ``url`` is out of the table (or removed)."""
        for t, eps in self.samples:
            if t > after and (url not in eps or eps[url].get("removed")):
                return t
        return None

    def first_seen(self, url: str, after: float) -> float | None:
        """The first poll after ``after`` with ``url`` in the router's table (not removed)."""
        for t, eps in self.samples:
            if t > after and url in eps and not eps[url].get("removed"):
                return t
        return None

    def first_completed(self, url: str) -> float | None:
        for t, eps in self.samples:
            if url in eps and eps[url]["completed"] > 0:
                return t
        return None

    def completed(self, url: str) -> int:
        for _, eps in reversed(self.samples):
            if url in eps:
                return int(eps[url]["completed"])
        return 0


@dataclass
class Fault:
    fault: str
    interval: float
    grace: float
    ok: bool = False
    error: str = ""
    node: str = ""
    new_node: str = ""
    mode: str = ""
    inject_s: float = 0.0  # how long the injection itself took
    last_sent_log_s: float | None = None  # (a), the access log's requests on the dead replica
    last_sent_poll_s: float | None = None  # (a), /health's attempts on the dead URL
    last_sent_s: float | None = None  # (a): the later of the two (0: none after the fault)
    out_of_table_s: float | None = None  # the dead URL left the router's table
    unreachable_s: float | None = None
    lost_s: float | None = None  # (b)
    reserved_s: float | None = None  # the new generation reserved
    starting_s: float | None = None
    ready_s: float | None = None
    engine_start_s: float | None = None  # starting -> ready
    in_table_s: float | None = None  # the new engine in the router's table (a /health poll)
    first_byte_s: float | None = None  # (c)
    first_done_s: float | None = None
    completed: int = 0  # requests completed from t0 to the end
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    inflight_dead: int | None = None  # streams in flight on the dead engine as the fault went in (access log)
    inflight_dead_poll: int | None = None  # the same, the router's /health just before t0
    before: int = 0  # requests completed before t0
    served_new: int = 0
    load: str = ""
    t0: float = 0.0  # the fault, wall clock


def _records(state: Path) -> dict[str, Any]:
    from cluster_cli.state.store import Store

    with Store(state, readonly=True) as s:
        return {r.name: r for r in s.records()}


def _events(state: Path) -> list[Any]:
    from cluster_cli.state.store import Store

    with Store(state, readonly=True) as s:
        return list(s.events())


def _access(path: Path) -> list[dict[str, Any]]:
    out = []
    with suppress(OSError):
        for ln in path.read_text(errors="replace").splitlines():
            with suppress(ValueError):
                d = json.loads(ln)
                if d.get("path") == "/v1/chat/completions":
                    out.append(d)
    return out


class Faults:
    def __init__(self, work: Path, c: Cluster, binary: str, model: Path, args: argparse.Namespace) -> None:
        self.work, self.c, self.binary, self.model, self.args = work, c, binary, model, args
        self.clusterctl = _tool("clusterctl")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "LLAMA_ARG_"))}
        self.inv = _inventory(c, work / "inventory-failover.yaml")
        self.cat = work / "catalog-failover.yaml"
        # -c 8192: 4 streams of --max-tokens fit the engine's one KV cache (2,048 by default, shared by its slots)
        prof = {"name": "cpu", "engine": "llamacpp", "cpus": 1, "memory_gib": 0.25, "model": str(model),
                "args": ["-c", "8192"]}  # fmt: skip
        doc = {
            "engines": {"llamacpp": {"command": binary}},
            "models": [{"name": "tiny", "replicas": 2, "profiles": [prof]}],
        }
        self.cat.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.n = 0

    def ctl(self, state: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.clusterctl, "--state", str(state), *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout, check=False)  # fmt: skip

    def run(self, fault: str, interval: float, grace: float) -> Fault:
        self.n += 1
        f = Fault(fault, interval, grace, mode=self.c.mode)
        d = self.work / f"{self.n:02d}-{fault}-i{interval:g}-g{grace:g}"
        state = d / "st" / "state.db"
        state.parent.mkdir(parents=True)
        config = state.parent / "router.yaml"
        config.write_text(f"models: {{}}\nrouter:\n  limits:\n    idle_timeout_s: {self.args.idle_timeout}\n")
        port, access = _free_port(), d / "access.log"
        router = subprocess.Popen(
            [self.clusterctl, "serve-router", "-c", str(config), "--port", str(port), "--access-log", str(access),
             "--watch-interval", str(self.args.watch_interval)],
            stdout=(d / "router.out").open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
        sup: subprocess.Popen[bytes] | None = None
        try:
            _wait(lambda: _get_json(f"http://127.0.0.1:{port}/health") is not None, 30, "serve-router start")
            r = self.ctl(state, "up", "-i", str(self.inv), "-c", str(self.cat), "-o", "json", "--timeout", "120")
            if r.returncode != 0:
                raise TestbedError(f"up rc {r.returncode}: {r.stderr.strip()[-300:]}")
            models = f"http://127.0.0.1:{port}/v1/models"
            _wait(lambda: any(m.get("id") == "tiny" for m in (_get_json(models) or {}).get("data", [])), 30,
                  "the router listing tiny")  # fmt: skip
            sup = subprocess.Popen(
                [self.clusterctl, "--state", str(state), "supervise", "-i", str(self.inv), "--interval", f"{interval:g}",
                 "--grace", f"{grace:g}", "--timeout", "120"],
                stdout=subprocess.DEVNULL, stderr=(d / "supervise.err").open("wb"), stdin=subprocess.DEVNULL,
                env=self.env,
            )  # fmt: skip
            self._scenario(f, state, config, port, access, d)
        except (TestbedError, subprocess.TimeoutExpired, OSError) as e:
            f.error = str(e)
        finally:
            self._restore(f)
            if sup is not None:
                sup.send_signal(signal.SIGTERM)
                try:
                    sup.wait(60)
                except subprocess.TimeoutExpired:
                    sup.kill()
                    sup.wait(10)
            router.terminate()  # flushes the access log
            with suppress(subprocess.TimeoutExpired):
                router.wait(30)
            with suppress(subprocess.TimeoutExpired):
                self.ctl(state, "down", "--all", timeout=120)
            _kill_engines(str(self.model))
        if not f.error:
            self._measure(f, state, access)
        f.ok = not f.error
        return f

    def _restore(self, f: Fault) -> None:
        if not f.node:
            return
        with suppress(TestbedError, OSError, subprocess.SubprocessError):
            if f.fault == "kill":
                self.c.revive(f.node)
            elif f.fault == "freeze":
                self.c.thaw(f.node)
            elif f.fault == "partition":
                self.c.heal(f.node)

    def _scenario(self, f: Fault, state: Path, config: Path, port: int, access: Path, d: Path) -> None:
        a = self.args
        with Load(port, a.clients, a.max_tokens) as load, Poller(port, a.poll) as poll:
            try:
                _wait(lambda: len(load.done) >= a.warm, 120, f"{a.warm} requests before the fault")
            except TestbedError as e:
                raise TestbedError(f"{e} ({len(load.done)} done, {len(load.failed)} failed: "
                                   f"{load.failed[0][2] if load.failed else '-'})") from None  # fmt: skip
            victim = _records(state)["tiny/0"]
            f.node = victim.shards[0].node
            self.victim_url, self.victim_gen = victim.endpoint, victim.generation
            doc = yaml.safe_load(config.read_text())
            names = {e["url"]: e.get("replica") for m in doc["models"].values() for e in m["endpoints"]}
            self.victim_name = names.get(victim.endpoint) or victim.endpoint.removeprefix("http://")
            time.sleep(2 * f.interval)  # the supervisor past its first ticks
            f.before = len(load.done)
            f.load = _loadavg()
            snap = _get_json(f"http://127.0.0.1:{port}/health", timeout=1.0) or {}
            at = {e["url"]: e for e in snap.get("endpoints", [])}.get(victim.endpoint)
            f.inflight_dead_poll = None if at is None else int(at["inflight"])
            self.t0 = time.time()
            getattr(self.c, f.fault)(f.node)
            f.inject_s, f.t0 = time.time() - self.t0, self.t0

            def rebuilt() -> bool:
                rec = _records(state).get("tiny/0")
                return rec is not None and rec.status == "ready" and rec.generation > victim.generation

            _wait(rebuilt, f.grace + 180, "the replacement of tiny/0 ready", step=0.05)
            t_ready = time.time()
            new = _records(state)["tiny/0"]
            f.new_node, self.new_url = new.shards[0].node, new.endpoint
            _wait(lambda: poll.completed(new.endpoint) >= a.served or time.time() - t_ready > a.settle,
                  a.settle + 10, "the replacement serving")  # fmt: skip
            time.sleep(max(2 * a.poll, 0.3))
        self.poll, self.load_obj = poll, load

    def _measure(self, f: Fault, state: Path, access: Path) -> None:
        t0, poll, load = self.t0, self.poll, self.load_obj
        evs = [e for e in _events(state) if e.at >= t0 - 0.5]

        def first(kind: str, **match: Any) -> float | None:
            for e in evs:
                if e.kind == kind and all(getattr(e, k) == v for k, v in match.items()):
                    return e.at - t0
            return None

        f.unreachable_s = first("node-unreachable", node=f.node)
        f.lost_s = first("node-lost", node=f.node)
        newer = [e for e in evs if e.model == "tiny" and e.replica == 0 and (e.generation or 0) > self.victim_gen]
        for kind in ("reserved", "starting", "ready"):
            got = next((e.at - t0 for e in newer if e.kind == kind), None)
            setattr(f, f"{kind}_s", got)
        if f.starting_s is not None and f.ready_s is not None:
            f.engine_start_s = f.ready_s - f.starting_s
        lines = _access(access)
        ready_at = t0 + (f.ready_s if f.ready_s is not None else 1e9)
        on_dead = [x for x in lines if x.get("endpoint") == self.victim_name]
        starts = [x["ts"] - x["duration_ms"] / 1000 for x in on_dead]
        after = [s for s in starts if t0 <= s < ready_at]
        f.last_sent_log_s = (max(after) - t0) if after else 0.0
        ps = poll.last_send(self.victim_url, t0)
        f.last_sent_poll_s = (ps - t0) if ps is not None else 0.0
        f.last_sent_s = max(f.last_sent_log_s, f.last_sent_poll_s)
        gone = poll.gone(self.victim_url, t0)
        f.out_of_table_s = gone - t0 if gone is not None else None
        # In flight while the fault went in (a kill's SIGKILLs take a while): started before its end, ended after t0.
        f.inflight_dead = sum(1 for x, s in zip(on_dead, starts, strict=True) if s < t0 + f.inject_s and x["ts"] > t0)
        served = [x for x in lines if x.get("endpoint") == self.victim_name and x.get("status") == 200
                  and x["ts"] - x["duration_ms"] / 1000 >= ready_at - 0.5 and x.get("ttfb_ms") is not None]  # fmt: skip
        if served:
            f.first_byte_s = min(x["ts"] - x["duration_ms"] / 1000 + x["ttfb_ms"] / 1000 for x in served) - t0
            f.first_done_s = min(x["ts"] for x in served if not x.get("note")) - t0 if any(
                not x.get("note") for x in served) else None  # fmt: skip
        f.served_new = poll.completed(self.new_url)
        seen = poll.first_seen(self.new_url, t0)
        f.in_table_s = seen - t0 if seen is not None else None
        f.completed = sum(1 for s, e, _ in load.done if e >= t0)
        fails = [x for x in load.failed if x[1] >= t0]
        f.failed = len(fails)
        f.failures = [f"{s - t0:+.2f}s..{e - t0:+.2f}s: {why}" for s, e, why in fails]
        if f.lost_s is None:
            f.error = "no node-lost event"
        elif f.first_byte_s is None:
            f.error = "the replacement served nothing"


def bare_start(binary: str, model: Path, work: Path, runs: int = 3) -> list[float]:
    """Seconds from spawning ``llama-server`` on the tiny model (one thread) to ``/health`` 200."""
    out = []
    for i in range(runs):
        port = _free_port()
        log = (work / f"bare-{i}.log").open("wb")
        t = time.perf_counter()
        p = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1"],
                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        try:
            while time.perf_counter() - t < 60:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            out.append(time.perf_counter() - t)
                            break
                except OSError:
                    pass
                time.sleep(0.01)
        finally:
            p.kill()
            p.wait(10)
            log.close()
    return out


def _fault_lines(f: Fault, engine_bare: float | None) -> list[str]:
    if f.error and f.lost_s is None:
        return [f"  {f.fault} (interval {f.interval:g}, grace {f.grace:g}): FAILED: {f.error}"]
    lines = [
        f"  {f.fault} {f.node} (interval {f.interval:g} s, grace {f.grace:g} s; load at t0 {f.load}; the injection "
        f"took {f.inject_s:.2f} s); tiny/0 rebuilt on {f.new_node or '-'}:",
        f"    (a) last request sent to the dead engine  {_fmt(f.last_sent_s)} s (access log {_fmt(f.last_sent_log_s)}, "
        f"/health polls {_fmt(f.last_sent_poll_s)}); out of the router's table {_fmt(f.out_of_table_s)} s; "
        f"node unreachable {_fmt(f.unreachable_s)} s   target < 2 s: {_met(f.last_sent_s, 2.0)}",
        f"    (b) node lost                            {_fmt(f.lost_s)} s   target <= grace + interval = "
        f"{f.grace + f.interval:g} s: {_met(f.lost_s, f.grace + f.interval)}",
    ]
    eng = f.engine_start_s
    bound = (f.lost_s + eng + 2.0) if f.lost_s is not None and eng is not None else None
    extra = (f.first_byte_s - f.lost_s - eng) if None not in (f.first_byte_s, f.lost_s, eng) else None
    bare = (f.first_byte_s - f.lost_s - engine_bare) if None not in (f.first_byte_s, f.lost_s, engine_bare) else None
    lines += [
        f"    (c) replacement serving (first byte)     {_fmt(f.first_byte_s)} s (first completion {_fmt(f.first_done_s)}; "
        f"reserved {_fmt(f.reserved_s)}, starting {_fmt(f.starting_s)}, ready {_fmt(f.ready_s)}, in the router's "
        f"table {_fmt(f.in_table_s)}); engine start "
        f"(starting -> ready) {_fmt(eng)} s; (c) - (b) - engine start {_fmt(extra)} s "
        f"(- the bare engine start instead: {_fmt(bare)} s)   target (c) <= (b) + engine start + 2 s = "
        f"{_fmt(bound)} s: {_met(f.first_byte_s, bound)}",
        f"    requests from t0: {f.completed} completed, {f.failed} failed; streams in flight on the dead engine during the injection "
        f"{f.inflight_dead} (the router's /health just before t0: {f.inflight_dead_poll})   target failed <= in flight: "
        f"{_met(f.failed, max(f.inflight_dead or 0, f.inflight_dead_poll or 0))}; the replacement completed "
        f"{f.served_new}",
    ]
    lines += [f"      failed {x}" for x in f.failures[:8]]
    if len(f.failures) > 8:
        lines.append(f"      ... {len(f.failures) - 8} more")
    if f.error:
        lines.append(f"    FAILED: {f.error}")
    return lines


def _met(v: float | None, bound: float | None) -> str:
    if v is None or bound is None:
        return "-"
    return "met" if v <= bound else "NOT met"


def faults_part(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    binary = args.llama_server or find_llama_server()
    if binary is None:
        raise SystemExit(
            "failover bench: llama-server not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh"
        )
    model = make_tiny_gguf(work / "tiny.gguf")
    print(f"engine: llama-server {llama_server_version(binary) or '?'} ({binary}); model {model}")
    bare = bare_start(binary, model, work)
    bare_med = statistics.median(bare) if bare else None
    print(f"bare llama-server start (spawn to /health 200): {', '.join(f'{x:.2f}' for x in bare)} s", flush=True)
    plan = [(x, args.interval, args.grace) for x in args.faults.split(",") if x]
    if args.defaults:
        plan.append(("kill", 2.0, 30.0))
    results: list[Fault] = []
    load = LoadSampler()
    t = time.perf_counter()
    with testbed(work / "testbed", 3, args.keep) as c, load:
        print(f"[3 nodes] testbed up in {time.perf_counter() - t:.1f}s ({c.mode})", flush=True)
        fb = Faults(work, c, binary, model, args)
        for fault, interval, grace in plan:
            if fault == "partition" and c.mode != "netns":
                print("  partition: skipped (needs the testbed's netns mode; loopback would freeze instead)")
                continue
            if fault not in ("kill", "freeze", "partition"):
                raise SystemExit(f"failover bench: unknown fault {fault!r}")
            f = fb.run(fault, interval, grace)
            results.append(f)
            for ln in _fault_lines(f, bare_med):
                print(ln, flush=True)
    print(f"  load average during the scenarios: {load.summary()}; now {_loadavg()}")
    print(f"  anchors (fault to lost/rescheduled): {ANCHORS}")
    out["bare_engine_start_s"] = bare
    out["faults"] = [vars(f) for f in results]
    out["faults_load"] = load.summary()
    return all(f.ok for f in results)


# ---------------------------------------------------------------------------
# idle


def _proc(pid: int) -> tuple[float, int]:
    """(CPU seconds: user + system, its reaped children's too; RSS KiB) of ``pid``."""
    f = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    cpu = sum(int(x) for x in f[11:15]) / CLK_TCK
    rss = 0
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            rss = int(ln.split()[1])
    return cpu, rss


def _box_busy() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK


def idle_part(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    clusterctl = _tool("clusterctl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_")}
    t = time.perf_counter()
    with testbed(work / "testbed-idle", args.nodes, args.keep) as c:
        print(f"[{args.nodes} nodes] testbed up in {time.perf_counter() - t:.1f}s ({c.mode})", flush=True)
        inv = _inventory(c, work / "inventory-idle.yaml")
        state = work / "idle" / "st" / "state.db"
        state.parent.mkdir(parents=True)
        r = subprocess.run([clusterctl, "--state", str(state), "discover", "-i", str(inv), "-o", "json"],
                           capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
        if r.returncode != 0:
            print(f"  discover FAILED: rc {r.returncode}: {r.stderr.strip()[-300:]}")
            return False
        reach = sum(1 for n in json.loads(r.stdout).get("nodes", []) if n.get("reachable"))
        cat = work / "catalog-empty.yaml"
        cat.write_text("models: []\n")
        given = ["-c", str(cat)]
        if args.stored_catalog:  # as `clusterctl supervise` runs after an `up`: the catalog the state keeps
            r = subprocess.run([clusterctl, "--state", str(state), "up", "-i", str(inv), "-c", str(cat), "-o", "json"],
                               capture_output=True, text=True, env=env, timeout=300, check=False)  # fmt: skip
            if r.returncode != 0:
                print(f"  up FAILED: rc {r.returncode}: {r.stderr.strip()[-300:]}")
                return False
            given = []
        err = work / "idle" / "supervise.err"
        p = subprocess.Popen([clusterctl, "--state", str(state), "supervise", "-i", str(inv), *given,
                              "--interval", f"{args.idle_interval:g}"], stdout=subprocess.DEVNULL,
                             stderr=err.open("wb"), stdin=subprocess.DEVNULL, env=env)  # fmt: skip
        samples: list[tuple[float, float, int, float]] = []  # (t, cpu s, rss KiB, box busy s)
        try:
            time.sleep(args.settle_idle)  # start-up and connecting every node: not idle
            t_end = time.monotonic() + args.minutes * 60
            how = "the catalog the state keeps (an empty one, stored by up)" if args.stored_catalog else "-c EMPTY"
            print(f"  discover: {reach}/{args.nodes} nodes reachable; supervise ({how}) pid {p.pid}, sampling every "
                  f"{args.sample:g} s for {args.minutes:g} min after {args.settle_idle:g} s (load {_loadavg()})",
                  flush=True)  # fmt: skip
            while True:
                if p.poll() is not None:
                    print(f"  supervise exited rc {p.returncode}: {err.read_text()[-300:]}")
                    return False
                cpu, rss = _proc(p.pid)
                samples.append((time.monotonic(), cpu, rss, _box_busy()))
                if time.monotonic() >= t_end:
                    break
                time.sleep(min(args.sample, max(0.0, t_end - time.monotonic())))
            load = _loadavg()
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    (t0, c0, r0, b0), (t1, c1, r1, b1) = samples[0], samples[-1]
    pct = 100 * (c1 - c0) / (t1 - t0)
    box = 100 * (b1 - b0) / (t1 - t0)
    peak = max(s[2] for s in samples)
    mid = samples[len(samples) // 2][2]
    log = err.read_text(errors="replace")
    notes = [ln for ln in log.splitlines() if "->" in ln or "fail" in ln][:5]
    rates = [100 * (b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(samples) if b[0] > a[0]]
    print(f"  supervise idle, {args.nodes} nodes, interval {args.idle_interval:g} s, {(t1 - t0) / 60:.1f} min: CPU "
          f"{pct:.2f}% of one core (per {args.sample:g}-s sample: min {min(rates):.1f}, median "
          f"{statistics.median(rates):.1f}, max {max(rates):.1f})   target < 5%: {_met(pct, 5.0)}")  # fmt: skip
    print(f"  RSS first {r0 / 1024:.1f} MiB, middle {mid / 1024:.1f}, last {r1 / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB "
          f"(last - first {(r1 - r0) / 1024:+.1f} MiB)   target flat")  # fmt: skip
    print(f"  the whole machine meanwhile {box:.0f}% of one core (every node's sshd and heartbeat scripts, other work); "
          f"load at the end {load}")  # fmt: skip
    for ln in notes:
        print(f"    supervise: {ln}")
    out["idle"] = {"stored_catalog": args.stored_catalog, "nodes": args.nodes, "interval": args.idle_interval, "minutes": (t1 - t0) / 60, "cpu_pct": pct,
                   "rss_first_kib": r0, "rss_last_kib": r1, "rss_peak_kib": peak, "box_pct": box, "load_end": load,
                   "samples": samples, "mode": c.mode}  # fmt: skip
    return True


# ---------------------------------------------------------------------------
# one pass at 1,000 simulated nodes


def pass_part(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    from fakenodes import FakeFleet
    from helpers import cpu_node

    from cluster_cli.config.catalog import Catalog
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.control.cluster import Cluster as Ctl
    from cluster_cli.control.supervise import Settings, Supervisor
    from cluster_cli.state.aio import AsyncStore
    from cluster_cli.state.store import Store

    n, reps = args.sim_nodes, args.sim_replicas
    names = [f"n{i:04d}" for i in range(n)]
    d = work / "sim"
    d.mkdir(parents=True, exist_ok=True)
    half = reps // 2
    cat = Catalog.model_validate({"models": [
        {"name": m, "replicas": k, "profiles": [{"name": "cpu", "engine": "llamacpp", "model": f"/models/{m}.gguf",
                                                 "cpus": 8}]}
        for m, k in (("a", half), ("b", reps - half)) if k]})  # fmt: skip
    inv = Inventory.model_validate({"nodes": [{"name": x, "host": f"h-{x}"} for x in names]})
    res: dict[str, Any] = {"nodes": n, "replicas": reps}

    async def go(astore: AsyncStore) -> None:
        fleet = FakeFleet(names)
        router = d / "router.yaml"
        cluster = Ctl(inv, d / "inventory.yaml", astore, None, router, nodes=fleet, drain_s=0.1)  # type: ignore[arg-type]
        now = [1000.0]
        logs: list[str] = []
        sup = Supervisor(cluster, cat, Settings(interval_s=2, grace_s=args.grace_sim), logs.append, lambda: now[0])
        sup.settings.start_timeout_s = 30
        sup.settings.max_rebuilds = reps  # the first pass starts every replica at once

        async def tick(advance: float = 2.0) -> float:
            now[0] += advance
            t = time.perf_counter()
            await sup.tick(start_pass=False)
            return time.perf_counter() - t

        async def reconcile() -> float:
            t = time.perf_counter()
            await sup.reconcile()
            return time.perf_counter() - t

        res["first_tick_s"] = await tick()
        res["first_pass_s"] = await reconcile()
        recs = {r.name: r for r in await astore.records()}
        res["ready_after_first"] = sum(r.status == "ready" for r in recs.values())
        sup.settings.max_rebuilds = 2
        ticks, passes = [], []
        for _ in range(args.repeat):
            ticks.append(await tick())
            passes.append(await reconcile())
        res["tick_s"], res["pass_s"] = ticks, passes
        victim = recs[sorted(recs)[0]]
        dead = victim.shards[0].node
        fleet[dead].kill()
        res["tick_unreachable_s"] = await tick()
        res["tick_unreachable_pass_s"] = await reconcile()
        res["tick_lost_s"] = await tick(args.grace_sim + 1)
        res["state_lost"] = sup.nodes[dead].state
        res["pass_rebuild_s"] = await reconcile()
        new = {r.name: r for r in await astore.records()}[victim.name]
        res["rebuilt"] = new.status == "ready" and new.shards[0].node != dead
        res["tick_after_s"] = await tick()
        res["pass_after_s"] = await reconcile()

    with Store(d / "state.db", actor="supervise") as s:
        s.save_discovery([replace(cpu_node(x, cpus=16), probed_at=1.0) for x in names])

        async def main() -> None:
            async with AsyncStore(s) as astore:
                await go(astore)

        gc.collect()
        asyncio.run(main())
    med = {k: statistics.median(res[k]) for k in ("tick_s", "pass_s")}
    print(f"  {n} fake nodes, {reps} replicas ({res['ready_after_first']} ready after the first pass; first tick "
          f"{res['first_tick_s'] * 1000:.0f} ms, first pass {res['first_pass_s']:.2f} s: every replica started)")  # fmt: skip
    print(f"  steady, nothing to do ({args.repeat} each): tick median {med['tick_s'] * 1000:.0f} ms "
          f"(min {min(res['tick_s']) * 1000:.0f}, max {max(res['tick_s']) * 1000:.0f}); pass median "
          f"{med['pass_s'] * 1000:.0f} ms (min {min(res['pass_s']) * 1000:.0f}, max {max(res['pass_s']) * 1000:.0f}); "
          f"tick + pass {(med['tick_s'] + med['pass_s']) * 1000:.0f} ms against the 2-s interval")  # fmt: skip
    print(f"  one node killed: the tick that finds it unreachable {res['tick_unreachable_s'] * 1000:.0f} ms (its pass "
          f"{res['tick_unreachable_pass_s'] * 1000:.0f} ms); the tick that finds it lost "
          f"{res['tick_lost_s'] * 1000:.0f} ms ({res['state_lost']}); the pass that rebuilds its replica "
          f"{res['pass_rebuild_s'] * 1000:.0f} ms (rebuilt: {res['rebuilt']}); then tick "
          f"{res['tick_after_s'] * 1000:.0f} ms, pass {res['pass_after_s'] * 1000:.0f} ms")  # fmt: skip
    out["pass"] = res
    return bool(res["rebuilt"])


# ---------------------------------------------------------------------------
# main


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", choices=("faults", "idle", "pass", "all"), default="all")
    g = ap.add_argument_group("faults")
    g.add_argument("--faults", default="kill,freeze,partition", help="comma-separated: kill, freeze, partition")
    g.add_argument("--interval", type=float, default=0.5, help="supervise --interval of the fault runs")
    g.add_argument("--grace", type=float, default=4.0, help="supervise --grace of the fault runs")
    g.add_argument("--defaults", action="store_true", help="also one kill with supervise's defaults (2 s, 30 s)")
    g.add_argument("--clients", type=int, default=4, help="streaming clients")
    g.add_argument("--max-tokens", type=int, default=1000, help="tokens per streamed request (ignore_eos)")
    g.add_argument("--warm", type=int, default=20, help="requests completed before the fault")
    g.add_argument("--served", type=int, default=5, help="requests the replacement completes before the run ends")
    g.add_argument("--settle", type=float, default=30.0, help="at most this long after the replacement is ready")
    g.add_argument("--idle-timeout", type=float, default=5.0, help="the router's limits.idle_timeout_s")
    g.add_argument("--watch-interval", type=float, default=1.0, help="serve-router --watch-interval")
    g.add_argument("--poll", type=float, default=0.1, help="seconds between polls of the router's /health")
    g.add_argument("--llama-server", default=None, metavar="PATH", help="the llama-server binary (default: found)")
    g = ap.add_argument_group("idle")
    g.add_argument("--nodes", type=int, default=64, help="testbed nodes of the idle run")
    g.add_argument("--minutes", type=float, default=10.0, help="how long the idle supervisor is sampled")
    g.add_argument("--idle-interval", type=float, default=2.0, help="supervise --interval of the idle run")
    g.add_argument("--sample", type=float, default=10.0, help="seconds between samples")
    g.add_argument("--stored-catalog", action="store_true",
                   help="supervise without -c, after an up stored an empty catalog (default: -c EMPTY)")  # fmt: skip
    g.add_argument("--settle-idle", type=float, default=20.0, help="seconds after supervise starts before sampling")
    g = ap.add_argument_group("pass")
    g.add_argument("--sim-nodes", type=int, default=1000, help="fake nodes")
    g.add_argument("--sim-replicas", type=int, default=200, help="replicas in the catalog (8 CPUs each)")
    g.add_argument("--grace-sim", type=float, default=30.0, help="the simulated supervisor's grace")
    g.add_argument("--repeat", type=int, default=5, help="steady ticks and passes timed")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder and leave the testbeds running")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    parts = ("faults", "idle", "pass") if args.part == "all" else (args.part,)
    if set(parts) & {"faults", "idle"} and (why := unavailable_reason()):
        print(f"failover bench: no testbed here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the testbeds are stopped on the way out
    made = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="clusterctl-bench-failover-")) if made else Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: nproc {os.cpu_count()}, load average at start {_loadavg()}; checkout at {_commit()}; work {work}")
    out: dict[str, Any] = {"commit": _commit(), "nproc": os.cpu_count(), "load_start": _loadavg()}
    ok = True
    try:
        for part in parts:
            print(f"\n== {part}", flush=True)
            ok &= {"faults": faults_part, "idle": idle_part, "pass": pass_part}[part](args, work, out)
    finally:
        if made and not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    out["load_end"] = _loadavg()
    print(f"\nload average at the end {out['load_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TestbedError, ValueError) as e:
        print(f"failover bench: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("failover bench: interrupted", file=sys.stderr)
        sys.exit(130)
