"""Simulated hardware: presets, node descriptions and the exact tool outputs they produce.

Everything here is pure (no processes, no files): a :class:`NodeSpec` plus the node's
position in the cluster renders to the bytes and return codes that ``nvidia-smi``,
``ibstat``, ``sminfo``, ``nproc`` and ``cat /proc/meminfo`` would print on such a
machine. The formats mimic the real captures in ``tests/fixtures/probes`` (tab-separated
``topo -m`` with the empty cell before ``N/A``; ``", "``-separated CSV; ibstat indented
with real tabs; nvidia-smi errors on stdout with their documented return codes).

Spec grammar (CLI ``--nodes``)::

    NAME=PRESET[:OPTION]...[,NAME=PRESET[:OPTION]...]

    options: fabric=NAME  cpus=N  mem_gib=N  ecc=IDX  remap=IDX  retire=IDX
             foreign=IDX:PID:NAME[:MIB]  lost=IDX  smi_error=no-driver|driver-mismatch|no-devices
             slow=SECONDS  garbage  sm_guid=0xHEX  prefix=HEX16  ib_down=IDX  hca=CA:FABRIC  label=KEY/VALUE
             driver=VERSION (before 450: no mig.mode.* or remapped_rows.* fields to query)

Index options may repeat (``ecc=1:ecc=3``) or list with ``+`` (``ecc=1+3``). A token
without ``=`` continues the previous option's value, which is how ``foreign`` carries
colons (``foreign=2:4242:/usr/bin/python3``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cluster_cli.probe.commands import APP_FIELDS, PROBES, sminfo_command

# ---------------------------------------------------------------------------
# Hardware building blocks


@dataclass(frozen=True)
class GpuModel:
    product: str
    memory_mib: int
    gpu_class: str  # inventory gpu_classes key
    idle_used_mib: int = 0
    ecc: str = "0"  # ecc.errors.uncorrected.volatile.total when healthy
    mig: str = "Disabled"  # mig.mode.current
    retired: str = "[N/A]"  # retired_pages.pending when healthy (Ampere+ remap rows instead)
    remapped: str = "No"  # remapped_rows.pending when healthy
    compute_cap: str = "9.0"
    power_limit: str = "700.00"


@dataclass(frozen=True)
class Nic:
    """One single-port RDMA CA (``mlx5_N``) and where it sits in the PCIe tree."""

    ca: str
    link_layer: str  # "InfiniBand" or "Ethernet"
    numa: int
    pix_gpu: int | None = None  # the GPU behind the same PCIe switch
    card: int | None = None  # CAs on one card (dual-port) share a card id: PIX to each other
    ca_type: str = "MT4129"
    firmware: str = "28.41.1000"
    rate: str = "400"

    @property
    def ca_index(self) -> int:
        return int(self.ca.rsplit("_", 1)[1])


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    gpu: GpuModel | None
    bus_ids: tuple[int, ...] = ()
    gpu_numa: tuple[int, ...] = ()
    numa_cpus: dict[int, str] = field(default_factory=dict)
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    nvlink_token: str = ""
    pcie_same_numa: str = "NODE"
    nics: tuple[Nic, ...] = ()
    cpus: int = 64
    mem_gib: int = 256
    driver: str = "570.211.01"

    @property
    def gpu_count(self) -> int:
        return len(self.bus_ids) if self.gpu else 0

    @property
    def has_ibstat(self) -> bool:
        return bool(self.nics)


H200 = GpuModel("NVIDIA H200", 143771, "H200")
H100 = GpuModel("NVIDIA H100 80GB HBM3", 81559, "H100")
A100_PCIE = GpuModel("NVIDIA A100 80GB PCIe", 81920, "A100", idle_used_mib=4, compute_cap="8.0", power_limit="300.00")
RTX4090 = GpuModel(
    "NVIDIA GeForce RTX 4090",
    24564,
    "RTX4090",
    idle_used_mib=1,
    ecc="[N/A]",
    mig="[N/A]",
    remapped="[N/A]",
    compute_cap="8.9",
    power_limit="450.00",
)
L40S = GpuModel("NVIDIA L40S", 46068, "L40S", mig="[N/A]", compute_cap="8.9", power_limit="350.00")


def _ib(n: int, numa: int, gpu: int | None) -> Nic:
    return Nic(f"mlx5_{n}", "InfiniBand", numa, pix_gpu=gpu, card=n)


def _eth(n: int, numa: int, card: int, rate: str = "100") -> Nic:
    return Nic(f"mlx5_{n}", "Ethernet", numa, card=card, ca_type="MT4125", firmware="22.38.1002", rate=rate)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "hgx-h200x8",
            "HGX H200 8-GPU, NV18 full mesh, 8x CX-7 NDR 400 InfiniBand (topology of a real capture)",
            H200,
            bus_ids=(0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB),
            gpu_numa=(0, 0, 0, 0, 1, 1, 1, 1),
            numa_cpus={0: "0-63,128-191", 1: "64-127,192-255"},
            nvlink_groups=((0, 1, 2, 3, 4, 5, 6, 7),),
            nvlink_token="NV18",
            nics=(
                _ib(0, 0, 2),
                _ib(1, 0, 1),
                _ib(2, 1, 7),
                _ib(3, 0, 3),
                _ib(4, 0, 0),
                _ib(5, 1, 6),
                _ib(6, 1, 4),
                _ib(7, 1, 5),
            ),
            cpus=256,
            mem_gib=2048,
        ),
        Preset(
            "dgx-h100",
            "DGX H100, NV18 full mesh, 8x CX-7 400 InfiniBand + 2 Ethernet (RoCE) ports",
            H100,
            bus_ids=(0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF),
            gpu_numa=(0, 0, 0, 0, 1, 1, 1, 1),
            numa_cpus={0: "0-55,112-167", 1: "56-111,168-223"},
            nvlink_groups=((0, 1, 2, 3, 4, 5, 6, 7),),
            nvlink_token="NV18",
            nics=(
                _ib(0, 0, 0),
                _eth(1, 0, card=100),
                _eth(2, 0, card=100),
                _ib(3, 0, 1),
                _ib(4, 0, 2),
                _ib(5, 0, 3),
                _ib(6, 1, 4),
                _ib(7, 1, 5),
                _ib(8, 1, 6),
                _ib(9, 1, 7),
            ),
            cpus=224,
            mem_gib=2048,
            driver="535.161.08",
        ),
        Preset(
            "a100-pcie-4x",
            "4x A100 80GB PCIe, NVLink bridges on pairs 0-1 and 2-3 (NV12), SYS across sockets",
            A100_PCIE,
            bus_ids=(0x17, 0x31, 0xB1, 0xCA),
            gpu_numa=(0, 0, 1, 1),
            numa_cpus={0: "0-51,104-155", 1: "52-103,156-207"},
            nvlink_groups=((0, 1), (2, 3)),
            nvlink_token="NV12",
            cpus=208,
            mem_gib=1024,
            driver="550.127.05",
        ),
        Preset(
            "rtx4090x8",
            "8x GeForce RTX 4090, PCIe only (no NVLink), no RDMA NICs",
            RTX4090,
            bus_ids=(0x01, 0x25, 0x41, 0x61, 0x81, 0xA1, 0xC1, 0xE1),
            gpu_numa=(0, 0, 0, 0, 1, 1, 1, 1),
            numa_cpus={0: "0-55,112-167", 1: "56-111,168-223"},
            cpus=224,
            mem_gib=512,
            driver="550.120",
        ),
        Preset(
            "l40s-2x",
            "2x L40S, PCIe only, one dual-port CX-6 Dx Ethernet (RoCE) card",
            L40S,
            bus_ids=(0x4A, 0x61),
            gpu_numa=(0, 0),
            numa_cpus={0: "0-31,64-95"},
            nics=(_eth(0, 0, card=0), _eth(1, 0, card=0)),
            cpus=128,
            mem_gib=512,
            driver="595.80",
        ),
        Preset("cpu-only", "CPU-only server: no nvidia-smi, no ibstat", None, cpus=64, mem_gib=256),
    )
}

SMI_ERRORS: dict[str, tuple[str, int]] = {
    # Texts from tests/fixtures/probes/nvidia-smi.err.*; nvidia-smi prints them on stdout.
    "no-driver": (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n",
        9,
    ),
    "driver-mismatch": (
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.161\n",
        18,
    ),
    "no-devices": ("No devices were found\n", 6),
}

LOST_RC = 15
DEFAULT_FOREIGN_MIB = 16384
ECC_FAULT_COUNT = "2"


# ---------------------------------------------------------------------------
# Node descriptions


@dataclass(frozen=True)
class Foreign:
    """A compute process someone else runs on a GPU."""

    gpu: int
    pid: int
    name: str
    used_mib: int = DEFAULT_FOREIGN_MIB


@dataclass(frozen=True)
class NodeSpec:
    """One simulated server: a preset plus faults and overrides."""

    name: str
    preset: str
    fabric: str | None = None
    cpus: int | None = None
    mem_gib: int | None = None
    ecc: tuple[int, ...] = ()
    remap: tuple[int, ...] = ()
    retire: tuple[int, ...] = ()
    foreign: tuple[Foreign, ...] = ()
    lost: tuple[int, ...] = ()
    smi_error: str | None = None
    slow: float = 0.0
    garbage: bool = False
    sm_guid: int | None = None
    subnet_prefix: int | None = None  # of every IB port's GID 0 (default fe80:0000:0000:0000)
    ib_down: tuple[int, ...] = ()
    hca_fabrics: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    driver: str | None = None  # the preset's driver version unless set

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", self.name):
            raise ValueError(f"invalid node name {self.name!r}: use letters, digits, '.', '_', '-'")
        p = PRESETS.get(self.preset)
        if p is None:
            raise ValueError(f"{self.name}: unknown preset {self.preset!r} (known: {', '.join(PRESETS)})")
        n = p.gpu_count
        for opt in ("ecc", "remap", "retire", "lost"):
            for i in getattr(self, opt):
                if not 0 <= i < n:
                    raise ValueError(f"{self.name}: {opt}={i}: preset {self.preset} has {n} GPUs")
        for f in self.foreign:
            if not 0 <= f.gpu < n:
                raise ValueError(f"{self.name}: foreign={f.gpu}: preset {self.preset} has {n} GPUs")
        cas = {nic.ca for nic in p.nics}
        for i in self.ib_down:
            if f"mlx5_{i}" not in cas:
                raise ValueError(f"{self.name}: ib_down={i}: preset {self.preset} has no mlx5_{i}")
        for ca in self.hca_fabrics:
            if ca not in cas:
                raise ValueError(f"{self.name}: hca={ca}: preset {self.preset} has no CA {ca}")
        if self.smi_error is not None and self.smi_error not in SMI_ERRORS:
            raise ValueError(f"{self.name}: smi_error must be one of {', '.join(SMI_ERRORS)}")
        if self.slow < 0:
            raise ValueError(f"{self.name}: slow must be >= 0")
        if self.driver is not None and not re.fullmatch(r"[0-9]{2,4}(?:\.[0-9]{1,4}){0,2}", self.driver):
            raise ValueError(f"{self.name}: driver={self.driver!r}: expected a version such as 418.67")
        if self.cpus is not None and self.cpus < 1:
            raise ValueError(f"{self.name}: cpus must be >= 1")
        if self.mem_gib is not None and self.mem_gib < 1:
            raise ValueError(f"{self.name}: mem_gib must be >= 1")

    @property
    def hw(self) -> Preset:
        return PRESETS[self.preset]

    @property
    def effective_cpus(self) -> int:
        return self.cpus if self.cpus is not None else self.hw.cpus

    @property
    def effective_mem_gib(self) -> int:
        return self.mem_gib if self.mem_gib is not None else self.hw.mem_gib

    def fabric_of(self, ca: str) -> str | None:
        return self.hca_fabrics.get(ca, self.fabric)

    def fabrics(self) -> set[str]:
        out = {f for f in self.hca_fabrics.values()}
        if self.fabric:
            out.add(self.fabric)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["foreign"] = [asdict(f) for f in self.foreign]
        for k in ("ecc", "remap", "retire", "lost", "ib_down"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeSpec:
        d = dict(d)
        d["foreign"] = tuple(Foreign(**f) for f in d.get("foreign") or ())
        for k in ("ecc", "remap", "retire", "lost", "ib_down"):
            d[k] = tuple(d.get(k) or ())
        return cls(**d)


_INDEX_OPTS = ("ecc", "remap", "retire", "lost", "ib_down")


def _int(name: str, opt: str, v: str) -> int:
    try:
        return int(v, 0)
    except ValueError:
        raise ValueError(f"{name}: {opt}={v!r} is not an integer") from None


def parse_node(text: str) -> NodeSpec:
    """``NAME=PRESET[:opt...]`` -> NodeSpec (see the module docstring)."""
    text = text.strip()
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"bad node spec {text!r}: expected NAME=PRESET[:option...]")
    preset, *tokens = rest.split(":")
    # Tokens without '=' continue the previous option's value (foreign=IDX:PID:NAME).
    opts: list[list[str]] = []
    for tok in tokens:
        if "=" in tok or tok == "garbage" or not opts:
            opts.append([tok])
        else:
            opts[-1].append(tok)
    return apply_options(NodeSpec(name=name.strip(), preset=preset.strip()), [":".join(o) for o in opts])


def apply_options(spec: NodeSpec, options: Iterable[str]) -> NodeSpec:
    """Return ``spec`` with ``key=value`` options applied (lists accumulate)."""
    kw: dict[str, Any] = {}
    lists: dict[str, list[Any]] = {}
    hca = dict(spec.hca_fabrics)
    labels = dict(spec.labels)
    n = spec.name
    for opt in options:
        opt = opt.strip()
        if not opt:
            continue
        key, _, val = opt.partition("=")
        key = key.strip().replace("-", "_")
        if key == "garbage":
            kw["garbage"] = val.lower() not in ("0", "no", "false") if val else True
        elif key in ("fabric", "smi_error", "driver"):
            kw[key] = val or None
        elif key in ("cpus", "mem_gib"):
            kw[key] = _int(n, key, val)
        elif key == "slow":
            try:
                kw["slow"] = float(val)
            except ValueError:
                raise ValueError(f"{n}: slow={val!r} is not a number") from None
        elif key == "sm_guid":
            kw["sm_guid"] = _int(n, key, val if val.lower().startswith("0x") else "0x" + val)
        elif key == "prefix":
            prefix = _int(n, key, val if val.lower().startswith("0x") else "0x" + val)
            if not 0 < prefix < 1 << 64:
                raise ValueError(f"{n}: prefix={val!r}: a subnet prefix is 64 bits (16 hex digits)")
            kw["subnet_prefix"] = prefix
        elif key in _INDEX_OPTS:
            lists.setdefault(key, list(getattr(spec, key))).extend(_int(n, key, v) for v in val.split("+") if v)
        elif key == "foreign":
            parts = val.split(":")
            if len(parts) < 3:
                raise ValueError(f"{n}: foreign={val!r}: expected IDX:PID:NAME[:MIB]")
            mib = DEFAULT_FOREIGN_MIB
            if len(parts) >= 4 and parts[-1].isdigit():
                mib = int(parts.pop())
            f = Foreign(_int(n, key, parts[0]), _int(n, key, parts[1]), ":".join(parts[2:]), mib)
            lists.setdefault("foreign", list(spec.foreign)).append(f)
        elif key == "hca":
            ca, _, fab = val.partition(":")
            if not ca or not fab:
                raise ValueError(f"{n}: hca={val!r}: expected CA:FABRIC (e.g. mlx5_4:ib-b)")
            hca[ca] = fab
        elif key == "label":
            k, _, v = val.partition("/")
            if not k:
                raise ValueError(f"{n}: label={val!r}: expected KEY/VALUE")
            labels[k] = v
        else:
            raise ValueError(f"{n}: unknown option {key!r}")
    for k, v in lists.items():
        kw[k] = tuple(v)
    return replace(spec, hca_fabrics=hca, labels=labels, **kw)


def _split_nodes(text: str) -> list[str]:
    # A comma starts a new node only before "NAME=", so process names may contain ", ".
    return [p for p in (s.strip() for s in re.split(r",(?=\s*[A-Za-z0-9][A-Za-z0-9._-]*=)", text)) if p]


def parse_specs(text: str | Sequence[str | NodeSpec]) -> list[NodeSpec]:
    """A comma-separated spec string (or a list of strings/NodeSpecs) -> NodeSpecs."""
    items: list[str | NodeSpec] = _split_nodes(text) if isinstance(text, str) else list(text)
    out: list[NodeSpec] = []
    for it in items:
        if isinstance(it, NodeSpec):
            out.append(it)
        else:
            out.extend(parse_node(s) for s in _split_nodes(it))
    seen: set[str] = set()
    for s in out:
        if s.name in seen:
            raise ValueError(f"duplicate node name {s.name!r}")
        seen.add(s.name)
    return out


def count_specs(count: int, preset: str, name_prefix: str = "node", start: int = 1) -> list[NodeSpec]:
    """``count`` nodes of one preset (``preset`` may carry options: ``hgx-h200x8:fabric=ib-a``)."""
    if count < 1:
        raise ValueError("count must be >= 1")
    width = max(2, len(str(start + count - 1)))
    return [parse_node(f"{name_prefix}-{i:0{width}d}={preset}") for i in range(start, start + count)]


# ---------------------------------------------------------------------------
# Rendering


@dataclass(frozen=True)
class ToolOutput:
    stdout: bytes
    rc: int = 0
    stderr: bytes = b""


def _h(*parts: object) -> str:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).hexdigest()


def gpu_uuid(node: str, idx: int) -> str:
    a, b = _h("node", node), _h("gpu", node, idx)
    return f"GPU-{a[:8]}-{b[:4]}-{b[4:8]}-{b[8:12]}-{b[12:24]}"


def pci_bus_id(bus: int) -> str:
    return f"00000000:{bus:02X}:00.0"


def fabric_sm_guid(fabric: str) -> int:
    """Master SM port GUID of a fabric: same name -> same GUID (a Mellanox switch GUID)."""
    return (0x98039B << 40) | (0x0300 << 24) | (int(_h("sm", fabric), 16) & 0xFFFFFF)


def fabric_sm_lid(fabric: str) -> int:
    return 1 + int(_h("smlid", fabric), 16) % 90  # node LIDs start at 100: never equal


IMPLICIT_FABRIC = "default"  # IB ports of nodes without fabric= sit on this one


def port_guid(spec: NodeSpec, index: int, nic: Nic) -> int:
    mix = int(_h("guid", spec.name), 16) & 0xFF
    low = (mix << 16) | ((index & 0xFFF) << 4) | (nic.ca_index & 0xF)
    return (0x58A2E1 << 40) | (0x0300 << 24) | low


def _gpu_fields(spec: NodeSpec, i: int) -> dict[str, str]:
    hw = spec.hw
    g = hw.gpu
    assert g is not None
    used = g.idle_used_mib + sum(f.used_mib for f in spec.foreign if f.gpu == i)
    serial = str(1650000000000 + int(_h("serial", spec.name, i), 16) % 10**10)
    bus = pci_bus_id(hw.bus_ids[i])
    v = {
        "index": str(i),
        "uuid": gpu_uuid(spec.name, i),
        "name": g.product,
        "memory.total": str(g.memory_mib),
        "memory.used": str(used),
        "memory.free": str(max(0, g.memory_mib - used)),
        "memory.reserved": "0",
        "pci.bus_id": bus,
        "ecc.errors.uncorrected.volatile.total": ECC_FAULT_COUNT if i in spec.ecc else g.ecc,
        "ecc.errors.uncorrected.aggregate.total": ECC_FAULT_COUNT if i in spec.ecc else g.ecc,
        "ecc.mode.current": "Disabled" if g.ecc == "[N/A]" else "Enabled",
        "mig.mode.current": g.mig,
        "mig.mode.pending": g.mig,
        "retired_pages.pending": "Yes" if i in spec.retire else g.retired,
        "remapped_rows.pending": "Yes" if i in spec.remap else g.remapped,
        "remapped_rows.failure": "No" if g.remapped != "[N/A]" else "[N/A]",
        "driver_version": spec.driver or hw.driver,
        "compute_cap": g.compute_cap,
        "serial": serial,
        "count": str(hw.gpu_count),
        "persistence_mode": "Enabled",
        "pstate": "P0",
        "temperature.gpu": str(30 + int(_h("t", spec.name, i), 16) % 8),
        "utilization.gpu": "100" if any(f.gpu == i for f in spec.foreign) else "0",
        "utilization.memory": "0",
        "power.limit": g.power_limit,
    }
    aliases = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "gpu_serial": "serial"}
    for a, t in aliases.items():
        v[a] = v[t]
    if int((spec.driver or hw.driver).split(".")[0]) < 450:
        # MIG and row remapping came with the A100 (R450): an older nvidia-smi does not know
        # these fields and refuses a query that names one.
        v = {k: x for k, x in v.items() if not k.startswith(("mig.", "remapped_rows."))}
    return v


_MIB_FIELDS = {"memory.total", "memory.used", "memory.free", "memory.reserved", "used_memory", "used_gpu_memory"}
_UNITS = {"power.limit": "W", "utilization.gpu": "%", "utilization.memory": "%"}


def _fmt_csv(fields: Sequence[str], rows: list[dict[str, str]], header: bool, units: bool) -> str:
    def unit(f: str) -> str:
        return "MiB" if f in _MIB_FIELDS else _UNITS.get(f, "")

    lines = []
    if header:
        names = ["used_gpu_memory" if f == "used_memory" else f for f in fields]
        lines.append(", ".join(f"{n} [{unit(f)}]" if unit(f) else n for n, f in zip(names, fields, strict=True)))
    for r in rows:
        cells = []
        for f in fields:
            val = r[f]
            if units and unit(f) and not val.startswith("["):
                val = f"{val} {unit(f)}"
            cells.append(val)
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines)


def _lost_line(spec: NodeSpec, i: int) -> str:
    bus = spec.hw.bus_ids[i]
    return (
        f"Unable to determine the device handle for GPU 0000:{bus:02X}:00.0: "
        "GPU is lost. Reboot the system to recover this GPU\n"
    )


def _parse_format(arg: str) -> tuple[bool, bool] | None:
    opts = arg.split(",")
    if opts[0] != "csv" or any(o not in ("noheader", "nounits") for o in opts[1:]):
        return None
    return ("noheader" not in opts, "nounits" not in opts)


_INVALID_ARGS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"


def nvidia_smi(spec: NodeSpec, args: Sequence[str]) -> ToolOutput:
    """What ``nvidia-smi ARGS`` prints on this node (garbage/missing handled by the caller)."""
    hw = spec.hw
    if hw.gpu is None:
        return ToolOutput(b"", 127, b"bash: line 1: nvidia-smi: command not found\n")
    if spec.smi_error:
        text, rc = SMI_ERRORS[spec.smi_error]
        return ToolOutput(text.encode(), rc)
    args = list(args)
    lost_rc = LOST_RC if spec.lost else 0
    if args == ["-L"]:
        out = []
        for i in range(hw.gpu_count):
            if i in spec.lost:
                out.append(_lost_line(spec, i))
            else:
                out.append(f"GPU {i}: {hw.gpu.product} (UUID: {gpu_uuid(spec.name, i)})\n")
        return ToolOutput("".join(out).encode(), lost_rc)
    if args == ["topo", "-m"]:
        if spec.lost:
            return ToolOutput("".join(_lost_line(spec, i) for i in spec.lost).encode(), LOST_RC)
        return ToolOutput(render_topo(hw).encode())
    if len(args) == 2 and args[0].startswith(("--query-gpu=", "--query-compute-apps=")):
        fmt = _parse_format(args[1].removeprefix("--format=")) if args[1].startswith("--format=") else None
        if fmt is None:
            return ToolOutput(_INVALID_ARGS.encode(), 2)
        header, units = fmt
        kind, _, flist = args[0].partition("=")
        fields = flist.split(",")
        if kind == "--query-gpu":
            rows = [_gpu_fields(spec, i) for i in range(hw.gpu_count)]
            for f in fields:
                if f not in rows[0]:
                    return ToolOutput(f'Field "{f}" is not a valid field to query.\n\n'.encode(), 2)
            out = ""
            if header:
                out = _fmt_csv(fields, [], True, units)
            for i, r in enumerate(rows):
                out += _lost_line(spec, i) if i in spec.lost else _fmt_csv(fields, [r], False, units)
            return ToolOutput(out.encode(), lost_rc)
        apps = []
        for f in spec.foreign:
            if f.gpu in spec.lost:
                continue
            g = _gpu_fields(spec, f.gpu)
            apps.append(
                {
                    "gpu_uuid": g["uuid"],
                    "gpu_name": g["name"],
                    "gpu_bus_id": g["pci.bus_id"],
                    "gpu_serial": g["serial"],
                    "pid": str(f.pid),
                    "process_name": f.name,
                    "name": f.name,
                    "used_memory": str(f.used_mib),
                    "used_gpu_memory": str(f.used_mib),
                    "timestamp": "2025/01/01 00:00:00.000",
                }
            )
        valid = set(apps[0]) if apps else set(APP_FIELDS) | {"gpu_name", "gpu_bus_id", "gpu_serial", "name"}
        valid |= {"used_gpu_memory", "timestamp"}
        for f in fields:
            if f not in valid:
                return ToolOutput(f'Field "{f}" is not a valid field to query.\n\n'.encode(), 2)
        lost = "".join(_lost_line(spec, i) for i in spec.lost)
        return ToolOutput((lost + _fmt_csv(fields, apps, header, units)).encode(), lost_rc)
    return ToolOutput(_INVALID_ARGS.encode(), 2, b"(testbed: these nvidia-smi arguments are not simulated)\n")


_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def render_topo(hw: Preset) -> str:
    """``nvidia-smi topo -m`` in the tab-separated format of the HGX H200 capture."""
    n = hw.gpu_count
    nics = sorted(hw.nics, key=lambda x: x.ca_index)
    nvl: dict[tuple[int, int], str] = {}
    for grp in hw.nvlink_groups:
        for a in grp:
            for b in grp:
                nvl[(a, b)] = hw.nvlink_token

    def gg(a: int, b: int) -> str:
        if a == b:
            return " X "
        if (a, b) in nvl:
            return nvl[(a, b)]
        return hw.pcie_same_numa if hw.gpu_numa[a] == hw.gpu_numa[b] else "SYS"

    def gn(g: int, nic: Nic) -> str:
        if nic.pix_gpu == g:
            return "PIX"
        return "NODE" if hw.gpu_numa[g] == nic.numa else "SYS"

    def nn(a: Nic, b: Nic) -> str:
        if a is b:
            return " X "
        if a.card is not None and a.card == b.card:
            return "PIX"
        return "NODE" if a.numa == b.numa else "SYS"

    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(len(nics))]
    lines = ["\t" + "\t".join([*cols, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for g in range(n):
        cells = [gg(g, b) for b in range(n)] + [gn(g, nic) for nic in nics]
        numa = hw.gpu_numa[g]
        lines.append("\t".join([f"GPU{g}", *cells, hw.numa_cpus[numa], str(numa), "", "N/A"]))
    for k, nic in enumerate(nics):
        cells = [gn(g, nic) for g in range(n)] + [nn(nic, o) for o in nics]
        lines.append("\t".join([f"NIC{k}", *cells, "", "", "", ""]))
    out = "\n".join(lines) + "\n" + _LEGEND
    if nics:
        out += "\nNIC Legend:\n\n" + "".join(f"  NIC{k}: {nic.ca}\n" for k, nic in enumerate(nics))
    return out + "\n"


def _ca_block(spec: NodeSpec, index: int, nic: Nic) -> str:
    hw = spec.hw
    guid = port_guid(spec, index, nic)
    sys_guid = guid
    if nic.card is not None:
        first = min((x for x in hw.nics if x.card == nic.card), key=lambda x: x.ca_index)
        sys_guid = port_guid(spec, index, first)
    lines = [
        f"CA '{nic.ca}'",
        f"\tCA type: {nic.ca_type}",
        "\tNumber of ports: 1",
        f"\tFirmware version: {nic.firmware}",
        "\tHardware version: 0",
        f"\tNode GUID: 0x{guid:016x}",
        f"\tSystem image GUID: 0x{sys_guid:016x}",
        "\tPort 1:",
    ]
    if nic.link_layer == "Ethernet":
        port = ["Active", "LinkUp", nic.rate, "0", "0", "0", "0x00010000", "0x0000000000000000"]
    elif nic.ca_index in spec.ib_down:
        port = ["Down", "Polling", "10", "0", "0", "0", "0xa751e848", f"0x{guid:016x}"]
    else:
        fab = spec.fabric_of(nic.ca) or IMPLICIT_FABRIC
        lid = 100 + index * 16 + nic.ca_index
        port = ["Active", "LinkUp", nic.rate, str(lid), "0", str(fabric_sm_lid(fab)), "0xa751e848", f"0x{guid:016x}"]
    keys = ["State", "Physical state", "Rate", "Base lid", "LMC", "SM lid", "Capability mask", "Port GUID"]
    lines += [f"\t\t{k}: {v}" for k, v in zip(keys, port, strict=True)]
    lines.append(f"\t\tLink layer: {nic.link_layer}")
    return "".join(line + "\n" for line in lines)


def ibstat(spec: NodeSpec, index: int, args: Sequence[str] = ()) -> ToolOutput:
    hw = spec.hw
    if not hw.nics:
        return ToolOutput(b"", 127, b"bash: line 1: ibstat: command not found\n")
    nics = sorted(hw.nics, key=lambda x: x.ca)  # ibstat sorts names as strings (mlx5_10 < mlx5_2)
    args = list(args)
    if not args:
        return ToolOutput("".join(_ca_block(spec, index, x) for x in nics).encode())
    if args == ["-l"]:
        return ToolOutput("".join(x.ca + "\n" for x in nics).encode())
    if args == ["-p"]:
        guids = [port_guid(spec, index, x) for x in nics if x.link_layer == "InfiniBand"]
        return ToolOutput("".join(f"0x{g:016x}\n" for g in guids).encode())
    if len(args) == 1:
        for x in nics:
            if x.ca == args[0]:
                return ToolOutput(_ca_block(spec, index, x).encode())
        msg = f"ibstat: iberror: failed: can't find local CA {args[0]}\n"
        return ToolOutput(msg.encode(), 255)
    return ToolOutput(b"", 255, b"(testbed: these ibstat arguments are not simulated)\n")


def sminfo(spec: NodeSpec, ca: str, port: int) -> ToolOutput:
    """``sminfo -C CA -P PORT``: the master SM as seen through that port."""
    hw = spec.hw
    nic = next((x for x in hw.nics if x.ca == ca), None)
    if not hw.nics:
        return ToolOutput(b"", 127, b"bash: line 1: sminfo: command not found\n")
    if nic is None or port != 1 or nic.link_layer != "InfiniBand":
        return ToolOutput(
            f"sminfo: iberror: failed: Failed to open '{ca}' port '{port}'\n".encode(),
            255,
            f"ibwarn: [4242] mad_rpc_open_port: can't open UMAD port ({ca}:{port})\n".encode(),
        )
    if nic.ca_index in spec.ib_down:
        return ToolOutput(
            b"sminfo: iberror: failed: query\n",
            255,
            b"ibwarn: [4242] mad_rpc: _do_madrpc failed; dport (Lid 0)\n",
        )
    fab = spec.fabric_of(ca) or IMPLICIT_FABRIC
    guid = spec.sm_guid if spec.sm_guid is not None else fabric_sm_guid(fab)
    act = 10000 + int(_h("act", fab), 16) % 90000
    line = (
        f"sminfo: sm lid {fabric_sm_lid(fab)} sm guid 0x{guid:x}, activity count {act} "
        "priority 14 state 3 SMINFO_MASTER\n"
    )
    return ToolOutput(line.encode())


DEFAULT_SUBNET_PREFIX = 0xFE80_0000_0000_0000


def sysfs_gids(spec: NodeSpec, index: int) -> dict[str, str]:
    """``/sys/class``-relative path -> content of each InfiniBand port's ``gids/0``
    (subnet prefix, then the port GUID), as a real HCA's sysfs shows it."""
    prefix = spec.subnet_prefix if spec.subnet_prefix is not None else DEFAULT_SUBNET_PREFIX
    out = {}
    for nic in spec.hw.nics:
        if nic.link_layer != "InfiniBand":
            continue
        gid = (prefix << 64) | port_guid(spec, index, nic)
        text = ":".join(f"{(gid >> (16 * i)) & 0xFFFF:04x}" for i in range(7, -1, -1))
        out[f"infiniband/{nic.ca}/ports/1/gids/0"] = text + "\n"
    return out


