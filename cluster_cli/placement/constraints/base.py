"""What constraints look at: the request of one profile and the planner's view of one node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cluster_cli.facts import NodeFacts
from cluster_cli.placement.verdict import Verdict

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Profile
    from cluster_cli.placement.fit import Estimate


@dataclass(frozen=True, slots=True)
class Request:
    """What one shard of a profile needs, in the units the constraints compare."""

    profile: str
    gpu_class: str | None = None
    gpus: int = 0
    nodes: int = 1
    cpus: int | None = None
    memory_mib: int | None = None
    fabric: str | None = None  # a multi-node replica's chosen fabric, once chosen
    need: Estimate | None = None  # memory per GPU (per node on the CPU); None: not checked

    @classmethod
    def of(cls, p: Profile, need: Estimate | None = None) -> Request:
        return cls(p.name, p.gpu_class, p.gpus_per_node, p.nodes, p.cpus, p.memory_mib, None, need)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def uses_gpus(self) -> bool:
        return bool(self.gpu_class)


@dataclass(slots=True)
class NodeState:
    """One node as the planner sees it: facts plus what is allocated on it so far.

    ``free`` holds, per GPU class, the sorted indices of GPUs that are ``Gpu.free``
    and held by no kept or planned replica. ``attachments`` maps each fabric to the
    node's Active InfiniBand ports on it (CA names, first port order, deduplicated).
    """

    facts: NodeFacts
    order: int
    free: dict[str, list[int]] = field(default_factory=dict)
    allocated: dict[int, str] = field(default_factory=dict)  # GPU index -> "model/replica"
    reserved_cpus: int = 0
    reserved_mib: int = 0
    cpu_replicas: int = 0
    replicas: int = 0
    models: dict[str, int] = field(default_factory=dict)  # model -> its replicas (shards) here
    attachments: dict[str, tuple[str, ...]] = field(default_factory=dict)
    class_total: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def has_gpus(self) -> bool:
        return bool(self.facts.gpus)

    @classmethod
    def build(cls, facts: NodeFacts, order: int, allocated: dict[int, str] | None = None) -> NodeState:
        st = cls(facts, order, allocated=dict(allocated or {}))
        st.refresh_free()
        att: dict[str, list[str]] = {}
        for h in facts.hcas:
            if h.is_ib_attachment and h.fabric:
                names = att.setdefault(h.fabric, [])
                if h.ca not in names:
                    names.append(h.ca)
        st.attachments = {f: tuple(v) for f, v in sorted(att.items())}
        return st

    def refresh_free(self) -> None:
        free: dict[str, list[int]] = {}
        total: dict[str, int] = {}
        seen: set[int] = set()
        allocated = self.allocated
        for g in self.facts.gpus:
            i, cls = g.index, g.gpu_class
            if i in seen:  # a duplicated index is never handed out twice
                continue
            seen.add(i)
            total[cls] = total.get(cls, 0) + 1
            lst = free.get(cls)
            if lst is None:
                lst = free[cls] = []
            if g.free and i not in allocated:
                lst.append(i)
        for lst in free.values():
            lst.sort()
        self.free = free
        self.class_total = total

    def unreserved_cpus(self) -> int | None:
        return None if self.facts.cpus is None else self.facts.cpus - self.reserved_cpus

    def unreserved_mib(self) -> int | None:
        return None if self.facts.memory_mib is None else self.facts.memory_mib - self.reserved_mib


class Constraint(Protocol):
    """One rule; ``name`` is the stable key counts and JSON use."""

    name: str

    def check(self, node: NodeState, req: Request) -> Verdict: ...
