"""The store from asyncio: calls run on the database thread, a cancelled call interrupts only
its own wait for the write lock, and nothing of it is committed."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import pytest
from helpers import ctrl_c_while_locked

from cluster_cli.facts import Replica, Shard
from cluster_cli.state.aio import AsyncStore
from cluster_cli.state.records import ReplicaRecord
from cluster_cli.state.store import Store


def test_a_cancelled_read_leaves_no_interrupt_behind_for_the_next_write(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")

    async def go() -> None:
        async with AsyncStore(store) as astore:
            slow = asyncio.create_task(astore.call(lambda: (store.version(), time.sleep(0.2))))
            await asyncio.sleep(0.05)
            slow.cancel()  # already running: its (lock) wait is interrupted, if it has one
            with contextlib.suppress(asyncio.CancelledError):
                await slow
            await asyncio.sleep(0.3)
            await astore.cordon("node-1", "disk")

    try:
        asyncio.run(go())
        assert store.cordons()["node-1"]["reason"] == "disk"
    finally:
        store.close()


def test_a_call_waiting_for_the_lock_is_cancelled_at_once_and_commits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = Store(path, timeout_s=30)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock

    async def go() -> float:
        async with AsyncStore(store) as astore:
            waiting = asyncio.create_task(astore.cordon("node-1", "disk"))
            ticks = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 0.3:  # the loop runs on while the write waits
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks > 10 and not waiting.done()
            waiting.cancel()
            t1 = time.monotonic()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            # the thread is free again at once: the next call does not wait 30 s
            holder.execute("ROLLBACK")
            await astore.cordon("node-2", "fan")
            return time.monotonic() - t1

    try:
        took = asyncio.run(go())
        assert took < 5, took
        assert set(store.cordons()) == {"node-2"}
    finally:
        holder.close()
        store.close()


@pytest.mark.slow
def test_ctrl_c_ends_an_async_command_waiting_for_the_write_lock_at_once(tmp_path: Path) -> None:
    """``down`` writes from its event loop, through the database thread: Ctrl-C while another
    process holds the write lock ends it at once (exit 130, no traceback), nothing written."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("nodes:\n  - {name: cpu-01, host: 198.18.99.1}\n")
    path = tmp_path / "s.db"
    with Store(path) as s:
        s.cordon("cpu-01", "x", inventory=inv)
        s.reserve([ReplicaRecord(Replica("m", 0, "p", "llamacpp", (Shard("cpu-01"),)), port=8100)])
    rc, out, err, took = ctrl_c_while_locked(path, "down", "--all")  # waits to mark it wanted down
    assert rc == 130 and "Traceback" not in err, (out, err)
    assert took < 5, took
    with Store(path) as s:
        assert [(r.name, r.desired, r.status) for r in s.records()] == [("m/0", "up", "planned")]
