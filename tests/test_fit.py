"""The memory-fit estimate: model shapes read from GGUF headers and config.json, and the
arithmetic of what one GPU needs, against published figures for real models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

import pytest
from gguf_tiny import FILE_TYPES, make_tiny_gguf
from helpers import cpu_node, l40s
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster_cli.config.catalog import Catalog
from cluster_cli.control.modelsize import read_sizes
from cluster_cli.engines.memreport import EngineMemory, parse_memory_report
from cluster_cli.facts import ModelSize, NodeFacts
from cluster_cli.placement import plan
from cluster_cli.placement.explain import render_plan
from cluster_cli.placement.fit import GIB, MIB, estimate, misses, shortfall
from cluster_cli.probe.modelfiles import ModelFileError, parse_stat, read_command, size_of, stat_command
from cluster_cli.probe.parsers.gguf import GgufError, parse_gguf_header
from cluster_cli.probe.parsers.hfmodel import HfConfigError, parse_hf_config


# ---------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    return {t: make_tiny_gguf(d / f"{t}.gguf", file_type=t).read_bytes() for t in FILE_TYPES}


def test_the_header_of_every_quantisation_gives_the_same_shape(ggufs) -> None:
    shapes = {t: parse_gguf_header(data) for t, data in ggufs.items()}
    for t, s in shapes.items():
        assert (s.architecture, s.block_count, s.head_count, s.head_count_kv, s.embedding_length) == (
            "llama", 2, 4, 2, 64
        ), t  # fmt: skip
        assert s.context_length == 2048 and s.complete
        # 2 layers x 2 KV heads x (16 + 16) per head x 2 bytes (f16 cache)
        assert s.kv_bytes_per_token() == 256
    assert [shapes[t].file_type for t in ("F32", "F16", "Q8_0")] == [0, 1, 7]
    assert len(ggufs["F32"]) > len(ggufs["F16"]) > len(ggufs["Q8_0"])


@given(st.integers(0, 5000))
def test_a_truncated_header_reads_as_far_as_it_goes(ggufs, cut: int) -> None:
    data = ggufs["F16"]
    try:
        s = parse_gguf_header(data[:cut])
    except GgufError:
        assert cut < 24
        return
    full = parse_gguf_header(data)
    for name in ("architecture", "block_count", "head_count", "head_count_kv", "embedding_length"):
        assert getattr(s, name) in (None, getattr(full, name))


@given(st.binary(max_size=200))
def test_junk_is_refused_cleanly(data: bytes) -> None:
    for blob in (data, b"GGUF\x03\x00\x00\x00" + data):
        with contextlib.suppress(GgufError):
            parse_gguf_header(blob)


# ---------------------------------------------------------------------------- config.json
# The numbers of each model's published config.json (Hugging Face), and its KV cache per token
# at bf16 as published (vLLM's log and the usual calculators): 128 KiB, 320 KiB, 128 KiB, 56 KiB.
CONFIGS = {
    "Llama-3-8B": (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
         "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "model_type": "llama"},
        128 * 1024, 8.03e9,
    ),
    "Llama-3-70B": (
        {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192,
         "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "model_type": "llama"},
        320 * 1024, 70.55e9,
    ),
    "Mixtral-8x7B": (
        {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
         "max_position_embeddings": 32768, "num_local_experts": 8, "torch_dtype": "bfloat16", "model_type": "mixtral"},
        128 * 1024, 46.7e9,
    ),
    "Qwen2-7B": (
        {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
         "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "model_type": "qwen2"},
        56 * 1024, 7.62e9,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_published_models_kv_cache_per_token(name: str) -> None:
    cfg, kv, _ = CONFIGS[name]
    assert parse_hf_config(json.dumps(cfg)).kv_bytes_per_token() == kv


def test_a_multimodal_config_is_read_from_its_text_config() -> None:
    cfg = {"model_type": "llava", "text_config": CONFIGS["Llama-3-8B"][0]}
    assert parse_hf_config(json.dumps(cfg)).kv_bytes_per_token() == 128 * 1024


@pytest.mark.parametrize(
    "text", ["[]", "{", '{"hidden_size": 4096}', '{"num_hidden_layers": 2, "num_attention_heads": 2}']
)
def test_a_config_without_what_is_needed_is_refused(text: str) -> None:
    with pytest.raises(HfConfigError):
        parse_hf_config(text)


def _size(name: str) -> ModelSize:
    cfg, _kv, params = CONFIGS[name]
    shape = parse_hf_config(json.dumps(cfg))
    return ModelSize(round(params * 2), shape.kv_bytes_per_token(), shape.max_context, "config.json")


def test_llama_70b_on_one_24_gib_gpu_is_refused_in_the_usual_words() -> None:
    est = estimate(_size("Llama-3-70B"), engine="vllm", gpus_per_node=1, nodes=1, args=["--max-model-len", "8192"])
    # 131.4 GiB of weights + 2.5 GiB of KV cache at 8192 tokens + 2 GiB of engine
    assert round(est.weights_bytes / GIB, 1) == 131.4 and round(est.kv_bytes / GIB, 2) == 2.5
    why = shortfall(est, 24 * GIB, GIB)
    assert why == "weights do not fit (needs 135.9 GiB per GPU, 21.6 at gpu_memory_utilization 0.9)"


def test_llama_70b_fits_on_4_h100s_and_on_2_nodes_of_4() -> None:
    size = _size("Llama-3-70B")
    tp4 = estimate(size, engine="vllm", gpus_per_node=4, nodes=1, args=["--max-model-len", "8192"])
    assert shortfall(tp4, 80 * GIB, GIB) is None and round(tp4.need_bytes / GIB, 1) == 35.5
    pp2 = estimate(size, engine="vllm", gpus_per_node=4, nodes=2, args=["--max-model-len=8192"])
    assert pp2.need_bytes < tp4.need_bytes and shortfall(pp2, 40 * GIB, GIB) is None


def test_vllm_needs_its_whole_share_free() -> None:
    est = estimate(
        _size("Llama-3-8B"), engine="vllm", gpus_per_node=1, nodes=1, args=["--gpu-memory-utilization", "0.9"]
    )
    assert shortfall(est, 80 * GIB, 0) is None
    assert shortfall(est, 80 * GIB, 20 * GIB) == (
        "not enough free memory (vLLM takes 72.0 GiB per GPU at start, 60.0 free)"
    )


def test_the_kv_cache_follows_the_engines_arguments() -> None:
    size = _size("Llama-3-8B")
    base = estimate(size, engine="vllm", gpus_per_node=1, nodes=1, args=["--max-model-len", "8192"])
    fp8 = estimate(
        size, engine="vllm", gpus_per_node=1, nodes=1, args=["--max-model-len", "8192", "--kv-cache-dtype", "fp8"]
    )
    assert base.kv_bytes == GIB and fp8.kv_bytes == GIB // 2
    llama = estimate(
        size, engine="llamacpp", gpus_per_node=1, nodes=1, args=["-c", "8192", "-ctk", "q8_0", "-ctv", "q8_0"]
    )
    assert llama.kv_bytes == round(GIB * 34 / 64) and llama.utilization is None
    assert estimate(size, engine="llamacpp", gpus_per_node=1, nodes=1).context == 4096  # llama-server's default
    assert estimate(size, engine="vllm", gpus_per_node=1, nodes=1).context == 8192  # the model's own


def test_a_cpu_replica_is_checked_against_its_node() -> None:
    q4 = ModelSize(round(4.92 * GIB), 131072, 8192, "llama-3-8b.Q4_K_M.gguf")  # its published file size
    est = estimate(q4, engine="llamacpp", gpus_per_node=0, nodes=1, args=["-c", "2048"])
    assert est.cpu and est.per == "node" and round(est.need_bytes / GIB, 2) == 5.67  # + 0.25 KV + 0.5
    assert shortfall(est, 8 * GIB, 4 * GIB) == "weights do not fit (needs 5.7 GiB per node, 4.0 free)"
    assert shortfall(est, 8 * GIB, GIB) is None


@given(
    st.integers(1, 2**40), st.integers(0, 2**20), st.integers(1, 2**17), st.integers(1, 2**17),
    st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["vllm", "llamacpp"]),
)  # fmt: skip
def test_the_need_grows_with_context_and_weights_and_shrinks_with_gpus(w, kv, c1, c2, tp1, tp2, engine) -> None:
    size = ModelSize(w, kv, None)
    lo, hi = sorted((c1, c2))
    small = estimate(size, engine=engine, gpus_per_node=1, nodes=1, args=["--max-model-len", str(lo), "-c", str(lo)])
    big = estimate(size, engine=engine, gpus_per_node=1, nodes=1, args=["--max-model-len", str(hi), "-c", str(hi)])
    assert small.need_bytes <= big.need_bytes
    heavier = estimate(ModelSize(w + 1024, kv, None), engine=engine, gpus_per_node=1, nodes=1)
    assert heavier.need_bytes >= estimate(size, engine=engine, gpus_per_node=1, nodes=1).need_bytes
    a, b = sorted((tp1, tp2))
    assert (
        estimate(size, engine=engine, gpus_per_node=b, nodes=1).need_bytes
        <= estimate(size, engine=engine, gpus_per_node=a, nodes=1).need_bytes
    )


# ---------------------------------------------------------------------------- placement
def _with_memory(f: NodeFacts, total_gib: float, used_gib: float) -> NodeFacts:
    gpus = tuple(
        dc_replace(g, memory_total_mib=round(total_gib * 1024), memory_used_mib=round(used_gib * 1024)) for g in f.gpus
    )
    return dc_replace(f, gpus=gpus)


def _catalog(engine: str = "llamacpp", **prof: Any) -> Catalog:
    p = {"name": "p", "engine": engine, "gpu_class": "L40S", "gpus": 1, "model": "/models/m", **prof}
    return Catalog.model_validate({"models": [{"name": "m", "replicas": 1, "profiles": [p]}]})


def test_a_profile_whose_weights_fit_nowhere_is_explained_like_any_rejection() -> None:
    fleet = [_with_memory(l40s(f"n{i:02}"), 24, 1.5) for i in range(8)]
    fleet += [l40s(f"b{i}", cordoned=True) for i in range(4)]
    plan_ = plan(fleet, _catalog(weights_gib=37.7))  # + 0.5 GiB of llama.cpp's own: 38.2
    (un,) = plan_.unplaced
    summary = un.attempts[0].to_dict()["summary"]
    assert summary == "0/12 nodes are available: 4 cordoned, 8 weights do not fit (needs 38.2 GiB per GPU, 22.5 free)."
    assert {r.constraint for r in un.reasons} >= {"fit"}


def test_a_profile_that_fits_is_placed_with_its_estimate() -> None:
    fleet = [_with_memory(l40s("n1"), 48, 0.5)]
    got = plan(fleet, _catalog(engine="vllm", weights_gib=14.96, kv_gib_per_1k_tokens=0.1220703125,
                                args=["--max-model-len", "8192"]))  # fmt: skip
    (p,) = got.placements
    assert p.action == "start" and p.need is not None
    assert p.to_dict()["memory"] == {
        "need_gib": 17.96, "weights_gib": 14.96, "kv_gib": 1.0, "overhead_gib": 2.0, "context": 8192, "shards": 1,
        "gpu_memory_utilization": 0.9, "source": "catalog", "per": "GPU",
    }  # fmt: skip
    assert any("memory: 18.0 GiB per GPU (weights 15.0 + KV 1.0 at 8192 tokens + overhead 2.0)" in x
               for x in render_plan(got))  # fmt: skip


def test_a_node_with_room_is_chosen_over_one_without() -> None:
    fleet = [_with_memory(l40s("a-small"), 24, 0), _with_memory(l40s("b-big"), 48, 0)]
    got = plan(fleet, _catalog(weights_gib=30))
    (p,) = got.placements
    assert p.replica.shards[0].node == "b-big"


def test_tensor_parallel_divides_the_weights_until_they_fit() -> None:
    fleet = [_with_memory(l40s("n1"), 24, 0)]  # vLLM may take 21.6 GiB of each
    assert plan(fleet, _catalog(engine="vllm", weights_gib=40)).unplaced
    assert plan(fleet, _catalog(engine="vllm", weights_gib=40, gpus=2)).unplaced  # 20 + 2
    assert not plan(fleet, _catalog(engine="vllm", weights_gib=40, gpus=4)).unplaced  # 10 + 2


def test_a_cpu_replica_is_checked_against_its_nodes_memory() -> None:
    cat = Catalog.model_validate({"models": [{"name": "m", "profiles": [
        {"name": "cpu", "engine": "llamacpp", "cpus": 4, "model": "/m.gguf", "weights_gib": 100}]}]})  # fmt: skip
    (un,) = plan([cpu_node("c1", memory_gib=64)], cat).unplaced
    assert "weights do not fit (needs 100.5 GiB per node, 64.0 free)" in un.attempts[0].to_dict()["summary"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([16, 24, 48, 80]), st.floats(0, 8)), min_size=1, max_size=6),
    st.floats(1, 90),
    st.sampled_from([1, 2, 4]),
    st.sampled_from(["vllm", "llamacpp"]),
)
def test_no_placement_needs_more_than_its_gpus_have(mems, weights, gpus, engine) -> None:
    if engine == "llamacpp":
        gpus = 1  # llama.cpp replicas take one GPU
    fleet = [_with_memory(l40s(f"n{i}"), total, used) for i, (total, used) in enumerate(mems)]
    cat = Catalog.model_validate({"models": [{"name": "m", "replicas": 3, "profiles": [
        {"name": "p", "engine": engine, "gpu_class": "L40S", "gpus": gpus, "model": "/m", "weights_gib": weights}]}]})  # fmt: skip
    got = plan(fleet, cat)
    facts = {f.name: f for f in fleet}
    for p in got.placements:
        assert p.need is not None
        for sh in p.replica.shards:
            for i in sh.gpus:
                g = facts[sh.node].gpus[i]
                assert shortfall(p.need, g.memory_total_mib * MIB, g.memory_used_mib * MIB) is None


# ---------------------------------------------------------------------------- read on the node
def _sh(cmd: str, home: Path) -> bytes:
    return subprocess.run(["sh", "-c", cmd], capture_output=True, env={**os.environ, "HOME": str(home)}).stdout


def _read(model: str, home: Path) -> ModelSize:
    listing = parse_stat(_sh(stat_command(model), home).decode(), model)
    return size_of(listing, _sh(read_command(listing), home), model)


def test_a_models_files_are_read_where_they_are(tmp_path: Path, ggufs) -> None:
    gguf = tmp_path / "m d" / "tiny Q8.gguf"  # blanks in names: every path is quoted
    gguf.parent.mkdir()
    gguf.write_bytes(ggufs["Q8_0"])
    got = _read(str(gguf), tmp_path)
    assert got == ModelSize(len(ggufs["Q8_0"]), 256, 2048, str(gguf))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS["Qwen2-7B"][0]))
    for i, n in enumerate((700, 300)):
        (folder / f"model-0000{i + 1}.safetensors").write_bytes(b"\0" * n)
    assert _read(str(folder), tmp_path) == ModelSize(1000, 56 * 1024, 32768, str(folder))
    snap = tmp_path / ".cache" / "huggingface" / "hub" / "models--acme--qwen" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).symlink_to(f)  # as the hub cache keeps them: links to blobs
    assert _read("acme/qwen", tmp_path).weights_bytes == 1000
    with pytest.raises(ModelFileError, match="not found on the node"):
        _read(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ModelFileError, match="not found on the node"):
        _read("acme/other", tmp_path)


def test_the_listing_key_changes_with_the_files(tmp_path: Path) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    a = parse_stat(_sh(stat_command(str(f)), tmp_path).decode(), "x")
    f.write_bytes(b"GGUF" + b"\0" * 200)
    b = parse_stat(_sh(stat_command(str(f)), tmp_path).decode(), "x")
    assert a.key() != b.key() and b.weights_bytes == 204


# ---------------------------------------------------------------------------- the engine's own figures
VLLM_LOG = """(EngineCore pid=1265223) INFO 06-02 00:51:40 [model_runner.py:295] Model loading took 7.64 GiB and 32.96 seconds
INFO 07-22 [gpu_worker.py:276] Available KV cache memory: 8.11 GiB
INFO 07-22 [kv_cache_utils.py:829] GPU KV cache size: 178,880 tokens
"""
LLAMA_LOG = """load_tensors:        CUDA0 model buffer size =  4403.50 MiB
load_tensors:   CPU_Mapped model buffer size =   281.81 MiB
llama_kv_cache:      CUDA0 KV buffer size =  1024.00 MiB
"""


def test_engines_memory_reports_are_read() -> None:
    assert parse_memory_report(VLLM_LOG) == EngineMemory(round(7.64 * GIB), round(8.11 * GIB), 178_880)
    assert parse_memory_report(LLAMA_LOG) == EngineMemory(round((4403.5 + 281.81) * MIB), 1024 * MIB, None)
    assert parse_memory_report("nothing said") == EngineMemory()


def test_a_large_miss_is_told_and_a_small_one_is_not() -> None:
    size = ModelSize(round(7.5 * GIB), 57344, 32768)  # Qwen2-7B-ish
    est = estimate(size, engine="vllm", gpus_per_node=1, nodes=1, args=["--max-model-len", "8192"])
    assert misses(est, parse_memory_report(VLLM_LOG)) == []  # 7.64 against 7.5; 47.5 KiB a token against 56
    far = EngineMemory(round(15 * GIB), None, None)
    assert misses(est, far) == ["weights: estimated 7.50 GiB per GPU, the engine loaded 15.00"]


class _Store:
    def __init__(self) -> None:
        self.saved: dict[str, tuple[str, ModelSize]] = {}

    async def model_sizes(self) -> dict[str, tuple[str, ModelSize]]:
        return dict(self.saved)

    async def save_model_size(self, model: str, key: str, size: ModelSize) -> None:
        self.saved[model] = (key, size)


class _Sessions:
    """Runs the commands here, counting them."""

    def __init__(self, home: Path) -> None:
        self.home, self.calls = home, []

    async def get(self, node: str) -> _Sessions:
        return self

    async def run(self, cmd: str, *, timeout: float) -> Any:
        self.calls.append("run")
        return subprocess.CompletedProcess([], 0, _sh(cmd, self.home).decode(), "")

    async def run_raw(self, cmd: str, *, timeout: float) -> tuple[int, bytes, bytes]:
        self.calls.append("read")
        return 0, _sh(cmd, self.home), b""


def test_a_model_listed_by_the_probe_is_read_once_while_unchanged(tmp_path: Path, ggufs) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(ggufs["F16"])
    cat = _catalog(model=str(gguf))
    nodes = [l40s("n1"), l40s("n2")]
    store, sessions = _Store(), _Sessions(tmp_path)
    listed = {"n2": {0: _sh(stat_command(str(gguf)), tmp_path).decode()}, "n1": {0: "N\n"}}
    got, notes = asyncio.run(read_sizes(cat, nodes, sessions, store, listings=listed, models=[str(gguf)]))
    assert got[str(gguf)].weights_bytes == len(ggufs["F16"]) and notes == [] and sessions.calls == ["read"]
    got, _ = asyncio.run(read_sizes(cat, nodes, sessions, store, listings=listed, models=[str(gguf)]))
    assert sessions.calls == ["read"]  # unchanged: the cache answers, nothing more is run
    gone = {"n1": {0: "N\n"}, "n2": {0: "N\n"}}
    got, notes = asyncio.run(read_sizes(cat, nodes, sessions, store, listings=gone, models=[str(gguf)]))
    assert got == {} and notes == [f"{gguf}: not found on any node"]
