"""Chaos: an endpoint is killed while clients stream through the router.

Every request that had not started streaming when the engine died must still succeed
(retried elsewhere); the ones cut mid-stream are continued elsewhere or end with an SSE
error event, never a hang.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
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


def _retries(f: Fleet) -> float:
    """The router's retry counter, summed over its labels."""
    return _counter(f, "clusterctl_router_retries_total")


def _resumed(f: Fleet) -> float:
    """Streams cut by the victim and continued on a survivor."""
    return _counter(f, "clusterctl_router_requests_resumed_total")


def _counter(f: Fleet, name: str) -> float:
    return sum(s.value for m in f.router.metrics.registry.collect() for s in m.samples if s.name == name)


@pytest.mark.slow
def test_engine_killed_while_clients_stream():
    f = Fleet(4, capacity=3, token_delay_s=0.01, tokens=25).start(router={"breaker": {"failure_threshold": 2}})
    victim = f.engines[0]
    try:

        async def kill_when_busy() -> int:
            """On the fleet's loop: wait until the victim runs >= 2 streams, then kill it in the
            same step (nothing can finish in between); returns what it had running and queued."""
            for _ in range(3000):  # bounded: about 30 s
                if victim.running >= 2:
                    held = victim.running + victim.waiting
                    await victim.kill()
                    return held
                await asyncio.sleep(0.01)
            pytest.fail(f"the victim never ran 2 streams (running={victim.running}, requests={victim.requests})")

        async def run() -> tuple[list[dict], int]:
            out: list[dict] = []
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                first = [asyncio.create_task(one(client, f.base, out)) for _ in range(24)]
                held = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(kill_when_busy(), f.lt.loop))
                later = [asyncio.create_task(one(client, f.base, out)) for _ in range(16)]
                await asyncio.wait_for(asyncio.gather(*first, *later), 60)
            return out, held

        results, held = asyncio.run(run())
        assert held >= 2
        assert len(results) == 40
        cut = [r for r in results if not r["done"]]
        for r in results:
            if not r["done"]:  # only a stream that had started may fail, and it ends with an error event
                assert r["started"] and r["error_event"] and r["exc"] is None, r
            else:
                assert r["status"] == 200 and not r["error_event"], r
        assert len(cut) <= 3  # at most what the victim was running (its capacity)
        assert victim.served + victim.aborted == victim.requests  # the victim's books balance
        assert victim.aborted >= held  # the kill dropped what it held: it never served those
        # Each request the victim held was either continued on a survivor or cut (its client
        # had seen tokens), or retried on a survivor (nothing had reached its client). The retry
        # counter also holds later requests that found the victim dead, hence ">=".
        assert len(cut) + _resumed(f) + _retries(f) >= held
        assert sum(e.served for e in f.engines[1:]) == 40 - len(cut)
        endpoints = f.router.table.endpoints
        f.lt.wait_for(lambda: all(w.inflight == 0 for w in endpoints.values()), what="in-flight back to 0")
    finally:
        f.close()
