"""The forwarding loop: one proxied request, attempt by attempt, until it is answered.

    forward --Balancer.acquire--> Lease(endpoint) --relay--> Relay --judge--> Forwarded
       ^                                                    |
       +------------- retry (another endpoint) -------------+

``relay`` sends the request on one endpoint and relays its answer (``proxy.Exchange``),
returning how that ended as a ``Relay``; ``forward`` judges it (breaker verdict, retry or
not, the client's answer) and returns a ``Forwarded`` for the request's metrics and log line.

A stream cut after it reached the client goes to ``_continue``: it ends the client's stream
when nothing more was needed, else sends the request that continues it to another replica
of the model (``resume``) and writes that replica's stream into the same response, up to
``resume_limit`` times, or ends the stream with the error event saying why not.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster_cli.router.admission import Rejected
from cluster_cli.router.affinity import Affinity, blocks, prompt_text
from cluster_cli.router.balancer import Lease, no_endpoint
from cluster_cli.router.http import Request, error_response
from cluster_cli.router.policy import PrefixAffinity
from cluster_cli.router.proxy import (
    FAIL_AFTER,
    FAIL_BEFORE,
    NOT_RETRIED,
    OK,
    REFUSED,
    RETRY_5XX,
    Continuation,
    Exchange,
    end_stream,
)
from cluster_cli.router.resume import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    StreamState,
    can_resume,
    continuation,
    cut_event,
    ending,
    refusal,
)
from cluster_cli.router.retry import RetryBudget
from cluster_cli.router.upstream import UpstreamConn, UpstreamError

if TYPE_CHECKING:
    from cluster_cli.router.endpoint import Endpoint
    from cluster_cli.router.lifecycle import Lifecycle
    from cluster_cli.router.registry import ModelEntry
    from cluster_cli.router.server import ClientConn

log = logging.getLogger("clusterctl.router")

CONNECT_FAILED = -1  # a Relay's outcome when no connection to the engine could be made (else proxy's OK...REFUSED)
_RESUMED_PATHS = (CHAT_PATH.encode(), COMPLETIONS_PATH.encode())


@dataclass(slots=True)
class Forwarded:
    """How a proxied request ended, for its metrics and access-log line: the status the client
    got, the configured model ("" before one was resolved), the replica of the last attempt,
    the attempts that reached an endpoint, seconds to the first byte (None: the router's own
    answer), and a note saying why when it failed (the client's answer is not the only place
    to find it)."""

    status: int
    model: str = ""
    replica: str = ""
    attempts: int = 0
    ttfb: float | None = None
    note: str = ""


@dataclass(slots=True)
class Relay:
    """How one attempt on one endpoint ended.

    ``outcome`` is ``proxy.OK`` (answered whole), ``RETRY_5XX``, ``FAIL_BEFORE`` (nothing
    reached the client), ``FAIL_AFTER`` (cut after bytes reached it) or ``CONNECT_FAILED``;
    ``relayed`` counts the engine's bytes the client was written; ``error`` says why it failed.
    """

    outcome: int
    upstream: Endpoint
    exchange: Exchange | None  # None: no connection was made
    error: UpstreamError | None
    relayed: int = 0

    @property
    def clean(self) -> bool:
        """The engine's answer reached the client whole (its stream ended as the engine ended it)."""
        return self.outcome == OK

    @property
    def status(self) -> int:
        """The engine's HTTP status, 0 when it answered none."""
        return self.exchange.status if self.exchange is not None else 0


class Trace:
    """How far one proxied request got: labels its metrics and log line if its client leaves."""

    __slots__ = ("affinity", "asked", "attempts", "endpoint", "exchange", "model", "suspects")

    def __init__(self) -> None:
        # Endpoints that answered this request with a 5xx and were retried: (endpoint, the
        # breaker generation it was sent in, status), judged once the request's end is known.
        self.suspects: Sequence[tuple[Endpoint, int, int]] = ()
        self.asked = ""  # the model the client named (capped), once the body is parsed
        self.model = ""  # the configured model it resolved to
        self.endpoint = ""  # the replica of the current attempt
        self.attempts = 0
        self.exchange: Exchange | None = None
        self.affinity = ""  # the prefix policy's decision, logged at debug level


