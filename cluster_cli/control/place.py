"""``place --dry-run`` as one operation: read the inventory, the catalog, the nodes' facts
(the state, or a facts file) and what runs now, and plan where every replica would go, with
the warnings a person should see first. It never writes."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster_cli.config.inventory import Inventory, load_inventory
from cluster_cli.errors import ClusterctlError, ConfigError
from cluster_cli.facts import ModelSize, NodeFacts, Replica
from cluster_cli.state.gpucordons import apply_gpu_cordons
from cluster_cli.state.store import Store
from cluster_cli.state.view import for_inventory, with_fenced

if TYPE_CHECKING:
    from cluster_cli.config.catalog import Catalog
    from cluster_cli.placement import Plan


@dataclass(frozen=True)
class PlaceResult:
    """A plan and what it was made from: the state version (None without a state), where
    the facts came from, how many nodes were considered, and the warnings about the inputs
    (in the order a person should read them, before the plan)."""

    plan: Plan
    version: int | None
    source: str
    nodes: int
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every replica was placed."""
        return self.plan.complete

    def to_dict(self) -> dict[str, Any]:
        return {"state_version": self.version, "source": self.source, **self.plan.to_dict()}

    def lines(self, header: str = "") -> list[str]:
        """The plan as text: a diff per model, then the dry-run block (``render_plan``)."""
        from cluster_cli.placement import render_plan

        return render_plan(self.plan, header=header)

    def trace_lines(self) -> list[str]:
        """Every node's verdict per profile tried (``render_trace``); needs ``place(trace=True)``."""
        from cluster_cli.placement import render_trace

        return render_trace(self.plan)


def place(
    inventory: Path, catalog: Path, state_path: Path, facts: Path | None = None, *, trace: bool = False
) -> PlaceResult:
    """Plan every replica of ``catalog`` on ``inventory``'s nodes, from their facts in the
    state at ``state_path`` (or in the file ``facts``, cordons and replicas still from the
    state when there is one); ``trace`` records every node's verdict for ``trace_lines``.
    Raises a ClusterctlError for an input that cannot be read. A port whose subnet
    contradicts its declared fabric is left out of the plan, with a warning."""
    from cluster_cli.config.catalog import load_catalog
    from cluster_cli.placement import plan
    from cluster_cli.probe.fabric import distrust_conflicting_ports, fabric_warnings

    warns: list[str] = []
    inv = load_inventory(inventory)
    cat = load_catalog(catalog)
    nodes, current, version, source, sizes = _inputs(warns, inv, state_path, facts)
    _warn_other_inventory(warns, inventory, state_path, facts)
    _warn_unknown_classes(warns, catalog, cat, inv, nodes)
    _warn_odd_tensor_parallel(warns, catalog, cat)
    _warn_unmatched_aliases(warns, inventory, inv, nodes)
    prefixes = inv.declared_prefixes()
    warns += [f"fabric conflict: {line}" for line in fabric_warnings(nodes, prefixes)]
    nodes = distrust_conflicting_ports(nodes, prefixes)
    return PlaceResult(plan(nodes, cat, current, trace=trace, sizes=sizes), version, source, len(nodes), warns)


def _warn_other_inventory(warns: list[str], inventory: Path, state_path: Path, facts: Path | None) -> None:
    """The state's facts come from the inventory its last discover used; planning with
    another one is legitimate (a subset, a copy) but usually a slip: say so once. With
    ``--facts`` the state still gives the cordons and replicas: say that, or a state made
    for another cluster (an exported CLUSTERCTL_STATE) silently cordons its namesakes."""
    if not state_path.exists():
        return
    try:
        with Store(state_path, readonly=True) as store:
            recorded = store.inventory()
    except ClusterctlError:
        return  # _inputs reports an unusable state
    if recorded is None or recorded == inventory.resolve():
        return
    if facts is None:
        warns.append(f"{inventory}: the state's recorded inventory is {recorded}; nodes only in this one have no facts")
    else:
        warns.append(
            f"{inventory}: cordons and replicas come from the state {state_path}, whose recorded inventory is "
            f"{recorded}: they apply to this plan's nodes of the same names (--state picks another state)"
        )


