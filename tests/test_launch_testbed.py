"""``up``, ``status``, ``logs``, ``down`` end to end: real ``llama-server`` replicas on the
testbed's sshd nodes, behind a real ``serve-router`` started before them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gguf_tiny import make_tiny_gguf
from helpers import ctl, json_out
from llama import find_llama_server

from cluster_cli.state.store import Store

pytestmark = pytest.mark.llama

CPU_NODES = "cpu-01=cpu-only,cpu-02=cpu-only,cpu-03=cpu-only"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inventory(cluster: Any, base: int) -> Path:
    """The testbed's inventory with a port range per node: in loopback mode all nodes are one host."""
    data = yaml.safe_load(cluster.inventory_path.read_text())
    for i, n in enumerate(data["nodes"]):
        n["ports"] = f"{base + 20 * i}-{base + 20 * i + 19}"
    p = cluster.inventory_path.parent / "inventory-launch.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _catalog(path: Path, model: Path, binary: str, replicas: int = 3, **profile: Any) -> Path:
    prof = {"name": "cpu", "engine": "llamacpp", "cpus": 1, "memory_gib": 0.25, "model": str(model)}
    prof.update(profile)
    doc = {
        "engines": {"llamacpp": {"command": binary}},
        "models": [{"name": "tiny", "replicas": replicas, "profiles": [prof]}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def fleet(testbed_factory, tmp_path: Path) -> Iterator[dict[str, Any]]:
    binary = find_llama_server()
    if binary is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    cluster = testbed_factory(CPU_NODES)
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    base = 20000 + (os.getpid() % 200) * 60
    env = {
        "state": tmp_path / "st" / "state.db",
        "inventory": _inventory(cluster, base),
        "catalog": _catalog(tmp_path / "catalog.yaml", model, binary),
        "model": model,
        "binary": binary,
        "cluster": cluster,
        "tmp": tmp_path,
    }
    yield env
    ctl(env["state"], "down", "--all")


def _pids(cluster: Any, node: str) -> set[int]:
    """The llama-server processes running on ``node``."""
    out = cluster.ssh(node, "ps -eo pid=,comm= | awk '$2 == \"llama-server\" {print $1}'").stdout.decode()
    return {int(x) for x in out.split()}


def _router(config: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster_cli", "serve-router", "-c", str(config), "--port", str(port),
         "--watch-interval", "0.2"],
        stdout=open(tmp / "router.out", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115 - the child keeps it
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"serve-router did not start: {(tmp / 'router.out').read_text()}")


def _engine_key(state: Path, name: str) -> str:
    """The API key of replica ``name``'s engine, as the cluster secret beside the state gives it."""
    from cluster_cli.launch import keys

    with Store(state, readonly=True) as s:
        (rec,) = [r for r in s.records() if r.name == name]
    return keys.record_key(keys.load_secret(keys.secret_path(state)), rec)


def _chat(base_url: str, stream: bool, key: str = "none") -> str:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
    msgs = [{"role": "user", "content": "hello"}]
    if stream:
        parts = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, stream=True)
        return "".join((c.choices[0].delta.content or "") for c in parts if c.choices)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    return r.choices[0].message.content or ""


def _wait(pred: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def test_up_serves_three_replicas_through_a_router_started_before_it(fleet) -> None:
    state, inv, cat, cluster = fleet["state"], fleet["inventory"], fleet["catalog"], fleet["cluster"]
    config = state.parent / "router.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("models: {}\n")  # a router waiting for its first replicas
    router, port = _router(config, fleet["tmp"])
    try:
        r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60")
        doc = json_out(r)
        assert r.returncode == 0, doc
        assert sorted(x["name"] for x in doc["replicas"]) == ["tiny/0", "tiny/1", "tiny/2"]
        assert {x["state"] for x in doc["replicas"]} == {"ready"}
        assert sorted(n for x in doc["replicas"] for n in x["nodes"]) == ["cpu-01", "cpu-02", "cpu-03"]

        # Each engine keeps its API behind its own key: a client that goes around the router
        # gets 401...
        import openai

        for x in doc["replicas"]:
            with pytest.raises(openai.AuthenticationError):
                _chat(x["endpoint"] + "/v1", stream=False)
        # ...while the router, which picked them up without a restart, is served.
        published = yaml.safe_load(config.read_text())
        assert [e["replica"] for e in published["models"]["tiny"]["endpoints"]] == ["tiny/0", "tiny/1", "tiny/2"]
        base = f"http://127.0.0.1:{port}/v1"
        _wait(lambda: _models(port) == ["tiny"])
        assert isinstance(_chat(base, stream=False), str)
        assert isinstance(_chat(base, stream=True), str)

        st = json_out(ctl(state, "status", "-o", "json"))
        assert [(x["name"], x["state"], x["engine"]) for x in st["replicas"]] == [
            (f"tiny/{i}", "ready", "llamacpp") for i in range(3)
        ]
        assert all(x["endpoint"] and x["nodes"] and x["uptime_s"] is not None for x in st["replicas"])

        log = ctl(state, "logs", "tiny/0", "-n", "50")
        assert log.returncode == 0 and "llama" in log.stdout.lower(), log
        # -f follows the log: a request's lines arrive while it runs, Ctrl-C ends it (exit 0).
        follow = subprocess.Popen(
            [sys.executable, "-m", "cluster_cli", "--state", str(state), "logs", "tiny/0", "-f", "-n", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            node0 = doc["replicas"][0]["nodes"][0]
            _wait(lambda: b"tail" in cluster.ssh(node0, "ps -eo args | grep -v grep | grep 'tail -n 0 -f'").stdout)
            _chat(doc["replicas"][0]["endpoint"] + "/v1", stream=False, key=_engine_key(state, "tiny/0"))
            time.sleep(1.0)
            follow.send_signal(signal.SIGINT)
            out, ferr = follow.communicate(timeout=15)
        finally:
            if follow.poll() is None:
                follow.kill()
        assert follow.returncode == 0 and b"slot" in out, (follow.returncode, out[-500:], ferr[-800:])

        # A second up changes no process.
        before = {n: _pids(cluster, n) for n in ("cpu-01", "cpu-02", "cpu-03")}
        r2 = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json")
        assert r2.returncode == 0
        assert {x["action"] for x in json_out(r2)["replicas"]} == {"keep"}
        assert {n: _pids(cluster, n) for n in before} == before

        # A killed engine is restarted by the next up, on its own node and port.
        victim = next(x for x in st["replicas"] if x["name"] == "tiny/1")
        node = victim["nodes"][0]
        cluster.ssh(node, "pkill -KILL -x llama-server")
        _wait(lambda: not _pids(cluster, node))
        r3 = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60"))
        again = next(x for x in r3["replicas"] if x["name"] == "tiny/1")
        assert (again["action"], again["state"], again["endpoint"]) == ("restart", "ready", victim["endpoint"])
        st2 = {x["name"]: x for x in json_out(ctl(state, "status", "-o", "json"))["replicas"]}
        assert st2["tiny/1"]["restarts"] == 1 and st2["tiny/0"]["restarts"] == 0

        # down of one replica: out of the router first, then stopped; the router keeps serving.
        assert ctl(state, "down", "tiny/1").returncode == 0
        assert [e["replica"] for e in yaml.safe_load(config.read_text())["models"]["tiny"]["endpoints"]] == [
            "tiny/0",
            "tiny/2",
        ]
        assert not _pids(cluster, node)
        for _ in range(3):
            assert isinstance(_chat(base, stream=False), str)

        # down --all: no process, no open port, no run folder left.
        assert ctl(state, "down", "--all").returncode == 0
        for n in ("cpu-01", "cpu-02", "cpu-03"):
            assert not _pids(cluster, n)
            left = cluster.ssh(n, "ls -A ~/.clusterctl/run 2>/dev/null").stdout.decode().split()
            assert left == [], (n, left)
        for x in doc["replicas"]:
            host, p = x["endpoint"].removeprefix("http://").rsplit(":", 1)
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((host, int(p))) != 0
        assert {x["state"] for x in json_out(ctl(state, "status", "-o", "json"))["replicas"]} == {"stopped"}
    finally:
        router.terminate()
        router.wait(10)


def _models(port: int) -> list[str]:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return [m["id"] for m in json.load(r)["data"]]
    except OSError:
        return []


def _one(fleet: dict[str, Any], **profile: Any) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    cat = _catalog(fleet["tmp"] / "bad.yaml", profile.pop("model", fleet["model"]), profile.pop("binary", fleet["binary"]),
                   replicas=1, **profile)  # fmt: skip
    r = ctl(fleet["state"], "up", "-i", str(fleet["inventory"]), "-c", str(cat), "-o", "json", "--timeout", "20")
    return r, json_out(r)


def _nothing_left(fleet: dict[str, Any]) -> None:
    st = json_out(ctl(fleet["state"], "status", "-o", "json"))
    assert st["replicas"] == []  # released whole
    for n in ("cpu-01", "cpu-02", "cpu-03"):
        assert not _pids(fleet["cluster"], n)


@pytest.mark.parametrize(
    "profile,reason",
    [
        ({"binary": "/nonexistent/llama-server"}, "engine binary not found: /nonexistent/llama-server"),
        ({"model": "/nonexistent/model.gguf"}, "model file not found: /nonexistent/model.gguf"),
        ({"args": ["--no-such-flag"]}, "the engine exited"),
    ],
    ids=["missing-binary", "missing-model", "exits-at-once"],
)
def test_a_replica_that_cannot_start_is_released_whole_with_its_reason(fleet, profile, reason) -> None:
    r, doc = _one(fleet, **profile)
    assert r.returncode == 3
    (x,) = doc["replicas"]
    assert x["state"] == "failed" and reason in x["reason"], x
    if reason == "the engine exited":
        assert any("no-such-flag" in line or "invalid argument" in line.lower() for line in x["log"]), x["log"]
    _nothing_left(fleet)
    with Store(fleet["state"], readonly=True) as s:
        ev = [e for e in s.events() if e.name == x["name"]]
    kinds = [e.kind for e in ev]
    assert kinds[0] == "reserved" and kinds[-2:] == ["failed", "released"], kinds
    assert reason in ev[-2].message and {e.actor for e in ev} == {"up"}


def test_a_port_in_use_on_the_node_is_skipped(fleet) -> None:
    """A port something listens on is never handed out: the next one in the range is."""
    inv = yaml.safe_load(fleet["inventory"].read_text())
    lo = int(inv["nodes"][0]["ports"].split("-")[0])
    for n in inv["nodes"]:  # one range for all: every node has a squatter on its first port
        n["ports"] = f"{lo}-{lo + 5}"
    fleet["inventory"].write_text(yaml.safe_dump(inv))
    squat = "nohup python3 -c 'import socket,time; s=socket.socket(); s.bind((\"0.0.0.0\", %d)); s.listen(); time.sleep(120)' >/dev/null 2>&1 &"
    for n in inv["nodes"]:
        fleet["cluster"].ssh(n["name"], squat % lo)
    time.sleep(0.5)
    r, doc = _one(fleet)
    assert r.returncode == 0, doc
    (x,) = doc["replicas"]
    assert x["endpoint"].endswith(f":{lo + 1}") or fleet["cluster"].mode == "loopback"


def test_a_hostile_model_path_reaches_the_engine_verbatim_and_runs_nothing(fleet) -> None:
    hostile = fleet["tmp"] / 'it\'s a;b $(touch pwned) `touch pwned` "q" | model.gguf'
    hostile.write_bytes(fleet["model"].read_bytes())
    r, doc = _one(fleet, model=hostile)
    assert r.returncode == 0, doc
    (x,) = doc["replicas"]
    log = ctl(fleet["state"], "logs", x["name"]).stdout
    assert str(hostile) in log  # llama-server names the file it loads: the path arrived whole
    made = subprocess.run(["find", "/tmp", "/root", "-name", "pwned"], capture_output=True, text=True).stdout
    assert made == ""


def test_secrets_in_a_profile_env_are_on_no_command_line_and_in_a_private_file(fleet) -> None:
    r, doc = _one(fleet, env={"HF_TOKEN": "hf_secret_value_123"})
    assert r.returncode == 0, doc
    node = doc["replicas"][0]["nodes"][0]
    c = fleet["cluster"]
    cmdlines = c.ssh(node, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout.decode()
    assert "hf_secret_value_123" not in cmdlines
    env_file = c.ssh(node, "stat -c %a ~/.clusterctl/run/tiny-0.g1/env").stdout.decode().strip()
    assert env_file == "600"
    assert "hf_secret_value_123" not in r.stdout + r.stderr
    assert "hf_secret_value_123" not in ctl(fleet["state"], "status", "-o", "json").stdout


def test_an_engine_that_stops_answering_is_restarted_by_the_next_up(fleet) -> None:
    # Frozen (SIGSTOP): its process runs, its health check gets no answer.
    state, inv, cluster = fleet["state"], fleet["inventory"], fleet["cluster"]
    cat = _catalog(fleet["tmp"] / "one.yaml", fleet["model"], fleet["binary"], replicas=1)
    (first,) = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))["replicas"]
    (node,) = first["nodes"]
    (pid,) = _pids(cluster, node)
    cluster.ssh(node, f"kill -STOP {pid}")
    (again,) = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))["replicas"]
    assert (again["action"], again["state"]) == ("restart", "ready"), again
    assert "stopped answering" in again["reason"]
    (new,) = _pids(cluster, node)
    assert new != pid  # the frozen one is gone, not left holding its port


def test_check_version_out_of_date_starts_nothing(fleet) -> None:
    """The plan printed at version N is applied only while the state is at N: a cordon since
    then moves it, and up refuses before starting anything."""
    state, inv, cat = fleet["state"], fleet["inventory"], fleet["catalog"]
    assert ctl(state, "discover", "-i", str(inv)).returncode == 0
    plan = json_out(ctl(state, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json"))
    version = plan["state_version"]
    assert ctl(state, "cordon", "cpu-03", "-i", str(inv), "--reason", "fan").returncode == 0
    r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "--check-version", str(version))
    assert r.returncode == 2 and f"not {version}" in r.stderr, r.stderr
    for n in ("cpu-01", "cpu-02", "cpu-03"):
        assert not _pids(fleet["cluster"], n)
    # At the state's current version, the same command applies the plan.
    now = json_out(ctl(state, "place", "--dry-run", "-i", str(inv), "-c", str(cat), "-o", "json"))["state_version"]
    r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "--check-version", str(now), "-o", "json")
    assert r.returncode == 0, r.stdout
    got = json_out(r)["replicas"]
    assert {x["state"] for x in got} == {"ready"}
    assert "cpu-03" not in {n for x in got for n in x["nodes"]}  # the cordon holds
    assert len({x["endpoint"] for x in got}) == 3  # two on one node: two ports


def test_a_replica_on_a_node_that_went_away_is_left_recorded_and_restarted_once_it_is_back(fleet) -> None:
    """A node that does not answer may still run its engine (a partition): up neither stops
    nor releases nor replaces its replica; once the node is back and the engine gone, the next
    up restarts it there."""
    state, inv, cat, cluster = fleet["state"], fleet["inventory"], fleet["catalog"], fleet["cluster"]
    first = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60"))
    victim = next(x for x in first["replicas"] if x["name"] == "tiny/1")
    node = victim["nodes"][0]
    cluster.kill(node)
    r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "30")
    assert r.returncode == 3
    got = {x["name"]: x for x in json_out(r)["replicas"]}
    assert got["tiny/1"]["state"] == "unhealthy" and "unreachable" in got["tiny/1"]["reason"], got["tiny/1"]
    assert {got["tiny/0"]["action"], got["tiny/2"]["action"]} == {"keep"}
    st = {x["name"]: x for x in json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]}
    assert st["tiny/1"]["nodes"] == [node]  # still recorded, its GPUs and port still held
    published = yaml.safe_load((state.parent / "router.yaml").read_text())
    assert "tiny/1" not in [e["replica"] for e in published["models"]["tiny"]["endpoints"]]
    cluster.revive(node)
    r = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60"))
    back = {x["name"]: x for x in r["replicas"]}["tiny/1"]
    assert (back["action"], back["state"], back["nodes"]) == ("restart", "ready", [node])


