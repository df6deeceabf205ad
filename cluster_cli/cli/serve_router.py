"""``clusterctl serve-router``: the bundled OpenAI-compatible router."""

from __future__ import annotations

import logging
import sys
from enum import StrEnum
from pathlib import Path

import typer

from cluster_cli.cli import ui
from cluster_cli.cli.main import app
from cluster_cli.errors import ConfigError


def _reflowed(text: str) -> str:
    """``text`` with each paragraph on one line (rich keeps a docstring's line breaks, which
    then break again at the terminal's width), except the verbatim ``\\b`` blocks."""
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split("\n")) for p in text.split("\n\n"))


HELP = _reflowed("""Serve an OpenAI-compatible router in front of the endpoints listed in a router config.

Example config (router.yaml):

\b
    engines:
      vllm: {metrics: {}}                 # empty = vLLM's metric names
      llamacpp: {metrics: {running: "llamacpp:requests_processing", waiting: "llamacpp:requests_deferred"}}
    models:
      tiny:
        endpoints:
          - {url: "http://10.0.0.11:8080", engine: llamacpp, replica: tiny-0}
          - {url: "http://10.0.0.12:8080", engine: llamacpp, replica: tiny-1, draining: true}

\b
    clusterctl serve-router --config router.yaml --port 8000
    curl -N localhost:8000/v1/chat/completions -d '{"model":"tiny","stream":true,"messages":[{"role":"user","content":"hi"}]}'

The config file (and the API keys file) is watched and re-read on change or SIGHUP; an
invalid new one is logged and the previous one keeps serving. Options given here override
the config's router: section. GET /health answers 200 while the router runs (503 while it
shuts down); its "status" is "degraded" when some model has no endpoint that can take a
request (listed in "unavailable_models") or the last reload of either file was rejected.

Exit codes: 0 clean shutdown on SIGTERM or SIGINT; 2 bad config, API keys file or
option value, an access log that cannot be opened, or an address it cannot listen on;
130 interrupted before it started serving; 1 an unexpected internal error.""")


class Policy(StrEnum):
    """Load-balancing policies (``cluster_cli.router.policy.POLICIES``)."""

    least_load = "least_load"
    p2c = "p2c"
    round_robin = "round_robin"
    prefix = "prefix"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


@app.command("serve-router", help=HELP)
def serve_router(
    config: Path = typer.Option(
        ..., "--config", "-c", help="Router config file (YAML), watched for changes.", show_default=False
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on (0 picks a free one).", min=0, max=65535),
    api_keys_file: Path | None = typer.Option(
        None,
        "--api-keys-file",
        help="File with one API key per line (or sha256:HEX) that clients send as 'Authorization: Bearer KEY'; "
        "default none: no key needed.",
        show_default=False,
    ),
    policy: Policy | None = typer.Option(
        None,
        "--policy",
        help="Load-balancing policy (prefix: to the replica already holding the prompt's beginning, "
        "guarded by load); default the config's router.policy, prefix if unset.",
        show_default=False,
    ),
    max_body_bytes: int | None = typer.Option(
        None,
        "--max-body-bytes",
        help="Largest request body accepted, in bytes; default the config's router.limits.max_body_bytes, "
        "32 MiB (33554432) if unset.",
        show_default=False,
    ),
    connect_timeout: float | None = typer.Option(
        None,
        "--connect-timeout",
        help="Upstream connect timeout in seconds; default the config's router.limits.connect_timeout_s, 5 if unset.",
        show_default=False,
    ),
    idle_timeout: float | None = typer.Option(
        None,
        "--idle-timeout",
        help="Seconds an engine may send no bytes before the request fails: a stream's start, and any "
        "silence once it is answering; default the config's "
        "router.limits.idle_timeout_s, 300 if unset.",
        show_default=False,
    ),
    response_timeout: float | None = typer.Option(
        None,
        "--response-timeout",
        help="Seconds an engine may take to start answering a request (a non-streamed reply starts only "
        "once generated; 0: no limit); past it the client gets 504, not retried; default the config's "
        "router.limits.response_timeout_s, 3600 if unset.",
        show_default=False,
    ),
    max_queue: int | None = typer.Option(
        None,
        "--max-queue",
        help="Requests that may wait per model while every endpoint is full; default the config's "
        "router.admission.max_queue, 256 if unset (a model's own admission.max_queue still applies to it).",
        show_default=False,
    ),
    queue_timeout: float | None = typer.Option(
        None,
        "--queue-timeout",
        help="Longest wait in that queue before a 429, in seconds; default the config's "
        "router.admission.max_wait_s, 30 if unset (a model's own admission.max_wait_s still applies to it).",
        show_default=False,
    ),
    access_log: str = typer.Option("-", "--access-log", help="Access log: '-' for stderr, a file path, or 'off'."),
    log_level: LogLevel = typer.Option(
        LogLevel.warning, "--log-level", help="Least severe log messages written to stderr.", case_sensitive=False
    ),
    watch_interval: float = typer.Option(
        1.0, "--watch-interval", min=0.05, help="Seconds between checks of the config and API keys files."
    ),
    grace: float = typer.Option(
        10.0,
        "--grace",
        min=0,
        help="On SIGTERM/SIGINT, seconds in-flight requests get to finish; the rest then end as if "
        "their engine failed (a stream: an SSE error event).",
    ),
) -> None:
    from cluster_cli.control import router

    logging.basicConfig(
        level=getattr(logging, log_level.value.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides = router.Overrides(policy.value if policy is not None else None, max_body_bytes, connect_timeout,
                                 idle_timeout, response_timeout, max_queue, queue_timeout)  # fmt: skip
    if not host.strip():  # an unset $HOST in a script: that would listen on every interface
        ui.abort("--host is empty: give an address (0.0.0.0 to listen on every interface)")
    try:
        alog = router.access_log(access_log)
    except OSError as e:
        ui.abort(f"--access-log: cannot open {access_log}: {e.strerror or e}")

    def ready(bound: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        ui.info(f"clusterctl router listening on http://{shown}:{bound} (config {config})")

    try:
        router.serve(config, host=host, port=port, overrides=overrides, keys_path=api_keys_file, log=alog,
                     watch_interval=watch_interval, grace=grace, on_ready=ready)  # fmt: skip
    except ConfigError as e:
        ui.fail(e)
    except OSError as e:
        ui.abort(f"cannot listen on {host}:{port}: {e.strerror or e}")
