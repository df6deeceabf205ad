"""The ``vllm`` and ``ray`` stand-ins of ``testbed/standin`` (run here, not over SSH).

They stand in for the real engines on the testbed's nodes (no GPU here): these tests hold
them to what clusterctl relies on: vLLM's HTTP surface and metric names, its process tree
(EngineCore and TP workers that outlive a SIGKILLed API server, vllm#55510, and end on
SIGTERM), Ray's head/worker CLI, and a pipeline-parallel ``vllm serve`` that becomes healthy
only once its Ray cluster has every node.

Each test runs its processes with a unique ``TESTBED_NODE`` marker in their environment and
kills everything that carries it afterwards (orphans and daemons included), pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import standin_env

from testbed.node import _SYS_PATH, alive, cmdline, marked

pytestmark = pytest.mark.slow

STANDIN = Path(__file__).resolve().parent.parent / "testbed" / "standin"
VLLM = str(STANDIN / "vllm")
RAY = str(STANDIN / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


def health(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


class Sandbox:
    """Processes of one test: a marker in their environment, a log each, all killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.marker = f"standin-test-{uuid.uuid4().hex[:12]}"
        self.procs: list[subprocess.Popen[bytes]] = []
        # The nodes run the scripts with the system python3 (no venv, no pyenv shim): so do we.
        path = f"{STANDIN}:{_SYS_PATH}"
        if shutil.which("python3", path=_SYS_PATH) is None:
            path = f"{STANDIN}:{os.path.dirname(sys.executable)}:{_SYS_PATH}"
        self.base_env = {
            "PATH": path,
            "HOME": str(tmp),
            "TESTBED_NODE": self.marker,
            "RAY_TMPDIR": str(tmp),
            "STANDIN_LOAD_S": "0.3",
            "STANDIN_TOKEN_DELAY_S": "0.002",
        }

    def env(self, **extra: str | None) -> dict[str, str]:
        env = dict(self.base_env)
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def start(self, name: str, argv: list[str], **env: str | None) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, env=self.env(**env), stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def run(self, argv: list[str], timeout: float = 30, **env: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=self.env(**env), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def titled(self) -> dict[str, list[int]]:
        """The live processes of this test by command line."""
        out: dict[str, list[int]] = {}
        for pid in marked(self.marker):
            if alive(pid):
                out.setdefault(cmdline(pid).strip(), []).append(pid)
        return out

    def cleanup(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (left := [p for p in marked(self.marker) if alive(p)]) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


@pytest.fixture
def sb(tmp_path: Path) -> Iterator[Sandbox]:
    s = Sandbox(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()


def serve(sb: Sandbox, port: int, *args: str, name: str = "vllm", **env: str | None) -> subprocess.Popen[bytes]:
    argv = [VLLM, "serve", "/models/tiny", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    return sb.start(name, [*argv, *args], **env)


def wait_healthy(sb: Sandbox, p: subprocess.Popen[bytes], port: int, timeout: float = 15, name: str = "vllm") -> None:
    def up() -> bool:
        if p.poll() is not None:
            raise AssertionError(f"vllm exited with {p.returncode}:\n{sb.log(name)}")
        return health(port) == 200

    wait_for(up, timeout, "GET /health to answer 200")


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "argv",
    [
        [VLLM, "serve", "m", "--no-such-flag"],
        [VLLM, "serve", "m", "--port", "8000", "--tensor-parallel-size"],
        [VLLM, "serve", "m", "--distributed-executor-backend", "nccl"],
        [VLLM, "serve", "m", "--tensor-parallel"],  # no abbreviations
        [VLLM, "sreve", "m"],
        [RAY, "start", "--head", "--no-such-flag"],
        [RAY, "start", "--head", "--port=notaport"],
    ],
)
def test_a_bad_command_line_fails_at_once_with_exit_2(sb: Sandbox, argv: list[str]) -> None:
    t0 = time.monotonic()
    r = sb.run(argv, timeout=10)
    assert r.returncode == 2, r
    assert "error" in r.stderr.lower() and "usage:" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 5
    assert not sb.titled()  # nothing started


def test_too_few_visible_gpus_for_the_world_size_fail_like_vllm(sb: Sandbox) -> None:
    r = sb.run([VLLM, "serve", "m", "--port", str(free_port()), "--tensor-parallel-size", "2"],
               CUDA_VISIBLE_DEVICES="0")  # fmt: skip
    assert r.returncode == 1 and "World size (2) is larger than the number of available GPUs (1)" in r.stdout, r
    r = sb.run([VLLM, "serve", "m", "--port", str(free_port())], CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 1 and "no CUDA device is visible" in r.stdout, r


def test_a_port_in_use_fails_the_server(sb: Sandbox) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = sb.run([VLLM, "serve", "m", "--host", "127.0.0.1", "--port", str(s.getsockname()[1])])
    assert r.returncode == 1 and "Address already in use" in r.stdout, r


# ---------------------------------------------------------------------------- one node


def test_single_node_serves_health_models_chat_and_metrics(sb: Sandbox) -> None:
    port = free_port()
    p = serve(sb, port, "--max-model-len", "2048", STANDIN_LOAD_S="1.0", CUDA_VISIBLE_DEVICES="GPU-1",
              CUDA_DEVICE_ORDER="PCI_BUS_ID", NCCL_IB_HCA=None)  # fmt: skip
    first = wait_for(lambda: health(port), 10, "the port to answer")
    assert first == 503  # loading
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False)
    assert r.status_code == 503
    wait_healthy(sb, p, port)

    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False).json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["root"]) for m in models["data"]] == [("tiny", "model", "/models/tiny")]

    with httpx.Client(trust_env=False) as http:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", http_client=http)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert chat.object == "chat.completion" and chat.model == "tiny"
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        assert chat.choices[0].finish_reason == "length" and chat.usage and chat.usage.completion_tokens == 5

        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == "lorem ipsum dolor sit "
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

        text = client.completions.create(model="tiny", prompt="say", max_tokens=3)
        assert text.object == "text_completion" and text.choices[0].text and text.choices[0].finish_reason == "length"
        streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="x", stream=True))
        assert streamed  # no max_tokens: the stand-in's default length

        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])

    raw = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", trust_env=False,
                     json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                           "max_tokens": 2})  # fmt: skip
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)

    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "vllm:request_success_total"):  # fmt: skip
        assert re.search(rf'^{re.escape(name)}{{[^}}]*model_name="tiny"[^}}]*}} [0-9.]+$', metrics, re.M), name
    assert re.search(r'^vllm:request_success_total{[^}]*finished_reason="length"} [1-9]', metrics, re.M)

    log = sb.log("vllm")
    assert "non-default args:" in log and "'tensor_parallel_size'" not in log
    (seen,) = [v for (who, _), v in standin_env(log).items() if who == "APIServer"]
    assert seen == {"CUDA_VISIBLE_DEVICES": "GPU-1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_IB_HCA": None,
                    "VLLM_HOST_IP": None, "RAY_ADDRESS": None}  # fmt: skip
    titled = sb.titled()
    assert "VLLM::EngineCore" in titled and not [t for t in titled if "Worker" in t]  # TP=1: no worker process

    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    wait_for(lambda: not sb.titled(), 5, "the engine core to end with the server")


