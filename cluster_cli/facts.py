"""Plain, immutable facts about nodes: what the probes learn and placement reads.

These are the lingua franca between stages (probe -> state -> placement). They hold
no behaviour beyond derived properties and JSON conversion, so every stage can be
tested with hand-made instances.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any


def _num(d: dict[str, Any], key: str) -> Any:
    """``d[key]`` if it is a finite number >= 0, or missing/null; else a ValueError naming the key.

    Every number in the facts is a count, a size or a time: NaN (which ``json.loads``
    accepts), infinities and negatives would slip past every comparison made with them.
    """
    v = d.get(key)
    if v is None:
        return v
    if isinstance(v, int | float) and not isinstance(v, bool):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{key}: expected a finite number >= 0, got {v!r}")
        return v
    raise ValueError(f"{key}: expected a number, got {v!r}")


def _bool(d: dict[str, Any], key: str, default: bool | None) -> Any:
    """``d[key]`` if it is true/false, ``default`` if missing/null; a string like "false" is an error."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    raise ValueError(f"{key}: expected true or false, got {v!r}")


def _text(d: dict[str, Any], key: str) -> str | None:
    """``d[key]`` if it is a string, None if missing/null; anything else is a ValueError naming
    the key (a name compared or sorted with others must not be a number in one file)."""
    v = d.get(key)
    if v is None or isinstance(v, str):
        return v
    raise ValueError(f"{key}: expected a string, got {v!r}")


