"""Live reload: file watch and trigger (SIGHUP), live state carried over, bad configs rejected, a retry
across a reload, a config file that appears only after the start."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest
import yaml
from simengine import Fleet

from cluster_cli.router.app import Router
from cluster_cli.router.breaker import State
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.source import FileSource, WatchedFile

MSG = [{"role": "user", "content": "hello"}]


def _cfg(f: Fleet, idx: list[int], **extra) -> dict:
    eps = [{"url": f.engines[i].url, "engine": "vllm", "replica": f"r{i}", **extra.get(str(i), {})} for i in idx]
    return {"models": {"sim": {"endpoints": eps}}, "router": {"scrape_interval_s": 0.1, "health_interval_s": 0.2}}


@pytest.mark.slow
def test_reload_carries_live_state_and_retires_removed(tmp_path):
    f = Fleet(3, capacity=4, token_delay_s=0.02, tokens=1000)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0, 1])))
    src = FileSource(path, interval=0.05)
    f.start(cfg=_cfg(f, [0, 1]), source=src)
    a_url, b_url, c_url = (e.url for e in f.engines)
    try:
        wa = f.router.table.endpoints[a_url]
        wb = f.router.table.endpoints[b_url]
        # a long stream pinned to A (B's breaker held open), then some live state on A
        body = json.dumps({"model": "sim", "messages": MSG, "stream": True}).encode()
        f.lt.call(lambda: setattr(wb.breaker, "state", State.OPEN) or setattr(wb.breaker, "opened_at", 1e18))
        with httpx.stream("POST", f.base + "/chat/completions", content=body, timeout=30) as r:
            lines = r.iter_lines()
            assert "lorem" in next(line for line in lines if line.startswith("data: "))
            assert f.lt.call(lambda: wa.inflight) == 1
            f.lt.call(lambda: (setattr(wa.breaker, "failures", 2), setattr(wa, "drain_rate", 7.5)))

            path.write_text(yaml.safe_dump(_cfg(f, [0, 2], **{"0": {"replica": "renamed"}})))  # B out, C in
            f.lt.wait_for(lambda: c_url in f.router.table.endpoints, what="reload")
            assert f.router.table.endpoints[a_url] is wa  # same live object
            assert f.lt.call(lambda: (wa.inflight, wa.breaker.failures, wa.drain_rate, wa.view.replica)) == (
                1,
                2,
                7.5,
                "renamed",
            )
            assert wb.removed and b_url not in f.router.table.endpoints
            wc = f.router.table.endpoints[c_url]
            assert (wc.inflight, wc.breaker.state, wc.cap) == (0, State.CLOSED, None)  # cold
        f.lt.wait_for(lambda: wa.inflight == 0, what="in-flight released when the client left")
        f.lt.wait_for(lambda: wb not in f.router.table.retired, what="removed endpoint retired")
        for _ in range(4):
            r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "max_tokens": 1})
            assert r.status_code == 200
        assert f.engines[1].requests == 0  # B got nothing while open, and nothing after removal
    finally:
        f.close()


@pytest.mark.slow
def test_reload_finishes_inflight_on_removed_endpoint(tmp_path):
    f = Fleet(2, capacity=4, token_delay_s=0.02, tokens=30)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0])))
    src = FileSource(path, interval=0.05)
    f.start(cfg=_cfg(f, [0]), source=src)
    try:
        body = {"model": "sim", "messages": MSG, "stream": True}
        with httpx.stream("POST", f.base + "/chat/completions", json=body, timeout=30) as r:
            events = r.iter_lines()
            assert next(e for e in events if e.startswith("data: "))
            path.write_text(yaml.safe_dump(_cfg(f, [1])))
            f.lt.wait_for(lambda: f.engines[1].url in f.router.table.endpoints, what="reload")
            rest = [e for e in events if e.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the removed endpoint finished its stream
        r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG, "max_tokens": 1})
        assert r.status_code == 200 and f.engines[1].served == 1
    finally:
        f.close()


@pytest.mark.slow
def test_bad_config_is_rejected_and_old_one_keeps_serving(tmp_path):
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0])))
    src = FileSource(path, interval=0.05)
    f.start(cfg=_cfg(f, [0]), source=src)
    try:
        path.write_text("models: {sim: {endpoints: [{url: 'ftp://x'}]}}\n")
        f.lt.wait_for(lambda: f.router.reloads_rejected >= 1, what="rejection")
        resp = httpx.get(f.url + "/health")
        health = resp.json()
        assert "only http:// upstreams" in health["last_reload_error"] and "router.yaml" in health["last_reload_error"]
        assert resp.status_code == 200 and health["status"] == "degraded" and health["unavailable_models"] == []
        r = httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG})
        assert r.status_code == 200
        assert 'clusterctl_router_config_reloads_total{result="rejected"}' in httpx.get(f.url + "/metrics").text
        path.write_text(yaml.safe_dump(_cfg(f, [0])))  # fixed: accepted, the error clears
        f.lt.wait_for(lambda: f.router.reloads_ok >= 1, what="reload")
        health = httpx.get(f.url + "/health").json()
        assert health["status"] == "ok" and health["last_reload_error"] is None
    finally:
        f.close()


def test_trigger_forces_a_reread(tmp_path):
    """SIGHUP calls trigger(): the file is read even when its stamp did not change."""
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0])))
    src = FileSource(path, interval=3600)
    f.start(cfg=_cfg(f, [0]), source=src)
    try:
        f.lt.call(src.trigger)
        f.lt.wait_for(lambda: f.router.reloads_ok == 1, what="reload on trigger")
    finally:
        f.close()


def test_model_added_and_removed(tmp_path):
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    cfg = _cfg(f, [0])
    path.write_text(yaml.safe_dump(cfg))
    f.start(cfg=cfg, source=FileSource(path, interval=0.05))
    try:
        cfg2 = {"models": {"other": cfg["models"]["sim"]}, "router": cfg["router"]}
        path.write_text(yaml.safe_dump(cfg2))
        f.lt.wait_for(lambda: "other" in f.router.table.models, what="reload")
        assert [m["id"] for m in httpx.get(f.base + "/models").json()["data"]] == ["other"]
        assert httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG}).status_code == 404
    finally:
        f.close()


@pytest.mark.slow
def test_a_file_pyyaml_cannot_build_is_rejected_and_watching_goes_on(tmp_path):
    f = Fleet(1, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0])))
    f.start(cfg=_cfg(f, [0]), source=FileSource(path, interval=0.05))
    try:
        for n, bad in enumerate(("models: {[1, 2]: x}\n", "models: {m: {endpoints: [{replica: 2024-13-01}]}}\n"), 1):
            path.write_text(bad)
            f.lt.wait_for(lambda n=n: f.router.reloads_rejected == n, what="rejection")
            assert "invalid YAML" in f.router.last_reload_error
        path.write_text(yaml.safe_dump(_cfg(f, [0], **{"0": {"replica": "back"}})))
        f.lt.wait_for(lambda: f.router.reloads_ok == 1, what="the watcher still running")
        assert next(iter(f.router.table.endpoints.values())).view.replica == "back"
    finally:
        f.close()


def test_a_rewrite_that_keeps_size_and_mtime_is_seen(tmp_path):
    """Same length, mtime put back (cp -p, rsync -t, or a coarse clock): the bytes differ."""
    import os

    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0, 1], **{"0": {"draining": False}})))
    st = path.stat()
    f.start(cfg=_cfg(f, [0, 1], **{"0": {"draining": False}}), source=FileSource(path, interval=0.05))
    try:
        text = path.read_text().replace("draining: false", "draining: true ")
        assert len(text) == st.st_size
        path.write_text(text)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        f.lt.wait_for(lambda: f.router.reloads_ok == 1, what="reload")
        assert f.lt.call(lambda: f.router.table.endpoints[f.engines[0].url].view.draining) is True
    finally:
        f.close()


def test_a_file_still_being_written_is_read_once_it_holds_still(tmp_path):
    """A writer that appends in steps (no rename): the watcher never applies a step."""
    import asyncio

    from cluster_cli.router.source import WatchedFile

    path = tmp_path / "keys.txt"
    path.write_text("a\n")

    async def go() -> list[bytes | None]:
        w = WatchedFile(path, interval=0.01, settle=0.08)
        seen: list[bytes | None] = []

        async def writer() -> None:
            await asyncio.sleep(0.05)
            for step in (b"a\nb\n", b"a\nb\nc\n", b"a\nb\nc\nd\n"):
                path.write_bytes(step)
                await asyncio.sleep(0.02)  # each step well inside the settle time

        task = asyncio.create_task(writer())
        async for data, _why in w.changes():
            seen.append(data)
            break
        await task
        return seen

    assert asyncio.run(go()) == [b"a\nb\nc\nd\n"]


def test_a_write_just_after_the_watcher_read_the_file_is_not_lost(tmp_path, monkeypatch):
    """A write landing right after the watcher read the file (and before it recorded what
    it read) is reported at the next poll, never taken as already seen."""
    import asyncio

    from cluster_cli.router import source

    path = tmp_path / "keys.txt"
    path.write_bytes(b"v1\n")
    real_read = source._read
    v2_reads = []

    def read(p):
        content = real_read(p)
        if content[0] == b"v2\n":
            v2_reads.append(1)
            if len(v2_reads) == 2:  # the settle read that agrees: a writer lands right after it
                p.write_bytes(b"v3\n")
        return content

    monkeypatch.setattr(source, "_read", read)

    async def go() -> list[bytes | None]:
        w = source.WatchedFile(path, interval=0.02, settle=0.02)
        w.read()
        seen: list[bytes | None] = []
        path.write_bytes(b"v2\n")
        async for data, _why in w.changes():
            seen.append(data)
            if data == b"v3\n" or len(seen) > 3:
                break
        return seen

    assert asyncio.run(asyncio.wait_for(go(), 10)) == [b"v2\n", b"v3\n"]


@pytest.mark.slow
def test_a_config_and_keys_from_pipes_serve(tmp_path):
    """`--config <(...)` and `--api-keys-file <(...)` read once; a pipe is not watched."""
    import subprocess
    import sys
    import threading
    import time

    cfg = tmp_path / "r.yaml"
    cfg.write_text("models: {a: {endpoints: [{url: 'http://127.0.0.1:9'}]}}\n")
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    cli = f"{sys.executable} -c 'from cluster_cli.cli.main import run; run()'"
    cmd = (f"exec {cli} serve-router --config <(cat {cfg}) --api-keys-file <(printf 'k1\\n') "
           f"--port {port} --access-log off --watch-interval 0.1 --log-level info")  # fmt: skip
    proc = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        codes: tuple[int, int] | None = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/v1/models"
                codes = (httpx.get(url, headers={"Authorization": "Bearer k1"}, timeout=2).status_code,
                         httpx.get(url, headers={"Authorization": "Bearer k2"}, timeout=2).status_code)  # fmt: skip
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert codes == (200, 401)
        # Both watchers saw a pipe and stopped there, for good: nothing will re-read them.
        deadline = time.monotonic() + 30
        while sum("is not a regular file: not watched" in line for line in list(lines)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        health = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": "Bearer k1"}, timeout=2).json()
        assert health["last_keys_error"] is None and health["last_reload_error"] is None
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k1"},
                         timeout=2).status_code == 200  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(30)
    err = "".join(lines)
    assert proc.returncode == 0, err
    reread = ("config reloaded", "config rejected", "API keys reloaded", "API keys not reloaded", " failed")
    assert not [line for line in lines if any(w in line for w in reread)], err  # never re-read


def test_a_fifo_or_an_oversized_file_in_place_of_the_config_is_refused_not_waited_on(tmp_path, monkeypatch):
    """A FIFO put where the file was would block a plain read until a writer came: the
    router would stop answering. It is refused at once, and so is a file over the limit."""
    import asyncio
    import os

    from cluster_cli.router import source

    monkeypatch.setattr(source, "MAX_BYTES", 1000)
    path = tmp_path / "keys.txt"
    path.write_bytes(b"k1\n")

    async def go() -> list[tuple[bytes | None, str | None]]:
        w = source.WatchedFile(path, interval=0.02, settle=0.02)
        seen: list[tuple[bytes | None, str | None]] = []
        path.unlink()
        os.mkfifo(path)  # nobody ever writes to it
        async for content in w.changes():
            seen.append(content)
            if len(seen) == 1:
                path.unlink()
                path.write_bytes(b"x" * 1001)
            else:
                break
        return seen

    assert asyncio.run(asyncio.wait_for(go(), 10)) == [(None, "not a regular file"), (None, "larger than 0 MiB")]


def test_a_read_that_fails_in_an_unexpected_way_is_reported_and_watching_goes_on(tmp_path, monkeypatch):
    import asyncio

    from cluster_cli.router import source

    path = tmp_path / "keys.txt"
    path.write_bytes(b"k1\n")
    fail = [True]

    def flaky_open(file, *args, **kwargs):
        if fail[0] and str(file) == str(path):
            fail[0] = False
            raise MemoryError
        return open(file, *args, **kwargs)

    async def go() -> list[tuple[bytes | None, str | None]]:
        w = source.WatchedFile(path, interval=0.02, settle=0.02)
        monkeypatch.setattr(source, "open", flaky_open, raising=False)
        path.write_bytes(b"k2\n")
        seen: list[tuple[bytes | None, str | None]] = []
        async for content in w.changes():
            seen.append(content)
            if content[0] is not None:
                break
        return seen

    seen = asyncio.run(asyncio.wait_for(go(), 10))
    assert fail == [False]  # the read did fail once
    assert seen[-1] == (b"k2\n", None)


@pytest.mark.slow
def test_the_start_and_the_watching_read_a_file_alike(tmp_path, monkeypatch):
    """A file the watcher would refuse (here: over the size limit) is refused at the start
    too, and an untouched file is never reported, full re-reads included."""
    import asyncio

    import pytest

    from cluster_cli.errors import ConfigError
    from cluster_cli.router import source

    path = tmp_path / "router.yaml"
    path.write_text("models: {a: {endpoints: [{url: 'http://127.0.0.1:9'}]}}\n")
    assert source.FileSource(path).load().models
    monkeypatch.setattr(source, "MAX_BYTES", 20)
    with pytest.raises(ConfigError, match=r"router\.yaml: larger than"):
        source.FileSource(path).load()

    async def go() -> None:
        w = source.WatchedFile(path, interval=0.01, settle=0.01)
        assert w.read() == (None, "larger than 0 MiB")
        with pytest.raises(TimeoutError):  # 50 polls, 5 of them full reads: nothing new
            await asyncio.wait_for(w.changes().__anext__(), 0.5)

    asyncio.run(go())


def test_a_stuck_filesystem_holds_neither_the_loop_nor_the_exit(tmp_path, monkeypatch):
    """Stat and read run in daemon threads: a read that hangs (a dead NFS server) does not
    stall the event loop, and a router that stops does not wait for it."""
    import asyncio
    import threading

    from cluster_cli.router import source

    path = tmp_path / "keys.txt"
    path.write_bytes(b"k1\n")
    stuck = threading.Event()
    threads: set[str] = set()
    real_stamp = source._stamp

    def stamp(p):
        threads.add(threading.current_thread().name)
        return real_stamp(p)

    def read(p):
        threads.add(threading.current_thread().name)
        stuck.wait(30)  # released at the end of the test
        return None, "stuck"

    async def go() -> None:
        w = source.WatchedFile(path, interval=0.01)
        monkeypatch.setattr(source, "_stamp", stamp)
        monkeypatch.setattr(source, "_read", read)
        w.trigger()
        task = asyncio.create_task(w.changes().__anext__())
        await asyncio.sleep(0.3)  # the loop runs on while the read hangs
        assert not task.done()
        task.cancel()

    try:
        asyncio.run(go())  # returns although the read still hangs
        assert not stuck.is_set()
        assert threads and threading.main_thread().name not in threads
    finally:
        stuck.set()


def test_a_fifo_is_refused_without_opening_it(tmp_path):
    """Opening a FIFO would release a writer waiting on it, and closing it break that writer."""
    import os
    import threading

    from cluster_cli.router.source import _read

    fifo = tmp_path / "keys.txt"
    os.mkfifo(fifo)
    wrote: list[int] = []
    writer = threading.Thread(target=lambda: wrote.append(fifo.open("wb").write(b"payload")), daemon=True)
    writer.start()
    assert _read(fifo) == (None, "not a regular file")
    writer.join(0.3)
    assert writer.is_alive()  # still waiting for a reader: untouched
    with fifo.open("rb") as r:
        assert r.read() == b"payload"
    writer.join(5)
    assert wrote == [7]


@pytest.mark.slow
def test_draining_closes_the_endpoints_kept_connections_and_unused_ones_expire(tmp_path, monkeypatch):
    """A drained endpoint's engine may be replaced before it is undrained: its kept-alive
    connections (to the old process, which may still hold them open) are closed when it is
    drained, not reused after. Elsewhere a kept connection unused for longer than engines
    keep theirs is closed too, instead of being reused just as the engine closes it."""
    import cluster_cli.router.lifecycle as app_mod

    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(_cfg(f, [0, 1])))
    f.start(cfg=_cfg(f, [0, 1]), source=FileSource(path, interval=0.05))
    w0, w1 = (f.router.table.endpoints[e.url] for e in f.engines)
    try:
        with httpx.Client() as client:
            for _ in range(40):  # until both endpoints have served (ties go either way)
                r = client.post(f.base + "/chat/completions", json={"model": "sim", "messages": MSG})
                assert r.status_code == 200
                if f.lt.call(lambda: bool(w0.pool.idle and w1.pool.idle)):
                    break
        assert w0.pool.idle and w1.pool.idle  # both kept connections after their requests
        path.write_text(yaml.safe_dump(_cfg(f, [0, 1], **{"0": {"draining": True}})))
        f.lt.wait_for(lambda: w0.view.draining, what="drain")
        f.lt.wait_for(lambda: not w0.pool.idle, what="the drained endpoint's connections closed")
        assert w1.pool.idle  # the other endpoint keeps its own
        monkeypatch.setattr(app_mod, "IDLE_KEEP_S", 0.2)
        f.lt.wait_for(lambda: not w1.pool.idle, what="unused connections closed")
    finally:
        f.close()


def _retries(r: Router) -> dict[str, float]:
    """The router's retry counter, by reason."""
    return {
        s.labels["reason"]: s.value
        for m in r.metrics.registry.collect()
        for s in m.samples
        if s.name == "clusterctl_router_retries_total"
    }


