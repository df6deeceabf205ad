"""The one writer of the router config.

Every command that changes what the router should serve (``up``, ``down``, later
``supervise``) publishes through here: it takes the config's lock (``router.yaml.lock``,
an exclusive ``flock``, waited for without blocking the event loop), reads what to publish
from the state in one snapshot, renders and writes the file atomically. Since it renders
from the state under the lock, a writer that decided to publish earlier can never write an
older picture over a newer one: the last writer writes the state as it is then. The
catalog's metric mappings come from the catalog ``up`` applied, kept in the state.

A replica being taken down (``stopping``) with an endpoint is published ``draining: true``:
the router sends it no new request while those in flight finish; once it is stopped and
released, the next publication leaves it out.

Publication is confirmed, not slept on: each router serving the config on this host says
which config it loaded and what is still in flight on each draining endpoint
(``router/serving.py``); :func:`publish` waits (a bound) until every one of them has loaded
what was written, and :func:`drained` until none has a request left on the replicas being
stopped. Where no router serves the config on this host, there is nothing to wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.errors import ConfigError
from cluster_cli.launch import keys, routerconf
from cluster_cli.router import serving
from cluster_cli.state.records import READY, STOPPING, UP

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.state.aio import AsyncStore
    from cluster_cli.state.records import ReplicaRecord

LOCK_WAIT_S = 30.0  # how long a writer waits for another before it gives up
CONFIRM_S = 5.0  # how long a publication waits for the routers to load it (they watch it every second)
DRAIN_S = 60.0  # how long a replica being stopped may finish the requests in flight on it


@dataclass(frozen=True)
class Published:
    path: Path
    endpoints: int  # serving
    draining: int
    routers: int = 0  # serving the config on this host
    confirmed: int = 0  # of those, the ones that loaded this publication in time

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "endpoints": self.endpoints, "draining": self.draining,
                "routers": self.routers, "confirmed": self.confirmed}  # fmt: skip


async def publish(
    store: AsyncStore, path: Path, *, cat: Catalog | None = None, confirm_s: float | None = None
) -> Published:
    """Write the router config at ``path`` from the state as it is now: the ready replicas
    wanted up, and those being stopped as draining, then wait (up to ``confirm_s``, default
    CONFIRM_S) until every router serving it on this host has loaded it. ``cat``: the catalog
    being applied (else the one the state keeps). Raises ConfigError."""
    async with _locked(path):
        records, stored = await store.call(_view, store.store)
        if cat is None and stored is not None:
            cat = _catalog(stored.doc)
        live = [r for r in records if r.status == READY and r.desired == UP]
        stopping = [r for r in records if r.status == STOPPING and r.endpoint]
        doc = routerconf.render(live + [replace(r, status=READY, desired=UP) for r in stopping], cat,
                                keys=engine_keys(store))  # fmt: skip
        urls = {r.endpoint for r in stopping}  # by URL: a newer generation may serve under its name
        for model in doc.get("models", {}).values():
            for ep in model["endpoints"]:
                if ep.get("url") in urls:
                    ep["draining"] = True
        changed = routerconf.write(path, doc)
        try:
            written = serving.digest(path.read_bytes())
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the router config back: {e.strerror or e}") from None
    if changed:
        _nudge(path)
    routers, confirmed = await _confirm(path, written, CONFIRM_S if confirm_s is None else confirm_s)
    return Published(path, len(live), len(stopping), routers, confirmed)


def _nudge(path: Path) -> None:
    """SIGHUP every router serving ``path`` on this host: it reloads now rather than at its
    next look at the file (up to its ``--watch-interval`` later). Only a process whose command
    line says ``serve-router``: a PID a dead router's file names may be another's now."""
    for r in serving.running(path):
        try:
            cmdline = Path(f"/proc/{r.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if r.pid != os.getpid() and b"serve-router" in cmdline:
            with contextlib.suppress(OSError):
                os.kill(r.pid, signal.SIGHUP)


async def _confirm(path: Path, written: str, wait_s: float) -> tuple[int, int]:
    """(routers serving ``path`` here, those that loaded ``written`` within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        routers = serving.running(path)
        done = sum(r.config_sha256 == written for r in routers)
        if done == len(routers) or time.monotonic() >= deadline:
            return len(routers), done
        await asyncio.sleep(0.05)


async def drained(path: Path, names: set[str], wait_s: float = DRAIN_S) -> dict[str, int]:
    """Wait until no router serving ``path`` here has a request in flight on the replicas
    ``names`` (being stopped, published draining), up to ``wait_s``; what is still in flight
    then, by replica (empty: drained, or no router here)."""
    deadline = time.monotonic() + wait_s
    while True:
        left: dict[str, int] = {}
        for r in serving.running(path):
            for name, n in r.draining.items():
                # An older generation serving beside its replacement is published as MODEL/N.gG.
                base = re.sub(r"\.g[0-9]+$", "", name)
                if (name in names or base in names) and n > 0:
                    left[base] = left.get(base, 0) + n
        if not left or time.monotonic() >= deadline:
            return left
        await asyncio.sleep(0.1)


def engine_keys(store: AsyncStore) -> Callable[[ReplicaRecord], str]:
    """Each replica generation's engine API key (``launch/keys.py``), from the cluster secret
    beside the state (made on first use)."""
    path = keys.secret_path(Path(store.store.path))
    secret = _SECRETS.get(path)
    if secret is None:
        secret = _SECRETS[path] = keys.ensure_secret(path)
    return lambda rec: keys.record_key(secret, rec)


_SECRETS: dict[Path, bytes] = {}  # read once per process: a key stays the same for a generation


def _view(s: Any) -> tuple[list[Any], Any]:
    """Every replica record and the stored catalog, in one snapshot (on the state's thread)."""
    with s.snapshot():
        return s.records(include_down=True), s.catalog()


def _catalog(doc: dict[str, Any]) -> Catalog | None:
    from cluster_cli.config.catalog import Catalog

    try:
        return Catalog.model_validate(doc)
    except ValueError:
        return None  # a catalog this clusterctl no longer reads: the engines' own mappings


@contextlib.asynccontextmanager
async def _locked(path: Path) -> AsyncIterator[None]:
    """The router config's lock, held for the block: tried in short waits, so the event loop
    goes on and an interrupt ends the wait."""
    wait_s = LOCK_WAIT_S
    lock = path.with_name(path.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"{lock}: cannot lock the router config: {e.strerror or e}") from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"{path}: another clusterctl has held the router config's lock for {wait_s:g} s"
                    ) from None
                await asyncio.sleep(0.02)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