def test_concurrent_requests_show_in_the_running_gauge(sb: Sandbox) -> None:
    port = free_port()
    p = serve(sb, port, "--max-num-seqs", "2", STANDIN_TOKEN_DELAY_S="0.05")
    wait_healthy(sb, p, port)
    url = f"http://127.0.0.1:{port}"

    def gauges() -> tuple[float, float]:
        text = httpx.get(f"{url}/metrics", trust_env=False).text
        run = re.search(r"^vllm:num_requests_running{.*} (\S+)$", text, re.M)
        wait = re.search(r"^vllm:num_requests_waiting{.*} (\S+)$", text, re.M)
        assert run and wait
        return float(run[1]), float(wait[1])

    def one() -> None:
        with httpx.Client(trust_env=False, timeout=30) as c:
            c.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10}).raise_for_status()

    # Three requests against two slots: two run, one waits.
    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: gauges() == (2.0, 1.0), 5, "2 running and 1 waiting")
    for t in threads:
        t.join(20)
    assert gauges() == (0.0, 0.0)


# ---------------------------------------------------------------------------- API key


def test_with_its_key_in_the_environment_it_serves_v1_only_with_the_key_as_vllm_does(sb: Sandbox) -> None:
    """Started as the adapter starts vLLM (its argv, VLLM_API_KEY in its environment): a client
    going around the router gets 401 on every /v1 route, while /health and /metrics stay open;
    the router, given the replica's key, is served; the key is printed nowhere."""
    from simengine import Fleet

    from cluster_cli.engines import LaunchSpec, get_engine
    from cluster_cli.launch.keys import replica_key

    key = replica_key(b"k" * 32, "tiny", 0, 7)
    port = free_port()
    adapter = get_engine("vllm")
    spec = LaunchSpec(model="/models/tiny", served_name="tiny", host="127.0.0.1", port=port, gpus=(0,), api_key=key)
    argv = adapter.command(spec, binary=VLLM)
    assert not any(key in a for a in argv)
    p = sb.start("vllm", argv, **adapter.env(spec))
    wait_healthy(sb, p, port)
    url = f"http://127.0.0.1:{port}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(trust_env=False, timeout=10) as c:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}, {"Authorization": f"Basic {key}"}):
            assert c.get(f"{url}/v1/models", headers=auth).status_code == 401
            r = c.post(f"{url}/v1/chat/completions", json=chat, headers=auth)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert c.post(f"{url}/v1/no-such-route", json={}).status_code == 401  # any /v1 path, as the middleware
        assert c.get(f"{url}/health").status_code == 200
        assert c.get(f"{url}/metrics").status_code == 200  # open in vLLM: the router's scrape needs no key
        assert c.get(f"{url}/version").status_code == 200
        for scheme in ("Bearer", "bearer"):  # vLLM reads the scheme in any case
            assert c.get(f"{url}/v1/models", headers={"Authorization": f"{scheme} {key}"}).status_code == 200

    f = Fleet(0)
    ep = {"url": url, "engine": "vllm", "replica": "tiny/0", "api_key": key}
    f.start(
        cfg={"models": {"tiny": {"endpoints": [ep]}}, "router": {"scrape_interval_s": 0.1, "health_interval_s": 0.2}}
    )
    try:
        with httpx.Client(trust_env=False, timeout=30) as c:
            r = c.post(f"{f.base}/chat/completions", json=chat, headers={"Authorization": "Bearer client-key"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            text = c.post(
                f"{f.base}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
            )
            assert text.status_code == 200 and text.text.rstrip().endswith("data: [DONE]")
        (w,) = f.router.table.endpoints.values()
        f.lt.wait_for(lambda: w.scraped.running is not None, what="a scrape")
    finally:
        f.close()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    log = sb.log("vllm")
    assert key not in log and key[3:20] not in log
    assert "VLLM_API_KEY" not in log


# ---------------------------------------------------------------------------- the process tree


def test_tp2_engine_core_and_workers_survive_a_sigkilled_server_and_end_on_sigterm(sb: Sandbox) -> None:
    port = free_port()
    p = serve(sb, port, "--tensor-parallel-size", "2", CUDA_VISIBLE_DEVICES="0,1")
    wait_healthy(sb, p, port)
    titled = sb.titled()
    for title in ("VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"):
        assert len(titled.get(title, [])) == 1, titled
    (core,) = titled["VLLM::EngineCore"]
    workers = titled["VLLM::Worker_TP0"] + titled["VLLM::Worker_TP1"]
    assert Path(f"/proc/{core}/comm").read_text().strip() == "VLLM::EngineCor"  # what ps and nvidia-smi show
    assert Path(f"/proc/{p.pid}/comm").read_text().strip() == "vllm"

    os.kill(p.pid, signal.SIGKILL)
    p.wait(5)
    wait_for(lambda: port_closed(port), 5, "the API port to close")
    time.sleep(1.0)
    assert alive(core) and all(alive(w) for w in workers), sb.titled()  # vllm#55510: orphans stay

    os.kill(core, signal.SIGTERM)
    wait_for(lambda: not any(alive(x) for x in [core, *workers]), 5, "the engine core and its workers to end")


def test_a_dead_worker_brings_the_engine_and_the_server_down(sb: Sandbox) -> None:
    port = free_port()
    p = serve(sb, port, "--tensor-parallel-size", "2", CUDA_VISIBLE_DEVICES="0,1")
    wait_healthy(sb, p, port)
    (w1,) = sb.titled()["VLLM::Worker_TP1"]
    os.kill(w1, signal.SIGKILL)
    assert p.wait(10) == 1
    wait_for(lambda: not sb.titled(), 5, "every process of the engine to end")
    assert "died unexpectedly" in sb.log("vllm")


def test_a_sigterm_worker_ends(sb: Sandbox) -> None:
    port = free_port()
    p = serve(sb, port, "--tensor-parallel-size", "2", CUDA_VISIBLE_DEVICES="0,1")
    wait_healthy(sb, p, port)
    (w0,) = sb.titled()["VLLM::Worker_TP0"]
    os.kill(w0, signal.SIGTERM)
    wait_for(lambda: not alive(w0), 5, "the worker to end on SIGTERM")


# ---------------------------------------------------------------------------- ray and pipeline parallelism


def ray_nodes(sb: Sandbox, port: int) -> int | None:
    r = sb.run([RAY, "status", f"--address=127.0.0.1:{port}"], timeout=10)
    m = re.search(r"^Nodes: (\d+)$", r.stdout, re.M)
    return int(m[1]) if r.returncode == 0 and m else None


def test_pipeline_parallel_serve_is_healthy_only_once_the_worker_node_joined(sb: Sandbox) -> None:
    rport, port = free_port(), free_port()
    head = sb.run([RAY, "start", "--head", f"--port={rport}", "--num-gpus=1", "--num-cpus=4",
                   "--node-ip-address=127.0.0.1"],
                  CUDA_VISIBLE_DEVICES="GPU-h", NCCL_IB_HCA="=mlx5_0", VLLM_HOST_IP="127.0.0.1")  # fmt: skip
    assert head.returncode == 0, head
    assert "Ray runtime started." in head.stdout and "standin-env: NCCL_IB_HCA==mlx5_0" in head.stdout
    assert ray_nodes(sb, rport) == 1

    # As the launcher runs it on shard 0: the driver without the HCA names, joined at RAY_ADDRESS.
    p = serve(sb, port, "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2",
              "--distributed-executor-backend", "ray", RAY_ADDRESS=f"127.0.0.1:{rport}", VLLM_HOST_IP="127.0.0.1",
              CUDA_VISIBLE_DEVICES="GPU-h", NCCL_IB_HCA=None, NCCL_DEBUG="INFO")  # fmt: skip
    wait_for(lambda: health(port), 10, "the port to answer")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # several times the load time: still waiting for the second node
        assert health(port) == 503
        time.sleep(0.1)
    assert p.poll() is None
    assert "Waiting for creating a placement group" in sb.log("vllm") and "1 of 2 node(s)" in sb.log("vllm")

    worker = sb.start("worker", [RAY, "start", "--block", f"--address=127.0.0.1:{rport}", "--num-gpus=1"],
                      CUDA_VISIBLE_DEVICES="GPU-w", NCCL_IB_HCA="=mlx5_1", VLLM_HOST_IP="127.0.0.1")  # fmt: skip
    wait_healthy(sb, p, port, timeout=20)
    assert ray_nodes(sb, rport) == 2
    models = httpx.get(f"http://127.0.0.1:{port}/v1/models", trust_env=False).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]

    # One Ray worker per node, each with its own raylet's environment plus what vLLM copies from the driver.
    def actors() -> dict[tuple[str, int], dict[str, str | None]]:
        got = {k: v for k, v in standin_env(sb.log("vllm")).items() if k[0] == "RayWorkerWrapper"}
        return got if len(got) == 2 and all(len(v) == 5 for v in got.values()) else {}

    seen = sorted(wait_for(actors, 5, "both Ray workers' environment in the driver's log").values(),
                  key=lambda v: v["CUDA_VISIBLE_DEVICES"] or "")  # fmt: skip
    assert [(v["CUDA_VISIBLE_DEVICES"], v["NCCL_IB_HCA"]) for v in seen] == [("GPU-h", "=mlx5_0"), ("GPU-w", "=mlx5_1")]
    (api,) = [v for (who, _), v in standin_env(sb.log("vllm")).items() if who == "APIServer"]
    assert api["NCCL_IB_HCA"] is None and api["RAY_ADDRESS"] == f"127.0.0.1:{rport}"
    assert "standin-env: NCCL_IB_HCA==mlx5_1" in sb.log("worker")  # the worker node's own log
    assert len(sb.titled().get("ray::RayWorkerWrapper", [])) == 2

    # The driver's end ends its Ray workers; the cluster stays.
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    wait_for(lambda: not sb.titled().get("ray::RayWorkerWrapper"), 5, "the Ray workers to end with the driver")
    assert worker.poll() is None and ray_nodes(sb, rport) == 2


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").partition("=")[::2] for x in raw if x)


def test_a_two_node_replica_started_as_the_adapter_says_keeps_its_key_from_the_ray_daemons(sb: Sandbox) -> None:
    """The adapter's own shard-0 script (Ray head, then vllm serve) and worker command, with a
    key: vllm serve has it and wants it on /v1; the Ray head's daemon (it outlives the script)
    was started without it; the worker node never had it."""
    from cluster_cli.engines import LaunchSpec, get_engine

    adapter = get_engine("vllm")
    key = "ck-" + "9" * 64
    rport, port = free_port(), free_port()
    common = {"model": "/models/tiny", "served_name": "tiny", "host": "127.0.0.1", "port": port, "nodes": 2,
              "head_address": "127.0.0.1", "ray_port": rport, "node_address": "127.0.0.1", "api_key": key}  # fmt: skip
    head = LaunchSpec(gpus=(0,), node_rank=0, **common)  # type: ignore[arg-type]
    worker = LaunchSpec(gpus=(1,), node_rank=1, **common)  # type: ignore[arg-type]
    p = sb.start("vllm", adapter.command(head, binary=VLLM), **adapter.env(head))
    sb.start("worker", adapter.command(worker, binary=VLLM), **adapter.env(worker))
    wait_healthy(sb, p, port, timeout=30)
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{url}/v1/models", trust_env=False).status_code == 401
    bearer = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{url}/v1/models", headers=bearer, trust_env=False).status_code == 200

    titled = sb.titled()
    (daemon,) = [pid for title, pids in titled.items() if "gcs_server" in title for pid in pids]
    assert "VLLM_API_KEY" not in _environ(daemon)  # the Ray head's daemon
    assert _environ(p.pid)["VLLM_API_KEY"] == key  # vllm serve itself (the script exec'd it)
    raylets = [pid for title, pids in titled.items() if "raylet" in title and "gcs" not in title for pid in pids]
    assert raylets and all("VLLM_API_KEY" not in _environ(pid) for pid in raylets)  # the worker node's
    for text in (sb.log("vllm"), sb.log("worker")):
        assert key not in text


def test_pipeline_parallel_serve_gives_up_when_the_nodes_do_not_join(sb: Sandbox) -> None:
    rport, port = free_port(), free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--num-gpus=1", "--node-ip-address=127.0.0.1"],
                  CUDA_VISIBLE_DEVICES="0").returncode == 0  # fmt: skip
    p = serve(sb, port, "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
              RAY_ADDRESS=f"127.0.0.1:{rport}", VLLM_HOST_IP="127.0.0.1", STANDIN_RAY_WAIT_S="1")  # fmt: skip
    assert p.wait(15) == 1
    log = sb.log("vllm")
    assert "1 of 2 node(s) have joined" in log and "Cannot provide a placement group" in log, log
    assert "Engine core initialization failed" in log
    wait_for(lambda: port_closed(port), 5, "the API port to close")


