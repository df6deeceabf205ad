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

4. failover: per contender 2 fresh engines (256-token replies at 8 ms a token), 64 closed-loop
   streams for --duration (20 s) and one engine SIGKILLed at --kill-at (8 s): clusterctl (a cut
   stream continued on the other replica), clusterctl with ``resume: false``, and the peers
   harness's nginx, vllm-router and LiteLLM (imported from a scratch copy; each skipped when
   not installed). Failed requests, streams resumed and seamless (the whole text equal to an
   uncut reply's), the seam (largest gap between two chunks of a resumed stream; the router's
   ``clusterctl_router_seam_seconds``), and a fresh request's TTFT on the surviving engine.

    python bench/router.py failover
    python bench/router.py failover --contenders clusterctl,nginx --router-yaml "{resume_limit: 1}"
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


def start_engine(rundir: Path, port: int, *, capacity: int, delay_ms: float, tokens: int, model: str = MODEL) -> Proc:
    argv = [sys.executable, str(SIMENGINE), "--port", str(port), "--model", model, "--capacity", str(capacity),
            "--token-delay-ms", str(delay_ms), "--tokens", str(tokens)]  # fmt: skip
    p = Proc(argv, rundir / f"engine-{port}.log")
    wait_port(port)
    return p


def start_router(
    rundir: Path,
    port: int,
    engine_ports: list[int],
    policy: str = "least_load",
    *,
    resume: bool = True,
    router_yaml: str = "",
) -> Proc:
    cfg = rundir / f"router-{port}.yaml"
    eps = "\n".join(
        f'      - {{url: "http://127.0.0.1:{p}", engine: vllm, replica: e{i}}}' for i, p in enumerate(engine_ports)
    )
    off = "" if resume else "    resume: false\n"
    extra = f"router: {router_yaml}\n" if router_yaml else ""
    cfg.write_text(f"engines:\n  vllm: {{metrics: {{}}}}\nmodels:\n  {MODEL}:\n{off}    endpoints:\n{eps}\n{extra}")
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

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The kept-alive connection, opened when there is none (no Nagle delay on it)."""
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
            self.w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self.r is not None
        return self.r, self.w

    async def exchange(self, req: bytes, t0: float) -> tuple[float, float, bool]:
        r, w = await self._open()
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


# ---------------------------------------------------------------------------- failover
FAILOVER_CONTENDERS = ("clusterctl", "clusterctl-noresume", "nginx", "vllm-router", "litellm")


class SSEConn(Conn):
    """One keep-alive connection for streamed chat completions, read event by event.

    ``stream`` returns what the client saw of one response: status, text, content chunks,
    finish reasons, [DONE], error events, the largest gap between two content chunks, and
    whether (and when) the simulated engine's continuation marker ``sim_continued_from``
    arrived: the router keeps a continuation's extra fields, so a resumed stream shows it.
    """

    def __init__(self, port: int, auth: str | None = None) -> None:
        super().__init__(port)
        self.auth = auth

    def request(self, model: str, max_tokens: int) -> bytes:
        body = json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": max_tokens}
        ).encode()
        auth = b"Authorization: Bearer %b\r\n" % self.auth.encode() if self.auth else b""
        return (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"%bContent-Length: %d\r\n\r\n%b" % (self.port, auth, len(body), body)
        )

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.w = self.r = None

    async def stream(self, req: bytes, rec: dict) -> None:
        """Fill ``rec`` as the response comes; raises on a connection error (``rec`` keeps what came)."""
        r, w = await self._open()
        w.write(req)
        head = await r.readuntil(b"\r\n\r\n")
        rec["status"] = int(head[9:12])
        lower = head.lower()
        if b"transfer-encoding: chunked" not in lower:
            clen = int(lower.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in lower else 0
            rec["body"] = (await r.readexactly(clen))[:300].decode("utf-8", "replace")
            if b"connection: close" in lower or b"content-length:" not in lower:
                self.close()
            return
        buf = b""
        sse = b""
        while True:
            while (i := buf.find(b"\r\n")) < 0:
                buf += await self._more(r)
            size = int(buf[:i].split(b";")[0], 16)
            if size == 0:
                while len(buf) < i + 4:
                    buf += await self._more(r)
                break
            need = i + 2 + size + 2
            while len(buf) < need:
                buf += await self._more(r)
            sse += buf[i + 2 : i + 2 + size]
            buf = buf[need:]
            if b"\r" in sse:
                sse = sse.replace(b"\r\n", b"\n")
            *events, sse = sse.split(b"\n\n")
            if events:
                _sse_events(events, rec, time.perf_counter())
        if b"connection: close" in lower:
            self.close()

    @staticmethod
    async def _more(r: asyncio.StreamReader) -> bytes:
        data = await r.read(65536)
        if not data:
            raise asyncio.IncompleteReadError(b"", None)
        return data


def _sse_events(events: list[bytes], rec: dict, now: float) -> None:
    for ev in events:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec["done"] += 1
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                rec["unreadable"] += 1
                continue
            choices = obj.get("choices") if isinstance(obj, dict) else None
            if not isinstance(obj, dict) or ("error" in obj and not choices):
                rec["errors"] += 1
                continue
            if "sim_continued_from" in obj and rec["resumed_at"] is None:
                rec["resumed_at"] = now
            if not choices:
                continue
            ch = choices[0]
            delta = ch.get("delta") or {}
            piece = delta.get("content") if isinstance(delta, dict) else None
            piece = piece if piece is not None else ch.get("text")
            if piece:
                rec["text"].append(piece)
                last = rec["last"]
                if last is None:
                    rec["first"] = now
                elif now - last > rec["gap"]:
                    rec["gap"] = now - last
                rec["last"] = now
            if ch.get("finish_reason"):
                rec["finish"] += 1


def _new_record(t0: float) -> dict:
    return {"t0": t0, "status": None, "text": [], "first": None, "last": None, "gap": 0.0, "finish": 0, "done": 0,
            "errors": 0, "unreadable": 0, "resumed_at": None, "exc": None}  # fmt: skip


async def _one_stream(conn: SSEConn, req: bytes, timeout: float) -> dict:
    rec = _new_record(time.perf_counter())
    try:
        await asyncio.wait_for(conn.stream(req, rec), timeout)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as e:
        rec["exc"] = type(e).__name__
        conn.close()
    rec["end"] = time.perf_counter()
    return rec


def _verdict(rec: dict, tokens: int) -> str | None:
    """Why a stream failed, or None: the client saw an error, no finish_reason, no [DONE], or
    another count of tokens (content chunks: the simulated engine sends one token a chunk)."""
    if rec["exc"] is not None:
        return "connection"
    if rec["status"] != 200:
        return f"HTTP {rec['status']}"
    if rec["errors"] or rec["unreadable"]:
        return "error event"
    if rec["finish"] != 1:
        return "no finish_reason" if not rec["finish"] else f"finish_reason x{rec['finish']}"
    if rec["done"] != 1:
        return "no [DONE]" if not rec["done"] else f"[DONE] x{rec['done']}"
    if len(rec["text"]) != tokens:
        return f"tokens {len(rec['text'])}"
    return None


async def _get(port: int, path: str) -> str:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"GET %b HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n" % path.encode())
        data = await asyncio.wait_for(r.read(), 5)
    finally:
        w.close()
    return data.split(b"\r\n\r\n", 1)[-1].decode("utf-8", "replace")


def _prom(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text: name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        lab = dict(kv.split("=", 1) for kv in labels.rstrip("}").split(",") if "=" in kv)
        out.setdefault(name, []).append(({k: v.strip('"') for k, v in lab.items()}, float(value)))
    return out


def _hist_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """A quantile of a Prometheus histogram (cumulative (le, count) pairs), as histogram_quantile does."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_bound
            return lo_bound + (le - lo_bound) * ((rank - lo_count) / max(count - lo_count, 1e-12))
        lo_bound, lo_count = le, count
    return lo_bound


