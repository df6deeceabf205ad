"""Where the endpoint list comes from: the interface, and a config file watched for changes.

``EndpointSource.run(apply, reject)`` calls ``apply(config)`` with each new valid
config and ``reject(message)`` with a one-line reason for each invalid one (the old
config keeps serving). ``trigger()`` asks for an immediate re-read (SIGHUP). A later
source can follow a watch stream from the state store instead of a file.

``WatchedFile`` is the polling underneath (also used for the API keys file): a change of
(mtime, ctime, size, inode) makes it read the file, a change of its bytes makes it report
them, and only once they have held still for a moment, so a writer that does not replace
the file atomically is not read half-way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from cluster_cli.errors import ConfigError
from cluster_cli.router.config import RouterConfig, load_router_config

log = logging.getLogger("clusterctl.router")

MIN_INTERVAL = 0.05  # seconds between polls, at least (0 would spin a core)
SETTLE_S = 0.2  # a change is read again after this long, and used once two reads agree
SETTLE_TRIES = 20


class EndpointSource(Protocol):
    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None: ...

    def trigger(self) -> None: ...


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    # ctime too: a same-size rewrite within the filesystem's mtime granularity, or one whose
    # writer restores the mtime (cp -p, rsync -t), still changes it.
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _digest(data: bytes | None) -> bytes | None:
    return None if data is None else hashlib.sha256(data).digest()


class WatchedFile:
    """Polls ``path`` every ``interval`` seconds; ``trigger`` forces a report at once."""

    def __init__(self, path: Path | str, *, interval: float = 1.0, settle: float | None = None) -> None:
        self.path = Path(path)
        self.interval = max(MIN_INTERVAL, interval)
        self.settle = SETTLE_S if settle is None else settle
        self._stamp = _stamp(self.path)  # nothing is read here: the path may be a pipe
        self._digest: bytes | None = None
        self._wake = asyncio.Event()
        try:
            # A pipe (--config <(...)) or a device reads once: there is nothing to watch.
            self.watched = stat.S_ISREG(os.stat(self.path).st_mode)
        except OSError:
            self.watched = True  # not there yet: it may appear

    def read(self) -> bytes | None:
        """The file's bytes now (None if it cannot be read), recorded as seen."""
        stamp = _stamp(self.path)  # before the read: a write after it shows as a new stamp
        data = _read(self.path)
        self._stamp, self._digest = stamp, _digest(data)
        return data

    def trigger(self) -> None:
        self._wake.set()

    async def changes(self) -> AsyncIterator[bytes | None]:
        """Yields the file's bytes (None: unreadable or gone) each time they changed and held
        still for ``settle`` seconds, and on every ``trigger()`` (then without waiting).
        Yields nothing for a path that was not a regular file at the start (a pipe)."""
        if not self.watched:
            log.info("%s is not a regular file: not watched", self.path)
            await asyncio.Event().wait()
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
                forced = True
            except TimeoutError:
                forced = False
            self._wake.clear()
            stamp = _stamp(self.path)
            if not forced and stamp == self._stamp:
                continue
            data = _read(self.path)
            if not forced:
                for _ in range(SETTLE_TRIES):
                    await asyncio.sleep(self.settle)
                    stamp = _stamp(self.path)  # before the read it vouches for (see ``read``)
                    again = _read(self.path)
                    if again == data:
                        break
                    data = again
                else:
                    continue  # still being written: look again at the next poll
            digest = _digest(data)
            self._stamp = stamp
            if not forced and digest == self._digest:
                continue  # touched, not changed
            self._digest = digest
            self._wake.clear()  # a trigger during the settle time is answered by this read
            yield data


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

    @property
    def interval(self) -> float:
        return self.file.interval

    def load(self) -> RouterConfig:
        return self.transform(load_router_config(self.path, self.file.read()))

    def trigger(self) -> None:
        self.file.trigger()

    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None:
        async for data in self.file.changes():
            try:
                # ``None``: gone or unreadable; reading the path again names the reason.
                cfg = self.transform(load_router_config(self.path, data))
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
