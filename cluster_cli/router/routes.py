"""The router's routes: which path a request takes, API keys, model lookup, and the routes it
answers itself (/health, /metrics, /v1/models); proxied requests go to ``forward``.

    client --ClientConn--> Router.handle --forward--> Balancer.acquire --> Lease(endpoint)
                                 |                                            |
                                 +----------- Exchange (sink) <--UpstreamConn (pooled)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from urllib.parse import unquote

from cluster_cli.router.forward import Forwarded, Trace, fail, forward, settle
from cluster_cli.router.http import Request, error_response, head_only, response
from cluster_cli.router.lifecycle import Lifecycle
from cluster_cli.router.registry import model_json
from cluster_cli.router.server import ClientConn

PROXY_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"})
LOGGED_MODEL_CHARS = 200  # an unknown model name is client text: log at most this much of it


class Router(Lifecycle):
    """The router: ``ClientConn`` hands it each request it reads (``server.Handler``)."""

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
            "endpoints": [w.snapshot(now) for w in list(t.endpoints.values()) + t.retired],
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
        """Serve a proxied request and account for it (metrics, access-log line), however it
        ends: answered, failed, or cut short by its client or by the router's shutdown."""
        t0 = time.monotonic()
        self._seq += 1
        rid = self._seq
        done = Forwarded(0)
        trace = Trace()  # what is known so far, for a request cut short by its client
        self.inflight_total += 1
        try:
            done = await self._route(conn, req, t0, trace)
        except asyncio.CancelledError:
            done = Forwarded(499, trace.model, trace.endpoint, trace.attempts)
            ex = trace.exchange
            done.ttfb = ex.first_at - t0 if ex is not None and ex.first_at else None
            stalled = ex is not None and ex.stalled
            done.note = (
                "dropped: the client read nothing for the idle timeout" if stalled else "client closed the connection"
            )
            if self.stopping is not None and not stalled:
                done.status, done.note = 503, self.stopping
                if ex is None or not ex.sent:  # it has had nothing yet: it gets its answer
                    conn.keep_alive = False
                    conn.write(error_response(503, self.stopping, "router_draining", keep_alive=False))
            if ex is not None and ex.done_seen and not stalled:
                # It had the whole stream: OpenAI's clients hang up on "[DONE]" without
                # waiting for the terminating chunk. Served, not abandoned.
                done.status, done.note = ex.status, "client closed after [DONE]"
            raise
        except Exception as e:
            # answered so by the server
            done = Forwarded(
                500, trace.model, trace.endpoint, trace.attempts, None, f"internal error: {type(e).__name__}"
            )
            raise
        finally:
            if trace.suspects:
                settle(trace.suspects, done.status)
            self.inflight_total -= 1
            total = time.monotonic() - t0
            self.metrics.request(done.model, done.replica, done.status, done.ttfb, total)
            if self.access.enabled:
                self.access.log(
                    rid,
                    conn.peer,
                    req.method.decode("latin-1"),
                    req.path.decode("latin-1"),
                    done.model or trace.asked,
                    done.replica,
                    done.status,
                    done.attempts,
                    done.ttfb,
                    total,
                    done.note,
                    trace.affinity,
                )

    async def _route(self, conn: ClientConn, req: Request, t0: float, trace: Trace) -> Forwarded:
        """Serve one proxied request: its key, its body, its model, then the forwarding loop.

        The result's ``model`` is a configured model name or "" (it labels metrics); the name
        the client asked for, capped at ``LOGGED_MODEL_CHARS``, goes to ``trace.asked`` for the
        access log. ``trace`` follows the request as it goes, for a client that leaves mid-way.
        """
        if not self._authorized(conn, req):
            return Forwarded(401)
        if self._draining:
            return fail(conn, 503, "the router is shutting down", "router_draining")
        try:
            obj = json.loads(req.body)
        except ValueError:
            return fail(conn, 400, "request body is not valid JSON", "invalid_json")
        except RecursionError:
            return fail(conn, 400, "request body is nested too deeply", "invalid_json")
        if not isinstance(obj, dict):
            return fail(conn, 400, f"the request body must be a JSON object, not {type(obj).__name__}", "invalid_json")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            if model is None or model == "":
                return fail(conn, 400, "you must provide a model parameter", "missing_model")
            return fail(conn, 400, f"model must be a string, not {type(model).__name__}", "invalid_model")
        trace.asked = model[:LOGGED_MODEL_CHARS]
        entry = self.table.models.get(model)
        if entry is None:
            msg = f"The model `{model}` does not exist or is not served by this router."
            return fail(conn, 404, msg, "model_not_found")
        trace.model = model

        waits_long = obj.get("stream") is not True  # its answer starts only once it is generated
        return await forward(self, conn, req, model, entry, waits_long, t0, trace, obj)


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
_KEY_MESSAGE = "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'."
_KEY_CHALLENGE = b'WWW-Authenticate: Bearer realm="clusterctl"\r\n'
