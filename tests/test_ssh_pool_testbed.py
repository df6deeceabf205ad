"""One node's connection under load and under faults, on real sshd nodes of the testbed.

The testbed's sshd runs with OpenSSH's default ``MaxSessions`` (10 sessions per connection),
as a stock node does: a session holds its commands to ``max_channels`` and asks again for a
channel sshd refused. Keepalive notices a node that stopped answering, and ``Sessions``
opens a new connection when the node is back.
"""

from __future__ import annotations

import asyncio
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_cli.config.inventory import load_inventory
from cluster_cli.errors import SSHError
from cluster_cli.ssh.channels import AsyncsshSession
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.pool import Sessions


def _inventory(src: Path, **defaults: Any) -> Path:
    """A copy of a testbed inventory, in the same folder, with some defaults changed."""
    data = yaml.safe_load(src.read_text())
    data["defaults"].update(defaults)
    p = src.parent / "inv-pool.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _fast() -> AsyncsshConnector:
    """Keepalive every second, dropped after 3 s of silence."""
    return AsyncsshConnector(keepalive_interval_s=1.0, keepalive_count_max=2)


def test_twelve_commands_at_once_on_one_connection(testbed_factory) -> None:
    """sshd allows 10 sessions per connection. Before the limit, 2 of these 12 failed
    with "n: cannot open a channel: open failed"; now 8 run at once, then the other 4."""
    c = testbed_factory("n=cpu-only")
    assert "MaxSessions" not in c.node("n").config_path.read_text()  # sshd's default: 10
    inv = load_inventory(c.inventory_path)

    async def go() -> tuple[list[Any], float]:
        async with AsyncsshConnector().session(inv.ssh_target(inv.node("n"))) as s:
            t0 = time.monotonic()
            res = await asyncio.gather(*(s.run_raw("sleep 1; echo ok", timeout=20) for _ in range(12)),
                                       return_exceptions=True)  # fmt: skip
            return res, time.monotonic() - t0

    res, took = asyncio.run(go())
    assert [r if isinstance(r, BaseException) else r[:2] for r in res] == [(0, b"ok\n")] * 12
    assert 1.9 < took < 10, took  # two rounds: 8, then 4


def test_a_steady_stream_of_short_commands_is_never_refused(testbed_factory) -> None:
    # sshd counts a session until it has read our close, a moment after we saw the command
    # end: a full pool of back-to-back commands is refused now and then ("open failed"),
    # and each refused one is asked for again.
    c = testbed_factory("n=cpu-only")
    inv = load_inventory(c.inventory_path)

    async def go() -> list[Any]:
        async with AsyncsshConnector(max_channels=10).session(inv.ssh_target(inv.node("n"))) as s:

            async def worker() -> list[Any]:
                return [await s.run_raw("echo ok", timeout=20) for _ in range(10)]

            return await asyncio.gather(*(worker() for _ in range(12)), return_exceptions=True)

    res = asyncio.run(go())
    assert all(not isinstance(r, BaseException) for r in res), [r for r in res if isinstance(r, BaseException)]
    assert [x[:2] for r in res for x in r] == [(0, b"ok\n")] * 120


# On the node: accept connections on 127.0.0.1:PORT, greet each and hold it; gone after 30 s idle.
_LISTENER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(64)
s.settimeout(30)
held = []
while True:
    c, _ = s.accept()
    c.sendall(b"hi\\n")
    held.append(c)