def _warn_unknown_classes(warns: list[str], path: Path, cat: Catalog, inv: Inventory, nodes: list[NodeFacts]) -> None:
    """A GPU class nothing in the fleet has is most likely a typo: say so once, not per node."""
    from cluster_cli.config.load import value_line

    known = set(inv.gpu_classes) | {g.gpu_class for n in nodes for g in n.gpus if g.gpu_class and not g.lost}
    for i, m in enumerate(cat.models):
        for j, p in enumerate(m.profiles):
            if p.gpu_class and p.gpu_class not in known:
                line = value_line(path, ("models", i, "profiles", j, "gpu_class"))
                hint = _class_hint(p.gpu_class, known, inv, nodes)
                warns.append(
                    f"{path}: {f'line {line}: ' if line else ''}models.{i}.profiles.{j}.gpu_class: no GPU of class "
                    f"{p.gpu_class!r} in the inventory or the facts{hint} "
                    f"(known: {', '.join(sorted(known)) or 'none'}){_blind_note(nodes)}"
                )


def _warn_odd_tensor_parallel(warns: list[str], path: Path, cat: Catalog) -> None:
    """vLLM splits each layer's attention heads over a node's GPUs (``gpus`` is its
    tensor-parallel size), and refuses to start unless that size divides the head count:
    a power of two for nearly every model. 3, 5, 6 or 7 is most likely a slip."""
    from cluster_cli.config.load import value_line

    for i, m in enumerate(cat.models):
        for j, p in enumerate(m.profiles):
            n = p.gpus_per_node
            if p.engine == "vllm" and n > 1 and n & (n - 1):
                line = value_line(path, ("models", i, "profiles", j, "gpus"))
                warns.append(
                    f"{path}: {f'line {line}: ' if line else ''}models.{i}.profiles.{j}.gpus: {n} is vLLM's "
                    f"tensor-parallel size, which must divide the model's attention heads (a power of two for most "
                    f"models); vLLM will refuse to start otherwise"
                )


def _class_hint(name: str, known: set[str], inv: Inventory, nodes: list[NodeFacts]) -> str:
    """``; did you mean 'H200'?`` for a class written in another case, or as a product name
    (a class is the inventory's alias for the product, else the product without "NVIDIA ")."""
    want = name.casefold().removeprefix("nvidia ").strip()
    for cls in sorted(known):
        if cls.casefold().removeprefix("nvidia ").strip() == want:
            return f"; did you mean {cls!r}?"
    products = {g.product: g.gpu_class for n in nodes for g in n.gpus if g.product and g.gpu_class and not g.lost}
    products |= {prod: alias for alias, names in inv.gpu_classes.items() for prod in names}
    for prod, cls in sorted(products.items()):
        if prod.casefold().removeprefix("nvidia ").strip() == want:
            return f"; {prod!r} is a product: its class is {cls!r}"
    return ""


def _blind_note(nodes: list[NodeFacts]) -> str:
    """Where a missing GPU class or product may be a node whose GPUs could not be read (its
    nvidia-smi failed, or it did not answer) rather than a typo: say which nodes."""
    from cluster_cli.facts import problem_key

    blind = sorted(
        n.name
        for n in nodes
        if not n.gpus
        and (
            (not n.reachable and n.cpus is None)
            or {problem_key(p) for p in n.problems} & {"gpu", "nvidia-smi", "gpus-gone", "gpus-unlisted"}
        )
    )
    if not blind:
        return ""
    shown = ", ".join(blind[:5]) + (" ..." if len(blind) > 5 else "")
    return f"; GPUs not known on {shown} (nvidia-smi failed or the node did not answer)"


def _warn_unmatched_aliases(warns: list[str], path: Path, inv: Inventory, nodes: list[NodeFacts]) -> None:
    """A ``gpu_classes`` alias none of whose products any node has is most likely a
    misspelt product name (the GPUs then keep their own class): one warning per alias."""
    from cluster_cli.config.load import value_line

    products = sorted({g.product for n in nodes for g in n.gpus if g.product})
    for alias, names in inv.gpu_classes.items():
        if names and not set(names) & set(products):
            line = value_line(path, ("gpu_classes", alias))
            seen = ", ".join(map(repr, products[:5])) + (" ..." if len(products) > 5 else "") if products else "none"
            warns.append(
                f"{path}: {f'line {line}: ' if line else ''}gpu_classes.{alias}: no GPU in the facts is "
                f"{' or '.join(map(repr, names))} (products seen: {seen}){_blind_note(nodes)}"
            )


