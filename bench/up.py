#!/usr/bin/env python3
"""Benchmark of ``clusterctl up`` and ``down`` on a real sshd testbed with real engines.

A testbed of ``--nodes`` N ``cpu-only`` nodes is started (see ``testbed/cluster.py``). The
engine is a real ``llama-server`` (found as ``tests/llama.py`` finds it: ``$LLAMA_SERVER``,
``PATH``, then the cache ``scripts/install-llama-server.sh`` installs into) serving the tiny
GGUF model of ``tests/gguf_tiny.py`` on one CPU thread; ``--engine fake`` uses a small stdlib
HTTP server instead (``/health``, ``/v1/models``, ``/metrics``: what ``up`` checks). The catalog
has one model ``tiny`` with one profile (``cpus: 1``, ``memory_gib: 0.25``), asking for 1 or
N replicas.

Every command is the real console script as a subprocess (Python start-up included), as a
user runs it, with its own ``--state`` in the work folder, timed wall-clock. Each of
``--repeat`` rounds runs, in this order:

* ``up`` of 1 replica, N-node inventory, fresh state (every node probed, one engine started),
  then ``down --all`` of it (the 1-replica down row),
* ``up`` of 1 replica on a 1-node inventory, fresh state (one node probed), then ``down --all``,
* ``up`` of N replicas on the N nodes, fresh state,
* a second ``up`` of the same catalog: nothing to do, every replica kept,
* ``discover`` of the same N nodes on the same state (the baseline of the second ``up``),
* ``down --all`` of the N replicas.

After the ``discover`` of each round, while the N engines of the ``up`` of N run, a
supervisor's heartbeat in this process: one ``Sessions`` pool opened with the connector the
commands use, connected to every node (timed apart), then ``--beats`` rounds of
``control.heartbeat.beat`` over the kept-open connections, each node asked about 4 shard
records (its engine's, from the state, and 3 made up: its PID with another start time, a PID
that runs nothing, its record from another boot). Each round's wall time and this process's
CPU time (``time.process_time``: the sshds and the node scripts are other processes) against
the ``discover`` of the same round.

One warm-up round (``--warmup``, not counted) goes first. After the rounds, ``--drain-runs``
pairs of ``down`` with a stream in flight: ``serve-router`` started on a fresh state's router
config, ``up`` of 1 replica (1-node inventory, ``--context-shift`` so that a stream can run
past the model's 2,048-token context), a streamed chat completion of ``--stream-tokens``
tokens (``ignore_eos``) through the router with the ``openai`` client, and ``--down-after``
seconds into it ``down tiny/0``: with the default drain, then ``--drain-timeout 0``. Timed
from the command: the engine's process gone (polled in ``/proc`` every 5 ms), the command's
end, the stream's last token and its end; the stream's time left at the command is how long
a reference stream (the same, once before the pairs, no ``down``) took, less the stream's
age. With the default drain the stream must end whole (every token, ``finish_reason``
``length``). With ``--phases`` a traced ``up`` of N, second ``up`` and ``down --all`` go
last and show where the time goes, step by step.

Every run is checked: ``up`` must exit 0 with every replica ready (``-o json``), on as many
distinct nodes as replicas, with exactly that many engine processes on the machine (found by
the model path in their command line); the second ``up`` must keep every replica and leave
every engine's PID as it was; ``discover`` must report every node reachable; ``down`` must
exit 0 and leave no engine running. A failing run is reported as FAILED, never timed.
Besides wall time it records the client's CPU time (rusage) and the whole machine's busy CPU
time (``/proc/stat``): the nodes share this machine's cores with the client, so on a 2-core
box N nodes' sshd, scripts and engine start-ups are done one core-second at a time. The
RSS of every engine is read after each ``up`` of N.

Targets (the project's issue; printed as ratios, never asserted): ``up`` of N replicas under
1.5x the time of ``up`` of 1 replica (same inventory); the second ``up`` no slower than
``discover`` of the same nodes; a heartbeat round of N nodes at most 0.1 s of client CPU and
1/10 of that ``discover``.

    python bench/up.py                                     # 32 nodes, 3 rounds, 2 drain pairs
    python bench/up.py --nodes 4 --repeat 1 --drain-runs 1 # a quick check
    python bench/up.py --nodes 32 --repeat 3 --json up.json --phases
    python bench/up.py --engine fake                       # no llama-server needed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
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
from benchlib import LoadSampler, Series, tool  # noqa: E402

PRESET = "cpu-only"
BIN = Path(sys.executable).parent
PORTS_PER_NODE = 20
PORT_BASE = 21000

FAKE_ENGINE = '''#!{python}
"""A stand-in for llama-server: answers /health, /v1/models and /metrics, nothing else."""
import argparse, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=8080)
ap.add_argument("--alias", default="model")
args, _ = ap.parse_known_args()
MODELS = json.dumps({{"object": "list", "data": [{{"id": args.alias, "object": "model", "owned_by": "fake"}}]}})
METRICS = "llamacpp:requests_processing 0\\nllamacpp:requests_deferred 0\\n"


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body, ctype = {{"/health": ('{{"status":"ok"}}', "application/json"), "/v1/models": (MODELS, "application/json"),
                       "/metrics": (METRICS, "text/plain")}}.get(self.path.split("?")[0], (None, None))
        if body is None:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


print(f"fake engine {{args.alias}} listening on {{args.host}}:{{args.port}}", flush=True)
ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


def _tool(name: str) -> str:
    return tool(name, "up")


# ---------------------------------------------------------------------------
# measurements


@dataclass
class Run:
    ok: bool
    wall_s: float
    cpu_s: float  # client: user + sys of the process and its reaped children
    error: str = ""
    box_cpu_s: float = 0.0  # the whole machine's busy CPU time meanwhile (nodes and engines too)
    node_cpu_s: float = 0.0  # heartbeat: every node's sshd, its sessions and what they ran


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _box_busy() -> float:
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK


def _timed(
    argv: Sequence[str], *, env: dict[str, str], stdout: Path, stderr: Path, timeout: float
) -> tuple[int, float, float, float]:
    """Run argv to completion: (rc, wall s, client CPU s, machine busy CPU s). Past the timeout
    it is killed (rc -9)."""
    b0 = _box_busy()
    with stdout.open("wb") as out, stderr.open("wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(list(argv), stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)  # fmt: skip
        deadline = t0 + timeout
        try:
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    os.killpg(p.pid, signal.SIGKILL)
                    pid, status, ru = os.wait4(p.pid, 0)
                    break
                time.sleep(0.002)
        except BaseException:  # Ctrl-C: the child (its own session) gets it too
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                p.wait(30)
            raise
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, wall, ru.ru_utime + ru.ru_stime, _box_busy() - b0


def _tree_cpu(roots: Sequence[int]) -> float:
    """CPU seconds of the processes ``roots`` and every live descendant, each its own and its
    reaped children's: every node's sshd, its sessions and what they ran (not the engines,
    which their start script left to init)."""
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(d.name)] = int(f[1])  # after "(comm)": state=0 ppid=1 ... utime=11 .. cstime=14
        used[int(d.name)] = sum(int(x) for x in f[11:15])
    kids: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        kids.setdefault(pp, []).append(pid)
    total, todo = 0, [r for r in roots if r in used]
    while todo:
        pid = todo.pop()
        total += used[pid]
        todo += kids.get(pid, [])
    return total / CLK_TCK


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------
# engine processes on this machine (the nodes share its kernel: netns or loopback)


def engine_pids(needle: str) -> dict[int, int]:
    """PID -> RSS KiB of every process whose command line names ``needle`` (the model path)."""
    out: dict[int, int] = {}
    key = needle.encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if key not in (d / "cmdline").read_bytes().split(b"\0"):
                continue
            rss = 0
            for ln in (d / "status").read_text().splitlines():
                if ln.startswith("VmRSS:"):
                    rss = int(ln.split()[1])
            out[int(d.name)] = rss
        except (OSError, ValueError):
            continue
    return out


def kill_engines(needle: str) -> int:
    """SIGKILL the engines this run started that are still there (found by the model path)."""
    pids = engine_pids(needle)
    for pid in pids:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _last_line(p: Path) -> str:
    try:
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:240] if lines else ""


# ---------------------------------------------------------------------------
# the bench


class Bench:
    def __init__(self, work: Path, cluster: Cluster, engine: str, binary: str, model: Path, timeout: float) -> None:
        self.work = work
        self.c = cluster
        self.engine = engine
        self.binary = binary
        self.model = model
        self.timeout = timeout
        self.n = 0
        self.box = 0.0
        self.clusterctl = _tool("clusterctl")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "LLAMA_ARG_"))}
        self.states: list[Path] = []  # every state used: `down --all` on each at the end
        self.rss_kib: list[int] = []  # RSS of each engine, read after each `up` of N
        self.nodes_used: list[int] = []
        self.names = list(cluster.nodes)
        self.inv_all = self._inventory(self.names, "inventory-up.yaml")
        self.inv_one = self._inventory(self.names[:1], "inventory-up-1.yaml")
        self.cat_one = self._catalog(1)
        self.cat_all = self._catalog(len(self.names))

    def _inventory(self, names: list[str], filename: str) -> Path:
        """The testbed's inventory (or some of its nodes) with a port range per node: in
        loopback mode every node is the same host."""
        data = yaml.safe_load(self.c.inventory_path.read_text())
        index = {n: i for i, n in enumerate(self.names)}
        data["nodes"] = [n for n in data["nodes"] if n["name"] in names]
        for n in data["nodes"]:
            lo = PORT_BASE + PORTS_PER_NODE * index[n["name"]]
            n["ports"] = f"{lo}-{lo + PORTS_PER_NODE - 1}"
        p = self.c.inventory_path.parent / filename  # beside it: its key paths are relative
        p.write_text(yaml.safe_dump(data, sort_keys=False))
        return p

    def _catalog(self, replicas: int, args: list[str] | None = None, filename: str = "") -> Path:
        prof: dict[str, Any] = {"name": "cpu", "engine": "llamacpp", "cpus": 1, "memory_gib": 0.25,
                                "model": str(self.model)}  # fmt: skip
        if args:
            prof["args"] = args
        doc = {
            "engines": {"llamacpp": {"command": self.binary}},
            "models": [{"name": "tiny", "replicas": replicas, "profiles": [prof]}],
        }
        p = self.work / (filename or f"catalog-{replicas}.yaml")
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        return p

    def fresh_state(self, label: str) -> Path:
        self.n += 1
        st = self.work / f"state-{self.n}-{label}" / "state.db"
        self.states.append(st)
        return st

    def argv(self, state: Path, *args: str) -> list[str]:
        return [self.clusterctl, "--state", str(state), *args]

    def up_argv(self, state: Path, inventory: Path, catalog: Path) -> list[str]:
        return self.argv(state, "up", "-i", str(inventory), "-c", str(catalog), "-o", "json",
                         "--timeout", str(int(self.timeout)))  # fmt: skip

    def _run(self, label: str, argv: list[str]) -> tuple[int, float, float, Path, Path]:
        self.n += 1
        out, err = self.work / f"{self.n:03d}-{label}.out", self.work / f"{self.n:03d}-{label}.err"
        rc, wall, cpu, self.box = _timed(argv, env=self.env, stdout=out, stderr=err, timeout=self.timeout + 60)
        return rc, wall, cpu, out, err

    def result(self, why: str, wall: float, cpu: float) -> Run:
        return Run(not why, wall, cpu, why, self.box)

    # -- the commands, each checked

    def up(self, state: Path, inventory: Path, catalog: Path, replicas: int, label: str) -> Run:
        rc, wall, cpu, out, err = self._run(label, self.up_argv(state, inventory, catalog))
        why = self._check_up(rc, out, err, replicas, {"start"})
        if not why:
            pids = engine_pids(str(self.model))
            if len(pids) != replicas:
                why = f"{len(pids)} engine processes on the machine, expected {replicas}"
            elif replicas > 1:
                self.rss_kib += list(pids.values())
        return self.result(why, wall, cpu)

    def up_again(self, state: Path, replicas: int) -> Run:
        before = set(engine_pids(str(self.model)))
        rc, wall, cpu, out, err = self._run("up-again", self.up_argv(state, self.inv_all, self.cat_all))
        why = self._check_up(rc, out, err, replicas, {"keep"})
        if not why and set(engine_pids(str(self.model))) != before:
            why = "engine PIDs changed"
        return self.result(why, wall, cpu)

    def _check_up(self, rc: int, out: Path, err: Path, replicas: int, actions: set[str]) -> str:
        if rc != 0:
            return f"rc {rc}: {_last_line(err) or _last_line(out)}"
        try:
            doc = json.loads(out.read_text())
        except (OSError, ValueError) as e:
            return f"unreadable JSON: {e}"
        reps = doc.get("replicas", [])
        if len(reps) != replicas:
            return f"{len(reps)} replicas in the output, expected {replicas}"
        bad = [r for r in reps if r.get("state") != "ready" or r.get("action") not in actions]
        if bad:
            r = bad[0]
            return f"{r['name']}: {r.get('action')} {r.get('state')}: {r.get('reason')}"
        nodes = {n for r in reps for n in r.get("nodes", [])}
        if "start" in actions and replicas > 1:
            self.nodes_used.append(len(nodes))
        if len(nodes) != replicas:
            return f"{replicas} replicas on {len(nodes)} distinct nodes"
        return ""

    def discover(self, state: Path) -> Run:
        rc, wall, cpu, out, err = self._run(
            "discover", self.argv(state, "discover", "-i", str(self.inv_all), "-o", "json")
        )
        why = f"rc {rc}: {_last_line(err)}" if rc != 0 else ""
        if not why:
            try:
                nodes = json.loads(out.read_text()).get("nodes", [])
            except (OSError, ValueError) as e:
                nodes, why = [], f"unreadable JSON: {e}"
            ok = sum(1 for n in nodes if n.get("reachable"))
            if not why and ok != len(self.names):
                why = f"{ok}/{len(self.names)} nodes reachable"
        return self.result(why, wall, cpu)

    def down(self, state: Path, label: str) -> Run:
        rc, wall, cpu, out, err = self._run(label, self.argv(state, "down", "--all"))
        why = f"rc {rc}: {_last_line(err) or _last_line(out)}" if rc != 0 else ""
        left = engine_pids(str(self.model))
        if not why and left:
            why = f"{len(left)} engine processes left running"
        if left:  # the next run must start from nothing
            kill_engines(str(self.model))
        return self.result(why, wall, cpu)

    def heartbeat(self, state: Path, beats: int) -> tuple[Run, list[Run]]:
        """``beats`` heartbeat rounds of every node, in this process, over one ``Sessions`` pool
        opened with the connector the commands use and connected to every node first: (the
        connect, one Run per round). Each node is asked about its recorded shard (the engine
        ``up`` started there, from the state) and 3 made-up ones: its PID with another start
        time (a reused PID), a PID that runs nothing, and its record from another boot. A round
        is good when every node answers, the real shard alive and the others not."""
        from cluster_cli.config.inventory import load_inventory
        from cluster_cli.control.cluster import ssh_connector
        from cluster_cli.control.heartbeat import beat
        from cluster_cli.control.nodes import SSHNodes
        from cluster_cli.launch.node import Beat
        from cluster_cli.ssh.pool import Sessions
        from cluster_cli.ssh.preflight import pinned_hosts_path
        from cluster_cli.state.store import Store

        inv = load_inventory(self.inv_all)
        run_dirs = {n.name: inv.run_dir(n) for n in inv.nodes}
        with Store(state, readonly=True) as s:
            records = s.records()
        nodes: dict[str, list[Any]] = {name: [] for name in self.names}
        for rec in records:
            for sh in rec.shards:
                nodes[sh.node] += [sh, replace(sh, start_time=(sh.start_time or 0) + 1), replace(sh, pid=4_100_000),
                                   replace(sh, boot_id="0" * 8 + sh.token[:8])]  # fmt: skip
        if any(len(v) != 4 for v in nodes.values()):
            why = f"not one recorded shard per node: {sorted((k, len(v) // 4) for k, v in nodes.items())[:4]}..."
            return Run(False, 0.0, 0.0, why), []

        def check(got: dict[str, Any]) -> str:
            for name, b in got.items():
                if not isinstance(b, Beat):
                    return str(b)
                if b.alive != [True, False, False, False]:
                    return f"{name}: alive {b.alive}, expected [True, False, False, False]"
            return "" if len(got) == len(nodes) else f"{len(got)} of {len(nodes)} nodes answered"

        async def go() -> tuple[Run, list[Run]]:
            rounds: list[Run] = []
            async with Sessions(inv, ssh_connector(pinned_hosts_path(state))) as sessions:
                b0, t0, c0 = _box_busy(), time.perf_counter(), time.process_time()
                got = await asyncio.gather(*(sessions.get(n) for n in nodes), return_exceptions=True)
                connect = Run(True, time.perf_counter() - t0, time.process_time() - c0, "", _box_busy() - b0)
                if bad := [g for g in got if isinstance(g, BaseException)]:
                    return replace(connect, ok=False, error=f"{len(bad)} nodes: {bad[0]}"), []
                via = SSHNodes(sessions)  # how the control plane reaches a node over its session
                sshds = [n.sshd_pid for n in self.c.nodes.values() if n.sshd_pid]
                for _ in range(beats):
                    n0 = _tree_cpu(sshds)  # read outside the timed span: it is this process's CPU
                    b0, t0, c0 = _box_busy(), time.perf_counter(), time.process_time()
                    answers = await beat(via, nodes, run_dirs, timeout_s=30)
                    wall, cpu, box = time.perf_counter() - t0, time.process_time() - c0, _box_busy() - b0
                    why = check(answers)
                    rounds.append(Run(not why, wall, cpu, why, box, _tree_cpu(sshds) - n0))
            return connect, rounds

        try:
            return asyncio.run(go())
        except Exception as e:  # the rows fail, the rest of the bench goes on
            return Run(False, 0.0, 0.0, f"{type(e).__name__}: {e}"), []

    def down_everywhere(self) -> None:
        """Best effort at the end (or after a failure): every state's replicas down, then any
        engine still found killed by its PID."""
        for st in self.states:
            if st.exists():
                with suppress(subprocess.TimeoutExpired, OSError):
                    subprocess.run(self.argv(st, "down", "--all"), env=self.env, capture_output=True, timeout=120)
        if n := kill_engines(str(self.model)):
            print(f"  killed {n} engine process(es) left behind", flush=True)


ROWS: tuple[tuple[str, str], ...] = (
    ("up1", "up, 1 replica, {n}-node inventory (fresh state)"),
    ("down1", "down --all, 1 replica"),
    ("up1_one", "up, 1 replica, 1-node inventory (fresh state)"),
    ("upN", "up, {n} replicas on {n} nodes (fresh state)"),
    ("again", "up again, {n} replicas, nothing to do"),
    ("discover", "discover, the same {n} nodes (baseline)"),
    ("hb_connect", "connect {n} sessions (in-process, once a round)"),
    ("beat", "heartbeat round, {n} nodes x 4 shards, kept-open connections (in-process)"),
    ("downN", "down --all, {n} replicas"),
)


# ---------------------------------------------------------------------------
# where the time goes: the real command in-process, its steps timed wall-clock

PHASES = r"""
import atexit, functools, json, sys, time
t0 = time.perf_counter()
import cluster_cli.cli.main  # typer app + every command module, as the console script does
import cluster_cli.cli.common as common
import cluster_cli.control.discovery as discovery
import cluster_cli.ssh.pool as sessions
import cluster_cli.control.lifecycle as lifecycle
import cluster_cli.control.up as up
import cluster_cli.launch.node as node
import cluster_cli.launch.routerconf as routerconf
import cluster_cli.placement as placement
import cluster_cli.probe.collect as collect
from cluster_cli.state.store import Store
spans = {"imports": [(t0, time.perf_counter())]}
out = sys.argv.pop(1)