def test_a_driver_at_an_address_outside_the_ray_cluster_never_gets_placed(sb: Sandbox) -> None:
    rport, port = free_port(), free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--num-gpus=2", "--node-ip-address=127.0.0.1"],
                  CUDA_VISIBLE_DEVICES="0,1").returncode == 0  # fmt: skip
    p = serve(sb, port, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
              RAY_ADDRESS=f"127.0.0.1:{rport}", VLLM_HOST_IP="10.9.9.9", STANDIN_RAY_WAIT_S="1")  # fmt: skip
    assert p.wait(15) == 1
    assert "driver's address 10.9.9.9" in sb.log("vllm")


def test_without_ray_address_the_driver_joins_the_newest_cluster_of_the_machine(sb: Sandbox) -> None:
    rport, port = free_port(), free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--num-gpus=1", "--node-ip-address=127.0.0.1"],
                  CUDA_VISIBLE_DEVICES="0").returncode == 0  # fmt: skip
    p = serve(sb, port, "--distributed-executor-backend", "ray", RAY_ADDRESS=None, VLLM_HOST_IP="127.0.0.1")
    wait_healthy(sb, p, port)
    assert f"Connecting to existing Ray cluster at address: 127.0.0.1:{rport}" in sb.log("vllm")


def test_ray_head_port_in_use_fails_like_ray(sb: Sandbox) -> None:
    rport = free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--node-ip-address=127.0.0.1"]).returncode == 0
    again = sb.run([RAY, "start", "--head", f"--port={rport}", "--node-ip-address=127.0.0.1"])
    assert again.returncode == 1 and "but is already running at 127.0.0.1:" in again.stdout, again
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        other = sb.run([RAY, "start", "--head", f"--port={s.getsockname()[1]}"])
    assert other.returncode == 1 and "already occupied" in other.stdout, other


