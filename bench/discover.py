#!/usr/bin/env python3
"""Benchmark of ``clusterctl discover`` against ``ansible`` ad hoc on real sshd testbeds.

For each size (default 8, 32 and 64 nodes of ``hgx-h200x8`` on fabric ``ib-a``: 8 GPUs and
8 Active IB ports per node, so 14 commands per node) a testbed is started (see
``testbed/cluster.py``), then, interleaved, ``--repeat`` times each:

* ``clusterctl --state FRESH discover -i INV -o json --parallel 64`` as a subprocess (the
  real console script, Python start-up included; a new, empty state database every run),
* ``ansible all -i HOSTS -f 64 -m raw -a "<the same commands joined with ;>"`` (the 6 probe
  commands of ``cluster_cli/probe/commands.py`` plus one ``sminfo`` per Active IB port),
  host keys verified against the testbed's known_hosts (StrictHostKeyChecking=yes),
  everything ansible writes kept under a temporary folder (ANSIBLE_HOME, local_tmp,
  control_path_dir). SSH connection sharing is off (ControlMaster=no) so every ansible run
  is as cold as every clusterctl run (with ControlPersist a repeat would reuse connections).
  ``raw`` is ansible's cheapest path (one login per host, no Python on the node): the
  strictest comparison.
* in the first ``--shell`` rounds (default 2), the same commands through ``-m shell``, the
  module an operator runs ad hoc for a command line with ``;`` (the default ``command``
  module runs no shell): Python on the node, ansible's default connection sharing within
  the run (``ControlMaster=auto``, ``ControlPersist=60s``, a fresh control folder per run,
  masters ended after it), with ``--pipelining`` also ansible's pipelining.

Every run is checked: clusterctl must exit 0 and report every node reachable with the GPUs
and SM GUIDs the testbed serves; ansible must report every host with rc=0 and print every
non-empty expected output. A failing run is reported as FAILED, never timed.

Besides wall time it records the client's CPU time (rusage of the process tree) and the
servers' CPU time (sshd and its reaped children, from /proc/PID/stat of each node's sshd):
on a 2-core box the 64 sshds share the cores with the client.

With ``--jump N``, N more nodes sit behind one jump host (a cpu-only node that is not probed):
clusterctl reaches them through ssh_config's ``ProxyJump`` (one shared, verified connection
to the jump host), ansible through an ssh ``ProxyCommand`` per host, as its users do; the
jump host's logins per run are counted too.

At the largest size it then profiles clusterctl: start-up (``clusterctl --version``),
``python -X importtime`` grouped by package, an in-process run timed phase by phase
(imports, inventory, state, connect, commands, save, output), and a cProfile of the real
command grouped by where the time is spent.

    python bench/discover.py                                  # 8, 32, 64 nodes, 5 runs each
    python bench/discover.py --sizes 8,32,64 --repeat 5 --mixed 32 --shell 2
    python bench/discover.py --sizes 8 --repeat 3 --no-profile --jump 64
    python bench/discover.py --sizes 64 --repeat 3 --no-profile --openssh   # with the floor
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster_cli.probe.commands import PROBES, sminfo_command  # noqa: E402
from cluster_cli.probe.parsers.ibstat import parse_ibstat  # noqa: E402
from testbed import Cluster, TestbedError, count_specs, unavailable_reason  # noqa: E402
from testbed.hardware import NodeSpec  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from benchlib import LoadSampler, Series, tool  # noqa: E402

PRESET = "hgx-h200x8:fabric=ib-a"
MIXED = (  # share of the mixed set per preset (rounded; the rest are hgx-h200x8)
    ("dgx-h100:fabric=ib-b", 0.25),
    ("a100-pcie-4x", 0.125),
    ("rtx4090x8", 0.125),
    ("l40s-2x", 0.125),
    ("cpu-only", 0.125),
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    return tool(name, "discover")


# ---------------------------------------------------------------------------
# measurements


@dataclass
class Run:
    ok: bool
    wall_s: float
    cpu_s: float  # client: user + sys of the process and its reaped children
    server_cpu_s: float  # every node's sshd and its reaped children
    error: str = ""


def _sshd_cpu(cluster: Cluster) -> float:
    """CPU seconds of every node's sshd, its own plus that of its reaped children."""
    total = 0
    for n in cluster.nodes.values():
        if not n.sshd_pid:
            continue
        try:
            with open(f"/proc/{n.sshd_pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # after "(comm)": state=0 ... utime=11 stime=12 cutime=13 cstime=14
        total += sum(int(x) for x in fields[11:15])
    return total / CLK_TCK


def _timed(
    argv: Sequence[str], *, env: dict[str, str], stdout: Path, stderr: Path, cluster: Cluster, timeout: float
) -> tuple[int, float, float, float]:
    """Run argv to completion: (rc, wall s, client CPU s, server CPU s)."""
    s0 = _sshd_cpu(cluster)
    with stdout.open("wb") as out, stderr.open("wb") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(list(argv), stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)  # fmt: skip
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                pid, status, ru = os.wait4(p.pid, 0)
                break
            time.sleep(0.002)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    # The server side finishes its bookkeeping (reaping sessions) a moment after the client.
    time.sleep(0.3)
    return p.returncode, wall, ru.ru_utime + ru.ru_stime, _sshd_cpu(cluster) - s0


# ---------------------------------------------------------------------------
# what each node should answer


@dataclass(frozen=True)
class Expect:
    commands: tuple[str, ...]  # the probe commands plus one sminfo per Active IB port
    outputs: tuple[str, ...]  # non-empty expected stdout of each command
    gpus: int
    sm_ports: int


def expectations(cluster: Cluster) -> dict[str, Expect]:
    out: dict[str, Expect] = {}
    for name in cluster.nodes:
        r = cluster.expected(name)
        ib = r.expected(PROBES["ibstat"])
        ports = [p for p in parse_ibstat(ib.stdout.decode()) if p.is_ib_attachment] if ib.rc == 0 else []
        cmds = (*PROBES.values(), *(sminfo_command(p.ca, p.port) for p in ports))
        outs = tuple(s for c in cmds if (s := r.expected(c).stdout.decode().strip()))
        g = r.expected(PROBES["gpus"])
        gpus = len([ln for ln in g.stdout.decode().splitlines() if ln.strip()]) if g.rc == 0 else 0
        out[name] = Expect(cmds, outs, gpus, len(ports))
    return out


def check_clusterctl(stdout: Path, expect: dict[str, Expect]) -> str:
    """'' if the JSON says every node answered what the testbed serves, else why not."""
    try:
        data = json.loads(stdout.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable JSON: {e}"
    nodes = {n["name"]: n for n in data.get("nodes", [])}
    if set(nodes) != set(expect):
        return f"nodes {len(nodes)}/{len(expect)}"
    for name, e in expect.items():
        n = nodes[name]
        if not n["reachable"]:
            return f"{name}: unreachable: {n['error']}"
        if len(n["gpus"]) != e.gpus:
            return f"{name}: {len(n['gpus'])} GPUs, expected {e.gpus}"
        sm = sum(1 for h in n["hcas"] if h.get("sm_guid"))
        if sm != e.sm_ports:
            return f"{name}: {sm} ports with an SM GUID, expected {e.sm_ports}"
    return ""


_HEADER = re.compile(r"^(\S+) \| (CHANGED|SUCCESS|FAILED!?|UNREACHABLE!)(?: \| rc=(-?\d+))? (>>|=>)", re.M)


def check_ansible(stdout: Path, expect: dict[str, Expect]) -> str:
    """'' if every host ran with rc 0 and printed every expected output, else why not."""
    text = stdout.read_text(errors="replace").replace("\r\n", "\n")
    heads = [m for m in _HEADER.finditer(text) if m.group(1) in expect]
    seen: dict[str, str] = {}
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        host, status, rc = m.group(1), m.group(2), m.group(3)
        if status != "CHANGED" or rc != "0":
            first = text[m.end() : end].strip().splitlines()[:1]
            return f"{host}: {status} rc={rc} {first[0][:160] if first else ''}"
        seen[host] = text[m.end() : end]
    missing = set(expect) - set(seen)
    if missing:
        return f"no result for {len(missing)} host(s), e.g. {sorted(missing)[0]}"
    for host, body in seen.items():
        for want in expect[host].outputs:
            if want not in body:
                return f"{host}: output incomplete (missing {want.splitlines()[0][:60]!r})"
    return ""


# ---------------------------------------------------------------------------
# the two contenders


class Bench:
    def __init__(self, work: Path, cluster: Cluster, parallel: int, timeout: float) -> None:
        self.work = work
        self.c = cluster
        self.parallel = parallel
        self.timeout = timeout
        self.expect = expectations(cluster)
        self.n = 0
        self.pipelining = False
        self.clusterctl = _tool("clusterctl")
        self.ansible = _tool("ansible")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "ANSIBLE_"))}
        self._ansible_setup()

    # -- clusterctl
    def clusterctl_argv(self, state: Path) -> list[str]:
        return [self.clusterctl, "--state", str(state), "discover", "-i", str(self.c.inventory_path),
                "-o", "json", "--parallel", str(self.parallel)]  # fmt: skip

    def run_clusterctl(self) -> Run:
        self.n += 1
        state = self.work / f"state-{self.n}" / "state.db"  # fresh every run
        out, err = self.work / f"cc-{self.n}.json", self.work / f"cc-{self.n}.err"
        rc, wall, cpu, scpu = _timed(self.clusterctl_argv(state), env=self.env, stdout=out, stderr=err,
                                     cluster=self.c, timeout=self.timeout)  # fmt: skip
        why = f"rc {rc}: {_first_line(err)}" if rc != 0 else check_clusterctl(out, self.expect)
        return Run(not why, wall, cpu, scpu, why)

    # -- ansible
    def _ansible_setup(self) -> None:
        a = self.work / "ansible"
        for d in ("home", "tmp", "cp", "remote"):
            (a / d).mkdir(parents=True, exist_ok=True)
        cfg = a / "ansible.cfg"
        cfg.write_text(
            "[defaults]\n"
            "host_key_checking = True\n"
            "retry_files_enabled = False\n"
            f"local_tmp = {a / 'tmp'}\n"
            f"remote_tmp = {a / 'remote'}\n"  # the nodes share this filesystem: keep ~/.ansible clean
            "gathering = explicit\n"
            "deprecation_warnings = False\n"
            "nocolor = True\n"
            "interpreter_python = /usr/bin/python3\n"
            "[ssh_connection]\n"
            f"control_path_dir = {a / 'cp'}\n"
            "ssh_args = -C -o ControlMaster=no\n"
        )
        common = (
            f"-F /dev/null -o UserKnownHostsFile={self.c.known_hosts_path} -o GlobalKnownHostsFile=/dev/null "
            "-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes -o BatchMode=yes -o ConnectTimeout=10"
        )
        base = "; ".join(PROBES.values())
        hosts: dict[str, Any] = {}
        for name in self.expect:
            n = self.c.nodes[name]
            extra = [c for c in self.expect[name].commands if c not in PROBES.values()]
            hosts[name] = {"ansible_host": n.host, "ansible_port": n.port, "sminfo_cmds": "; ".join(extra) or "true"}
        inv = {
            "all": {
                "hosts": hosts,
                "vars": {
                    "ansible_user": self.c.user,
                    "ansible_ssh_private_key_file": str(self.c.identity_file),
                    "ansible_ssh_common_args": common,
                },
            }
        }
        self.hosts_file = a / "hosts.json"  # JSON is YAML; no yaml quoting pitfalls
        self.hosts_file.write_text(json.dumps(inv, indent=1))
        # Homogeneous sets run the literal command line; the per-host part is only the sminfo list.
        self.raw_cmd = f"{base}; {{{{ sminfo_cmds }}}}"
        self.ansible_env = {
            **self.env,
            "ANSIBLE_CONFIG": str(cfg),
            "ANSIBLE_HOME": str(a / "home"),
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            "ANSIBLE_LOCAL_TEMP": str(a / "tmp"),
            "ANSIBLE_REMOTE_TEMP": str(a / "remote"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(a / "cp"),
            "ANSIBLE_NOCOLOR": "1",
        }

    # -- OpenSSH's own client: the floor for any SSH tool on this box
    def _openssh_setup(self) -> None:
        """One ``ssh`` per node, all at once, the same commands as ansible's, nothing parsed.

        The same key exchange and cipher clusterctl negotiates (curve25519-sha256, AES-GCM), host
        keys verified, no connection sharing. What it costs is what any tool pays here just to
        log in to every node and run the probes; the rest of a tool's time is its own.
        """
        d = self.work / "openssh"
        d.mkdir(parents=True, exist_ok=True)
        opts = [
            "-F", "/dev/null", "-o", f"UserKnownHostsFile={self.c.known_hosts_path}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ControlMaster=no",
            "-o", "KexAlgorithms=curve25519-sha256", "-o", "Ciphers=aes128-gcm@openssh.com",
            "-i", str(self.c.identity_file), "-l", self.c.user,
        ]  # fmt: skip
        lines = ["#!/bin/sh", 'out="$1"']
        for name, e in self.expect.items():
            n = self.c.nodes[name]
            argv = ["ssh", *opts, "-p", str(n.port), n.host, "; ".join(e.commands)]
            lines.append(f'{" ".join(shlex.quote(a) for a in argv)} >"$out/{name}" 2>&1 </dev/null &')
        lines.append("wait")
        self.openssh_script = d / "all.sh"
        self.openssh_script.write_text("\n".join(lines) + "\n")

    def run_openssh(self) -> Run:
        self.n += 1
        out = self.work / f"os-{self.n}"
        out.mkdir()
        rc, wall, cpu, scpu = _timed(["sh", str(self.openssh_script), str(out)], env=self.env,
                                     stdout=out / "_stdout", stderr=out / "_stderr", cluster=self.c,
                                     timeout=self.timeout)  # fmt: skip
        why = f"rc {rc}" if rc != 0 else ""
        for name, e in self.expect.items():
            if why:
                break
            try:
                body = (out / name).read_text(errors="replace")
            except OSError:
                why = f"{name}: no output"
                break
            for want in e.outputs:
                if want not in body:
                    why = f"{name}: output incomplete (missing {want.splitlines()[0][:60]!r}): {body[:160]!r}"
                    break
        return Run(not why, wall, cpu, scpu, why)

    def ansible_argv(self, module: str = "raw") -> list[str]:
        return [self.ansible, "all", "-i", str(self.hosts_file), "-f", str(self.parallel), "-m", module,
                "-a", self.raw_cmd]  # fmt: skip

    def run_ansible(self, module: str = "raw") -> Run:
        """One ``ansible all -m MODULE`` run.

        ``raw`` logs in once per host, so connection sharing would change nothing within a run
        and is off. A module (``shell``) logs in several times per host (make the remote temp
        folder, copy the module, run it, remove it); there the run uses ansible's default
        sharing (``ControlMaster=auto``, ``ControlPersist=60s``) with a fresh control folder,
        so one run reuses its own connections and no run reuses another's. The masters left
        persisting are ended after the run, outside its timing. With ``--pipelining`` a module
        runs as ansible's tuned set-ups run it: sent on the command's stdin, one exec per host.
        """
        self.n += 1
        out, err = self.work / f"an-{self.n}.out", self.work / f"an-{self.n}.err"
        env = self.ansible_env
        cp = None
        if module != "raw":
            cp = self.work / "ansible" / f"cp-{self.n}"
            cp.mkdir()
            env = {**env, "ANSIBLE_SSH_ARGS": "-C -o ControlMaster=auto -o ControlPersist=60s",
                   "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp)}  # fmt: skip
            if self.pipelining:
                env["ANSIBLE_PIPELINING"] = "True"
        try:
            rc, wall, cpu, scpu = _timed(self.ansible_argv(module), env=env, stdout=out, stderr=err,
                                         cluster=self.c, timeout=self.timeout)  # fmt: skip
        finally:
            if cp is not None:
                _end_processes_naming(str(cp))
        why = check_ansible(out, self.expect)
        if not why and rc != 0:
            why = f"rc {rc}: {_first_line(err)}"
        return Run(not why, wall, cpu, scpu, why)


def _pids_naming(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text.encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def _end_processes_naming(text: str) -> None:
    """TERM every process whose command line contains text (ssh ControlPersist masters), and wait.

    Waiting matters: a node's sshd adds its session's CPU (the modules ansible ran there) to
    its own children's time only when that session ends, which must not land in the next run.
    """
    for pid in _pids_naming(text):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while _pids_naming(text) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the servers reap the sessions


def _first_line(p: Path) -> str:
    try:
        lines = [ln for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[0][:200] if lines else ""


# ---------------------------------------------------------------------------
# profile of clusterctl at one size

PHASES = r"""
import asyncio, json, statistics, sys, time
from contextlib import asynccontextmanager
t0 = time.perf_counter()
import cluster_cli.cli.main  # typer app + every command module, as the console script does
from cluster_cli.cli.common import inventory_or_abort, open_store
from cluster_cli.probe.collect import discover
from cluster_cli.probe.fabric import fabric_conflicts
from cluster_cli.ssh.connect import AsyncsshConnector
from pathlib import Path
t1 = time.perf_counter()
inv = inventory_or_abort(Path(sys.argv[1]), check_files=True)
t2 = time.perf_counter()
store = open_store(Path(sys.argv[2]))
t3 = time.perf_counter()
conn_done, cmd_times, conn_times = [], [], []

class Timed(AsyncsshConnector):
    @asynccontextmanager
    async def session(self, target):
        a = time.perf_counter()
        async with super().session(target) as s:
            b = time.perf_counter()
            conn_times.append(b - a)
            conn_done.append(b)
            yield s
            cmd_times.append(time.perf_counter() - b)

facts = asyncio.run(discover(inv, inv.nodes, connector=Timed(), parallel=int(sys.argv[3])))
t4 = time.perf_counter()
store.save_discovery(facts)
saved = store.nodes([n.name for n in inv.nodes])
conflicts = fabric_conflicts([f for f in saved if f.reachable])
store.close()
t5 = time.perf_counter()
text = json.dumps({"nodes": [f.to_dict() for f in saved], "fabric_conflicts": conflicts}, indent=2)
t6 = time.perf_counter()
ok = sum(f.reachable for f in facts)
print(json.dumps({
    "ok": ok, "n": len(facts),
    "imports": t1 - t0, "inventory": t2 - t1, "state_open": t3 - t2, "discover": t4 - t3,
    "save": t5 - t4, "json": t6 - t5,
    "first_connected": min(conn_done) - t3, "all_connected": max(conn_done) - t3,
    "connect_p50": statistics.median(conn_times), "connect_max": max(conn_times),
    "commands_p50": statistics.median(cmd_times), "commands_max": max(cmd_times),
}))
"""

# cProfile of the SSH part (asyncio.run): own time by area. A built-in (C) function counts
# for the area of its busiest caller, except the ones named here.
_BUCKETS: tuple[tuple[str, str], ...] = (
    ("<method 'poll' of 'select.epoll", "idle: waiting for the network / the servers (epoll)"),
    ("<method 'send' of '_socket", "socket send (kernel TCP, veth delivery charged to the sender)"),
    ("<method 'recv' of '_socket", "socket recv"),
    ("<method 'connect' of '_socket", "socket connect"),
    ("<frozen importlib", "imports done late (inside the run)"),
    ("<built-in method marshal", "imports done late (inside the run)"),
    ("/asyncssh/kex", "asyncssh key exchange (curve25519/sntrup/mlkem, DH)"),
    ("/asyncssh/crypto/ec", "asyncssh key exchange (curve25519/sntrup/mlkem, DH)"),
    ("/asyncssh/crypto/pq", "asyncssh key exchange (curve25519/sntrup/mlkem, DH)"),
    ("/asyncssh/crypto/ed", "asyncssh auth + host key (ed25519 sign/verify, key loading)"),
    ("/asyncssh/auth", "asyncssh auth + host key (ed25519 sign/verify, key loading)"),
    ("/asyncssh/public_key", "asyncssh auth + host key (ed25519 sign/verify, key loading)"),
    ("/asyncssh/known_hosts", "asyncssh auth + host key (ed25519 sign/verify, key loading)"),
    ("/asyncssh/crypto/chacha", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncssh/crypto/cipher", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncssh/crypto/umac", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncssh/encryption", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncssh/mac", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncssh/channel", "asyncssh channels / processes (14 per node)"),
    ("/asyncssh/process", "asyncssh channels / processes (14 per node)"),
    ("/asyncssh/stream", "asyncssh channels / processes (14 per node)"),
    ("/asyncssh/", "asyncssh connection / packet framing / config"),
    ("cryptography", "asyncssh ciphers + MACs (per packet)"),
    ("/asyncio/", "asyncio event loop"),
    ("/cluster_cli/probe/parsers", "clusterctl: parsing probe output"),
    ("/cluster_cli/", "clusterctl: other"),
    ("/pydantic", "pydantic"),
    ("/typing.py", "typing"),
    ("/rich/", "rich"),
)

PROFILE_DRIVER = """
import asyncio, cProfile, sys
prof = cProfile.Profile()
out = sys.argv.pop(1)
_run = asyncio.run
def run(*a, **k):
    prof.enable()
    try:
        return _run(*a, **k)
    finally:
        prof.disable()
        prof.dump_stats(out)
asyncio.run = run
sys.argv[0] = "clusterctl"
from cluster_cli.cli.main import run as main
main()
"""


def _area(func: tuple[str, int, str], stats: dict[Any, Any], depth: int = 0) -> str:
    key = f"{func[0]}:{func[2]}"
    for needle, name in _BUCKETS:
        if needle in key:
            return name
    if func[0] == "~" and depth < 5:  # a built-in: the area of its busiest caller
        callers = stats.get(func, (0, 0, 0, 0, {}))[4]
        if callers:
            caller = max(callers.items(), key=lambda kv: kv[1][2])[0]
            return _area(caller, stats, depth + 1)
    return "other"


def profile(bench: Bench, repeat: int, median_discover: float | None, top: int = 12) -> list[str]:
    import pstats

    lines: list[str] = []
    py = sys.executable
    env = bench.env
    inv = str(bench.c.inventory_path)

    # 1. start-up: the console script doing nothing but --version (typer + every command module)
    vers = [_startup(1) for _ in range(repeat)]
    bare = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([py, "-c", "pass"], env=env, capture_output=True, check=True)
        bare.append(time.perf_counter() - t)
    v = statistics.median(vers)
    share = f" = {v / median_discover:.0%} of discover's median" if median_discover else ""
    lines.append(f"start-up: `clusterctl --version` median {v:.2f}s (min {min(vers):.2f}s){share}; "
                 f"bare `python -c pass` {statistics.median(bare):.2f}s")  # fmt: skip

    # 2. import time by package (sum of self times)
    p = subprocess.run([py, "-X", "importtime", "-c", "import cluster_cli.cli.main"], env=env,
                       capture_output=True, text=True, check=True)  # fmt: skip
    per: dict[str, int] = {}
    own: dict[str, int] = {}
    for ln in p.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", ln)
        if m:
            pkg = m.group(4).split(".")[0]
            per[pkg] = per.get(pkg, 0) + int(m.group(1))
            if pkg == "cluster_cli" or m.group(4).startswith("asyncssh.crypto.pq"):
                own[m.group(4)] = int(m.group(1))
    total = sum(per.values())
    tops = sorted(per.items(), key=lambda kv: -kv[1])[:10]
    lines.append(f"imports (-X importtime, self time by package, total {total / 1e6:.2f}s): "
                 + ", ".join(f"{k} {t / 1e3:.0f}ms" for k, t in tops))  # fmt: skip
    lines.append("  slowest single modules: " + ", ".join(
        f"{k} {t / 1e3:.0f}ms" for k, t in sorted(own.items(), key=lambda kv: -kv[1])[:8]))  # fmt: skip

    # 3. the same work in-process, phase by phase (best of `repeat` by total)
    best: dict[str, Any] | None = None
    for i in range(repeat):
        st = bench.work / f"phase-{i}" / "state.db"
        p = subprocess.run([py, "-c", PHASES, inv, str(st), str(bench.parallel)], env=env, capture_output=True,
                           text=True, cwd=ROOT, timeout=bench.timeout)  # fmt: skip
        if p.returncode != 0:
            lines.append(f"phases: failed: {p.stderr.strip().splitlines()[-1:]}")
            break
        d = json.loads(p.stdout.strip().splitlines()[-1])
        d["total"] = sum(d[k] for k in ("imports", "inventory", "state_open", "discover", "save", "json"))
        if best is None or d["total"] < best["total"]:
            best = d
    if best is not None:
        b = best
        lines.append(
            f"phases (in-process, best of {repeat}, {b['ok']}/{b['n']} nodes ok, total {b['total']:.2f}s): "
            f"imports {b['imports']:.2f}s, inventory {b['inventory']:.3f}s, state open {b['state_open']:.3f}s, "
            f"discover {b['discover']:.2f}s, save+conflicts {b['save']:.3f}s, json {b['json']:.3f}s"
        )
        lines.append(
            f"  inside discover: first node connected at {b['first_connected']:.2f}s, last at "
            f"{b['all_connected']:.2f}s; per node connect p50 {b['connect_p50']:.2f}s (max "
            f"{b['connect_max']:.2f}s), commands p50 {b['commands_p50']:.2f}s (max {b['commands_max']:.2f}s)"
        )

    # 4. cProfile of the SSH part of the real command (asyncio.run inside `discover`)
    prof = bench.work / "discover.prof"
    driver = bench.work / "driver.py"
    driver.write_text(PROFILE_DRIVER)
    st = bench.work / "prof-state" / "state.db"
    argv = [py, str(driver), str(prof), *bench.clusterctl_argv(st)[1:]]
    t = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, timeout=bench.timeout, check=False)
    wall = time.perf_counter() - t
    if not prof.exists():
        lines.append(f"cProfile: failed (rc {p.returncode}): {p.stderr.decode(errors='replace')[-300:]}")
        return lines
    raw: dict[Any, Any] = pstats.Stats(str(prof)).stats  # type: ignore[attr-defined]
    areas: dict[str, float] = {}
    for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
        k = _area(func, raw)
        areas[k] = areas.get(k, 0.0) + tt
    tot = sum(areas.values())
    busy = tot - sum(v for k, v in areas.items() if k.startswith("idle"))
    lines.append(
        f"cProfile of asyncio.run inside the real command ({wall:.2f}s wall for the whole command under the "
        f"profiler, rc {p.returncode}): {tot:.2f}s in the loop, {busy:.2f}s of it busy; own time by area:"
    )
    for name, tt in sorted(areas.items(), key=lambda kv: -kv[1]):
        if tt >= 0.005:
            lines.append(f"  {tt:6.2f}s {tt / tot:4.0%}  {name}")
    lines.append(f"  top {top} functions by own time:")
    for func, (_cc, nc, tt, ct, _callers) in sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{_short(func[0])}:{func[1]}" if func[1] else ""
        lines.append(f"  {tt:6.3f}s own {ct:6.3f}s cum {nc:>6} calls  {func[2]} {where}")
    return lines


def _startup(repeat: int) -> float:
    """Median seconds of `clusterctl --version`: interpreter, imports and typer, no work."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTERCTL_")}
    times = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        subprocess.run([_tool("clusterctl"), "--version"], env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _short(path: str) -> str:
    for marker in ("site-packages/", "lib/python3.11/", str(ROOT) + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


class JumpBench(Bench):
    """Every node behind one jump host (not itself probed). clusterctl reaches them through
    ssh_config's ProxyJump (one shared, verified connection to the jump host); ansible the
    way its users do, with an ssh ProxyCommand per host (`ssh -W` through the jump host)."""

    def __init__(self, work: Path, cluster: Cluster, parallel: int, timeout: float, jump: str) -> None:
        self.jump = jump
        super().__init__(work, cluster, parallel, timeout)
        j = cluster.nodes[jump]
        d = self.work / "jump"
        d.mkdir(parents=True, exist_ok=True)
        patterns = " ".join(sorted({n.host for name, n in cluster.nodes.items() if name != jump}))
        (d / "ssh_config").write_text(
            f"Host {jump}\n  HostName {j.host}\n  Port {j.port}\n  User {cluster.user}\n"
            f"  IdentityFile {cluster.identity_file}\n  IdentitiesOnly yes\n"
            f"Host {patterns}\n  ProxyJump {jump}\n"
        )
        data = yaml.safe_load(cluster.inventory_path.read_text())
        data["nodes"] = [n for n in data["nodes"] if n["name"] != jump]
        data["ssh_config"] = str(d / "ssh_config")
        for key in ("identity_file", "known_hosts"):
            data["defaults"][key] = str(cluster.inventory_path.parent / data["defaults"][key])
        self.inventory = d / "inventory.yaml"
        self.inventory.write_text(yaml.safe_dump(data))

    def _ansible_setup(self) -> None:
        self.expect.pop(self.jump, None)
        super()._ansible_setup()
        j = self.c.nodes[self.jump]
        proxy = (
            f"ssh -F /dev/null -i {self.c.identity_file} -o UserKnownHostsFile={self.c.known_hosts_path} "
            "-o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes -o BatchMode=yes "
            f"-W %h:%p -p {j.port} {self.c.user}@{j.host}"
        )
        inv = json.loads(self.hosts_file.read_text())
        inv["all"]["vars"]["ansible_ssh_common_args"] += f" -o ProxyCommand='{proxy}'"
        self.hosts_file.write_text(json.dumps(inv, indent=1))

    def clusterctl_argv(self, state: Path) -> list[str]:
        return [self.clusterctl, "--state", str(state), "discover", "-i", str(self.inventory),
                "-o", "json", "--parallel", str(self.parallel)]  # fmt: skip

    def jump_logins(self) -> int:
        log = self.c.nodes[self.jump].log_path
        return log.read_text(errors="replace").count("Accepted publickey") if log.exists() else 0


def run_jump(args: argparse.Namespace, work: Path, n: int) -> list[str]:
    """``n`` nodes behind one jump host, both contenders ``args.repeat`` times, interleaved."""
    specs = [*count_specs(n, PRESET, "gpu"), *count_specs(1, "cpu-only", "jump")]
    out: list[str] = []
    with testbed(work / f"tb-jump-{n}", specs) as c:
        jump = next(name for name in c.nodes if name.startswith("jump"))
        b = JumpBench(work / f"run-jump-{n}", c, args.parallel, args.timeout, jump)
        print(f"[{n} nodes behind jump host {jump}] ({c.mode})", flush=True)
        cc, an = Series(), Series()
        logins: dict[str, list[int]] = {"clusterctl": [], "ansible": []}
        b.run_clusterctl()  # warm-up, not counted
        b.run_ansible()
        for i in range(args.repeat):
            for label, series, fn in (("clusterctl", cc, b.run_clusterctl), ("ansible", an, b.run_ansible)):
                before = b.jump_logins()
                r = fn()
                logins[label].append(b.jump_logins() - before)
                series.runs.append(r)
                if not r.ok:
                    print(f"  run {i + 1}: {label} FAILED: {r.error}", flush=True)
            print(f"  run {i + 1}: clusterctl {cc.runs[-1].wall_s:.2f}s, ansible {an.runs[-1].wall_s:.2f}s", flush=True)
        cm, am = cc.median(), an.median()
        out.append(
            f"{n} nodes behind one jump host: clusterctl median {_fmt(cm)}s, ansible (ProxyCommand) {_fmt(am)}s"
            + (f" ({am / cm:.1f}x)" if cm and am else "")
            + f"; logins on the jump host per run: clusterctl {statistics.median(logins['clusterctl']):g}, "
            f"ansible {statistics.median(logins['ansible']):g}; client CPU {_fmt(cc.median('cpu_s'))} / "
            f"{_fmt(an.median('cpu_s'))} s; servers' CPU (jump host included) {_fmt(cc.median('server_cpu_s'))} / "
            f"{_fmt(an.median('server_cpu_s'))} s"
        )
    return out


# ---------------------------------------------------------------------------
# main


@contextmanager
def testbed(directory: Path, specs: list[NodeSpec]) -> Iterator[Cluster]:
    c = Cluster.start(directory, specs, stop_at_exit=True)
    try:
        yield c
    finally:
        c.stop()


def mixed_specs(n: int) -> list[NodeSpec]:
    specs: list[NodeSpec] = []
    used = 0
    for preset, share in MIXED:
        k = max(1, round(n * share))
        specs += count_specs(k, preset, preset.split(":")[0])
        used += k
    specs += count_specs(max(0, n - used), PRESET, "hgx")
    return specs


def _fmt(x: float | None, d: int = 2) -> str:
    return f"{x:.{d}f}" if x is not None else "FAILED"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,32,64", help="testbed sizes, comma-separated (hgx-h200x8 on ib-a)")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each contender per size")
    ap.add_argument("--mixed", type=int, default=0, metavar="N", help="also a mixed set of N nodes (6 presets)")
    ap.add_argument("--parallel", type=int, default=64, help="clusterctl --parallel and ansible -f")
    ap.add_argument(
        "--shell",
        type=int,
        default=2,
        metavar="N",
        help="also time ansible -m shell (its module path: Python on the node, ansible's default SSH "
        "connection sharing) N times per size, in the first N rounds (0: not at all)",
    )
    ap.add_argument("--pipelining", action="store_true",
                    help="run the -m shell contender with ansible's pipelining on (off by default in ansible)")  # fmt: skip
    ap.add_argument("--jump", type=int, default=0, metavar="N",
                    help="also N nodes behind one jump host (ssh_config ProxyJump vs ansible ProxyCommand)")  # fmt: skip
    ap.add_argument("--openssh", action="store_true",
                    help="also time OpenSSH's client (one ssh per node, same commands, nothing parsed): the floor")  # fmt: skip
    ap.add_argument("--no-profile", action="store_true", help="skip the profile at the largest size")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as failed")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (outputs of every run)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if why := unavailable_reason():
        print(f"discover bench: no testbed here: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so every testbed is stopped on the way out

    sets: list[tuple[str, list[NodeSpec]]] = [(str(n), count_specs(n, PRESET, "gpu")) for n in sizes]
    if args.mixed:
        sets.append((f"{args.mixed} mixed", mixed_specs(args.mixed)))
    work = Path(tempfile.mkdtemp(prefix="clusterctl-bench-discover-"))
    print(f"machine: nproc {os.cpu_count()}, {_cpu_model()}, load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    print(f"clusterctl: {_tool('clusterctl')}; ansible: {_tool('ansible')} ({_ansible_version()}); work: {work}")
    print(f"runs: {args.repeat} of each per size, interleaved; clusterctl with a fresh --state every run\n")
    startup = _startup(args.repeat)
    print(f"start-up: `clusterctl --version` median {startup:.2f}s (Python + typer + every command module)\n")
    rows: list[tuple[str, ...]] = []
    extra: list[str] = []
    try:
        for label, specs in sets:
            tb = work / f"tb-{label.replace(' ', '-')}"
            t = time.perf_counter()
            with testbed(tb, specs) as c, LoadSampler() as load:
                print(f"[{label} nodes] testbed up in {time.perf_counter() - t:.1f}s ({c.mode}); "
                      f"{sum(len(e.commands) for e in expectations(c).values())} commands in all", flush=True)  # fmt: skip
                b = Bench(work / f"run-{label.replace(' ', '-')}", c, args.parallel, args.timeout)
                b.pipelining = args.pipelining
                b.work.mkdir(parents=True, exist_ok=True)
                print("  clusterctl: " + " ".join(b.clusterctl_argv(Path("STATE"))))
                print("  ansible:    " + " ".join(b.ansible_argv()[:-1]) + f" '{b.raw_cmd[:60]}...'")
                cc, an, sh, os_ = Series(), Series(), Series(), Series()
                contenders = [(cc, b.run_clusterctl), (an, b.run_ansible)]
                if args.openssh:
                    b._openssh_setup()
                    contenders.append((os_, b.run_openssh))
                for _, fn in contenders:  # warm the page cache for all (not counted)
                    fn()
                for i in range(args.repeat):
                    for series, fn in contenders:
                        r = fn()
                        series.runs.append(r)
                        if not r.ok:
                            print(f"  run {i + 1}: FAILED: {r.error}", flush=True)
                    if i < args.shell:
                        sh.runs.append(b.run_ansible("shell"))
                    print(
                        f"  run {i + 1}: clusterctl {cc.runs[-1].wall_s:.2f}s, ansible {an.runs[-1].wall_s:.2f}s"
                        + (f", ansible shell {sh.runs[-1].wall_s:.2f}s" if i < args.shell else "")
                        + (f", openssh {os_.runs[-1].wall_s:.2f}s" if args.openssh else ""),
                        flush=True,
                    )
                cm, am = cc.median(), an.median()
                ratio = f"{am / cm:.1f}x" if cm and am else "-"
                ccpu, acpu = cc.median("cpu_s"), an.median("cpu_s")
                scpu = cc.median("server_cpu_s")
                rows.append((label, _fmt(cm), _fmt(cc.min()), _fmt(am), _fmt(an.min()), ratio,
                             f"{startup / cm:.0%}" if cm else "-", _fmt(ccpu), _fmt(scpu), _fmt(acpu),
                             _fmt(an.median("server_cpu_s")), f"{acpu / ccpu:.1f}x" if acpu and ccpu else "-",
                             _fmt(sh.median()) if sh.runs else "-",
                             f"{sh.median() / cm:.1f}x" if sh.runs and sh.median() and cm else "-",
                             load.summary()))  # fmt: skip
                if ccpu is not None and scpu is not None:
                    extra.append(f"{label} nodes: clusterctl client + servers need {ccpu + scpu:.2f} CPU-s; on "
                                 f"{os.cpu_count()} cores no run can take under {(ccpu + scpu) / (os.cpu_count() or 1):.2f}s")  # fmt: skip
                if args.openssh:
                    om = os_.median()
                    extra.append(f"{label} nodes: OpenSSH client (the floor) median {_fmt(om)}s, min {_fmt(os_.min())}s, "
                                 f"client CPU {_fmt(os_.median('cpu_s'))}s, servers' CPU {_fmt(os_.median('server_cpu_s'))}s"
                                 + (f"; clusterctl / floor {cm / om:.2f}x" if om and cm else "")
                                 + (f"; FAILED: {os_.failed[0].error}" if os_.failed else ""))  # fmt: skip
                if args.shell:
                    sm = sh.median()
                    extra.append(f"{label} nodes: ansible -m shell (module path, connection sharing"
                                 f"{', pipelining' if args.pipelining else ''}) "
                                 f"median {_fmt(sm)}s, min {_fmt(sh.min())}s"
                                 + (f" ({sm / cm:.1f}x clusterctl)" if sm and cm else "")
                                 + (f"; FAILED: {sh.failed[0].error}" if sh.failed else ""))  # fmt: skip
                if not args.no_profile and label == str(max(sizes)):
                    print(f"  profiling clusterctl at {label} nodes...", flush=True)
                    extra += [f"profile at {label} nodes:", *profile(b, args.repeat, cm)]
        if args.jump:
            extra += run_jump(args, work, args.jump)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    head = ("nodes", "cc median", "cc min", "ansible med", "ansible min", "ans/cc", "start-up",
            "cc cpu", "cc srv cpu", "ans cpu", "ans srv cpu", "cpu ans/cc", "shell med", "shell/cc",
            "load avg")  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    print("(seconds, medians; start-up = `clusterctl --version` / cc median; cpu = client user+sys;")
    print(" srv cpu = every node's sshd and its children; ansible = -m raw; shell = ansible -m shell;")
    print(" load avg = 1-min, sampled every second)")
    for ln in extra:
        print(ln)
    print(f"load average at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _cpu_model() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _ansible_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"ansible-core {version('ansible-core')}"
    except PackageNotFoundError:
        return "ansible-core ?"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (TestbedError, ValueError) as e:
        print(f"discover bench: {e}", file=sys.stderr)
        sys.exit(1)