def wrap(obj, name, label):
    f = getattr(obj, name, None)
    if f is None:  # renamed since: that step is left out of the trace
        spans.setdefault(f"(not traced: {name})", []).append((t0, t0))
        return
    def note(t):
        spans.setdefault(label, []).append((t, time.perf_counter()))
    if getattr(f, "__code__", None) is not None and f.__code__.co_flags & 0x80:  # a coroutine function
        @functools.wraps(f)
        async def w(*a, **k):
            t = time.perf_counter()
            try:
                return await f(*a, **k)
            finally:
                note(t)
    else:
        @functools.wraps(f)
        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                note(t)
    setattr(obj, name, w)

for obj, name, label in (
    (common, "inventory_or_abort", "inventory"), (common, "open_store", "state open"),
    (collect, "discover", "probe (discover's)"), (Store, "save_discovery", "save facts"),
    (discovery, "fleet", "fleet from state"), (up, "find_dead", "check kept replicas"),
    (placement, "plan", "placement"), (up, "taken_ports", "ports in use (new nodes)"),
    (Store, "reserve", "reserve"), (lifecycle, "start", "start + wait ready (per replica)"),
    (lifecycle, "wait_ready", "wait ready (per replica)"), (routerconf, "write", "router config"),
    (sessions.Sessions, "get", "session (connect on first use)"), (sessions.Sessions, "aclose", "close sessions"),
    (node, "start", "start script"), (node, "stop", "stop script"), (node, "alive", "alive script"),
    (node, "ready", "ready check (/health, /v1/models)"), (node, "listening", "listening script"),
):
    wrap(obj, name, label)

