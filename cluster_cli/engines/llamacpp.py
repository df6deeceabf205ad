"""llama.cpp ``llama-server`` adapter: CPU or one GPU, one node.

llama.cpp splits a model over local GPUs by its own mechanism, which this adapter does
not drive; a multi-node or multi-GPU profile would start and then serve from a single
device while the catalog believed otherwise, so such profiles are refused.
"""

from __future__ import annotations

from cluster_cli.engines.base import LaunchSpec, MetricMapping, cuda_env

# Exported with --metrics. Current builds no longer export llamacpp:kv_cache_usage_ratio.
LLAMACPP_RUNNING = "llamacpp:requests_processing"
LLAMACPP_WAITING = "llamacpp:requests_deferred"


class LlamaCpp:
    name = "llamacpp"
    supports_cpu = True
    health_path = "/health"
    # llama-server takes its key from --api-key, else from LLAMA_API_KEY; with one, /health,
    # /v1/health, /models and /v1/models (and the web UI's static files) stay open, and every
    # other route, /metrics and /v1/chat/completions included, wants "Authorization: Bearer KEY"
    # ("Bearer" spelt so: "bearer" is refused) or answers 401 (docs/engines.md).
    api_key_env = "LLAMA_API_KEY"
    metrics = MetricMapping(LLAMACPP_RUNNING, LLAMACPP_WAITING, None)

    def validate_profile(self, *, gpu_class: str | None, gpus: int, nodes: int) -> str | None:
        if nodes > 1:
            return f"llamacpp cannot serve one replica from several nodes (nodes: {nodes})"
        if gpus > 1:
            return f"llamacpp profiles are limited to one GPU (gpus: {gpus}); tensor parallel is not supported"
        if gpus == 1 and not gpu_class:
            return "a profile that asks for a GPU must name its gpu_class"
        return None

    def command(self, spec: LaunchSpec, *, binary: str = "llama-server") -> list[str]:
        argv = [
            binary,
            "-m", spec.model,
            "--alias", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--metrics",
        ]  # fmt: skip
        if spec.cpus:
            argv += ["-t", str(spec.cpus)]
        # -ngl defaults to "auto" in current llama-server: a GPU build would offload onto
        # every visible GPU, including ones other replicas hold. Always say it: all layers
        # onto the assigned GPUs (999 = all, accepted by old and new builds), or none.
        argv += ["-ngl", "999" if spec.gpus else "0"]
        if not spec.gpus:
            # A CPU replica uses no device at all, whatever the backend: with -ngl 0 a GPU build
            # still offloads large operations (--op-offload), and CUDA_VISIBLE_DEVICES (below)
            # hides nothing from a Vulkan, ROCm or SYCL build. "none" = no offloading device
            # (-dev needs a build that has it, as current ones and the pinned one do).
            argv += ["-dev", "none"]
        return argv + list(spec.extra_args)

    def env(self, spec: LaunchSpec) -> dict[str, str]:
        # The replica's GPU for a CUDA build (the catalog's GPUs are NVIDIA ones, numbered as
        # nvidia-smi numbers them); a CPU replica also hides every GPU from CUDA.
        env = cuda_env(spec.gpus, spec.gpu_uuids)
        if spec.api_key:
            env[self.api_key_env] = spec.api_key
        return env
