"""Two multi-node vLLM replicas whose shards share nodes: the Ray command lines they get.

Each Ray port is either the replica's own (the head's GCS port, reserved in the state) or 0,
which has the kernel or Ray pick a free one when the process starts: no port number is
given to two Ray processes of one node, and no Ray default that two would share is left.
"""

from __future__ import annotations

import re
import shlex

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
# default; the Ray Client server needs ray[client], see docs/engines.md).
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
