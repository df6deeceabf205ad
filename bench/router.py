#!/usr/bin/env python3
"""Benchmark of ``clusterctl serve-router`` against simulated engines (tests/simengine.py).

1. overhead: one engine with no token delay; direct vs through the router at 1 and 64
   concurrent streams (added time to first token p50/p99), the most short non-stream
   requests per second, and the router's CPU milliseconds per request.
2. balance: 4 engines of unequal speed and capacity (2 x cap 8 / 10 ms per token, 2 x
   cap 4 / 30 ms per token, 64 tokens), Poisson arrivals at --load of the fleet's
   capacity; TTFT p50/p99 and throughput per router policy (least_load, p2c, round_robin).

Everything listens on 127.0.0.1; every process is started here, in its own process
group, and stopped by that group. The load generator is a small raw-socket HTTP/1.1
client (keep-alive), so it costs little CPU next to the proxy it measures.

    python bench/router.py overhead --duration 5
    python bench/router.py overhead --duration 4 --rounds 3 --floor   # with a bare relay and nginx
    python bench/router.py balance --duration 60
    python bench/router.py all --out results.json

3. peers: nginx, vllm-router and LiteLLM side by side with clusterctl (overhead and/or
   balance, same simulated engine), by the shared peers harness (``shared/bench-peers``
   beside this repository, or --peers-dir), run from a scratch copy with this checkout's
   ``clusterctl`` on PATH (its venvs under $BENCH_VENVS, default /opt/benchvenv; --install
   installs them first: apt nginx and three PyPI venvs).

    python bench/router.py peers --peers-test overhead --duration 5 --rounds 3
    python bench/router.py peers --peers-test balance --duration 60 --load 0.8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMENGINE = ROOT / "tests" / "simengine.py"
MODEL = "sim"


# ---------------------------------------------------------------------------- processes
class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def cpu_s(self) -> float:
        """utime+stime of the process group we started (leader's pgid == its pid)."""
        tck = os.sysconf("SC_CLK_TCK")
        total = 0
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                st = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            rest = st[st.rfind(")") + 2 :].split()
            if int(rest[2]) == self.p.pid:
                total += int(rest[11]) + int(rest[12])
        return total / tck

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


def start_engine(rundir: Path, port: int, *, capacity: int, delay_ms: float, tokens: int) -> Proc:
    argv = [sys.executable, str(SIMENGINE), "--port", str(port), "--model", MODEL, "--capacity", str(capacity),
            "--token-delay-ms", str(delay_ms), "--tokens", str(tokens)]  # fmt: skip
    p = Proc(argv, rundir / f"engine-{port}.log")
    wait_port(port)
    return p


def start_router(rundir: Path, port: int, engine_ports: list[int], policy: str = "least_load") -> Proc:
    cfg = rundir / f"router-{port}.yaml"
    eps = "\n".join(
        f'      - {{url: "http://127.0.0.1:{p}", engine: vllm, replica: e{i}}}' for i, p in enumerate(engine_ports)
    )
    cfg.write_text(f"engines:\n  vllm: {{metrics: {{}}}}\nmodels:\n  {MODEL}:\n    endpoints:\n{eps}\n")
    argv = [sys.executable, "-c", "from cluster_cli.cli.main import run; run()", "serve-router", "--config", str(cfg),
            "--port", str(port), "--policy", policy, "--access-log", str(rundir / f"access-{port}.log")]  # fmt: skip
    p = Proc(argv, rundir / f"router-{port}.log")
    wait_port(port)
    return p


# ---------------------------------------------------------------------------- load generator
def request_bytes(port: int, stream: bool, max_tokens: int) -> bytes:
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": max_tokens}
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (port, len(body), body)
    )


