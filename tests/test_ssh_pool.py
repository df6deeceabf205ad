"""One node's connection as a pool of channels, and Sessions that heal (no testbed).

A session runs at most ``max_channels`` commands at once and asks again for a channel the
server refused; keepalive drops a peer that stopped answering. Against in-process asyncssh
servers on loopback that count their sessions. ``Sessions`` reopens an ended connection
and backs off from a node that failed, against a fake connector.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from cluster_cli.config.inventory import Inventory, SSHTarget
from cluster_cli.errors import SSHError
from cluster_cli.ssh.channels import DEFAULT_MAX_CHANNELS, AsyncsshSession
from cluster_cli.ssh.connect import AsyncsshConnector
from cluster_cli.ssh.pool import Sessions


@dataclass
class _Count:
    """Sessions the server has open: counted from the open request to the channel's end."""

    limit: int | None = None  # the server's MaxSessions; None: no limit
    hold_s: float = 0.1  # how long each command runs
    open: int = 0
    peak: int = 0
    refused: int = 0
    conns: list[asyncssh.SSHServerConnection] = field(default_factory=list)


class _Command(asyncssh.SSHServerSession):  # type: ignore[type-arg]
    def __init__(self, count: _Count) -> None:
        self._count = count

    def connection_made(self, chan: Any) -> None:
        self._chan = chan

    def exec_requested(self, command: str) -> bool:
        return True

    def session_started(self) -> None:
        asyncio.get_running_loop().call_later(self._count.hold_s, self._finish)

    def _finish(self) -> None:
        self._chan.write(b"ok\n")
        self._chan.exit(0)

    def connection_lost(self, exc: Exception | None) -> None:
        self._count.open -= 1


def _server(count: _Count) -> type[asyncssh.SSHServer]:
    class Server(asyncssh.SSHServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            count.conns.append(conn)

        def begin_auth(self, username: str) -> bool:
            return True  # public key auth, against authorized_client_keys

        def session_requested(self) -> Any:
            if count.limit is not None and count.open >= count.limit:
                count.refused += 1
                raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, "open failed")  # as sshd says it
            count.open += 1
            count.peak = max(count.peak, count.open)
            return _Command(count)

    return Server


