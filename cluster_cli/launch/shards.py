"""From a reserved replica to what each of its shards runs on its node (pure).

The engine adapter gives argv and environment; this adds the profile's environment (secrets
go to the shard's 0600 environment file only), GPU pinning by UUID, the shard's folder, and
what the node must have before anything starts (the binary, the model file, free ports).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster_cli.engines import LaunchSpec, get_engine
from cluster_cli.engines.base import RAY_PORT
from cluster_cli.launch.remote import StartScript, new_token
from cluster_cli.state.records import ReplicaRecord, ShardRun

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog, Profile
    from cluster_cli.config.inventory import Inventory
    from cluster_cli.facts import NodeFacts

DEFAULT_RUN_DIR = "~/.clusterctl/run"
LISTEN_HOST = "0.0.0.0"  # the engine serves the router from wherever it runs


@dataclass(frozen=True)
class ShardStart:
    """One shard to start: where, and the script's inputs."""

    rank: int
    node: str
    script: StartScript
    run: ShardRun


def folder(run_dir: str, rec: ReplicaRecord) -> str:
    """The shard's own folder under the node's run folder: ``MODEL-N.gG``."""
    r = rec.replica
    return posixpath.join(run_dir, f"{r.model}-{r.replica}.g{rec.generation}")


def profile_of(cat: Catalog, rec: ReplicaRecord) -> Profile:
    model = cat.model(rec.replica.model)
    p = model.profile(rec.replica.profile) if model is not None else None
    if p is None:
        raise ValueError(f"{rec.name}: profile {rec.replica.profile!r} is no longer in the catalog")
    return p


def shard_starts(
    rec: ReplicaRecord,
    cat: Catalog,
    inv: Inventory,
    facts: dict[str, NodeFacts],
    *,
    api_key: str | None = None,
) -> list[ShardStart]:
    """What every shard of ``rec`` runs (shard 0 first). ``rec.port`` must be set; a
    multi-node replica's Ray head port is ``rec.extra_ports[0]``, its Ray Client server's
    ``rec.extra_ports[1]`` (where it has one).

    ``api_key`` (``keys.record_key(secret, rec)``) is the key shard 0's API server demands: it goes
    into that shard's environment in the engine's own variable (its 0600 environment file on
    the node), never into an argv. None: the engine is open to whoever reaches its port."""
    r = rec.replica
    engine = get_engine(r.engine)
    if engine is None:
        raise ValueError(f"{rec.name}: unknown engine {r.engine!r}")
    p = profile_of(cat, rec)
    binary = cat.command(r.engine)
    cfg = cat.engines.get(r.engine)
    extra = tuple((cfg.args if cfg else []) + list(p.args))
    head = r.shards[0].node
    head_node = inv.node(head)
    head_address = head_node.host if head_node is not None else head
    ray_port = rec.extra_ports[0] if rec.extra_ports else RAY_PORT
    client_port = rec.extra_ports[1] if len(rec.extra_ports) > 1 else None
    out: list[ShardStart] = []
    for rank, s in enumerate(r.shards):
        n = inv.node(s.node)
        if n is None:
            raise ValueError(f"{rec.name}: node {s.node!r} is no longer in the inventory")
        f = facts.get(s.node)
        by_index = {g.index: g.uuid for g in f.gpus} if f is not None else {}
        uuids = tuple(by_index.get(i, "") for i in s.gpus)
        if any(not u for u in uuids):
            uuids = ()  # a GPU whose UUID is not known: pinned by index (CUDA_DEVICE_ORDER=PCI_BUS_ID)
        spec = LaunchSpec(
            model=p.model or "",
            served_name=r.model,
            host=LISTEN_HOST,
            port=rec.port or 0,
            gpus=s.gpus,
            gpu_uuids=uuids,
            tensor_parallel=max(1, len(s.gpus)),
            nodes=len(r.shards),
            node_rank=rank,
            head_address=head_address if len(r.shards) > 1 else None,
            ray_port=ray_port,
            ray_client_port=client_port,
            cpus=r.cpus,
            extra_args=extra,
            hcas=s.hcas,
            node_address=n.host if len(r.shards) > 1 else None,
            api_key=api_key if rank == 0 else None,
        )
        argv = engine.command(spec, binary=binary)
        env = {**p.env, **engine.env(spec)}  # the adapter's pinning (and key) wins over a profile's
        binaries = [binary]
        if len(r.shards) > 1:
            binaries = [posixpath.join(posixpath.dirname(binary), "ray") if "/" in binary else "ray"]
            if rank == 0:
                binaries.append(binary)
        files = [spec.model] if (r.engine == "llamacpp" or spec.model.startswith("/")) and rank == 0 else []
        ports = ([rec.port] if rec.port else []) + list(rec.extra_ports) if rank == 0 else []
        run_dir = folder(inv.run_dir(n), rec)
        run = ShardRun(node=s.node, run_dir=run_dir, token=_token(rec, rank), gpu_uuids=uuids)
        script = StartScript(run_dir, argv, env, run.token, ports=ports, binaries=binaries, files=files)
        out.append(ShardStart(rank, s.node, script, run))
    return out


def _token(rec: ReplicaRecord, rank: int) -> str:
    r = rec.replica
    return f"{r.model}/{r.replica}.g{rec.generation}.s{rank}.{new_token()}"


def pick_port(lo: int, hi: int, taken: set[int]) -> int | None:
    """The lowest port of ``lo..hi`` not in ``taken``."""
    for port in range(lo, hi + 1):
        if port not in taken:
            return port
    return None
