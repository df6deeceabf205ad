"""vLLM adapter: GPU only; tensor parallel within a node, pipeline parallel across nodes.

A multi-node replica runs on a Ray cluster, as vLLM's multi-node docs describe: the
rank-0 shard starts the Ray head and then runs ``vllm serve`` (the only process that
serves HTTP), every other shard runs a Ray worker that joins the head and blocks.
"""

from __future__ import annotations

import posixpath
import shlex

from cluster_cli.engines.base import LaunchSpec, MetricMapping, cuda_env


def _ray_binary(vllm_binary: str) -> str:
    """``ray`` from the same environment as the vllm binary (a venv path), else from PATH."""
    return posixpath.join(posixpath.dirname(vllm_binary), "ray") if "/" in vllm_binary else "ray"


def _ray_resources(spec: LaunchSpec) -> list[str]:
    res = [f"--num-gpus={len(spec.gpus)}"]
    if spec.cpus:
        res.append(f"--num-cpus={spec.cpus}")
    if spec.node_address:
        res.append(f"--node-ip-address={spec.node_address}")
    return res


# Every port a Ray node listens on besides the head's GCS port (the replica's own, from the
# launcher): 0 makes the kernel, or Ray itself, pick one free at start, where Ray's fixed
# defaults (dashboard agent 52365, workers 10002-19999) would collide between two Ray replicas
# sharing a node. The runtime-env agent is left out: Ray refuses 0 for it, and picks a free
# port for it by default.
RAY_NODE_PORTS = (
    "--node-manager-port=0",
    "--object-manager-port=0",
    "--dashboard-agent-listen-port=0",
    "--dashboard-agent-grpc-port=0",
    "--metrics-export-port=0",
    "--min-worker-port=0",
    "--max-worker-port=0",
)
# The head's own: no dashboard UI (vLLM needs none; its API server still starts, on a port the
# kernel picks, as its default 8265 lies in clusterctl's default HTTP range).
RAY_HEAD_PORTS = ("--include-dashboard=false", "--dashboard-port=0")
# The Ray Client server listens (on 10001 by default) only where ray[client] is installed,
# and Ray refuses a port for it elsewhere: the head is given the replica's own port for it
# when the node's Ray says it has the client's dependencies (asked with Ray's own check).
_CLIENT_CHECK = "import sys, ray._private.utils as u; sys.exit(0 if u.check_ray_client_dependencies_installed() else 1)"


def _python(vllm_binary: str) -> str:
    """The Python of the vllm binary's environment (a venv path), else python3 from PATH."""
    return posixpath.join(posixpath.dirname(vllm_binary), "python") if "/" in vllm_binary else "python3"


class VLLM:
    name = "vllm"
    supports_cpu = False
    health_path = "/health"
    # vLLM's OpenAI server takes its key from --api-key, else from VLLM_API_KEY; with one, every
    # /v1 route wants "Authorization: Bearer KEY" (401 otherwise), while /health, /ping,
    # /version and /metrics stay open (docs/engines.md).
    api_key_env = "VLLM_API_KEY"
    metrics = MetricMapping.vllm()

    def validate_profile(self, *, gpu_class: str | None, gpus: int, nodes: int) -> str | None:
        if not gpu_class:
            return "vllm needs a gpu_class (a profile without one would be placed on a machine with no GPU)"
        if gpus < 1:
            return "vllm needs at least 1 GPU per node"
        return None

    def command(self, spec: LaunchSpec, *, binary: str = "vllm") -> list[str]:
        if spec.nodes > 1 and spec.node_rank > 0:
            if not spec.head_address:
                raise ValueError(f"vllm shard {spec.node_rank} of {spec.nodes} needs the rank-0 shard's head_address")
            # A Ray worker joining the head; vLLM places its workers here through Ray.
            return [
                _ray_binary(binary), "start", "--block",
                f"--address={spec.head_address}:{spec.ray_port}",
                *_ray_resources(spec),
                *RAY_NODE_PORTS,
            ]  # fmt: skip
        serve = [
            binary, "serve", spec.model,
            "--served-model-name", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--tensor-parallel-size", str(spec.tensor_parallel),
        ]  # fmt: skip
        if spec.nodes == 1:
            return serve + list(spec.extra_args)
        serve += ["--pipeline-parallel-size", str(spec.nodes), "--distributed-executor-backend", "ray"]
        serve += spec.extra_args
        head = [_ray_binary(binary), "start", "--head", f"--port={spec.ray_port}", *_ray_resources(spec),
                *RAY_HEAD_PORTS, *RAY_NODE_PORTS]  # fmt: skip
        body = f"exec {shlex.join(head)}"
        if spec.ray_client_port:
            client = [*head, f"--ray-client-server-port={spec.ray_client_port}"]
            check = f"{shlex.quote(_python(binary))} -c {shlex.quote(_CLIENT_CHECK)} >/dev/null 2>&1"
            body = f"if {check}; then exec {shlex.join(client)}; else {body}; fi"
        if spec.api_key:
            # The key is vllm serve's alone: the Ray daemons started here (GCS, raylet, dashboard)
            # and the workers they spawn do not get it from this shell.
            start_head = f"(unset {self.api_key_env} && {body})"
        else:
            start_head = f"({body})" if spec.ray_client_port else shlex.join(head)
        # Current vLLM (since early 2026) copies the driver's NCCL_* variables onto every Ray
        # worker, which would push this node's HCA names onto the other nodes; older releases
        # copy none (the unset is then harmless). Each node's raylet carries its own
        # NCCL_IB_HCA (see env()), so the driver must not have one.
        # vllm serve joins the cluster at RAY_ADDRESS (the head's address, when the launcher
        # gives it): without it Ray picks the newest cluster started on this machine, which
        # may be another replica's.
        join = ""
        if spec.head_address:
            join = f"RAY_ADDRESS={shlex.quote(f'{spec.head_address}:{spec.ray_port}')} && export RAY_ADDRESS && "
        script = f"{start_head} && unset NCCL_IB_HCA && {join}exec {shlex.join(serve)}"
        return ["sh", "-c", script]

    def env(self, spec: LaunchSpec) -> dict[str, str]:
        env = cuda_env(spec.gpus, spec.gpu_uuids)
        if spec.nodes > 1 and spec.hcas:
            # "=" makes the names exact: a bare mlx5_1 is a prefix that also matches mlx5_10...
            env["NCCL_IB_HCA"] = "=" + ",".join(spec.hcas)
        if spec.nodes > 1 and spec.node_address:
            env["VLLM_HOST_IP"] = spec.node_address  # the address Ray was told (--node-ip-address)
        if spec.api_key and (spec.nodes == 1 or spec.node_rank == 0):
            env[self.api_key_env] = spec.api_key  # the shard that runs vllm serve; a Ray worker serves no HTTP
        return env
