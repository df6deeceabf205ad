"""The state store for asyncio code: every call runs on one dedicated database thread, so the
event loop never waits on SQLite (a write waiting for another process's lock, an fsync).

``await astore.records()`` is ``store.records()`` run on that thread. Calls run one at a
time, in the order they were made (one connection, one transaction at a time). A caller
cancelled while its call waits for the write lock (Ctrl-C, a shutting-down loop) interrupts
that wait at once; nothing of the call is committed.

Why a thread and not an async driver (aiosqlite): measured in ``bench/state.py``, both keep
the loop free under a held lock, but a call here is one hop to the thread for a whole
transaction where aiosqlite makes one per statement (about 2x faster per call, reads and
writes); and the synchronous commands and this share one connection and its semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cluster_cli.state.store import Store

T = TypeVar("T")


class AsyncStore:
    """An asyncio face on a :class:`Store`; the store must not be used directly meanwhile."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._running: Future[Any] | None = None  # the call on the thread now
        self._lock = threading.Lock()
        # A daemon thread: a process ending on Ctrl-C does not wait for a call stuck in C.
        self._thread = threading.Thread(target=self._serve, name="clusterctl-state", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            with self._lock:
                if not fut.set_running_or_notify_cancel():
                    continue
                self._running = fut
            try:
                result: Any = fn()
            except BaseException as e:
                error: BaseException | None = e
            else:
                error = None
            with self._lock:  # an interrupt meant for this call ends with it
                self._running = None
                self.store.clear_interrupt()
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` (a Store method, or a function of it) on the database thread."""
        fut: Future[T] = Future()
        self._jobs.put((lambda: fn(*args, **kwargs), fut))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            with self._lock:
                if not fut.cancel() and self._running is fut:  # running: end its wait for the lock now
                    self.store.interrupt()
            raise

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.store, name)
        if not callable(method):
            return method

        async def bound(*args: Any, **kwargs: Any) -> Any:
            return await self.call(method, *args, **kwargs)

        bound.__name__ = name
        return bound

    def close(self) -> None:
        """Stop the thread once the calls already made are done (the store stays open)."""
        self._jobs.put(None)
        with contextlib.suppress(RuntimeError):
            self._thread.join(timeout=5)

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def using(store: Store | None, fn: Callable[[AsyncStore | None], Any]) -> Any:
    """``await fn(astore)`` with ``store`` behind an AsyncStore for the length of the call."""
    if store is None:
        return await fn(None)
    async with AsyncStore(store) as astore:
        return await fn(astore)
