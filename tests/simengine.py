#!/usr/bin/env python3
"""A simulated OpenAI-compatible inference engine for router tests and benchmarks.

Continuous batching: one scheduler loop; each step (``token_delay_s / speed``) every
running sequence emits one token; at most ``capacity`` sequences run, the rest wait in
FIFO order. Exports vLLM's or llama.cpp's metric names. It can be slowed (``speed``),
made to fail (``fail_status`` = 5xx answers, ``refuse()`` = connections refused,
``hang`` = never answers, ``cut_after`` = streams cut after N tokens, ``done_linger_s`` = a
pause after "[DONE]" before the stream's terminating chunk, ``health_status``),
or killed mid-stream (``kill()``: every connection reset, the port closed).

Its text is one deterministic sequence of pieces (``lorem ipsum dolor ...``, one a token).
Asked to continue its own text (chat: a final assistant message with
``continue_final_message: true``; completions: a prompt that ends with the sequence's start)
it goes on from where that text stops, as a router continuing a cut stream asks, so the
whole text equals an uncut reply; such a reply's chunks carry ``"sim_continued_from": K``
(the pieces the given text held) and ``continued`` counts them.

Streams send their response head at once (as vLLM does) and tokens as they come.
A client that disconnects frees its slot at once (``aborted`` counts it).

A prefix cache, off by default (``prefix_cache_tokens``, ``prefill_ms_per_1k``): a token is 4
characters of the prompt (chat: each message's role and content, in order); a sequence
given a slot looks up its longest cached prefix (whole blocks of ``cache_block_tokens``, as
vLLM's), then inserts its prompt's blocks into a per-engine LRU of ``prefix_cache_tokens``;
once served, its prompt and reply (chat: as the next turn's assistant message) too.
Its uncached tokens cost ``prefill_ms_per_1k`` per 1,000 before its first token: each step
prefills at most ``prefill_chunk_tokens`` of them, first come first served, and lasts as
long as that prefill or the token delay, whichever is longer (chunked prefill beside the
decoding sequences). Responses then carry ``usage.prompt_tokens`` and
``usage.prompt_tokens_details.cached_tokens`` (streams: with ``stream_options.include_usage``),
and ``/metrics`` the engine's prefix-cache counters in tokens.

In-process: ``await SimEngine(...).start()`` on any asyncio loop; ``LoopThread`` runs a
loop in a background thread for synchronous tests. As a process:
``python tests/simengine.py --port 9001 --capacity 8 --token-delay-ms 10``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
WORDS = [b"lorem", b"ipsum", b"dolor", b"sit", b"amet", b"consectetur", b"adipiscing", b"elit"]
REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


class _Seq:
    __slots__ = (
        "cached",
        "conn",
        "done",
        "i",
        "kind",
        "lead",
        "n",
        "prefill_left",
        "prompt",
        "prompt_tokens",
        "rid",
        "start",
        "stream",
        "usage_chunk",
    )

    def __init__(
        self, conn: _Conn, n: int, stream: bool, kind: str, rid: int, start: int = 0, lead: bytes = b""
    ) -> None:
        self.conn, self.n, self.stream, self.kind, self.rid = conn, n, stream, kind, rid
        self.start = start  # index of the first piece to generate (a continuation's)
        self.lead = lead  # the rest of a piece the given text ends inside of, sent first
        self.i = 0
        self.done: asyncio.Future[bool] | None = None
        self.prompt: str | None = None  # the normalised prompt (prefix-cache mode only)
        self.prompt_tokens = 0
        self.cached = 0  # prompt tokens found in the prefix cache
        self.prefill_left = 0  # uncached prompt tokens still to prefill
        self.usage_chunk = False  # a stream whose client asked for usage at the end


CHARS_PER_TOKEN = 4


def prompt_of(path: bytes, req: dict) -> str | None:
    """A request's prompt as the prefix cache sees it: chat, each message's role and content in
    order; completions, the prompt. None when there is none."""
    if b"chat" in path:
        msgs = req.get("messages")
        if not isinstance(msgs, list):
            return None
        parts = []
        for m in msgs:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\x1e")
        return "".join(parts)
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def prompt_blocks(text: str, block_tokens: int) -> tuple[int, list[int]]:
    """(prompt tokens, chain hashes of its whole blocks): block i's hash covers blocks 0..i.
    The last token is always computed (as vLLM does), so a block that would hold it is left out."""
    tokens = max(1, -(-len(text) // CHARS_PER_TOKEN))
    size = block_tokens * CHARS_PER_TOKEN
    out, h = [], 0
    for i in range((tokens - 1) // block_tokens):
        h = hash((h, text[i * size : (i + 1) * size]))
        out.append(h)
    return tokens, out


def held_pieces(text: str) -> tuple[int, str] | None:
    """How much of the engine's sequence ``text`` is, from its start: (whole pieces, the part of
    the next piece after them), or None when it is not a prefix of the sequence."""
    k = pos = 0
    while pos < len(text):
        piece = (WORDS[k % len(WORDS)] + b" ").decode()
        if text.startswith(piece, pos):
            k += 1
            pos += len(piece)
        elif piece.startswith(text[pos:]):
            return k, piece[len(text) - pos :]
        else:
            return None
    return k, ""


def continued_from(path: bytes, req: dict) -> tuple[int, bytes]:
    """Where a request asks the sequence to go on: (first piece, rest of a split piece)."""
    held = None
    if b"chat" in path:
        msgs = req.get("messages")
        if req.get("continue_final_message") is True and isinstance(msgs, list) and msgs:
            last = msgs[-1]
            content = last.get("content") if isinstance(last, dict) and last.get("role") == "assistant" else None
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if isinstance(content, str) and content:
                held = held_pieces(content)
    else:
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            # The earliest start of the sequence that runs to the prompt's end: the longest text.
            first = WORDS[0].decode() + " "
            at = prompt.find(first)
            while at >= 0 and held is None:
                held = held_pieces(prompt[at:])
                if held is not None and held[0] == 0:
                    held = None  # a word of the prompt's own, not a piece of the engine's
                at = prompt.find(first, at + 1)
    if held is None:
        return 0, b""
    k, rest = held
    return (k + 1, rest.encode()) if rest else (k, b"")


class SimEngine:
    def __init__(
        self,
        *,
        model: str = "sim",
        capacity: int = 8,
        token_delay_s: float = 0.005,
        tokens: int = 16,
        metrics_style: str = "vllm",
        speed: float = 1.0,
        prefix_cache_tokens: int = 0,
        prefill_ms_per_1k: float = 0.0,
        prefill_chunk_tokens: int = 2048,
        cache_block_tokens: int = 16,
    ) -> None:
        self.model = model
        self.capacity = capacity
        self.token_delay_s = token_delay_s
        self.tokens = tokens
        self.metrics_style = metrics_style
        self.speed = speed
        self.fail_status: int | None = None
        self.hang = False
        self.cut_after: int | None = None
        self.done_linger_s = 0.0  # a pause between a stream's "[DONE]" and its terminating chunk
        # As llama-server does to some kept-alive connections after a streamed reply: the next
        # request on such a connection is met with a close, no answer and no "Connection: close".
        self.drop_after_stream = False
        self.health_status = 200
        self.running = 0
        self.waiting = 0
        self.served = 0
        self.aborted = 0
        self.requests = 0
        self.continued = 0  # requests that went on from text the engine had produced
        self.prefix_cache_tokens = prefix_cache_tokens  # LRU capacity; 0: no prefix cache
        self.prefill_ms_per_1k = prefill_ms_per_1k
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        self.cache_block_tokens = max(1, cache_block_tokens)
        self.prompt_tokens_total = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.cached_tokens_total = 0  # of them, found in the cache (prefix_cache_hits)
        self._cache: OrderedDict[int, None] = OrderedDict()  # block chain hash, least recent first
        self.port = 0
        self._queue: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._wake: asyncio.Event | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._sched: asyncio.Task[None] | None = None
        self._rid = 0
        self.url = ""

    # ---------------------------------------------------------------- lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None) -> int:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self._sched is None:
            self._sched = loop.create_task(self._scheduler())
        if sock is not None:
            self._server = await loop.create_server(lambda: _Conn(self), sock=sock, backlog=4096)
        else:
            self._server = await loop.create_server(
                lambda: _Conn(self), host, port or self.port, backlog=4096, reuse_address=True
            )
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.port

    async def refuse(self) -> None:
        """Stop listening (new connections are refused) and close idle keep-alive connections."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in list(self._conns):
            if not c.busy:
                c.abort()

    async def kill(self) -> None:
        """Die mid-stream: reset every connection and stop listening; queued work is dropped."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for c in list(self._conns):
            c.abort()
        for seq in self._active + list(self._queue):
            self._finish(seq, aborted=True)
        self._active.clear()
        self._queue.clear()
        self.running = self.waiting = 0

    async def revive(self) -> None:
        await self.start(port=self.port)

    async def stop(self) -> None:
        await self.kill()
        if self._sched is not None:
            self._sched.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sched
            self._sched = None

    # ---------------------------------------------------------------- generation
    def _piece(self, i: int) -> bytes:
        return WORDS[i % len(WORDS)] + b" "

    def _seq_piece(self, seq: _Seq, i: int) -> bytes:
        """The i-th token of seq's reply (0-based)."""
        if seq.lead:
            return seq.lead if i == 0 else self._piece(seq.start + i - 1)
        return self._piece(seq.start + i)

    def _chunk(self, seq: _Seq, piece: bytes, finish: bytes | None = None) -> bytes:
        fr = b"null" if finish is None else b'"' + finish + b'"'
        if seq.kind == "chat":
            delta = b'{"content":"' + piece + b'"}' if finish is None else b"{}"
            if seq.i == 1 and finish is None:
                delta = b'{"role":"assistant","content":"' + piece + b'"}'
            body = (
                b'{"id":"chatcmpl-%d","object":"chat.completion.chunk","created":0,"model":"%s","choices":[{"index":0,"delta":%s,"finish_reason":%s}]'
                % (
                    seq.rid,
                    self.model.encode(),
                    delta,
                    fr,
                )
            )
        else:
            body = (
                b'{"id":"cmpl-%d","object":"text_completion","created":0,"model":"%s","choices":[{"index":0,"text":"%s","finish_reason":%s}]'
                % (
                    seq.rid,
                    self.model.encode(),
                    piece,
                    fr,
                )
            )
        if seq.start or seq.lead:
            body += b',"sim_continued_from":%d' % (seq.start - 1 if seq.lead else seq.start)
        return b"data: " + body + b"}\n\n"

    def _final(self, seq: _Seq) -> bytes:
        text = b"".join(self._seq_piece(seq, i) for i in range(seq.n)).decode()
        usage = self._usage(seq)
        if seq.kind == "chat":
            obj = {
                "id": f"chatcmpl-{seq.rid}",
                "object": "chat.completion",
                "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage,
            }
        else:
            obj = {
                "id": f"cmpl-{seq.rid}",
                "object": "text_completion",
                "created": 0,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }
        return json.dumps(obj).encode()

    def _usage(self, seq: _Seq) -> dict:
        if seq.prompt is None:
            return {"prompt_tokens": 1, "completion_tokens": seq.n, "total_tokens": seq.n + 1}
        return {
            "prompt_tokens": seq.prompt_tokens,
            "completion_tokens": seq.n,
            "total_tokens": seq.prompt_tokens + seq.n,
            "prompt_tokens_details": {"cached_tokens": seq.cached},
        }

    def _usage_event(self, seq: _Seq) -> bytes:
        obj = {
            "id": f"{'chatcmpl' if seq.kind == 'chat' else 'cmpl'}-{seq.rid}",
            "object": "chat.completion.chunk" if seq.kind == "chat" else "text_completion",
            "created": 0,
            "model": self.model,
            "choices": [],
            "usage": self._usage(seq),
        }
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _emit(self, seq: _Seq) -> bool:
        """One token for seq; True when it is finished (or its client is gone)."""
        if seq.conn.closed:
            return True
        seq.i += 1
        if seq.stream:
            out = self._chunk(seq, self._seq_piece(seq, seq.i - 1))
            if self.cut_after is not None and seq.i > self.cut_after:
                seq.conn.cut()  # the scheduler finishes seq (this loop is walking _active)
                return True
            if seq.i >= seq.n:
                out += self._chunk(seq, b"", b"length")
                out += (self._usage_event(seq) if seq.usage_chunk else b"") + b"data: [DONE]\n\n"
            seq.conn.write_chunk(out)
        return seq.i >= seq.n

    @property
    def prefix_mode(self) -> bool:
        return self.prefix_cache_tokens > 0 or self.prefill_ms_per_1k > 0

    def _admit(self, seq: _Seq) -> None:
        """seq got a slot: its longest cached prefix, then its blocks into the LRU (the first
        block the most recently used, so a prompt's tail goes first)."""
        if seq.prompt is None:
            return
        tokens, hashes = prompt_blocks(seq.prompt, self.cache_block_tokens)
        hit = 0
        if self.prefix_cache_tokens > 0:
            cache = self._cache
            for h in hashes:
                if h not in cache:
                    break
                hit += 1
            self._insert(hashes)
        seq.prompt_tokens = tokens
        seq.cached = hit * self.cache_block_tokens
        seq.prefill_left = tokens - seq.cached if self.prefill_ms_per_1k > 0 else 0
        self.prompt_tokens_total += tokens
        self.cached_tokens_total += seq.cached

    def _insert(self, hashes: list[int]) -> None:
        cache = self._cache
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        room = self.prefix_cache_tokens // self.cache_block_tokens
        while len(cache) > room:
            cache.popitem(last=False)

    def _cache_reply(self, seq: _Seq) -> None:
        """A finished sequence's reply is cached too (vLLM keeps its decoded blocks), as the
        next turn's prompt holds it: chat, an assistant message after the prompt."""
        reply = b"".join(self._seq_piece(seq, i) for i in range(seq.n)).decode()
        full = seq.prompt + (f"assistant\n{reply}\x1e" if seq.kind == "chat" else reply)  # type: ignore[operator]
        self._insert(prompt_blocks(full, self.cache_block_tokens)[1])

    def _prefill_step(self) -> float:
        """Prefill this step's share (at most prefill_chunk_tokens, first come first served);
        the seconds it takes."""
        budget = self.prefill_chunk_tokens
        done = 0
        for seq in self._active:
            if seq.prefill_left > 0:
                take = min(seq.prefill_left, budget)
                seq.prefill_left -= take
                budget -= take
                done += take
                if budget <= 0:
                    break
        return done * self.prefill_ms_per_1k / 1e6 / max(self.speed, 1e-9)

    async def _scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._active and not self._queue:
                self._wake.clear()  # type: ignore[union-attr]
                await self._wake.wait()  # type: ignore[union-attr]
            while self._queue and len(self._active) < self.capacity:
                seq = self._queue.popleft()
                self.waiting -= 1
                if seq.conn.closed:
                    self._finish(seq, aborted=True)
                    continue
                self.running += 1
                self._active.append(seq)
                if seq.prompt is not None:
                    self._admit(seq)
            t0 = loop.time()
            if self.prefill_ms_per_1k > 0 and (work := self._prefill_step()) > 0:
                await asyncio.sleep(work)  # the step lasts as long as its prefill, or the token delay
            keep = []
            for seq in self._active:
                if seq.prefill_left > 0:
                    keep.append(seq)  # still prefilling: no token yet
                elif self._emit(seq):
                    self.running -= 1
                    self._finish(seq, aborted=seq.conn.closed or seq.i < seq.n)
                else:
                    keep.append(seq)
            self._active = keep
            delay = self.token_delay_s / max(self.speed, 1e-9)
            rest = delay - (loop.time() - t0)
            await asyncio.sleep(rest if rest > 0 else 0)

    def _finish(self, seq: _Seq, aborted: bool) -> None:
        if aborted:
            self.aborted += 1
        else:
            self.served += 1
            if seq.prompt is not None and self.prefix_cache_tokens > 0:
                self._cache_reply(seq)
        if seq.done is not None and not seq.done.done():
            seq.done.set_result(not aborted)

    def _reap(self, conn: _Conn) -> None:
        """A client went away: free its slot now, not at its next token."""
        for seq in [s for s in self._active if s.conn is conn]:
            self._active.remove(seq)
            self.running -= 1
            self._finish(seq, aborted=True)
        for seq in [s for s in self._queue if s.conn is conn]:
            self._queue.remove(seq)
            self.waiting -= 1
            self._finish(seq, aborted=True)

    async def generate(self, seq: _Seq) -> bool:
        if self.token_delay_s <= 0:
            if seq.prompt is not None:
                self._admit(seq)
                if seq.prefill_left:  # no scheduler steps here: its prefill alone
                    await asyncio.sleep(seq.prefill_left * self.prefill_ms_per_1k / 1e6 / max(self.speed, 1e-9))
                    seq.prefill_left = 0
                    if seq.conn.closed:
                        self._finish(seq, aborted=True)
                        return False
            if seq.stream:
                parts = []
                for i in range(seq.n):
                    seq.i = i + 1
                    parts.append(self._chunk(seq, self._seq_piece(seq, i)))
                parts.append(self._chunk(seq, b"", b"length"))
                parts.append((self._usage_event(seq) if seq.usage_chunk else b"") + b"data: [DONE]\n\n")
                seq.conn.write_chunk(b"".join(parts))
            seq.i = seq.n
            self._finish(seq, aborted=False)
            return True
        seq.done = asyncio.get_running_loop().create_future()
        self.waiting += 1
        self._queue.append(seq)
        self._wake.set()  # type: ignore[union-attr]
        return await seq.done

    # ---------------------------------------------------------------- metrics
    def metrics_text(self) -> bytes:
        kv = min(1.0, self.running / max(1, self.capacity))
        if self.metrics_style == "vllm":
            lab = f'{{model_name="{self.model}"}}'
            lines = [
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{lab} {self.running}",
                "# TYPE vllm:num_requests_waiting gauge",
                f"vllm:num_requests_waiting{lab} {self.waiting}",
                "# TYPE vllm:kv_cache_usage_perc gauge",
                f"vllm:kv_cache_usage_perc{lab} {kv:.4f}",
            ]
        else:
            lines = [
                "# TYPE llamacpp:requests_processing gauge",
                f"llamacpp:requests_processing {self.running}",
                "# TYPE llamacpp:requests_deferred gauge",
                f"llamacpp:requests_deferred {self.waiting}",
            ]
        if self.prefix_mode:
            q, h = self.prompt_tokens_total, self.cached_tokens_total
            if self.metrics_style == "vllm":
                lines += [
                    "# TYPE vllm:prefix_cache_queries_total counter",
                    f"vllm:prefix_cache_queries_total{lab} {q}",
                    "# TYPE vllm:prefix_cache_hits_total counter",
                    f"vllm:prefix_cache_hits_total{lab} {h}",
                ]
            else:  # llama-server counts the prompt tokens it processed, and those it took from its cache
                lines += [
                    "# TYPE llamacpp:prompt_tokens_total counter",
                    f"llamacpp:prompt_tokens_total {q - h}",
                    "# TYPE llamacpp:prompt_tokens_cached_total counter",
                    f"llamacpp:prompt_tokens_cached_total {h}",
                ]
        lines += ["# TYPE sim_requests_served_total counter", f"sim_requests_served_total {self.served}"]
        lines += ["# TYPE sim_requests_continued_total counter", f"sim_requests_continued_total {self.continued}"]
        return ("\n".join(lines) + "\n").encode()

    # ---------------------------------------------------------------- requests
    async def handle(self, conn: _Conn, method: bytes, path: bytes, body: bytes, keep: bool) -> None:
        if path == b"/health":
            ok = self.health_status == 200
            return conn.respond(self.health_status, b'{"status":"ok"}' if ok else b'{"status":"unhealthy"}', keep)
        if path == b"/metrics":
            return conn.respond(200, self.metrics_text(), keep, b"text/plain; version=0.0.4")
        if path == b"/v1/models":
            data = {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "sim"}]}
            return conn.respond(200, json.dumps(data).encode(), keep)
        if path not in (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings") or method != b"POST":
            return conn.respond(404, b'{"error":{"message":"not found","type":"not_found"}}', keep)
        self.requests += 1
        if self.hang:
            return  # never answers: the client or router must time out
        if self.fail_status is not None:
            msg = b'{"error":{"message":"simulated failure","type":"server_error"}}'
            return conn.respond(self.fail_status, msg, keep)
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            return conn.respond(400, b'{"error":{"message":"bad json","type":"invalid_request_error"}}', keep)
        if path == b"/v1/embeddings":
            self.served += 1
            data = {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                "model": self.model,
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
            return conn.respond(200, json.dumps(data).encode(), keep)
        n = self.tokens
        mt = req.get("max_completion_tokens") or req.get("max_tokens")
        if isinstance(mt, int) and mt > 0:
            n = min(n, mt)
        self._rid += 1
        start, lead = continued_from(path, req)
        self.continued += bool(start or lead)
        seq = _Seq(
            conn, max(1, n), bool(req.get("stream")), "chat" if b"chat" in path else "text", self._rid, start, lead
        )
        if self.prefix_mode:
            seq.prompt = prompt_of(path, req) or ""
            so = req.get("stream_options")
            seq.usage_chunk = seq.stream and isinstance(so, dict) and so.get("include_usage") is True
        if seq.stream:
            hdr = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n"
            conn.write(hdr + (b"" if keep else b"Connection: close\r\n") + b"\r\n")
            await self.generate(seq)
            if self.done_linger_s and not conn.closed:
                await asyncio.sleep(self.done_linger_s)  # "[DONE]" sent, the terminating chunk not yet
            if not conn.closed:
                conn.write(b"0\r\n\r\n")
                if not keep:
                    conn.close()
                elif self.drop_after_stream:
                    conn.poisoned = True
            return None
        ok = await self.generate(seq)
        if ok and not conn.closed:
            conn.respond(200, self._final(seq), keep)
        return None


class _Conn(asyncio.Protocol):
    def __init__(self, eng: SimEngine) -> None:
        self.e = eng
        self.buf = b""
        self.tr: asyncio.Transport | None = None
        self.closed = False
        self.busy = False
        self.poisoned = False  # the engine closes this connection at its next request (drop_after_stream)
        self.reqs: deque[tuple[bytes, bytes, bytes, bool]] = deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tr = transport  # type: ignore[assignment]
        with contextlib.suppress(OSError):
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.e._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.e._conns.discard(self)
        self.e._reap(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            idx = self.buf.find(b"\r\n\r\n")
            if idx < 0:
                break
            lines = self.buf[:idx].split(b"\r\n")
            method, path, version = lines[0].split(b" ", 2)
            hdrs = {}
            for ln in lines[1:]:
                k, _, v = ln.partition(b":")
                hdrs[k.strip().lower()] = v.strip()
            clen = int(hdrs.get(b"content-length", b"0"))
            if len(self.buf) < idx + 4 + clen:
                break
            body = self.buf[idx + 4 : idx + 4 + clen]
            self.buf = self.buf[idx + 4 + clen :]
            keep = version == b"HTTP/1.1" and b"close" not in hdrs.get(b"connection", b"").lower()
            self.reqs.append((method, path.split(b"?")[0], body, keep))
        if self.reqs and not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.reqs and not self.closed:
                method, path, body, keep = self.reqs.popleft()
                if self.poisoned:
                    self.close()
                    return
                await self.e.handle(self, method, path, body, keep)
        finally:
            self.busy = False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.tr.write(data)  # type: ignore[union-attr]

    def write_chunk(self, data: bytes) -> None:
        self.write(b"%x\r\n%b\r\n" % (len(data), data))

    def respond(self, status: int, body: bytes, keep: bool, ctype: bytes = b"application/json") -> None:
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
            status,
            REASONS.get(status, b"X"),
            ctype,
            len(body),
        )
        self.write(head + (b"" if keep else b"Connection: close\r\n") + b"\r\n" + body)
        if not keep:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.tr.close()  # type: ignore[union-attr]

    def abort(self) -> None:
        if not self.closed:
            self.cut()
            self.e._reap(self)

    def cut(self) -> None:
        """Reset the connection; whoever holds its request finishes it."""
        if not self.closed:
            self.closed = True
            self.tr.abort()  # type: ignore[union-attr]


class LoopThread:
    """An asyncio (uvloop when available) loop in a daemon thread, for synchronous tests."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        async def go() -> T:
            return fn()

        return self.run(go(), timeout)

    def wait_for(self, pred: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        """Poll ``pred`` on the loop until true; bounded (raises AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call(pred):
                return
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}")

    def close(self) -> None:
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_all(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Simulated OpenAI-compatible engine.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="sim")
    p.add_argument("--capacity", type=int, default=8)
    p.add_argument("--token-delay-ms", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--metrics-style", choices=["vllm", "llamacpp"], default="vllm")
    p.add_argument("--prefix-cache-tokens", type=int, default=0, help="prefix cache capacity in tokens (0: none)")
    p.add_argument("--prefill-ms-per-1k", type=float, default=0.0, help="prompt time per 1,000 uncached tokens")
    p.add_argument("--prefill-chunk-tokens", type=int, default=2048, help="prompt tokens prefilled per step at most")
    p.add_argument("--cache-block-tokens", type=int, default=16, help="the prefix cache's block")
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass

    async def run() -> None:
        eng = SimEngine(
            model=a.model,
            capacity=a.capacity,
            token_delay_s=a.token_delay_ms / 1000.0,
            tokens=a.tokens,
            metrics_style=a.metrics_style,
            speed=a.speed,
            prefix_cache_tokens=a.prefix_cache_tokens,
            prefill_ms_per_1k=a.prefill_ms_per_1k,
            prefill_chunk_tokens=a.prefill_chunk_tokens,
            cache_block_tokens=a.cache_block_tokens,
        )
        await eng.start(a.host, a.port)
        stop = asyncio.get_running_loop().create_future()
        for s in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(s, lambda: stop.done() or stop.set_result(None))
        await stop
        await eng.stop()

    asyncio.run(run())


class Fleet:
    """Simulated engines plus a clusterctl router on one ``LoopThread`` (for tests).

    ``Fleet(n=2, capacity=4).start(router={...})``: engines serve model ``sim``; the
    router config lists every engine as an endpoint; ``router`` merges into its
    ``router:`` section. ``base`` is the router's OpenAI base URL.
    """

    def __init__(self, n: int = 2, *, model: str = "sim", **engine_kw: object) -> None:
        self.lt = LoopThread()
        self.model = model
        self.engines = [SimEngine(model=model, **engine_kw) for _ in range(n)]  # type: ignore[arg-type]
        for e in self.engines:
            self.lt.run(e.start())
        self.router = None
        self.port = 0

    def config(self, router: dict | None = None, endpoint_extra: dict[int, dict] | None = None) -> dict:
        eps = []
        for i, e in enumerate(self.engines):
            ep = {"url": e.url, "engine": "vllm" if e.metrics_style == "vllm" else "llamacpp", "replica": f"r{i}"}
            ep.update((endpoint_extra or {}).get(i, {}))
            eps.append(ep)
        cfg: dict = {"models": {self.model: {"endpoints": eps}}}
        cfg["router"] = {"scrape_interval_s": 0.1, "health_interval_s": 0.2, **(router or {})}
        return cfg

    def start(self, router: dict | None = None, cfg: dict | None = None, **router_kw: object) -> Fleet:
        from cluster_cli.router.app import Router
        from cluster_cli.router.config import RouterConfig

        rc = RouterConfig.model_validate(cfg or self.config(router))
        self.router = Router(rc, **router_kw)  # type: ignore[arg-type]
        self.port = self.lt.run(self.router.start("127.0.0.1", 0))
        return self

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.router is not None:
            with contextlib.suppress(Exception):
                self.lt.run(self.router.stop(0.5), 15)
        for e in self.engines:
            with contextlib.suppress(Exception):
                self.lt.run(e.stop(), 10)
        self.lt.close()


__all__ = ["Fleet", "LoopThread", "SimEngine"]

if __name__ == "__main__":
    main()
