"""Demo: `clusterctl up` starts two llama-server replicas of a generated tiny model on the
testbed's CPU nodes, a `clusterctl serve-router` started before them picks them up, a chat
completion streams through it with the official openai client, and `clusterctl down` stops
them (unless --keep)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gguf_tiny import make_tiny_gguf  # noqa: E402
from llama import free_port  # noqa: E402


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".demo")
    ap.add_argument(
        "--keep", action="store_true", help="leave the replicas running ('clusterctl down --all' stops them)"
    )
    args = ap.parse_args()
    d = Path(args.dir).resolve()
    model = make_tiny_gguf(d / "tiny.gguf")
    binary = os.environ["LLAMA_SERVER"]
    catalog = d / "catalog-cpu.yaml"
    catalog.write_text(
        f"engines:\n  llamacpp: {{command: {binary}}}\n"
        "models:\n  - name: tiny\n    replicas: 2\n    profiles:\n"
        f"      - {{name: cpu, engine: llamacpp, cpus: 2, memory_gib: 1, model: {model}}}\n"
    )
    config = d / "router.yaml"
    config.write_text("models: {}\n")  # the router starts first, with nothing to serve yet
    ctl = str(Path(sys.executable).parent / "clusterctl")
    port = free_port()
    router = subprocess.Popen(
        [ctl, "serve-router", "--config", str(config), "--port", str(port), "--access-log", "off",
         "--watch-interval", "0.5"],
        start_new_session=True,
    )  # fmt: skip

    def stop_router() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(router.pid, signal.SIGTERM)
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(router.pid, signal.SIGKILL)
            router.wait()

    try:
        base = f"http://127.0.0.1:{port}"
        print(f"clusterctl serve-router --config {config} --port {port}   (no models yet: 404 until up)")
        say(f"clusterctl up -c {catalog.name}: two llama-server replicas on the CPU nodes")
        print(catalog.read_text())
        if subprocess.run([ctl, "up", "-c", str(catalog), "--timeout", "120"]).returncode != 0:
            return 1
        say("clusterctl status")
        subprocess.run([ctl, "status"], check=True)
        say("a streamed chat completion through the router (the official openai client)")
        deadline = time.monotonic() + 30
        while True:  # the router reloads its config within its watch interval
            with contextlib.suppress(httpx.HTTPError):
                if any(m["id"] == "tiny" for m in httpx.get(f"{base}/v1/models", timeout=1).json()["data"]):
                    break
            if time.monotonic() > deadline or router.poll() is not None:
                print("the router did not pick up the replicas", file=sys.stderr)
                return 1
            time.sleep(0.2)
        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        print("  (the tiny model's weights are random, so is its text)\n  ", end="")
        chunks = 0
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=16, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                print(chunk.choices[0].delta.content, end="", flush=True)
        print(f"\n  ({chunks} chunks streamed through the router)")
        say("clusterctl logs tiny/0 -n 3")
        subprocess.run([ctl, "logs", "tiny/0", "-n", "3"], check=True)
        if not args.keep:
            say("clusterctl down --all: every process stopped, ports closed, folders removed")
            subprocess.run([ctl, "down", "--all"], check=True)
        return 0 if chunks else 1
    finally:
        stop_router()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