def meminfo(spec: NodeSpec) -> str:
    """A plausible /proc/meminfo whose MemTotal is exactly mem_gib GiB."""
    total = spec.effective_mem_gib * 1024 * 1024
    free = total * 88 // 100
    vals: list[tuple[str, int | None]] = [
        ("MemTotal", total),
        ("MemFree", free),
        ("MemAvailable", total * 95 // 100),
        ("Buffers", total // 200),
        ("Cached", total * 6 // 100),
        ("SwapCached", 0),
        ("Active", total * 4 // 100),
        ("Inactive", total * 3 // 100),
        ("Active(anon)", total // 100),
        ("Inactive(anon)", total // 400),
        ("Active(file)", total * 3 // 100),
        ("Inactive(file)", total * 2 // 100),
        ("Unevictable", 0),
        ("Mlocked", 0),
        ("SwapTotal", 0),
        ("SwapFree", 0),
        ("Dirty", 120),
        ("Writeback", 0),
        ("AnonPages", total // 80),
        ("Mapped", total // 500),
        ("Shmem", total // 900),
        ("KReclaimable", total // 150),
        ("Slab", total // 120),
        ("SReclaimable", total // 150),
        ("SUnreclaim", total // 700),
        ("KernelStack", 65536),
        ("PageTables", total // 4000),
        ("CommitLimit", total // 2),
        ("Committed_AS", total // 20),
        ("VmallocTotal", 34359738367),
        ("VmallocUsed", 0),
        ("VmallocChunk", 0),
        ("HardwareCorrupted", 0),
        ("AnonHugePages", 0),
        ("HugePages_Total", None),
        ("HugePages_Free", None),
        ("HugePages_Rsvd", None),
        ("HugePages_Surp", None),
        ("Hugepagesize", 2048),
        ("Hugetlb", 0),
    ]
    out = []
    for k, v in vals:
        if k == "HardwareCorrupted":
            out.append(f"{k}: {v:>5} kB\n")
        elif v is None:
            out.append(f"{k + ':':<16}{0:>8}\n")
        else:
            out.append(f"{k + ':':<16}{v:>8} kB\n")
    return "".join(out)


def garbage_output(tool: str, spec: NodeSpec) -> ToolOutput:
    seed = _h("junk", spec.name, tool)[:12]
    junk: dict[str, bytes] = {
        "gpus": (
            f"0, GPU-{seed}, NVIDIA H200, 143771 MiB, [Unknown Error], 00000000:18:00\n"
            "\x1b[31mNVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.\x1b[0m\n"
            "1, , , , , , , , , , , , , ,\n"
            "two, GPU-, NVIDIA, -5, abc, ZZ:ZZ, many, Maybe, , \n"
        ).encode()
        + b"\xff\xfe\xfa binary \x00 tail\n",
        "apps": f"{seed}, ???, , ,\n, , , , , ,\nGPU-xyz, -1, lots, \n".encode(),
        "list": f"GPU ?: (UUID: {seed})\n".encode(),
        "topo": b"\tGPU0\tGPU?\tCPU\nGPU0\t X \tNV??\nGPU9\tSYS\t\t\t\nLegend: (truncated\n",
        "ibstat": f"CA 'mlx5_\n\tPort x:\n\t\tState: ???\n\t\tRate: fast\n\t\tPort GUID: 0x{seed}zz\n".encode(),
        "sminfo": f"sminfo: sm lid ?? sm guid 0x{seed}zz, activity count -1\n".encode(),
        "nproc": b"lots\n",
        "meminfo": b"MemTotal: lots kB\nMemFree:\n-1 kB\n",
    }
    return ToolOutput(junk[tool])


@dataclass(frozen=True)
class Rendered:
    """All pre-rendered outputs of one node.

    ``tools[tool][argstring]`` is what ``tool ARGS`` prints (argstring = ``" ".join(args)``);
    ``missing`` lists the tools that do not exist on the node (``command not found``).
    ``meminfo`` is the node's /proc/meminfo.
    """

    spec: NodeSpec
    index: int
    tools: dict[str, dict[str, ToolOutput]]
    missing: tuple[str, ...]
    meminfo: ToolOutput
    sysfs: dict[str, str] = field(default_factory=dict)  # /sys/class-relative path -> content

    def expected(self, command: str) -> ToolOutput:
        """What a probe command line (as in ``cluster_cli.probe.commands``) returns."""
        cmd = command.removeprefix("LC_ALL=C ").strip()
        if cmd == "cat /proc/meminfo":
            return self.meminfo
        tool, _, args = cmd.partition(" ")
        if tool in self.missing:
            return ToolOutput(b"", 127, f"bash: line 1: {tool}: command not found\n".encode())
        try:
            return self.tools[tool][args]
        except KeyError:
            raise KeyError(f"{self.spec.name}: {command!r} is not pre-rendered") from None


def _probe_args(key: str) -> str:
    return PROBES[key].removeprefix("LC_ALL=C ").split(" ", 1)[1] if " " in PROBES[key] else ""


def render(spec: NodeSpec, index: int) -> Rendered:
    """Pre-render every command the probe runs (plus a few handy extras) for one node."""
    hw = spec.hw
    tools: dict[str, dict[str, ToolOutput]] = {}
    missing: list[str] = []
    g = spec.garbage
    if hw.gpu is None:
        missing.append("nvidia-smi")
    else:
        smi: dict[str, ToolOutput] = {}
        for key, junk in (("gpus", "gpus"), ("apps", "apps"), ("topo", "topo")):
            a = _probe_args(key)
            smi[a] = garbage_output(junk, spec) if g else nvidia_smi(spec, a.split(" "))
        smi["-L"] = garbage_output("list", spec) if g else nvidia_smi(spec, ["-L"])
        tools["nvidia-smi"] = smi
    if not hw.nics:
        missing += ["ibstat", "sminfo"]
    else:
        ib: dict[str, ToolOutput] = {}
        for a in ("", "-l", "-p"):
            ib[a] = garbage_output("ibstat", spec) if g else ibstat(spec, index, a.split())
        for nic in hw.nics:
            ib[nic.ca] = garbage_output("ibstat", spec) if g else ibstat(spec, index, [nic.ca])
        tools["ibstat"] = ib
        sm: dict[str, ToolOutput] = {}
        for nic in hw.nics:
            a = sminfo_command(nic.ca, 1).split(" ", 1)[1]
            sm[a] = garbage_output("sminfo", spec) if g else sminfo(spec, nic.ca, 1)
        tools["sminfo"] = sm
    n = f"{spec.effective_cpus}\n".encode()
    tools["nproc"] = {a: garbage_output("nproc", spec) if g else ToolOutput(n) for a in ("--all", "")}
    mem = garbage_output("meminfo", spec) if g else ToolOutput(meminfo(spec).encode())
    return Rendered(spec, index, tools, tuple(missing), mem, sysfs_gids(spec, index))


def gpu_classes(specs: Iterable[NodeSpec]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in specs:
        g = s.hw.gpu
        if g is not None and g.product not in out.setdefault(g.gpu_class, []):
            out[g.gpu_class].append(g.product)
    return out


def describe_presets() -> str:
    return "\n".join(f"{p.name:<14} {p.description}" for p in PRESETS.values())


def spec_json(spec: NodeSpec, index: int) -> str:
    return json.dumps({"index": index, "spec": spec.to_dict()}, indent=1)