def _inputs(
    warns: list[str], inv: Inventory, state_path: Path, facts_path: Path | None
) -> tuple[list[NodeFacts], list[Replica], int | None, str, dict[str, ModelSize]]:
    """Facts of the inventory's nodes, current allocations, state version, where facts came
    from, and the models' sizes the last ``up`` read on the nodes (for the memory-fit check)."""
    store = Store(state_path, readonly=True) if facts_path is None or state_path.exists() else None
    try:
        with store.snapshot() if store is not None else nullcontext():
            raw, current, version, source, cordons = _read(store, facts_path, state_path)
            held = store.held_apart() if store is not None else {}  # GPUs of replicas being stopped, fenced
            sizes = store.known_model_sizes() if store is not None else {}
    finally:
        if store is not None:
            store.close()
    if facts_path is not None:
        named = {f.name for f in raw}
        if not named & {n.name for n in inv.nodes}:
            count = f"{len(inv.nodes)} node{'s' if len(inv.nodes) != 1 else ''}"
            theirs = f"it has {_some(sorted(named))}" if named else "it has no nodes at all"
            raise ConfigError(
                f"{facts_path}: has facts for none of the inventory's {count} "
                f"({_some([n.name for n in inv.nodes])}); {theirs}"
            )
        if extra := sorted(named - {n.name for n in inv.nodes}):
            warns.append(f"{facts_path}: ignoring facts of nodes not in the inventory: {', '.join(extra)}")
    # A node cordoned before its first discover has no facts: its placeholder carries the cordon.
    nodes = for_inventory(inv, raw, from_state=facts_path is None, cordons=cordons)
    return with_fenced(nodes, held), current, version, source, sizes


def _some(names: list[str], most: int = 5) -> str:
    """``a, b, c`` or ``a, b, c, d, e and 7 more``."""
    more = len(names) - most
    return ", ".join(names[:most]) + (f" and {more} more" if more > 0 else "")


def _read(
    store: Store | None, facts_path: Path | None, state_path: Path
) -> tuple[list[NodeFacts], list[Replica], int | None, str, dict[str, str | None]]:
    """Facts, current allocations, state version, where the facts came from, and the
    state's cordons (node -> reason; none without a state store)."""
    cordons = {n: c.get("reason") for n, c in store.cordons().items()} if store is not None else {}
    if facts_path is not None:
        raw = read_facts(facts_path)
        if store is not None:
            # Cordons live in the state store: a file's stale "cordoned" never outlives an uncordon.
            gpu_cordons = store.gpu_cordons()
            raw = [
                apply_gpu_cordons(
                    replace(f, cordoned=f.name in cordons, cordon_reason=cordons.get(f.name)), gpu_cordons
                )
                for f in raw
            ]
        source = str(facts_path)
    else:
        assert store is not None
        raw = store.nodes()
        source = str(state_path)
    current = store.replicas() if store else []
    version = store.version() if store else None
    return raw, current, version, source, cordons


def read_facts(path: Path) -> list[NodeFacts]:
    """Parse a facts file: ``{"nodes": [NodeFacts.to_dict(), ...]}`` (a bare list is accepted too)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    items: Any = doc.get("nodes") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ConfigError(f"{path}: nodes: expected a list of node facts (the output of 'discover -o json')")
    out = []
    seen: dict[str, int] = {}
    for i, d in enumerate(items):
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: nodes.{i}: expected an object, got {type(d).__name__}")
        name = d.get("name")
        if isinstance(name, str):
            if name in seen:
                raise ConfigError(f"{path}: nodes.{i}: duplicate node name {name!r} (also nodes.{seen[name]})")
            seen[name] = i
        try:
            out.append(NodeFacts.from_dict(d))
        except KeyError as e:
            raise ConfigError(f"{path}: nodes.{i}: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"{path}: nodes.{i} ({d.get('name', '?')}): invalid facts: {e}") from None
    return out
