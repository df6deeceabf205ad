"""Placement benchmark: synthetic fleets of 100, 1,000 and 10,000 nodes.

Every node has 8 GPUs (H100, H200, A100 or L40S), sits on one of 4 InfiniBand
fabrics (8 rails), and a few percent of nodes/GPUs carry faults (cordoned,
unreachable, ECC, foreign processes, lost). The catalog asks for about half the
fleet's healthy GPUs in a mix of TP8, TP4, TP2, single-GPU, 2-node replicas and CPU
replicas, plus one model whose GPU class does not exist, so the explanation path
(a full scan per failing profile) is in the measurement too.

    python bench/placement.py                 # 100, 1000, 10000 nodes
    python bench/placement.py --sizes 100 1000 10000 100000 --repeat 3

Prints the plan time of each size (best of --repeat, fleet generation excluded),
the ratio between consecutive sizes, and what n log n growth would allow; then the same
catalog with each profile's model size given (``weights_gib``, ``kv_gib_per_1k_tokens``), so
that the memory-fit check runs on every node, and its time against the first.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster_cli.config.catalog import Catalog
from cluster_cli.facts import Gpu, HcaPort, NodeFacts
from cluster_cli.placement import plan

CLASSES = [("H100", 0.4), ("H200", 0.2), ("A100", 0.3), ("L40S", 0.1)]
MEMORY_GIB = {"H100": 80, "H200": 141, "A100": 80, "L40S": 48}
# Weights (bf16) and KV cache per 1,000 tokens of the models the catalog names, in GiB.
SIZES = {"llama-70b": (131.4, 0.3125), "llama-405b": (756.0, 0.4883), "mixtral": (87.0, 0.1221),
         "qwen-14b": (27.5, 0.1875), "qwen-7b": (14.2, 0.0547), "next-gen": (40.0, 0.1)}  # fmt: skip
FABRICS = ["ib-0", "ib-1", "ib-2", "ib-3"]


def fleet(n: int, seed: int = 7) -> list[NodeFacts]:
    rnd = random.Random(seed)
    nodes = []
    for i in range(n):
        cls = rnd.choices([c for c, _ in CLASSES], [w for _, w in CLASSES])[0]
        fabric = FABRICS[i % len(FABRICS)]
        gpus = []
        for g in range(8):
            roll = rnd.random()
            problems: tuple[str, ...] = ()
            if roll < 0.01:
                problems = ("ecc: 2 uncorrected ECC errors",)
            elif roll < 0.02:
                problems = (f"foreign-process: pid {4000 + g} (python)",)
            elif roll < 0.025:
                problems = ("lost: GPU has fallen off the bus",)
            # MiB in use: a few GPUs hold enough of another's memory that vLLM's share is no longer free
            used = rnd.randint(10_000, 30_000) if roll < 0.03 else rnd.randint(0, 600)
            gpus.append(Gpu(g, f"GPU-{i}-{g}", f"NVIDIA {cls}", cls, memory_total_mib=MEMORY_GIB[cls] * 1024,
                            memory_used_mib=used, lost=problems[:1] == ("lost",), problems=problems))  # fmt: skip
        domains = ((0, 1), (2, 3), (4, 5), (6, 7)) if cls == "A100" else (() if cls == "L40S" else (tuple(range(8)),))
        hcas = tuple(
            HcaPort(
                f"mlx5_{k}",
                1,
                "Down" if rnd.random() < 0.01 else "Active",
                "LinkUp",
                "InfiniBand",
                400.0,
                fabric=fabric,
            )
            for k in range(8)
        )
        roll = rnd.random()
        nodes.append(
            NodeFacts(
                name=f"node-{i:06d}",
                reachable=roll >= 0.01,
                error=None if roll >= 0.01 else "timeout",
                cpus=128,
                memory_mib=1024 * 1024,
                gpus=tuple(gpus),
                nvlink_domains=domains,
                hcas=hcas,
                fabric=fabric,
                cordoned=0.01 <= roll < 0.03,
            )
        )
    rnd.shuffle(nodes)  # the placer must not rely on input order
    return nodes


def catalog(n: int, fit: bool = False) -> Catalog:
    def r(frac: float) -> int:
        return max(1, round(n * frac))

    models = [
        ("llama-70b", r(0.10), [("H100", 8, 1, 100), ("H200", 8, 1, 50)]),
        ("llama-405b", r(0.03), [("A100", 8, 2, 100), ("H100", 8, 2, 50)]),
        ("mixtral", r(0.15), [("H200", 4, 1, 100), ("H100", 4, 1, 50)]),
        ("qwen-14b", r(0.40), [("A100", 2, 1, 100), ("H100", 2, 1, 50)]),
        ("qwen-7b", r(0.90), [("L40S", 1, 1, 100), ("A100", 1, 1, 50), ("H100", 1, 1, 10)]),
        ("next-gen", r(0.01), [("B200", 8, 1, 100)]),  # no such class: exercises explanations
    ]
    doc = {
        "models": [
            {
                "name": name,
                "replicas": reps,
                "profiles": [
                    {
                        "name": f"{c.lower()}-{g}x{k}",
                        "engine": "vllm",
                        "gpu_class": c,
                        "gpus": g,
                        "nodes": k,
                        "priority": pr,
                        "model": f"/models/{name}",
                        "args": ["--max-model-len", "8192"],
                        **({"weights_gib": SIZES[name][0], "kv_gib_per_1k_tokens": SIZES[name][1]} if fit else {}),
                    }
                    for c, g, k, pr in profiles
                ],
            }
            for name, reps, profiles in models
        ]
    }
    doc["models"].append(
        {
            "name": "tiny",
            "replicas": r(0.02),
            "profiles": [
                {"name": "cpu", "engine": "llamacpp", "cpus": 8, "memory_gib": 16, "model": "/models/tiny.gguf"}
            ],
        }
    )
    return Catalog.model_validate(doc)


def asked(cat: Catalog) -> int:
    return sum(m.replicas * m.ordered_profiles()[0].gpus_per_node * m.ordered_profiles()[0].nodes for m in cat.models)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    print(f"{'nodes':>8} {'gpus':>8} {'asked':>7} {'placed':>7} {'unplaced':>8} {'time':>9}  growth (n log n allows)"
          f"  {'fit check':>9} {'placed':>7} {'unplaced':>8} {'ratio':>6}")  # fmt: skip
    for n in args.sizes:
        nodes = fleet(n)
        timed = []
        for fit in (False, True):
            cat = catalog(n, fit)
            best = math.inf
            result = None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                result = plan(nodes, cat, [])
                best = min(best, time.perf_counter() - t0)
            assert result is not None
            placed_gpus = sum(len(s.gpus) for p in result.starts for s in p.replica.shards)
            timed.append((best, placed_gpus, len(result.unplaced)))
        (best, placed_gpus, unplaced), (fbest, fplaced, funplaced) = timed
        growth = ""
        if rows:
            pn, pt = rows[-1]
            allow = (n * math.log(n)) / (pn * math.log(pn))
            growth = f"x{best / pt:.1f} (x{allow:.1f})"
        rows.append((n, best))
        print(
            f"{n:>8} {n * 8:>8} {asked(catalog(n)):>7} {placed_gpus:>7} {unplaced:>8} {best * 1000:>7.0f}ms  {growth:<22}"
            f"{fbest * 1000:>7.0f}ms {fplaced:>7} {funplaced:>8} {fbest / best:>5.2f}x"
        )


if __name__ == "__main__":
    main()
