"""The router: routes, the forwarding loop, background tasks and live reload.

    client --ClientConn--> Router.handle --Balancer.acquire--> Lease(worker)
                                 |                                 |
                                 +--- Exchange (sink) <--UpstreamConn (pooled)

Background tasks: the sweeper (timeouts, queue deadlines, drain rates, access-log
flush, retiring removed endpoints), metric scrapes, active health checks, and the
endpoint source (config file watch + SIGHUP). A reload builds a new table from the
new config, carrying live endpoint state over, and swaps one reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import unquote

from cluster_cli.router.accesslog import AccessLog
from cluster_cli.router.admission import Rejected
from cluster_cli.router.balancer import Balancer, Lease, no_endpoint
from cluster_cli.router.config import LimitsSpec, RouterConfig
from cluster_cli.router.health import health_loop
from cluster_cli.router.http import Request, error_response, head_only, response
from cluster_cli.router.keys import ApiKeys
from cluster_cli.router.metrics import RouterMetrics
from cluster_cli.router.policy import make_policy
from cluster_cli.router.proxy import FAIL_AFTER, FAIL_BEFORE, NOT_RETRIED, OK, RETRY_5XX, Exchange
from cluster_cli.router.registry import ModelEntry, Table, build_table, model_json
from cluster_cli.router.retry import RetryBudget, RetryPolicy
from cluster_cli.router.scrape import scrape_loop
from cluster_cli.router.server import ClientConn, raise_fd_limit
from cluster_cli.router.source import EndpointSource
from cluster_cli.router.upstream import UpstreamError, UpstreamPool
from cluster_cli.router.worker import Worker

log = logging.getLogger("clusterctl.router")

PROXY_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"})
SWEEP_S = 0.1
# Kept engine connections unused this long are closed: engines close theirs after 5 s (uvicorn's and
# llama-server's keep-alive timeouts), and reusing one they are closing fails the request (then retried).
IDLE_KEEP_S = 4.0
LOGGED_MODEL_CHARS = 200  # an unknown model name is client text: log at most this much of it


class Router:
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
        self._stopping: str | None = None  # set when stop()'s grace period is over
        self._apply_limits(cfg)
        table = build_table(cfg, clock=clock)
        self._attach_pools(table)
        self.balancer = Balancer(table, make_policy(cfg.router.policy), clock)
        self.metrics = RouterMetrics(lambda: self)
        self.server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._seq = 0
        self._draining = False
        self._inflight_total = 0

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
        for w in table.workers.values():
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
        if cfg.router.policy != old.cfg.router.policy:
            self.balancer.policy = make_policy(cfg.router.policy)
        self.cfg = cfg
        self.balancer.swap(table, dropped)
        self.reloads_ok += 1
        self.last_reload_error = None
        added = [u for u in table.workers if u not in old.workers]
        removed = [u for u in old.workers if u not in table.workers]
        log.warning(
            "config reloaded: %d models, %d endpoints (%d added, %d removed)",
            len(table.models),
            len(table.workers),
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
                    self._live_workers, lambda: self.cfg.router.scrape_interval_s, self.clock, self.balancer.kick
                )
            ),
            loop.create_task(
                health_loop(self._live_workers, lambda: self.cfg.router.health_interval_s, self.balancer.kick)
            ),
        ]
        if self.source is not None:
            self._tasks.append(loop.create_task(self.source.run(self.reload, self.reject_config)))
        return bound

    def _live_workers(self) -> list:
        return list(self.table.workers.values())

    async def stop(self, grace: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then end
        the rest as an engine failure would (a started stream gets its SSE error event and a
        clean end, each request its access-log line), and close."""
        self._draining = True
        if self.server is not None:
            self.server.close()
        deadline = self.clock() + grace
        while self._inflight_total > 0 and self.clock() < deadline:
            await asyncio.sleep(0.05)
        if self._inflight_total > 0:
            self._stopping = f"the router shut down ({grace:g} s grace period over)"
            self.balancer.reject_all(503, "router_draining", self._stopping)  # the queued ones
            for c in list(self.conns):
                if c.exchange is not None:
                    c.exchange.conn.fail("shutdown", self._stopping)
            # Between attempts, a request sees _stopping when it wakes (backoff is short);
            # whatever is still running after a second is cancelled and answered 503.
            end = time.monotonic() + 1.0
            while self._inflight_total > 0 and time.monotonic() < end:
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
        for w in list(self.table.workers.values()) + list(self.table.retired):
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
        for w in t.workers.values():
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
            for w in list(t.workers.values()) + t.retired:
                w.update_rates(now)
        read_limit = self.request_read_timeout
        for c in [c for c in self.conns if not c.busy]:
            if c.reading_since and mono - c.reading_since > read_limit:
                c.read_timed_out(read_limit)
            elif mono - c.last_io > self.client_idle_timeout:
                c.close()
        self.balancer.kick()
        self.access.flush()

    # ---------------------------------------------------------------- routes
    def handle(self, conn: ClientConn, req: Request) -> Awaitable[None] | None:
        """Answer ``req``; proxied paths return the coroutine that serves them, the rest answer at once."""
        path = req.path
        if path in PROXY_PATHS and req.method == b"POST":
            return self.proxy(conn, req)
        t0 = time.monotonic()
        status = self._answer(conn, req)
        self.metrics.answered(status)
        self._log_direct(conn, req, status, time.monotonic() - t0)
        return None

    def check_head(self, req: Request, body_bytes: int) -> tuple[int, str, str, bytes] | None:
        """Refused on its head, its body never read: a proxied request without a valid API key,
        and a body beyond a few KiB (or chunked) for any other route, which reads none (a client
        could otherwise make the router hold max_body_bytes per connection for a 404)."""
        if req.method != b"POST" or req.path not in PROXY_PATHS:
            if body_bytes < 0 or body_bytes > _UNUSED_BODY_MAX:
                # What the route would answer anyway (no route: 404, wrong method: 405) comes
                # first; a body too big to read is the answer only where one would be served.
                return _unroutable(req) or (
                    413,
                    f"{req.path.decode('latin-1')[:100]} takes no request body",
                    "request_too_large",
                    b"",
                )
            return None
        keys = self.api_keys
        if keys is None:
            return None
        if keys.check(req.header(b"authorization")):
            return None
        return 401, _KEY_MESSAGE, "invalid_api_key", _KEY_CHALLENGE

    def refused(self, conn: ClientConn, req: Request | None, status: int, code: str) -> None:
        """A request refused while it was being read (head too large, malformed, body over the limit)."""
        self.metrics.answered(status)
        self._log_direct(conn, req, status, 0.0, code)

    def _log_direct(self, conn: ClientConn, req: Request | None, status: int, took: float, note: str = "") -> None:
        """The access-log line of a request the router answered itself (``req`` None: its head was unreadable)."""
        if self.access.enabled:
            self._seq += 1
            method = req.method.decode("latin-1") if req is not None else ""
            path = req.path.decode("latin-1") if req is not None else ""
            self.access.log(self._seq, conn.peer, method, path, "", "", status, 0, None, took, note)

    def _answer(self, conn: ClientConn, req: Request) -> int:
        """Answer a request that is not proxied; returns its HTTP status."""
        path = req.path
        refusal = _unroutable(req)  # no route (404) or the wrong method (405): as check_head says it
        if refusal is not None:
            status, msg, code, extra = refusal
            data = error_response(status, msg, code, keep_alive=conn.keep_alive, extra=extra)
            conn.write(data if req.method != b"HEAD" else head_only(data))
            return status
        # A HEAD answer is the GET answer's head alone (same Content-Length, no body).
        write = conn.write if req.method == b"GET" else lambda data: conn.write(head_only(data))
        if path == b"/health":
            status = 200 if not self._draining else 503
            # With client keys, a caller without one learns the router's status alone: the
            # detail names every engine's URL (and its state), which a stranger has no use for.
            keys = self.api_keys
            detail = keys is None or keys.check(req.header(b"authorization"))
            write(response(status, self._health_body(detail), keep_alive=conn.keep_alive))
            return status
        if path == b"/metrics":
            write(response(200, self.metrics.render(), keep_alive=conn.keep_alive, ctype=b"text/plain; version=0.0.4"))
            return 200
        if path == b"/v1/models":
            if not self._authorized(conn, req, write):
                return 401
            write(response(200, self.table.models_json, keep_alive=conn.keep_alive))
            return 200
        if path.startswith(b"/v1/models/"):  # OpenAI's models.retrieve; a model name may hold "/"
            if not self._authorized(conn, req, write):
                return 401
            name = unquote(path[len(b"/v1/models/") :].decode("latin-1"))
            if name not in self.table.models:
                msg = f"The model `{name}` does not exist or is not served by this router."
                write(error_response(404, msg, "model_not_found", keep_alive=conn.keep_alive))
                return 404
            write(response(200, model_json(name), keep_alive=conn.keep_alive))
            return 200
        raise AssertionError(f"_unroutable let {path!r} through")  # it names every route above

    def _health_body(self, detail: bool = True) -> bytes:
        """The router's state (without ``detail``: ``{"status": ...}`` alone). ``status`` is
        "draining" (answered with 503) while it shuts down,
        "degraded" while some model has no endpoint that would take a request now, by the
        balancer's own test (each one draining, removed or with its breaker open: a request
        would get 503; a half-open one whose probe is out still counts, requests wait for it),
        such models listed in ``unavailable_models``, or
        after a rejected config reload (``last_reload_error``); else "ok". Only draining changes
        the HTTP status: /health is the router's liveness, and a degraded router still works.
        """
        now = self.clock()
        t = self.table
        unavailable = [n for n, e in t.models.items() if not self.balancer.any_eligible(e)]
        if self._draining:
            status = "draining"
        elif unavailable or self.last_reload_error is not None or self.last_keys_error is not None:
            status = "degraded"
        else:
            status = "ok"
        if not detail:
            return json.dumps({"status": status}, separators=(",", ":")).encode()
        body = {
            "status": status,
            "models": {n: len(e.queue) for n, e in t.models.items()},
            "unavailable_models": unavailable,
            "endpoints": [w.snapshot(now) for w in list(t.workers.values()) + t.retired],
            "last_reload_error": self.last_reload_error,
            "last_keys_error": self.last_keys_error,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    def _authorized(self, conn: ClientConn, req: Request, write: Callable[[bytes], None] | None = None) -> bool:
        keys = self.api_keys
        if keys is None or keys.check(req.header(b"authorization")):
            return True
        (write or conn.write)(
            error_response(401, _KEY_MESSAGE, "invalid_api_key", keep_alive=conn.keep_alive, extra=_KEY_CHALLENGE)
        )
        return False

    # ---------------------------------------------------------------- proxying
    async def proxy(self, conn: ClientConn, req: Request) -> None:
        t0 = time.monotonic()
        self._seq += 1
        rid = self._seq
        model = ""
        status = 0
        endpoint = ""
        attempts = 0
        ttfb: float | None = None
        note = ""
        trace = _Trace()  # what is known so far, for a request cut short by its client
        self._inflight_total += 1
        try:
            status, model, endpoint, attempts, ttfb, note = await self._proxy(conn, req, t0, trace)
        except asyncio.CancelledError:
            status = 499
            model, endpoint, attempts = trace.model, trace.endpoint, trace.attempts
            ex = trace.exchange
            ttfb = ex.first_at - t0 if ex is not None and ex.first_at else None
            stalled = ex is not None and ex.stalled
            note = (
                "dropped: the client read nothing for the idle timeout" if stalled else "client closed the connection"
            )
            if self._stopping is not None and not stalled:
                status, note = 503, self._stopping
                if ex is None or not ex.sent:  # it has had nothing yet: it gets its answer
                    conn.keep_alive = False
                    conn.write(error_response(503, self._stopping, "router_draining", keep_alive=False))
            if ex is not None and ex.done_seen and not stalled:
                # It had the whole stream: OpenAI's clients hang up on "[DONE]" without
                # waiting for the terminating chunk. Served, not abandoned.
                status, note = ex.status, "client closed after [DONE]"
            raise
        except Exception as e:
            status, note = 500, f"internal error: {type(e).__name__}"  # answered so by the server
            model, endpoint, attempts = trace.model, trace.endpoint, trace.attempts
            raise
        finally:
            if trace.suspects:
                _settle(trace.suspects, status)
            self._inflight_total -= 1
            total = time.monotonic() - t0
            self.metrics.request(model, endpoint, status, ttfb, total)
            if self.access.enabled:
                self.access.log(
                    rid,
                    conn.peer,
                    req.method.decode("latin-1"),
                    req.path.decode("latin-1"),
                    model or trace.asked,
                    endpoint,
                    status,
                    attempts,
                    ttfb,
                    total,
                    note,
                )

    def _reply_error(self, conn: ClientConn, status: int, message: str, code: str, extra: bytes = b"") -> int:
        if code == "router_draining":  # the router stops: this connection will not be served again
            conn.keep_alive = False
        conn.write(error_response(status, message, code, keep_alive=conn.keep_alive, extra=extra))
        return status

    def _fail(
        self, conn: ClientConn, status: int, message: str, code: str,
        model: str = "", endpoint: str = "", attempts: int = 0, extra: bytes = b"",
    ) -> tuple[int, str, str, int, float | None, str]:  # fmt: skip
        """Reply with an error and return ``_proxy``'s result tuple for the access log (whose
        note says why: the client's answer is not the only place to find it)."""
        note = f"{code}: {message}"[:300]
        return self._reply_error(conn, status, message, code, extra), model, endpoint, attempts, None, note

    def _no_retry(
        self, conn: ClientConn, r: Rejected, entry: ModelEntry, last_error: str, last_status: int,
        model: str, endpoint: str, attempts: int,
    ) -> tuple[int, str, str, int, float | None, str]:  # fmt: skip
        """A failed request that no endpoint may retry (``r`` says why): 503 with Retry-After
        when its failures took the whole model down (breakers open, Retry-After until the first
        probe), else the last failure's answer."""
        msg = f"{last_error} ({r.message})"
        if not self.balancer.any_eligible(entry):
            self.metrics.rejection(model, r.reason)
            return self._fail(conn, 503, msg, "no_endpoint", model, endpoint, attempts, _retry_after(r))
        return self._last_failure(conn, msg, last_status, model, endpoint, attempts)

    def _last_failure(
        self, conn: ClientConn, msg: str, last_status: int, model: str, endpoint: str, attempts: int
    ) -> tuple[int, str, str, int, float | None, str]:
        if last_status == 429:
            return self._fail(conn, 429, msg, "engine_busy", model, endpoint, attempts, _RETRY_1S)
        return self._fail(conn, last_status, msg, "upstream_error", model, endpoint, attempts)

    async def _proxy(
        self, conn: ClientConn, req: Request, t0: float, trace: _Trace
    ) -> tuple[int, str, str, int, float | None, str]:
        """Serve one proxied request; returns (status, model, endpoint, attempts, ttfb, note).

        ``model`` is a configured model name or "" (it labels metrics); the name the client
        asked for, capped at ``LOGGED_MODEL_CHARS``, goes to ``trace.asked`` for the access
        log. ``trace`` follows the request as it goes, for a client that leaves mid-way.
        """
        if not self._authorized(conn, req):
            return 401, "", "", 0, None, ""
        if self._draining:
            return self._fail(conn, 503, "the router is shutting down", "router_draining")
        try:
            obj = json.loads(req.body)
        except ValueError:
            return self._fail(conn, 400, "request body is not valid JSON", "invalid_json")
        except RecursionError:
            return self._fail(conn, 400, "request body is nested too deeply", "invalid_json")
        if not isinstance(obj, dict):
            return self._fail(
                conn, 400, f"the request body must be a JSON object, not {type(obj).__name__}", "invalid_json"
            )
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            if model is None or model == "":
                return self._fail(conn, 400, "you must provide a model parameter", "missing_model")
            return self._fail(conn, 400, f"model must be a string, not {type(model).__name__}", "invalid_model")
        trace.asked = model[:LOGGED_MODEL_CHARS]
        entry = self.table.models.get(model)
        if entry is None:
            msg = f"The model `{model}` does not exist or is not served by this router."
            return self._fail(conn, 404, msg, "model_not_found")
        trace.model = model

        waits_long = obj.get("stream") is not True  # its answer starts only once it is generated
        # The client's own Authorization never goes upstream (http.REQUEST_DROP): the engine gets
        # its own key, the endpoint's (in ``w.head_lines``), or none.
        head_tail = b"%s%sContent-Length: %d\r\n\r\n" % (req.forward, _forwarded(req, conn), len(req.body))
        start_line = req.method + b" " + req.target + b" HTTP/1.1\r\nHost: "  # then w.head_lines

        loop = asyncio.get_running_loop()
        rp = self.retry_policy
        tried: list = []
        attempts = 0
        # A kept-alive connection the engine closed before answering (llama-server closes about
        # a quarter of them after a streamed reply, without saying so) is not the engine's
        # failure: the request goes again, on a new connection (the other kept ones may be
        # closed too), without spending an attempt.
        stale_retries = 0
        fresh = False
        # A retry holds a slot of the router's retry budget from when it is sent to an engine
        # until that engine answers (its head): waiting in the model's queue puts no load on any
        # engine, and a retried stream once answered is an ordinary one (held for whole streams,
        # ten slow streams used the budget up and every further failure became a 502).
        budget: _BudgetSlot | None = None  # made for the first retry only
        last_error = ""
        last_status = 502
        endpoint = ""
        try:
            while True:
                if self._stopping is not None:  # the grace period ran out between attempts
                    return self._fail(conn, 503, self._stopping, "router_draining", model, endpoint, attempts)
                attempts += 1  # the trace counts it once it has an endpoint (a client may leave the queue)
                if attempts > 1:  # a reload may have replaced the model's endpoints since the last try
                    entry = self.table.models.get(model)
                    if entry is None:
                        msg = f"the model `{model}` was removed from this router while the request was retried"
                        return self._fail(conn, 503, msg, "model_removed", model, endpoint, attempts - 1)
                try:
                    lease: Lease = self.balancer.try_acquire(entry, tried) or await self.balancer.acquire(entry, tried)
                except Rejected as r:
                    attempts -= 1  # this one never reached an engine
                    if r.reason != "no_endpoint" or not last_error:
                        self.metrics.rejection(model, r.reason)
                        extra = _retry_after(r)
                        return self._fail(conn, r.status, r.message, r.reason, model, endpoint, attempts, extra)
                    return self._no_retry(conn, r, entry, last_error, last_status, model, endpoint, attempts)
                w = lease.worker
                if attempts > 1 and not (budget := budget or _BudgetSlot(self.budget)).take(self._inflight_total):
                    lease.release(None)
                    msg = f"{last_error}; retry budget exhausted"
                    return self._fail(conn, last_status, msg, "upstream_error", model, endpoint, attempts - 1)
                endpoint = trace.endpoint = w.view.replica
                trace.attempts = attempts
                # Retries go to another endpoint: with one, the engine's own answer is relayed.
                may_retry = (
                    attempts < rp.max_attempts
                    and len(entry.workers) > 1
                    and self.balancer.has_untried(entry, (*tried, w))
                )
                ex: Exchange | None = None
                try:
                    up = None if fresh else w.pool.get_idle()  # type: ignore[union-attr]
                    fresh = False
                    if up is None:
                        up = await w.pool.connect()  # type: ignore[union-attr]
                    fut: asyncio.Future[int] = loop.create_future()
                    ex = Exchange(conn, up, may_retry, fut, http10=req.version == b"HTTP/1.0")
                    if lease.gen:
                        ex.probe = lease
                    if budget is not None and budget.held:
                        ex.on_answer = budget.give_back
                    conn.exchange = trace.exchange = ex
                    # A half-open breaker's probe holds the endpoint's one slot until its head
                    # comes: it is bounded by the idle timeout, not the response timeout.
                    up.waits_long = waits_long and ex.probe is None
                    up.send(start_line + w.head_lines + head_tail + req.body, ex)
                    code = await fut
                except UpstreamError as e:  # connect failed
                    lease.release(False)
                    last_error, last_status = f"{w.view.replica}: {e.message}", 502
                    code = -1
                except BaseException:
                    if ex is not None:
                        ex.cancel()
                    served = ex is not None and ex.done_seen and not ex.stalled
                    lease.release(_verdict(ex.status) if served else None)  # type: ignore[union-attr]
                    raise
                finally:
                    conn.exchange = None

                if code == OK:
                    verdict = _verdict(ex.status)  # type: ignore[union-attr]
                    if verdict is False and any(st == ex.status for _, _, st in trace.suspects):  # type: ignore[union-attr]
                        verdict = None  # the same 5xx everywhere: the request's, not this engine's
                    lease.release(verdict)
                    return ex.status, model, endpoint, attempts, ex.first_at - t0, ""  # type: ignore[union-attr]
                cut_by_stop = ex is not None and ex.error is not None and ex.error.kind == "shutdown"
                if code == FAIL_AFTER:
                    lease.release(None if cut_by_stop else False)
                    if not cut_by_stop:
                        self.metrics.cut(model, endpoint)
                    if ex is not None and ex.abort_client:
                        conn.abort()
                    err = ex.error.message if ex and ex.error else "upstream failed"
                    return ex.status, model, endpoint, attempts, ex.first_at - t0, f"cut: {err}"  # type: ignore[union-attr]
                reason = "connect"
                if code == RETRY_5XX and ex.status == 429:  # type: ignore[union-attr]
                    lease.release(None)  # too busy: no failure of the endpoint, nor a request served
                    last_error, last_status = f"{w.view.replica} answered HTTP 429 (too busy)", 429
                    reason = "429"
                elif code == RETRY_5XX:
                    # The verdict waits for the retry: the same 5xx from every endpoint is this
                    # request's doing (an image sent to a text-only model), not each engine's,
                    # and must not open every healthy replica's breaker (see _settle).
                    lease.release(None)
                    trace.suspects = [*trace.suspects, (w, lease.gen, ex.status)]  # type: ignore[union-attr]
                    last_error, last_status = f"{w.view.replica} answered HTTP {ex.status}", 502  # type: ignore[union-attr]
                    reason = "5xx"
                elif code == FAIL_BEFORE:
                    e = ex.error  # type: ignore[union-attr]
                    if e is not None and e.kind == "response_timeout":
                        # Sent whole and not answered within the response timeout: the engine may
                        # still be generating it. Another endpoint (or the client's own retry)
                        # would start the work over, and one slow request is no verdict on an
                        # engine whose health checks pass: 504, not retried, no breaker strike
                        # (a half-open breaker's probe never gets here: see waits_long).
                        lease.release(None)
                        msg = f"{w.view.replica}: {e.message}"
                        extra = b"x-should-retry: false\r\n"
                        return self._fail(conn, 504, msg, "upstream_timeout", model, endpoint, attempts, extra)
                    if e is not None and e.stale and stale_retries < _STALE_RETRIES:
                        lease.release(None)  # a keep-alive connection the engine had closed: not its fault
                        stale_retries += 1
                        fresh = True
                        attempts -= 1
                        trace.attempts = attempts
                        continue
                    lease.release(None if cut_by_stop else False)
                    kind = e.kind if e else "reset"
                    last_error = f"{w.view.replica}: {e.message if e else 'upstream failed'}"
                    last_status = 504 if kind == "timeout" else 502
                    reason = kind
                tried.append(w)
                if self._stopping is not None:
                    continue  # answered at the top of the loop
                if attempts >= rp.max_attempts:
                    return self._last_failure(conn, last_error, last_status, model, endpoint, attempts)
                now_entry = self.table.models.get(model)  # a reload may have replaced its endpoints
                if now_entry is not None and not self.balancer.has_untried(now_entry, tried):
                    r = no_endpoint(now_entry.workers) if not self.balancer.any_eligible(now_entry) else _NOWHERE_ELSE
                    return self._no_retry(conn, r, now_entry, last_error, last_status, model, endpoint, attempts)
                self.metrics.retry(model, reason)
                delay = rp.backoff(attempts + 1)
                if delay > 0:
                    await asyncio.sleep(delay)
        finally:
            if budget is not None:
                budget.give_back()


_GET_PATHS = frozenset({b"/health", b"/metrics", b"/v1/models"})


def _unroutable(req: Request) -> tuple[int, str, str, bytes] | None:
    """The 404 or 405 a request gets for its method and path alone, or None for a route that is
    served (``_answer`` and ``check_head`` both go by it, so the two cannot drift apart)."""
    path = req.path
    if path in PROXY_PATHS:
        return None if req.method == b"POST" else (405, "use POST", "method_not_allowed", b"Allow: POST\r\n")
    if req.method in (b"GET", b"HEAD"):
        if path in _GET_PATHS or path.startswith(b"/v1/models/"):
            return None
    elif path in _GET_PATHS:
        return 405, f"{path.decode('latin-1')} takes GET or HEAD", "method_not_allowed", b"Allow: GET, HEAD\r\n"
    return 404, f"no route for {path.decode('latin-1')}", "not_found", b""


_UNUSED_BODY_MAX = 16 * 1024  # what a route that reads no body may still be sent (and is discarded)
_RETRY_1S = b"Retry-After: 1\r\n"
_NOWHERE_ELSE = Rejected(503, "no_endpoint", "no other endpoint to retry on")


def _forwarded(req: Request, conn: ClientConn) -> bytes:
    """The X-Forwarded-For and -Proto lines sent upstream: the list received with the client's
    address appended (as nginx's $proxy_add_x_forwarded_for), and the scheme the router served."""
    addr = conn.peer.rpartition(":")[0].encode()
    if req.forwarded_for:
        addr = req.forwarded_for + b", " + addr if addr else req.forwarded_for
    line = b"X-Forwarded-For: " + addr + b"\r\n" if addr else b""
    return line + b"X-Forwarded-Proto: http\r\n"


def _retry_after(r: Rejected) -> bytes:
    return b"Retry-After: %d\r\n" % int(r.retry_after + 0.999) if r.retry_after else b""


def _verdict(status: int) -> bool | None:
    """What a relayed answer tells the breaker and the drain rate: 5xx a failure, 429 nothing,
    nor 501/505 (the engine does not do this: a refusal, not an outage)."""
    if status < 500:
        return None if status == 429 else True
    return None if status in NOT_RETRIED else False


_STALE_RETRIES = 3  # a new connection cannot be stale: more than one in a row is a reload's or a race's


_DEFAULT_MAX_CONNECTIONS = LimitsSpec.model_fields["max_connections"].default
_KEY_MESSAGE = "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'."
_KEY_CHALLENGE = b'WWW-Authenticate: Bearer realm="clusterctl"\r\n'


class _BudgetSlot:
    """One request's slot of the retry budget: taken once for its retries, given back once."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: RetryBudget) -> None:
        self.budget = budget
        self.held = False

    def take(self, active_requests: int) -> bool:
        if not self.held:
            self.held = self.budget.try_acquire(active_requests)
        return self.held

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.budget.release()


def _settle(suspects: Sequence[tuple[Worker, int, int]], final: int) -> None:
    """The breaker verdicts held back for the 5xx answers a request was retried after. Served
    elsewhere (or failed otherwise), each was its engine's failure; answered with the same
    5xx by every endpoint it tried, it was the request: no engine is blamed."""
    for w, gen, status in suspects:
        if status != final:
            w.breaker.on_result(False, gen, holds_slot=False)
            w.failed += 1


class _Trace:
    """How far one proxied request got: labels its metrics and log line if its client leaves."""

    __slots__ = ("asked", "attempts", "endpoint", "exchange", "model", "suspects")

    def __init__(self) -> None:
        # Endpoints that answered this request with a 5xx and were retried: (worker, the
        # breaker generation it was sent in, status), judged once the request's end is known.
        self.suspects: Sequence[tuple[Worker, int, int]] = ()
        self.asked = ""  # the model the client named (capped), once the body is parsed
        self.model = ""  # the configured model it resolved to
        self.endpoint = ""  # the replica of the current attempt
        self.attempts = 0
        self.exchange: Exchange | None = None
