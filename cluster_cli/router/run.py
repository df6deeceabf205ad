"""Run a router until SIGTERM/SIGINT: uvloop if present, SIGHUP reloads the config."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from cluster_cli.errors import ConfigError
from cluster_cli.router import serving
from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.app import Router
from cluster_cli.router.config import RouterConfig
from cluster_cli.router.keys import ApiKeys
from cluster_cli.router.source import Content, FileSource, WatchedFile

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


def tune_gc() -> None:
    """Call once everything that lives as long as the router is built (modules, config,
    pydantic schemas, metric families): ``gc.freeze`` keeps the collector from walking all
    of that again at every full collection, and a larger young generation means fewer
    collections. Measured at 64 concurrent streams, per 7 s of load: GC time 94-124 ->
    18-24 ms, the longest pause 18-37 ms (full collections) -> about 2 ms (bench/README.md).
    Request handling frees its objects by reference counting; the collector only has
    cycles to find.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def untune_gc(threshold: tuple[int, int, int]) -> None:
    """Undo ``tune_gc`` (for a process that goes on after the router stopped)."""
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _load_keys(path: Path, content: Content) -> ApiKeys:
    """API keys from what ``WatchedFile`` read; ConfigError when it could not be read."""
    data, why = content
    if data is None:
        raise ConfigError(f"{path}: cannot read API keys: {(why or '').removeprefix('cannot read: ')}")
    return ApiKeys.load(path, data)


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
    keys_file = WatchedFile(keys_path, interval=watch_interval) if keys_path else None
    keys = _load_keys(keys_path, keys_file.read()) if keys_path and keys_file else None
    router = Router(cfg, api_keys=keys, access_log=access_log, source=source)
    router.manage_open_files()
    bound = await router.start(host, port)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    async def _watch_keys() -> None:
        """The keys file is watched like the config: a removed key stops working within a
        poll; a file that cannot be used keeps the old keys, and /health says so."""
        assert keys_file is not None and keys_path is not None
        async for content in keys_file.changes():
            try:
                router.reload_keys(_load_keys(keys_path, content))
            except ConfigError as e:
                router.reject_keys(e.message)
            except Exception as e:  # never stop watching
                router.reject_keys(f"{keys_path}: {type(e).__name__}: {e}")

    keys_task = loop.create_task(_watch_keys()) if keys_file is not None else None
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{bound}"
    announce_task = loop.create_task(_announce(config_path, url, source, router))
    gc_threshold = gc.get_threshold()
    tune_gc()

    def _stop() -> None:
        if not stop.done():
            stop.set_result(None)

    def _hup() -> None:
        # Routine: every publication of clusterctl on this host sends one (the reload says what changed).
        log.info("SIGHUP: reloading %s", config_path)
        if access_log is not None:
            access_log.reopen()  # a rotated access log: write a new file at its path
        source.trigger()
        if keys_file is not None:
            keys_file.trigger()

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
        if keys_task is not None:
            keys_task.cancel()
        announce_task.cancel()
        await router.stop(grace)
        serving.remove(config_path)
        untune_gc(gc_threshold)


async def _announce(config_path: Path, url: str, source: FileSource, router: Router, every: float = 0.2) -> None:
    """Keep this router's serving file (``router/serving.py``) beside the config: which
    config it loaded, and what is in flight on each draining endpoint. Written when either
    changes, and every second at least (its time says it is alive)."""
    last: tuple[object, ...] | None = None
    written = 0.0
    while True:
        draining = {
            w.view.replica: w.inflight for w in router.table.endpoints.values() if w.view.draining and w.view.replica
        }
        for w in router.table.retired:  # removed from the config, still finishing what it had
            if w.view.replica and w.inflight:
                draining[w.view.replica] = draining.get(w.view.replica, 0) + w.inflight
        now = asyncio.get_running_loop().time()
        state = (source.applied_sha256, tuple(sorted(draining.items())))
        if state != last or now - written >= 1.0:
            serving.write(config_path, url=url, config_sha256=source.applied_sha256, loaded_at=source.applied_at,
                          draining=draining)  # fmt: skip
            last, written = state, now
        await asyncio.sleep(every)