class Conn:
    """One keep-alive connection; ``exchange`` returns (ttft_s, total_s, ok)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def exchange(self, req: bytes, t0: float) -> tuple[float, float, bool]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
            self.w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        r, w = self.r, self.w
        w.write(req)
        head = await r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        ttft = 0.0
        ok = status == 200
        if b"transfer-encoding: chunked" in lower:
            done = False
            while True:
                size_line = await r.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await r.readuntil(b"\r\n")
                    break
                data = await r.readexactly(size + 2)
                if not ttft and b'"content":"' in data:
                    ttft = time.perf_counter() - t0
                if b"[DONE]" in data:
                    done = True
                if b'"error"' in data:
                    ok = False
            ok = ok and done
        else:
            clen = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(clen)
            ttft = time.perf_counter() - t0
        if b"connection: close" in lower:
            w.close()
            self.w = None
        return ttft or (time.perf_counter() - t0), time.perf_counter() - t0, ok


def pct(vals: list[float], q: float) -> float | None:
    if not vals:
        return None
    v = sorted(vals)
    k = (len(v) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(ttfts: list[float], totals: list[float], errors: int, window: float) -> dict:
    ms = lambda x: None if x is None else round(x * 1000, 3)  # noqa: E731
    return {
        "count": len(ttfts),
        "errors": errors,
        "req_per_s": round(len(ttfts) / window, 1) if window > 0 else None,
        "ttft_p50_ms": ms(pct(ttfts, 0.5)),
        "ttft_p99_ms": ms(pct(ttfts, 0.99)),
        "latency_p50_ms": ms(pct(totals, 0.5)),
        "latency_p99_ms": ms(pct(totals, 0.99)),
    }


async def closed_loop(
    port: int, concurrency: int, duration: float, stream: bool, max_tokens: int, warmup: float
) -> dict:
    req = request_bytes(port, stream, max_tokens)
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + duration

    async def worker() -> None:
        nonlocal errors
        c = Conn(port)
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            try:
                ttft, total, ok = await asyncio.wait_for(c.exchange(req, t0), 60)
            except (OSError, asyncio.IncompleteReadError, ValueError, TimeoutError):
                c = Conn(port)
                ok, ttft, total = False, 0.0, 0.0
            if t0 >= t_measure:
                if ok:
                    ttfts.append(ttft)
                    totals.append(total)
                else:
                    errors += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(ttfts, totals, errors, duration)


async def poisson(port: int, rate: float, duration: float, max_tokens: int, drain: float, seed: int) -> dict:
    rng = random.Random(seed)
    req = request_bytes(port, True, max_tokens)
    ttfts: list[float] = []
    totals: list[float] = []
    errors = 0
    pool: list[Conn] = []
    t0 = time.perf_counter()
    tasks = []

    async def one(at: float) -> None:
        nonlocal errors
        c = pool.pop() if pool else Conn(port)
        try:
            ttft, total, ok = await c.exchange(req, at)  # clock starts at the scheduled arrival
        except (OSError, asyncio.IncompleteReadError, ValueError):
            errors += 1
            return
        pool.append(c)
        if ok:
            ttfts.append(ttft)
            totals.append(total)
        else:
            errors += 1

    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(t0 + t)))
    _done, pending = await asyncio.wait(tasks, timeout=drain)
    for p in pending:
        p.cancel()
    last = time.perf_counter() - t0
    res = summarize(ttfts, totals, errors, last)
    res["incomplete"] = len(pending)
    res["offered"] = len(tasks)
    return res


# ---------------------------------------------------------------------------- scenarios
NGINX_CONF = """\
worker_processes {workers};
daemon off;
master_process on;
pid {rundir}/nginx.pid;
error_log {rundir}/nginx.error.log warn;
worker_rlimit_nofile 65536;
events {{ worker_connections 16384; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {rundir}/nginx-tmp/body;
  proxy_temp_path {rundir}/nginx-tmp/proxy;
  fastcgi_temp_path {rundir}/nginx-tmp/fastcgi;
  uwsgi_temp_path {rundir}/nginx-tmp/uwsgi;
  scgi_temp_path {rundir}/nginx-tmp/scgi;
  keepalive_requests 1000000;
  upstream engines {{ server 127.0.0.1:{upstream} max_fails=0; keepalive 256; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def start_floor(rundir: Path, upstream: int) -> dict[str, tuple[int, Proc]]:
    """The two references of --floor: a bare uvloop byte relay and nginx (when installed),
    both with the shared peers harness's nginx settings (keep-alive upstream, no buffering)."""
    import shutil

    out: dict[str, tuple[int, Proc]] = {}
    port = free_port()
    out["relay"] = (port, Proc([sys.executable, str(ROOT / "bench" / "relay.py"), "--port", str(port),
                                "--upstream", f"127.0.0.1:{upstream}"], rundir / "relay.log"))  # fmt: skip
    wait_port(port)
    nginx = shutil.which("nginx", path="/usr/sbin:/usr/bin:/sbin:/bin") or shutil.which("nginx")
    if nginx:
        port = free_port()
        (rundir / "nginx-tmp").mkdir(exist_ok=True)
        conf = rundir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(workers="auto", rundir=rundir, port=port, upstream=upstream))
        out["nginx"] = (port, Proc([nginx, "-p", str(rundir), "-e", str(rundir / "nginx.error.log"), "-c", str(conf)],
                                   rundir / "nginx.log"))  # fmt: skip
        wait_port(port)
    else:
        print("  --floor: nginx not installed, only the bare relay", file=sys.stderr)
    return out


def run_overhead(a: argparse.Namespace, rundir: Path) -> dict:
    eport, rport = free_port(), free_port()
    eng = start_engine(rundir, eport, capacity=1_000_000, delay_ms=0, tokens=32)
    router = start_router(rundir, rport, [eport])
    proxies: dict[str, tuple[int, Proc]] = {"clusterctl": (rport, router)}
    out: dict = {"cells": {}}
    try:
        if a.floor:
            proxies.update(start_floor(rundir, eport))
        scen = {"c1_stream": (1, True, 32), "c64_stream": (64, True, 32), "c64_short": (64, False, 4)}
        order = [("direct", eport, None)] + [(name, port, proc) for name, (port, proc) in proxies.items()]
        for name, (conc, stream, mt) in scen.items():
            for rnd in range(a.rounds):
                for target, port, proc in order if rnd % 2 == 0 else order[::-1]:
                    c0 = proc.cpu_s() if proc else 0.0
                    res = asyncio.run(closed_loop(port, conc, a.duration, stream, mt, a.warmup))
                    if proc is not None and res["count"]:
                        cpu = proc.cpu_s() - c0
                        res["router_cpu_ms_per_req"] = round(cpu * 1000 / (res["count"] + res["errors"]), 4)
                    out["cells"].setdefault(name, {}).setdefault(target, []).append(res)
                    print(f"  {name:10s} {target:10s} round {rnd}: {res}", file=sys.stderr)
    finally:
        for _, proc in proxies.values():
            proc.stop()
        eng.stop()
    table = {}
    for name, by in out["cells"].items():
        row: dict = {}
        for target, runs in by.items():
            row[target] = {
                "ttft_p50_ms": _median(r["ttft_p50_ms"] for r in runs),
                "ttft_p99_ms": _median(r["ttft_p99_ms"] for r in runs),
                "req_per_s": _median(r["req_per_s"] for r in runs),
                "errors": sum(r["errors"] for r in runs),
                "router_cpu_ms_per_req": _median(r.get("router_cpu_ms_per_req") for r in runs),
            }
        d = row["direct"]
        for target in proxies:
            c = row[target]
            c["added_ttft_p50_ms"] = _sub(c["ttft_p50_ms"], d["ttft_p50_ms"])
            c["added_ttft_p99_ms"] = _sub(c["ttft_p99_ms"], d["ttft_p99_ms"])
            c["req_per_s_ratio"] = round(c["req_per_s"] / d["req_per_s"], 3) if d["req_per_s"] else None
        c = row["clusterctl"]
        row["added_ttft_p50_ms"] = c["added_ttft_p50_ms"]
        row["added_ttft_p99_ms"] = c["added_ttft_p99_ms"]
        row["req_per_s_ratio"] = c["req_per_s_ratio"]
        table[name] = row
    out["table"] = table
    out["proxies"] = list(proxies)
    return out


def run_balance(a: argparse.Namespace, rundir: Path) -> dict:
    fast_cap, fast_ms = (int(x) if i == 0 else float(x) for i, x in enumerate(a.fast.split(":")))
    slow_cap, slow_ms = (int(x) if i == 0 else float(x) for i, x in enumerate(a.slow.split(":")))
    specs = [(fast_cap, fast_ms), (fast_cap, fast_ms), (slow_cap, slow_ms), (slow_cap, slow_ms)]
    capacity = sum(c / (a.tokens * ms / 1000.0) for c, ms in specs)
    rate = a.load * capacity
    out: dict = {"fleet_capacity_req_s": round(capacity, 2), "rate_req_s": round(rate, 2), "runs": {}}
    for policy in a.policies.split(","):
        eports = [free_port() for _ in specs]
        engines = [
            start_engine(rundir, p, capacity=c, delay_ms=ms, tokens=a.tokens)
            for p, (c, ms) in zip(eports, specs, strict=True)
        ]
        rport = free_port()
        router = start_router(rundir, rport, eports, policy)
        try:
            time.sleep(1.0)  # first scrapes
            res = asyncio.run(poisson(rport, rate, a.duration, a.tokens, a.drain, a.seed))
            served = [_served(p) for p in eports]
            res["slow_share"] = round(sum(served[2:]) / max(1, sum(served)), 3)
            out["runs"][policy] = res
            print(f"  balance {policy:12s}: {res}", file=sys.stderr)
        finally:
            router.stop()
            for e in engines:
                e.stop()
    return out


def _served(port: int) -> float:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("sim_requests_served_total"):
                    return float(line.split()[-1])
    except OSError:
        pass
    return 0.0


def _median(xs) -> float | None:
    v = sorted(x for x in xs if x is not None)
    if not v:
        return None
    m = len(v) // 2
    return round(v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2, 3)


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def machine() -> dict:
    info: dict = {"nproc": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def print_tables(res: dict) -> None:
    if "overhead" in res:
        print("\n## overhead (ms; added = proxy - direct, medians over rounds)")
        print(
            "| scenario | proxy | direct p50/p99 | proxy p50/p99 | added p50/p99 | req/s direct / proxy (ratio) | proxy CPU ms/req |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, row in res["overhead"]["table"].items():
            d = row["direct"]
            for target in res["overhead"].get("proxies", ["clusterctl"]):
                c = row[target]
                print(
                    f"| {name} | {target} | {d['ttft_p50_ms']} / {d['ttft_p99_ms']} | {c['ttft_p50_ms']} / "
                    f"{c['ttft_p99_ms']} | {c['added_ttft_p50_ms']} / {c['added_ttft_p99_ms']} | {d['req_per_s']} / "
                    f"{c['req_per_s']} ({c['req_per_s_ratio']}) | {c['router_cpu_ms_per_req']} |"
                )
    if "balance" in res:
        b = res["balance"]
        print(f"\n## balance (fleet {b['fleet_capacity_req_s']} req/s, offered {b['rate_req_s']} req/s Poisson)")
        print(
            "| policy | completed | errors | incomplete | req/s | TTFT p50 | TTFT p99 | latency p99 | slow share | p99 vs least_load |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        base = b["runs"].get("least_load", {}).get("ttft_p99_ms")
        for pol, r in b["runs"].items():
            ratio = round(r["ttft_p99_ms"] / base, 2) if base and r["ttft_p99_ms"] else None
            print(
                f"| {pol} | {r['count']} | {r['errors']} | {r['incomplete']} | {r['req_per_s']} | {r['ttft_p50_ms']} | "
                f"{r['ttft_p99_ms']} | {r['latency_p99_ms']} | {r['slow_share']} | {ratio} |"
            )


def run_peers(a: argparse.Namespace) -> int:
    """The shared peers harness, unmodified, from a scratch copy, with clusterctl on PATH."""
    import shutil

    src = Path(a.peers_dir) if a.peers_dir else ROOT.parent / "shared" / "bench-peers"
    if not (src / "peers.sh").is_file():
        print(f"bench/router.py peers: no peers harness at {src} (give --peers-dir)", file=sys.stderr)
        return 2
    cc = shutil.which("clusterctl", path=str(Path(sys.executable).parent)) or shutil.which("clusterctl")
    if cc is None:
        print("bench/router.py peers: clusterctl is not installed (make venv)", file=sys.stderr)
        return 2
    env = dict(os.environ, PATH=f"{Path(cc).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = Path(tmp) / "bench-peers"
        shutil.copytree(src, work, ignore=shutil.ignore_patterns("results-*.json", "__pycache__"))
        for p in (work, *work.rglob("*")):  # the source may be read-only; the copy is ours
            p.chmod(p.stat().st_mode | 0o200)
        if a.install and subprocess.run(["bash", "peers.sh", "install"], cwd=work, env=env).returncode:
            return 1
        args = ["--duration", str(a.duration or (5.0 if a.peers_test == "overhead" else 60.0))]
        args += ["--rounds", str(a.rounds)] if a.peers_test == "overhead" else ["--load", str(a.load)]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = (
            Path(a.out).resolve() if a.out else Path(tempfile.gettempdir()) / f"bench-peers-{a.peers_test}-{stamp}.json"
        )
        print(f"peers harness: {src} (copied to {work}); clusterctl: {cc}", flush=True)
        rc = subprocess.run(["bash", "peers.sh", a.peers_test, *args, "--out", str(out)], cwd=work, env=env).returncode
        if rc == 0:
            print(f"wrote {out}")
        return rc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["overhead", "balance", "all", "peers"])
    ap.add_argument("--duration", type=float, default=None, help="seconds per cell (overhead 5, balance 60)")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fast", default="8:10", help="capacity:token_delay_ms of the 2 fast engines")
    ap.add_argument("--slow", default="4:30", help="capacity:token_delay_ms of the 2 slow engines")
    ap.add_argument("--drain", type=float, default=20.0)
    ap.add_argument("--policies", default="least_load,p2c,round_robin")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the JSON results here")
    ap.add_argument("--peers-test", choices=["overhead", "balance"], default="overhead", help="peers: which test")
    ap.add_argument(
        "--peers-dir", default=None, help="peers: the harness (default: shared/bench-peers beside the repo)"
    )
    ap.add_argument("--install", action="store_true", help="peers: install nginx and the peers' venvs first")
    ap.add_argument("--floor", action="store_true",
                    help="overhead: also a bare uvloop byte relay (bench/relay.py) and nginx, in the same rounds")  # fmt: skip
    a = ap.parse_args(argv)
    if a.what == "peers":
        sys.exit(run_peers(a))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "params": vars(a)}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        rundir = Path(tmp)
        if a.what in ("overhead", "all"):
            a.duration = a.duration or 5.0
            res["overhead"] = run_overhead(a, rundir)
            a.duration = None if a.what == "all" else a.duration
        if a.what in ("balance", "all"):
            a.duration = a.duration or 60.0
            res["balance"] = run_balance(a, rundir)
    res["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print_tables(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
