"""How often a continued stream equals an uncut one, at temperature 0 (real ``llama-server``).

Two replicas of the tiny model, each behind a relay that resets the connection of one
armed completion after its first ``k`` SSE events (``k`` drawn at random for each try).
The router continues the cut stream on the other replica; the client's whole text is
compared with an uncut run of the same request, for chat and for completions.

A continuation gets the streamed text back as text, which the engine tokenizes again. Where
that text tokenizes to the tokens the first replica generated, the continuing engine sees
what the first one saw, and greedy decoding must go on identically; where it does not
(a word the model built from two pieces tokenizes as one), the model sees another context
and may choose otherwise from the seam on. The test asserts the first (equal text whenever
the tokens agree) and that a difference never starts before the seam, and prints the figures
(``-s`` shows them). Two vocabularies: single characters only, where any text tokenizes back
to what was generated, and the default one with whole words, which the tokenizer cannot
reach from their letters (SentencePiece merges need every intermediate piece), so that every
word the model emitted as one token comes back as letters.

Skipped when no ``llama-server`` binary is found (see ``tests/llama.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from gguf_tiny import MIN_VOCAB, make_tiny_gguf
from llama import find_llama_server, free_port, router_config, router_running, run_llama_server
from simengine import LoopThread

from cluster_cli.router.app import Router

pytestmark = pytest.mark.llama
ALIAS = "tiny"
MAX_TOKENS = 48
TRIES = 12  # per API; each is one cut at a random event
MSGS = [{"role": "user", "content": "Tell a long story."}]
PROMPT = "Once upon a time"


@dataclass
class Arm:
    """The next completion request a relay sees is cut after ``events`` SSE events, once."""

    events: int | None = None
    cut: list[str] = field(default_factory=list)  # the relays that cut, in order
    sent: bytes = b""  # what the cut response relayed before its reset


class CuttingRelay:
    """A TCP relay to one engine that resets an armed completion's connection mid-stream."""

    def __init__(self, name: str, upstream: int, arm: Arm) -> None:
        self.name, self.upstream, self.arm = name, upstream, arm
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream)
        todo: list[int] = []  # the armed cut of the request now being answered, if any

        async def requests() -> None:
            while data := await cr.read(65536):
                if b"completions " in data and self.arm.events is not None:
                    todo.append(self.arm.events)
                    self.arm.events = None
                    self.arm.cut.append(self.name)
                uw.write(data)
                await uw.drain()

        async def answers() -> None:
            seen = 0
            while data := await ur.read(65536):
                if todo:
                    at, n = 0, todo[0]
                    while seen < n and (i := data.find(b"data: ", at)) >= 0:
                        end = data.find(b"\n\n", i)
                        if end < 0:
                            break
                        seen, at = seen + 1, end + 2
                    if seen >= n:
                        self.arm.sent += data[:at]
                        cw.write(data[:at])
                        await cw.drain()
                        cw.transport.abort()  # a reset, as from a node that died
                        uw.transport.abort()
                        return
                if todo:
                    self.arm.sent += data
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.ensure_future(requests()), asyncio.ensure_future(answers())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        cw.transport.abort()
        uw.transport.abort()


VOCABS = {"chars": MIN_VOCAB, "words": 300}  # single characters only; and the default, with words


@pytest.fixture(scope="module", params=list(VOCABS))
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if find_llama_server() is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    tmp = tmp_path_factory.mktemp("fidelity")
    model = make_tiny_gguf(tmp / "tiny.gguf", n_vocab=VOCABS[request.param])
    arm = Arm()
    relay_loop = LoopThread()
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(
                run_llama_server(Path(model), port=free_port(), alias=ALIAS, n_parallel=1, ctx=1024, n_predict=256)
            )
            for _ in range(2)
        ]
        relays = [CuttingRelay(f"tiny-{i}", int(u.rsplit(":", 1)[1]), arm) for i, u in enumerate(engines)]
        urls = [f"http://127.0.0.1:{relay_loop.run(r.start())}" for r in relays]
        # Every cut is its replica's failure: a few in a row on one would open its breaker.
        cfg = router_config(urls, router={"scrape_interval_s": 0.5, "breaker": {"failure_threshold": 1000}})
        try:
            with router_running(cfg) as (base, router, lt):
                yield Fleet(request.param, base, engines[0], arm, router, lt)
        finally:
            for r in relays:
                relay_loop.run(r.stop())
            relay_loop.close()