def test_ray_num_gpus_beyond_cuda_visible_devices_fails(sb: Sandbox) -> None:
    r = sb.run([RAY, "start", "--head", f"--port={free_port()}", "--num-gpus=2"], CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 1 and "Attempting to start raylet with 2 GPUs" in r.stdout, r


def test_ray_worker_exits_when_the_head_goes_away(sb: Sandbox) -> None:
    rport = free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--node-ip-address=127.0.0.1"]).returncode == 0
    worker = sb.start("worker", [RAY, "start", "--block", f"--address=127.0.0.1:{rport}"])
    wait_for(lambda: ray_nodes(sb, rport) == 2, 10, "the worker to join")
    heads = [pid for title, pids in sb.titled().items() if title.startswith("ray::gcs_server") for pid in pids]
    assert len(heads) == 1
    os.kill(heads[0], signal.SIGKILL)
    assert worker.wait(10) == 1
    assert "is gone" in sb.log("worker") and "exited unexpectedly" in sb.log("worker")


def test_ray_worker_waits_for_a_head_that_comes_later(sb: Sandbox) -> None:
    rport = free_port()
    sb.start("worker", [RAY, "start", "--block", f"--address=127.0.0.1:{rport}"])
    time.sleep(0.5)
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--node-ip-address=127.0.0.1"]).returncode == 0
    wait_for(lambda: ray_nodes(sb, rport) == 2, 10, "the early worker to join")


def test_ray_stop_stops_the_nodes_daemons(sb: Sandbox) -> None:
    rport = free_port()
    assert sb.run([RAY, "start", "--head", f"--port={rport}", "--node-ip-address=127.0.0.1"]).returncode == 0
    joined = sb.run([RAY, "start", f"--address=127.0.0.1:{rport}"])
    assert joined.returncode == 0, joined
    assert ray_nodes(sb, rport) == 2
    stop = sb.run([RAY, "stop"])
    assert stop.returncode == 0 and "Stopped all 2 Ray processes." in stop.stdout, stop
    assert not sb.titled()
    assert ray_nodes(sb, rport) is None
    assert "Did not find any active Ray processes." in sb.run([RAY, "stop"]).stdout


def test_ray_status_without_a_cluster_fails(sb: Sandbox) -> None:
    r = sb.run([RAY, "status"], RAY_ADDRESS=None)
    assert r.returncode == 1 and "Could not find any running Ray instance" in r.stdout
