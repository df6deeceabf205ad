#!/usr/bin/env python3
"""Prefix affinity: clusterctl's ``prefix`` policy against ``least_load``, ``round_robin`` and
the cache-aware policies of vllm-router and sglang-router, on engines with a prefix cache.

Per workload and contender: 4 fresh simulated engines (tests/simengine.py with its prefix
cache: an LRU of ``--cache-tokens`` per engine, ``--prefill-ms-per-1k`` for each uncached
prompt token, chunked beside the decoding), then the router in front of them. Before the
router starts, each engine gets the workload's shared prompt once, straight (``--no-warm``:
not), so that a run measures routing in steady state rather than each engine's first prefill.

1. multiturn: ``--conversations`` conversations of ``--turns`` turns over one shared system
   prompt of ``--system-chars`` (4 characters a token), ``--concurrency`` at a time, each turn
   sent when the previous answer is in. Prompt tokens the engines processed per request
   (``usage.prompt_tokens`` - ``prompt_tokens_details.cached_tokens``), cache-hit ratio,
   TTFT p50/p99, requests per second.
2. hot: Poisson arrivals at ``--hot-load`` of the fleet's capacity for ``--hot-seconds``;
   ``--hot-share`` of the requests share one prefix of ``--hot-chars``, then a unique
   question; the rest are unique. TTFT p50/p99, the busiest replica's share of requests, the
   largest spread of requests on the engines (running + waiting, sampled every 0.25 s).
3. unique: no shared prefix, ``--unique-concurrency`` closed-loop streams for
   ``--unique-seconds``: requests per second and TTFT against least_load's. Then
   ``--rss-seconds`` of unique long prompts through ``prefix`` alone (fast engines, no cache),
   the router's RSS (VmRSS) sampled every second.
4. llama: 4 ``llama-server`` replicas of the tiny test model (tests/gguf_tiny.py), the
   multiturn workload scaled down, non-streamed, tokens counted from each response's
   ``timings.cache_n`` and ``timings.prompt_n``; once with the engines set as a loaded GPU
   engine behaves (no host prompt cache, 4 slots, ``--llama-sps``), once with their defaults
   for those (host prompt cache on).

    python bench/prefix.py all --out prefix.json
    python bench/prefix.py multiturn --conversations 128 --concurrency 32
    python bench/prefix.py hot --variant "abs8={prefix: {balance_abs: 8}}"
    python bench/prefix.py multiturn --router-yaml "{prefix: {min_match_chars: 1024}}"

Every process is started here in its own process group and stopped by it; everything
listens on 127.0.0.1. A peer that is not installed is skipped with a line saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import router as rb  # bench/router.py: processes, ports, percentiles, Prometheus text
from benchlib import Sampler

ROOT = rb.ROOT
MODEL = rb.MODEL
VENVS = Path(os.environ.get("BENCH_VENVS", "/opt/benchvenv"))
VLLM_ROUTER = VENVS / "vllm-router" / "bin" / "vllm-router"
SGLANG_PY = VENVS / "sglang-router" / "bin" / "python"
CONTENDERS = ("least_load", "round_robin", "prefix", "vllm-router", "sglang-router")
CLUSTERCTL = ("least_load", "round_robin", "prefix")
# Words of the tiny test model's vocabulary (tests/gguf_tiny.py); it still reads about a character a token.
_VOCAB = ("the of and to in is it that was for on are as with be at by this from or have an they which one you all "
          "were her she there would their we him been has when who will more no if out so said what up its")  # fmt: skip
WORDS = tuple(_VOCAB.split())


def text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


# ---------------------------------------------------------------------------- client
class Client:
    """One keep-alive HTTP/1.1 connection for chat completions, streamed or not.

    ``post`` returns what the client saw: ok, status, ttft (first text; a whole response's
    latency when not streamed), latency, the text, and the ``usage`` and ``timings`` the
    response carried (a stream's from any chunk)."""

    def __init__(self, port: int, headers: dict[str, str] | None = None) -> None:
        self.port = port
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None

    async def post(self, body: dict, t0: float | None = None, timeout: float = 120.0, headers: bytes = b"") -> dict:
        t0 = time.perf_counter() if t0 is None else t0
        rec: dict = {"ok": False, "status": None, "ttft": None, "latency": None, "text": "", "usage": None,
                     "timings": None, "why": None}  # fmt: skip
        try:
            await asyncio.wait_for(self._exchange(body, t0, rec, headers), timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as e:
            rec["why"] = type(e).__name__
            self.close()
        rec["latency"] = time.perf_counter() - t0
        if rec["why"] is None and rec["status"] != 200:
            rec["why"] = f"HTTP {rec['status']}"
        elif rec["why"] is None and not rec["text"]:
            rec["why"] = "no text"
        rec["ok"] = rec["why"] is None
        return rec

    async def _exchange(self, body: dict, t0: float, rec: dict, headers: bytes) -> None:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 22)
            self.w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        r, w = self.r, self.w
        data = json.dumps(body).encode()
        w.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"%b%bContent-Length: %d\r\n\r\n%b" % (self.headers, headers, len(data), data)
        )
        head = await r.readuntil(b"\r\n\r\n")
        rec["status"] = int(head[9:12])
        lower = head.lower()
        stream = b"text/event-stream" in lower
        raw = b""
        sse = b""
        if b"transfer-encoding: chunked" in lower:
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await r.readuntil(b"\r\n")
                    break
                piece = (await r.readexactly(size + 2))[:-2]
                if not stream:
                    raw += piece
                    continue
                sse += piece
                if b"\r" in sse:
                    sse = sse.replace(b"\r\n", b"\n")
                *events, sse = sse.split(b"\n\n")
                for ev in events:
                    self._event(ev, t0, rec)
            if stream and sse.strip():
                self._event(sse, t0, rec)
        else:
            clen = int(lower.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in lower else 0
            raw = await r.readexactly(clen)
        if b"connection: close" in lower:
            self.close()
        if stream:
            if rec["status"] == 200 and not rec.get("done"):
                rec["why"] = "no [DONE]"
            return
        rec["ttft"] = time.perf_counter() - t0
        if rec["status"] != 200:
            rec["body"] = raw[:300].decode("utf-8", "replace")
            return
        obj = json.loads(raw)
        ch = (obj.get("choices") or [{}])[0]
        rec["text"] = (ch.get("message") or {}).get("content") or ""
        rec["usage"] = obj.get("usage")
        rec["timings"] = obj.get("timings")

    @staticmethod
    def _event(ev: bytes, t0: float, rec: dict) -> None:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                rec["done"] = True
                continue
            obj = json.loads(data)
            if isinstance(obj.get("usage"), dict):
                rec["usage"] = obj["usage"]
            if isinstance(obj.get("timings"), dict):
                rec["timings"] = obj["timings"]
            choices = obj.get("choices")
            if "error" in obj and not choices:
                rec["why"] = "error event"
                continue
            if choices:
                piece = (choices[0].get("delta") or {}).get("content")
                if piece:
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
                    rec["text"] += piece


def tokens_of(rec: dict) -> tuple[int, int] | None:
    """(prompt tokens, of them from the cache) as the engine reported them: llama-server's
    timings (cache_n reused, prompt_n processed), else usage."""
    t = rec.get("timings")
    if isinstance(t, dict) and "cache_n" in t and "prompt_n" in t:
        return int(t["cache_n"]) + int(t["prompt_n"]), int(t["cache_n"])
    u = rec.get("usage")
    if isinstance(u, dict) and isinstance(u.get("prompt_tokens"), int):
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return u["prompt_tokens"], int(cached)
    return None


def _raw(r: dict) -> list:
    return [r.get("conv", -1), r.get("turn", -1), ms(r["ttft"]) if r["ok"] else -1, *(tokens_of(r) or (-1, -1))]


def summarize(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    lat = [r["latency"] for r in ok]
    toks = [t for r in ok if (t := tokens_of(r)) is not None]
    prompt = sum(p for p, _ in toks)
    cached = sum(c for _, c in toks)
    why: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            why[r["why"]] = why.get(r["why"], 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_why": why,
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 2) if wall > 0 else None,
        "with_tokens": len(toks),
        "prompt_tokens_per_req": round(prompt / len(toks), 1) if toks else None,
        "processed_tokens_per_req": round((prompt - cached) / len(toks), 1) if toks else None,
        "cache_hit_ratio": round(cached / prompt, 3) if prompt else None,
        "ttft_p50_ms": ms(rb.pct(ttft, 0.5)),
        "ttft_p99_ms": ms(rb.pct(ttft, 0.99)),
        "latency_p50_ms": ms(rb.pct(lat, 0.5)),
        "latency_p99_ms": ms(rb.pct(lat, 0.99)),
        # per request: [conversation, turn, TTFT ms, prompt tokens, cached tokens] (-1: not known)
        "raw": [_raw(r) for r in records],
    }


# ---------------------------------------------------------------------------- workloads
def chat_body(model: str, messages: list[dict], max_tokens: int, stream: bool) -> dict:
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream, "temperature": 0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def multiturn(port: int, model: str, p: dict) -> tuple[list[dict], float]:
    """Conversations over one system prompt, ``concurrency`` at a time, each turn after the last answer."""
    rng = random.Random(p["seed"])
    system = text(rng, p["system_chars"])
    sem = asyncio.Semaphore(p["concurrency"])
    records: list[dict] = []

    async def conversation(c: int) -> None:
        async with sem:
            crng = random.Random(p["seed"] * 1000 + c)
            think = p.get("think_s", 0.0)
            if think:
                await asyncio.sleep(crng.expovariate(1 / think))  # arrivals spread, not all at once
            cl = Client(port)
            hdr = b"X-Session-ID: conv-%d\r\n" % c if p.get("sessions") else b""
            msgs = [{"role": "system", "content": system}]
            for t in range(p["turns"]):
                msgs.append({"role": "user", "content": f"[{c}.{t}] " + text(crng, p["user_chars"])})
                rec = await cl.post(chat_body(model, msgs, p["max_tokens"], p["stream"]), headers=hdr)
                rec.update(conv=c, turn=t)
                records.append(rec)
                if not rec["ok"]:
                    break  # the conversation cannot go on without its answer
                msgs.append({"role": "assistant", "content": rec["text"]})
                if think and t + 1 < p["turns"]:
                    await asyncio.sleep(crng.expovariate(1 / think))  # the user reads and types
            cl.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(p["conversations"])))
    return records, time.perf_counter() - t0