def dump():
    end = time.perf_counter()
    rows = []
    for label, sp in spans.items():
        d = sorted(e - s for s, e in sp)
        rows.append({"step": label, "n": len(sp), "from": min(s for s, _ in sp) - t0,
                     "to": max(e for _, e in sp) - t0, "p50": d[len(d) // 2], "max": d[-1]})
    rows.sort(key=lambda r: r["from"])
    with open(out, "w") as f:
        json.dump({"total": end - t0, "steps": rows}, f)
atexit.register(dump)
sys.argv[0] = "clusterctl"
from cluster_cli.cli.main import run
run()
"""


def phases(b: Bench) -> list[str]:
    """One ``up`` of N (fresh state), the second ``up`` and ``down --all``, each run in-process
    by a driver that times the command's steps wall-clock (functions wrapped, nothing changed)."""
    driver = b.work / "phases.py"
    driver.write_text(PHASES)
    st = b.fresh_state("phases")
    lines: list[str] = []
    steps = (
        (f"up {len(b.names)} (fresh state)", b.up_argv(st, b.inv_all, b.cat_all)),
        (f"up again {len(b.names)} (nothing to do)", b.up_argv(st, b.inv_all, b.cat_all)),
        (f"down --all {len(b.names)}", b.argv(st, "down", "--all")),
    )
    for label, argv in steps:
        trace = b.work / f"phases-{len(lines)}.json"
        t = time.perf_counter()
        p = subprocess.run([sys.executable, str(driver), str(trace), *argv[1:]], env=b.env, cwd=ROOT,
                           capture_output=True, timeout=b.timeout + 60, check=False)  # fmt: skip
        wall = time.perf_counter() - t
        try:
            doc = json.loads(trace.read_text())
        except (OSError, ValueError):
            lines.append(f"{label}: no trace (rc {p.returncode}): {p.stderr.decode(errors='replace')[-300:]}")
            continue
        lines.append(f"{label}: {wall:.2f}s wall (rc {p.returncode}), {doc['total']:.2f}s in-process after start-up:")
        for r in doc["steps"]:
            each = f"  each p50 {r['p50']:.2f}s max {r['max']:.2f}s" if r["n"] > 1 else ""
            lines.append(f"  {r['from']:5.2f}s -> {r['to']:5.2f}s  {r['to'] - r['from']:5.2f}s  {r['step']}"
                         + (f" (x{r['n']})" if r["n"] > 1 else "") + each)  # fmt: skip
    if engine_pids(str(b.model)):
        b.down_everywhere()
    return lines


def one_round(b: Bench, series: dict[str, Series] | None, i: int, beats: int) -> None:
    """One round of every command, in order; ``series=None``: the warm-up (not counted)."""
    got: dict[str, Run] = {}

    def rec(key: str, r: Run) -> Run:
        got[key] = r
        if series is not None:
            series[key].runs.append(r)
        if not r.ok:
            print(f"  {'warm-up' if series is None else f'run {i + 1}'}: {key} FAILED: {r.error}", flush=True)
        return r

    nn = len(b.names)
    st = b.fresh_state("up1")
    rec("up1", b.up(st, b.inv_all, b.cat_one, 1, "up1"))
    rec("down1", b.down(st, "down1"))
    st = b.fresh_state("up1-one")
    rec("up1_one", b.up(st, b.inv_one, b.cat_one, 1, "up1-one"))
    b.down(st, "down1-one")
    st = b.fresh_state("upN")
    if rec("upN", b.up(st, b.inv_all, b.cat_all, nn, "upN")).ok:
        rec("again", b.up_again(st, nn))
    else:
        rec("again", Run(False, 0.0, 0.0, "not run: the up before it failed"))
    rec("discover", b.discover(st))
    if beats and got["upN"].ok:  # the engines of the up of N run: a supervisor's tick over them
        connect, rounds = b.heartbeat(st, beats)
        rec("hb_connect", connect)
        for r in rounds:
            rec("beat", r)
        if rounds:
            got["beat"] = Run(all(r.ok for r in rounds), statistics.median(r.wall_s for r in rounds),
                              statistics.median(r.cpu_s for r in rounds))  # fmt: skip
    rec("downN", b.down(st, "downN"))

    def shown(k: str, r: Run) -> str:
        if k == "beat":
            return f"beat {r.wall_s * 1000:.0f} ms (median of {beats}, cpu {r.cpu_s * 1000:.0f} ms)"
        return f"{k} {r.wall_s:.2f}s"

    print(f"  {'warm-up' if series is None else f'run {i + 1}'}: "
          + ", ".join(shown(k, r) + ("" if r.ok else " (FAILED)") for k, r in got.items())
          + f"; load {_loadavg()}", flush=True)  # fmt: skip


# ---------------------------------------------------------------------------
# down of a replica with a stream in flight


@dataclass
class Drain:
    """One ``down`` of the replica while a stream through the router is under way on it."""

    drain: str  # the --drain-timeout given ("default": none given)
    ok: bool = False
    error: str = ""
    down_s: float = 0.0  # the command's wall time
    stopped_s: float | None = None  # from the command to the engine's process gone
    remaining_s: float | None = None  # from the command to the stream's end (its last chunk, or its error)
    last_token_s: float | None = None  # from the command to the stream's last token
    left_s: float | None = None  # the stream's time left at the command: a reference stream's length - its age
    stream_s: float | None = None  # the whole stream, first chunk to its end
    tokens: int = 0
    finish: str = ""  # the stream's finish_reason, or the error that ended it
    rc: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has stopped: only its exit status is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _router_lists(port: int, model: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return model in {m.get("id") for m in json.loads(r.read()).get("data", [])}
    except (OSError, ValueError):
        return False


class Stream:
    """One streamed chat completion through the router, in a thread (the ``openai`` client)."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.port, self.max_tokens = port, max_tokens
        self.tokens = 0
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.end: float | None = None
        self.finish = ""
        self.error = ""
        self.t = threading.Thread(target=self._go, daemon=True)
        self.t.start()

    def _go(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=300)
        try:
            parts = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=self.max_tokens,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for p in parts:
                if not p.choices:
                    continue
                if p.choices[0].delta.content:
                    self.tokens += 1
                    self.last = time.perf_counter()
                    if self.first is None:
                        self.first = self.last
                if p.choices[0].finish_reason:
                    self.finish = p.choices[0].finish_reason
        except Exception as e:  # what cut the stream is the finding
            self.error = f"{type(e).__name__}: {str(e)[:160]}"
        finally:
            self.end = time.perf_counter()


def drain_run(
    b: Bench, st: Path, cat: Path, port: int, drain: float | None, max_tokens: int, after: float, ref_s: float | None
) -> Drain:
    """``up`` of the one replica, a stream started through the router, ``after`` seconds of it,
    then ``down tiny/0`` (``drain``: its ``--drain-timeout``; None: the default). ``ref_s``: how
    long the same stream takes with no ``down``."""
    d = Drain("default" if drain is None else f"{drain:g}")
    up = b.up(st, b.inv_one, cat, 1, "drain-up")
    if not up.ok:
        d.error = f"up: {up.error}"
        return d
    deadline = time.monotonic() + 30
    while not _router_lists(port, "tiny"):
        if time.monotonic() > deadline:
            d.error = "the router did not list tiny within 30 s of up"
            return d
        time.sleep(0.1)
    (pid,) = engine_pids(str(b.model))
    s = Stream(port, max_tokens)
    deadline = time.monotonic() + 60
    while s.first is None or time.perf_counter() - s.first < after:
        if s.end is not None or time.monotonic() > deadline:
            d.error = f"the stream ended or did not start before down: {s.error or s.finish or 'no token'}"
            s.t.join(60)
            return d
        time.sleep(0.01)
    t_cmd = time.perf_counter()
    d.left_s = ref_s - (t_cmd - s.start) if ref_s else None
    gone: list[float] = []

    def watch() -> None:
        while _alive(pid) and time.perf_counter() - t_cmd < b.timeout + 120:
            time.sleep(0.005)
        gone.append(time.perf_counter())

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    argv = b.argv(st, "down", "tiny/0", "-o", "json") + ([] if drain is None else ["--drain-timeout", f"{drain:g}"])
    d.rc, d.down_s, _, out, err = b._run(f"drain-down-{d.drain}", argv)
    s.t.join(b.timeout + 60)
    w.join(b.timeout + 180)
    if s.end is not None:
        d.remaining_s = s.end - t_cmd
        d.stream_s = s.end - (s.first or s.end)
    if s.last is not None:
        d.last_token_s = s.last - t_cmd
    d.stopped_s = gone[0] - t_cmd if gone and not _alive(pid) else None
    d.tokens = s.tokens
    d.finish = s.error or s.finish or "ended without finish_reason"
    if d.rc != 0:
        d.error = f"down rc {d.rc}: {_last_line(err) or _last_line(out)}"
    elif d.stopped_s is None:
        d.error = "the engine still runs"
    elif drain is None and (s.error or s.finish != "length" or s.tokens != max_tokens):
        d.error = f"the stream did not finish: {s.tokens} of {max_tokens} tokens, {d.finish}"
    d.ok = not d.error
    return d


def drains(b: Bench, runs: int, max_tokens: int, after: float) -> list[Drain]:
    """``runs`` pairs of ``down`` with a stream in flight, the default drain then
    ``--drain-timeout 0``, on one state and one ``serve-router`` started before the first ``up``."""
    st = b.fresh_state("drain")
    st.parent.mkdir(parents=True, exist_ok=True)
    config = st.parent / "router.yaml"  # where up writes it by default
    config.write_text("models: {}\n")
    cat = b._catalog(1, args=["--context-shift"], filename="catalog-drain.yaml")  # past the 2,048-token context
    port = _free_port()
    log = (b.work / "drain-router.log").open("wb")
    router = subprocess.Popen([b.clusterctl, "serve-router", "-c", str(config), "--port", str(port)], env=b.env,
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    out: list[Drain] = []
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            if router.poll() is not None or time.monotonic() > deadline:
                raise TestbedError(f"serve-router did not start: {_last_line(b.work / 'drain-router.log')}")
            time.sleep(0.1)
        ref_s = reference(b, st, cat, port, max_tokens)
        for i in range(runs):
            for drain in (None, 0.0):
                d = drain_run(b, st, cat, port, drain, max_tokens, after, ref_s)
                out.append(d)
                print(f"  drain run {i + 1}, --drain-timeout {d.drain}: " + _drain_line(d) + f"; load {_loadavg()}",
                      flush=True)  # fmt: skip
                if engine_pids(str(b.model)):
                    b.down(st, "drain-cleanup")
    finally:
        router.terminate()
        with suppress(subprocess.TimeoutExpired):
            router.wait(30)
        log.close()
    return out


def reference(b: Bench, st: Path, cat: Path, port: int, max_tokens: int) -> float | None:
    """How long the stream takes from request to its end with no ``down`` meanwhile (``up``,
    the stream, then ``down``); None when it failed."""
    up = b.up(st, b.inv_one, cat, 1, "drain-ref-up")
    deadline = time.monotonic() + 30
    while up.ok and not _router_lists(port, "tiny") and time.monotonic() < deadline:
        time.sleep(0.1)
    s = Stream(port, max_tokens) if up.ok else None
    if s is not None:
        s.t.join(b.timeout)
    b.down(st, "drain-ref-down")
    if s is None or s.end is None or s.error or s.tokens != max_tokens:
        why = up.error if s is None else (s.error or f"{s.tokens} of {max_tokens} tokens")
        print(f"  reference stream FAILED: {why}", flush=True)
        return None
    print(f"  reference stream, no down: {s.end - s.start:.2f}s for {s.tokens} tokens; load {_loadavg()}", flush=True)
    return s.end - s.start


def _drain_line(d: Drain) -> str:
    if not d.ok and d.stopped_s is None:
        return f"FAILED: {d.error}"
    line = (f"engine stopped {_fmt(d.stopped_s)}s after the command (the command {d.down_s:.2f}s); the stream had "
            f"{_fmt(d.left_s)}s left (reference), its last token {_fmt(d.last_token_s)}s and its end "
            f"{_fmt(d.remaining_s)}s after the command: {d.tokens} tokens, "
            f"{d.finish}")  # fmt: skip
    return line + ("" if d.ok else f" (FAILED: {d.error})")


# ---------------------------------------------------------------------------
# main


@contextmanager
def testbed(directory: Path, n: int, keep: bool) -> Iterator[Cluster]:
    c = Cluster.start(directory, count_specs(n, PRESET, "cpu"), stop_at_exit=not keep)
    try:
        yield c
    finally:
        if not keep:
            c.stop()


def _commit() -> str:
    """The checkout's commit (read only: ``git rev-parse``), or "?"."""
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10, check=False)  # fmt: skip
    except OSError:
        return "?"
    return p.stdout.strip() or "?"


def _fmt(x: float | None, d: int = 2) -> str:
    return f"{x:.{d}f}" if x is not None else "FAILED"


def _ratio(a: float | None, b: float | None) -> str:
    return (f"{a / b:.3f}x" if a / b < 0.1 else f"{a / b:.2f}x") if a and b else "-"


def _engine(args: argparse.Namespace, work: Path) -> tuple[str, str]:
    """(engine binary, its description)."""
    if args.engine == "fake":
        p = work / "fake-engine.py"
        p.write_text(FAKE_ENGINE.format(python=sys.executable))
        p.chmod(0o755)
        return str(p), f"fake engine (stdlib HTTP server, {sys.executable})"
    binary = args.llama_server or find_llama_server()
    if binary is None:
        raise SystemExit(
            "up bench: llama-server not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh "
            "(or use --engine fake)"
        )
    return binary, f"llama-server {llama_server_version(binary) or '?'} ({binary})"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32, help="testbed nodes (cpu-only), and replicas of the N-replica up")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every command")
    ap.add_argument("--warmup", type=int, default=1, help="rounds before the counted ones (not counted)")
    ap.add_argument("--engine", choices=("llama", "fake"), default="llama",
                    help="llama: a real llama-server on a tiny GGUF; fake: a stdlib HTTP stand-in")  # fmt: skip
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="the llama-server binary (default: found)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command before it counts as failed")
    ap.add_argument("--dir", default=None, help="work folder (default: a new temporary one, removed at the end)")
    ap.add_argument("--keep", action="store_true",
                    help="leave the testbed running and keep the work folder (every run's output)")  # fmt: skip
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--phases", action="store_true",
                    help="at the end, trace one up of N, the second up and down --all step by step (in-process)")  # fmt: skip
    ap.add_argument("--beats", type=int, default=10,
                    help="heartbeat rounds per round, after its second up (0: none)")  # fmt: skip
    ap.add_argument("--drain-runs", type=int, default=2,
                    help="pairs of down with a stream in flight (default drain, then --drain-timeout 0); 0: none")  # fmt: skip
    ap.add_argument("--stream-tokens", type=int, default=10000, help="max_tokens of the stream in flight")
    ap.add_argument("--down-after", type=float, default=1.0, help="seconds of the stream before down")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be at least 2")
    if args.drain_runs and args.engine == "fake":
        print("up bench: the fake engine does not stream: no down with a stream in flight (--drain-runs 0)")
        args.drain_runs = 0
    if why := unavailable_reason():
        print(f"up bench: no testbed here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the testbed is stopped on the way out

    made = args.dir is None
    work = Path(tempfile.mkdtemp(prefix="clusterctl-bench-up-")) if made else Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    load_start = _loadavg()
    print(f"machine: nproc {os.cpu_count()}, load average at start {load_start}")
    binary, desc = _engine(args, work)
    model = make_tiny_gguf(work / "tiny.gguf")
    commit = _commit()
    print(
        f"clusterctl: {_tool('clusterctl')} (checkout at commit {commit}); engine: {desc}; model {model} ({model.stat().st_size} bytes)"
    )
    print(f"work: {work}; runs: {args.repeat} rounds (+{args.warmup} warm-up), every command a subprocess\n")

    series = {k: Series() for k, _ in ROWS}
    trace: list[str] = []
    drained: list[Drain] = []
    b: Bench | None = None
    mode = "?"
    load = LoadSampler()
    try:
        t = time.perf_counter()
        with testbed(work / "testbed", args.nodes, args.keep) as c, load:
            mode = c.mode
            print(f"[{args.nodes} nodes] testbed up in {time.perf_counter() - t:.1f}s ({c.mode})", flush=True)
            b = Bench(work, c, args.engine, binary, model, args.timeout)
            print("  up:       " + shlex.join(b.up_argv(Path("STATE"), b.inv_all, b.cat_all)))
            print("  discover: " + shlex.join(b.argv(Path("STATE"), "discover", "-i", str(b.inv_all), "-o", "json")))
            print("  down:     " + shlex.join(b.argv(Path("STATE"), "down", "--all")), flush=True)
            try:
                for i in range(args.warmup):
                    one_round(b, None, i, args.beats)
                for i in range(args.repeat):
                    one_round(b, series, i, args.beats)
                if args.drain_runs:
                    print(f"  down of a replica with a stream in flight ({args.stream_tokens} tokens, down after "
                          f"{args.down_after:g}s of it), {args.drain_runs} pair(s)...", flush=True)  # fmt: skip
                    drained = drains(b, args.drain_runs, args.stream_tokens, args.down_after)
                if args.phases:
                    print("  tracing up / up again / down step by step...", flush=True)
                    trace = phases(b)
            finally:
                if not args.keep:
                    b.down_everywhere()
    finally:
        if made and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load_end = _loadavg()

    n = args.nodes
    med = {k: s.median() for k, s in series.items()}
    head = ("command", "median s", "min s", "cpu s", "box cpu s", "runs")
    rows = [(text.format(n=n), _fmt(med[k]), _fmt(series[k].min()), _fmt(series[k].median("cpu_s")),
             _fmt(series[k].median("box_cpu_s")), f"{len(series[k].good)}/{len(series[k].runs)}")
            for k, text in ROWS if series[k].runs]  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print()
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    beat_cpu, disc_cpu = series["beat"].median("cpu_s"), series["discover"].median("cpu_s")
    node_cpu = series["beat"].median("node_cpu_s")
    ratios = [
        (f"up {n} replicas / up 1 replica (same {n}-node inventory)", _ratio(med["upN"], med["up1"]), "< 1.5x"),
        (f"up again ({n}, nothing to do) / discover ({n} nodes)", _ratio(med["again"], med["discover"]), "<= 1.0x"),
        (f"up 1 replica: {n}-node / 1-node inventory", _ratio(med["up1"], med["up1_one"]), "(info)"),
        (f"down --all {n} / down --all 1", _ratio(med["downN"], med["down1"]), "(info)"),
    ]
    if args.beats:
        ratios += [
            (f"heartbeat round ({n} nodes), client cpu", f"{_fmt(beat_cpu, 3)}s", "<= 0.1s"),
            (f"heartbeat round ({n} nodes), the nodes' cpu (sshd, scripts)", f"{_fmt(node_cpu, 3)}s", "(info)"),
            (f"heartbeat round / discover ({n} nodes), wall", _ratio(med["beat"], med["discover"]), "<= 0.10x"),
            (f"heartbeat round / discover ({n} nodes), client cpu", _ratio(beat_cpu, disc_cpu), "<= 0.10x"),
        ]
    w0 = max(len(r[0]) for r in ratios)
    print()
    for name, val, target in ratios:
        print(f"{name.ljust(w0)}  {val.rjust(7)}  target {target}")
    print("(wall seconds of the console script, Python start-up included; medians and minimum over the rounds;")
    print(" cpu = client user+sys, median; box cpu = the whole machine's busy CPU time during the run (client,")
    print(f" every node's sshd and scripts, the engines, other work on the machine), median: on {os.cpu_count()} cores")
    print(f" a run takes at least box cpu / {os.cpu_count()}; FAILED = some run of it failed, see above)")
    rss = sorted(b.rss_kib) if b else []
    if rss:
        print(f"engine RSS: median {statistics.median(rss) / 1024:.1f} MiB, max {rss[-1] / 1024:.1f} MiB per process; "
              f"{n} of them {statistics.median(rss) * n / 1024:.0f} MiB")  # fmt: skip
    if b and b.nodes_used:
        print(f"nodes used by the N-replica up: {sorted(set(b.nodes_used))}")
    print(f"load average: start {load_start}, end {load_end}; 1-min during the runs {load.summary()}; mode {mode}")
    if drained:
        print(f"\ndown of tiny/0 with a stream of {args.stream_tokens} tokens in flight through serve-router, issued "
              f"{args.down_after:g}s into it (1 replica, a 1-node inventory; the console script, start-up included):")  # fmt: skip
        for d in drained:
            print(f"  --drain-timeout {d.drain:8s} " + _drain_line(d))
        for label in ("default", "0"):
            good = [d for d in drained if d.drain == label and d.ok]
            if good:
                late = [d.stopped_s - d.remaining_s for d in good if d.stopped_s is not None and d.remaining_s]
                print(f"  {label}: engine stopped, median {_fmt(statistics.median(d.stopped_s or 0 for d in good))}s "
                      f"after the command against the stream's {_fmt(statistics.median(d.left_s or 0 for d in good))}s "
                      f"left; engine stopped - stream end: median {_fmt(statistics.median(late) if late else None)}s")  # fmt: skip
    if trace:
        print(
            "\nwhere the time goes (one traced run each; start = the interpreter's, spans overlap where steps run at once):"
        )
        for ln in trace:
            print(ln)
    if args.keep:
        print(f"kept: work folder {work}; testbed: python -m testbed down --dir {work / 'testbed'}")

    if args.json:
        doc: dict[str, Any] = {
            "nodes": n,
            "repeat": args.repeat,
            "engine": desc,
            "commit": commit,
            "mode": mode,
            "nproc": os.cpu_count(),
            "load_start": load_start,
            "load_end": load_end,
            "load_during": load.summary(),
            "engine_rss_kib": rss,
            "phases": trace,
            "beats_per_round": args.beats,
            "drain": [vars(d) for d in drained],
            "commands": {
                k: {
                    "label": text.format(n=n),
                    "median_s": med[k],
                    "min_s": series[k].min(),
                    "cpu_median_s": series[k].median("cpu_s"),
                    "box_cpu_median_s": series[k].median("box_cpu_s"),
                    "runs": [dict(vars(r)) for r in series[k].runs],
                }
                for k, text in ROWS
            },
            "ratios": {
                "upN_over_up1": _div(med["upN"], med["up1"]),
                "again_over_discover": _div(med["again"], med["discover"]),
                "up1_over_up1_one_node": _div(med["up1"], med["up1_one"]),
                "downN_over_down1": _div(med["downN"], med["down1"]),
                "beat_over_discover": _div(med["beat"], med["discover"]),
                "beat_cpu_over_discover_cpu": _div(beat_cpu, disc_cpu),
            },
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if all(not s.failed for s in series.values()) and all(d.ok for d in drained) else 1


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TestbedError, ValueError) as e:
        print(f"up bench: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("up bench: interrupted", file=sys.stderr)
        sys.exit(130)