def reply_error(conn: ClientConn, status: int, message: str, code: str, extra: bytes = b"") -> int:
    if code == "router_draining":  # the router stops: this connection will not be served again
        conn.keep_alive = False
    conn.write(error_response(status, message, code, keep_alive=conn.keep_alive, extra=extra))
    return status


def fail(
    conn: ClientConn, status: int, message: str, code: str,
    model: str = "", replica: str = "", attempts: int = 0, extra: bytes = b"",
) -> Forwarded:  # fmt: skip
    """Reply with an error; the result's note says why, for the access log."""
    note = f"{code}: {message}"[:300]
    return Forwarded(reply_error(conn, status, message, code, extra), model, replica, attempts, None, note)


async def forward(
    router: Lifecycle,
    conn: ClientConn,
    req: Request,
    model: str,
    entry: ModelEntry,
    waits_long: bool,
    t0: float,
    trace: Trace,
    body: dict[str, Any] | None = None,
) -> Forwarded:
    """Serve ``req`` on an endpoint of ``model`` (``entry``), retrying elsewhere while nothing
    reached the client, and continuing a stream cut after that (``body``: the request's JSON,
    needed to continue it). ``waits_long``: the answer starts only once it is generated (not
    a stream), so the response timeout bounds it rather than the idle timeout."""
    # The client's own Authorization never goes upstream (http.REQUEST_DROP): the engine gets
    # its own key, the endpoint's (in ``w.head_lines``), or none.
    head_tail = b"%s%sContent-Length: %d\r\n\r\n" % (req.forward, _forwarded(req, conn), len(req.body))
    start_line = req.method + b" " + req.target + b" HTTP/1.1\r\nHost: "  # then w.head_lines

    rp = router.retry_policy
    balancer = router.balancer
    tried: list[Endpoint] = []
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
    resume = _resumable(router, req, model, body)
    hint = affinity_of(router, req, model, body)
    try:
        while True:
            if router.stopping is not None:  # the grace period ran out between attempts
                return fail(conn, 503, router.stopping, "router_draining", model, endpoint, attempts)
            attempts += 1  # the trace counts it once it has an endpoint (a client may leave the queue)
            if attempts > 1:  # a reload may have replaced the model's endpoints since the last try
                now_entry = router.table.models.get(model)
                if now_entry is None:
                    msg = f"the model `{model}` was removed from this router while the request was retried"
                    return fail(conn, 503, msg, "model_removed", model, endpoint, attempts - 1)
                entry = now_entry
            try:
                lease: Lease = balancer.try_acquire(entry, tried, hint) or await balancer.acquire(entry, tried, hint)
            except Rejected as r:
                attempts -= 1  # this one never reached an engine
                if r.reason != "no_endpoint" or not last_error:
                    router.metrics.rejection(model, r.reason)
                    return fail(conn, r.status, r.message, r.reason, model, endpoint, attempts, _retry_after(r))
                return _no_retry(router, conn, r, entry, last_error, last_status, model, endpoint, attempts)
            w = lease.endpoint
            if attempts > 1 and not (budget := budget or _BudgetSlot(router.budget)).take(router.inflight_total):
                lease.release(None)
                msg = f"{last_error}; retry budget exhausted"
                return fail(conn, last_status, msg, "upstream_error", model, endpoint, attempts - 1)
            endpoint = trace.endpoint = w.view.replica
            trace.attempts = attempts
            if hint is not None and hint.outcome:
                _affinity_decided(router, hint, endpoint, trace)
            # Retries go to another endpoint: with one, the engine's own answer is relayed.
            may_retry = (
                attempts < rp.max_attempts and len(entry.endpoints) > 1 and balancer.has_untried(entry, (*tried, w))
            )
            payload = start_line + w.head_lines + head_tail + req.body
            # A half-open breaker's probe holds the endpoint's one slot until its head comes:
            # it is bounded by the idle timeout, not the response timeout.
            relay = await _relay(
                conn, req, lease, payload, may_retry, waits_long, fresh, budget, trace, _first_exchange(resume)
            )
            fresh = False
            code, ex = relay.outcome, relay.exchange

            if code == OK:
                assert ex is not None
                verdict = _verdict(ex.status)
                if verdict is False and any(st == ex.status for _, _, st in trace.suspects):
                    verdict = None  # the same 5xx everywhere: the request's, not this engine's
                lease.release(verdict)
                return Forwarded(ex.status, model, endpoint, attempts, ex.first_at - t0)
            cut_by_stop = relay.error is not None and relay.error.kind == "shutdown"
            if code == FAIL_AFTER:
                assert ex is not None
                # The stream was cut after bytes reached the client: with a StreamState it is
                # continued elsewhere or ended here; without, the client was told already.
                lease.release(None if cut_by_stop else False)
                if not cut_by_stop:
                    router.metrics.cut(model, endpoint)
                if ex.state is not None and isinstance(resume, _Resume):
                    tried.append(w)
                    budget = budget or _BudgetSlot(router.budget)
                    cut = _Cut(ex, relay.error, cut_by_stop, attempts, tried, budget)
                    return await _continue(router, conn, req, model, resume, cut, t0, trace)
                if isinstance(resume, _NotResumed) and not cut_by_stop:
                    router.metrics.resume_failure(model, resume.bucket)
                if ex.abort_client:
                    conn.abort()
                err = relay.error.message if relay.error else "upstream failed"
                return Forwarded(ex.status, model, endpoint, attempts, ex.first_at - t0, f"cut: {err}")
            reason = "connect"
            if code == CONNECT_FAILED:
                assert relay.error is not None
                lease.release(False)
                last_error, last_status = f"{w.view.replica}: {relay.error.message}", 502
            elif code == RETRY_5XX and relay.status == 429:
                lease.release(None)  # too busy: no failure of the endpoint, nor a request served
                last_error, last_status = f"{w.view.replica} answered HTTP 429 (too busy)", 429
                reason = "429"
            elif code == RETRY_5XX:
                # The verdict waits for the retry: the same 5xx from every endpoint is this
                # request's doing (an image sent to a text-only model), not each engine's,
                # and must not open every healthy replica's breaker (see settle).
                lease.release(None)
                trace.suspects = [*trace.suspects, (w, lease.gen, relay.status)]
                last_error, last_status = f"{w.view.replica} answered HTTP {relay.status}", 502
                reason = "5xx"
            elif code == FAIL_BEFORE:
                e = relay.error
                if e is not None and e.kind == "response_timeout":
                    # Sent whole and not answered within the response timeout: the engine may
                    # still be generating it. Another endpoint (or the client's own retry)
                    # would start the work over, and one slow request is no verdict on an
                    # engine whose health checks pass: 504, not retried, no breaker strike
                    # (a half-open breaker's probe never gets here: see _relay's waits_long).
                    lease.release(None)
                    msg = f"{w.view.replica}: {e.message}"
                    extra = b"x-should-retry: false\r\n"
                    return fail(conn, 504, msg, "upstream_timeout", model, endpoint, attempts, extra)
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
            if router.stopping is not None:
                continue  # answered at the top of the loop
            if attempts >= rp.max_attempts:
                return _last_failure(conn, last_error, last_status, model, endpoint, attempts)
            now_entry = router.table.models.get(model)  # a reload may have replaced its endpoints
            if now_entry is not None and not balancer.has_untried(now_entry, tried):
                r = no_endpoint(now_entry.endpoints) if not balancer.any_eligible(now_entry) else _NOWHERE_ELSE
                return _no_retry(router, conn, r, now_entry, last_error, last_status, model, endpoint, attempts)
            router.metrics.retry(model, reason)
            delay = rp.backoff(attempts + 1)
            if delay > 0:
                await asyncio.sleep(delay)
    finally:
        if budget is not None:
            budget.give_back()