def _router_resume_metrics(text: str) -> dict:
    m = _prom(text)
    name = "clusterctl_router_seam_seconds"
    buckets = [(float(lab["le"]), v) for lab, v in m.get(name + "_bucket", []) if lab.get("model") == MODEL]
    count = sum(v for lab, v in m.get(name + "_count", []) if lab.get("model") == MODEL)
    total = sum(v for lab, v in m.get(name + "_sum", []) if lab.get("model") == MODEL)
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    fails: dict[str, int] = {}
    for lab, v in m.get("clusterctl_router_resume_failures_total", []):
        if v:
            fails[lab.get("reason", "")] = fails.get(lab.get("reason", ""), 0) + int(v)
    return {
        "resumed": int(sum(v for _, v in m.get("clusterctl_router_requests_resumed_total", []))),
        "resume_failures": fails,
        "cut": int(sum(v for _, v in m.get("clusterctl_router_responses_cut_total", []))),
        "seam_count": int(count),
        "seam_mean_ms": ms(total / count) if count else None,
        "seam_p50_ms": ms(_hist_quantile(buckets, 0.5)),
        "seam_p99_ms": ms(_hist_quantile(buckets, 0.99)),
    }


def _load_peers(a: argparse.Namespace, rundir: Path):
    """The shared harness's peers.py, imported from a scratch copy (None when it is absent)."""
    import importlib.util
    import shutil

    src = Path(a.peers_dir) if a.peers_dir else ROOT.parent / "shared" / "bench-peers"
    if not (src / "peers.py").is_file():
        return None
    work = rundir / "bench-peers"
    if not work.exists():
        shutil.copytree(src, work, ignore=shutil.ignore_patterns("results-*.json", "__pycache__"))
        for p in (work, *work.rglob("*")):  # the source may be read-only; the copy is ours
            p.chmod(p.stat().st_mode | 0o200)
    spec = importlib.util.spec_from_file_location("bench_peers", work / "peers.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _peer_missing(peers, name: str) -> str | None:
    if peers is None:
        return "the shared peers harness is not there (give --peers-dir)"
    path = {"nginx": peers.NGINX, "vllm-router": peers.VLLM_ROUTER, "litellm": peers.LITELLM}[name]
    if not os.path.exists(path):
        return f"not installed ({path}; python bench/router.py peers --install, or peers.sh install)"
    return None


async def _failover_load(
    port: int, auth: str | None, model: str, a: argparse.Namespace, victim: Proc, victim_port: int, survivor: int
) -> dict:
    """64 closed-loop streams for a.duration; at a.kill_at the victim engine is SIGKILLed; from then
    on fresh short streams straight to the survivor measure its time to first token."""
    records: list[dict] = []
    probes: list[float] = []
    t_start = time.perf_counter()
    t_end = t_start + a.duration
    info: dict = {}

    async def worker() -> None:
        conn = SSEConn(port, auth)
        req = conn.request(model, a.stream_tokens)
        while time.perf_counter() < t_end:
            rec = await _one_stream(conn, req, a.request_timeout)
            records.append(rec)
            if _verdict(rec, a.stream_tokens) is not None:
                await asyncio.sleep(0.1)  # a client's pause before it tries again: no storm of instant failures
        conn.close()

    async def killer() -> None:
        await asyncio.sleep(a.kill_at)
        try:
            m = _prom(await _get(victim_port, "/metrics"))
            info["victim_running"] = int(sum(v for _, v in m.get("vllm:num_requests_running", [])))
        except OSError:
            info["victim_running"] = None
        os.killpg(victim.p.pid, signal.SIGKILL)
        info["t_kill"] = time.perf_counter()
        conn = SSEConn(survivor)
        req = conn.request(model, 4)
        while time.perf_counter() < t_end:
            await asyncio.sleep(0.1)
            rec = await _one_stream(conn, req, 10)
            if rec["first"] is not None:
                probes.append(rec["first"] - rec["t0"])
        conn.close()

    tasks = [asyncio.ensure_future(worker()) for _ in range(a.streams)]
    await killer()
    _done, pending = await asyncio.wait(tasks, timeout=a.request_timeout + 5)
    for t in pending:
        t.cancel()
    info.update(records=records, probes=probes, t_start=t_start, incomplete=len(pending))
    return info


def _failover_summary(info: dict, expected: str, tokens: int) -> dict:
    ms = lambda x: None if x is None else round(x * 1000, 1)  # noqa: E731
    t_kill = info["t_kill"]
    failed: dict[str, int] = {}
    fail_cut = fail_new = resumed = seamless = wrong_text = 0
    gaps: list[float] = []
    from_kill: list[float] = []
    ttft_after: list[float] = []
    for rec in info["records"]:
        why = _verdict(rec, tokens)
        text = "".join(rec["text"])
        if why is not None:
            failed[why] = failed.get(why, 0) + 1
            if rec["t0"] < t_kill:
                fail_cut += 1
            else:
                fail_new += 1
        elif text != expected:
            wrong_text += 1
        if rec["resumed_at"] is not None:
            resumed += 1
            seamless += why is None and text == expected
            gaps.append(rec["gap"])
            from_kill.append(rec["resumed_at"] - t_kill)
        if rec["t0"] >= t_kill and rec["first"] is not None:
            ttft_after.append(rec["first"] - rec["t0"])
    n_failed = sum(failed.values())
    return {
        "requests": len(info["records"]),
        "ok": len(info["records"]) - n_failed,
        "failed": n_failed,
        "failed_started_before_kill": fail_cut,
        "failed_started_after_kill": fail_new,
        "failed_why": failed,
        "incomplete": info["incomplete"],
        "victim_running_at_kill": info.get("victim_running"),
        "resumed": resumed,
        "seamless": seamless,
        "wrong_text_not_failed": wrong_text,
        "seam_gap_p50_ms": ms(pct(gaps, 0.5)),
        "seam_gap_p99_ms": ms(pct(gaps, 0.99)),
        "seam_gap_max_ms": ms(max(gaps) if gaps else None),
        "seam_from_kill_p50_ms": ms(pct(from_kill, 0.5)),
        "seam_from_kill_p99_ms": ms(pct(from_kill, 0.99)),
        "survivor_ttft_p50_ms": ms(pct(info["probes"], 0.5)),
        "survivor_ttft_p99_ms": ms(pct(info["probes"], 0.99)),
        "probes": len(info["probes"]),
        "ttft_after_kill_p50_ms": ms(pct(ttft_after, 0.5)),
    }


def run_failover(a: argparse.Namespace, rundir: Path) -> dict:
    """Per contender: 2 fresh engines, the proxy, 64 closed-loop streams, one engine SIGKILLed."""
    wanted = [c.strip() for c in a.contenders.split(",") if c.strip()]
    if not 0 < a.kill_at < a.duration:
        raise SystemExit("bench/router.py failover: --kill-at must fall inside --duration")
    peers = _load_peers(a, rundir) if any(c in ("nginx", "vllm-router", "litellm") for c in wanted) else None
    out: dict = {"runs": {}, "skipped": {}, "params": {
        "streams": a.streams, "tokens": a.stream_tokens, "token_delay_ms": a.token_delay_ms,
        "duration_s": a.duration, "kill_at_s": a.kill_at, "router_yaml": a.router_yaml}}  # fmt: skip
    if peers is not None:
        out["peer_versions"] = {k: v for k, v in peers.versions().items() if k in ("nginx", "vllm-router", "litellm")}
    for name in wanted:
        if name not in FAILOVER_CONTENDERS:
            raise SystemExit(f"bench/router.py failover: unknown contender {name!r} (of {FAILOVER_CONTENDERS})")
        peer = name in ("nginx", "vllm-router", "litellm")
        if peer and (why := _peer_missing(peers, name)):
            out["skipped"][name] = why
            print(f"  failover {name}: skipped: {why}", file=sys.stderr)
            continue
        model = peers.MODEL if peer else MODEL
        eports = [free_port(), free_port()]
        engines = [
            start_engine(rundir, p, capacity=4 * a.streams, delay_ms=a.token_delay_ms, tokens=a.stream_tokens,
                         model=model)
            for p in eports
        ]  # fmt: skip
        proxy = None
        try:
            ref = asyncio.run(_reference(eports[1], model, a.stream_tokens))
            expected = "".join(ref["text"])
            assert _verdict(ref, a.stream_tokens) is None, f"the engine's own stream: {ref}"
            port = free_port()
            auth = None
            if name.startswith("clusterctl"):
                proxy = start_router(rundir, port, eports, resume=name == "clusterctl", router_yaml=a.router_yaml)
                time.sleep(1.0)  # first scrapes and health checks
            elif name == "nginx":
                proxy = peers.start_nginx(str(rundir), port, eports)
            elif name == "vllm-router":
                proxy = peers.start_vllm_router(str(rundir), port, eports, policy="round_robin")
            else:
                proxy = peers.start_litellm(str(rundir), port, eports, workers=os.cpu_count() or 1)
                auth = peers.LITELLM_KEY
            info = asyncio.run(_failover_load(port, auth, model, a, engines[0], eports[0], eports[1]))
            res = _failover_summary(info, expected, a.stream_tokens)
            if name.startswith("clusterctl"):
                res["router"] = _router_resume_metrics(asyncio.run(_get(port, "/metrics")))
            out["runs"][name] = res
            print(f"  failover {name}: {json.dumps(res)}", file=sys.stderr)
        finally:
            if proxy is not None:
                proxy.stop()
            for e in engines:
                e.stop()
    return out


async def _reference(port: int, model: str, tokens: int) -> dict:
    """One uncut stream straight from an engine: the text every stream must end up with."""
    conn = SSEConn(port)
    rec = await _one_stream(conn, conn.request(model, tokens), 30)
    conn.close()
    return rec


def _target(r: dict) -> str:
    """Target: no failed request, seam p99 < 200 ms + the survivor's TTFT p50."""
    if r["failed"]:
        return f"no ({r['failed']} failed)"
    if not r["resumed"]:
        return "no stream resumed" if r["incomplete"] == 0 else "no"
    limit = 200 + (r["survivor_ttft_p50_ms"] or 0)
    return ("met" if r["seam_gap_p99_ms"] < limit else "no") + f" (p99 {r['seam_gap_p99_ms']} < {limit:.0f} ms)"


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
    if "failover" in res:
        print_failover(res["failover"])


def print_failover(f: dict) -> None:
    p = f["params"]
    print(
        f"\n## failover ({p['streams']} streams of {p['tokens']} tokens at {p['token_delay_ms']} ms a token, "
        f"{p['duration_s']} s, one of 2 engines SIGKILLed at {p['kill_at_s']} s; ms)"
    )
    print(
        "| contender | requests | failed (started before / after the kill) | on the victim at the kill | resumed "
        "(router) | seamless | seam p50 / p99 (client) | router seam p50 / p99 (mean) | survivor TTFT p50 | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in f["runs"].items():
        rt = r.get("router")
        routed = f" ({rt['resumed']})" if rt else ""
        rseam = f"{rt['seam_p50_ms']} / {rt['seam_p99_ms']} ({rt['seam_mean_ms']})" if rt and rt["seam_count"] else "-"
        seam = f"{r['seam_gap_p50_ms']} / {r['seam_gap_p99_ms']}" if r["resumed"] else "-"
        print(
            f"| {name} | {r['requests']} | {r['failed']} ({r['failed_started_before_kill']} / "
            f"{r['failed_started_after_kill']}) | {r['victim_running_at_kill']} | {r['resumed']}{routed} | "
            f"{r['seamless']} | {seam} | {rseam} | {r['survivor_ttft_p50_ms']} | {_target(r)} |"
        )
    for name, why in f["skipped"].items():
        print(f"| {name} | skipped: {why} |||||||||")


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
    ap.add_argument("what", choices=["overhead", "balance", "failover", "all", "peers"])
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds per cell (overhead 5, balance 60, failover 20)"
    )
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
    ap.add_argument("--streams", type=int, default=64, help="failover: concurrent streams")
    ap.add_argument("--stream-tokens", type=int, default=256, help="failover: tokens per stream")
    ap.add_argument("--token-delay-ms", type=float, default=8.0, help="failover: the engines' time per token")
    ap.add_argument("--kill-at", type=float, default=8.0, help="failover: seconds into the run the engine is killed")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="failover: a stream's limit")
    ap.add_argument("--router-yaml", default="", help="failover: clusterctl's router section, a YAML flow mapping")
    ap.add_argument("--contenders", default=",".join(FAILOVER_CONTENDERS), help="failover: which, in this order")
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
    given = a.duration
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        rundir = Path(tmp)
        if a.what in ("overhead", "all"):
            a.duration = given or 5.0
            res["overhead"] = run_overhead(a, rundir)
        if a.what in ("balance", "all"):
            a.duration = given or 60.0
            res["balance"] = run_balance(a, rundir)
        if a.what in ("failover", "all"):
            a.duration = given or 20.0
            res["failover"] = run_failover(a, rundir)
    res["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    print_tables(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
