"""Engine adapters: profile validation, exact command lines, metric mappings."""

from __future__ import annotations

import pytest

from cluster_cli.engines import LaunchSpec, MetricMapping, get_engine
from cluster_cli.engines.base import VLLM_KV_CACHE, VLLM_KV_CACHE_LEGACY, VLLM_RUNNING, VLLM_WAITING

VLLM = get_engine("vllm")
LLAMA = get_engine("llamacpp")


def test_vllm_metric_names_are_current_vllms() -> None:
    assert (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_CACHE) == (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    )
    assert VLLM.metrics.names("kv_cache_usage") == ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert VLLM_KV_CACHE_LEGACY == "vllm:gpu_cache_usage_perc"


def test_llamacpp_metric_names_and_no_kv_gauge() -> None:
    m = LLAMA.metrics
    assert (m.running, m.waiting, m.kv_cache_usage) == (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        None,  # current llama.cpp no longer exports llamacpp:kv_cache_usage_ratio: unknown, not 0
    )


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({}, (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_CACHE)),
        (None, (VLLM_RUNNING, VLLM_WAITING, VLLM_KV_CACHE)),
        # naming its own running metric makes the mapping complete: blanks stay unknown
        ({"running": "llamacpp:requests_processing"}, ("llamacpp:requests_processing", None, None)),
        (
            {"running": "a", "waiting": "b", "kv_cache_usage": "c"},
            ("a", "b", "c"),
        ),
        # without running: single overrides on top of vLLM's names
        ({"waiting": "my_waiting"}, (VLLM_RUNNING, "my_waiting", VLLM_KV_CACHE)),
    ],
)
def test_mapping_resolution(mapping, expected) -> None:
    m = MetricMapping.from_config(mapping)
    assert (m.running, m.waiting, m.kv_cache_usage) == expected


def test_mapping_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown metric key"):
        MetricMapping.from_config({"runing": "x"})


@pytest.mark.parametrize(
    ("engine", "gpu_class", "gpus", "nodes", "needle"),
    [
        ("vllm", None, 1, 1, "needs a gpu_class"),
        ("vllm", "H100", 0, 1, "at least 1 GPU"),
        ("llamacpp", None, 0, 2, "several nodes"),
        ("llamacpp", "H100", 2, 1, "tensor parallel"),
        ("llamacpp", None, 1, 1, "gpu_class"),
    ],
)
def test_profile_refusals(engine: str, gpu_class, gpus: int, nodes: int, needle: str) -> None:
    why = get_engine(engine).validate_profile(gpu_class=gpu_class, gpus=gpus, nodes=nodes)
    assert why is not None and needle in why


def test_profiles_accepted() -> None:
    assert VLLM.validate_profile(gpu_class="H100", gpus=8, nodes=2) is None
    assert LLAMA.validate_profile(gpu_class=None, gpus=0, nodes=1) is None
    assert LLAMA.validate_profile(gpu_class="L40S", gpus=1, nodes=1) is None


def test_vllm_command_line_single_node_tp() -> None:
    spec = LaunchSpec(model="/models/llama-70b", served_name="llama-70b", host="0.0.0.0", port=8000,
                      gpus=(0, 1, 2, 3), tensor_parallel=4)  # fmt: skip
    assert VLLM.command(spec, binary="vllm") == [
        "vllm", "serve", "/models/llama-70b",
        "--served-model-name", "llama-70b",
        "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "4",
    ]  # fmt: skip
    assert VLLM.env(spec) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert VLLM.health_path == "/health"


def test_vllm_command_line_multi_node() -> None:
    spec = LaunchSpec(model="m", served_name="m", host="h", port=1, gpus=tuple(range(8)), tensor_parallel=8, nodes=2)
    argv = VLLM.command(spec, binary="vllm")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"


def test_llamacpp_command_line() -> None:
    spec = LaunchSpec(model="/m/tiny.gguf", served_name="tiny", host="127.0.0.1", port=8080, cpus=4)
    assert LLAMA.command(spec, binary="llama-server") == [
        "llama-server", "-m", "/m/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1", "--port", "8080",
        "--metrics", "-t", "4",
    ]  # fmt: skip
    assert LLAMA.env(spec) == {}
    gpu = LaunchSpec(model="x", served_name="x", host="h", port=1, gpus=(3,))
    assert LLAMA.command(gpu)[-2:] == ["-ngl", "999"] and LLAMA.env(gpu) == {"CUDA_VISIBLE_DEVICES": "3"}