"""


def test_forwarded_connections_are_not_counted_as_sessions(testbed_factory) -> None:
    # MaxSessions counts shells and commands, not TCP forwarding: 16 connections to a port
    # of the node stay open beside a full pool of commands. (Not to its sshd's own port:
    # its MaxStartups would drop unauthenticated connections past 10.)
    c = testbed_factory("n=cpu-only")
    inv = load_inventory(c.inventory_path)
    port = _free_port()

    async def go() -> tuple[list[bytes], list[Any]]:
        async with AsyncsshConnector().session(inv.ssh_target(inv.node("n"))) as s:
            assert isinstance(s, AsyncsshSession)
            start = f"{shlex.quote(sys.executable)} -c {shlex.quote(_LISTENER)} {port} </dev/null >/dev/null 2>&1 &"
            assert (await s.run_raw(start, timeout=10))[0] == 0
            for _ in range(100):  # until it listens
                try:
                    _, w = await s.open_connection("127.0.0.1", port)
                    w.close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            streams = await asyncio.gather(*(s.open_connection("127.0.0.1", port) for _ in range(16)))
            greetings = [await r.readline() for r, _ in streams]
            res = await asyncio.gather(*(s.run_raw("echo ok", timeout=20) for _ in range(8)), return_exceptions=True)
            for _, w in streams:
                w.close()
            return greetings, res

    greetings, res = asyncio.run(go())
    assert greetings == [b"hi\n"] * 16
    assert [r if isinstance(r, BaseException) else r[:2] for r in res] == [(0, b"ok\n")] * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_killed_and_revived_node_is_reconnected(testbed_factory) -> None:
    c = testbed_factory("n=cpu-only")
    inv = load_inventory(c.inventory_path)

    async def go() -> None:
        async with Sessions(inv, _fast()) as sessions:
            s = await sessions.get("n")
            assert (await s.run("echo ok", timeout=10)).stdout == "ok\n"
            c.kill("n")
            await asyncio.wait_for(s.wait_closed(), 10)  # type: ignore[attr-defined]
            c.revive("n")
            again = await sessions.get("n")  # the same Sessions: a new connection
            assert again is not s and (await again.run("echo back", timeout=10)).stdout == "back\n"

    asyncio.run(go())


def test_a_long_lived_sessions_finds_a_revived_node_after_its_backoff(testbed_factory) -> None:
    c = testbed_factory("n=cpu-only")
    inv = load_inventory(c.inventory_path)

    async def go() -> None:
        async with Sessions(inv, _fast(), retry_failed=True, backoff_s=1.0) as sessions:
            s = await sessions.get("n")
            c.kill("n")
            await asyncio.wait_for(s.wait_closed(), 10)  # type: ignore[attr-defined]
            errors = await asyncio.gather(*(sessions.get("n") for _ in range(5)), return_exceptions=True)
            assert all(e is errors[0] for e in errors), errors  # one attempt, its error to all
            assert isinstance(errors[0], SSHError) and "connection refused" in str(errors[0])
            with pytest.raises(SSHError) as remembered:  # within the backoff: no new attempt
                await sessions.get("n")
            assert remembered.value is errors[0]
            c.revive("n")
            loop = asyncio.get_running_loop()
            await asyncio.sleep(max(0.0, sessions._retry_at["n"] - loop.time()))
            again = await sessions.get("n")
            assert (await again.run("echo back", timeout=10)).stdout == "back\n"

    asyncio.run(go())


def test_a_partitioned_node_is_noticed_by_keepalive_and_reconnected_after_heal(testbed_factory) -> None:
    c = testbed_factory("n=cpu-only")
    inv = load_inventory(_inventory(c.inventory_path, connect_timeout_s=2))

    async def go() -> float:
        async with Sessions(inv, _fast(), retry_failed=True, backoff_s=0.2) as sessions:
            s = await sessions.get("n")
            c.partition("n")
            t0 = time.monotonic()
            await asyncio.wait_for(s.wait_closed(), 15)  # type: ignore[attr-defined]
            noticed = time.monotonic() - t0
            try:
                await sessions.get("n")
                raise AssertionError("a partitioned node answered")
            except SSHError as e:
                assert "timed out" in str(e) or "no answer" in str(e), e
            c.heal("n")
            await asyncio.sleep(0.5)  # past the first backoff
            again = await sessions.get("n")
            assert again is not s and (await again.run("echo back", timeout=10)).stdout == "back\n"
            return noticed

    noticed = asyncio.run(go())
    assert noticed < 6, noticed  # 3 s of silence, give or take a keepalive interval
