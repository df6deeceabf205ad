"""Engine adapters: profile validation, exact command lines, metric mappings."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.engines import LaunchSpec, MetricMapping, get_engine
from cluster_cli.engines.base import VLLM_KV_CACHE, VLLM_KV_CACHE_LEGACY, VLLM_RUNNING, VLLM_WAITING
from cluster_cli.engines.vllm import RAY_HEAD_PORTS, RAY_NODE_PORTS

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
        # running given as blank: the engine exports none, and the mapping is complete
        ({"running": None, "waiting": "w"}, (None, "w", None)),
        ({"running": ""}, (None, None, None)),
    ],
)
def test_mapping_resolution(mapping, expected) -> None:
    m = MetricMapping.from_config(mapping)
    assert (m.running, m.waiting, m.kv_cache_usage) == expected
    back = MetricMapping.from_config(m.to_config())
    assert back == m  # to_config reads back the same, fallbacks included


_NAMES = st.one_of(st.none(), st.just(""), st.sampled_from([VLLM_RUNNING, VLLM_WAITING, VLLM_KV_CACHE, "x:y", "w"]))


@given(st.dictionaries(st.sampled_from(["running", "waiting", "kv_cache_usage"]), _NAMES, max_size=3))
def test_a_mapping_written_back_reads_as_itself(mapping: dict) -> None:
    """to_config is what the router config will carry (``clusterctl up`` writes it): reading
    it back must give the same names *and* fallbacks (vLLM's old KV-cache gauge was lost
    when overrides were written out as a complete mapping)."""
    m = MetricMapping.from_config(mapping)
    assert MetricMapping.from_config(m.to_config()) == m


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
    assert VLLM.env(spec) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert VLLM.health_path == "/health"


def _multi_node(rank: int, **kw) -> LaunchSpec:
    return LaunchSpec(model="/m/deep seek;x", served_name="deepseek-r1", host="0.0.0.0", port=8000,
                      gpus=tuple(range(8)), tensor_parallel=8, nodes=2, node_rank=rank,
                      head_address=None if rank == 0 else "10.0.0.12", **kw)  # fmt: skip


def test_vllm_multi_node_head_starts_ray_head_then_serves() -> None:
    argv = VLLM.command(_multi_node(0, extra_args=("--max-model-len", "8192")), binary="/opt/vllm/bin/vllm")
    assert argv[:2] == ["sh", "-c"] and len(argv) == 3
    head, rest = argv[2].split(" && unset NCCL_IB_HCA && exec ")
    assert shlex.split(head) == ["/opt/vllm/bin/ray", "start", "--head", "--port=6379", "--num-gpus=8",
                                 *RAY_HEAD_PORTS, *RAY_NODE_PORTS]  # fmt: skip
    # every word is quoted: a model path with a space and a ';' stays one argument
    assert shlex.split(rest) == [
        "/opt/vllm/bin/vllm", "serve", "/m/deep seek;x",
        "--served-model-name", "deepseek-r1",
        "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--max-model-len", "8192",
    ]  # fmt: skip


def test_vllm_multi_node_workers_join_the_head() -> None:
    argv = VLLM.command(_multi_node(1, cpus=32, extra_args=("--max-model-len", "8192")), binary="vllm")
    assert argv == ["ray", "start", "--block", "--address=10.0.0.12:6379", "--num-gpus=8", "--num-cpus=32",
                    *RAY_NODE_PORTS]  # fmt: skip
    with pytest.raises(ValueError, match="head_address"):
        VLLM.command(dataclasses.replace(_multi_node(1), head_address=None))


def test_two_multi_node_replicas_sharing_nodes_get_their_own_ray_clusters() -> None:
    """Two replicas whose shards share nodes (4 of 8 GPUs each on the same two nodes): each
    runs its own Ray head on its own port, its workers join that head, and its vllm serve
    joins that cluster by address (not "the newest cluster on this machine")."""
    heads, workers = [], []
    for port, gpus in ((6379, (0, 1, 2, 3)), (6380, (4, 5, 6, 7))):
        common = {"gpus": gpus, "tensor_parallel": 4, "head_address": "10.0.0.12", "ray_port": port}
        head = VLLM.command(dataclasses.replace(_multi_node(0), **common), binary="vllm")[2]
        start, _, rest = head.partition(" && unset NCCL_IB_HCA && ")
        assert shlex.split(start) == ["ray", "start", "--head", f"--port={port}", "--num-gpus=4",
                                      *RAY_HEAD_PORTS, *RAY_NODE_PORTS]  # fmt: skip
        assert rest.startswith(f"RAY_ADDRESS=10.0.0.12:{port} && export RAY_ADDRESS && exec vllm serve ")
        heads.append(port)
        workers.append(VLLM.command(dataclasses.replace(_multi_node(1), **common), binary="vllm")[3])
    assert heads == [6379, 6380]
    assert workers == ["--address=10.0.0.12:6379", "--address=10.0.0.12:6380"]


def test_vllm_multi_node_tells_ray_and_vllm_the_nodes_own_address() -> None:
    """On a machine with several networks Ray and vLLM may each pick another address; given the
    node's own, the Ray head or worker is started on it and vllm serve's VLLM_HOST_IP names it."""
    for rank, addr in ((0, "10.0.0.11"), (1, "10.0.0.12")):
        spec = _multi_node(rank, node_address=addr)
        argv = VLLM.command(spec, binary="vllm")
        ray = shlex.split(argv[2].split(" && ")[0]) if rank == 0 else argv
        assert f"--node-ip-address={addr}" in ray
        assert VLLM.env(spec)["VLLM_HOST_IP"] == addr
    assert "VLLM_HOST_IP" not in VLLM.env(_multi_node(0))
    single = LaunchSpec(model="m", served_name="m", host="h", port=1, gpus=(0,), node_address="10.0.0.11")
    assert "VLLM_HOST_IP" not in VLLM.env(single) and not any("node-ip" in a for a in VLLM.command(single))


def test_vllm_multi_node_pins_nccl_to_the_shards_hcas() -> None:
    for rank in (0, 1):
        env = VLLM.env(_multi_node(rank, hcas=("mlx5_0", "mlx5_3")))
        assert env == {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
            "NCCL_IB_HCA": "=mlx5_0,mlx5_3",  # exact names, not prefixes (mlx5_1 would match mlx5_10)
        }
    single = LaunchSpec(model="m", served_name="m", host="h", port=1, gpus=(2, 5), tensor_parallel=2, hcas=("mlx5_0",))
    assert "NCCL_IB_HCA" not in VLLM.env(single)
    assert VLLM.command(single)[0] == "vllm"


def test_launch_spec_hcas_default_keeps_old_call_sites() -> None:
    assert LaunchSpec(model="m", served_name="m", host="h", port=1).hcas == ()


def test_llamacpp_command_line() -> None:
    spec = LaunchSpec(model="/m/tiny.gguf", served_name="tiny", host="127.0.0.1", port=8080, cpus=4)
    assert LLAMA.command(spec, binary="llama-server") == [
        "llama-server", "-m", "/m/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1", "--port", "8080",
        "--metrics", "-t", "4", "-ngl", "0", "-dev", "none",
    ]  # fmt: skip
    gpu = LaunchSpec(model="x", served_name="x", host="h", port=1, gpus=(3,))
    assert LLAMA.command(gpu)[-2:] == ["-ngl", "999"]
    assert LLAMA.env(gpu) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3"}


def test_llamacpp_cpu_replica_touches_no_gpu() -> None:
    # the placer may put a CPU replica on a GPU node: llama-server's default -ngl (auto)
    # would offload onto every visible GPU, including ones other replicas hold
    spec = LaunchSpec(model="/m/tiny.gguf", served_name="tiny", host="0.0.0.0", port=8081, cpus=8)
    argv = LLAMA.command(spec)
    assert argv[argv.index("-ngl") + 1] == "0"
    assert argv[argv.index("-dev") + 1] == "none"  # no offloading device, whatever the backend
    assert LLAMA.env(spec) == {"CUDA_VISIBLE_DEVICES": ""}  # empty: no device visible to CUDA
    assert "-dev" not in LLAMA.command(LaunchSpec(model="x", served_name="x", host="h", port=1, gpus=(0,)))


# ---------------------------------------------------------------------------- API keys


KEY = "ck-" + "ab" * 32


def test_vllm_takes_its_key_from_its_environment_never_its_command_line() -> None:
    spec = LaunchSpec(model="/models/llama-70b", served_name="llama-70b", host="0.0.0.0", port=8000,
                      gpus=(0, 1), tensor_parallel=2, api_key=KEY)  # fmt: skip
    assert VLLM.api_key_env == "VLLM_API_KEY"
    assert VLLM.command(spec, binary="vllm") == [
        "vllm", "serve", "/models/llama-70b",
        "--served-model-name", "llama-70b",
        "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "2",
    ]  # fmt: skip
    assert VLLM.env(spec) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_API_KEY": KEY}
    assert "VLLM_API_KEY" not in VLLM.env(dataclasses.replace(spec, api_key=None))  # no key: an open engine


def test_a_multi_node_vllm_key_goes_to_vllm_serve_not_to_ray() -> None:
    head = _multi_node(0, api_key=KEY)
    argv = VLLM.command(head, binary="/opt/vllm/bin/vllm")
    assert KEY not in argv[2]
    start, rest = argv[2].split(" && unset NCCL_IB_HCA && exec ")
    # The Ray head's daemons (they outlive this shell) start without the key in their environment.
    ports = " ".join((*RAY_HEAD_PORTS, *RAY_NODE_PORTS))
    assert start == f"(unset VLLM_API_KEY && exec /opt/vllm/bin/ray start --head --port=6379 --num-gpus=8 {ports})"
    assert shlex.split(rest)[:2] == ["/opt/vllm/bin/vllm", "serve"]
    assert VLLM.env(head)["VLLM_API_KEY"] == KEY
    worker = _multi_node(1, api_key=KEY)
    assert "VLLM_API_KEY" not in VLLM.env(worker) and KEY not in " ".join(VLLM.command(worker))


def test_llamacpp_takes_its_key_from_its_environment_never_its_command_line() -> None:
    spec = LaunchSpec(model="/m/tiny.gguf", served_name="tiny", host="127.0.0.1", port=8080, cpus=4, api_key=KEY)
    assert LLAMA.api_key_env == "LLAMA_API_KEY"
    assert LLAMA.command(spec, binary="llama-server") == [
        "llama-server", "-m", "/m/tiny.gguf", "--alias", "tiny", "--host", "127.0.0.1", "--port", "8080",
        "--metrics", "-t", "4", "-ngl", "0", "-dev", "none",
    ]  # fmt: skip
    assert LLAMA.env(spec) == {"CUDA_VISIBLE_DEVICES": "", "LLAMA_API_KEY": KEY}
    gpu = LaunchSpec(model="x", served_name="x", host="h", port=1, gpus=(3,), api_key=KEY)
    assert LLAMA.env(gpu) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3", "LLAMA_API_KEY": KEY}


@given(st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80))
def test_no_key_ever_reaches_an_argv(tail: str) -> None:
    key = "ck-" + tail
    for engine, spec in (
        (VLLM, LaunchSpec(model="m", served_name="m", host="h", port=1, gpus=(0,), api_key=key)),
        (VLLM, _multi_node(0, api_key=key)),
        (LLAMA, LaunchSpec(model="m.gguf", served_name="m", host="h", port=1, api_key=key)),
    ):
        assert engine.env(spec)[engine.api_key_env] == key
        assert not any(key in a for a in engine.command(spec, binary="bin"))