@asynccontextmanager
async def _node(tmp: Path, count: _Count) -> AsyncIterator[SSHTarget]:
    """An SSH server on loopback that runs every command as ``count`` says; yields its target."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(tmp / "id"))
    key.write_public_key(str(tmp / "id.pub"))
    (tmp / "ssh_config").write_text("")  # never the user's own ~/.ssh/config
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    srv = await asyncssh.create_server(
        _server(count), "127.0.0.1", 0, server_host_keys=[host_key], authorized_client_keys=str(tmp / "id.pub"),
        encoding=None,
    )  # fmt: skip
    port = srv.sockets[0].getsockname()[1]
    (tmp / "kh").write_text(f"[127.0.0.1]:{port} {host_key.export_public_key('openssh').decode().strip()}\n")
    try:
        yield SSHTarget(name="n1", host="127.0.0.1", port=port, user="u", identity_file=str(tmp / "id"),
                        known_hosts=str(tmp / "kh"), ssh_config=str(tmp / "ssh_config"))  # fmt: skip
    finally:
        srv.close()
        await srv.wait_closed()


def _outputs(results: list[Any]) -> list[Any]:
    return [r if isinstance(r, BaseException) else r[1] for r in results]


def test_a_session_runs_at_most_max_channels_commands_at_once(tmp_path: Path) -> None:
    count = _Count(hold_s=0.1)

    async def go() -> list[Any]:
        async with _node(tmp_path, count) as t, AsyncsshConnector(max_channels=3).session(t) as s:
            assert isinstance(s, AsyncsshSession) and s.max_channels == 3
            return await asyncio.gather(*(s.run_raw("x", timeout=5) for _ in range(12)), return_exceptions=True)

    assert _outputs(asyncio.run(go())) == [b"ok\n"] * 12
    assert count.peak == 3, "measured at the server: as many as allowed, never more"


def test_the_default_limit_stays_under_sshd_s_default_max_sessions(tmp_path: Path) -> None:
    assert DEFAULT_MAX_CHANNELS == 8 < 10
    count = _Count(hold_s=0.1)

    async def go() -> list[Any]:
        async with _node(tmp_path, count) as t, AsyncsshConnector().session(t) as s:
            return await asyncio.gather(*(s.run_raw("x", timeout=5) for _ in range(20)), return_exceptions=True)

    assert _outputs(asyncio.run(go())) == [b"ok\n"] * 20
    assert count.peak == DEFAULT_MAX_CHANNELS


def test_a_channel_the_server_refuses_is_asked_for_again(tmp_path: Path) -> None:
    # The server allows 2 sessions; this client would open 6: the others are refused
    # ("open failed", as sshd past MaxSessions) and asked for again until one is free.
    count = _Count(limit=2, hold_s=0.2)

    async def go() -> list[Any]:
        async with _node(tmp_path, count) as t, AsyncsshConnector(max_channels=6).session(t) as s:
            return await asyncio.gather(*(s.run_raw("x", timeout=10) for _ in range(8)), return_exceptions=True)

    assert _outputs(asyncio.run(go())) == [b"ok\n"] * 8
    assert count.refused > 0 and count.peak == 2


def test_a_channel_refused_for_the_whole_timeout_says_so(tmp_path: Path) -> None:
    count = _Count(limit=0)  # MaxSessions 0: forwarding only

    async def go() -> float:
        async with _node(tmp_path, count) as t, AsyncsshConnector().session(t) as s:
            t0 = time.monotonic()
            with pytest.raises(SSHError, match=r"^n1: cannot open a channel: open failed"):
                await s.run_raw("x", timeout=0.6)
            return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.3 < took < 2.0, took  # asked again meanwhile, and not for longer than the timeout
    assert count.refused >= 3


def test_a_closed_connection_fails_a_command_at_once(tmp_path: Path) -> None:
    count = _Count()

    async def go() -> float:
        async with _node(tmp_path, count) as t, AsyncsshConnector().session(t) as s:
            assert isinstance(s, AsyncsshSession)
            assert await s.run("x", timeout=5)
            count.conns[0].close()
            await asyncio.wait_for(s.wait_closed(), 5)
            assert s.is_closed()
            t0 = time.monotonic()
            with pytest.raises(SSHError, match=r"^n1: cannot open a channel: SSH connection closed"):
                await s.run_raw("x", timeout=5)
            return time.monotonic() - t0

    assert asyncio.run(go()) < 0.5  # not asked again: the connection is gone


def test_a_stream_holds_a_channel_while_it_runs(tmp_path: Path) -> None:
    count = _Count(hold_s=0.3)

    async def go() -> tuple[int | None, list[bytes], float]:
        got: list[bytes] = []
        async with _node(tmp_path, count) as t, AsyncsshConnector(max_channels=1).session(t) as s:
            assert isinstance(s, AsyncsshSession)
            streaming = asyncio.ensure_future(s.stream("x", got.append))
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await s.run_raw("x", timeout=5)  # waits for the stream's channel
            return await streaming, got, time.monotonic() - t0

    rc, got, waited = asyncio.run(go())
    assert rc == 0 and b"".join(got) == b"ok\n"
    assert waited > 0.4 and count.peak == 1


def test_keepalive_drops_a_peer_that_stopped_answering(tmp_path: Path) -> None:
    count = _Count()

    async def go() -> float:
        c = AsyncsshConnector(keepalive_interval_s=0.2, keepalive_count_max=1)
        async with _node(tmp_path, count) as t, c.session(t) as s:
            assert isinstance(s, AsyncsshSession)
            count.conns[0]._transport.pause_reading()  # alive, but answers nothing any more
            t0 = time.monotonic()
            await asyncio.wait_for(s.wait_closed(), 5)
            return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.3 < took < 1.5, took  # (count_max + 1) intervals of silence


def test_max_channels_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AsyncsshConnector(max_channels=0)


# ---------------------------------------------------------------------------
# Sessions: reopened when ended, failures remembered (one command) or backed off (long-lived)


class _FakeSession:
    def __init__(self, n: int) -> None:
        self.n = n
        self.closed = False
        self.exited = False

    def is_closed(self) -> bool:
        return self.closed


class _Connector:
    """Connects as told: ``down`` nodes fail (after ``delay_s``); counts the attempts."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.down: set[str] = set()
        self.delay_s = delay_s
        self.attempts = 0
        self.made: list[_FakeSession] = []

    @asynccontextmanager
    async def session(self, target: SSHTarget) -> AsyncIterator[_FakeSession]:
        self.attempts += 1
        await asyncio.sleep(self.delay_s)
        if target.name in self.down:
            raise SSHError(f"{target.name}: connection refused (attempt {self.attempts})")
        s = _FakeSession(len(self.made))
        self.made.append(s)
        try:
            yield s
        finally:
            s.exited = True


