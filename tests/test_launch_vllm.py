"""``up`` and ``down`` of vLLM replicas through the launch path, on the testbed's simulated GPU
nodes, with the ``vllm`` and ``ray`` stand-ins (testbed/standin) on their PATH: a single-node
tensor-parallel replica and a two-node one (Ray head, worker, ``vllm serve`` as one unit), the
processes and environment they get, and nothing of them left after ``down``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import ctl, json_out, standin_env

from cluster_cli.state.store import Store

STANDIN = Path(__file__).resolve().parent.parent / "testbed" / "standin"
NODES = "gpu-01=hgx-h200x8:fabric=ib-a,gpu-02=hgx-h200x8:fabric=ib-a"


def _vllm_procs(cluster: Any, node: str) -> list[str]:
    """The command lines of the stand-ins' processes on ``node`` (API server, engine core,
    workers, Ray daemons)."""
    out = cluster.ssh(
        node, "for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' <$p/cmdline 2>/dev/null); echo \"$c\"; done"
    ).stdout.decode()
    keys = ("VLLM::", "standin/vllm", "standin/ray", "ray::", "RayWorker")
    return [ln for ln in out.splitlines() if any(k in ln for k in keys)]


@pytest.fixture
def gpu_fleet(testbed_factory, tmp_path: Path) -> Any:
    cluster = testbed_factory(NODES, path_extra=(str(STANDIN),))
    cat = tmp_path / "catalog.yaml"
    cat.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"name": "tp", "profiles": [{"name": "tp2", "engine": "vllm", "gpu_class": "H200", "gpus": 2,
                                                 "model": "acme/tp-model", "env": {"STANDIN_LOAD_S": "0.3"}}]},
                    {"name": "pp", "profiles": [{"name": "pp2", "engine": "vllm", "gpu_class": "H200", "gpus": 2,
                                                 "nodes": 2, "model": "acme/pp-model"}]},
                ]
            }
        )
    )  # fmt: skip
    state = tmp_path / "st" / "state.db"
    yield cluster, cat, state
    ctl(state, "down", "--all")


def test_vllm_single_node_tp_and_two_node_replicas_start_serve_and_stop_whole(gpu_fleet) -> None:
    cluster, cat, state = gpu_fleet
    r = ctl(state, "up", "-i", str(cluster.inventory_path), "-c", str(cat), "-o", "json", "--timeout", "90")
    doc = json_out(r)
    assert r.returncode == 0, doc
    got = {x["name"]: x for x in doc["replicas"]}
    assert {n: x["state"] for n, x in got.items()} == {"pp/0": "ready", "tp/0": "ready"}
    assert sorted(got["pp/0"]["nodes"]) == ["gpu-01", "gpu-02"]

    import openai
    from openai import OpenAI

    from cluster_cli.launch import keys

    secret = keys.load_secret(keys.secret_path(state))
    with Store(state, readonly=True) as s:
        recs = {r.name: r for r in s.records()}
    for name in ("tp", "pp"):
        base = got[f"{name}/0"]["endpoint"] + "/v1"
        with pytest.raises(openai.AuthenticationError):  # its own key, or nothing: the router's way in
            OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30).models.list()
        client = OpenAI(base_url=base, api_key=keys.record_key(secret, recs[f"{name}/0"]), max_retries=0, timeout=30)
        out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.choices[0].message.content
        msgs = [{"role": "user", "content": "hi"}]
        chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=3, stream=True))
        assert chunks

    facts = {
        n["name"]: n for n in json_out(ctl(state, "discover", "-i", str(cluster.inventory_path), "-o", "json"))["nodes"]
    }
    st = {x["name"]: x for x in json_out(ctl(state, "status", "-o", "json"))["replicas"]}

    # The single-node replica: its GPUs pinned by UUID, its engine core and two TP workers.
    tp = st["tp/0"]
    (node, gpus), = tp["gpus"].items()  # fmt: skip
    uuids = {g["index"]: g["uuid"] for g in facts[node]["gpus"]}
    log = ctl(state, "logs", "tp/0", "-n", "400").stdout
    seen = next(v for (who, _), v in standin_env(log).items() if who == "APIServer")
    assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(uuids[i] for i in gpus)
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert tp["load"]["running"] is not None  # vLLM's metric names, read through SSH

    # The two-node replica: a Ray head and vllm serve on shard 0, a Ray worker on shard 1, each
    # with exactly its own HCAs on the replica's fabric; the driver itself has none.
    plan = json_out(ctl(state, "place", "--dry-run", "-i", str(cluster.inventory_path), "-c", str(cat), "-o", "json"))
    shards = next(x for x in plan["replicas"] if x["model"] == "pp")["shards"]
    head_log = ctl(state, "logs", "pp/0", "-n", "2000").stdout
    worker_log = ctl(state, "logs", "pp/0", "--shard", "1", "-n", "2000").stdout
    driver = next(v for (who, _), v in standin_env(head_log).items() if who == "APIServer")
    assert driver["NCCL_IB_HCA"] is None and driver["RAY_ADDRESS"]
    raylet = standin_env(worker_log)
    assert any(v.get("NCCL_IB_HCA") == "=" + ",".join(shards[1]["hcas"]) for v in raylet.values()), raylet
    assert "Ray" in worker_log or "ray" in worker_log

    before = {n: _vllm_procs(cluster, n) for n in ("gpu-01", "gpu-02")}
    assert any("VLLM::EngineCore" in p for p in before[node])
    assert sum("VLLM::Worker" in p for p in before[node]) >= 2
    assert all(before.values())

    # The API server dies hard: its engine core and workers live on (vllm#55510) and hold the
    # GPUs; the next up finds the replica dead and restarts it, none of the old ones left.
    old_core = [p for p in _vllm_procs(cluster, node) if "EngineCore" in p]
    cluster.ssh(node, "pkill -KILL -f 'standin/vllm serve acme/tp-model'")
    time.sleep(0.5)
    assert [p for p in _vllm_procs(cluster, node) if "EngineCore" in p] == old_core  # orphaned, still there
    r = json_out(ctl(state, "up", "-i", str(cluster.inventory_path), "-c", str(cat), "-o", "json", "--timeout", "90"))
    assert {x["name"]: (x["action"], x["state"]) for x in r["replicas"]}["tp/0"] == ("restart", "ready")
    assert len([p for p in _vllm_procs(cluster, node) if "EngineCore" in p]) == len(old_core)  # the new one only

    # down --all: every process of every shard gone, Ray daemons included.
    assert ctl(state, "down", "--all").returncode == 0
    for n in ("gpu-01", "gpu-02"):
        assert _vllm_procs(cluster, n) == [], (n, _vllm_procs(cluster, n))


def test_a_node_killed_while_its_replica_loads_fails_that_replica_alone(gpu_fleet, tmp_path: Path) -> None:
    cluster, _, state = gpu_fleet
    cat = tmp_path / "slow.yaml"
    prof = {"name": "tp1", "engine": "vllm", "gpu_class": "H200", "gpus": 1, "model": "acme/slow"}
    cat.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"name": "slow", "profiles": [{**prof, "env": {"STANDIN_LOAD_S": "60"}}]},
                    {"name": "fast", "profiles": [{**prof, "model": "acme/fast", "env": {"STANDIN_LOAD_S": "0.2"}}]},
                ]
            }
        )
    )
    cmd = [sys.executable, "-m", "cluster_cli", "--state", str(state), "up", "-i", str(cluster.inventory_path),
           "-c", str(cat), "-o", "json", "--timeout", "120"]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        node = None
        while node is None and time.monotonic() < deadline:  # the slow replica is loading: where?
            for n in ("gpu-01", "gpu-02"):
                if any("acme/slow" in p for p in _vllm_procs(cluster, n)):
                    node = n
            time.sleep(0.2)
        assert node is not None, "the slow replica never started"
        cluster.kill(node)
        out, err = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 3, err
    got = {x["name"]: x for x in json.loads(out)["replicas"]}
    assert got["slow/0"]["state"] == "failed" and got["slow/0"]["reason"], got["slow/0"]
    st = {x["name"]: x for x in json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"]}
    # Its engine may still run on the node that went away: the row, its GPU and its marker are
    # kept (fenced), not released, until a stop there confirms it gone.
    assert st["slow/0"]["state"] == "fenced", st["slow/0"]
    with Store(state, readonly=True) as s:
        # (fast/0 may have been on the killed node too, not yet ready: then fenced as well)
        (fence,) = [f for f in s.fences() if f.name == "slow/0"]
        assert (fence.node, fence.name, fence.generation) == (node, "slow/0", 1)
        assert fence.token.startswith("slow/0.g1.s0.") and fence.run_dir.endswith("slow-0.g1")
        assert s.fenced_gpus()[node][st["slow/0"]["gpus"][node][0]] == "slow/0 generation 1"
    if got["fast/0"]["nodes"] != [node]:  # the other replica was not held back by it
        assert got["fast/0"]["state"] == "ready"


def _tp_catalog(path: Path, gpus: int) -> Path:
    prof = {"name": f"tp{gpus}", "engine": "vllm", "gpu_class": "H200", "gpus": gpus, "model": "acme/tp-model"}
    path.write_text(yaml.safe_dump({"models": [{"name": "tp", "profiles": [prof]}]}))
    return path


def test_a_replica_whose_profile_changed_is_replaced_beside_the_old_one(gpu_fleet, tmp_path: Path) -> None:
    """A second up on GPU nodes keeps the replica (its GPUs read again, healthy); a profile
    that now asks for 4 GPUs replaces it, make before break: generation 2 starts on other GPUs
    while the old one serves, then the old one is stopped and nothing of it is left."""
    cluster, _, state = gpu_fleet
    inv = str(cluster.inventory_path)
    two = _tp_catalog(tmp_path / "tp2.yaml", 2)
    (first,) = json_out(ctl(state, "up", "-i", inv, "-c", str(two), "-o", "json", "--timeout", "90"))["replicas"]
    assert first["state"] == "ready", first
    (node,) = first["nodes"]
    old = [p for p in _vllm_procs(cluster, node) if "EngineCore" in p]
    (kept,) = json_out(ctl(state, "up", "-i", inv, "-c", str(two), "-o", "json"))["replicas"]
    assert (kept["action"], kept["state"]) == ("keep", "ready")
    assert [p for p in _vllm_procs(cluster, node) if "EngineCore" in p] == old
    was = set(json_out(ctl(state, "status", "--no-check", "-o", "json"))["replicas"][0]["gpus"][node])

    four = _tp_catalog(tmp_path / "tp4.yaml", 4)
    r = ctl(state, "up", "-i", inv, "-c", str(four), "-o", "json", "--timeout", "90")
    doc = json_out(r)
    assert r.returncode == 0, doc
    acts = [(x["action"], x["state"]) for x in doc["replicas"]]
    assert acts == [("replace", "ready")], doc  # its profile is gone: replaced, made before the break
    (now,) = json_out(ctl(state, "status", "-o", "json"))["replicas"]
    assert now["state"] == "ready" and list(now["gpus"]) == [node] and len(now["gpus"][node]) == 4
    assert not was & set(now["gpus"][node])  # beside the old one (best fit: the same node), then it stopped
    from cluster_cli.state.store import Store

    with Store(state) as s:
        assert [r.key for r in s.records()] == [("tp", 0, 2)]
    cores = [p for n in ("gpu-01", "gpu-02") for p in _vllm_procs(cluster, n) if "EngineCore" in p]
    assert len(cores) == 1  # the new engine's only


def test_a_replica_placed_anew_never_starts_on_gpus_its_old_engine_may_still_hold(gpu_fleet, tmp_path: Path) -> None:
    """The old generation's stop is not confirmed (nvidia-smi still lists its engine on its
    GPU): it is fenced with its GPUs, and the new generation is placed on other GPUs."""
    cluster, _, state = gpu_fleet
    inv = str(cluster.inventory_path)
    (first,) = json_out(ctl(state, "up", "-i", inv, "-c", str(_tp_catalog(tmp_path / "tp2.yaml", 2)), "-o", "json",
                            "--timeout", "90"))["replicas"]  # fmt: skip
    assert first["state"] == "ready", first
    (node,) = first["nodes"]
    with Store(state, readonly=True) as s:
        (rec,) = s.records()
    old_gpus = set(rec.replica.shards[0].gpus)
    spec_file = cluster.node(node).dir / "spec.json"
    doc = json.loads(spec_file.read_text())
    doc["spec"]["foreign"] = [
        {"gpu": min(old_gpus), "pid": rec.shards[0].pid, "name": "VLLM::EngineCore", "used_mib": 1}
    ]
    spec_file.write_text(json.dumps(doc))  # its CUDA context outlives it

    r = ctl(state, "up", "-i", inv, "-c", str(_tp_catalog(tmp_path / "tp4.yaml", 4)), "-o", "json", "--timeout", "90")
    got = {x["action"]: x for x in json_out(r)["replicas"]}
    assert r.returncode == 3 and got["stop"]["state"] == "failed" and "nvidia-smi still lists" in got["stop"]["reason"]
    assert got["replace"]["state"] == "ready", got["replace"]
    with Store(state, readonly=True) as s:
        (new,) = s.records()
        assert new.generation == 2 and not old_gpus & {g for sh in new.replica.shards for g in sh.gpus}
        assert s.fenced_gpus() == {node: dict.fromkeys(sorted(old_gpus), "tp/0 generation 1")}


def test_up_places_nothing_on_a_cordoned_gpu(gpu_fleet, tmp_path: Path) -> None:
    cluster, _, state = gpu_fleet
    inv = str(cluster.inventory_path)
    assert ctl(state, "cordon", "gpu-02", "-i", inv, "--reason", "maintenance").returncode == 0
    for gpu in ("0", "1"):
        r = ctl(state, "cordon", "gpu-01", "-i", inv, "--gpu", gpu, "--reason", "Xid 79")
        assert r.returncode == 0, r.stderr
    (rep,) = json_out(ctl(state, "up", "-i", inv, "-c", str(_tp_catalog(tmp_path / "tp2.yaml", 2)), "-o", "json",
                          "--timeout", "90"))["replicas"]  # fmt: skip
    assert rep["state"] == "ready" and rep["nodes"] == ["gpu-01"], rep
    with Store(state, readonly=True) as s:
        (rec,) = s.records()
    assert not {0, 1} & set(rec.replica.shards[0].gpus)  # the node's other GPUs serve


def _model_folder(path: Path, weights_gib: float) -> Path:
    """A Hugging Face folder: Llama-3-8B's config.json, and sparse weights of the size asked."""
    path.mkdir(parents=True)
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    with open(path / "model.safetensors", "wb") as f:
        f.truncate(int(weights_gib * 1024**3))  # the size the node reports; no disk used
    return path