async def _relay(
    conn: ClientConn,
    req: Request,
    lease: Lease,
    payload: bytes,
    may_retry: bool,
    waits_long: bool,
    fresh: bool,
    budget: _BudgetSlot | None,
    trace: Trace,
    make: Callable[[ClientConn, UpstreamConn, bool, asyncio.Future[int], bool], Exchange] | None = None,
) -> Relay:
    """Send ``payload`` on ``lease``'s endpoint (a new connection when ``fresh``, else a kept
    one if there is one) and relay its answer to ``conn`` through the sink ``make`` builds
    (an ``Exchange`` by default) until the attempt ends. The lease is released here only
    when the request is cancelled (its client left: the engine's request is dropped at
    once); otherwise the caller judges the result."""
    w = lease.endpoint
    pool = w.pool
    assert pool is not None  # attached by the router when the table was built
    ex: Exchange | None = None
    try:
        up = None if fresh else pool.get_idle()
        if up is None:
            up = await pool.connect()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        ex = (make or Exchange)(conn, up, may_retry, fut, req.version == b"HTTP/1.0")
        if lease.gen:
            ex.probe = lease
        if budget is not None and budget.held:
            ex.on_answer = budget.give_back
        conn.exchange = trace.exchange = ex
        up.waits_long = waits_long and ex.probe is None
        up.send(payload, ex)
        code = await fut
    except UpstreamError as e:  # connect failed
        return Relay(CONNECT_FAILED, w, None, e)
    except BaseException:
        if ex is not None:
            ex.cancel()
        served = ex is not None and ex.done_seen and not ex.stalled
        lease.release(_verdict(ex.status) if served and ex is not None else None)
        raise
    finally:
        conn.exchange = None
    return Relay(code, w, ex, ex.error, ex.relayed)


