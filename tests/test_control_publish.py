"""The one router-config writer: under the config's lock, from the state as it is then, the
catalog's metric mappings kept, replicas being stopped published draining."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_cli.control.publish import publish
from cluster_cli.errors import ConfigError
from cluster_cli.facts import Replica, Shard
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import READY, ReplicaRecord, ShardRun
from cluster_cli.state.store import Store


def _ready(s: Store, n: int) -> ReplicaRecord:
    (rec,) = s.reserve([ReplicaRecord(Replica("m", n, "p", "llamacpp", (Shard(f"n{n}"),)), port=8100)]).records
    run = ShardRun(f"n{n}", "~/r", f"m/{n}.g1.s0")
    return s.observe(replace(rec, status=READY, endpoint=f"http://n{n}:8100", shards=(run,)))


def _endpoints(path: Path) -> list[tuple[str, bool]]:
    doc = yaml.safe_load(path.read_text())
    return [(e["replica"], bool(e.get("draining"))) for m in doc["models"].values() for e in m["endpoints"]]


def test_a_writer_that_waited_for_the_lock_writes_the_state_as_it_is_then(tmp_path: Path) -> None:
    """A publication decided before a change but held up by another writer's lock never
    writes the older picture: it reads the state once it holds the lock."""
    rc = tmp_path / "router.yaml"
    with Store(tmp_path / "s.db") as s, Store(tmp_path / "s.db") as other:
        _ready(s, 0)
        fd = os.open(rc.with_name("router.yaml.lock"), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another clusterctl is publishing

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                waiting = asyncio.create_task(publish(astore, rc))
                await asyncio.sleep(0.2)
                assert not waiting.done()
                _ready(other, 1)  # the state moves on meanwhile
                fcntl.flock(fd, fcntl.LOCK_UN)
                return await waiting

        try:
            done = asyncio.run(go())
        finally:
            os.close(fd)
        assert done.endpoints == 2 and _endpoints(rc) == [("m/0", False), ("m/1", False)]


def test_a_replica_being_stopped_is_published_draining_then_left_out(tmp_path: Path) -> None:
    rc = tmp_path / "router.yaml"
    with Store(tmp_path / "s.db") as s:
        a, _b = _ready(s, 0), _ready(s, 1)
        stopping = s.want_down(a, owner="run-1")

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await publish(astore, rc)

        got = asyncio.run(go())
        assert (got.endpoints, got.draining) == (1, 1)
        assert _endpoints(rc) == [("m/0", True), ("m/1", False)]
        s.release(stopping, wanted_down=True)
        asyncio.run(go())
        assert _endpoints(rc) == [("m/1", False)]


def test_a_lock_held_too_long_is_a_one_line_error_naming_the_config(tmp_path: Path, monkeypatch: Any) -> None:
    import cluster_cli.control.publish as pub

    rc = tmp_path / "router.yaml"
    fd = os.open(rc.with_name("router.yaml.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    monkeypatch.setattr(pub, "LOCK_WAIT_S", 0.2)
    with Store(tmp_path / "s.db") as s:

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await pub.publish(astore, rc)

        try:
            with pytest.raises(
                ConfigError, match=r"router\.yaml: another clusterctl has held the router config's lock"
            ):
                asyncio.run(go())
        finally:
            os.close(fd)


def test_a_publication_waits_until_the_routers_here_loaded_it(tmp_path: Path) -> None:
    """A router serving the config on this host says which config it loaded: the publisher
    waits for it (a bound), and says how many routers confirmed. A dead router's file counts
    for nothing and is cleared."""
    import subprocess
    import sys

    from cluster_cli.router import serving

    rc = tmp_path / "router.yaml"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    d = serving.folder(rc)
    d.mkdir()
    pid = int(dead.stdout)
    (d / f"{pid}.json").write_text(json.dumps({"pid": pid, "url": "x", "written_at": 1}))
    with Store(tmp_path / "s.db") as s:
        _ready(s, 0)
        serving.write(rc, url="http://127.0.0.1:1", config_sha256="an older config", loaded_at=1.0, draining={})

        async def go(router_loads: bool) -> Any:
            async with AsyncStore(s) as astore:
                task = asyncio.create_task(publish(astore, rc, confirm_s=2.0 if router_loads else 0.3))
                if router_loads:  # the router's watch picks the file up a moment later
                    await asyncio.sleep(0.2)
                    serving.write(rc, url="http://127.0.0.1:1", config_sha256=serving.digest(rc.read_bytes()),
                                  loaded_at=2.0, draining={})  # fmt: skip
                return await task

        late = asyncio.run(go(router_loads=False))
        assert (late.routers, late.confirmed) == (1, 0)
        _ready(s, 1)  # a new config to publish
        ok = asyncio.run(go(router_loads=True))
        assert (ok.routers, ok.confirmed) == (1, 1)
    assert [p.name for p in d.glob("*.json")] == [f"{os.getpid()}.json"]  # the dead one's file is gone


def test_drained_waits_until_no_router_has_a_request_in_flight_on_the_replicas(tmp_path: Path) -> None:
    from cluster_cli.control.publish import drained
    from cluster_cli.router import serving

    rc = tmp_path / "router.yaml"

    async def go() -> Any:
        serving.write(rc, url="u", config_sha256="c", loaded_at=1.0, draining={"m/0": 2, "m/1": 1})
        waiting = asyncio.create_task(drained(rc, {"m/0"}, wait_s=5))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        serving.write(rc, url="u", config_sha256="c", loaded_at=1.0, draining={"m/0": 0, "m/1": 1})
        return await waiting, await drained(rc, {"m/1"}, wait_s=0.2)

    assert asyncio.run(go()) == ({}, {"m/1": 1})  # m/1 still has one after its bound
    serving.remove(rc)
    assert asyncio.run(drained(rc, {"m/1"}, wait_s=5)) == {}  # no router here: nothing to wait for


@pytest.mark.slow
def test_a_real_router_confirms_what_was_published_and_clears_its_file_when_it_stops(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    from cluster_cli.router import serving

    rc = tmp_path / "router.yaml"
    rc.write_text("models: {}\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # It would look at the file again only in a minute: the publisher's SIGHUP has it reload now.
    proc = subprocess.Popen([sys.executable, "-m", "cluster_cli", "serve-router", "-c", str(rc), "--port", str(port),
                             "--watch-interval", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not serving.running(rc):
            assert time.monotonic() < deadline and proc.poll() is None, "serve-router did not announce itself"
            time.sleep(0.1)
        (r,) = serving.running(rc)
        assert (r.pid, r.url, r.config_sha256) == (
            proc.pid,
            f"http://127.0.0.1:{port}",
            serving.digest(rc.read_bytes()),
        )
        with Store(tmp_path / "s.db") as s:
            _ready(s, 0)

            async def go() -> Any:
                async with AsyncStore(s) as astore:
                    return await publish(astore, rc)

            got = asyncio.run(go())
        assert (got.routers, got.confirmed, got.endpoints) == (1, 1, 1)
        assert serving.running(rc)[0].config_sha256 == serving.digest(rc.read_bytes())
    finally:
        proc.terminate()
        proc.wait(30)
    assert serving.running(rc) == [] and not list(serving.folder(rc).glob("*.json"))


def test_the_publisher_signals_no_process_that_is_not_a_router(tmp_path: Path) -> None:
    """A serving file whose PID is not a serve-router (this test's own process: a dead
    router's PID reused) gets no SIGHUP, which would end it."""
    from cluster_cli.router import serving

    rc = tmp_path / "router.yaml"
    serving.write(rc, url="u", config_sha256="c", loaded_at=1.0, draining={})
    with Store(tmp_path / "s.db") as s:
        _ready(s, 0)

        async def go() -> Any:
            async with AsyncStore(s) as astore:
                return await publish(astore, rc, confirm_s=0.2)

        got = asyncio.run(go())  # still here: not signalled
    assert (got.routers, got.confirmed) == (1, 0)
    serving.remove(rc)
