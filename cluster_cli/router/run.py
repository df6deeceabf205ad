"""Run a router until SIGTERM/SIGINT: uvloop if present, SIGHUP reloads the config."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.keys import ApiKeys
from cluster_cli.router.source import FileSource

log = logging.getLogger("clusterctl.router")


def install_uvloop() -> bool:
    """Use uvloop's event loop unless ``CLUSTERCTL_NO_UVLOOP=1`` (for debugging and for the benchmark)."""
    if os.environ.get("CLUSTERCTL_NO_UVLOOP") == "1":
        return False
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


async def serve(
    config_path: Path,
    *,
    host: str,
    port: int,
    transform: Callable[[RouterConfig], RouterConfig],
    keys_path: Path | None = None,
    access_log: AccessLog | None = None,
    watch_interval: float = 1.0,
    grace: float = 10.0,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    source = FileSource(config_path, interval=watch_interval, transform=transform)
    cfg = source.load()
    keys = ApiKeys.load(keys_path) if keys_path else None
    router = Router(cfg, api_keys=keys, access_log=access_log, source=source)
    bound = await router.start(host, port)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def _stop() -> None:
        if not stop.done():
            stop.set_result(None)

    def _hup() -> None:
        log.warning("SIGHUP: reloading %s", config_path)
        source.trigger()
        if keys_path is not None:
            try:
                router.api_keys = ApiKeys.load(keys_path)
            except Exception as e:  # keep the old keys
                log.error("API keys not reloaded: %s", e)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop)
    loop.add_signal_handler(signal.SIGHUP, _hup)
    if on_ready is not None:
        on_ready(bound)
    try:
        await stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await router.stop(grace)
