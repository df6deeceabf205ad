"""Where the endpoint list comes from: the interface, and a config file watched for changes.

``EndpointSource.run(apply, reject)`` calls ``apply(config)`` with each new valid
config and ``reject(message)`` with a one-line reason for each invalid one (the old
config keeps serving). ``trigger()`` asks for an immediate re-read (SIGHUP). A later
source can follow a watch stream from the state store instead of a file.

``WatchedFile`` is the polling underneath (also used for the API keys file): it reads the
file each poll and reports new bytes once they have held still for a moment, so a writer
that does not replace the file atomically is not read half-way.
"""

from __future__ import annotations

import asyncio
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


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


class WatchedFile:
    """Reads ``path`` every ``interval`` seconds and reports new content; ``trigger``
    forces a report at once.

    It compares the bytes, not the file's times or size: a same-size rewrite within a
    coarse timestamp tick, or by a writer that puts the mtime back (cp -p, rsync -t), is
    still seen, and a file touched without a change is not reported. A config or keys file
    is small; reading it once a second costs next to nothing.
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
        self._last = _read(self.path) if self.watched else None

    def read(self) -> bytes | None:
        """The file's bytes now (None if it cannot be read), recorded as seen."""
        self._last = _read(self.path)
        return self._last

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
            data = _read(self.path)
            if not forced:
                if data == self._last:
                    continue
                for _ in range(SETTLE_TRIES):  # held still for a moment: not half-written
                    await asyncio.sleep(self.settle)
                    again = _read(self.path)
                    if again == data:
                        break
                    data = again
                else:
                    continue  # still being written: look again at the next poll
                if data == self._last:
                    continue  # changed and changed back
            self._last = data
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
