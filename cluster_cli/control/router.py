"""``serve-router`` as one operation: the bundled router over a config file, with the
command line's settings laid over the config's ``router:`` section.

Nothing here prints; :func:`serve` runs until the router shuts down.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster_cli.errors import ConfigError

if TYPE_CHECKING:
    from cluster_cli.router.accesslog import AccessLog
    from cluster_cli.router.config import RouterConfig

# Each override's place in the config, and the option that sets it (named in its errors).
_FLAGS: dict[tuple[str, ...], str] = {
    ("router", "policy"): "--policy",
    ("router", "limits", "max_body_bytes"): "--max-body-bytes",
    ("router", "limits", "connect_timeout_s"): "--connect-timeout",
    ("router", "limits", "idle_timeout_s"): "--idle-timeout",
    ("router", "limits", "response_timeout_s"): "--response-timeout",
    ("router", "admission", "max_queue"): "--max-queue",
    ("router", "admission", "max_wait_s"): "--queue-timeout",
}


@dataclass(frozen=True)
class Overrides:
    """Settings that replace the config's own; None leaves the config's (or its default)."""

    policy: str | None = None
    max_body_bytes: int | None = None
    connect_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    response_timeout_s: float | None = None
    max_queue: int | None = None
    max_wait_s: float | None = None

    def apply(self, cfg: RouterConfig) -> RouterConfig:
        """``cfg`` with these settings, validated like the file; a value the config's own
        rules refuse is a ConfigError naming its option (``--max-queue -1: ...``). Applied
        again to every config reloaded."""
        from pydantic import ValidationError

        from cluster_cli.router.config import with_overrides

        overrides: dict[str, dict[str, object]] = {
            "": {"policy": self.policy},
            "limits": {
                "max_body_bytes": self.max_body_bytes,
                "connect_timeout_s": self.connect_timeout_s,
                "idle_timeout_s": self.idle_timeout_s,
                "response_timeout_s": self.response_timeout_s,
            },
            "admission": {"max_queue": self.max_queue, "max_wait_s": self.max_wait_s},
        }
        try:
            return with_overrides(cfg, overrides)
        except ValidationError as e:
            first = e.errors()[0]
            flag = _FLAGS.get(tuple(first["loc"]), ".".join(map(str, first["loc"])))
            raise ConfigError(f"{flag} {first.get('input')}: {first['msg']}") from None


def access_log(spec: str) -> AccessLog:
    """The access log ``spec`` names: ``-`` stderr, ``off`` none, else a file appended to
    (raises OSError when it cannot be opened)."""
    from cluster_cli.router.accesslog import AccessLog

    if spec == "off":
        return AccessLog(None)
    if spec == "-":
        return AccessLog(sys.stderr)
    return AccessLog.to_file(spec)


def serve(
    config: Path,
    *,
    host: str,
    port: int,
    overrides: Overrides,
    keys_path: Path | None,
    log: AccessLog,
    watch_interval: float,
    grace: float,
    on_ready: Callable[[int], None],
) -> None:
    """Serve the router on ``host:port`` until SIGTERM or SIGINT (``grace`` seconds for the
    requests in flight), re-reading ``config`` and ``keys_path`` on change; ``on_ready`` gets
    the port bound. Raises ConfigError for a config or keys file that cannot be used, and
    OSError for an address it cannot listen on."""
    import asyncio

    from cluster_cli.router.run import install_uvloop
    from cluster_cli.router.run import serve as run

    install_uvloop()
    asyncio.run(run(config, host=host, port=port, transform=overrides.apply, keys_path=keys_path, access_log=log,
                    watch_interval=watch_interval, grace=grace, on_ready=on_ready))  # fmt: skip
