"""Chaos: an endpoint is killed while clients stream through the router.

Every request that had not started streaming when the engine died must still succeed
(retried elsewhere); the ones cut mid-stream end with an SSE error event, never a hang.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from simengine import Fleet

MSG = [{"role": "user", "content": "hello"}]


async def one(client: httpx.AsyncClient, base: str, out: list[dict]) -> None:
    rec = {"started": False, "done": False, "error_event": False, "status": None, "exc": None}
    out.append(rec)
    body = {"model": "sim", "messages": MSG, "stream": True}
    try:
        async with client.stream("POST", base + "/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec["done"] = True
                elif "error" in json.loads(data):
                    rec["error_event"] = True
                else:
                    rec["started"] = True
    except httpx.HTTPError as e:
        rec["exc"] = repr(e)


def test_engine_killed_while_clients_stream():
    f = Fleet(4, capacity=3, token_delay_s=0.01, tokens=25).start(router={"breaker": {"failure_threshold": 2}})
    victim = f.engines[0]
    try:

        async def run() -> list[dict]:
            out: list[dict] = []
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                first = [asyncio.create_task(one(client, f.base, out)) for _ in range(24)]
                for _ in range(500):  # bounded wait until the victim is busy and has a queue
                    if f.lt.call(lambda: victim.running >= 2):
                        break
                    await asyncio.sleep(0.01)
                f.lt.run(victim.kill())
                later = [asyncio.create_task(one(client, f.base, out)) for _ in range(16)]
                await asyncio.wait_for(asyncio.gather(*first, *later), 60)
            return out

        results = asyncio.run(run())
        assert len(results) == 40
        cut = [r for r in results if not r["done"]]
        for r in results:
            if not r["done"]:  # only a stream that had started may fail, and it ends with an error event
                assert r["started"] and r["error_event"] and r["exc"] is None, r
            else:
                assert r["status"] == 200 and not r["error_event"], r
        assert len(cut) <= 3  # at most what the victim was running (its capacity)
        assert sum(e.served for e in f.engines[1:]) == 40 - len(cut)
        workers = f.router.table.workers
        f.lt.wait_for(lambda: all(w.inflight == 0 for w in workers.values()), what="in-flight back to 0")
    finally:
        f.close()
