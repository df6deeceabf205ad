"""Where the endpoint list comes from: the interface, and a config file watched for changes.

``EndpointSource.run(apply, reject)`` calls ``apply(config)`` with each new valid
config and ``reject(message)`` with a one-line reason for each invalid one (the old
config keeps serving). ``trigger()`` asks for an immediate re-read (SIGHUP). A later
source can follow a watch stream from the state store instead of a file.

``WatchedFile`` is the polling underneath (also used for the API keys file): it reports new
bytes once they have held still for a moment, so a writer that does not replace the file
atomically is not read half-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol, TypeVar

from cluster_cli.errors import ConfigError
from cluster_cli.router.config import RouterConfig, load_router_config

log = logging.getLogger("clusterctl.router")
T = TypeVar("T")

MIN_INTERVAL = 0.05  # seconds between polls, at least (0 would spin a core)
SETTLE_S = 0.2  # a change is read again after this long, and used once two reads agree
SETTLE_TRIES = 20
FULL_READ_EVERY = 10  # polls: the content is compared at least this often, whatever the stat says
MAX_BYTES = 16 << 20  # a config or keys file larger than this is refused


class EndpointSource(Protocol):
    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None: ...

    def trigger(self) -> None: ...


Content = tuple[bytes | None, str | None]  # the file's bytes, or None and why it cannot be read


def _read(path: Path) -> Content:
    """The file's bytes, or why not. Only a regular file of at most ``MAX_BYTES`` is opened
    (a FIFO is never opened: that would release, then break, a writer waiting on it).
    Never raises. Blocking: call it off the event loop (``_off_loop``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None, "file not found"
    except OSError as e:
        return None, f"cannot read: {e.strerror or e}"
    if stat.S_ISDIR(st.st_mode):
        return None, "is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return None, "not a regular file"
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced since the stat
                return None, "not a regular file"
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, "file not found"
    except OSError as e:
        return None, f"cannot read: {e.strerror or e}"
    except Exception as e:  # MemoryError and the like: reported, never the end of the watching
        return None, f"cannot read: {type(e).__name__}: {e}"
    if len(data) > MAX_BYTES:
        return None, f"larger than {MAX_BYTES >> 20} MiB"
    return data, None


Stamp = tuple[int, int, int, int] | None


def _stamp(path: Path) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _poll(path: Path, last: Stamp, full: bool) -> tuple[Stamp, Content | None]:
    """The file's stamp, and its content if the stamp moved or ``full`` (else None).
    The stamp is taken before the read it vouches for. Blocking: call it off the loop."""
    stamp = _stamp(path)
    return stamp, (_read(path) if full or stamp != last else None)


def _digest(c: Content) -> bytes:
    return hashlib.sha256(c[0]).digest() if c[0] is not None else b"error:" + (c[1] or "").encode()


def _off_loop(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """``fn(*args)`` in a daemon thread: a read stuck on a dead network filesystem then
    holds neither the event loop nor the process's exit (the default executor would)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: object) -> None:
        if not fut.done():
            if ok:
                fut.set_result(value)  # type: ignore[arg-type]
            else:
                fut.set_exception(value)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result: tuple[bool, object] = (True, fn(*args))
        except BaseException as e:  # handed to the awaiting coroutine
            result = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(target=work, name=f"clusterctl-watch {fn.__name__}", daemon=True).start()
    return fut


class WatchedFile:
    """Polls ``path`` every ``interval`` seconds and reports new content; ``trigger``
    forces a report at once.

    A poll stats the file and reads it when the stat changed, and every
    ``FULL_READ_EVERY`` polls in any case, then compares the bytes: a same-size rewrite
    within a coarse timestamp tick, or by a writer that puts the mtime back (cp -p,
    rsync -t), is still seen, and a file touched without a change is not reported. Both the
    stat and the read run in a daemon thread, never on the event loop. Only regular files of
    at most ``MAX_BYTES`` are read: a FIFO put in its place is refused, never opened.
    """

    def __init__(self, path: Path | str, *, interval: float = 1.0, settle: float | None = None) -> None:
        self.path = Path(path)
        self.interval = max(MIN_INTERVAL, interval)
        self.settle = SETTLE_S if settle is None else settle
        self._wake = asyncio.Event()
        try:
            # A pipe (--config <(...)) or a device reads once: there is nothing to watch.
            self.watched = stat.S_ISREG(os.stat(self.path).st_mode)
        except OSError:
            self.watched = True  # not there yet: it may appear
        self._stamp: Stamp = None
        self._digest = b""
        if self.watched:
            self.read()

    def read(self) -> Content:
        """The file's content now, recorded as seen: what the first load uses, so the start
        and the watching agree. A path that is not watched (a pipe) is read once, as is."""
        if not self.watched:
            try:
                return self.path.read_bytes(), None
            except OSError as e:
                return None, f"cannot read: {e.strerror or e}"
        self._stamp, content = _poll(self.path, None, True)
        assert content is not None
        self._digest = _digest(content)
        return content

    def trigger(self) -> None:
        if not self.watched:
            log.warning("%s is not a regular file (a pipe?): nothing to re-read", self.path)
        self._wake.set()

    async def changes(self) -> AsyncIterator[Content]:
        """Yields (bytes, None), or (None, why) when the file is gone or cannot be read, each
        time that changed and held still for ``settle`` seconds, and on every ``trigger()``
        (then without waiting). Yields nothing for a path that was not a regular file at the
        start (a pipe)."""
        if not self.watched:
            log.info("%s is not a regular file: not watched", self.path)
            await asyncio.Event().wait()
        polls = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
                forced = True
            except TimeoutError:
                forced = False
            self._wake.clear()
            polls += 1
            full = forced or polls % FULL_READ_EVERY == 0
            stamp, content = await _off_loop(_poll, self.path, self._stamp, full)
            if content is None:
                continue  # the stat did not move
            if not forced:
                if _digest(content) == self._digest:
                    self._stamp = stamp
                    continue
                for _ in range(SETTLE_TRIES):  # held still for a moment: not half-written
                    await asyncio.sleep(self.settle)
                    stamp, again = await _off_loop(_poll, self.path, None, True)
                    if again == content:
                        break
                    content = again  # type: ignore[assignment]
                else:
                    continue  # still being written: look again at the next poll
            self._stamp = stamp
            digest = _digest(content)
            if not forced and digest == self._digest:
                continue  # changed and changed back
            self._digest = digest
            self._wake.clear()  # a trigger during the settle time is answered by this read
            yield content


class FileSource:
    """The router config file, watched (``WatchedFile``); ``trigger`` forces a re-read."""

    def __init__(
        self,
        path: Path | str,
        *,
        interval: float = 1.0,
        transform: Callable[[RouterConfig], RouterConfig] | None = None,
    ) -> None:
        self.path = Path(path)
        self.transform = transform or (lambda c: c)
        self.file = WatchedFile(self.path, interval=interval)
        self.applied_sha256: str | None = None  # the digest of the file's bytes last applied
        self.applied_at: float | None = None

    @property
    def interval(self) -> float:
        return self.file.interval

    def _config(self, content: Content) -> RouterConfig:
        data, why = content
        if data is None:
            raise ConfigError(f"{self.path}: {why}")
        return self.transform(load_router_config(self.path, data))

    def load(self) -> RouterConfig:
        content = self.file.read()
        cfg = self._config(content)
        self._applied(content)
        return cfg

    def _applied(self, content: Content) -> None:
        from cluster_cli.router.serving import digest

        if content[0] is not None:
            self.applied_sha256, self.applied_at = digest(content[0]), time.time()

    def trigger(self) -> None:
        self.file.trigger()

    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None:
        async for content in self.file.changes():
            try:
                cfg = self._config(content)
            except ConfigError as e:
                reject(e.message)
                continue
            except Exception as e:  # never let one bad file stop the watching
                log.exception("reading %s failed", self.path)
                reject(f"{self.path}: {type(e).__name__}: {e}")
                continue
            try:
                apply(cfg)
            except Exception as e:
                log.exception("applying %s failed", self.path)
                reject(f"{self.path}: could not be applied: {type(e).__name__}: {e}")
            else:
                self._applied(content)