@dataclass(slots=True)
class _Resume:
    """A streamed request whose cut may be continued: its JSON body, path and settings."""

    body: dict[str, Any]
    path: bytes
    limit: int  # resume_limit
    stall_s: float  # stall_timeout_s


@dataclass(slots=True)
class _Cut:
    """Where a cut stream stands: its first exchange, why it was cut, the attempts so far,
    the endpoints tried (the failed one included) and the request's retry-budget slot."""

    first: Exchange
    error: UpstreamError | None
    stopped: bool  # cut by the router's shutdown
    attempts: int
    tried: list[Endpoint]
    budget: _BudgetSlot


def affinity_of(router: Lifecycle, req: Request, model: str, body: dict[str, Any] | None) -> Affinity | None:
    """What the request shares with earlier ones, where its model's policy routes on it."""
    policy = router.balancer.policy_for(model)
    if body is None or not isinstance(policy, PrefixAffinity):
        return None
    spec = policy.spec
    session = None
    if spec.session_header:
        name = spec.session_header.lower().encode()
        session = next((v.decode("latin-1") for k, v in req.headers if k == name), None)
    if session is None and spec.session_from_user and isinstance(body.get("user"), str):
        session = body["user"]
    text = prompt_text(req.path, body)
    if text is None and not session:
        return None
    hashed = blocks(text or "", spec.block_chars, spec.max_prompt_chars // spec.block_chars)
    return Affinity(model, hashed, session[:256] if session else None, spec.block_chars)


def _affinity_decided(router: Lifecycle, hint: Affinity, replica: str, trace: Trace) -> None:
    router.metrics.affinity(hint.model, hint.outcome, hint.matched_chars, hint.prompt_chars)
    if log.isEnabledFor(logging.DEBUG):
        trace.affinity = hint.note()  # on the access-log line too
        log.debug("%s -> %s: %s", hint.model, replica, trace.affinity)
    hint.outcome = ""  # a retry decides again


@dataclass(slots=True, frozen=True)
class _NotResumed:
    """A stream that could never be continued: why (for its error event) and the metric's reason."""

    why: str
    bucket: str  # disabled or unsupported


def _resumable(
    router: Lifecycle, req: Request, model: str, body: dict[str, Any] | None
) -> _Resume | _NotResumed | None:
    """For a chat or text completion stream: the settings to continue it if cut, or why it
    never could be; None for any other request."""
    if body is None or body.get("stream") is not True or req.path not in _RESUMED_PATHS:
        return None
    spec = router.cfg.models.get(model)
    r = router.cfg.router
    enabled = spec is None or spec.resume
    why = can_resume(body, req.path, StreamState(), 0, r.resume_limit, enabled=enabled)
    if why is not None:
        return _NotResumed(why, "unsupported" if enabled and r.resume_limit else "disabled")
    return _Resume(body, req.path, r.resume_limit, r.limits.stall_timeout_s)


def _first_exchange(
    resume: _Resume | _NotResumed | None,
) -> Callable[[ClientConn, UpstreamConn, bool, asyncio.Future[int], bool], Exchange] | None:
    """The sink of a first attempt: it keeps a StreamState when the stream may be continued."""
    if resume is None:
        return None

    def make(client: ClientConn, up: UpstreamConn, may_retry: bool, fut: asyncio.Future[int], h10: bool) -> Exchange:
        ex = Exchange(client, up, may_retry, fut, h10)
        if isinstance(resume, _NotResumed):
            ex.cut_why = resume.why
        else:
            ex.state = StreamState()  # a retry before any byte went out starts a new one
            ex.stall_s = resume.stall_s
        return ex

    return make


async def _continue(
    router: Lifecycle, conn: ClientConn, req: Request, model: str, rs: _Resume, cut: _Cut, t0: float, trace: Trace
) -> Forwarded:
    """Finish a stream its engine cut after bytes reached the client: end it when it needs no
    more tokens, else continue it on another replica of ``model`` (the balancer's pick among
    those not tried), again after each cut, up to ``resume_limit`` continuations; else end it
    with the error event saying why. The client's response stays one stream; its status is
    the 200 it already had."""
    first = cut.first
    state = first.state
    assert state is not None
    metrics = router.metrics
    balancer = router.balancer
    ttfb = first.first_at - t0
    endpoint = trace.endpoint
    attempts = cut.attempts
    cause = cut.error.message if cut.error is not None else "upstream failed"
    stopped = cut.stopped
    failed_at = conn.now()  # the current seam's start
    tries = 0
    fwd = req.forward + _forwarded(req, conn)
    while True:
        tail = ending(state, rs.body)  # it needed no more tokens: ended here
        if tail:
            end_stream(conn, first.chunked, tail)
            if tries:
                metrics.resumed(model)
            note = f"continued {tries}x after: {cause}" if tries else f"ended after: {cause}"
            return Forwarded(200, model, endpoint, attempts, ttfb, note[:300])
        why: str | None = None
        bucket = ""
        entry = router.table.models.get(model)
        if stopped or router.stopping is not None:
            why, bucket = "the router is shutting down", "shutdown"
        elif (why := can_resume(rs.body, rs.path, state, tries, rs.limit)) is not None:
            bucket = "limit" if tries >= rs.limit else "unsupported"
        elif entry is None or not balancer.has_untried(entry, cut.tried):
            why, bucket = "no other replica of the model is left to continue it", "no_endpoint"
        # No retry budget: a continuation replaces work its engine lost, it adds none. A node
        # that dies cuts all its streams at once, and the budget (a share of what is in
        # flight) refused most of them while the survivors had room.
        lease: Lease | None = None
        if why is None:
            assert entry is not None
            try:
                lease = balancer.try_acquire(entry, cut.tried) or await balancer.acquire(entry, cut.tried)
            except Rejected as r:
                why, bucket = f"no other replica can take it ({r.message})", "no_endpoint"
        if lease is None:
            assert why is not None
            end_stream(conn, first.chunked, cut_event(cause, why))
            metrics.resume_failure(model, bucket)
            return Forwarded(200, model, endpoint, attempts, ttfb, f"cut: {cause}; not continued: {why}"[:300])

        tries += 1
        attempts += 1
        w = lease.endpoint
        endpoint = trace.endpoint = w.view.replica
        trace.attempts = attempts
        data = json.dumps(
            continuation(rs.body, rs.path, state, w.view.engine), ensure_ascii=False, separators=(",", ":")
        ).encode()
        head = b"%s %s HTTP/1.1\r\nHost: %s%sContent-Length: %d\r\n\r\n" % (
            req.method, req.target, w.head_lines, fwd, len(data)
        )  # fmt: skip

        def make(client: ClientConn, up: UpstreamConn, _r: bool, fut: asyncio.Future[int], _h: bool) -> Exchange:
            return Continuation(client, up, fut, first, state, rs.body)

        # A new connection: a kept one the engine closed meanwhile would cost a continuation.
        try:
            relay = await _relay(conn, req, lease, head + data, False, False, True, cut.budget, trace, make)
        except asyncio.CancelledError:  # the client left; OpenAI's clients do at "[DONE]"
            if (cex := trace.exchange) is not None and cex.first_at:
                metrics.seam(model, cex.first_at - failed_at)
                if cex.done_seen:
                    metrics.resumed(model)
            raise
        cex = relay.exchange
        relayed = cex is not None and cex.first_at > 0
        if relayed:
            assert cex is not None
            metrics.seam(model, cex.first_at - failed_at)
        code, err = relay.outcome, relay.error
        if code == OK:
            lease.release(True)
            metrics.resumed(model)
            return Forwarded(200, model, endpoint, attempts, ttfb, f"continued {tries}x after: {cause}"[:300])
        if code == REFUSED:
            assert isinstance(cex, Continuation)
            lease.release(None)  # the engine answers; it does not take this continuation
            why = refusal(cex.status, bytes(cex.refused or b""))
            end_stream(conn, first.chunked, cut_event(cause, why))
            metrics.resume_failure(model, "engine_refused")
            return Forwarded(200, model, endpoint, attempts, ttfb, f"cut: {cause}; not continued: {why}"[:300])
        stop = err is not None and err.kind == "shutdown"
        if code == RETRY_5XX:
            # No verdict: a continuation (an assistant message to extend) is an unusual request,
            # and its 5xx may be the request's doing; the health checks judge the engine.
            lease.release(None)
            new_cause = f"{w.view.replica} answered HTTP {relay.status} to the continuation"
        else:  # CONNECT_FAILED or FAIL_AFTER
            lease.release(None if stop else False)
            if code == FAIL_AFTER and not stop:
                metrics.cut(model, endpoint)
            new_cause = f"{w.view.replica}: {err.message}" if err is not None else "upstream failed"
        cut.tried.append(w)
        stopped = stopped or stop
        cause = new_cause
        if relayed:
            failed_at = conn.now()  # the continuation had reached the client: a new seam


def _no_retry(
    router: Lifecycle, conn: ClientConn, r: Rejected, entry: ModelEntry, last_error: str, last_status: int,
    model: str, endpoint: str, attempts: int,
) -> Forwarded:  # fmt: skip
    """A failed request that no endpoint may retry (``r`` says why): 503 with Retry-After
    when its failures took the whole model down (breakers open, Retry-After until the first
    probe), else the last failure's answer."""
    msg = f"{last_error} ({r.message})"
    if not router.balancer.any_eligible(entry):
        router.metrics.rejection(model, r.reason)
        return fail(conn, 503, msg, "no_endpoint", model, endpoint, attempts, _retry_after(r))
    return _last_failure(conn, msg, last_status, model, endpoint, attempts)


def _last_failure(conn: ClientConn, msg: str, last_status: int, model: str, endpoint: str, attempts: int) -> Forwarded:
    if last_status == 429:
        return fail(conn, 429, msg, "engine_busy", model, endpoint, attempts, _RETRY_1S)
    return fail(conn, last_status, msg, "upstream_error", model, endpoint, attempts)


def settle(suspects: Sequence[tuple[Endpoint, int, int]], final: int) -> None:
    """The breaker verdicts held back for the 5xx answers a request was retried after. Served
    elsewhere (or failed otherwise), each was its engine's failure; answered with the same
    5xx by every endpoint it tried, it was the request: no engine is blamed."""
    for w, gen, status in suspects:
        if status != final:
            w.breaker.on_result(False, gen, holds_slot=False)
            w.failed += 1


_RETRY_1S = b"Retry-After: 1\r\n"
_NOWHERE_ELSE = Rejected(503, "no_endpoint", "no other endpoint to retry on")
_STALE_RETRIES = 3  # a new connection cannot be stale: more than one in a row is a reload's or a race's


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
