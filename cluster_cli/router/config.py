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
      - {url: "http://198.18.0.13:8080", engine: llamacpp, replica: tiny-2, api_key: "ck-..."}
router:                                     # optional; every key has a default
  policy: prefix                            # prefix | least_load | p2c | round_robin
  admission: {max_queue: 256, max_wait_s: 30}
```

An engine named under ``endpoints`` but absent from ``engines`` takes its adapter's
metric names (``cluster_cli.engines``); ``metrics: {}`` always means vLLM's names.
Unknown keys are rejected; every error is one line naming the file and the field. Values are
not converted between types: a boolean must be a YAML boolean, a count a YAML integer (not
``true`` nor ``4.0``), a number of seconds a YAML number (an integer will do).

An endpoint's ``api_key`` is the key its engine demands: the router sends it as
``Authorization: Bearer KEY`` with every request to that engine (proxied ones, health checks,
metric scrapes), never the client's own. It appears in no error message, log line, metric or
``/health`` answer, nor in the repr of the config.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from cluster_cli.config.load import load_model
from cluster_cli.engines import MetricMapping, get_engine

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")
# What an engine key may hold: visible ASCII, no blank (a header value the engines read as one
# token; a CR or LF would split the request). 4096: the longest any engine could want.
_API_KEY = re.compile(r"[\x21-\x7e]{1,4096}")  # (fullmatch: "$" would let a final newline in)


class _Strict(BaseModel):
    """Unknown keys are errors. Counts and limits are ``StrictInt`` (pydantic would take ``true``
    as 1 and ``4.0`` as 4), flags ``StrictBool`` (not ``"yes"`` nor ``1``), seconds and ratios
    ``StrictFloat`` (an integer will do; a boolean or a string will not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(_Strict):
    metrics: dict[str, str | None] | None = None
    health_path: str | None = None

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, v: dict[str, str | None] | None) -> dict[str, str | None] | None:
        return MetricMapping.checked(v)


class EndpointSpec(_Strict):
    url: str
    engine: str = "vllm"
    replica: str | None = None
    draining: StrictBool = False
    max_inflight: StrictInt | None = Field(default=None, ge=1)
    api_key: str | None = Field(default=None, repr=False)

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        # The message never holds the value: it is a secret, and errors are printed and logged.
        if v is not None and not _API_KEY.fullmatch(v):
            raise ValueError("an engine key is 1-4096 visible ASCII characters, no blanks")
        return v

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
        if "@" in parts.netloc:
            # Not sent: a user part would be ignored, and the engine's refusals would read as its
            # failures. (The message leaves them out: they may be a password.)
            shown = urlsplit(v)._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()
            raise ValueError(f"{shown!r}: credentials in an endpoint URL are not supported (give api_key)")
        if parts.port == 0:
            raise ValueError(f"{v!r}: bad port")
        # One spelling per server, so that duplicates are found and a URL listed under several
        # models is one upstream: rebuilt from its parts, the host in lower case (an IPv6 address
        # in its short form), the port as a number (":08080" is 8080), a trailing "/" and
        # http's own :80 gone. Names are not resolved: "localhost" is not 127.0.0.1.
        host = parts.hostname
        if ":" in host:
            with contextlib.suppress(ValueError):  # a zone ("%eth0") or the like: kept as written
                host = ipaddress.IPv6Address(host).compressed
            host = f"[{host}]"
        port = parts.port
        return f"http://{host}" if port in (None, 80) else f"http://{host}:{port}"


class QueueSpec(_Strict):
    max_queue: StrictInt = Field(default=256, ge=0)
    max_wait_s: StrictFloat = Field(default=30.0, gt=0)


PolicyName = Literal["least_load", "p2c", "round_robin", "prefix"]


class PrefixSpec(_Strict):
    """The ``prefix`` policy's settings (docs/router.md, "Prefix affinity")."""

    block_chars: StrictInt = Field(default=64, ge=8, le=4096)  # ~16 tokens: vLLM's KV block
    min_match_chars: StrictInt = Field(default=256, ge=0)  # shorter matches: load decides
    max_prompt_chars: StrictInt = Field(default=256 * 1024, ge=0)  # of a prompt, indexed
    max_nodes: StrictInt = Field(default=65536, ge=16)  # per model: ~300 bytes each
    balance_abs: StrictFloat = Field(default=4.0, ge=0)  # requests above the least loaded...
    balance_rel: StrictFloat = Field(default=1.5, ge=1)  # ...and this many times it: load decides
    session_header: str = Field(default="x-session-id", max_length=64, pattern=r"^[A-Za-z0-9-]*$")  # "": off
    session_from_user: StrictBool = True  # the OpenAI body's "user" field as a session key
    max_sessions: StrictInt = Field(default=100_000, ge=1)


class ModelSpec(_Strict):
    endpoints: list[EndpointSpec] = Field(min_length=1)
    admission: QueueSpec | None = None
    policy: PolicyName | None = None  # this model's own; None: router.policy
    # Continue this model's cut streams on another replica (router.resume_limit bounds how often).
    resume: StrictBool = True

    @model_validator(mode="after")
    def _unique(self) -> ModelSpec:
        seen: dict[str, int] = {}
        for i, ep in enumerate(self.endpoints):
            first = seen.setdefault(ep.url, i)
            if first != i:
                raise ValueError(f"endpoint {ep.url} is listed twice (endpoints {first} and {i})")
        return self


class BreakerSpec(_Strict):
    failure_threshold: StrictInt = Field(default=5, ge=1)
    success_threshold: StrictInt = Field(default=2, ge=1)
    open_for_s: StrictFloat = Field(default=5.0, gt=0)
    max_open_for_s: StrictFloat = Field(default=60.0, gt=0)
    health_failure_threshold: StrictInt = Field(default=2, ge=1)


class RetrySpec(_Strict):
    max_attempts: StrictInt = Field(default=3, ge=1, le=10)
    budget_ratio: StrictFloat = Field(default=0.2, ge=0, le=1)
    min_retry_concurrency: StrictInt = Field(default=10, ge=0)
    backoff_base_s: StrictFloat = Field(default=0.005, ge=0)
    backoff_max_s: StrictFloat = Field(default=0.25, ge=0)


class LimitsSpec(_Strict):
    max_body_bytes: StrictInt = Field(default=32 * 1024 * 1024, ge=1024)
    max_header_bytes: StrictInt = Field(default=64 * 1024, ge=1024)
    connect_timeout_s: StrictFloat = Field(default=5.0, gt=0)
    idle_timeout_s: StrictFloat = Field(default=300.0, gt=0)
    # An engine's answer (its response head) to a request sent whole: a non-streamed reply comes
    # only once it is generated, so silence then is work, not a failure (0: no limit). Past
    # it the client gets 504, with no retry elsewhere (the work would start over).
    response_timeout_s: StrictFloat = Field(default=3600.0, ge=0)
    client_idle_timeout_s: StrictFloat = Field(default=75.0, gt=0)
    # A request's head and body must arrive whole within this, however they trickle in
    # (the idle timeout alone restarts on every byte: a slow sender could hold a connection).
    request_read_timeout_s: StrictFloat = Field(default=60.0, gt=0)
    # A stream that can be continued elsewhere and sent nothing for this long after its first
    # byte is cut and continued (0: only the idle timeout). 30 s is far beyond an engine's
    # gap between tokens under load, yet a tenth of what a frozen node would cost otherwise.
    stall_timeout_s: StrictFloat = Field(default=30.0, ge=0)
    max_connections: StrictInt = Field(default=10000, ge=1)


class RouterSpec(_Strict):
    # Measured better than least_load on multi-turn chat and no worse elsewhere (bench/prefix.py).
    policy: PolicyName = "prefix"
    prefix: PrefixSpec = PrefixSpec()
    scrape_interval_s: StrictFloat = Field(default=0.5, gt=0)
    scrape_stale_s: StrictFloat = Field(default=3.0, gt=0)
    health_interval_s: StrictFloat = Field(default=2.0, gt=0)
    capacity_probe_s: StrictFloat = Field(default=5.0, gt=0)
    limits: LimitsSpec = LimitsSpec()
    breaker: BreakerSpec = BreakerSpec()
    retry: RetrySpec = RetrySpec()
    admission: QueueSpec = QueueSpec()
    # Times one stream may be continued on another replica after its engine cut it (0: never).
    resume_limit: StrictInt = Field(default=3, ge=0, le=10)


class RouterConfig(_Strict):
    engines: dict[str, EngineSpec] = Field(default_factory=dict)
    models: dict[str, ModelSpec] = Field(default_factory=dict)  # none yet: 404 until `up` publishes some
    router: RouterSpec = RouterSpec()

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        for name in v:
            if not _NAME.match(name):
                raise ValueError(f"{name!r}: model names are 1-128 characters of letters, digits and ._:/@+-")
        return v

    @model_validator(mode="after")
    def _endpoints_consistent(self) -> RouterConfig:
        """Engines are known; a URL listed under several models has one engine and one replica
        name (it is one upstream); a replica name belongs to one URL (metrics and the access
        log tell replicas apart by it)."""
        by_url: dict[str, tuple[str, EndpointSpec]] = {}  # each URL's first entry
        by_replica: dict[str, tuple[str, str]] = {}
        for mname, m in self.models.items():
            for i, ep in enumerate(m.endpoints):
                where = f"models.{mname}.endpoints.{i}"
                if ep.engine not in self.engines and get_engine(ep.engine) is None:
                    known = sorted(set(self.engines) | {"vllm", "llamacpp"})
                    raise ValueError(f"{where}.engine: unknown engine {ep.engine!r} (known: {', '.join(known)})")
                pmodel, prev = by_url.setdefault(ep.url, (mname, ep))
                if prev.engine != ep.engine:
                    raise ValueError(f"{where}.engine: {ep.url} is listed as both {prev.engine} and {ep.engine}")
                if prev.api_key != ep.api_key:  # (the keys themselves are not shown)
                    raise ValueError(f"{where}.api_key: {ep.url} has another api_key (or none) under {pmodel}")
                if replica_name(prev) != replica_name(ep):
                    raise ValueError(
                        f"{where}.replica: {ep.url} is {_replica_desc(ep)} here but {_replica_desc(prev)}"
                        f" under {pmodel}: give it one name"
                    )
                name = replica_name(ep)
                omodel, ourl = by_replica.setdefault(name, (mname, ep.url))
                if ourl != ep.url:
                    unnamed = "" if ep.replica else " (an endpoint without a replica name takes its host:port)"
                    raise ValueError(f"{where}.replica: {name!r} is also {omodel}'s endpoint {ourl}{unnamed}")
        return self

    @model_validator(mode="after")
    def _bounds_ordered(self) -> RouterConfig:
        """A base above its cap would be silently cut to the cap."""
        for section, base, cap in (
            ("retry", "backoff_base_s", "backoff_max_s"),
            ("breaker", "open_for_s", "max_open_for_s"),
        ):
            spec = getattr(self.router, section)
            lo, hi = getattr(spec, base), getattr(spec, cap)
            if lo <= hi:
                continue
            given = spec.model_fields_set
            if cap in given and base not in given:  # name the key the file gave
                raise ValueError(f"router.{section}.{cap}: {hi:g} is below {base} ({lo:g}, the default)")
            default = "" if cap in given else ", the default"
            raise ValueError(f"router.{section}.{base}: {lo:g} is above {cap} ({hi:g}{default})")
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


def replica_name(ep: EndpointSpec) -> str:
    """The name metrics and the access log give the endpoint: its ``replica``, else its host:port."""
    return ep.replica or ep.url.removeprefix("http://")


def _replica_desc(ep: EndpointSpec) -> str:
    return repr(ep.replica) if ep.replica else f"unnamed ({replica_name(ep)!r})"


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
    api_key: str | None = field(default=None, repr=False)  # what the engine demands (sent as a bearer token)


def endpoint_views(cfg: RouterConfig) -> dict[str, EndpointView]:
    """URL -> EndpointView; an endpoint listed under several models is one endpoint."""
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
                    "replica": replica_name(ep),
                    "draining": False,
                    "max_inflight": ep.max_inflight,
                    "metrics": cfg.metric_mapping(ep.engine),
                    "health_path": cfg.health_path(ep.engine),
                    "models": [],
                    "api_key": ep.api_key,
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