async def poisson(port: int, model: str, p: dict, make) -> tuple[list[dict], float, int]:
    """Poisson arrivals at ``rate`` for ``seconds``; ``make(i)`` gives the i-th request's messages.
    The clock of each request starts at its scheduled arrival (no coordinated omission)."""
    rng = random.Random(p["seed"])
    pool: list[Client] = []
    records: list[dict] = []
    tasks = []

    async def one(i: int, at: float) -> None:
        cl = pool.pop() if pool else Client(port)
        rec = await cl.post(chat_body(model, make(i), p["max_tokens"], True), t0=at)
        records.append(rec)
        pool.append(cl)

    t0 = time.perf_counter()
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(p["rate"])
        if t >= p["seconds"]:
            break
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, t0 + t)))
        i += 1
    _done, pending = await asyncio.wait(tasks, timeout=p["drain"]) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    wall = time.perf_counter() - t0
    for cl in pool:
        cl.close()
    return records, wall, len(pending)


async def closed_loop(port: int, model: str, p: dict, make) -> tuple[list[dict], float]:
    records: list[dict] = []
    t_end = time.perf_counter() + p["seconds"]
    counter = iter(range(10**9))

    async def worker() -> None:
        cl = Client(port)
        while time.perf_counter() < t_end:
            rec = await cl.post(chat_body(model, make(next(counter)), p["max_tokens"], True))
            records.append(rec)
        cl.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(p["concurrency"])))
    return records, time.perf_counter() - t0


