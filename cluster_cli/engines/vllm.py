"""vLLM adapter: GPU only; tensor parallel within a node, pipeline parallel across nodes."""

from __future__ import annotations

from cluster_cli.engines.base import LaunchSpec, MetricMapping


class VLLM:
    name = "vllm"
    supports_cpu = False
    health_path = "/health"
    metrics = MetricMapping.vllm()

    def validate_profile(self, *, gpu_class: str | None, gpus: int, nodes: int) -> str | None:
        if not gpu_class:
            return "vllm needs a gpu_class (a profile without one would be placed on a machine with no GPU)"
        if gpus < 1:
            return "vllm needs at least 1 GPU per node"
        return None

    def command(self, spec: LaunchSpec, *, binary: str = "vllm") -> list[str]:
        argv = [
            binary, "serve", spec.model,
            "--served-model-name", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--tensor-parallel-size", str(spec.tensor_parallel),
        ]  # fmt: skip
        if spec.nodes > 1:
            argv += ["--pipeline-parallel-size", str(spec.nodes), "--distributed-executor-backend", "ray"]
        return argv + list(spec.extra_args)

    def env(self, spec: LaunchSpec) -> dict[str, str]:
        env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in spec.gpus)}
        return env