_INV = Inventory.model_validate({"nodes": [{"name": "n1", "host": "h1"}, {"name": "n2", "host": "h2"}]})


def test_an_open_session_is_shared_and_an_ended_one_reopened() -> None:
    conn = _Connector(delay_s=0.01)

    async def go() -> None:
        async with Sessions(_INV, conn) as sessions:  # type: ignore[arg-type]
            first = await asyncio.gather(*(sessions.get("n1") for _ in range(5)))
            assert {id(s) for s in first} == {id(first[0])} and conn.attempts == 1
            first[0].closed = True  # keepalive gave up on it, or the node went away
            again = await asyncio.gather(*(sessions.get("n1") for _ in range(5)))
            assert {s.n for s in again} == {1} and conn.attempts == 2
            assert first[0].exited, "the ended session's context is left"
        assert again[0].exited  # aclose

    asyncio.run(go())


def test_one_command_remembers_a_failed_node_for_good() -> None:
    # up/down/status: a node that did not answer fails every later user at once, with the
    # same error, and is never tried again (no second connect timeout), even once it is back.
    conn = _Connector(delay_s=0.05)
    conn.down.add("n1")

    async def go() -> None:
        async with Sessions(_INV, conn) as sessions:  # type: ignore[arg-type]
            errors = await asyncio.gather(*(sessions.get("n1") for _ in range(10)), return_exceptions=True)
            assert {str(e) for e in errors} == {"n1: connection refused (attempt 1)"}
            conn.down.clear()
            await asyncio.sleep(0.6)  # past what would be a first backoff
            with pytest.raises(SSHError, match=r"\(attempt 1\)"):
                await sessions.get("n1")
            assert conn.attempts == 1
            assert (await sessions.get("n2")).n == 0  # the others go on

    asyncio.run(go())


def test_a_long_lived_sessions_backs_off_a_failed_node_then_finds_it_again() -> None:
    conn = _Connector()
    conn.down.add("n1")

    async def go() -> None:
        async with Sessions(_INV, conn, retry_failed=True, backoff_s=0.1, max_backoff_s=0.4) as sessions:  # type: ignore[arg-type]
            loop = asyncio.get_running_loop()
            waits = []
            for attempt in range(1, 6):
                errors = await asyncio.gather(*(sessions.get("n1") for _ in range(10)), return_exceptions=True)
                assert {str(e) for e in errors} == {f"n1: connection refused (attempt {attempt})"}
                assert conn.attempts == attempt, "one attempt for all the callers of one tick"
                waits.append(round(sessions._retry_at["n1"] - loop.time(), 1))
                with pytest.raises(SSHError, match=rf"\(attempt {attempt}\)"):  # within the backoff: remembered
                    await sessions.get("n1")
                await asyncio.sleep(sessions._retry_at["n1"] - loop.time() + 0.01)
            assert waits == [0.1, 0.2, 0.4, 0.4, 0.4]  # doubling, capped
            conn.down.clear()
            assert (await sessions.get("n1")).n == 0
            assert "n1" not in sessions._failures  # a success starts the backoff over

    asyncio.run(go())


def test_prefetch_starts_connecting_and_aclose_closes_everything() -> None:
    conn = _Connector(delay_s=0.01)

    async def go() -> list[_FakeSession]:
        sessions = Sessions(_INV, conn)  # type: ignore[arg-type]
        sessions.prefetch(["n1", "n2", "n1"])
        await asyncio.sleep(0.05)
        assert conn.attempts == 2
        got = [await sessions.get("n1"), await sessions.get("n2")]
        assert conn.attempts == 2
        await sessions.aclose()
        return got

    assert all(s.exited for s in asyncio.run(go()))