# ---------------------------------------------------------------------------- processes
def start_sim(rundir: Path, a: argparse.Namespace, *, fast: bool = False) -> tuple[int, rb.Proc]:
    port = rb.free_port()
    argv = [sys.executable, str(rb.SIMENGINE), "--port", str(port), "--model", MODEL]
    if fast:  # routing only: short replies, no prefill, no cache
        argv += ["--capacity", "256", "--token-delay-ms", "2", "--tokens", "4"]
    else:
        argv += ["--capacity", str(a.capacity), "--token-delay-ms", str(a.token_delay_ms), "--tokens", str(a.tokens),
                 "--prefix-cache-tokens", str(a.cache_tokens), "--prefill-ms-per-1k", str(a.prefill_ms_per_1k),
                 "--prefill-chunk-tokens", str(a.prefill_chunk_tokens)]  # fmt: skip
    p = rb.Proc(argv, rundir / f"engine-{port}.log")
    rb.wait_port(port)
    return port, p


def peer_missing(name: str) -> str | None:
    if name == "vllm-router" and not VLLM_ROUTER.exists():
        return f"not installed ({VLLM_ROUTER}; python3 -m venv {VENVS}/vllm-router && .../pip install vllm-router)"
    if name == "sglang-router" and not SGLANG_PY.exists():
        return f"not installed ({SGLANG_PY}; python3 -m venv {VENVS}/sglang-router && .../pip install sglang-router)"
    return None


PEER_ARGS: dict[str, list[str]] = {}  # --vllm-router-args, --sglang-router-args


def start_contender(
    name: str, rundir: Path, urls: list[str], model: str, engine: str, router_yaml: str, timeout: float = 90.0
) -> tuple[int, rb.Proc]:
    """The router ``name`` in front of ``urls``, ready once a chat completion went through it."""
    port = rb.free_port()
    if name in CLUSTERCTL or name.startswith("prefix"):
        cfg = rundir / f"router-{port}.yaml"
        eps = "\n".join(f'      - {{url: "{u}", engine: {engine}, replica: r{i}}}' for i, u in enumerate(urls))
        extra = f"router: {router_yaml}\n" if router_yaml else ""
        cfg.write_text(f"models:\n  {model}:\n    endpoints:\n{eps}\n{extra}")
        policy = "prefix" if name.startswith("prefix") else name
        argv = [sys.executable, "-c", "from cluster_cli.cli.main import run; run()", "serve-router", "--config",
                str(cfg), "--port", str(port), "--policy", policy]  # fmt: skip
    elif name == "vllm-router":
        argv = [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                "--policy", "cache_aware", "--worker-startup-check-interval", "1",
                "--prometheus-port", str(rb.free_port()), "--log-level", "warning", *PEER_ARGS.get(name, [])]  # fmt: skip
    elif name == "sglang-router":
        argv = [str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", "cache_aware", "--worker-startup-check-interval", "1",
                "--prometheus-port", str(rb.free_port()), "--log-level", "warn", *PEER_ARGS.get(name, [])]  # fmt: skip
    else:
        raise SystemExit(f"bench/prefix.py: unknown contender {name!r}")
    proc = rb.Proc(argv, rundir / f"{name.replace(' ', '_')}-{port}.log")
    proc.argv = argv  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    while True:
        if proc.p.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.p.returncode}: {Path(proc.log.name).read_text()[-1500:]}")
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"{name} not ready after {timeout:.0f}s")
        time.sleep(0.25)
    return port, proc