def test_up_status_logs_through_a_jump_host_with_the_engine_port_unreachable_from_here(
    testbed_factory, tmp_path: Path
) -> None:
    """The CLI reaches the nodes only through a bastion (ssh_config ProxyJump), and each engine
    listens on the node's loopback only: readiness, status and logs all go through SSH."""
    binary = find_llama_server()
    if binary is None:
        pytest.skip("llama-server binary not found: set $LLAMA_SERVER or run scripts/install-llama-server.sh")
    c = testbed_factory("jump=cpu-only,n1=cpu-only,n2=cpu-only")
    d = c.inventory_path.parent
    cfg = [f"Host jump\n  HostName {c.nodes['jump'].host}\n  Port {c.nodes['jump'].port}\n  User {c.user}\n"
           f"  IdentityFile {d / 'id_ed25519'}\n", "Host node-*\n  ProxyJump jump\n"]  # fmt: skip
    base = 21000 + (os.getpid() % 100) * 40
    nodes = []
    for i, name in enumerate(("n1", "n2")):
        cfg.append(f"Host node-{name}\n  HostName {c.nodes[name].host}\n  Port {c.nodes[name].port}\n")
        nodes.append({"name": name, "host": f"node-{name}", "ports": f"{base + 20 * i}-{base + 20 * i + 19}"})
    (d / "ssh_config").write_text("".join(cfg))
    data = yaml.safe_load(c.inventory_path.read_text())
    data["ssh_config"] = "ssh_config"
    data["defaults"].pop("port", None)
    data["nodes"] = nodes
    inv = d / "inv-jump.yaml"
    inv.write_text(yaml.safe_dump(data))
    model = make_tiny_gguf(tmp_path / "tiny.gguf")
    cat = _catalog(tmp_path / "cat.yaml", model, binary, replicas=2, args=["--host", "127.0.0.1"])
    state = tmp_path / "st" / "state.db"
    try:
        r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60")
        doc = json_out(r)
        assert r.returncode == 0, doc
        assert {x["state"] for x in doc["replicas"]} == {"ready"}
        for x in doc["replicas"]:  # where the node is (ssh_config's HostName), not the alias
            assert x["endpoint"].removeprefix("http://").rsplit(":", 1)[0] == c.nodes[x["nodes"][0]].host, x
        if c.mode == "netns":  # the engine's port answers on the node only
            for x in doc["replicas"]:
                name = x["nodes"][0]
                port = int(x["endpoint"].rsplit(":", 1)[1])
                with socket.socket() as s:
                    s.settimeout(2)
                    assert s.connect_ex((c.nodes[name].host, port)) != 0
        st = json_out(ctl(state, "status", "-i", str(inv), "-o", "json"))
        assert [x["state"] for x in st["replicas"]] == ["ready", "ready"]
        assert all(x["load"]["running"] is not None for x in st["replicas"])  # /metrics read through SSH
        log = ctl(state, "logs", "tiny/0", "-i", str(inv), "-n", "20")
        assert log.returncode == 0 and "listening" in log.stdout, log
    finally:
        ctl(state, "down", "--all", "-i", str(inv))


