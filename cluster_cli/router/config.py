"""The router config: engines with their metric mappings, models with their endpoints, tunables.

```yaml
engines:
  vllm: {metrics: {}}                       # empty = vLLM's names
  llamacpp: {metrics: {running: "llamacpp:requests_processing", waiting: "llamacpp:requests_deferred"}}
models:
  tiny:
    endpoints:
      - {url: "http://198.18.0.11:8080", engine: llamacpp, replica: tiny-0}
      - {url: "http://198.18.0.12:8080", engine: llamacpp, replica: tiny-1, draining: true}
router:                                     # optional; every key has a default
  policy: least_load                        # least_load | p2c | round_robin
  admission: {max_queue: 256, max_wait_s: 30}
```

An engine named under ``endpoints`` but absent from ``engines`` takes its adapter's
metric names (``cluster_cli.engines``); ``metrics: {}`` always means vLLM's names.
Unknown keys are rejected; every error is one line naming the file and the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster_cli.config.load import load_model
from cluster_cli.engines import MetricMapping, get_engine

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(_Strict):
    metrics: dict[str, str | None] | None = None
    health_path: str | None = None

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: dict[str, str | None] | None) -> dict[str, str | None] | None:
        if v is not None:
            MetricMapping.from_config(v)  # raises ValueError naming the bad key
        return v


class EndpointSpec(_Strict):
    url: str
    engine: str = "vllm"
    replica: str | None = None
    draining: bool = False
    max_inflight: int | None = Field(default=None, ge=1)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "http":
            raise ValueError(f"{v!r}: only http:// upstreams are supported")
        if not parts.hostname:
            raise ValueError(f"{v!r}: no host")
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError:
            raise ValueError(f"{v!r}: bad port") from None
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"{v!r}: give the server's base URL without a path")
        return v.rstrip("/")


class QueueSpec(_Strict):
    max_queue: int = Field(default=256, ge=0)
    max_wait_s: float = Field(default=30.0, gt=0)


class ModelSpec(_Strict):
    endpoints: list[EndpointSpec] = Field(min_length=1)
    admission: QueueSpec | None = None

    @model_validator(mode="after")
    def _unique(self) -> ModelSpec:
        seen: set[str] = set()
        for ep in self.endpoints:
            if ep.url in seen:
                raise ValueError(f"endpoint {ep.url} is listed twice")
            seen.add(ep.url)
        return self


class BreakerSpec(_Strict):
    failure_threshold: int = Field(default=5, ge=1)
    success_threshold: int = Field(default=2, ge=1)
    open_for_s: float = Field(default=5.0, gt=0)
    max_open_for_s: float = Field(default=60.0, gt=0)
    health_failure_threshold: int = Field(default=2, ge=1)


class RetrySpec(_Strict):
    max_attempts: int = Field(default=3, ge=1, le=10)
    budget_ratio: float = Field(default=0.2, ge=0, le=1)
    min_retry_concurrency: int = Field(default=10, ge=0)
    backoff_base_s: float = Field(default=0.005, ge=0)
    backoff_max_s: float = Field(default=0.25, ge=0)


class LimitsSpec(_Strict):
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    idle_timeout_s: float = Field(default=300.0, gt=0)
    client_idle_timeout_s: float = Field(default=75.0, gt=0)
    # A request's head and body must arrive whole within this, however they trickle in
    # (the idle timeout alone restarts on every byte: a slow sender could hold a connection).
    request_read_timeout_s: float = Field(default=60.0, gt=0)
    max_connections: int = Field(default=10000, ge=1)


class RouterSpec(_Strict):
    policy: Literal["least_load", "p2c", "round_robin"] = "least_load"
    scrape_interval_s: float = Field(default=0.5, gt=0)
    scrape_stale_s: float = Field(default=3.0, gt=0)
    health_interval_s: float = Field(default=2.0, gt=0)
    capacity_probe_s: float = Field(default=5.0, gt=0)
    limits: LimitsSpec = LimitsSpec()
    breaker: BreakerSpec = BreakerSpec()
    retry: RetrySpec = RetrySpec()
    admission: QueueSpec = QueueSpec()


class RouterConfig(_Strict):
    engines: dict[str, EngineSpec] = Field(default_factory=dict)
    models: dict[str, ModelSpec] = Field(min_length=1)
    router: RouterSpec = RouterSpec()

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        for name in v:
            if not _NAME.match(name):
                raise ValueError(f"{name!r}: model names are 1-128 characters of letters, digits and ._:/@+-")
        return v

    @model_validator(mode="after")
    def _engines_known(self) -> RouterConfig:
        by_url: dict[str, str] = {}
        for mname, m in self.models.items():
            for i, ep in enumerate(m.endpoints):
                if ep.engine not in self.engines and get_engine(ep.engine) is None:
                    known = sorted(set(self.engines) | {"vllm", "llamacpp"})
                    raise ValueError(
                        f"models.{mname}.endpoints.{i}.engine: unknown engine {ep.engine!r} (known: {', '.join(known)})"
                    )
                prev = by_url.setdefault(ep.url, ep.engine)
                if prev != ep.engine:
                    raise ValueError(
                        f"models.{mname}.endpoints.{i}.engine: {ep.url} is listed as both {prev} and {ep.engine}"
                    )
        return self

    def metric_mapping(self, engine: str) -> MetricMapping:
        spec = self.engines.get(engine)
        if spec is not None and spec.metrics is not None:
            return MetricMapping.from_config(spec.metrics)
        adapter = get_engine(engine)
        return adapter.metrics if adapter is not None else MetricMapping.vllm()

    def health_path(self, engine: str) -> str:
        spec = self.engines.get(engine)
        if spec is not None and spec.health_path:
            return spec.health_path
        adapter = get_engine(engine)
        return adapter.health_path if adapter is not None else "/health"


@dataclass(frozen=True)
class EndpointView:
    """One upstream as the router uses it, after merging every model entry that names its URL."""

    url: str
    host: str
    port: int
    engine: str
    replica: str
    draining: bool
    max_inflight: int | None
    metrics: MetricMapping
    health_path: str
    models: tuple[str, ...]


def endpoint_views(cfg: RouterConfig) -> dict[str, EndpointView]:
    """URL -> EndpointView; an endpoint listed under several models is one upstream."""
    acc: dict[str, dict] = {}
    for mname, m in cfg.models.items():
        for ep in m.endpoints:
            parts = urlsplit(ep.url)
            cur = acc.setdefault(
                ep.url,
                {
                    "url": ep.url,
                    "host": parts.hostname or "",
                    "port": parts.port or 80,
                    "engine": ep.engine,
                    "replica": ep.replica or ep.url.removeprefix("http://"),
                    "draining": False,
                    "max_inflight": ep.max_inflight,
                    "metrics": cfg.metric_mapping(ep.engine),
                    "health_path": cfg.health_path(ep.engine),
                    "models": [],
                },
            )
            cur["draining"] = cur["draining"] or ep.draining
            if ep.max_inflight is not None:
                mi = cur["max_inflight"]
                cur["max_inflight"] = ep.max_inflight if mi is None else min(mi, ep.max_inflight)
            cur["models"].append(mname)
    return {u: EndpointView(**{**d, "models": tuple(d["models"])}) for u, d in acc.items()}


def load_router_config(path: Path | str, data: bytes | None = None) -> RouterConfig:
    """Read (or take ``data``, the file's bytes already read) and validate a router config;
    raises ConfigError with a one-line message."""
    return load_model(path, RouterConfig, data)


def with_overrides(cfg: RouterConfig, overrides: dict[str, dict[str, object]]) -> RouterConfig:
    """Apply command-line overrides, e.g. ``{"limits": {"max_body_bytes": 1024}, "": {"policy": "p2c"}}``.

    Keys of the outer mapping name a section of ``router`` ("" = ``router`` itself);
    ``None`` values are ignored. The result is validated like the file.
    """
    data = cfg.model_dump()
    r = data["router"]
    for section, values in overrides.items():
        target = r if not section else r[section]
        for k, v in values.items():
            if v is not None:
                target[k] = v
    return RouterConfig.model_validate(data)
