"""Two multi-node vLLM replicas whose shards share nodes: the Ray command lines they get.

Each Ray port is either the replica's own (the head's GCS port, reserved in the state) or 0,
which has the kernel or Ray pick a free one when the process starts: no port number is
given to two Ray processes of one node, and no Ray default that two would share is left.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cluster_cli.config.catalog import Catalog
from cluster_cli.config.inventory import Inventory
from cluster_cli.facts import Replica, Shard
from cluster_cli.launch.shards import shard_starts
from cluster_cli.state.records import ReplicaRecord

# Every `ray start` option that makes a Ray process listen on TCP (Ray's CLI reference),
# with Ray's default where it is a fixed port.
RAY_LISTEN_FLAGS = {
    "--port": 6379,  # the head's GCS
    "--dashboard-port": 8265,
    "--dashboard-agent-listen-port": 52365,
    "--dashboard-agent-grpc-port": None,
    "--metrics-export-port": None,
    "--node-manager-port": None,
    "--object-manager-port": None,
    "--min-worker-port": 10002,
    "--max-worker-port": 19999,
}
# Left to Ray on purpose: it refuses 0 for these (it picks a free runtime-env agent port by
# default; the Ray Client server's port is given only where ray[client] is installed: below).
NOT_GIVEN = {"--runtime-env-agent-port", "--ray-client-server-port"}


def _inputs() -> tuple[Catalog, Inventory]:
    prof = {"name": "p", "engine": "vllm", "model": "/models/m", "gpu_class": "H100", "gpus": 4, "nodes": 2}
    cat = Catalog.model_validate(
        {
            "engines": {"vllm": {"command": "/opt/v/bin/vllm"}},
            "models": [{"name": "m", "replicas": 2, "profiles": [prof]}],
        }
    )
    inv = Inventory.model_validate({"nodes": [{"name": f"n{i}", "host": f"10.0.0.{i}"} for i in (1, 2)]})
    return cat, inv


def _ray_commands(script_argv: list[str]) -> list[list[str]]:
    """The `ray start` command lines in a shard's argv (a head's sits in its sh -c script)."""
    if script_argv[:2] == ["sh", "-c"]:
        start = script_argv[2].split(" && ")[0]
        start = re.sub(r"^\(unset \w+ && exec (.*)\)$", r"\1", start)
        return [shlex.split(start)]
    return [script_argv]


def _ports(argv: list[str]) -> dict[str, int]:
    out = {}
    for a in argv:
        flag, eq, value = a.partition("=")
        if eq and flag in RAY_LISTEN_FLAGS | dict.fromkeys(NOT_GIVEN):
            out[flag] = int(value)
    return out


def test_two_ray_replicas_on_the_same_nodes_share_no_port() -> None:
    cat, inv = _inputs()
    # Replica 0: head on n1, worker on n2. Replica 1 the other way round, so each node runs a
    # head of one and a worker of the other; then both heads on n1.
    layouts = [
        (("n1", "n2"), ("n2", "n1")),
        (("n1", "n2"), ("n1", "n2")),
    ]
    for layout in layouts:
        by_node: dict[str, list[tuple[str, dict[str, int]]]] = {}
        for r, (nodes, ray_port) in enumerate(zip(layout, (8300, 8301), strict=True)):
            shards = tuple(Shard(n, (0, 1, 2, 3) if r == 0 else (4, 5, 6, 7)) for n in nodes)
            rec = ReplicaRecord(
                Replica("m", r, "p", "vllm", shards), generation=1, port=8100 + r, extra_ports=(ray_port,)
            )
            for s in shard_starts(rec, cat, inv, {}):
                for argv in _ray_commands(list(s.script.argv)):
                    assert argv[1] == "start"
                    by_node.setdefault(s.node, []).append((f"m/{r}.s{s.rank}", _ports(argv)))
        for node, procs in by_node.items():
            assert len(procs) == 2, node
            fixed: dict[int, str] = {}
            for who, ports in procs:
                head = "--port" in ports
                # Every listening port Ray has is given, but those Ray refuses 0 for.
                want = set(RAY_LISTEN_FLAGS) - ({"--dashboard-port"} if not head else set())
                if not head:
                    want.discard("--port")
                assert set(ports) == want, (who, ports)
                for flag, port in ports.items():
                    if port == 0:
                        continue  # picked free when the process starts
                    assert flag == "--port", (who, flag, port)
                    assert port not in fixed, f"{who} and {fixed.get(port)} both listen on {port} on {node}"
                    fixed[port] = who


def test_the_head_runs_no_dashboard_and_a_worker_is_given_no_head_only_flag() -> None:
    cat, inv = _inputs()
    shards = (Shard("n1", (0, 1, 2, 3)), Shard("n2", (0, 1, 2, 3)))
    rec = ReplicaRecord(Replica("m", 0, "p", "vllm", shards), generation=1, port=8100, extra_ports=(8300,))
    head, worker = shard_starts(rec, cat, inv, {})
    (head_argv,) = _ray_commands(list(head.script.argv))
    assert "--include-dashboard=false" in head_argv and "--port=8300" in head_argv
    # Ray refuses --port and --include-dashboard on a node that joins a head.
    assert not any(a.startswith(("--port=", "--include-dashboard", "--dashboard-port")) for a in worker.script.argv)
    assert "--address=10.0.0.1:8300" in worker.script.argv


def _head_script(tmp: Path, extra_ports: tuple[int, ...], api_key: str | None) -> str:
    prof = {"name": "p", "engine": "vllm", "model": "/models/m", "gpu_class": "H100", "gpus": 4, "nodes": 2}
    cat = Catalog.model_validate({"engines": {"vllm": {"command": str(tmp / "bin" / "vllm")}},
                                  "models": [{"name": "m", "replicas": 1, "profiles": [prof]}]})  # fmt: skip
    inv = Inventory.model_validate({"nodes": [{"name": f"n{i}", "host": f"10.0.0.{i}"} for i in (1, 2)]})
    shards = (Shard("n1", (0, 1, 2, 3)), Shard("n2", (0, 1, 2, 3)))
    rec = ReplicaRecord(Replica("m", 0, "p", "vllm", shards), generation=1, port=8100, extra_ports=extra_ports)
    head = shard_starts(rec, cat, inv, {}, api_key=api_key)[0]
    assert head.script.argv[:2] == ["sh", "-c"]
    return head.script.argv[2]


@pytest.mark.parametrize("shell", ["sh", "dash", "busybox sh"])
@pytest.mark.parametrize("has_client", [True, False])
@pytest.mark.parametrize("api_key", [None, "ck-secret"])
def test_the_ray_client_port_is_given_only_where_rays_client_is_installed(
    tmp_path: Path, shell: str, has_client: bool, api_key: str | None
) -> None:
    """The head gets the replica's own Ray Client port where the node's Ray has ray[client]
    (Ray's own check, run with the environment's Python), and no such flag elsewhere (Ray
    refuses it there); the key never reaches ray start either way."""
    import shutil
    import subprocess

    if shutil.which(shell.split()[0]) is None:
        pytest.skip(f"{shell} not installed")
    b = tmp_path / "bin"
    b.mkdir()
    log = tmp_path / "calls"
    (b / "python").write_text(f"#!/bin/sh\nexit {0 if has_client else 1}\n")
    (b / "ray").write_text(f'#!/bin/sh\necho "ray KEY=${{VLLM_API_KEY:-}} $*" >> {log}\n')
    (b / "vllm").write_text(f'#!/bin/sh\necho "vllm KEY=${{VLLM_API_KEY:-}}" >> {log}\n')
    for f in b.iterdir():
        f.chmod(0o755)
    script = _head_script(tmp_path, (8300, 8301), api_key)
    env = {"PATH": "/usr/bin:/bin", **({"VLLM_API_KEY": api_key} if api_key else {})}
    r = subprocess.run([*shell.split(), "-c", script], env=env, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    ray, vllm = log.read_text().splitlines()
    assert ray.startswith("ray KEY= start --head --port=8300")
    assert ("--ray-client-server-port=8301" in ray) is has_client
    assert vllm == f"vllm KEY={api_key or ''}"


def test_without_a_client_port_the_head_command_is_as_before(tmp_path: Path) -> None:
    assert "--ray-client-server-port" not in _head_script(tmp_path, (8300,), None)