def _texts(d: dict[str, Any], key: str) -> tuple[str, ...]:
    """``d[key]`` as a tuple of strings (missing/null: empty); else a ValueError naming the key."""
    v = d.get(key)
    if v is None:
        return ()
    if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return tuple(v)
    raise ValueError(f"{key}: expected a list of strings, got {v!r}")


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, from ``nvidia-smi --query-compute-apps``."""

    pid: int
    name: str
    gpu_uuid: str
    used_mib: int | None = None


@dataclass(frozen=True)
class Gpu:
    """One physical GPU of a node.

    ``problems`` holds every reason the GPU is not free, as short human strings
    whose first word is a stable key (``ecc``, ``retired-pages``, ``remap``, ``lost``,
    ``foreign-process``, ``mig``).
    """

    index: int
    uuid: str
    product: str
    gpu_class: str
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    pci_bus_id: str | None = None
    ecc_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    mig_mode: bool | None = None
    lost: bool = False
    processes: tuple[GpuProcess, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        """Hardware is usable: not lost, no ECC fault, nothing pending retirement or remap."""
        return not any(problem_key(p) in _HEALTH_KEYS for p in self.problems)

    @property
    def free(self) -> bool:
        """Healthy and nobody else is computing on it."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        unread = self.lost and self.product == UNREAD  # nvidia-smi could not say what it is
        return {
            "index": self.index,
            "uuid": self.uuid or None,  # a lost GPU has none
            "product": None if unread else self.product,
            "class": None if unread else self.gpu_class,
            "memory_total_mib": self.memory_total_mib,
            "memory_used_mib": self.memory_used_mib,
            "pci_bus_id": self.pci_bus_id,
            "ecc_uncorrected": self.ecc_uncorrected,
            "retired_pages_pending": self.retired_pages_pending,
            "remapped_rows_pending": self.remapped_rows_pending,
            "mig_mode": self.mig_mode,
            "lost": self.lost,
            "healthy": self.healthy,
            "free": self.free,
            "problems": list(self.problems),
            "processes": [
                {"pid": p.pid, "name": p.name, "gpu_uuid": p.gpu_uuid, "used_mib": p.used_mib} for p in self.processes
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, away: bool = False) -> Gpu:
        """From ``to_dict``'s shape. Hand-written facts may set the fields and leave out
        ``problems``: a fault in the fields still makes the GPU not free. ``away``: the GPU
        of a node that did not answer, whose ``free`` says only that (see ``NodeFacts``)."""
        if _num(d, "index") is None:
            raise KeyError("index")
        lost = _bool(d, "lost", False)
        g = cls(
            index=int(d["index"]),
            uuid=str(d.get("uuid") or ""),
            product=str(d.get("product") or (UNREAD if lost else "")),
            gpu_class=_text(d, "class") or _text(d, "gpu_class") or (UNREAD if lost else ""),
            memory_total_mib=_num(d, "memory_total_mib"),
            memory_used_mib=_num(d, "memory_used_mib"),
            pci_bus_id=_text(d, "pci_bus_id"),
            ecc_uncorrected=_num(d, "ecc_uncorrected"),
            retired_pages_pending=_bool(d, "retired_pages_pending", None),
            remapped_rows_pending=_bool(d, "remapped_rows_pending", None),
            mig_mode=_bool(d, "mig_mode", None),
            lost=lost,
            processes=tuple(_process(p) for p in d.get("processes") or ()),
            problems=_texts(d, "problems"),
        )
        have = {problem_key(p) for p in g.problems}
        implied = [
            (g.lost, "lost", "lost: GPU is lost"),
            (bool(g.ecc_uncorrected), "ecc", f"ecc: {g.ecc_uncorrected} uncorrected ECC error(s)"),
            (g.retired_pages_pending, "retired-pages", "retired-pages: page retirement pending"),
            (g.remapped_rows_pending, "remap", "remap: row remap pending"),
            (g.mig_mode, "mig", "mig: MIG mode enabled"),
        ]
        missing = [text for on, key, text in implied if on and key not in have]
        # Compute processes in a file that gives no problems at all (written by hand: discover
        # always writes them, and leaves out only its own replicas' processes): each holds its GPU.
        if g.processes and "problems" not in d:
            missing += [f"foreign-process: pid {p.pid} ({p.name})" if p.name else f"foreign-process: pid {p.pid}"
                        for p in g.processes]  # fmt: skip
        # A file that says a GPU is not healthy or not free, with no problem saying why (discover
        # never writes that), is believed: the flags are what a person editing it would change.
        keys = have | {problem_key(p) for p in missing}
        if d.get("healthy") is False and not keys & _HEALTH_KEYS:
            missing.append("unhealthy: marked unhealthy in the facts")
        if d.get("free") is False and not away and not keys and not missing:
            missing.append("busy: marked not free in the facts")
        return replace(g, problems=g.problems + tuple(missing)) if missing else g


# Problem keys that make a GPU unhealthy (as opposed to merely busy).
# The product and class of a GPU that fell off the bus: nvidia-smi cannot read them. The JSON
# says null; inside, the placeholder keeps a lost GPU apart from a class of its own.
UNREAD = "unknown"
_HEALTH_KEYS = frozenset({"lost", "ecc", "retired-pages", "remap", "unhealthy"})


def lost_gpus_problem(n: int) -> str:
    """The node's problem that sums up its lost GPUs (each also has one of its own)."""
    return f"gpu: {n} GPU(s) lost"


def problem_key(problem: str) -> str:
    """The stable key of a problem string: ``"ecc: 3 uncorrected"`` -> ``"ecc"``."""
    return problem.split(":", 1)[0].split(" ", 1)[0].strip()


DEFAULT_SUBNET_PREFIX = 0xFE80_0000_0000_0000  # what every subnet has unless its SM is told otherwise
_PREFIX_TEXT = re.compile(r"[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){3}")
_PREFIX_HEX = re.compile(r"0x[0-9a-f]{1,16}")


def prefix_text(prefix: int) -> str:
    """``0xfe80000000000000`` -> ``fe80:0000:0000:0000`` (as sysfs and ibstatus print it)."""
    return ":".join(f"{(prefix >> shift) & 0xFFFF:04x}" for shift in (48, 32, 16, 0))


def prefix_value(v: object) -> int | None:
    """A 64-bit subnet prefix: four hex groups (``fe80:0000:0000:0000``, as ``prefix_text``
    writes), ``0x`` and up to 16 hex digits (as opensm writes), or an int -> int."""
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64:
        return v
    text = v.strip().lower() if isinstance(v, str) else ""
    if _PREFIX_HEX.fullmatch(text):
        return int(text, 16)
    if not _PREFIX_TEXT.fullmatch(text):
        raise ValueError(
            f"subnet_prefix: expected a 64-bit subnet prefix like fec0:0000:0000:0001 or 0xfec0000000000001, got {v!r}"
        )
    out = 0
    for part in text.split(":"):
        out = (out << 16) | int(part, 16)
    return out


@dataclass(frozen=True)
class HcaPort:
    """One port of an RDMA adapter, from ``ibstat``."""

    ca: str
    port: int
    state: str  # Active, Down, Initializing, ...
    physical_state: str = ""  # LinkUp, Disabled, Polling, ...
    link_layer: str = ""  # InfiniBand or Ethernet
    rate_gbps: float | None = None
    port_guid: int | None = None
    base_lid: int | None = None
    sm_lid: int | None = None
    ca_type: str | None = None
    sm_guid: int | None = None  # master SM port GUID seen from this port (sminfo), if known
    fabric: str | None = None  # from the inventory (node default or per-HCA override)
    subnet_prefix: int | None = None  # upper 64 bits of the port's GID 0 (sysfs), if known

    @property
    def is_ib_attachment(self) -> bool:
        """Only Active InfiniBand ports attach a node to a fabric."""
        return self.state == "Active" and self.link_layer == "InfiniBand"

    def to_dict(self) -> dict[str, Any]:
        rate: float | int | None = self.rate_gbps
        if rate is not None and float(rate).is_integer():
            rate = int(rate)
        return {
            "name": self.ca,
            "port": self.port,
            "state": self.state,
            "physical_state": self.physical_state,
            "link_layer": self.link_layer,
            "rate_gbps": rate,
            "port_guid": None if self.port_guid is None else f"0x{self.port_guid:016x}",
            "base_lid": self.base_lid,
            "sm_lid": self.sm_lid,
            "ca_type": self.ca_type,
            "sm_guid": None if self.sm_guid is None else f"0x{self.sm_guid:016x}",
            "subnet_prefix": None if self.subnet_prefix is None else prefix_text(self.subnet_prefix),
            "fabric": self.fabric,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HcaPort:
        return cls(
            ca=str(d["name"]),
            port=int(d["port"]),
            state=str(d.get("state") or ""),
            physical_state=str(d.get("physical_state") or ""),
            link_layer=str(d.get("link_layer") or ""),
            rate_gbps=None if (rate := _num(d, "rate_gbps")) is None else float(rate),
            port_guid=_guid(d, "port_guid"),
            base_lid=_num(d, "base_lid"),
            sm_lid=_num(d, "sm_lid"),
            ca_type=_text(d, "ca_type"),
            sm_guid=_guid(d, "sm_guid"),
            fabric=_text(d, "fabric"),
            subnet_prefix=prefix_value(d.get("subnet_prefix")),
        )


@dataclass(frozen=True)
class ModelSize:
    """A model's weights and KV cache, as read from its files on a node or given in the catalog."""

    weights_bytes: int
    kv_bytes_per_token: float | None = None  # at 2 bytes an element (f16/bf16)
    max_context: int | None = None
    source: str = "catalog"  # "catalog", or where its files were read

    def to_dict(self) -> dict[str, Any]:
        return {"weights_bytes": self.weights_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "max_context": self.max_context, "source": self.source}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSize:
        return cls(int(d["weights_bytes"]), d.get("kv_bytes_per_token"), d.get("max_context"), str(d.get("source", "")))


@dataclass(frozen=True)
class NodeFacts:
    """Everything known about one node at one moment.

    ``nvlink_domains`` is ``None`` when the topology is unknown (never guessed);
    an empty tuple means "known: no NVLink". ``gpus`` is empty for CPU-only nodes.
    """

    name: str
    host: str = ""
    reachable: bool = True
    error: str | None = None
    cpus: int | None = None
    memory_mib: int | None = None
    gpus: tuple[Gpu, ...] = ()
    nvlink_domains: tuple[tuple[int, ...], ...] | None = None
    hcas: tuple[HcaPort, ...] = ()
    fabric: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    cordoned: bool = False
    cordon_reason: str | None = None
    problems: tuple[str, ...] = ()
    probed_at: float | None = None
    last_seen_at: float | None = None  # an unreachable node: when it last answered (its facts' age)

    @property
    def fabrics(self) -> frozenset[str]:
        """Fabrics this node is attached to through Active InfiniBand ports."""
        return frozenset(h.fabric for h in self.hcas if h.is_ib_attachment and h.fabric)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.host,
            "reachable": self.reachable,
            "error": self.error,
            "cordoned": self.cordoned,
            "cordon_reason": self.cordon_reason,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "fabric": self.fabric,
            "labels": dict(self.labels),
            # An unreachable node's GPUs are its last known ones: none of them is free now.
            "gpus": [g.to_dict() if self.reachable else {**g.to_dict(), "free": False} for g in self.gpus],
            "nvlink_domains": None if self.nvlink_domains is None else [list(d) for d in self.nvlink_domains],
            "hcas": [h.to_dict() for h in self.hcas],
            "fabrics": sorted(self.fabrics),
            "problems": list(self.problems),
            "probed_at": self.probed_at,
            "last_seen_at": self.probed_at if self.reachable else self.last_seen_at,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeFacts:
        """Read back ``to_dict``'s form (the state, a facts file); its text made printable."""
        reachable = _bool(d, "reachable", True)
        return printable_facts(
            cls(
                name=str(d["name"]),
                host=str(d.get("host") or ""),
                reachable=reachable,
                error=_text(d, "error"),
                cpus=_num(d, "cpus"),
                memory_mib=_num(d, "memory_mib"),
                gpus=tuple(Gpu.from_dict(g, away=not reachable) for g in d.get("gpus") or ()),
                nvlink_domains=_domains(d),
                hcas=tuple(HcaPort.from_dict(h) for h in d.get("hcas") or ()),
                fabric=_text(d, "fabric"),
                labels=_labels(d),
                cordoned=_bool(d, "cordoned", False),
                cordon_reason=_text(d, "cordon_reason"),
                problems=_texts(d, "problems"),
                probed_at=_num(d, "probed_at"),
                last_seen_at=_num(d, "last_seen_at"),
            )
        )


def _process(p: Any) -> GpuProcess:
    """A compute process of ``Gpu.to_dict``'s shape; a ValueError naming the field otherwise."""
    if not isinstance(p, dict) or not isinstance(p.get("pid"), int) or isinstance(p.get("pid"), bool):
        raise ValueError(f"processes: expected objects with an integer pid, got {p!r}")
    return GpuProcess(p["pid"], _text(p, "name") or "", _text(p, "gpu_uuid") or "", _num(p, "used_mib"))


def _guid(d: dict[str, Any], key: str) -> int | None:
    """A 64-bit GUID: ``0x``-hex text (as ``to_dict`` writes it) or an integer; else a ValueError naming the key."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        try:
            n = int(v, 16)
        except ValueError:
            n = -1
    elif isinstance(v, int) and not isinstance(v, bool):
        n = v
    else:
        n = -1
    if not 0 <= n < 1 << 64:
        raise ValueError(f"{key}: expected a 64-bit GUID like 0x0002c90300a1b2c3, got {v!r}")
    return n


def _domains(d: dict[str, Any]) -> tuple[tuple[int, ...], ...] | None:
    """NVLink domains: null (unknown) or a list of lists of GPU indices; else a ValueError."""
    v = d.get("nvlink_domains")
    if v is None:
        return None
    if isinstance(v, list) and all(
        isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x) for x in v
    ):
        return tuple(tuple(x) for x in v)
    raise ValueError(f"nvlink_domains: expected null or a list of lists of GPU indices, got {v!r}")


def _labels(d: dict[str, Any]) -> dict[str, str]:
    v = d.get("labels")
    if v is None:
        return {}
    if isinstance(v, dict) and all(isinstance(x, str) for x in v.values()):
        return {str(k): x for k, x in v.items()}
    raise ValueError(f"labels: expected a mapping of strings, got {v!r}")


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (ESC, other C0 and C1 controls,
    DEL, and other non-printing characters) written out as ``\\xNN``: what a node prints ends
    up on the operator's terminal, where ESC ] 52 writes the clipboard and ESC c resets it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in text)


def printable_facts(obj: Any) -> Any:
    """``obj`` (facts: a dataclass, tuple, dict or str, nested) with all its text ``printable``."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, tuple):
        return tuple(printable_facts(x) for x in obj)
    if isinstance(obj, frozenset):
        return frozenset(printable_facts(x) for x in obj)
    if isinstance(obj, dict):
        return {printable_facts(k): printable_facts(v) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        changes = {
            name: cleaned
            for name, f in obj.__dataclass_fields__.items()
            if f.init and (cleaned := printable_facts(value := getattr(obj, name))) is not value and cleaned != value
        }
        return replace(obj, **changes) if changes else obj
    return obj


@dataclass(frozen=True)
class Shard:
    """The part of a replica that runs on one node."""

    node: str
    gpus: tuple[int, ...] = ()
    hcas: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "gpus": list(self.gpus), "hcas": list(self.hcas)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Shard:
        return cls(str(d["node"]), tuple(int(g) for g in d.get("gpus") or ()), tuple(d.get("hcas") or ()))


@dataclass(frozen=True)
class Replica:
    """One placed replica of a model: all its shards are allocated and released together."""

    model: str
    replica: int
    profile: str
    engine: str
    shards: tuple[Shard, ...]
    fabric: str | None = None
    gpu_class: str | None = None
    cpus: int | None = None
    memory_mib: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.model, self.replica)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "replica": self.replica,
            "profile": self.profile,
            "engine": self.engine,
            "fabric": self.fabric,
            "gpu_class": self.gpu_class,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Replica:
        return cls(
            model=str(d["model"]),
            replica=int(d["replica"]),
            profile=str(d["profile"]),
            engine=str(d["engine"]),
            shards=tuple(Shard.from_dict(s) for s in d.get("shards") or ()),
            fabric=d.get("fabric"),
            gpu_class=d.get("gpu_class"),
            cpus=_num(d, "cpus"),
            memory_mib=_num(d, "memory_mib"),
        )
