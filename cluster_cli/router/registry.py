"""Config -> routing table, carrying live endpoint state across reloads.

Endpoints are keyed by URL. One that survives an update keeps its ``Endpoint`` (in-flight
count, breaker, drain rate, learned capacity, pooled connections); a new one starts
cold; a removed one is marked ``removed``, gets no new requests and is retired once its
in-flight requests finish (listed again before that, it comes back with its state).
A model's admission queue survives with the model.
Building the table does no I/O; the router swaps one reference to apply it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster_cli.router.admission import ModelQueue, QueueLimits
from cluster_cli.router.breaker import BreakerConfig
from cluster_cli.router.config import RouterConfig, endpoint_views
from cluster_cli.router.endpoint import Endpoint


@dataclass
class ModelEntry:
    name: str
    endpoints: list[Endpoint]
    queue: ModelQueue


@dataclass
class Table:
    cfg: RouterConfig
    models: dict[str, ModelEntry]
    endpoints: dict[str, Endpoint]
    models_json: bytes = b""
    retired: list[Endpoint] = field(default_factory=list)


def breaker_config(cfg: RouterConfig) -> BreakerConfig:
    b = cfg.router.breaker
    return BreakerConfig(
        failure_threshold=b.failure_threshold,
        success_threshold=b.success_threshold,
        open_for_s=b.open_for_s,
        max_open_for_s=b.max_open_for_s,
        health_failure_threshold=b.health_failure_threshold,
    )


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "clusterctl"}


def models_json(names: list[str]) -> bytes:
    data = [_model_object(n) for n in names]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).encode()


def model_json(name: str) -> bytes:
    """One model, as ``GET /v1/models/{id}`` answers it."""
    return json.dumps(_model_object(name), separators=(",", ":")).encode()


def adopt_peer_capacity(endpoints: list[Endpoint], restarted: set[str]) -> None:
    """An endpoint whose estimate starts over at a reload (re-added, its limit changed) beside
    endpoints of the same model that kept a learned one starts at the largest of those, probed
    upwards as any estimate. Never full, it took every request the others had no room for (a
    burst of 18 put 14 on it, waiting inside its engine, while the router's queue stayed empty).
    Not at the router's start: every endpoint of an unequal fleet learns its own (the first
    one learned, a small engine's, would be imposed on the others)."""
    # Learned estimates only: an operator's max_inflight is that endpoint's own limit.
    learned = [w.cap for w in endpoints if w.url not in restarted and w.cap is not None and w.view.max_inflight is None]
    if not learned:
        return
    for w in endpoints:
        if w.url in restarted and w.cap is None:
            w.cap = max(learned)


def build_table(
    cfg: RouterConfig,
    old: Table | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> Table:
    """A new table for ``cfg``; live state of surviving endpoints and models comes from ``old``."""
    bcfg = breaker_config(cfg)
    stale_s, probe_s = cfg.router.scrape_stale_s, cfg.router.capacity_probe_s
    old_endpoints = old.endpoints if old else {}
    retiring = {w.url: w for w in old.retired} if old else {}
    endpoints: dict[str, Endpoint] = {}
    restarted: set[str] = set()  # endpoints whose capacity estimate starts over with this table
    for url, view in endpoint_views(cfg).items():
        w = old_endpoints.get(url) or retiring.get(url)  # one still finishing comes back with its state
        if w is None:
            w = Endpoint(view, breaker_cfg=bcfg, clock=clock, stale_s=stale_s, probe_s=probe_s)
            restarted.add(url)
        elif w.update_view(view, breaker_cfg=bcfg, stale_s=stale_s, probe_s=probe_s):
            restarted.add(url)
        endpoints[url] = w
    retired = [w for u, w in old_endpoints.items() if u not in endpoints]
    for w in retired:
        w.retire()
    if old:  # still finishing from earlier reloads, unless they came back
        retired += [w for w in old.retired if w.url not in endpoints and w not in retired]

    models: dict[str, ModelEntry] = {}
    for name, m in cfg.models.items():
        # A model's admission block overrides router.admission key by key: the keys it leaves
        # out are the router's (and so the --max-queue/--queue-timeout flags'), not the built-in defaults.
        spec = cfg.router.admission
        if m.admission is not None:
            spec = spec.model_copy(update={k: getattr(m.admission, k) for k in m.admission.model_fields_set})
        limits = QueueLimits(spec.max_queue, spec.max_wait_s)
        prev = old.models.get(name) if old else None
        if prev is not None:
            q = prev.queue
            q.limits = limits
        else:
            q = ModelQueue(limits)
        models[name] = ModelEntry(name, [endpoints[ep.url] for ep in m.endpoints], q)
        if old is not None and restarted:
            adopt_peer_capacity(models[name].endpoints, restarted)
    return Table(cfg, models, endpoints, models_json(list(models)), retired)
