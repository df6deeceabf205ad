"""The planner: ``plan(nodes, catalog, current) -> Plan``. Pure; no I/O.

Order of work
=============
1. **Current allocations.** A replica in ``current`` is kept when its model, replica
   number and profile are still in the catalog, the profile still asks for what it
   holds, every node of it is known and reachable, each of its GPUs still exists, is
   not lost, is healthy (no uncorrected ECC error, pending page retirement or row
   remap), is of the class and is not held by a replica kept before it (by index on
   its node, and by UUID under another node name: one machine seen twice), and
   (multi-node) each node still has an Active port on its fabric, and every HCA its
   shard uses still is one. A replica on a
   *cordoned* node, or sharing a GPU with a foreign process, is kept: a cordon stops
   new work, moving running work is ``drain``'s job. Of two allocations of one replica
   the first valid one, in an order that does not depend on the input's, is kept and the
   other stopped. Anything else is stopped, whole (all shards together), and its
   resources are free for this plan. A kept replica stays even if a higher-priority
   profile would now fit: the plan does not churn. Its GPUs are held under every name
   their UUIDs appear under.
2. **Index.** Nodes that pass the static constraints (not cordoned, reachable) are
   grouped per GPU class, and per (class, fabric) for the nodes with an Active
   InfiniBand port on that fabric, into buckets by their number of free GPUs of the
   class (``indexes.Buckets``). A GPU is free when ``Gpu.free`` (healthy, no foreign process, no MIG) and
   no kept or planned replica holds it. Nodes of the wrong class or fabric are never
   in the group a request reads, so no code path can mix classes or fabrics.
3. **Place.** Models in catalog order, missing replicas in number order, each with
   the highest-priority profile that fits (ties: the order profiles are written):
   single-node GPU replicas take the best-fitting node (smallest bucket that is big
   enough, then name); multi-node replicas take, on one fabric, the emptiest nodes;
   CPU replicas spread. GPUs inside a node are chosen NVLink-aware.
4. **Explain.** A profile that did not fit will not fit later in the same plan
   (allocations only grow), so it is skipped afterwards. It is explained when it fails,
   by the full constraint chain over every node, against the allocations of that moment
   (replicas placed later are not blamed for it), and again for a replica left unplaced
   if GPUs of its class (or CPUs) were allocated since. Successes get cheap counts from
   the index (filtered exactly, exhausted from bucket sizes; a CPU replica's up to the
   first node that fits).

Cost: O(N·G) to index, O(log N) per placed replica (a CPU model with replicas on many
nodes builds a heap of its own once, O(N)), and O(N) per explanation: per distinct
failing profile, and per unplaced replica after allocations of its class; see
``bench/placement.py``.
"""

from __future__ import annotations

import gc
import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cluster_cli.facts import ModelSize, NodeFacts, Replica, Shard, problem_key
from cluster_cli.machines import is_gpu_uuid
from cluster_cli.placement import scoring
from cluster_cli.placement.constraints import (
    CAPACITY,
    FIT,
    NODE_LEVEL,
    choose_gpus,
    gpus_known,
    mark_duplicate_gpus,
)
from cluster_cli.placement.constraints.base import NodeState, Request
from cluster_cli.placement.constraints.fit import gpus_shortfall, node_shortfall
from cluster_cli.placement.constraints.fit import verdict as fit_verdict
from cluster_cli.placement.constraints.nvlink import domain_room, fits_one_domain
from cluster_cli.placement.explain import explain_request, node_verdicts
from cluster_cli.placement.fit import Estimate, catalog_size, need_of
from cluster_cli.placement.indexes import Buckets, CpuHeap, DomainIndex
from cluster_cli.placement.results import ACTIONS, Attempt, Considered, Placement, Plan, Unplaced
from cluster_cli.placement.verdict import Kind, PlacementMetrics, Reason

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog, Model, Profile

_ANY = "\x00any"  # group key of nodes attached to some fabric (any)


# One profile tried for one replica: the profile, its request, its counts (None: skipped,
# it failed an earlier replica), and why it fits nowhere (None: it placed the replica).
_Tried = tuple["Profile", Request, PlacementMetrics | None, tuple[PlacementMetrics, tuple[Reason, ...]] | None]


def _canonical(obj: NodeFacts | Replica) -> str:
    """A total order on facts or allocations (to choose between two of one name, whatever the input order)."""
    return json.dumps(obj.to_dict(), sort_keys=True, default=str)