def test_a_replica_another_live_run_is_starting_is_left_be_until_that_run_ends(fleet) -> None:
    """A replica left starting names its run: while that run holds its lock, a new up keeps
    its hands off; once the run is gone (interrupted, killed), the next up restarts it."""
    from dataclasses import replace

    from cluster_cli.control.runs import Runs
    from cluster_cli.state.records import STARTING

    state, inv, cat, cluster = fleet["state"], fleet["inventory"], fleet["catalog"], fleet["cluster"]
    cat = _catalog(fleet["tmp"] / "one.yaml", fleet["model"], fleet["binary"], replicas=1)
    assert ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json").returncode == 0
    pids = {n: _pids(cluster, n) for n in ("cpu-01", "cpu-02", "cpu-03")}
    with Runs(state) as other:
        with Store(state) as s:
            (rec,) = s.records()
            s.observe(replace(rec, status=STARTING, owner=other.id))
        kept = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))
        (x,) = kept["replicas"]
        assert (x["action"], x["state"], x["reason"]) == ("keep", "starting", "being started by another up"), x
        assert {n: _pids(cluster, n) for n in pids} == pids  # nothing stopped, nothing started
    assert not list(other.dir.glob("*.lock"))  # its lock file went with it
    again = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))
    (x,) = again["replicas"]
    assert (x["action"], x["state"]) == ("restart", "ready"), x
    assert "left starting by an earlier run" in x["reason"]


