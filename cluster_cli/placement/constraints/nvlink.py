"""NVLink-aware GPU choice: a tensor-parallel group stays inside one NVLink domain.

This is a preference, never a filter: where the topology is known and some domain
has enough free GPUs, the best-fitting one (fewest free GPUs left over, then the
smallest, then the lowest index) is used; otherwise the lowest free indices. GPUs in
no domain count as domains of one, so a single-GPU replica takes a lone GPU before
it breaks into an NVLink group.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.verdict import Verdict

Domains = Sequence[Sequence[int]] | None


def choose_gpus(free: Sequence[int], n: int, domains: Domains) -> tuple[tuple[int, ...], bool | None]:
    """Pick ``n`` of the sorted ``free`` indices.

    Returns the GPUs and whether they sit in one NVLink domain: ``True``/``False``
    when the topology is known, ``None`` when it is not.
    """
    if n > len(free):
        raise ValueError(f"need {n} GPUs, {len(free)} free")
    if domains is None:
        return tuple(free[:n]), None
    if n == 0:
        return (), True
    free_set = set(free)
    covered: set[int] = set()
    best: tuple[tuple[int, int, int], list[int]] | None = None
    for d in domains:
        covered.update(d)
        avail = sorted(i for i in set(d) if i in free_set)
        if len(avail) >= n:
            key = (len(avail), len(d), avail[0])
            if best is None or key < best[0]:
                best = (key, avail[:n])
    if n == 1:
        lone = [i for i in free if i not in covered]
        if lone:
            return (lone[0],), True
    if best is not None:
        return tuple(best[1]), True
    return tuple(free[:n]), False


def domain_room(free: Sequence[int], domains: Sequence[Sequence[int]]) -> int:
    """The most free GPUs that one NVLink domain of the node holds."""
    fs = set(free)
    return max((sum(1 for i in set(d) if i in fs) for d in domains), default=0)


def fits_one_domain(free: Sequence[int], n: int, domains: Domains) -> bool | None:
    """Whether some domain has ``n`` free GPUs (``None``: topology unknown)."""
    if domains is None:
        return None
    return n <= 1 or domain_room(free, domains) >= n


class NvlinkDomain:
    """Soft constraint: always passes, says whether the group would stay in one domain."""

    name = "nvlink"

    def check(self, node: NodeState, req: Request) -> Verdict:
        if not req.gpu_class or req.gpus <= 1:
            return Verdict.passed(self.name)
        fits = fits_one_domain(node.free.get(req.gpu_class, ()), req.gpus, node.facts.nvlink_domains)
        if fits is None:
            return Verdict.passed(self.name, "topology unknown: lowest free indices")
        if fits:
            return Verdict.passed(self.name, "fits in one NVLink domain")
        return Verdict.passed(self.name, f"no NVLink domain with {req.gpus} free GPUs: lowest free indices")
