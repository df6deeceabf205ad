"""What each running router says of itself, beside the config it serves: the publisher's way
to know that a new config was loaded and that a draining endpoint has no request left.

A ``serve-router`` serving ``router.yaml`` keeps ``router.yaml.serving/PID.json`` (0600):

    {"pid": 4242, "url": "http://127.0.0.1:8000", "config_sha256": "...", "loaded_at": ...,
     "written_at": ..., "draining": {"tiny/0": 2}}

written atomically when it starts, after every reload, and while an endpoint drains (a few
times a second), removed when it stops. ``config_sha256`` is the digest of the config file's
bytes it last loaded; ``draining`` the requests still in flight on each draining endpoint
(by replica name). A file whose PID no longer runs is a router that died: ignored, and
removed by the next reader. Only routers on the same host can be seen this way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def folder(config: Path) -> Path:
    return config.with_name(config.name + ".serving")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Serving:
    """One running router, as its file says."""

    pid: int
    url: str
    config_sha256: str | None
    loaded_at: float | None
    written_at: float
    draining: dict[str, int]


def write(config: Path, *, url: str, config_sha256: str | None, loaded_at: float | None,
          draining: Mapping[str, int]) -> None:  # fmt: skip
    """This router's file (atomically). Errors are swallowed: a router serves without it."""
    doc = {
        "pid": os.getpid(),
        "url": url,
        "config_sha256": config_sha256,
        "loaded_at": loaded_at,
        "written_at": time.time(),
        "draining": dict(draining),
    }
    d = folder(config)
    with contextlib.suppress(OSError):
        d.mkdir(mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".serving.", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, d / f"{os.getpid()}.json")
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def remove(config: Path) -> None:
    with contextlib.suppress(OSError):
        (folder(config) / f"{os.getpid()}.json").unlink()


def running(config: Path) -> list[Serving]:
    """The routers serving ``config`` on this host now (files of dead ones are removed)."""
    out = []
    d = folder(config)
    try:
        files = sorted(d.glob("*.json"))
    except OSError:
        return []
    for p in files:
        try:
            doc: Any = json.loads(p.read_text())
            pid = int(doc["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid):
            with contextlib.suppress(OSError):
                p.unlink()
            continue
        out.append(
            Serving(
                pid,
                str(doc.get("url") or ""),
                doc.get("config_sha256"),
                doc.get("loaded_at"),
                float(doc.get("written_at") or 0.0),
                {str(k): int(v) for k, v in (doc.get("draining") or {}).items()},
            )
        )
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it runs
    return True