@dataclass
class Fleet:
    vocab: str
    url: str  # the router's
    engine: str  # one engine's own URL, to ask it how text tokenizes
    arm: Arm
    router: Router
    lt: LoopThread

    def resumed(self) -> int:
        return self.lt.call(lambda: sum(self.router.metrics._req.resumed.values()))


def _stream(c: openai.OpenAI, chat: bool) -> tuple[str, list[str], set[str]]:
    """The text, the finish reasons, the ids seen."""
    text, reasons, ids = [], [], set()
    common = {"model": ALIAS, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    if chat:
        stream = c.chat.completions.create(messages=MSGS, **common)
    else:
        stream = c.completions.create(prompt=PROMPT, **common)
    for ch in stream:
        ids.add(ch.id)
        for choice in ch.choices:
            text.append((choice.delta.content if chat else choice.text) or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return "".join(text), reasons, ids


def _post(engine: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        engine + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _pieces(engine: str, text: str) -> list[str]:
    """The pieces ``text`` tokenizes to on ``engine``."""
    return [t["piece"] for t in _post(engine, "/tokenize", {"content": text, "with_pieces": True})["tokens"]]


def _relayed(raw: bytes, chat: bool) -> list[str]:
    """The text pieces of the SSE events in ``raw`` (one per token on llama-server)."""
    out = []
    for m in re.finditer(rb"data: (\{.*?\})\n\n", raw):
        for choice in json.loads(m.group(1)).get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                out.append(piece)
    return out


def _diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_continued_stream_equals_an_uncut_one_where_its_tokens_agree(fleet: Fleet, chat: bool) -> None:
    c = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=60)
    whole, reasons, _ = _stream(c, chat)
    assert len(reasons) == 1
    if chat:
        context = _post(fleet.engine, "/apply-template", {"messages": MSGS, "add_generation_prompt": True})["prompt"]
    else:
        context = PROMPT
    before = _pieces(fleet.engine, context)
    rng = random.Random(f"{fleet.vocab}-{chat}")
    rows = []
    for _ in range(TRIES):
        k = rng.randint(2, MAX_TOKENS - 2)
        resumed = fleet.resumed()
        fleet.arm.events, fleet.arm.sent = k, b""
        text, reasons, ids = _stream(c, chat)
        assert fleet.arm.events is None, "no request was cut"
        assert len(ids) == 1 and len(reasons) == 1, (ids, reasons)
        # counted as the request ends, just after its last bytes went out
        fleet.lt.wait_for(lambda n=resumed + 1: sum(fleet.router.metrics._req.resumed.values()) == n, what="resumed")
        generated = _relayed(fleet.arm.sent, chat)  # what the first replica streamed, token by token
        prefix = "".join(generated)
        assert whole.startswith(prefix) and text.startswith(prefix), "the first replica's text is the uncut run's"
        # The continuing replica tokenizes context + prefix: the same tokens as the first saw?
        agree = _pieces(fleet.engine, context + prefix) == before + generated
        rows.append((len(prefix), len(generated), agree, text == whole, _diff(text, whole)))
        if agree:
            assert text == whole, f"cut after {len(generated)} tokens, which tokenize back alike, yet differs"
        else:
            assert _diff(text, whole) >= len(prefix), "the text differs before the seam"
    equal = sum(r[3] for r in rows)
    agreeing = sum(r[2] for r in rows)
    print(
        f"\n{fleet.vocab} vocabulary, {'chat' if chat else 'completions'}: {equal}/{TRIES} continued streams"
        f" equal the uncut run; the streamed tokens tokenize back alike at {agreeing}/{TRIES} seams"
    )
    for chars, n, agree, eq, at in rows:
        print(
            f"  seam after {n:2d} tokens ({chars:2d} chars): tokens agree {agree!s:5}, equal {eq!s:5}"
            + ("" if eq else f" (from char {at})")
        )
    if fleet.vocab == "chars":
        assert agreeing == TRIES, "a vocabulary of single characters tokenizes any text back alike"
