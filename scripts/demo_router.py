"""Demo: two llama-server replicas of a generated tiny model, clusterctl's router in front,
and a streamed chat completion through it with the official openai client."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gguf_tiny import make_tiny_gguf  # noqa: E402
from llama import free_port, run_llama_server  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".demo")
    ap.add_argument("--keep", action="store_true", help="leave the replicas running (pids in DIR/engines.pids)")
    args = ap.parse_args()
    d = Path(args.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    model = make_tiny_gguf(d / "tiny.gguf")
    print(f"model: {model} ({model.stat().st_size // 1024} KiB, generated with the gguf package)")
    with ExitStack() as stack:
        urls = []
        for i in range(2):
            kept = {"leave_running": d / "engines.pids", "log_path": d / f"tiny-{i}.log"} if args.keep else {}
            url = stack.enter_context(run_llama_server(model, port=free_port(), alias="tiny", n_predict=24, **kept))
            print(f"replica tiny-{i}: llama-server at {url}")
            urls.append(url)
        cfg = d / "router.yaml"
        cfg.write_text(
            "engines:\n"
            '  llamacpp: {metrics: {running: "llamacpp:requests_processing", waiting: "llamacpp:requests_deferred"}}\n'
            "models:\n  tiny:\n    endpoints:\n"
            + "".join(f'      - {{url: "{u}", engine: llamacpp, replica: tiny-{i}}}\n' for i, u in enumerate(urls))
        )
        print(f"router config: {cfg}\n" + cfg.read_text())
        port = free_port()
        ctl = str(Path(sys.executable).parent / "clusterctl")
        router = subprocess.Popen(
            [ctl, "serve-router", "--config", str(cfg), "--port", str(port), "--access-log", "off"],
            start_new_session=True,
        )

        def stop_router() -> None:
            with contextlib.suppress(ProcessLookupError):  # it may have exited (and been reaped) already
                os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(router.pid, signal.SIGKILL)
                router.wait()

        stack.callback(stop_router)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or router.poll() is not None:
                print("router did not become healthy", file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(f"clusterctl serve-router listening on {base}\n")

        from openai import OpenAI

        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        print("models:", [m.id for m in client.models.list().data])
        print("streamed chat completion (the tiny model's weights are random, so is its text):\n  ", end="")
        chunks = 0
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=16, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
                print(chunk.choices[0].delta.content, end="", flush=True)
        print(f"\n  ({chunks} chunks streamed through the router)")
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        # The proxied requests (the router's own /health and /v1/models have no model label).
        lines = [
            m for m in metrics.splitlines() if m.startswith("clusterctl_router_requests_total") and 'model=""' not in m
        ]
        print("router metrics:", *lines[:4], sep="\n  ")
        return 0 if chunks else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the replicas and the router are stopped on the way out
        sys.exit(130)