def scrape(port: int) -> dict[str, float]:
    """An engine's /metrics: name -> sum over label sets."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            body = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for name, samples in rb._prom(body).items():
        out[name] = sum(v for _, v in samples)
    return out


class LoadSampler(Sampler):
    """Every ``every`` s, each engine's requests (running + waiting): the largest spread
    between the busiest and the idlest, and the most waiting on one engine."""

    def __init__(self, ports: list[int], running: str, waiting: str, every: float = 0.25) -> None:
        super().__init__()
        self.ports, self.running, self.waiting, self.every = ports, running, waiting, every
        self.spreads: list[float] = []
        self.max_waiting = 0.0

    def sample(self) -> None:
        m = [scrape(p) for p in self.ports]
        loads = [x.get(self.running, 0) + x.get(self.waiting, 0) for x in m]
        if any(loads):
            self.spreads.append(max(loads) - min(loads))
        self.max_waiting = max([self.max_waiting, *(x.get(self.waiting, 0) for x in m)])

    def summary(self) -> dict:
        s = self.spreads
        return {
            "spread_mean": round(sum(s) / len(s), 2) if s else None,
            "spread_p99": rb.pct(s, 0.99),
            "spread_max": max(s) if s else None,
            "max_waiting_one_engine": self.max_waiting,
        }


def router_decisions(port: int) -> dict:
    """clusterctl's prefix decisions by outcome, and the characters matched of those indexed."""
    try:
        m = rb._prom(asyncio.run(rb._get(port, "/metrics")))
    except OSError:
        return {}
    out: dict = {}
    for lab, v in m.get("clusterctl_router_prefix_decisions_total", []):
        out[lab.get("outcome", "")] = int(v)
    matched = sum(v for _, v in m.get("clusterctl_router_prefix_matched_chars_total", []))
    indexed = sum(v for _, v in m.get("clusterctl_router_prefix_prompt_chars_total", []))
    ratio = [v for _, v in m.get("clusterctl_router_engine_cache_hit_ratio", [])]
    return {"decisions": out, "matched_chars": int(matched), "indexed_chars": int(indexed),
            "engine_cache_hit_ratio": ratio[0] if ratio else None}  # fmt: skip


def vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------- one run
def contenders(a: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, router yaml) per contender, the --variant ones last."""
    out = []
    for name in (c.strip() for c in a.contenders.split(",") if c.strip()):
        if name not in CONTENDERS:
            raise SystemExit(f"bench/prefix.py: unknown contender {name!r} (of {', '.join(CONTENDERS)})")
        out.append((name, a.router_yaml if name in CLUSTERCTL else ""))
    for v in a.variant:
        label, sep, yaml = v.partition("=")
        if not sep:
            raise SystemExit("bench/prefix.py: --variant LABEL=YAML (a router: section, a YAML flow mapping)")
        out.append((f"prefix {label.strip()}", yaml.strip()))
    return out


def run_sim_workload(a: argparse.Namespace, rundir: Path, what: str) -> dict:
    out: dict = {"runs": {}, "skipped": {}}
    for name, yaml in contenders(a):
        if why := peer_missing(name):
            out["skipped"][name] = why
            print(f"  {what} {name}: skipped: {why}", file=sys.stderr)
            continue
        engines = [start_sim(rundir, a) for _ in range(a.replicas)]
        eports = [p for p, _ in engines]
        proxy = None
        try:
            shared = WARM[what](a)
            if shared and a.warm:
                asyncio.run(warm(eports, MODEL, shared))
            try:
                port, proxy = start_contender(
                    name, rundir, [f"http://127.0.0.1:{p}" for p in eports], MODEL, "vllm", yaml
                )
            except RuntimeError as e:
                out["skipped"][name] = f"did not start: {str(e)[:300]}"
                print(f"  {what} {name}: skipped: {e}", file=sys.stderr)
                continue
            time.sleep(1.0)  # first scrapes
            before = [scrape(p) for p in eports]
            with LoadSampler(eports, "vllm:num_requests_running", "vllm:num_requests_waiting") as ls:
                res = asyncio.run(WORKLOADS[what](port, a))
            after = [scrape(p) for p in eports]
            served = [x.get("sim_requests_served_total", 0) - y.get("sim_requests_served_total", 0)
                      for x, y in zip(after, before, strict=True)]  # fmt: skip
            hits = sum(x.get("vllm:prefix_cache_hits_total", 0) - y.get("vllm:prefix_cache_hits_total", 0)
                       for x, y in zip(after, before, strict=True))  # fmt: skip
            queries = sum(x.get("vllm:prefix_cache_queries_total", 0) - y.get("vllm:prefix_cache_queries_total", 0)
                          for x, y in zip(after, before, strict=True))  # fmt: skip
            res["served_per_replica"] = [int(s) for s in served]
            res["busiest_share"] = round(max(served) / sum(served), 3) if sum(served) else None
            res["engine_hit_ratio"] = round(hits / queries, 3) if queries else None
            res.update(ls.summary())
            res["router_yaml"] = yaml
            res["argv"] = proxy.argv  # type: ignore[attr-defined]
            if name in CLUSTERCTL or name.startswith("prefix"):
                res["router"] = router_decisions(port)
                res["router_rss_mib"] = round((vm_rss_kib(proxy.p.pid) or 0) / 1024, 1)
            out["runs"][name] = res
            print(f"  {what} {name}: {json.dumps({k: v for k, v in res.items() if k != 'raw'})}", file=sys.stderr)
        finally:
            if proxy is not None:
                proxy.stop()
            for _, e in engines:
                e.stop()
    return out


async def w_multiturn(port: int, a: argparse.Namespace) -> dict:
    p = {"seed": a.seed, "system_chars": a.system_chars, "concurrency": a.concurrency, "turns": a.turns,
         "conversations": a.conversations, "user_chars": a.user_chars, "max_tokens": a.tokens, "stream": True,
         "sessions": a.sessions, "think_s": a.think_ms / 1000}  # fmt: skip
    records, wall = await multiturn(port, MODEL, p)
    return summarize(records, wall)


def fleet_rate(a: argparse.Namespace, prefill_tokens: float) -> float:
    """The fleet's requests per second when each request prefills ``prefill_tokens`` (mean):
    per engine, its slots' decode rate less the steps its prefills stall (a step lasts as long
    as its prefill), at most what its prefill alone allows."""
    decode = a.capacity / (a.tokens * a.token_delay_ms / 1000.0)
    prefill_s = prefill_tokens * a.prefill_ms_per_1k / 1e6
    per_engine = decode / (1 + decode * prefill_s)
    return a.replicas * (min(per_engine, 1 / prefill_s) if prefill_s else per_engine)


async def w_hot(port: int, a: argparse.Namespace) -> dict:
    rng = random.Random(a.seed)
    hot = text(rng, a.hot_chars)
    # Every engine holds the hot prefix: the hot requests prefill their question, the rest all.
    tokens = (a.hot_chars + a.user_chars) / 4
    rate = a.hot_load * fleet_rate(a, a.hot_share * a.user_chars / 4 + (1 - a.hot_share) * tokens)

    def make(i: int) -> list[dict]:
        r = random.Random(a.seed * 7919 + i)
        q = f"[{i}] " + text(r, a.user_chars)
        if r.random() < a.hot_share:
            return [{"role": "system", "content": hot}, {"role": "user", "content": q}]
        return [{"role": "system", "content": f"[{i}] " + text(r, a.hot_chars)}, {"role": "user", "content": q}]

    p = {"seed": a.seed, "rate": rate, "seconds": a.hot_seconds, "drain": a.drain, "max_tokens": a.tokens}
    records, wall, incomplete = await poisson(port, MODEL, p, make)
    res = summarize(records, wall)
    res.update(incomplete=incomplete, rate_req_s=round(rate, 2), offered=len(records) + incomplete)
    return res


async def w_unique(port: int, a: argparse.Namespace) -> dict:
    preamble = text(random.Random(a.seed + 1), a.unique_preamble_chars) if a.unique_preamble_chars else ""

    def make(i: int) -> list[dict]:
        r = random.Random(a.seed * 104729 + i)
        msgs = [{"role": "system", "content": preamble}] if preamble else []
        return [*msgs, {"role": "user", "content": f"[{i}] " + text(r, a.unique_chars)}]

    p = {"seconds": a.unique_seconds, "concurrency": a.unique_concurrency, "max_tokens": a.tokens}
    records, wall = await closed_loop(port, MODEL, p, make)
    return summarize(records, wall)


WORKLOADS = {"multiturn": w_multiturn, "hot": w_hot, "unique": w_unique}
# The prompt a workload's requests share (the multiturn system prompt, the hot prefix): what
# the same seed draws first.
WARM = {
    "multiturn": lambda a: text(random.Random(a.seed), a.system_chars),
    "hot": lambda a: text(random.Random(a.seed), a.hot_chars),
    "unique": lambda a: "",
}


async def warm(ports: list[int], model: str, shared: str) -> None:
    """The shared prompt once into each engine's cache, straight to the engine: the run then
    measures routing in steady state, not each engine's first prefill of it."""
    msgs = [{"role": "system", "content": shared}, {"role": "user", "content": "warm-up"}]
    for port in ports:
        cl = Client(port)
        rec = await cl.post(chat_body(model, msgs, 1, False))
        cl.close()
        if not rec["ok"]:
            raise RuntimeError(f"warm-up of the engine on {port}: {rec['why']}")