def test_two_ups_at_once_start_each_replica_once(fleet) -> None:
    """Two up runs of one catalog at the same moment: the state books every replica, port and
    GPU once; the run that planned second sees the first's replicas starting and leaves them
    be. Afterwards exactly the catalog's replicas run, once each."""
    state, inv, cat, cluster = fleet["state"], fleet["inventory"], fleet["catalog"], fleet["cluster"]
    assert ctl(state, "discover", "-i", str(inv)).returncode == 0  # one state for both to share
    cmd = [sys.executable, "-m", "cluster_cli", "--state", str(state), "up", "-i", str(inv), "-c", str(cat),
           "-o", "json", "--timeout", "60"]  # fmt: skip
    runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [r.communicate(timeout=180) for r in runs]
    actions = sorted(tuple(sorted({x["action"] for x in json.loads(o)["replicas"]})) for o, _ in outs)
    assert actions == [("keep",), ("start",)], actions  # started once, by one run; the other keeps
    for r, (out, err) in zip(runs, outs, strict=True):
        assert r.returncode in (0, 3), err
        assert {x["state"] for x in json.loads(out)["replicas"]} <= {"ready", "starting"}, out
    st = json_out(ctl(state, "status", "-o", "json"))
    assert sorted(x["name"] for x in st["replicas"]) == ["tiny/0", "tiny/1", "tiny/2"]
    assert {x["state"] for x in st["replicas"]} == {"ready"}
    assert sum(len(_pids(cluster, n)) for n in ("cpu-01", "cpu-02", "cpu-03")) == 3
    again = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))
    assert {x["action"] for x in again["replicas"]} == {"keep"}


