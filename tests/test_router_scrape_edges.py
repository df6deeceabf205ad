"""Metric scrapes and health checks at their edges: the text exposition forms a parser must
read, values no engine can mean, scrapes that answer without any mapped metric, one engine
that hangs while the others are polled, and the Host header of an IPv6 endpoint.

No timed assertions: the loop tests count what happened, with generous timeouts only as
guards against a hang (which is how the old all-at-once rounds fail them).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.engines import MetricMapping
from cluster_cli.engines.metrics import CACHE_COUNTERS, cache_reading, parse_metrics, resolve
from cluster_cli.router import health, scrape
from cluster_cli.router.breaker import BreakerConfig
from cluster_cli.router.config import EndpointView
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.http import fetch

VM = MetricMapping.vllm()
RUN, WAIT, KV = VM.running, VM.waiting, VM.kv_cache_usage
GUARD_S = 10.0  # hang guard only: every wait below ends in milliseconds when the code is right

_port = iter(range(21000, 30000))


def endpoint(mapping: MetricMapping = VM, clock: Callable[[], float] = time.monotonic) -> Endpoint:
    port = next(_port)  # a distinct URL per endpoint (the unusable-value warning is once per URL)
    view = EndpointView(
        url=f"http://127.0.0.1:{port}",
        host="127.0.0.1",
        port=port,
        engine="vllm",
        replica=f"r{port}",
        draining=False,
        max_inflight=None,
        metrics=mapping,
        health_path="/health",
        models=("m",),
    )
    return Endpoint(view, breaker_cfg=BreakerConfig(), clock=clock, stale_s=3.0, probe_s=5.0)


def parse(text: str) -> dict[str, list[float]]:
    return parse_metrics(text, [RUN, WAIT, KV, "my.metric"])


# ---------------------------------------------------------------- the parser


def test_the_parser_reads_every_legal_sample_line_form():
    text = (
        f"{RUN}\t8\n"  # tab separated
        f"   {WAIT} 2\n"  # indented
        f'{KV}{{model_name="a"}}0.25\n'  # nothing between the label set and the value
        f'{KV}{{model_name="a b}}c",engine="0"}} 0.5\n'  # a label value with a blank and a "}"
        f'{RUN}{{model_name="say \\"hi}}\\""}} 1 1700000000000\n'  # escaped quotes, a timestamp
        f'{RUN} {{model_name="x"}}\t2\n'  # blanks between the name and its label set
        f'{RUN}{{le="0.1"}} 4 # {{trace_id="k}}1"}} 9 1700000000.1\n'  # an OpenMetrics exemplar
        '{"my.metric",model_name="a"} 3\n'  # a quoted UTF-8 name (Prometheus 3)
        f"\t# {RUN} 100\n"  # an indented comment
        f"{RUN}_total 9\n"  # another metric that starts with the name
    )
    assert parse(text) == {RUN: [8.0, 1.0, 2.0, 4.0], WAIT: [2.0], KV: [0.25, 0.5], "my.metric": [3.0]}


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>Not Found</body></html>",
        '{"running": 3}',
        "",
        f"{RUN}\n",
        f'{RUN}{{a="b" 3\n',  # an unterminated label set
        f'{RUN}{{a="b}} 3\n',  # an unterminated label value
        f"{RUN} three\n",
        '{"my.metric" 3\n',
        "{} 3\n",
        f"{RUN}_total 9\n",
    ],
)
def test_lines_that_are_no_sample_of_a_wanted_metric_give_nothing(text):
    assert parse(text) == {}


_label_value = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
_blank = st.text(alphabet=" \t", min_size=1, max_size=3)


@st.composite
def sample_line(draw: st.DrawFn) -> tuple[str, str, float]:
    name = draw(st.sampled_from([RUN, WAIT, KV]))
    value = draw(st.floats(allow_nan=False, allow_infinity=False))
    labels = draw(st.lists(st.tuples(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), _label_value), max_size=3))
    quoted = [k + '="' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"' for k, v in labels]
    line = draw(st.text(alphabet=" \t", max_size=2)) + name
    if labels or draw(st.booleans()):
        line += draw(st.sampled_from(["", " "])) + "{" + ",".join(quoted) + "}"
        line += draw(st.sampled_from(["", " ", "\t"]))
    else:
        line += draw(_blank)
    line += repr(value)
    if draw(st.booleans()):
        line += draw(_blank) + str(draw(st.integers(0, 2**42)))
    return line, name, value


@given(sample_line())
def test_any_legal_sample_line_is_read(case):
    line, name, value = case
    assert parse(line + "\n") == {name: [value]}, line


@given(st.text(max_size=300))
def test_the_parser_never_raises(text):
    for name in (RUN, "", "{", "my.metric"):
        parse_metrics(text, [name, WAIT])


@given(st.lists(st.sampled_from([RUN, "{", "}", '"', "\\", " ", "\t", "1", "=", ",", "#", "\n", "a", "NaN"])))
def test_the_parser_never_raises_on_near_misses(parts):
    parse("".join(parts))


# ---------------------------------------------------------------- values no engine can mean


@pytest.mark.parametrize("kv", [-1.0, 5.0, 100.0, math.inf, -math.inf, math.nan, -0.001])
def test_an_impossible_kv_cache_use_is_unknown(kv):
    """-Inf sent all traffic to the replica, +Inf none; 5 (a percentage-style metric mapped by
    mistake) would make it look full for ever if clamped: unknown is never worse than that."""
    assert resolve({RUN: [1.0], WAIT: [0.0], KV: [kv]}, VM) == (1.0, 0.0, None)


def test_a_kv_cache_use_a_rounding_error_above_one_is_full():
    assert resolve({KV: [1.0000001]}, VM) == (None, None, 1.0)
    assert resolve({KV: [0.0, -0.0]}, VM) == (None, None, 0.0)


@pytest.mark.parametrize("bad", [-1.0, math.inf, -math.inf, math.nan])
def test_an_impossible_count_is_unknown(bad):
    assert resolve({RUN: [bad], WAIT: [2.0]}, VM) == (None, 2.0, None)
    assert resolve({RUN: [3.0], WAIT: [bad]}, VM) == (3.0, None, None)
    # One bad series makes the signal unknown: the sum without it is no number the engine gave.
    assert resolve({RUN: [3.0, bad], WAIT: [1.0, 1.0]}, VM) == (None, 2.0, None)
    assert resolve({KV: [0.5, bad]}, VM) == (None, None, None)


def test_a_sum_that_overflows_is_unknown():
    assert resolve({RUN: [1e308, 1e308]}, VM)[0] is None


# ---------------------------------------------------------------- scrape_one


def _scrape(monkeypatch, w: Endpoint, body: bytes, status: int = 200) -> None:
    async def fake_fetch(host, port, path, timeout):
        return status, body

    monkeypatch.setattr(scrape, "fetch", fake_fetch)
    asyncio.run(scrape.scrape_one(w, 1.0, time.monotonic))


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body>Not Found</body></html>",
        b'{"running": 3}',
        b"",
        b"vllm:num_requests_runing 3\nvllm:num_request_waiting 0\n",  # typos
        b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n",
    ],
)
def test_a_scrape_without_any_mapped_metric_is_an_error(monkeypatch, body):
    w = endpoint()
    _scrape(monkeypatch, w, b"%s 2\n" % RUN.encode())
    at = w.scraped.at
    _scrape(monkeypatch, w, body)
    s = w.scraped
    assert s.error is not None and s.error.startswith("none of the mapped metrics (")
    assert RUN in s.error and WAIT in s.error and KV in s.error and "/metrics" in s.error
    assert s.at == at  # no fresh reading: the scrape age is not reset


def test_a_typo_in_a_custom_mapping_is_named_in_the_error(monkeypatch):
    w = endpoint(MetricMapping("llamacpp:requests_procesing", None, None))
    _scrape(monkeypatch, w, b"llamacpp:requests_processing 1\n")
    assert w.scraped.error == "none of the mapped metrics (llamacpp:requests_procesing) in /metrics"
    assert not w.fresh(time.monotonic())


def test_one_mapped_metric_found_is_a_good_scrape(monkeypatch):
    w = endpoint()
    _scrape(monkeypatch, w, b"<html>\n%s\t3\n" % RUN.encode())
    s = w.scraped
    assert (s.running, s.waiting, s.kv, s.error) == (3.0, None, None, None)
    assert w.fresh(time.monotonic())


def test_a_scrape_with_no_usable_value_is_an_error(monkeypatch):
    w = endpoint()
    _scrape(monkeypatch, w, b"%s -1\n%s NaN\n%s +Inf\n" % (RUN.encode(), WAIT.encode(), KV.encode()))
    assert w.scraped.error is not None and w.scraped.error.startswith("no usable value in /metrics")
    assert "running" in w.scraped.error and "kv_cache_usage" in w.scraped.error
    assert not w.fresh(time.monotonic())


def test_an_unusable_value_is_unknown_and_warned_about_once(monkeypatch, caplog):
    w = endpoint()
    body = b"%s 1\n%s 0\n%s 5\n" % (RUN.encode(), WAIT.encode(), KV.encode())
    with caplog.at_level(logging.WARNING, logger="clusterctl.router"):
        for _ in range(3):
            _scrape(monkeypatch, w, body)
    s = w.scraped
    assert (s.running, s.waiting, s.kv, s.error) == (1.0, 0.0, None, None)
    warnings = [r for r in caplog.records if w.url in r.getMessage()]
    assert len(warnings) == 1 and "kv_cache_usage" in warnings[0].getMessage()


# ---------------------------------------------------------------- one slow engine, the others polled


async def until(pred: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not pred():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), GUARD_S)


class Engines:
    """A fake ``fetch``: the ports in ``hang`` never answer until released (or cancelled)."""

    def __init__(self, body: bytes = b"") -> None:
        self.body = body
        self.hang: set[int] = set()
        self.gate = asyncio.Event()
        self.calls: dict[int, int] = {}
        self.cancelled: dict[int, int] = {}
        self.running: dict[int, int] = {}
        self.most_at_once = 0

    async def fetch(self, host, port, path, timeout, **kw):
        self.calls[port] = self.calls.get(port, 0) + 1
        self.running[port] = self.running.get(port, 0) + 1
        self.most_at_once = max(self.most_at_once, self.running[port])
        try:
            if port in self.hang:
                await self.gate.wait()
            return 200, self.body
        except asyncio.CancelledError:
            self.cancelled[port] = self.cancelled.get(port, 0) + 1
            raise
        finally:
            self.running[port] -= 1


def _others() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def _run_loop_edges(monkeypatch, module, start_loop) -> None:
    """One endpoint (a) hangs: b is polled round after round meanwhile, a never twice at once;
    released, a is polled again at once; removed while hanging, its poll is cancelled;
    cancelling the loop cancels what is in flight."""
    a, b = endpoint(), endpoint()
    pa, pb = a.view.port, b.view.port
    listed = [a, b]
    kicks = [0]

    def kick() -> None:
        kicks[0] += 1

    async def go() -> None:
        eng = Engines(b"%s 1\n" % RUN.encode())
        eng.hang.add(pa)
        monkeypatch.setattr(module, "fetch", eng.fetch)
        loop_task = asyncio.create_task(start_loop(lambda: list(listed), lambda: 0.01, kick))
        await until(lambda: eng.calls.get(pb, 0) >= 6)  # the old rounds waited on a for ever
        assert eng.calls[pa] == 1 and kicks[0] >= 3
        eng.gate.set()  # a answers: polled again without waiting for a further round
        await until(lambda: eng.calls[pa] >= 3)
        assert eng.most_at_once == 1

        eng.gate = asyncio.Event()
        await until(lambda: eng.running.get(pa, 0) == 1)  # a hangs again
        listed.remove(a)  # a reload removed it
        await until(lambda: eng.cancelled.get(pa, 0) == 1)
        n, m = eng.calls[pa], eng.calls[pb]
        await until(lambda: eng.calls[pb] >= m + 6)
        assert eng.calls[pa] == n  # no longer polled

        eng.hang.add(pb)
        await until(lambda: eng.running.get(pb, 0) == 1)
        loop_task.cancel()  # the router shuts down
        with pytest.raises(asyncio.CancelledError):
            await loop_task
        assert eng.cancelled.get(pb, 0) == 1 and eng.most_at_once == 1
        assert _others() == []  # nothing left behind

    asyncio.run(go())


def test_a_hanging_scrape_holds_up_no_other_endpoint(monkeypatch):
    def start(endpoints, interval, kick):
        return scrape.scrape_loop(endpoints, interval, time.monotonic, kick)

    _run_loop_edges(monkeypatch, scrape, start)


def test_a_hanging_health_check_holds_up_no_other_endpoint(monkeypatch):
    _run_loop_edges(monkeypatch, health, health.health_loop)


def test_a_healthy_endpoint_stays_fresh_while_another_scrape_hangs(monkeypatch):
    a, b = endpoint(), endpoint()

    async def go() -> None:
        eng = Engines(b"%s 2\n" % RUN.encode())
        eng.hang.add(a.view.port)
        monkeypatch.setattr(scrape, "fetch", eng.fetch)
        task = asyncio.create_task(scrape.scrape_loop(lambda: [a, b], lambda: 0.01, time.monotonic))
        seen: set[float] = set()

        def readings() -> int:
            seen.add(b.scraped.at)
            return len(seen)

        await until(lambda: readings() >= 6)  # new readings keep coming (the first is "never")
        assert b.scraped.running == 2.0 and a.scraped.at < -1e17
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_health_loop_skips_removed_endpoints(monkeypatch):
    a, b = endpoint(), endpoint()
    a.removed = True

    async def go() -> None:
        eng = Engines()
        monkeypatch.setattr(health, "fetch", eng.fetch)
        task = asyncio.create_task(health.health_loop(lambda: [a, b], lambda: 0.01))
        await until(lambda: eng.calls.get(b.view.port, 0) >= 3)
        assert a.view.port not in eng.calls and b.health_ok is True
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


# ---------------------------------------------------------------- the Host header


async def _host_echo(host: str) -> tuple[asyncio.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        hosts = [line[5:].strip() for line in head.split(b"\r\n") if line.lower().startswith(b"host:")]
        body = b"|".join(hosts)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, host, 0)
    return server, server.sockets[0].getsockname()[1]


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_endpoint_gets_a_bracketed_host_header():
    async def go() -> None:
        server, port = await _host_echo("::1")
        async with server:
            status, body = await asyncio.wait_for(fetch("::1", port, "/health", 5.0), GUARD_S)
        assert (status, body) == (200, b"[::1]:%d" % port)

    asyncio.run(go())


def test_an_ipv4_endpoint_host_header_is_unchanged():
    async def go() -> None:
        server, port = await _host_echo("127.0.0.1")
        async with server:
            status, body = await asyncio.wait_for(fetch("127.0.0.1", port, "/metrics", 5.0), GUARD_S)
        assert (status, body) == (200, b"127.0.0.1:%d" % port)

    asyncio.run(go())


def test_host_header_forms():
    from cluster_cli.router.http import host_header

    assert host_header("::1", 8000) == b"[::1]:8000"
    assert host_header("fe80::1%eth0", 80) == b"[fe80::1]:80"
    assert host_header("[::1]", 8000) == b"[::1]:8000"
    assert host_header("engine-0.local", 8000) == b"engine-0.local:8000"


@pytest.mark.parametrize("status_line", [b"HTTP/1.1", b"HTTP/1.1 2000 OK", b"garbage here", b"HTTP/1.1 OK 200"])
def test_a_malformed_status_line_from_an_engine_is_a_value_error_the_scraper_handles(status_line: bytes):
    """An engine's broken answer must read as a failed scrape or health check (ValueError, which
    both handle), not an IndexError that escaped them and left the endpoint's state untouched."""

    async def go() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(status_line + b"\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(ValueError, match="malformed status line"):
                await asyncio.wait_for(fetch("127.0.0.1", port, "/metrics", 5.0), GUARD_S)

    asyncio.run(go())


def test_the_primary_metric_name_wins_over_its_fallback() -> None:
    mapping = MetricMapping.vllm()  # KV cache: current name, then the pre-0.10 one
    primary, legacy = mapping.kv_cache_usage, mapping.names("kv_cache_usage")[1]
    assert resolve({primary: [0.2], legacy: [0.7]}, mapping)[2] == 0.2
    assert resolve({legacy: [0.7]}, mapping)[2] == 0.7


# ---------------------------------------------------------------- prefix-cache counters
def test_engines_prefix_cache_counters_are_read_in_tokens():
    vllm, llama = CACHE_COUNTERS["vllm"], CACHE_COUNTERS["llamacpp"]
    assert cache_reading(
        {"vllm:prefix_cache_hits_total": [30.0], "vllm:prefix_cache_queries_total": [100.0]}, vllm
    ) == (30.0, 100.0)
    old = {"vllm:gpu_prefix_cache_hits_total": [1.0, 2.0], "vllm:gpu_prefix_cache_queries_total": [5.0, 5.0]}
    assert cache_reading(old, vllm) == (3.0, 10.0)  # summed over label sets
    both = {"llamacpp:prompt_tokens_cached_total": [723.0], "llamacpp:prompt_tokens_total": [438.0]}
    assert cache_reading(both, llama) == (723.0, 1161.0)  # processed ones exclude the cached
    assert cache_reading({"llamacpp:prompt_tokens_total": [438.0]}, llama) is None  # an older build: unknown
    assert (
        cache_reading({"vllm:prefix_cache_hits_total": [5.0], "vllm:prefix_cache_queries_total": [4.0]}, vllm) is None
    )
    assert (
        cache_reading({"vllm:prefix_cache_hits_total": [math.nan], "vllm:prefix_cache_queries_total": [4.0]}, vllm)
        is None
    )


def test_a_scrape_keeps_the_cache_counters_and_a_restart_empties_the_cache(monkeypatch):
    w = endpoint()
    _scrape(
        monkeypatch, w, b"%s 1\nvllm:prefix_cache_hits_total 50\nvllm:prefix_cache_queries_total 80\n" % RUN.encode()
    )
    assert w.scraped.cache == (50.0, 80.0)
    gen = w.cache_gen
    _scrape(
        monkeypatch, w, b"%s 1\nvllm:prefix_cache_hits_total 60\nvllm:prefix_cache_queries_total 90\n" % RUN.encode()
    )
    assert w.cache_gen == gen
    _scrape(monkeypatch, w, b"%s 1\nvllm:prefix_cache_hits_total 0\nvllm:prefix_cache_queries_total 9\n" % RUN.encode())
    assert w.cache_gen == gen + 1 and w.scraped.cache == (0.0, 9.0)  # counters went back: a new process
    _scrape(monkeypatch, w, b"", status=503)  # the engine down a while: its scrapes fail
    _scrape(monkeypatch, w, b"%s 1\nvllm:prefix_cache_hits_total 0\nvllm:prefix_cache_queries_total 2\n" % RUN.encode())
    assert w.cache_gen == gen + 2  # back with counters below the last read: another new process
