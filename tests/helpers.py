"""Builders shared by the test modules (no tests here; ``test_helpers.py`` checks the node builders).

Placement:

* ``dgx``: DGX/HGX H100 or H200, 8 SXM GPUs in one NVLink domain, 8 InfiniBand rails
  (mlx5_0..mlx5_7) on one fabric, 2x56 cores, 2 TiB.
* ``a100_pcie``: 8 A100 PCIe in NVLink bridge pairs (0-1, 2-3, ...), one HDR port.
* ``l40s``: 4 L40S, PCIe only (known topology, no NVLink), no InfiniBand.
* ``cpu_node``: no GPU, no InfiniBand.
* ``node``, ``gpu``, ``ib``: the parts they are made of; ``profile`` and ``catalog``: a catalog
  in code; ``rep``: a replica as the state records it.
* ``ISSUE_EXAMPLE``: the catalog of the format's specification; ``write_inputs``: the
  inventory, catalog and facts files of ``place --dry-run``.

Router:

* ``Clock``: an injected clock (``clock.t += 5`` moves it on); ``endpoint``: a router endpoint
  for an endpoint on 127.0.0.1:9000+i; ``router_config``: a validated router config.
* ``chat_request`` and ``read_until``: a raw HTTP/1.1 chat request, and reading responses
  off a socket.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cluster_cli.config.catalog import Catalog
from cluster_cli.engines import MetricMapping
from cluster_cli.facts import Gpu, GpuProcess, HcaPort, NodeFacts, Replica, Shard
from cluster_cli.router.breaker import BreakerConfig
from cluster_cli.router.config import EndpointView, RouterConfig
from cluster_cli.router.endpoint import Endpoint

# --------------------------------------------------------------------------- placement

PRODUCTS = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
    "A100": "NVIDIA A100 80GB PCIe",
    "L40S": "NVIDIA L40S",
}

PROBLEMS = {
    "ecc": "ecc: 2 uncorrected ECC errors",
    "lost": "lost: GPU has fallen off the bus",
    "retired": "retired-pages: page retirement pending",
    "remap": "remap: row remap pending",
    "mig": "mig: MIG mode enabled",
}


def gpu(node: str, i: int, cls: str, problem: str | None = None, pid: int = 4411) -> Gpu:
    uuid = f"GPU-{node}-{i}"
    if problem == "foreign":
        return Gpu(
            i, uuid, PRODUCTS.get(cls, cls), cls,
            processes=(GpuProcess(pid, "python", uuid, 1024),),
            problems=(f"foreign-process: pid {pid} (python)",),
        )  # fmt: skip
    problems = (PROBLEMS[problem],) if problem else ()
    return Gpu(
        i, uuid, PRODUCTS.get(cls, cls), cls,
        lost=problem == "lost",
        ecc_uncorrected=2 if problem == "ecc" else None,
        mig_mode=problem == "mig",
        problems=problems,
    )  # fmt: skip


def ib(ca: str, fabric: str | None, state: str = "Active", link: str = "InfiniBand") -> HcaPort:
    return HcaPort(ca, 1, state, "LinkUp" if state == "Active" else "Disabled", link, 400.0, fabric=fabric)


def node(
    name: str,
    *,
    cls: str | None = None,
    gpus: int = 0,
    problems: Mapping[int, str] | None = None,
    domains: Iterable[Iterable[int]] | None = None,
    hcas: Iterable[HcaPort] = (),
    cpus: int | None = 64,
    memory_gib: int | None = 256,
    cordoned: bool = False,
    reachable: bool = True,
    error: str | None = None,
    fabric: str | None = None,
) -> NodeFacts:
    problems = problems or {}
    return NodeFacts(
        name=name,
        host=f"10.0.0.{abs(hash(name)) % 250 + 1}",
        reachable=reachable,
        error=error if error or reachable else "connection refused",
        cpus=cpus,
        memory_mib=None if memory_gib is None else memory_gib * 1024,
        gpus=tuple(gpu(name, i, cls or "", problems.get(i), pid=4411 + i) for i in range(gpus)),
        nvlink_domains=None if domains is None else tuple(tuple(d) for d in domains),
        hcas=tuple(hcas),
        fabric=fabric,
        cordoned=cordoned,
        cordon_reason="maintenance" if cordoned else None,
    )


def dgx(name: str, cls: str = "H100", fabric: str | None = "ib-a", **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [range(8)])
    kw.setdefault("hcas", [ib(f"mlx5_{i}", fabric) for i in range(8)] if fabric else ())
    kw.setdefault("cpus", 224)
    kw.setdefault("memory_gib", 2048)
    return node(name, cls=cls, gpus=8, fabric=fabric, **kw)


def a100_pcie(name: str, fabric: str | None = None, **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [(0, 1), (2, 3), (4, 5), (6, 7)])
    kw.setdefault("hcas", [ib("mlx5_0", fabric)] if fabric else ())
    kw.setdefault("cpus", 128)
    kw.setdefault("memory_gib", 1024)
    return node(name, cls="A100", gpus=8, fabric=fabric, **kw)


def l40s(name: str, **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [])
    return node(name, cls="L40S", gpus=4, **kw)


def cpu_node(name: str, cpus: int | None = 32, memory_gib: int | None = 128, **kw: Any) -> NodeFacts:
    return node(name, cpus=cpus, memory_gib=memory_gib, **kw)


def profile(name: str, engine: str = "vllm", **kw: Any) -> dict[str, Any]:
    return {"name": name, "engine": engine, "model": f"/models/{name}", **kw}


def catalog(*models: tuple[str, int, list[dict[str, Any]]]) -> Catalog:
    return Catalog.model_validate({"models": [{"name": n, "replicas": r, "profiles": ps} for n, r, ps in models]})


def rep(model: str, i: int, prof: str, shards: list[tuple[str, tuple[int, ...]]], **kw: object) -> Replica:
    return Replica(
        model, i, prof, kw.pop("engine", "vllm"), tuple(Shard(n, g, tuple(kw.pop("hcas", ()))) for n, g in shards), **kw
    )  # type: ignore[arg-type]


ISSUE_EXAMPLE = """
engines:
  vllm:     {command: vllm}
  llamacpp: {command: llama-server}
