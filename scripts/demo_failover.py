"""`make demo-failover`: a node killed under load, and the cluster healing itself.

Three CPU nodes of the testbed, two `llama-server` replicas of a generated tiny model behind
`clusterctl serve-router`, `clusterctl supervise` running, four clients streaming through the
router with the official openai client. The node of one replica is killed: it leaves the
router, is marked lost, its replica is rebuilt on a survivor; the clients go on. Then it is
revived and fenced before it is trusted again. Everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gguf_tiny import make_tiny_gguf  # noqa: E402
from llama import free_port  # noqa: E402

NODES = "cpu-01=cpu-only:cpus=8:mem_gib=16,cpu-02=cpu-only:cpus=8:mem_gib=16,cpu-03=cpu-only:cpus=8:mem_gib=16"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


class Clients:
    """Four clients streaming through the router without pause."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.done = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(4)]

    def run(self) -> None:
        from openai import OpenAI

        c = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=30)
        while not self.stop.is_set():
            try:
                parts = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=200, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                for _ in parts:
                    pass
                self.done += 1
            except Exception as e:  # shown: the streams that were on the killed node
                self.failed.append(f"{type(e).__name__}: {str(e)[:80]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".demo-failover")
    ap.add_argument("--grace", type=float, default=5.0, help="supervise --grace (the demo's is short)")
    args = ap.parse_args()
    d = Path(args.dir).resolve()
    if d.exists():  # a state of an earlier run would carry its replicas' generations on
        subprocess.run([sys.executable, "-m", "testbed", "down", "--dir", str(d)], capture_output=True, check=False)
        shutil.rmtree(d)
    py, ctl = sys.executable, str(Path(sys.executable).parent / "clusterctl")
    env = {**os.environ, "CLUSTERCTL_STATE": str(d / "state.db")}
    procs: list[subprocess.Popen[bytes]] = []

    def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(cmd), env=env, check=check, text=True, capture_output=True)

    def state(*cmd: str) -> Any:
        return json.loads(run(ctl, *cmd, "-o", "json").stdout)

    try:
        say("A testbed of 3 CPU nodes (real sshd each), discovered")
        subprocess.run([py, "-m", "testbed", "up", "--dir", str(d), "--nodes", NODES], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        inv = d / "inventory.yaml"
        run(ctl, "discover", "-i", str(inv))
        model = make_tiny_gguf(d / "tiny.gguf")
        catalog = d / "catalog.yaml"
        catalog.write_text(
            f"engines:\n  llamacpp: {{command: {os.environ['LLAMA_SERVER']}}}\n"
            "models:\n  - name: tiny\n    replicas: 2\n    profiles:\n"
            f"      - {{name: cpu, engine: llamacpp, cpus: 2, memory_gib: 1, model: {model}}}\n"
        )
        config = d / "router.yaml"
        config.write_text("models: {}\nrouter:\n  limits:\n    idle_timeout_s: 5.0\n")
        port = free_port()
        procs.append(subprocess.Popen([ctl, "serve-router", "-c", str(config), "--port", str(port),
                                       "--access-log", "off", "--watch-interval", "0.2"], env=env))  # fmt: skip
        say("clusterctl up: two replicas, published to the router")
        run(ctl, "up", "-i", str(inv), "-c", str(catalog))
        for r in state("status", "--no-check")["replicas"]:
            print(f"  {r['name']} on {','.join(r['nodes'])}: {r['state']}")
        say(f"clusterctl supervise --interval 0.5 --grace {args.grace:g} (its log below)")
        sup = subprocess.Popen([ctl, "supervise", "-i", str(inv), "--interval", "0.5", "--grace", str(args.grace)],
                               env=env, stdout=subprocess.DEVNULL)  # fmt: skip
        procs.append(sup)
        time.sleep(2)
        clients = Clients(port)
        for t in clients.threads:
            t.start()
        time.sleep(3)
        victim = next(r for r in state("status", "--no-check")["replicas"] if r["name"] == "tiny/0")
        dead = victim["nodes"][0]
        say(f"Killing {dead} (everything on it dies) while 4 clients stream: {clients.done} requests done so far")
        t0 = time.monotonic()
        subprocess.run([py, "-m", "testbed", "kill", "--dir", str(d), dead], check=True, stdout=subprocess.DEVNULL)
        while time.monotonic() - t0 < 60:
            rows = {r["name"]: r for r in state("status", "--no-check")["replicas"]}
            r = rows.get("tiny/0")
            if r is not None and r["state"] == "ready" and r["nodes"] != [dead]:
                break
            time.sleep(0.3)
        took = time.monotonic() - t0
        time.sleep(3)
        clients.stop.set()
        for t in clients.threads:
            t.join(40)
        say(f"Rebuilt on {r['nodes'][0]} {took:.1f} s after the kill; the clients went on")
        print(f"  requests completed: {clients.done}; failed: {len(clients.failed)} "
              "(streams that were on the killed node, if any)")  # fmt: skip
        for f in clients.failed:
            print(f"    {f}")
        say(f"Reviving {dead}: fenced before it is trusted again")
        subprocess.run([py, "-m", "testbed", "revive", "--dir", str(d), dead], check=True, stdout=subprocess.DEVNULL)
        t1 = time.monotonic()
        while time.monotonic() - t1 < 30 and not any(
            e["kind"] == "node-ready" and e["node"] == dead for e in state("events", "-n", "5")["events"]
        ):
            time.sleep(0.5)
        say("clusterctl events: what the supervisor decided")
        for e in state("events", "-n", "14")["events"]:
            print(f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))} {e['kind']:<17} {e['message']}")
        return 0
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        run(ctl, "down", "--all", check=False)
        subprocess.run([py, "-m", "testbed", "down", "--dir", str(d)], stdout=subprocess.DEVNULL, check=False)


if __name__ == "__main__":
    sys.exit(main())