def _in_order(current: Sequence[Replica]) -> list[Replica]:
    """``current`` by model and replica number, two allocations of one replica in ``_canonical`` order."""
    out = sorted(current, key=lambda r: (r.model, r.replica))
    i = 0
    while i < len(out):
        j = i + 1
        while j < len(out) and out[j].key == out[i].key:
            j += 1
        if j - i > 1:
            out[i:j] = sorted(out[i:j], key=_canonical)
        i = j
    return out


def _sig(req: Request) -> tuple[Any, ...]:
    """Requests with the same signature fit (or not) on exactly the same nodes."""
    return (req.gpu_class, req.gpus, req.nodes, req.cpus, req.memory_mib, _need_key(req))


def _need_key(req: Request) -> tuple[Any, ...] | None:
    n = req.need
    return None if n is None else (n.need_bytes, n.utilization)


# --------------------------------------------------------------------------- the planner


class _Planner:
    def __init__(self, nodes: Sequence[NodeFacts], catalog: Catalog, sizes: Mapping[str, ModelSize] | None) -> None:
        self.catalog = catalog
        self.sizes = sizes or {}
        uniq: dict[str, NodeFacts] = {}
        for f in nodes:
            other = uniq.setdefault(f.name, f)
            if other is not f and _canonical(f) < _canonical(other):  # one of two by the same name, whatever the order
                uniq[f.name] = f
        # A GPU UUID on two nodes is one machine under two names: the later name is left out.
        facts = mark_duplicate_gpus(sorted(uniq.values(), key=lambda f: f.name))
        self.states = [NodeState.build(f, i) for i, f in enumerate(facts)]
        self.by_name = {s.name: s for s in self.states}
        self.placements: list[Placement] = []
        self.kept: set[tuple[str, int]] = set()
        self.domain_index: dict[str, DomainIndex] = {}  # GPU class -> its nodes by NVLink room
        # Bumped by every allocation this plan makes, per GPU class ("": CPU reservations): an
        # explanation records the one its request depends on, and is retaken only when it moved.
        self.versions: defaultdict[str, int] = defaultdict(int)

    # ---- 1. current allocations --------------------------------------------
    def apply_current(self, current: Sequence[Replica]) -> None:
        seen: set[tuple[str, int]] = set()
        # A kept replica holds its GPUs by UUID too: one machine under two names (one of
        # them marked duplicate-gpu) must not have the same GPU handed out under the other.
        held: dict[str, tuple[str, str]] = {}  # GPU UUID -> (replica, the node it is held on)
        # Two allocations of one replica: the first valid one (in a fixed order, whatever the
        # input's) is kept, the rest are stopped.
        for rep in _in_order(current):
            if rep.key in seen:
                self.placements.append(Placement(rep, "stop", "duplicate allocation of this replica"))
                continue
            why = self._invalid(rep, held)
            if why:
                self.placements.append(Placement(rep, "stop", why))
                continue
            seen.add(rep.key)
            key = f"{rep.model}/{rep.replica}"
            for s in rep.shards:
                node = self.by_name[s.node]
                uuids = {g.index: g.uuid for g in node.facts.gpus}
                for g in s.gpus:
                    node.allocated[g] = key
                    if (u := uuids.get(g)) and is_gpu_uuid(u):
                        held[u] = (key, s.node)
                node.replicas += 1
                node.models[rep.model] = node.models.get(rep.model, 0) + 1
                if not rep.gpu_class:
                    node.reserved_cpus += rep.cpus or 0
                    node.reserved_mib += rep.memory_mib or 0
                    node.cpu_replicas += 1
            cordoned = [s.node for s in rep.shards if self.by_name[s.node].facts.cordoned]
            note = f"on cordoned {', '.join(cordoned)}: kept until drained" if cordoned else ""
            model = self.catalog.model(rep.model)
            prof = model.profile(rep.profile) if model is not None else None
            self.placements.append(Placement(rep, "keep", note, need=self._need(prof) if prof is not None else None))
            self.kept.add(rep.key)
        if held:
            for st in self.states:
                for g in st.facts.gpus:
                    if g.uuid in held and held[g.uuid][1] != st.name and g.index not in st.allocated:
                        st.allocated[g.index] = held[g.uuid][0]
        for s in self.states:
            if s.allocated:
                s.refresh_free()

    def _invalid(self, rep: Replica, held: dict[str, tuple[str, str]]) -> str:
        """Why a current replica cannot be kept, or ""; ``held``: GPU UUIDs of the replicas kept
        so far, with the node each is held on."""
        mine: dict[str, str] = {}  # this replica's own GPU UUIDs, by node: two shards on one box
        model = self.catalog.model(rep.model)
        if model is None:
            return "model no longer in the catalog"
        if not 0 <= rep.replica < model.replicas:
            return f"beyond replicas: {model.replicas}"
        prof = model.profile(rep.profile)
        if prof is None:
            return f"profile {rep.profile!r} no longer in the catalog"
        if prof.engine != rep.engine or (prof.gpu_class or None) != (rep.gpu_class or None):
            return f"profile {prof.name!r} changed (now {prof.engine}, {prof.describe()})"
        if len(rep.shards) != prof.nodes or len({s.node for s in rep.shards}) != len(rep.shards):
            return f"profile {prof.name!r} now spans {prof.nodes} node(s)"
        if prof.is_cpu and (rep.cpus != prof.cpus or rep.memory_mib != prof.memory_mib):
            return f"profile {prof.name!r} now reserves {prof.describe()}"
        for s in rep.shards:
            node = self.by_name.get(s.node)
            if node is None:
                return f"node {s.node} has no facts (not in the inventory, or never discovered)"
            if not node.facts.reachable:
                return f"node {s.node} unreachable"
            if len(s.gpus) != prof.gpus_per_node or len(set(s.gpus)) != len(s.gpus):
                return f"profile {prof.name!r} now needs {prof.gpus_per_node} GPU(s) per node"
            gpus = {g.index: g for g in node.facts.gpus}
            for i in s.gpus:
                g = gpus.get(i)
                if g is None:
                    return f"GPU {i} of {s.node} is gone"
                if g.lost:
                    return f"GPU {i} of {s.node} is lost"
                if not g.healthy:  # a replica fails whole: it is released whole, then placed again
                    why = next((p for p in g.problems if problem_key(p) in ("ecc", "retired-pages", "remap")), "")
                    return f"GPU {i} of {s.node} is unhealthy ({why})"
                if g.gpu_class != prof.gpu_class:
                    return f"GPU {i} of {s.node} is {g.gpu_class}, profile needs {prof.gpu_class}"
                if i in node.allocated:
                    return f"GPU {i} of {s.node} is also held by {node.allocated[i]}"
                if g.uuid in held and held[g.uuid][1] != s.node:
                    who, where = held[g.uuid]
                    return f"GPU {i} of {s.node} ({g.uuid}) is also held by {who}, on {where}: the same machine"
                if is_gpu_uuid(g.uuid) and mine.setdefault(g.uuid, s.node) != s.node:
                    return f"GPU {i} of {s.node} ({g.uuid}) is also this replica's on {mine[g.uuid]}: the same machine"
            if prof.nodes > 1:
                if rep.fabric not in node.attachments:
                    return f"node {s.node} has no Active port on fabric {rep.fabric}"
                gone = [ca for ca in s.hcas if ca not in node.attachments[rep.fabric]]
                if gone:
                    are = "is" if len(gone) == 1 else "are"
                    return f"{', '.join(gone)} of {s.node} {are} no longer Active on fabric {rep.fabric}"
        return ""

    # ---- 2. index -----------------------------------------------------------
    def index(self) -> None:
        self.ok: list[bool] = []
        self.node_filtered: dict[str, tuple[str, int]] = {}  # constraint -> (reason, nodes)
        # Of those, the nodes with known GPUs, and per class how many have one: a request for a
        # class such a node lacks counts it as filtered by class (as ``first_failure`` explains it).
        self.filtered_known: dict[str, int] = {}
        self.filtered_has: dict[tuple[str, str], int] = {}
        self.has_class: dict[str, int] = {}
        self.has_class_attached: dict[str, int] = {}
        members: dict[tuple[str, str | None], list[NodeState]] = {}
        probe = Request("")
        for s in self.states:
            v = next((v for c in NODE_LEVEL if not (v := c.check(s, probe)).ok), None)
            if v is not None:
                reason, n = self.node_filtered.get(v.constraint, (v.reason, 0))
                self.node_filtered[v.constraint] = (reason, n + 1)
                if gpus_known(s):
                    self.filtered_known[v.constraint] = self.filtered_known.get(v.constraint, 0) + 1
                    for cls in s.class_total:
                        k = (v.constraint, cls)
                        self.filtered_has[k] = self.filtered_has.get(k, 0) + 1
            ok = v is None
            self.ok.append(ok)
            if not ok:
                continue
            for cls in s.class_total:
                self.has_class[cls] = self.has_class.get(cls, 0) + 1
                members.setdefault((cls, None), []).append(s)
                if s.attachments:
                    self.has_class_attached[cls] = self.has_class_attached.get(cls, 0) + 1
                    members.setdefault((cls, _ANY), []).append(s)
                for fab in s.attachments:
                    members.setdefault((cls, fab), []).append(s)
        self.groups: dict[tuple[str, str | None], Buckets] = {}
        self.node_groups: dict[tuple[int, str], list[Buckets]] = {}
        for key, nodes in members.items():
            cls = key[0]
            b = Buckets(max(s.class_total[cls] for s in nodes))
            for s in nodes:
                b.add(s.order, len(s.free.get(cls, ())))
                self.node_groups.setdefault((s.order, cls), []).append(b)
            self.groups[key] = b
        self.fabrics = sorted({f for (_, f) in self.groups if f is not None and f != _ANY})
        self.n_ok = sum(self.ok)
        self.cpu_heaps: dict[tuple[Any, ...], CpuHeap] = {}
        self.static_metrics: dict[tuple[Any, ...], PlacementMetrics] = {}
        # A group's nodes whose GPUs hold a request's estimate, per (group, need): built on
        # first use, kept current by ``_take`` like the group itself; and why the others do not.
        self.fit_groups: dict[tuple[Any, ...], Buckets | None] = {}
        self.fit_rejected: dict[tuple[Any, ...], Counter[tuple[str, str, str]]] = {}
        self.fit_memo: dict[tuple[Any, ...], Any] = {}

    def _need(self, p: Profile) -> Estimate | None:
        cfg = self.catalog.engines.get(p.engine)
        size = catalog_size(p) or (self.sizes.get(p.model) if p.model else None)
        return need_of(p, size, cfg.overhead_gib if cfg is not None else None)

    def _group(self, key: tuple[str, str | None], req: Request) -> Buckets | None:
        """The nodes of group ``key`` that ``req`` may use: all of them, or those whose GPUs
        can hold its estimate (memory does not change during a plan: decided once)."""
        base = self.groups.get(key)
        if req.need is None or base is None:
            return base
        fkey = (key, _need_key(req))
        if fkey in self.fit_groups:
            return self.fit_groups[fkey]
        cls = key[0]
        rejected: Counter[tuple[str, str, str]] = Counter()
        fits: list[int] = []
        memo = self.fit_memo
        for i in base.count:
            mkey = (i, cls, req.gpus, fkey[1])
            why = memo.get(mkey, memo)
            if why is memo:  # the nodes of a class are in several groups: each judged once
                node = self.states[i]
                why = memo[mkey] = gpus_shortfall(
                    [g for g in node.facts.gpus if g.gpu_class == cls and g.free], req.gpus, req.need
                )
            if why is None:
                fits.append(i)
            else:
                v = fit_verdict(why)
                kind = "exhausted" if v.kind is Kind.EXHAUSTED else "filtered"
                rejected[(kind, v.dimension or v.constraint, v.reason)] += 1
        b = base
        if rejected:  # else every node of the group fits: the group itself serves
            b = Buckets(len(base.heaps) - 1)
            for i in fits:
                b.add(i, len(self.states[i].free.get(cls, ())))
                self.node_groups.setdefault((i, cls), []).append(b)
        self.fit_groups[fkey] = b
        self.fit_rejected[fkey] = rejected
        return b

    # ---- 3. place -------------------------------------------------------------
    def place_all(self) -> tuple[list[Replica], list[tuple[Model, int]]]:
        """Place every missing replica; returns the started ones and the failures."""
        dead: set[tuple[Any, ...]] = set()
        starts: list[Replica] = []
        failed: list[tuple[Model, int]] = []
        for model in self.catalog.models:
            profiles = model.ordered_profiles()
            reqs = [Request.of(p, self._need(p)) for p in profiles]
            for r in range(model.replicas):
                if (model.name, r) in self.kept:
                    continue
                tried: list[_Tried] = []
                placed: Replica | None = None
                for p, req in zip(profiles, reqs, strict=True):
                    sig = _sig(req)
                    if sig in dead:  # did not fit earlier; allocations only grew since
                        # Its counts stand (a node filtered or full stays so as allocations
                        # grow; one that fit alone for a multi-node profile may since be
                        # full instead); the details of full nodes change: retaken if unplaced.
                        tried.append((p, req, None, self.explained[sig][1]))
                        if self.tracing:
                            why = "did not fit an earlier replica, and allocations only grew since"
                            self.trace.append(Considered(model.name, r, p.name, p.describe(), skipped=why))
                        continue
                    metrics = self.quick_metrics(req)
                    verdicts = node_verdicts(self.states, req) if self.tracing else ()
                    placed = self._try(model, r, p, req, metrics)
                    if self.tracing:
                        chosen = tuple(sh.node for sh in placed.shards) if placed is not None else ()
                        self.trace.append(
                            Considered(model.name, r, p.name, p.describe(), placed is not None, chosen,
                                       tuple(verdicts), dict(metrics.scores), _strategy(req))
                        )  # fmt: skip
                    if placed is not None:
                        tried.append((p, req, metrics, None))
                        break
                    dead.add(sig)
                    tried.append((p, req, metrics, self._explain(req)))
                if placed is None:
                    # Its reasons say what each node had when this replica was tried.
                    tried = [(p, req, m, self._explain(req)) for p, req, m, _ in tried]
                    failed.append((model, r))
                else:
                    starts.append(placed)
                self.tried[(model.name, r)] = tried
        return starts, failed

    def _explain(self, req: Request) -> tuple[PlacementMetrics, tuple[Reason, ...]]:
        """Why ``req`` fits nowhere, against the allocations of this moment: replicas placed
        later are not blamed for it, and one placed since it last failed is (its GPUs are
        counted as allocated). Taken again only when something was allocated since: O(N),
        so once per failing profile, and again only for a replica left unplaced."""
        sig = _sig(req)
        got = self.explained.get(sig)
        version = self.versions[req.gpu_class or ""]
        if got is None or got[0] != version:
            got = self.explained[sig] = (version, explain_request(self.states, req))
        return got[1]

    def quick_metrics(self, req: Request) -> PlacementMetrics:
        """Counts at this moment, from the index: static filters exactly, GPU exhaustion from bucket sizes."""
        sig = _sig(req)
        base = self.static_metrics.get(sig)
        if base is None:
            base = self.static_metrics[sig] = self._static_metrics(req)
        m = base.copy()
        if req.gpu_class:
            cls = req.gpu_class
            b = self._group((cls, _ANY) if req.multi_node else (cls, None), req)
            m.add("exhausted", "gpus", "insufficient gpus", b.below(req.gpus) if b else 0)
            if req.multi_node:
                for fab in self.fabrics:
                    fb = self._group((cls, fab), req)
                    if fb is not None:
                        m.fabrics[fab] = fb.at_least(req.gpus)
        return m

    def _static_metrics(self, req: Request) -> PlacementMetrics:
        """What the static constraints filter for this request (the same for every replica)."""
        m = PlacementMetrics(evaluated=len(self.states), partial=not req.gpu_class)
        cls = req.gpu_class or ""
        other_class = 0
        for constraint, (reason, n) in self.node_filtered.items():
            lacking = self.filtered_known.get(constraint, 0) - self.filtered_has.get((constraint, cls), 0) if cls else 0
            m.add("filtered", constraint, reason, n - lacking)
            other_class += lacking
        if cls:
            m.add("filtered", "gpu-class", f"no {cls} gpu", self.n_ok - self.has_class.get(cls, 0) + other_class)
            if req.multi_node:
                unattached = self.has_class.get(cls, 0) - self.has_class_attached.get(cls, 0)
                m.add("filtered", "fabric", "no active ib port", unattached)
            if req.need is not None:  # memory does not change during a plan: static too
                key = (cls, _ANY) if req.multi_node else (cls, None)
                self._group(key, req)
                for (kind, dim, reason), n in self.fit_rejected.get((key, _need_key(req)), {}).items():
                    m.add(kind, dim, reason, n)
        return m

    def _try(self, model: Model, r: int, p: Profile, req: Request, m: PlacementMetrics) -> Replica | None:
        if req.gpu_class:
            if req.multi_node:
                return self._multi(model, r, p, req, m)
            return self._single(model, r, p, req, m)
        return self._cpu(model, r, p, req, m)

    def _take(self, node: NodeState, cls: str, n: int, key: str) -> tuple[tuple[int, ...], bool | None]:
        free = node.free[cls]
        gpus, in_dom = choose_gpus(free, n, node.facts.nvlink_domains)
        chosen = set(gpus)
        node.free[cls] = [i for i in free if i not in chosen]
        for i in gpus:
            node.allocated[i] = key
        node.replicas += 1
        model = key.rpartition("/")[0]
        node.models[model] = node.models.get(model, 0) + 1
        left = len(node.free[cls])
        for b in self.node_groups.get((node.order, cls), ()):
            b.move(node.order, left)
        dix = self.domain_index.get(cls)
        if dix is not None and node.order in dix.at:
            dix.put(node.order, domain_room(node.free[cls], node.facts.nvlink_domains or ()), left)
        self.versions[cls] += 1
        return gpus, in_dom

    def _single(self, model: Model, r: int, p: Profile, req: Request, m: PlacementMetrics) -> Replica | None:
        cls = req.gpu_class or ""
        b = self._group((cls, None), req)
        i = b.best_fit(req.gpus) if b else None
        if i is None:
            return None
        if req.gpus > 1 and b is not None:
            i = self._keep_in_one_domain(b, cls, req.gpus, i)
        node = self.states[i]
        gpus, in_dom = self._take(node, cls, req.gpus, f"{model.name}/{r}")
        self._note_topology(model.name, r, req, node, gpus, in_dom)
        total = node.class_total[cls]
        m.scores[node.name] = scoring.normalise(
            {"binpack": scoring.binpack(len(node.free[cls]), total), "nvlink": scoring.nvlink(in_dom)}
        )
        # A single-node replica is on no fabric; its shard still lists the node's Active IB ports.
        hcas = tuple(dict.fromkeys(ca for cas in node.attachments.values() for ca in cas))
        return Replica(
            model.name, r, p.name, p.engine, (Shard(node.name, gpus, hcas),), None, cls, p.cpus, p.memory_mib
        )

    def _note_topology(
        self, model: str, r: int, req: Request, node: NodeState, gpus: tuple[int, ...], in_dom: bool | None
    ) -> None:
        """A tensor-parallel group that is not known to sit in one NVLink domain says so in the
        plan: chosen by index where the topology is unknown (it may span sockets), or split
        across domains where a domain big enough had no room (its traffic crosses PCIe)."""
        domains = node.facts.nvlink_domains
        # Known topology with no domain as big as the group (no NVLink, or PCIe pairs under a
        # TP-4): the hardware, not the plan, splits it; nothing to say on every such replica.
        if domains is not None and all(len(set(d)) < req.gpus for d in domains):
            return
        if req.gpus > 1 and in_dom is not True:
            chosen = ",".join(map(str, gpus))
            if domains is None:
                note = f"NVLink topology of {node.name} unknown: GPUs {chosen} chosen by index"
            else:
                doms = " ".join("[" + ",".join(map(str, sorted(d))) + "]" for d in domains)
                note = f"GPUs {chosen} of {node.name} are not in one NVLink domain ({doms}): none had {req.gpus} free"
            key = (model, r)
            self.notes[key] = f"{self.notes[key]}; {note}" if key in self.notes else note

    def _keep_in_one_domain(self, b: Buckets, cls: str, k: int, best: int) -> int:
        """The best-fit node, unless it would split the TP group across NVLink domains while
        another node of the class has a whole domain free: then the best-fitting such node.
        Packing yields to NVLink locality, never to unknowns."""
        st = self.states[best]
        if fits_one_domain(st.free[cls], k, st.facts.nvlink_domains) is not False:
            return best
        dix = self.domain_index.get(cls)
        if dix is None:  # built on first need: most fleets never split a group
            dix = self.domain_index[cls] = DomainIndex(len(b.heaps) - 1)
            for i in b.count:
                s = self.states[i]
                if s.facts.nvlink_domains is not None:
                    dix.put(i, domain_room(s.free[cls], s.facts.nvlink_domains), len(s.free[cls]))
        found = dix.best(k)
        return best if found is None else found

    def _multi(self, model: Model, r: int, p: Profile, req: Request, m: PlacementMetrics) -> Replica | None:
        cls = req.gpu_class or ""
        best: tuple[tuple[int, str], str, list[int]] | None = None
        for fab in self.fabrics:
            b = self._group((cls, fab), req)
            if b is None or b.at_least(req.gpus) < req.nodes:
                continue
            top = b.emptiest(req.gpus, req.nodes)
            key = scoring.fabric_key(fab, [b.count[i] for i in top])
            if best is None or key < best[0]:
                best = (key, fab, top)
        if best is None:
            return None
        _, fab, top = best
        shards = []
        for i in top:
            node = self.states[i]
            before = len(node.free[cls])
            gpus, in_dom = self._take(node, cls, req.gpus, f"{model.name}/{r}")
            self._note_topology(model.name, r, req, node, gpus, in_dom)
            m.scores[node.name] = scoring.normalise(
                {"emptiest": scoring.emptiness(before, node.class_total[cls]), "nvlink": scoring.nvlink(in_dom)}
            )
            shards.append(Shard(node.name, gpus, node.attachments[fab]))
        return Replica(model.name, r, p.name, p.engine, tuple(shards), fab, cls, p.cpus, p.memory_mib)

    def _cpu_fits(self, node: NodeState, req: Request) -> bool:
        if req.need is not None and node_shortfall(node, req.need) is not None:
            return False
        if req.cpus:
            cpus = node.unreserved_cpus()
            if cpus is None or cpus < req.cpus:
                return False
        if req.memory_mib:
            mib = node.unreserved_mib()
            if mib is None or mib < req.memory_mib:
                return False
        return True

    def _cpu(self, model: Model, r: int, p: Profile, req: Request, m: PlacementMetrics) -> Replica | None:
        sig = _sig(req)
        h = self.cpu_heaps.get(sig)
        if h is None:
            h = self.cpu_heaps[sig] = CpuHeap(
                [(scoring.spread_key(s), s.order) for s in self.states if self.ok[s.order]]
            )
            heapq.heapify(h.heap)
        own = h.by_model.get(model.name)
        chosen = self._cpu_shared(h, model.name, req) if own is None else self._cpu_own(h, own, model.name, req)
        m.merge(h.rejected)  # nodes looked at and dropped (partial: the first that fits is taken)
        if chosen is None:
            return None
        node = self.states[chosen]
        before = node.replicas
        self.versions[""] += 1
        node.reserved_cpus += req.cpus or 0
        node.reserved_mib += req.memory_mib or 0
        node.cpu_replicas += 1
        node.replicas += 1
        node.models[model.name] = node.models.get(model.name, 0) + 1
        m.scores[node.name] = scoring.normalise({"spread": scoring.spread(before)})
        return Replica(model.name, r, p.name, p.engine, (Shard(node.name, (), ()),), None, None, p.cpus, p.memory_mib)

    def _cpu_drop(self, h: CpuHeap, i: int, req: Request) -> None:
        h.dropped.add(i)
        node = self.states[i]
        v = FIT.check(node, req)  # counted as the explanation counts it
        h.rejected.record(v if not v.ok else CAPACITY.check(node, req))

    def _cpu_shared(self, h: CpuHeap, model: str, req: Request) -> int | None:
        """The first node in spread order that fits and has no replica of ``model``. Nodes that
        have one are set aside while looking; once more than ``_HELD_MAX`` are (every GPU-less
        node has one, say, and GPU hosts come after them in spread order), or every node that
        fits has one, ``model`` gets a heap of its own, led by its replicas per node: built
        once, O(N), instead of setting those nodes aside again for each replica."""
        heap = h.heap
        held: list[tuple[tuple[int, int, int], int]] = []
        chosen: int | None = None
        while (i := self._cpu_top(h, heap, scoring.spread_key, req)) is not None:
            if self.states[i].models.get(model):
                held.append(heapq.heappop(heap))
                if len(held) > _HELD_MAX:
                    break
                continue
            chosen = i
            break
        for entry in held:
            heapq.heappush(heap, entry)
        if chosen is None and held:
            own = [(_spread(self.states[i], model), i) for _, i in heap if i not in h.dropped]
            heapq.heapify(own)
            h.by_model[model] = own
            chosen = self._cpu_own(h, own, model, req)
        return chosen

    def _cpu_own(
        self, h: CpuHeap, own: list[tuple[tuple[int, int, int, int], int]], model: str, req: Request
    ) -> int | None:
        """The node with the fewest replicas of ``model`` (then spread order) that fits."""
        return self._cpu_top(h, own, lambda node: _spread(node, model), req)

    def _cpu_top(
        self, h: CpuHeap, heap: list[tuple[Any, int]], key: Callable[[NodeState], Any], req: Request
    ) -> int | None:
        """The node at the top of ``heap`` once it is current: entries of nodes dropped (here or
        through another heap of the request) are popped, a key gone stale is re-filed, a node
        that no longer fits is dropped for the request. None when none is left. Not popped."""
        while heap:
            k, i = heap[0]
            if i in h.dropped:
                heapq.heappop(heap)
                continue
            node = self.states[i]
            cur = key(node)
            if k != cur:  # replicas landed here since: re-file it
                heapq.heapreplace(heap, (cur, i))
                continue
            if not self._cpu_fits(node, req):  # resources only shrink: never again for this request
                heapq.heappop(heap)
                self._cpu_drop(h, i, req)
                continue
            return i
        return None

    # ---- 4. explain and assemble -------------------------------------------
    def run(self, current: Sequence[Replica], *, trace: bool = False) -> Plan:
        self.tracing = trace
        self.trace: list[Considered] = []
        self.notes: dict[tuple[str, int], str] = {}  # (model, replica) -> a note on its start
        self.tried: dict[tuple[str, int], list[_Tried]] = {}
        # Signature of a profile that did not fit -> (allocation version, its explanation then).
        self.explained: dict[tuple[Any, ...], tuple[int, tuple[PlacementMetrics, tuple[Reason, ...]]]] = {}
        self.apply_current(current)
        self.index()
        starts, failed = self.place_all()

        labelled: dict[tuple[int, str], tuple[PlacementMetrics, tuple[Reason, ...]]] = {}

        def relabel(
            req: Request, expl: tuple[PlacementMetrics, tuple[Reason, ...]]
        ) -> tuple[PlacementMetrics, tuple[Reason, ...]]:
            """An explanation of ``req``'s signature, under ``req``'s profile name (built once)."""
            key = (id(expl), req.profile)
            if key not in labelled:
                m, reasons = expl
                if reasons and reasons[0].profile != req.profile:
                    reasons = tuple(
                        Reason(req.profile, x.node, x.constraint, x.detail, x.kind, x.reason) for x in reasons
                    )
                labelled[key] = (m, reasons)
            return labelled[key]

        def attempts(key: tuple[str, int]) -> tuple[Attempt, ...]:
            out = []
            for p, req, m, expl in self.tried[key]:
                if expl is None:  # the profile that placed it: its own counts
                    out.append(Attempt(p.name, p.describe(), True, m))  # type: ignore[arg-type]
                else:
                    out.append(Attempt(p.name, p.describe(), False, relabel(req, expl)[0]))
            return tuple(out)

        def need(key: tuple[str, int]) -> Estimate | None:
            return next((req.need for _p, req, _m, expl in self.tried[key] if expl is None), None)

        started = [
            Placement(rep, "start", self.notes.get(rep.key, ""), attempts(rep.key), need(rep.key)) for rep in starts
        ]
        unplaced: list[Unplaced] = []
        for model, r in failed:
            reasons: list[Reason] = []
            for _p, req, _m, expl in self.tried[(model.name, r)]:
                reasons.extend(relabel(req, expl)[1])  # type: ignore[arg-type]
            unplaced.append(Unplaced(model.name, r, attempts((model.name, r)), tuple(reasons)))

        order = {m.name: i for i, m in enumerate(self.catalog.models)}
        rank = {a: i for i, a in enumerate(ACTIONS)}
        placements = sorted(
            [*self.placements, *started],
            key=lambda p: (order.get(p.replica.model, len(order)), p.replica.model, p.replica.replica, rank[p.action]),
        )
        return Plan(tuple(placements), tuple(unplaced), len(self.states), tuple(self.trace))


