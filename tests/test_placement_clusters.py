"""Realistic node builders shared by the placement tests (plus a few checks of the builders).

* ``dgx``: DGX/HGX H100 or H200, 8 SXM GPUs in one NVLink domain, 8 InfiniBand rails
  (mlx5_0..mlx5_7) on one fabric, 2x56 cores, 2 TiB.
* ``a100_pcie``: 8 A100 PCIe in NVLink bridge pairs (0-1, 2-3, ...), one HDR port.
* ``l40s``: 4 L40S, PCIe only (known topology, no NVLink), no InfiniBand.
* ``cpu_node``: no GPU, no InfiniBand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cluster_cli.config.catalog import Catalog
from cluster_cli.facts import Gpu, GpuProcess, HcaPort, NodeFacts

PRODUCTS = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
    "A100": "NVIDIA A100 80GB PCIe",
    "L40S": "NVIDIA L40S",
}

PROBLEMS = {
    "ecc": "ecc: 2 uncorrected ECC errors",
    "lost": "lost: GPU has fallen off the bus",
    "retired": "retired-pages: page retirement pending",
    "remap": "remap: row remap pending",
    "mig": "mig: MIG mode enabled",
}


def gpu(node: str, i: int, cls: str, problem: str | None = None, pid: int = 4411) -> Gpu:
    uuid = f"GPU-{node}-{i}"
    if problem == "foreign":
        return Gpu(
            i, uuid, PRODUCTS.get(cls, cls), cls,
            processes=(GpuProcess(pid, "python", uuid, 1024),),
            problems=(f"foreign-process: pid {pid} (python)",),
        )  # fmt: skip
    problems = (PROBLEMS[problem],) if problem else ()
    return Gpu(
        i, uuid, PRODUCTS.get(cls, cls), cls,
        lost=problem == "lost",
        ecc_uncorrected=2 if problem == "ecc" else None,
        mig_mode=problem == "mig",
        problems=problems,
    )  # fmt: skip


def ib(ca: str, fabric: str | None, state: str = "Active", link: str = "InfiniBand") -> HcaPort:
    return HcaPort(ca, 1, state, "LinkUp" if state == "Active" else "Disabled", link, 400.0, fabric=fabric)


def node(
    name: str,
    *,
    cls: str | None = None,
    gpus: int = 0,
    problems: Mapping[int, str] | None = None,
    domains: Iterable[Iterable[int]] | None = None,
    hcas: Iterable[HcaPort] = (),
    cpus: int | None = 64,
    memory_gib: int | None = 256,
    cordoned: bool = False,
    reachable: bool = True,
    error: str | None = None,
    fabric: str | None = None,
) -> NodeFacts:
    problems = problems or {}
    return NodeFacts(
        name=name,
        host=f"10.0.0.{abs(hash(name)) % 250 + 1}",
        reachable=reachable,
        error=error if error or reachable else "connection refused",
        cpus=cpus,
        memory_mib=None if memory_gib is None else memory_gib * 1024,
        gpus=tuple(gpu(name, i, cls or "", problems.get(i), pid=4411 + i) for i in range(gpus)),
        nvlink_domains=None if domains is None else tuple(tuple(d) for d in domains),
        hcas=tuple(hcas),
        fabric=fabric,
        cordoned=cordoned,
        cordon_reason="maintenance" if cordoned else None,
    )


def dgx(name: str, cls: str = "H100", fabric: str | None = "ib-a", **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [range(8)])
    kw.setdefault("hcas", [ib(f"mlx5_{i}", fabric) for i in range(8)] if fabric else ())
    kw.setdefault("cpus", 224)
    kw.setdefault("memory_gib", 2048)
    return node(name, cls=cls, gpus=8, fabric=fabric, **kw)


def a100_pcie(name: str, fabric: str | None = None, **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [(0, 1), (2, 3), (4, 5), (6, 7)])
    kw.setdefault("hcas", [ib("mlx5_0", fabric)] if fabric else ())
    kw.setdefault("cpus", 128)
    kw.setdefault("memory_gib", 1024)
    return node(name, cls="A100", gpus=8, fabric=fabric, **kw)


def l40s(name: str, **kw: Any) -> NodeFacts:
    kw.setdefault("domains", [])
    return node(name, cls="L40S", gpus=4, **kw)


def cpu_node(name: str, cpus: int | None = 32, memory_gib: int | None = 128, **kw: Any) -> NodeFacts:
    return node(name, cpus=cpus, memory_gib=memory_gib, **kw)


def profile(name: str, engine: str = "vllm", **kw: Any) -> dict[str, Any]:
    return {"name": name, "engine": engine, "model": f"/models/{name}", **kw}


def catalog(*models: tuple[str, int, list[dict[str, Any]]]) -> Catalog:
    return Catalog.model_validate({"models": [{"name": n, "replicas": r, "profiles": ps} for n, r, ps in models]})


# ---- checks of the builders themselves ---------------------------------------------


def test_dgx_has_eight_rails_on_one_fabric() -> None:
    n = dgx("gpu-01")
    assert n.fabrics == frozenset({"ib-a"})
    assert len(n.hcas) == 8 and all(h.is_ib_attachment for h in n.hcas)
    assert all(g.free for g in n.gpus) and n.nvlink_domains == (tuple(range(8)),)


def test_problem_gpus_are_not_free() -> None:
    n = dgx("gpu-01", problems={0: "ecc", 1: "foreign", 2: "lost", 3: "mig"})
    assert [g.free for g in n.gpus[:5]] == [False, False, False, False, True]
    assert [g.healthy for g in n.gpus[:4]] == [False, True, False, True]