@pytest.mark.slow
def test_a_retry_after_a_reload_uses_the_new_endpoints() -> None:
    f = Fleet(2, capacity=4, token_delay_s=0.001, tokens=2)
    old, new = f.engines
    cfg = f.config(router={"limits": {"idle_timeout_s": 1.0}})
    eps = cfg["models"]["sim"]["endpoints"]
    f.start(cfg={**cfg, "models": {"sim": {"endpoints": [eps[0]]}}})
    try:
        f.lt.call(lambda: setattr(old, "hang", True))
        res: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: res.setdefault(
            "r", httpx.post(f.base + "/chat/completions", json={"model": "sim", "messages": [], "stream": True},
                            timeout=10)))  # fmt: skip
        t.start()
        # The request hangs on the old endpoint; a reload swaps in the new one.
        f.lt.wait_for(lambda: old.requests == 1, what="the request to reach the old endpoint")
        new_cfg = RouterConfig.model_validate({**cfg, "models": {"sim": {"endpoints": [eps[1]]}}})
        f.lt.call(lambda: f.router.reload(new_cfg))
        t.join(30)
        assert not t.is_alive(), "the request never ended"
        assert res["r"].status_code == 200, res["r"].text
        # The old endpoint timed out (idle timeout: a stream's head comes at once) without
        # answering; the retry went to the new one.
        assert f.lt.call(lambda: (old.requests, old.served, new.requests, new.served)) == (1, 0, 1, 1)
        assert f.lt.call(lambda: _retries(f.router)) == {"timeout": 1.0}
    finally:
        f.close()


def test_a_config_file_missing_at_start_is_picked_up_when_it_appears(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"

    async def scenario() -> bytes | None:
        wf = WatchedFile(path, interval=0.05, settle=0.01)
        it = wf.changes().__aiter__()
        path.write_bytes(b"models: {}\n")
        content, _why = await asyncio.wait_for(it.__anext__(), 10)
        return content

    assert asyncio.run(scenario()) == b"models: {}\n"
