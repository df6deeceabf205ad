"""The router's life: start and stop, live reload of its config and API keys, the sweeper.

Background tasks: the sweeper (timeouts, queue deadlines, drain rates, access-log flush,
retiring removed endpoints), metric scrapes, active health checks, and the endpoint source
(config file watch + SIGHUP). A reload builds a new table from the new config, carrying live
endpoint state over, and swaps one reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.balancer import Balancer
from cluster_cli.router.config import LimitsSpec, RouterConfig
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.health import health_loop
from cluster_cli.router.keys import ApiKeys
from cluster_cli.router.metrics import RouterMetrics
from cluster_cli.router.policy import make_policy
from cluster_cli.router.registry import Table, build_table
from cluster_cli.router.retry import RetryBudget, RetryPolicy
from cluster_cli.router.scrape import scrape_loop
from cluster_cli.router.server import ClientConn, raise_fd_limit
from cluster_cli.router.source import EndpointSource
from cluster_cli.router.upstream import UpstreamPool

log = logging.getLogger("clusterctl.router")

SWEEP_S = 0.1
# Kept engine connections unused this long are closed: engines close theirs after 5 s (uvicorn's and
# llama-server's keep-alive timeouts), and reusing one they are closing fails the request (then retried).
IDLE_KEEP_S = 4.0
_DEFAULT_MAX_CONNECTIONS = LimitsSpec.model_fields["max_connections"].default


class Lifecycle:
    """A router's state and its life: built from a config, started on a socket, reloaded in
    place (endpoints that survive keep their live state), swept every ``SWEEP_S``, stopped
    with a grace period. What it serves is ``routes.Router``'s."""

    def __init__(
        self,
        cfg: RouterConfig,
        *,
        api_keys: ApiKeys | None = None,
        access_log: AccessLog | None = None,
        clock: Callable[[], float] = time.monotonic,
        source: EndpointSource | None = None,
    ) -> None:
        self.clock = clock
        self.cfg = cfg
        self.api_keys = api_keys
        self.access = access_log or AccessLog(None)
        self.source = source
        self.conns: set[ClientConn] = set()
        self.lingering: set[ClientConn] = set()  # refused, reading the rest of what they send
        self.reloads_ok = 0
        self.reloads_rejected = 0
        self.last_reload_error: str | None = None
        self.keys_reloads_ok = 0
        self.keys_reloads_rejected = 0
        self.last_keys_error: str | None = None  # the API keys file's last reload failed: old keys kept
        self._manage_fd = False  # raise the open-files limit and cap connections to it (manage_open_files)
        self.stopping: str | None = None  # set when stop()'s grace period is over
        self._apply_limits(cfg)
        table = build_table(cfg, clock=clock)
        self._attach_pools(table)
        self.balancer = Balancer(table, make_policy(cfg.router.policy, cfg.router.prefix), clock)
        self.balancer.configure(cfg)
        self.metrics = RouterMetrics(lambda: self)
        self.server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._draining = False
        self.inflight_total = 0  # proxied requests being served, queued ones included

    # ---------------------------------------------------------------- config
    @property
    def table(self) -> Table:
        return self.balancer.table

    def _apply_limits(self, cfg: RouterConfig) -> None:
        lim = cfg.router.limits
        self.max_header_bytes = lim.max_header_bytes
        self.max_body_bytes = lim.max_body_bytes
        self.connect_timeout = lim.connect_timeout_s
        self.idle_timeout = lim.idle_timeout_s
        self.response_timeout = lim.response_timeout_s
        self.client_idle_timeout = lim.client_idle_timeout_s
        self.request_read_timeout = lim.request_read_timeout_s
        self.max_connections = lim.max_connections
        if self._manage_fd:
            self._fit_open_files(lim.max_connections)
        r = cfg.router.retry
        self.retry_policy = RetryPolicy(
            r.max_attempts, r.budget_ratio, r.min_retry_concurrency, r.backoff_base_s, r.backoff_max_s
        )
        if hasattr(self, "budget"):
            self.budget.policy = self.retry_policy
        else:
            self.budget = RetryBudget(self.retry_policy)

    def manage_open_files(self) -> None:
        """For a router that owns its process: on start and on every reload, raise the soft
        open-files limit toward what ``max_connections`` needs, and cap client connections to
        what it allows (each may hold an engine connection too, plus a reserve), so that the
        router's 503 comes before the kernel's EMFILE."""
        self._manage_fd = True
        self._apply_limits(self.cfg)

    def _fit_open_files(self, wanted: int) -> None:
        soft = raise_fd_limit(wanted)
        if soft <= 0:  # unlimited or unknown
            return
        cap = max(1, (soft - 256) // 2)
        if wanted > cap:
            self.max_connections = cap
            if wanted != _DEFAULT_MAX_CONNECTIONS:  # the default is cut quietly; a value the config sets is not
                log.warning(
                    "router.limits.max_connections %d is more than the open-files limit %d allows: "
                    "serving at most %d client connections (raise the hard limit: ulimit -Hn)",
                    wanted,
                    soft,
                    cap,
                )

    def _attach_pools(self, table: Table) -> None:
        for w in table.endpoints.values():
            if w.pool is None:
                w.pool = UpstreamPool(w.view.host, w.view.port, connect_timeout=self.connect_timeout)
            else:
                w.pool.connect_timeout = self.connect_timeout

    def reload(self, cfg: RouterConfig) -> None:
        """Apply a new, already validated config; endpoints that survive keep their live state."""
        old = self.table
        self._apply_limits(cfg)
        table = build_table(cfg, old, clock=self.clock)
        self._attach_pools(table)
        dropped = [(n, e.queue) for n, e in old.models.items() if n not in table.models]
        self.balancer.configure(cfg)
        self.cfg = cfg
        self.balancer.swap(table, dropped)
        self.reloads_ok += 1
        self.last_reload_error = None
        added = [u for u in table.endpoints if u not in old.endpoints]
        removed = [u for u in old.endpoints if u not in table.endpoints]
        log.warning(
            "config reloaded: %d models, %d endpoints (%d added, %d removed)",
            len(table.models),
            len(table.endpoints),
            len(added),
            len(removed),
        )

    def reject_config(self, message: str) -> None:
        self.reloads_rejected += 1
        self.last_reload_error = message
        log.error("config rejected, still serving the previous one: %s", message)

    def reload_keys(self, keys: ApiKeys) -> None:
        self.api_keys = keys
        self.keys_reloads_ok += 1
        self.last_keys_error = None
        log.warning("API keys reloaded: %d keys", len(keys))

    def reject_keys(self, message: str) -> None:
        self.keys_reloads_rejected += 1
        self.last_keys_error = message
        log.error("API keys not reloaded, still using the previous ones: %s", message)

    # ---------------------------------------------------------------- lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 8000, *, sock: object | None = None) -> int:
        loop = asyncio.get_running_loop()
        if sock is not None:
            self.server = await loop.create_server(lambda: ClientConn(self), sock=sock, backlog=4096)
        else:
            self.server = await loop.create_server(
                lambda: ClientConn(self), host, port, backlog=4096, reuse_address=True
            )
        bound = self.server.sockets[0].getsockname()[1]
        self._tasks = [
            loop.create_task(self._sweeper()),
            loop.create_task(
                scrape_loop(
                    self._live_endpoints, lambda: self.cfg.router.scrape_interval_s, self.clock, self.balancer.kick
                )
            ),
            loop.create_task(
                health_loop(self._live_endpoints, lambda: self.cfg.router.health_interval_s, self.balancer.kick)
            ),
        ]
        if self.source is not None:
            self._tasks.append(loop.create_task(self.source.run(self.reload, self.reject_config)))
        return bound

    def _live_endpoints(self) -> list[Endpoint]:
        return list(self.table.endpoints.values())

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then end
        the rest as an engine failure would (a started stream gets its SSE error event and a
        clean end, each request its access-log line), and close."""
        self._draining = True
        if self.server is not None:
            self.server.close()
        deadline = self.clock() + grace
        while self.inflight_total > 0 and self.clock() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight_total > 0:
            self.stopping = f"the router shut down ({grace:g} s grace period over)"
            self.balancer.reject_all(503, "router_draining", self.stopping)  # the queued ones
            for c in list(self.conns):
                if c.exchange is not None:
                    c.exchange.conn.fail("shutdown", self.stopping)
            # Between attempts, a request sees ``stopping`` when it wakes (backoff is short);
            # whatever is still running after a second is cancelled and answered 503.
            end = time.monotonic() + 1.0
            while self.inflight_total > 0 and time.monotonic() < end:
                await asyncio.sleep(0.01)
            for c in list(self.conns):
                if c.task is not None and not c.task.done():
                    c.task.cancel()
            await asyncio.sleep(0)  # let the cancelled requests write their answer and log line
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        closing = list(self.conns)
        for c in closing:
            c.close()  # what was written to it (an error event, a last chunk, a 503) still goes out
        for c in list(self.lingering):
            if c.tr is not None:
                c.tr.close()  # its answer is out (half-closed); what it still sends is not waited for
        for w in list(self.table.endpoints.values()) + list(self.table.retired):
            if w.pool is not None:
                w.pool.close()
        end = time.monotonic() + 1.0  # before the loop ends: a slow reader's last bytes
        while any(c.tr is not None and c.tr.get_write_buffer_size() for c in closing) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.access.flush()

    async def _sweeper(self) -> None:
        last_rates = self.clock()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self._sweep_once(last_rates)
                now = self.clock()
                if now - last_rates >= 1.0:
                    last_rates = now
            except Exception:  # never let bookkeeping kill the sweeper
                log.exception("sweeper error")

    def _sweep_once(self, last_rates: float) -> None:
        now = self.clock()
        mono = time.monotonic()
        t = self.table
        for w in t.endpoints.values():
            pool = w.pool
            if pool is None:
                continue
            if pool.active:
                pool.sweep(mono, self.idle_timeout, self.response_timeout)
            if pool.idle:
                # A draining endpoint's kept connections are closed (it gets no new requests, and
                # its engine may be replaced before it is undrained); elsewhere the ones unused for
                # longer than engines keep them open (uvicorn's and llama-server's 5 s).
                pool.close_idle(mono, 0.0 if w.view.draining else IDLE_KEEP_S)
        for w in list(t.retired):
            if w.pool is not None and w.pool.active:
                w.pool.sweep(mono, self.idle_timeout, self.response_timeout)
            if w.inflight == 0:
                t.retired.remove(w)
                if w.pool is not None:
                    w.pool.close()
        if now - last_rates >= 1.0:
            for w in list(t.endpoints.values()) + t.retired:
                w.update_rates(now)
        read_limit = self.request_read_timeout
        for c in [c for c in self.conns if not c.busy]:
            if c.reading_since and mono - c.reading_since > read_limit:
                c.read_timed_out(read_limit)
            elif mono - c.last_io > self.client_idle_timeout:
                c.close()
        self.balancer.kick()
        self.access.flush()
