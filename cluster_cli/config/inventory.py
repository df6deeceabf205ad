"""The inventory: which nodes exist and how to reach them over SSH.

```yaml
defaults: {user: root, port: 22, identity_file: ~/.ssh/id_ed25519, known_hosts: ~/.ssh/known_hosts}
ssh_config: ~/.ssh/config
gpu_classes: {H100: ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"]}
fabrics: {ib-a: {}, ib-b: {}}
nodes:
  - {name: gpu-01, host: 10.0.0.11, fabric: ib-a, hca_fabrics: {mlx5_4: ib-b}, labels: {rack: r1}}
```

Relative paths are resolved against the inventory file's folder; ``~`` is expanded.
``known_hosts: accept-new`` trusts a node's key on first use and pins it in a file beside
the state, named after it (``.clusterctl/state.known_hosts``); left unset, known_hosts is
``~/.ssh/known_hosts`` and the system's ``/etc/ssh/ssh_known_hosts``, as OpenSSH reads
them. Host keys are never left unchecked.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from cluster_cli.config.load import load_model
from cluster_cli.facts import UNREAD, prefix_text, prefix_value

ACCEPT_NEW = "accept-new"
# Where OpenSSH looks for host keys besides the user's file (GlobalKnownHostsFile): fleets
# often distribute their nodes' keys there. Used only while known_hosts is left unset.
SYSTEM_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # fullmatch: "$" matches before a final newline


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SSHDefaults(_Strict):
    # Unset user/port/identity_file leave the choice to ssh_config (if any), then to SSH's
    # own defaults (the local user, port 22, the usual ~/.ssh keys).
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535, strict=True)  # not `true` read as 1
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, strict=True)
    command_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, strict=True)
    # Where engines run: the HTTP ports 'up' hands out on each node, and the per-replica folders.
    ports: str = "8100-8999"
    run_dir: str = "~/.clusterctl/run"
    # The size a shard's log may reach before it is kept as log.1 and emptied (copytruncate).
    log_max_mib: float = Field(default=64.0, gt=0, allow_inf_nan=False, strict=True)
    # Commands open at once on one SSH connection: under the node sshd's MaxSessions (10 by default).
    max_channels: int = Field(default=8, gt=0, strict=True)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: str) -> str:
        port_range(v)
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str) -> str:
        return _check_run_dir(v)


def port_range(v: str) -> tuple[int, int]:
    """``"8100-8999"`` (or one port, ``"8100"``) as (low, high). Raises ValueError."""
    lo, sep, hi = str(v).partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"ports: {v!r} is not a range like 8100-8999") from None
    if not (1 <= a <= b <= 65535):
        raise ValueError(f"ports: {v!r}: give LOW-HIGH with 1 <= LOW <= HIGH <= 65535")
    return a, b


def _check_run_dir(v: str) -> str:
    # It is in the start script's error lines: a control character (\r too) would garble them.
    if not v or not v.isprintable():
        raise ValueError("run_dir: give a folder path (no newline, NUL or other control character)")
    if not (v.startswith("/") or v == "~" or v.startswith("~/")):
        raise ValueError(f"run_dir: {v!r}: give an absolute path or one under ~/ (the node user's home)")
    return v


class Fabric(_Strict):
    description: str | None = None
    # The subnet prefix its SM hands out (opensm's subnet_prefix): "fec0:0000:0000:0001" or
    # "0xfec0000000000001". A port on this fabric showing another one is a conflict.
    subnet_prefix: str | None = None

    @field_validator("subnet_prefix", mode="before")
    @classmethod
    def _prefix(cls, v: object) -> str | None:
        # Any spelling prefix_value takes (YAML reads an unquoted 0xfec0... as a number); kept
        # in the four-group form.
        try:
            value = prefix_value(v)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("subnet_prefix: ")) from None
        return None if value is None else prefix_text(value)

    @property
    def prefix(self) -> int | None:
        return prefix_value(self.subnet_prefix)


class Node(_Strict):
    name: str
    host: str
    port: int | None = Field(default=None, ge=1, le=65535, strict=True)  # not `true` read as 1
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None
    fabric: str | None = None
    hca_fabrics: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    ports: str | None = None  # overrides defaults.ports
    run_dir: str | None = None  # overrides defaults.run_dir
    # overrides defaults.log_max_mib
    log_max_mib: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    max_channels: int | None = Field(default=None, gt=0, strict=True)  # overrides defaults.max_channels

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: str | None) -> str | None:
        if v is not None:
            port_range(v)
        return v

    @field_validator("run_dir")
    @classmethod
    def _run_dir(cls, v: str | None) -> str | None:
        return None if v is None else _check_run_dir(v)

    @field_validator("host")
    @classmethod
    def _host_ok(cls, v: str) -> str:
        if not v or any(c.isspace() for c in v):
            raise ValueError(f"invalid host {v!r}: a name or address without spaces")
        if ":" in v:  # only an IPv6 address has colons: "10.0.0.1:22" is a port in the wrong place
            bare = v[1:-1] if v.startswith("[") and v.endswith("]") else v
            try:
                ipaddress.IPv6Address(bare)
            except ValueError:
                raise ValueError(f"invalid host {v!r}: give the port as port:, not in host:") from None
            return bare  # "[::1]" is how a URL or known_hosts writes it; the address is "::1"
        return v

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if len(v) > 63:
            raise ValueError(f"invalid node name {v[:20]!r}...: {len(v)} characters, at most 63")
        if not _NAME.fullmatch(v):
            raise ValueError(
                f"invalid node name {v!r}: use letters, digits, '.', '_', '-' (starting with a letter or digit)"
            )
        return v


class Inventory(_Strict):
    defaults: SSHDefaults = Field(default_factory=SSHDefaults)
    ssh_config: str | None = None
    gpu_classes: dict[str, list[str]] = Field(default_factory=dict)
    fabrics: dict[str, Fabric | None] = Field(default_factory=dict)
    nodes: list[Node] = Field(default_factory=list)
    # Not part of the YAML (a key of that name is unknown, as any other): the folder
    # relative paths are resolved against.
    _base_dir: str = PrivateAttr(default=".")

    @property
    def base_dir(self) -> str:
        return self._base_dir

    @model_validator(mode="after")
    def _check(self) -> Inventory:
        seen: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            if n.name in seen:
                raise ValueError(f"nodes.{i}.name: duplicate node name {n.name!r} (also nodes.{seen[n.name]})")
            seen[n.name] = i
            declared = [("fabric", n.fabric)] + [(f"hca_fabrics.{k}", v) for k, v in n.hca_fabrics.items()]
            for field, fab in declared:
                if fab is not None and self.fabrics and fab not in self.fabrics:
                    raise ValueError(
                        f"nodes.{i}.{field}: unknown fabric {fab!r} (declared: {', '.join(sorted(self.fabrics))})"
                    )
        products: dict[str, str] = {}
        for cls_name, names in self.gpu_classes.items():
            if cls_name.strip() == UNREAD or not cls_name.strip():
                # "unknown" marks lost GPUs (nvidia-smi could not read them): a real class of
                # that name would make a lost GPU look like one of its own.
                what = "is reserved for lost GPUs" if cls_name.strip() else "is empty"
                raise ValueError(f"gpu_classes.{cls_name}: the class name {cls_name!r} {what}")
            for p in names:
                if p in products and products[p] != cls_name:
                    raise ValueError(f"gpu_classes: {p!r} is listed under both {products[p]!r} and {cls_name!r}")
                products[p] = cls_name
        if not self.nodes:
            raise ValueError("nodes: the inventory lists no nodes")
        return self

    # ---- resolved views -------------------------------------------------
    def address(self, n: Node) -> tuple[str, int | None]:
        """(host, port) of ``n`` as the inventory writes them: the host in lower case (names
        are case-insensitive), the port from the node, else ``defaults``, else 22 (None when
        ``ssh_config`` may still set it)."""
        port = n.port or self.defaults.port or (None if self.ssh_config else 22)
        return n.host.lower(), port

    def shared_addresses(self) -> list[tuple[int, str]]:
        """(index, message) of each node whose host and port an earlier node has: one machine
        under two names, probed twice. A warning, not an error: inventories for ``place
        --facts`` may use placeholder hosts, and placement itself takes a GPU UUID seen on two
        nodes once. Compared as written (an ssh_config alias is not resolved): a port left
        unset is 22 unless ssh_config may set it, and then it only matches another unset port."""
        first: dict[tuple[str, int | None], str] = {}
        out: list[tuple[int, str]] = []
        for i, n in enumerate(self.nodes):
            address = self.address(n)
            if address in first:
                out.append((i, f"{_show_address(address)} is also node {first[address]}'s"))
            else:
                first[address] = n.name
        return out

    def port_range(self, n: Node) -> tuple[int, int]:
        """The HTTP ports ``up`` may hand out on ``n``."""
        return port_range(n.ports or self.defaults.ports)

    def run_dir(self, n: Node) -> str:
        """The folder on ``n`` that holds its replicas' folders (``~/`` is the node user's home)."""
        return n.run_dir or self.defaults.run_dir

    def log_max_mib(self, n: Node) -> float:
        """The size (MiB) a shard's log on ``n`` may reach before it is trimmed."""
        return n.log_max_mib if n.log_max_mib is not None else self.defaults.log_max_mib

    def log_max_bytes(self, n: Node) -> int:
        """``log_max_mib`` in bytes (at least one)."""
        return max(1, int(self.log_max_mib(n) * (1 << 20)))

    def node(self, name: str) -> Node | None:
        return next((n for n in self.nodes if n.name == name), None)

    def resolve_path(self, p: str | None) -> str | None:
        if p is None:
            return None
        expanded = os.path.expanduser(p)
        if os.path.isabs(expanded):
            return expanded
        return str(Path(self.base_dir) / expanded)

    def ssh_target(self, n: Node) -> SSHTarget:
        d = self.defaults
        kh = n.known_hosts or d.known_hosts
        unset = n.known_hosts is None and "known_hosts" not in d.model_fields_set
        return SSHTarget(
            name=n.name,
            host=n.host,
            port=n.port or d.port,
            user=n.user or d.user,
            identity_file=self.resolve_path(n.identity_file or d.identity_file),
            known_hosts=kh if kh == ACCEPT_NEW else self.resolve_path(kh),
            ssh_config=self.resolve_path(self.ssh_config),
            system_known_hosts=SYSTEM_KNOWN_HOSTS if unset else None,
            connect_timeout_s=d.connect_timeout_s,
            command_timeout_s=d.command_timeout_s,
            max_channels=n.max_channels or d.max_channels,
        )

    def gpu_class(self, product: str) -> str:
        """The alias whose list names ``product``, else the product without 'NVIDIA '."""
        for cls_name, names in self.gpu_classes.items():
            if product in names:
                return cls_name
        return product.removeprefix("NVIDIA ").strip()

    def declared_prefixes(self) -> dict[str, int]:
        """Fabric name -> the subnet prefix the inventory declares for it (only those that do)."""
        return {name: p for name, f in self.fabrics.items() if f is not None and (p := f.prefix) is not None}

    def fabric_for(self, n: Node, ca: str) -> str | None:
        return n.hca_fabrics.get(ca, n.fabric)


def _show_address(address: tuple[str, int | None]) -> str:
    host, port = address
    if port is None:
        return host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class SSHTarget(BaseModel):
    """Everything needed to open one SSH connection, paths already resolved."""

    model_config = ConfigDict(frozen=True)

    name: str
    host: str
    port: int | None
    user: str | None
    identity_file: str | None
    known_hosts: str
    ssh_config: str | None = None
    # The system's known_hosts, also trusted when the inventory leaves known_hosts unset.
    system_known_hosts: str | None = None
    connect_timeout_s: float = 10.0
    command_timeout_s: float = 30.0
    max_channels: int | None = None  # unset: the connector's own default


def load_inventory(path: Path | str) -> Inventory:
    path = Path(path)
    inv = load_model(path, Inventory)
    inv._base_dir = str(path.resolve().parent)
    return inv
