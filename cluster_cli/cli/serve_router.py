"""``clusterctl serve-router``: the bundled OpenAI-compatible router."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import typer

from cluster_cli.cli import ui
from cluster_cli.cli.main import app
from cluster_cli.errors import ConfigError

HELP = """Serve an OpenAI-compatible router in front of the endpoints listed in a router config.

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

The config file is watched and re-read on change or SIGHUP; an invalid new config is
logged and the previous one keeps serving.
"""


@app.command("serve-router", help=HELP)
def serve_router(
    config: Path = typer.Option(..., "--config", "-c", help="Router config file (YAML).", show_default=False),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", "-p", help="Port to listen on.", min=0, max=65535),
    api_keys_file: Path | None = typer.Option(
        None, "--api-keys-file", help="One API key per line (or sha256:HEX); clients send 'Authorization: Bearer KEY'."
    ),
    policy: str | None = typer.Option(None, "--policy", help="least_load (default), p2c or round_robin."),
    max_body_bytes: int | None = typer.Option(None, "--max-body-bytes", help="Request body limit [default: 32 MiB]."),
    connect_timeout: float | None = typer.Option(
        None, "--connect-timeout", help="Upstream connect timeout, s [default: 5]."
    ),
    idle_timeout: float | None = typer.Option(
        None, "--idle-timeout", help="Upstream idle (no bytes) timeout, s [default: 300]."
    ),
    max_queue: int | None = typer.Option(
        None, "--max-queue", help="Requests that may wait per model when all endpoints are full [default: 256]."
    ),
    queue_timeout: float | None = typer.Option(
        None, "--queue-timeout", help="Longest wait in that queue before 429, s [default: 30]."
    ),
    access_log: str = typer.Option("-", "--access-log", help="Access log: '-' for stderr, a file path, or 'off'."),
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
    watch_interval: float = typer.Option(1.0, "--watch-interval", help="Seconds between config file checks."),
) -> None:
    from cluster_cli.router.accesslog import AccessLog
    from cluster_cli.router.config import RouterConfig, with_overrides
    from cluster_cli.router.run import install_uvloop, serve

    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        ui.abort(f"--log-level: unknown level {log_level!r}")
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if policy is not None and policy not in ("least_load", "p2c", "round_robin"):
        ui.abort(f"--policy: unknown policy {policy!r} (least_load, p2c, round_robin)")
    overrides: dict[str, dict[str, object]] = {
        "": {"policy": policy},
        "limits": {
            "max_body_bytes": max_body_bytes,
            "connect_timeout_s": connect_timeout,
            "idle_timeout_s": idle_timeout,
        },
        "admission": {"max_queue": max_queue, "max_wait_s": queue_timeout},
    }

    def transform(cfg: RouterConfig) -> RouterConfig:
        try:
            return with_overrides(cfg, overrides)
        except Exception as e:  # pydantic ValidationError on a bad flag value
            raise ConfigError(f"command-line option: {str(e).splitlines()[-1].strip()}") from None

    if access_log == "off":
        alog = AccessLog(None)
    elif access_log == "-":
        alog = AccessLog(sys.stderr)
    else:
        try:
            alog = AccessLog(open(access_log, "a", encoding="utf-8"))  # noqa: SIM115 - lives as long as the process
        except OSError as e:
            ui.abort(f"--access-log: cannot open {access_log}: {e.strerror or e}")

    def ready(bound: int) -> None:
        ui.info(f"clusterctl router listening on http://{host}:{bound} (config {config})")

    install_uvloop()
    try:
        asyncio.run(
            serve(
                config,
                host=host,
                port=port,
                transform=transform,
                keys_path=api_keys_file,
                access_log=alog,
                watch_interval=watch_interval,
                on_ready=ready,
            )
        )
    except ConfigError as e:
        ui.fail(e)
    except OSError as e:
        ui.abort(f"cannot listen on {host}:{port}: {e.strerror or e}")