models:
  - name: llama-70b
    replicas: 2
    profiles:
      - {name: h100-tp8, engine: vllm, gpu_class: H100, gpus: 8, priority: 100, model: /models/llama-70b}
      - {name: a100-2x8, engine: vllm, gpu_class: A100, gpus: 8, nodes: 2, priority: 50, model: /models/llama-70b}
      - {name: cpu, engine: llamacpp, cpus: 32, memory_gib: 64, priority: 1, model: /models/llama-70b.Q4_K_M.gguf}
"""


def write_inputs(tmp_path: Path, nodes: list[NodeFacts], *, inventory_nodes: list[str] | None = None,
                 catalog: str = ISSUE_EXAMPLE) -> tuple[Path, Path, Path]:  # fmt: skip
    """An inventory of ``inventory_nodes`` (default: the nodes'), a catalog, and a facts file of ``nodes``."""
    names = inventory_nodes if inventory_nodes is not None else [n.name for n in nodes]
    inv = tmp_path / "inventory.yaml"
    inv.write_text("nodes:\n" + "".join(f"  - {{name: {n}, host: 10.0.0.{i + 1}}}\n" for i, n in enumerate(names)))
    cat = tmp_path / "catalog.yaml"
    cat.write_text(catalog)
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"nodes": [n.to_dict() for n in nodes]}))
    return inv, cat, facts


# --------------------------------------------------------------------------- router


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def endpoint(i: int, clock: Clock, *, max_inflight: int | None = None, draining: bool = False) -> Endpoint:
    view = EndpointView(
        url=f"http://127.0.0.1:{9000 + i}",
        host="127.0.0.1",
        port=9000 + i,
        engine="vllm",
        replica=f"r{i}",
        draining=draining,
        max_inflight=max_inflight,
        metrics=MetricMapping.vllm(),
        health_path="/health",
        models=("m",),
    )
    return Endpoint(view, breaker_cfg=BreakerConfig(), clock=clock, stale_s=3.0, probe_s=5.0)


def router_config(models: dict, router: dict | None = None) -> RouterConfig:
    return RouterConfig.model_validate({"models": models, "router": router or {}})


def chat_request(pad: int, stream: bool = False) -> bytes:
    """A raw HTTP/1.1 chat request for the simulated engines' model, its message ``pad`` characters long."""
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "x" * pad}], "stream": stream}).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


def read_until(s: socket.socket, count: int, needle: bytes = b"HTTP/1.1 200", timeout: float = 8.0) -> bytes:
    """Read from ``s`` until ``needle`` came ``count`` times, the peer closed, or ``timeout`` passed."""
    s.settimeout(timeout)
    buf = b""
    deadline = time.monotonic() + timeout
    while buf.count(needle) < count and time.monotonic() < deadline:
        try:
            d = s.recv(65536)
        except TimeoutError:
            break
        if not d:
            break
        buf += d
    return buf


# ---------------------------------------------------------------------------- stand-in engines
# "(WHO pid=N) standin-env: NAME=VALUE", or "NAME unset"; actors add ", ip=IP" after the pid.
ENV_LINE = re.compile(
    r"^\((?P<who>[^ )]+) pid=(?P<pid>\d+)(?:, ip=(?P<ip>[^)]*))?\) standin-env: (?P<name>\w+)(?:=(?P<value>.*)| unset)$",
    re.M,
)


def standin_env(text: str) -> dict[tuple[str, int], dict[str, str | None]]:
    """What each process of a stand-in log saw: {(who, pid): {NAME: value or None (unset)}}."""
    out: dict[tuple[str, int], dict[str, str | None]] = {}
    for m in ENV_LINE.finditer(text):
        out.setdefault((m["who"], int(m["pid"])), {})[m["name"]] = m["value"]
    return out


def ctl(state: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process (a hang fails the test instead of stalling the suite)."""
    return subprocess.run(
        [sys.executable, "-m", "cluster_cli", "--state", str(state), *args], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def ctrl_c_while_locked(state: Path, *args: str, wait_s: float = 3.0) -> tuple[int | None, str, str, float]:
    """Run the CLI while another process holds the state's write lock; once it waits for it,
    Ctrl-C. Its exit code, stdout, stderr, and how long it took to end after the signal."""
    import signal
    import sqlite3

    holder = sqlite3.connect(state, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a hung writer holds the lock
    argv = [sys.executable, "-m", "cluster_cli", "--state", str(state), *args]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(wait_s)  # imported, its input read, waiting for the lock
        assert p.poll() is None, p.communicate()
        t = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        return p.returncode, out, err, time.monotonic() - t
    finally:
        p.kill()
        holder.execute("ROLLBACK")
        holder.close()


def json_out(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """A command's ``-o json`` output (its exit code and stderr in the failure when it printed none)."""
    assert r.stdout.strip().startswith("{"), (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)