# Nodes with a replica of the model a CPU request may set aside on the shared heap (see _cpu_shared).
_HELD_MAX = 64


def _spread(node: NodeState, model: str) -> tuple[int, int, int, int]:
    """A CPU candidate's place in the heap: fewest replicas of the model, then ``spread_key``."""
    return (node.models.get(model, 0), *scoring.spread_key(node))


def _strategy(req: Request) -> str:
    """How the placer picks among the nodes that fit ``req``."""
    if not req.gpu_class:
        return (
            "CPU replicas spread: nodes with the fewest replicas of the model first, then GPU-less nodes, "
            "then the fewest replicas, then name"
        )
    if req.multi_node:
        return "multi-node replicas take the emptiest nodes of one fabric"
    return "single-node replicas take the best fit: the node left with the fewest free GPUs, then name"


def plan(
    nodes: Sequence[NodeFacts],
    catalog: Catalog,
    current: Sequence[Replica] = (),
    *,
    trace: bool = False,
    sizes: Mapping[str, ModelSize] | None = None,
) -> Plan:
    """Where every replica of every model goes, given the nodes' facts and what runs now.
    ``sizes``: models' sizes read on the nodes (by the profile's ``model``), for the memory-fit
    check of profiles that give none themselves.

    Pure and deterministic: the same inputs (in any order) give the same plan. ``trace``
    also records, per profile tried, the verdict on every node (``Plan.trace``; O(N) per
    attempt, for ``place -v``).
    The cyclic garbage collector is paused meanwhile: the plan allocates many small,
    acyclic objects, and collections over a large fleet's facts would dominate.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Planner(nodes, catalog, sizes).run(current, trace=trace)
    finally:
        if was_enabled:
            gc.enable()
