"""Helpers for tests that need a real ``llama-server`` (llama.cpp) running on CPU.

``scripts/install-llama-server.sh`` builds/installs the binary into the cache that
:func:`find_llama_server` looks at; tests generate their model with ``gguf_tiny.make_tiny_gguf``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from simengine import LoopThread

    from cluster_cli.router.app import Router
    from cluster_cli.router.config import RouterConfig

LLAMA_SERVER_ENV = "LLAMA_SERVER"
# Cache layout written by scripts/install-llama-server.sh; keep the two in sync.
PINNED_CACHE_VERSIONS = ("11434.0.0", "skulk-vulkan-0.10434.0")

DEFAULT_STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def llama_cache_dir() -> Path:
    root = os.environ.get("CLUSTERCTL_CACHE") or str(Path.home() / ".cache" / "clusterctl")
    return Path(root) / "llama-server"


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_llama_server() -> str | None:
    """Locate a ``llama-server`` binary: ``$LLAMA_SERVER``, then ``PATH``, then the install cache.

    An explicitly set ``$LLAMA_SERVER`` (a path or a command name) that does not resolve gives ``None`` rather
    than silently falling back to another binary.
    """
    explicit = os.environ.get(LLAMA_SERVER_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if _is_executable(path):
            return str(path.resolve())
        return shutil.which(explicit)

    on_path = shutil.which("llama-server")
    if on_path:
        return on_path

    cache = llama_cache_dir()
    for version in PINNED_CACHE_VERSIONS:
        candidate = cache / version / "bin" / "llama-server"
        if _is_executable(candidate):
            return str(candidate)
    # Any other cached version, newest first.
    others = [p for p in cache.glob("*/bin/llama-server") if _is_executable(p)]
    if others:
        return str(max(others, key=lambda p: p.stat().st_mtime))
    return None


def llama_server_version(binary: str, *, timeout: float = 30.0) -> str | None:
    """First ``version: ...`` line of ``binary --version`` (``None`` if it does not run)."""
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick; racy but good enough for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LlamaServerError(RuntimeError):
    pass


def llama_server_command(
    binary: str,
    model_path: Path | str,
    *,
    port: int,
    host: str = "127.0.0.1",
    alias: str = "tiny",
    n_parallel: int = 2,
    ctx: int = 512,
    n_predict: int = 16,
    threads: int = 1,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv used by :func:`run_llama_server` (exposed so engine-launch code/tests can compare)."""
    return [
        binary,
        "--host", host,
        "--port", str(port),
        "-m", str(model_path),
        "--alias", alias,
        "-c", str(ctx),
        "-np", str(n_parallel),
        "-n", str(n_predict),  # server-side default cap; clients still cap with max_tokens
        "--metrics",
        # Be light on a shared 2-core CI box: one compute thread, no GPU offload, no warmup, no web UI.
        "-t", str(threads),
        "-tb", str(threads),
        "-ngl", "0",
        "--no-warmup",
        "--no-webui",
        *extra_args,
    ]  # fmt: skip


def _tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n_bytes:].decode("utf-8", "replace")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=STOP_TIMEOUT_S)


@contextlib.contextmanager
def run_llama_server(
    model_path: Path | str,
    *,
    port: int,
    alias: str = "tiny",
    n_parallel: int = 2,
    ctx: int = 512,
    extra_args: Sequence[str] = (),
    binary: str | None = None,
    host: str = "127.0.0.1",
    n_predict: int = 16,
    threads: int = 1,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
    log_path: Path | None = None,
    leave_running: Path | None = None,
) -> Iterator[str]:
    """Start ``llama-server`` on ``model_path`` and yield its base URL (``http://host:port``, no ``/v1``).

    Waits (at most ``startup_timeout`` seconds) until ``GET /health`` answers 200, raising
    :class:`LlamaServerError` with the tail of the server log otherwise.  The server runs in its own process
    group, which is terminated (then killed) on exit.  Server output goes to ``log_path`` (a temporary file
    by default, deleted afterwards). With ``leave_running`` (a file), the server is left running
    on exit and its pid appended to that file (give ``log_path`` too: it outlives the block).
    """
    binary = binary or find_llama_server()
    if binary is None:
        raise LlamaServerError("llama-server not found (set $LLAMA_SERVER or run scripts/install-llama-server.sh)")
    cmd = llama_server_command(
        binary,
        model_path,
        port=port,
        host=host,
        alias=alias,
        n_parallel=n_parallel,
        ctx=ctx,
        n_predict=n_predict,
        threads=threads,
        extra_args=extra_args,
    )
    # LLAMA_ARG_* variables would silently change the server's configuration: keep runs hermetic.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    base_url = f"http://{host}:{port}"

    with contextlib.ExitStack() as stack:
        if log_path is None:
            tmpdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="llama-server-"))
            log_path = Path(tmpdir) / "server.log"
        log_file = stack.enter_context(open(log_path, "wb"))
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        stack.callback(_stop, proc)

        deadline = time.monotonic() + startup_timeout
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise LlamaServerError(
                        f"llama-server exited with {proc.returncode} during startup: {' '.join(cmd)}\n{_tail(log_path)}"
                    )
                try:
                    if client.get(f"{base_url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise LlamaServerError(
                        f"llama-server not healthy after {startup_timeout:.0f}s: {' '.join(cmd)}\n{_tail(log_path)}"
                    )
                time.sleep(0.1)
        if leave_running is not None:
            with open(leave_running, "a") as f:
                f.write(f"{proc.pid}\n")
            stack.pop_all()  # healthy: it stays up (the caller's pid file says how to stop it)
        yield base_url


def router_config(
    urls: Sequence[str], *, alias: str = "tiny", router: dict | None = None, **extra: object
) -> RouterConfig:
    """A router config with the ``llama-server`` replicas at ``urls`` as endpoints of ``alias``
    (named ``tiny-0``, ``tiny-1``...), scraped and checked often; ``router`` adds to its
    ``router:`` section, ``extra`` are other top-level sections (``engines``)."""
    from cluster_cli.router.config import RouterConfig

    eps = [{"url": u, "engine": "llamacpp", "replica": f"tiny-{i}"} for i, u in enumerate(urls)]
    doc = {
        **extra,
        "models": {alias: {"endpoints": eps}},
        "router": {"scrape_interval_s": 0.2, "health_interval_s": 0.5, **(router or {})},
    }
    return RouterConfig.model_validate(doc)


@contextlib.contextmanager
def router_running(cfg: RouterConfig) -> Iterator[tuple[str, Router, LoopThread]]:
    """The router of ``cfg`` serving on a free port, on a loop of its own: its base URL, the
    router and the loop (``simengine.LoopThread``); stopped on exit."""
    from simengine import LoopThread

    from cluster_cli.router.app import Router

    lt = LoopThread()
    router = Router(cfg)
    try:
        port = lt.run(router.start("127.0.0.1", 0))
        yield f"http://127.0.0.1:{port}", router, lt
    finally:
        lt.run(router.stop(1))
        lt.close()