def run_rss(a: argparse.Namespace, rundir: Path) -> dict:
    """Unique long prompts through ``prefix`` for --rss-seconds: the router's RSS every second."""
    engines = [start_sim(rundir, a, fast=True) for _ in range(a.replicas)]
    proxy = None
    try:
        urls = [f"http://127.0.0.1:{p}" for p, _ in engines]
        port, proxy = start_contender("prefix", rundir, urls, MODEL, "vllm", a.router_yaml)
        pid = proxy.p.pid
        samples: list[tuple[float, int | None]] = []
        stop = threading.Event()
        t0 = time.perf_counter()

        def sample() -> None:
            while True:
                samples.append((round(time.perf_counter() - t0, 1), vm_rss_kib(pid)))
                if stop.wait(1.0):
                    return

        th = threading.Thread(target=sample, daemon=True)
        th.start()

        def make(i: int) -> list[dict]:
            r = random.Random(a.seed * 15485863 + i)
            return [{"role": "user", "content": f"[{i}] " + text(r, a.rss_chars)}]

        p = {"seconds": a.rss_seconds, "concurrency": 16, "max_tokens": 4}
        records, wall = asyncio.run(closed_loop(port, MODEL, p, make))
        stop.set()
        th.join()
        dec = router_decisions(port)
    finally:
        if proxy is not None:
            proxy.stop()
        for _, e in engines:
            e.stop()
    res = summarize(records, wall)
    kib = [(t, k) for t, k in samples if k is not None]
    mib = lambda k: round(k / 1024, 1)  # noqa: E731
    start, mid, end = kib[0], kib[len(kib) // 2], kib[-1]
    res.update(
        rss_start_mib=mib(start[1]),
        rss_mid_mib=mib(mid[1]),
        rss_end_mib=mib(end[1]),
        rss_max_mib=mib(max(k for _, k in kib)),
        rss_mid_s=mid[0],
        rss_end_s=end[0],
        rss_series_mib=[(t, mib(k)) for t, k in kib],
        indexed_blocks=dec.get("indexed_chars", 0) // 64,
        router=dec,
        prompt_chars=a.rss_chars,
    )
    # Flat: the second half grew by less than 2% (the index is full well before the middle).
    res["flat"] = (end[1] - mid[1]) < 0.02 * mid[1]
    print(f"  rss: {json.dumps({k: v for k, v in res.items() if k != 'rss_series_mib'})}", file=sys.stderr)
    return res


# ---------------------------------------------------------------------------- llama-server
def run_llama(a: argparse.Namespace, rundir: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_tiny import make_tiny_gguf
    from llama import find_llama_server, llama_server_version, run_llama_server

    binary = find_llama_server()
    if binary is None:
        why = "llama-server not found ($LLAMA_SERVER, PATH, ~/.cache/clusterctl/llama-server)"
        print(f"  llama: skipped: {why}", file=sys.stderr)
        return {"skipped_all": why}
    model = make_tiny_gguf(rundir / "tiny.gguf")
    # (slots, extra arguments). gpu-like: a loaded GPU engine keeps only what its KV cache
    # holds; llama-server's host-memory prompt cache would keep every prompt it saw, on any
    # replica. defaults: llama-server's own for these (slots auto: 4 on a unified KV cache,
    # a host prompt cache of 8 GiB, slot similarity 0.10).
    settings = {
        "gpu-like": (a.llama_slots, ["--cache-ram", "0", "--slot-prompt-similarity", str(a.llama_sps)]),
        "defaults": (-1, []),
    }
    out: dict = {"binary": binary, "version": llama_server_version(binary), "settings": {}, "skipped": {}}
    p = {"seed": a.seed, "system_chars": a.llama_system_chars, "concurrency": a.llama_concurrency,
         "turns": a.llama_turns, "conversations": a.llama_conversations, "user_chars": a.llama_user_chars,
         "max_tokens": a.llama_tokens, "stream": False, "sessions": a.sessions, "think_s": a.llama_think_ms / 1000}  # fmt: skip
    out["params"] = p
    for label, (slots, extra) in settings.items():
        if label not in a.llama_settings.split(","):
            continue
        runs: dict = {}
        args = ["-np", str(slots), "-c", str(a.llama_ctx * (slots if slots > 0 else 4)), *extra]
        out["settings"][label] = {"engine_args": args, "runs": runs}
        for name, yaml in contenders(a):
            if why := peer_missing(name):
                out["skipped"][name] = why
                continue
            with contextlib.ExitStack() as stack:
                urls = []
                for i in range(a.replicas):
                    port = rb.free_port()
                    urls.append(
                        stack.enter_context(
                            run_llama_server(
                                model, port=port, alias="tiny", n_parallel=slots,
                                ctx=a.llama_ctx * (slots if slots > 0 else 4), n_predict=a.llama_tokens, extra_args=extra,
                                log_path=rundir / f"llama-{label}-{name.replace(' ', '_')}-{i}.log",
                            )
                        )
                    )  # fmt: skip
                eports = [int(u.rsplit(":", 1)[1]) for u in urls]
                if a.warm:
                    asyncio.run(warm(eports, "tiny", text(random.Random(a.seed), a.llama_system_chars)))
                try:
                    rport, proxy = start_contender(name, rundir, urls, "tiny", "llamacpp", yaml)
                except RuntimeError as e:
                    out["skipped"][name] = f"did not start: {str(e)[:300]}"
                    print(f"  llama {label} {name}: skipped: {e}", file=sys.stderr)
                    continue
                stack.callback(proxy.stop)
                time.sleep(1.0)
                before = [scrape(q) for q in eports]
                records, wall = asyncio.run(multiturn(rport, "tiny", p))
                after = [scrape(q) for q in eports]
                res = summarize(records, wall)
                processed = [x.get("llamacpp:prompt_tokens_total", 0) - y.get("llamacpp:prompt_tokens_total", 0)
                             for x, y in zip(after, before, strict=True)]  # fmt: skip
                res["processed_per_replica"] = [int(v) for v in processed]
                res["router_yaml"] = yaml
                res["argv"] = proxy.argv  # type: ignore[attr-defined]
                if name in CLUSTERCTL or name.startswith("prefix"):
                    res["router"] = router_decisions(rport)
                runs[name] = res
                print(f"  llama {label} {name}: {json.dumps(res)}", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------- tables
def _decisions(r: dict) -> str:
    dec = (r.get("router") or {}).get("decisions") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(dec.items()) if v) or "-"


def _ratio(x: float | None, base: float | None) -> float | None:
    return round(x / base, 2) if x is not None and base else None


def _targets_multiturn(runs: dict) -> dict:
    ll = runs.get("least_load", {})
    pr = runs.get("prefix", {})
    out = {}
    if ll and pr:
        r = _ratio(pr.get("processed_tokens_per_req"), ll.get("processed_tokens_per_req"))
        out["processed_vs_least_load"] = r
        out["processed_met"] = r is not None and r <= 0.3
        peers = {n: x["ttft_p99_ms"] for n, x in runs.items() if n != "prefix" and not n.startswith("prefix ")}
        out["ttft_p99_below_every_peer"] = all(pr["ttft_p99_ms"] < v for v in peers.values() if v is not None)
    return out


def print_tables(res: dict) -> None:
    eng = res.get("engine")
    if eng:
        print(
            f"\nEngines: {eng['replicas']} simulated, {eng['capacity']} slots, {eng['token_delay_ms']} ms a token, "
            f"{eng['tokens']}-token replies, prefix cache {eng['cache_tokens']} tokens (LRU, 16-token blocks), "
            f"prefill {eng['prefill_ms_per_1k']} ms per 1,000 uncached tokens, {eng['prefill_chunk_tokens']} a step."
        )
    if "multiturn" in res:
        m = res["multiturn"]
        runs = m["runs"]
        base = runs.get("least_load", {}).get("processed_tokens_per_req")
        print(f"\n## 1. multiturn ({res['params']['conversations']} conversations x {res['params']['turns']} turns, "
              f"{res['params']['concurrency']} at a time; ms)")  # fmt: skip
        print("| contender | requests (errors) | prompt tok/req | processed tok/req | vs least_load | cache hits "
              "| TTFT p50 | TTFT p99 | req/s | busiest share | router decisions |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for n, r in runs.items():
            d = _decisions(r)
            print(f"| {n} | {r['requests']} ({r['errors']}) | {r['prompt_tokens_per_req']} | "
                  f"{r['processed_tokens_per_req']} | {_ratio(r['processed_tokens_per_req'], base)} | "
                  f"{r['cache_hit_ratio']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['req_per_s']} | "
                  f"{r['busiest_share']} | {d} |")  # fmt: skip
        for n, why in m["skipped"].items():
            print(f"| {n} | skipped: {why} |||||||||")
        print(f"targets: {_targets_multiturn(runs)}")
    if "hot" in res:
        h = res["hot"]
        runs = h["runs"]
        base = runs.get("least_load", {}).get("ttft_p99_ms")
        any_run = next(iter(runs.values()), {})
        print(f"\n## 2. hot prefix ({res['params']['hot_share']:.0%} share a {res['params']['hot_chars']}-char prefix; "
              f"Poisson {any_run.get('rate_req_s')} req/s for {res['params']['hot_seconds']} s; ms)")  # fmt: skip
        print("| contender | completed (errors, incomplete) | TTFT p50 | TTFT p99 | p99 vs least_load | cache hits | "
              "busiest share | spread mean / max | most waiting | router decisions |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n, r in runs.items():
            d = _decisions(r)
            print(f"| {n} | {r['ok']} ({r['errors']}, {r['incomplete']}) | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
                  f"{_ratio(r['ttft_p99_ms'], base)} | {r['cache_hit_ratio']} | {r['busiest_share']} | "
                  f"{r['spread_mean']} / {r['spread_max']} | {r['max_waiting_one_engine']} | {d} |")  # fmt: skip
        for n, why in h["skipped"].items():
            print(f"| {n} | skipped: {why} ||||||||")
        if "prefix" in runs and base:
            print(
                f"target (prefix p99 <= least_load's): {'met' if runs['prefix']['ttft_p99_ms'] <= base else 'not met'}"
            )
    if "unique" in res:
        u = res["unique"]
        runs = u["runs"]
        b = runs.get("least_load", {})
        print(f"\n## 3. unique prompts ({res['params']['unique_concurrency']} closed-loop streams, "
              f"{res['params']['unique_seconds']} s; ms)")  # fmt: skip
        print(
            "| contender | requests (errors) | req/s | vs least_load | TTFT p50 | TTFT p99 | p50 / p99 vs least_load |"
        )
        print("|---|---|---|---|---|---|---|")
        for n, r in runs.items():
            print(f"| {n} | {r['ok']} ({r['errors']}) | {r['req_per_s']} | {_ratio(r['req_per_s'], b.get('req_per_s'))} | "
                  f"{r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {_ratio(r['ttft_p50_ms'], b.get('ttft_p50_ms'))} / "
                  f"{_ratio(r['ttft_p99_ms'], b.get('ttft_p99_ms'))} |")  # fmt: skip
        for n, why in u["skipped"].items():
            print(f"| {n} | skipped: {why} ||||||")
        if "prefix" in runs and b:
            r = runs["prefix"]
            within = [
                abs(r[k] / b[k] - 1) <= 0.05 if r.get(k) and b.get(k) else False
                for k in ("req_per_s", "ttft_p50_ms", "ttft_p99_ms")
            ]
            print(f"target (prefix within 5% of least_load: req/s, TTFT p50, p99): {within}")
    if "rss" in res:
        r = res["rss"]
        print(f"\n## 3b. router RSS, prefix, unique {r['prompt_chars']}-char prompts for {r['rss_end_s']} s")
        print(f"requests {r['ok']} ({r['errors']} errors), {r['req_per_s']} req/s; blocks indexed {r['indexed_blocks']} "
              f"(cap {r.get('max_nodes', 65536)}); RSS start {r['rss_start_mib']} MiB, middle ({r['rss_mid_s']} s) "
              f"{r['rss_mid_mib']}, end {r['rss_end_mib']}, max {r['rss_max_mib']}: "
              f"{'flat' if r['flat'] else 'NOT flat'} over the second half")  # fmt: skip
    if "llama" in res:
        lm = res["llama"]
        if "skipped_all" in lm:
            print(f"\n## 4. llama-server: skipped: {lm['skipped_all']}")
            return
        p = lm["params"]
        print(f"\n## 4. llama-server {lm['version']}, tiny model, {p['conversations']} conversations x {p['turns']} "
              f"turns, {p['concurrency']} at a time, non-streamed (tokens from timings; latency ms)")  # fmt: skip
        print("| engines | contender | requests (errors) | prompt tok/req | processed tok/req | vs least_load | "
              "cache hits | latency p50 | latency p99 | req/s | processed per replica |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for label, s in lm["settings"].items():
            base = s["runs"].get("least_load", {}).get("processed_tokens_per_req")
            for n, r in s["runs"].items():
                print(f"| {label} (`{' '.join(s['engine_args'])}`) | {n} | {r['requests']} ({r['errors']}) | "
                      f"{r['prompt_tokens_per_req']} | {r['processed_tokens_per_req']} | "
                      f"{_ratio(r['processed_tokens_per_req'], base)} | {r['cache_hit_ratio']} | {r['latency_p50_ms']} | "
                      f"{r['latency_p99_ms']} | {r['req_per_s']} | {r['processed_per_replica']} |")  # fmt: skip
        for n, why in lm["skipped"].items():
            print(f"| | {n} | skipped: {why} |||||||||")


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["multiturn", "hot", "unique", "rss", "llama", "all"])
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="which, in this order")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL=YAML: one more prefix contender with this router: section (repeatable)")  # fmt: skip
    ap.add_argument("--router-yaml", default="", help="clusterctl's router: section, a YAML flow mapping")
    ap.add_argument("--vllm-router-args", default="", help="more arguments for vllm-router (its defaults otherwise)")
    ap.add_argument("--sglang-router-args", default="", help="more arguments for sglang-router")
    ap.add_argument("--sessions", action="store_true", help="multiturn: an X-Session-ID header per conversation")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="multiturn, hot, llama: engines start cold (no shared prompt cached)")  # fmt: skip
    ap.add_argument("--out", default=None, help="write the raw results (JSON) here")
    g = ap.add_argument_group("simulated engines")
    g.add_argument("--replicas", type=int, default=4)
    g.add_argument("--capacity", type=int, default=8, help="slots per engine")
    g.add_argument("--token-delay-ms", type=float, default=20.0)
    g.add_argument("--tokens", type=int, default=32, help="reply length")
    g.add_argument("--cache-tokens", type=int, default=65536, help="each engine's prefix cache, tokens")
    g.add_argument("--prefill-ms-per-1k", type=float, default=100.0)
    g.add_argument("--prefill-chunk-tokens", type=int, default=2048)
    g = ap.add_argument_group("workloads")
    g.add_argument("--conversations", type=int, default=64)
    g.add_argument("--turns", type=int, default=8)
    g.add_argument("--concurrency", type=int, default=32, help="multiturn: conversations at a time")
    g.add_argument("--think-ms", type=float, default=500.0,
                   help="multiturn: mean pause before each conversation and between its turns (exponential)")  # fmt: skip
    g.add_argument("--system-chars", type=int, default=4000)
    g.add_argument("--user-chars", type=int, default=200)
    g.add_argument("--hot-share", type=float, default=0.9)
    g.add_argument("--hot-chars", type=int, default=8000)
    g.add_argument("--hot-load", type=float, default=0.6, help="of the fleet's capacity")
    g.add_argument("--hot-seconds", type=float, default=20.0)
    g.add_argument("--drain", type=float, default=30.0)
    g.add_argument("--unique-chars", type=int, default=4000)
    g.add_argument("--unique-concurrency", type=int, default=24)
    g.add_argument("--unique-preamble-chars", type=int, default=0,
                   help="unique: a system prompt of this many characters shared by every request (0: none)")  # fmt: skip
    g.add_argument("--unique-seconds", type=float, default=15.0)
    g.add_argument("--rss-seconds", type=float, default=60.0)
    g.add_argument("--rss-chars", type=int, default=16000, help="rss: each unique prompt's characters")
    g = ap.add_argument_group("llama-server")
    g.add_argument("--llama-settings", default="gpu-like,defaults")
    g.add_argument("--llama-slots", type=int, default=4)
    g.add_argument("--llama-sps", type=float, default=0.5, help="gpu-like: --slot-prompt-similarity")
    g.add_argument("--llama-ctx", type=int, default=2048, help="context per slot (the tiny model's own: 2048)")
    g.add_argument("--llama-conversations", type=int, default=32)
    g.add_argument("--llama-turns", type=int, default=6)
    g.add_argument("--llama-concurrency", type=int, default=8)
    g.add_argument("--llama-system-chars", type=int, default=1000, help="~1,100 tokens: a character a token")
    g.add_argument("--llama-user-chars", type=int, default=100)
    g.add_argument("--llama-tokens", type=int, default=8)
    g.add_argument("--llama-think-ms", type=float, default=200.0)
    a = ap.parse_args(argv)
    PEER_ARGS.update(
        {"vllm-router": shlex.split(a.vllm_router_args), "sglang-router": shlex.split(a.sglang_router_args)}
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res: dict = {"machine": rb.machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "params": vars(a)}
    res["engine"] = {k: getattr(a, k) for k in ("replicas", "capacity", "token_delay_ms", "tokens", "cache_tokens",
                                                 "prefill_ms_per_1k", "prefill_chunk_tokens")}  # fmt: skip
    res["peer_versions"] = {
        "vllm-router": _pip_version(VLLM_ROUTER, "vllm-router"),
        "sglang-router": _pip_version(SGLANG_PY, "sglang-router"),
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        rundir = Path(tmp)
        for what in ("multiturn", "hot", "unique"):
            if a.what in (what, "all"):
                res[what] = run_sim_workload(a, rundir, what)
        if a.what in ("rss", "unique", "all") and a.rss_seconds > 0:
            res["rss"] = run_rss(a, rundir)
        if a.what in ("llama", "all"):
            res["llama"] = run_llama(a, rundir)
    res["machine"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    res["total_s"] = round(time.perf_counter() - t0, 1)
    print_tables(res)
    print(f"\ntotal {res['total_s']} s; load average at the end {res['machine']['loadavg_end']}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


def _pip_version(binary: Path, pkg: str) -> str | None:
    py = binary if binary.name.startswith("python") else binary.parent / "python"
    if not py.exists():
        return None
    import subprocess

    out = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version({pkg!r}))"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return out.stdout.strip() or None


if __name__ == "__main__":
    main()