def test_a_second_up_reads_no_hardware_again_until_it_has_something_to_place(fleet) -> None:
    """With every replica held, up checks them without reading the nodes' hardware again: the
    state's CPU counts and memory stand, even wrong ones. Once a replica has to be placed (its
    profile now reserves more), every node is read again before it is."""
    from dataclasses import replace

    state, inv, cluster = fleet["state"], fleet["inventory"], fleet["cluster"]
    cat = _catalog(fleet["tmp"] / "one.yaml", fleet["model"], fleet["binary"], replicas=1)
    (first,) = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))["replicas"]
    (node,) = first["nodes"]
    (pid,) = _pids(cluster, node)
    with Store(state) as s:
        real = {f.name: (f.cpus, f.memory_mib) for f in s.nodes()}
        s.save_discovery([replace(f, cpus=f.cpus + 1000, memory_mib=f.memory_mib + 7) for f in s.nodes()],
                         inventory=inv)  # fmt: skip
    (again,) = json_out(ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json"))["replicas"]
    assert (again["action"], again["state"]) == ("keep", "ready") and _pids(cluster, node) == {pid}
    with Store(state) as s:
        assert {f.name: (f.cpus, f.memory_mib) for f in s.nodes()} == {
            n: (c + 1000, m + 7) for n, (c, m) in real.items()
        }
    bigger = _catalog(fleet["tmp"] / "two-cpus.yaml", fleet["model"], fleet["binary"], replicas=1, cpus=2)
    r = ctl(state, "up", "-i", str(inv), "-c", str(bigger), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(x["action"], x["state"]) for x in json_out(r)["replicas"]] == [("replace", "ready")]
    with Store(state) as s:
        assert {f.name: (f.cpus, f.memory_mib) for f in s.nodes()} == real


def test_down_of_a_replica_under_streaming_load_fails_no_request(fleet) -> None:
    """Four clients stream through the router without pause while one replica is taken down:
    it is published draining (no new request reaches it), its streams run to their end, and
    only then is its engine stopped. Not one request fails."""
    import threading

    from openai import OpenAI

    state, inv = fleet["state"], fleet["inventory"]
    # Streams of a few seconds (the tiny model writes thousands of tokens a second): longer
    # than any fixed pause before a stop, so only a drain that waits for them lets them end.
    cat = _catalog(fleet["tmp"] / "two.yaml", fleet["model"], fleet["binary"], replicas=2, args=["-c", "32768"])
    config = state.parent / "router.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("models: {}\n")
    router, port = _router(config, fleet["tmp"])
    stop = threading.Event()
    done: list[int] = []
    failed: list[str] = []

    def client() -> None:
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        while not stop.is_set():
            try:
                parts = c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6000, stream=True,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                n = sum(1 for p in parts if p.choices and p.choices[0].delta.content)
                done.append(n)
            except Exception as e:  # every failure is the finding
                failed.append(f"{type(e).__name__}: {e}")

    try:
        r = ctl(state, "up", "-i", str(inv), "-c", str(cat), "-o", "json", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        _wait(lambda: _models(port) == ["tiny"])
        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        _wait(lambda: len(done) >= 4, timeout=60)  # streams going on both replicas
        down = ctl(state, "down", "tiny/0", "-o", "json")
        assert down.returncode == 0, down.stderr
        served = len(done)
        _wait(lambda: len(done) >= served + 8, timeout=60)  # and on after it, on tiny/1
        stop.set()
        for t in threads:
            t.join(90)
    finally:
        stop.set()
        router.terminate()
        router.wait(30)
    assert failed == [], failed[:3]
    assert len(done) >= 12 and min(done) > 0
    st = json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]
    assert [(x["name"], x["state"]) for x in st] == [("tiny/0", "stopped"), ("tiny/1", "ready")]
