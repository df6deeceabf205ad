"""Where the endpoint list comes from: the interface, and a config file watched for changes.

``EndpointSource.run(apply, reject)`` calls ``apply(config)`` with each new valid
config and ``reject(message)`` with a one-line reason for each invalid one (the old
config keeps serving). ``trigger()`` asks for an immediate re-read (SIGHUP). A later
source can follow a watch stream from the state store instead of a file.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cluster_cli.errors import ConfigError
from cluster_cli.router.config import RouterConfig, load_router_config


class EndpointSource(Protocol):
    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None: ...

    def trigger(self) -> None: ...


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class FileSource:
    """Polls the file's (mtime, size, inode) every ``interval`` seconds; ``trigger`` forces a read."""

    def __init__(
        self,
        path: Path | str,
        *,
        interval: float = 1.0,
        transform: Callable[[RouterConfig], RouterConfig] | None = None,
    ) -> None:
        self.path = Path(path)
        self.interval = interval
        self.transform = transform or (lambda c: c)
        self._stamp = _stamp(self.path)
        self._wake = asyncio.Event()

    def load(self) -> RouterConfig:
        self._stamp = _stamp(self.path)
        return self.transform(load_router_config(self.path))

    def trigger(self) -> None:
        self._wake.set()

    async def run(self, apply: Callable[[RouterConfig], None], reject: Callable[[str], None]) -> None:
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
            self._stamp = stamp
            try:
                cfg = self.transform(load_router_config(self.path))
            except ConfigError as e:
                reject(e.message)
                continue
            apply(cfg)