def test_up_reads_the_models_size_on_the_node_and_refuses_what_cannot_fit(gpu_fleet, tmp_path: Path) -> None:
    cluster, _, state = gpu_fleet
    inv = str(cluster.inventory_path)
    big = _model_folder(tmp_path / "models" / "big", 400)  # on one H200 (141 GiB): no
    cat = tmp_path / "big.yaml"
    prof = {"name": "one", "engine": "vllm", "gpu_class": "H200", "gpus": 1, "model": str(big),
            "args": ["--max-model-len", "8192"]}  # fmt: skip
    cat.write_text(yaml.safe_dump({"models": [{"name": "big", "profiles": [prof]}]}))
    r = ctl(state, "up", "-i", inv, "-c", str(cat), "-o", "json", "--timeout", "60")
    assert r.returncode == 3, r.stdout + r.stderr
    (un,) = json_out(r)["replicas"]
    assert un["state"] == "unplaced" and "weights do not fit (needs 403.0 GiB per GPU" in json.dumps(un), un
    with Store(state, readonly=True) as s:
        ((_listing, size),) = s.model_sizes().values()
    assert size.weights_bytes == 400 * 1024**3 and size.kv_bytes_per_token == 128 * 1024
    # place reads no node: the size the up read stands.
    r = ctl(state, "place", "--dry-run", "-i", inv, "-c", str(cat))
    assert r.returncode == 3 and "weights do not fit" in r.stdout

    tp8 = {**prof, "name": "tp8", "gpus": 8}  # 50 GiB + 0.125 of KV + 2 a GPU: fits
    cat.write_text(yaml.safe_dump({"models": [{"name": "big", "profiles": [tp8]}]}))
    r = ctl(state, "place", "--dry-run", "-i", inv, "-c", str(cat), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    (rep,) = json_out(r)["replicas"]
    assert rep["memory"]["need_gib"] == 52.12 and rep["memory"]["source"] == str(big)


def test_an_engine_whose_memory_is_far_off_the_estimate_is_told(gpu_fleet, tmp_path: Path) -> None:
    cluster, _, state = gpu_fleet
    inv = str(cluster.inventory_path)
    cat = tmp_path / "m.yaml"
    prof = {"name": "one", "engine": "vllm", "gpu_class": "H200", "gpus": 1, "model": "acme/m", "weights_gib": 10,
            "kv_gib_per_1k_tokens": 0.125, "args": ["--max-model-len", "8192"],
            "env": {"STANDIN_MODEL_GIB": "20", "STANDIN_KV_GIB": "64", "STANDIN_KV_TOKENS": "524288"}}  # fmt: skip
    cat.write_text(yaml.safe_dump({"models": [{"name": "m", "profiles": [prof]}]}))
    r = ctl(state, "up", "-i", inv, "-c", str(cat), "-o", "json", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    with Store(state, readonly=True) as s:
        (ev,) = [e for e in s.events() if e.message.startswith("memory off the estimate")]
    # 64 GiB over 524,288 tokens is 128 KiB a token, as estimated: only the weights are off.
    assert ev.message == "memory off the estimate: weights: estimated 10.00 GiB per GPU, the engine loaded 20.00"
    assert ev.detail["reported"]["weights_bytes"] == 20 * 1024**3 and ev.detail["estimate"]["weights_gib"] == 10
