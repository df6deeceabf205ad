"""Pick an endpoint for a request, or queue it while every endpoint is full.

``acquire`` returns a ``Lease``: the request counts as in flight on its endpoint from
then on, and ``Lease.release(outcome)`` (idempotent) undoes it exactly once, whatever
happens to the request (success, error, retry, client gone). Releasing a slot hands it
to the oldest queued request of any model the endpoint serves.

Only eligible endpoints (not removed, not draining, breaker allowing) are candidates;
the policy chooses among those that are not saturated. With none eligible the
request is refused with a reason in the style of a scheduler's FitError:
"0/4 endpoints available: 2 circuit open, 2 draining".
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Collection

from cluster_cli.router.admission import ModelQueue, Rejected
from cluster_cli.router.affinity import Affinity
from cluster_cli.router.config import PrefixSpec, RouterConfig
from cluster_cli.router.endpoint import Endpoint
from cluster_cli.router.policy import PrefixAffinity, make_policy
from cluster_cli.router.policy.base import Policy
from cluster_cli.router.registry import ModelEntry, Table


class Lease:
    __slots__ = ("_balancer", "answered_at_head", "endpoint", "gen", "released")

    def __init__(self, balancer: Balancer, endpoint: Endpoint, gen: int) -> None:
        self._balancer = balancer
        self.endpoint = endpoint
        self.gen = gen  # the breaker's half-open generation when this is a probe, else 0
        self.released = False
        self.answered_at_head = False

    @property
    def probe(self) -> bool:
        return self.gen > 0

    def answered(self) -> None:
        """A probe's engine answered (a status line below 500, not 429): its probe slot goes
        to the next request at once (one waiting behind it would otherwise wait for a whole
        generation). Whether the engine serves it whole is still what its release tells the
        breaker: an engine that answers and then cuts its streams must not close it."""
        if self.gen and not self.released and not self.answered_at_head:
            self.answered_at_head = True
            w = self.endpoint
            w.breaker.on_answered(self.gen)
            self._balancer.dispatch_for(w)

    def release(self, outcome: bool | None) -> None:
        """outcome: True = the endpoint served it, False = the endpoint failed, None = no verdict."""
        if self.released:
            return
        self.released = True
        w = self.endpoint
        holds = not self.answered_at_head
        if outcome is None:
            w.breaker.on_abandon(self.gen, holds)
        else:
            w.breaker.on_result(outcome, self.gen, holds)
        w.release(outcome)
        self._balancer.on_release(w)


def no_endpoint(endpoints: Collection[Endpoint]) -> Rejected:
    """503 for a model none of whose endpoints may take a request now. ``Retry-After`` is the
    time until the first open breaker lets a probe through (at least 1 s); none when every
    endpoint is draining or removed, since nothing says when that ends."""
    waits = [t for w in endpoints if (t := w.breaker.reopens_in()) is not None]
    return Rejected(503, "no_endpoint", fit_message(endpoints), max(1.0, min(waits)) if waits else None)


def fit_message(endpoints: Collection[Endpoint]) -> str:
    counts = Counter(r for w in endpoints if (r := w.unavailable_reason()) is not None)
    parts = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    return f"0/{len(endpoints)} endpoints available: {parts}" if parts else f"0/{len(endpoints)} endpoints available"


class Balancer:
    def __init__(self, table: Table, policy: Policy, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = table
        self.policy = policy  # the router's
        self.model_policies: dict[str, Policy] = {}  # models with a policy of their own
        self.clock = clock
        self.active_leases = 0

    def configure(self, cfg: RouterConfig) -> None:
        """The router's and each model's policy for ``cfg``. A policy whose name is unchanged is
        kept, with what it learned (a prefix index), and takes the new settings."""
        spec = cfg.router.prefix
        self.policy = _reuse(self.policy, cfg.router.policy, spec)
        own = {}
        for name, m in cfg.models.items():
            if m.policy is not None and m.policy != cfg.router.policy:
                own[name] = _reuse(self.model_policies.get(name), m.policy, spec)
        self.model_policies = own
        for p in (self.policy, *own.values()):
            if isinstance(p, PrefixAffinity):
                for model in [m for m in p.indexes.keys() | p.sessions.keys() if m not in cfg.models]:
                    p.forget_model(model)

    def policy_for(self, model: str) -> Policy:
        return self.model_policies.get(model, self.policy)

    # ---------------------------------------------------------------- picking
    def _pick_now(
        self, entry: ModelEntry, exclude: Collection[Endpoint] = (), hint: Affinity | None = None
    ) -> Lease | None:
        """A lease on the best unsaturated eligible endpoint, or None (all full or none eligible).

        ``exclude`` (a retry: the endpoints that already failed it) are avoided while any other
        eligible endpoint exists, even one that is full for now: the retry then waits for it
        rather than going back to an endpoint that just failed. Once every eligible endpoint
        has been tried, any of them may take it.
        """
        now = self.clock()
        cands: list[Endpoint] = []
        full: list[Endpoint] = []  # eligible, and saturated: a deeper prefix there is affinity lost to load
        for w in entry.endpoints:
            if w.unavailable_reason() is None:
                (full if w.saturated(now) else cands).append(w)
        if exclude:
            untried = [w for w in cands if w not in exclude]
            if untried:
                cands = untried
            elif any(w not in exclude and w.unavailable_reason() is None for w in entry.endpoints):
                return None
        if hint is not None:
            hint.full = tuple(full)
        w = self.model_policies.get(entry.name, self.policy).select(cands, now, hint)
        if w is None:
            return None
        w.acquire()
        self.active_leases += 1
        return Lease(self, w, w.breaker.on_send())

    def any_eligible(self, entry: ModelEntry) -> bool:
        return any(w.unavailable_reason() is None for w in entry.endpoints)

    def try_acquire(
        self, entry: ModelEntry, exclude: Collection[Endpoint] = (), hint: Affinity | None = None
    ) -> Lease | None:
        """The fast path: a lease now, or None when the request must go through ``acquire`` (queue/refuse)."""
        if entry.queue.waiters and entry.queue.peek_live():
            return None
        return self._pick_now(entry, exclude, hint)

    async def acquire(
        self, entry: ModelEntry, exclude: Collection[Endpoint] = (), hint: Affinity | None = None
    ) -> Lease:
        q = entry.queue
        if not q.waiters or not q.peek_live():  # nobody ahead in the queue
            lease = self._pick_now(entry, exclude, hint)
            if lease is not None:
                return lease
        else:
            self.dispatch(entry)
        if not self.any_eligible(entry):
            raise no_endpoint(entry.endpoints)
        if not q.has_room():
            q.rejected_full += 1
            raise Rejected(
                429,
                "queue_full",
                f"model {entry.name!r} is at capacity and its wait queue is full ({q.limits.max_queue})",
                q.retry_after(),
            )
        fut: asyncio.Future[Lease] = asyncio.get_running_loop().create_future()
        q.push(fut, self.clock(), tuple(exclude), hint)  # type: ignore[arg-type]
        self.dispatch(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().release(None)  # a slot was handed over just as the client left
            raise

    # ---------------------------------------------------------------- slots coming free
    def dispatch(self, entry: ModelEntry) -> None:
        """Hand free slots to ``entry``'s queue, oldest first, while any fits."""
        while self._dispatch_one(entry):
            pass

    def _dispatch_one(self, entry: ModelEntry) -> bool:
        """Give one waiter of ``entry`` a slot, if one is free for it now; whether one was served."""
        q = entry.queue
        if not q.waiters or not q.peek_live():
            return False
        head = q.waiters[0]
        lease = self._pick_now(entry, head.exclude, head.hint)
        if lease is None:
            # A retry at the head waits for endpoints it has not tried; the slot that is
            # free may still suit someone behind it.
            return bool(head.exclude) and self._serve_behind(entry)
        waiter = q.pop_live()
        if waiter is None:  # cannot happen after peek_live; keep the slot bookkeeping exact anyway
            lease.release(None)
            return False
        waiter.fut.set_result(lease)  # type: ignore[arg-type]
        return True

    def _dispatch_oldest_first(self, entries: list[ModelEntry]) -> None:
        """Serve several models' queues that may compete for the same endpoints (one endpoint
        serving two models): each free slot goes to the longest-waiting request among them,
        not to whichever model comes first (whose queue, kept full, would starve the other's)."""
        pending = [e for e in entries if e.queue.waiters]
        while pending:
            if len(pending) == 1:
                self.dispatch(pending[0])
                return
            pending = [e for e in pending if e.queue.peek_live()]
            if not pending:
                return
            oldest = min(pending, key=lambda e: e.queue.waiters[0].queued_at)
            if not self._dispatch_one(oldest):
                pending.remove(oldest)  # nothing free for it now: the others may still fit

    def _serve_behind(self, entry: ModelEntry) -> bool:
        """Give a free slot to the first live waiter (past the head) that can take it now."""
        q = entry.queue
        for waiter in q.waiters:
            if waiter.fut.done():
                continue
            lease = self._pick_now(entry, waiter.exclude, waiter.hint)
            if lease is not None:
                q.remove(waiter)
                waiter.fut.set_result(lease)  # type: ignore[arg-type]
                return True
            if not waiter.exclude:
                return False  # nothing is free for a waiter with no exclusions: nor for any behind it
        return False

    def has_untried(self, entry: ModelEntry, tried: Collection[Endpoint]) -> bool:
        """Whether an endpoint not in ``tried`` may take a retry (now or once it has room)."""
        return any(w not in tried and w.unavailable_reason() is None for w in entry.endpoints)

    def on_release(self, w: Endpoint) -> None:
        if self.active_leases > 0:
            self.active_leases -= 1
        self.dispatch_for(w)

    def dispatch_for(self, w: Endpoint) -> None:
        """Dispatch the queues of every model ``w`` serves (a slot of it came free)."""
        models = self.table.models
        entries = [e for name in w.view.models if (e := models.get(name)) is not None and e.queue.waiters]
        if entries:
            self._dispatch_oldest_first(entries)

    def kick(self) -> None:
        """Re-dispatch every queue (after a scrape, breaker change or reload); expire old waiters."""
        now = self.clock()
        self._dispatch_oldest_first(list(self.table.models.values()))
        for entry in self.table.models.values():
            q = entry.queue
            if not q.waiters:
                continue
            for waiter in q.expired(now):
                q.rejected_timeout += 1
                waiter.fut.set_exception(
                    Rejected(
                        429,
                        "queue_timeout",
                        f"model {entry.name!r} stayed at capacity for {q.limits.max_wait_s:g}s",
                        q.retry_after(),
                    )
                )
            if q.waiters and not self.any_eligible(entry):
                rejected = no_endpoint(entry.endpoints)
                while (waiter := q.pop_live()) is not None:
                    waiter.fut.set_exception(Rejected(503, "no_endpoint", rejected.message, rejected.retry_after))

    def reject_all(self, status: int, reason: str, message: str) -> None:
        """Answer every queued request with ``status`` (the router stops)."""
        for entry in self.table.models.values():
            while (waiter := entry.queue.pop_live()) is not None:
                waiter.fut.set_exception(Rejected(status, reason, message))

    def swap(self, table: Table, dropped_queues: Collection[tuple[str, ModelQueue]] = ()) -> None:
        self.table = table
        for name, q in dropped_queues:
            while (waiter := q.pop_live()) is not None:
                waiter.fut.set_exception(Rejected(503, "model_removed", f"model {name!r} was removed from the config"))
        self.kick()


def _reuse(old: Policy | None, name: str, spec: PrefixSpec) -> Policy:
    if old is not None and old.name == name:
        if isinstance(old, PrefixAffinity):
            old.configure(spec)
        return old
    return make_policy(name, spec)
