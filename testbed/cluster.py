"""A testbed: nodes, their network, keys, inventory and on-disk state.

Network (``netns`` mode, root): one shared bridge ``ctlbr0`` = 198.18.0.1/24 on the host;
each node gets a network namespace ``<prefix>-<name>`` and a veth pair (host end
``<prefix>v<i>`` on the bridge, node end ``eth0`` = 198.18.0.N/24, no default route, no
IPv6). Node addresses come from 198.18.0.10-254, shared by every testbed on the machine
through a small registry in ``/run/clusterctl-testbed`` (flock): 245 nodes in total, so keep
all testbeds together under ~200 nodes. The bridge is created by the first testbed and
removed by the last one.

``loopback`` mode (no root / no namespaces): sshd on 127.0.0.1 with distinct ports.
``partition`` then degrades to "freeze" (connections hang; documented).

Names are unique per DIR: ``prefix = "tb" + sha1(realpath(DIR))[:5]``.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from testbed.hardware import IMPLICIT_FABRIC, NodeSpec, Rendered, fabric_sm_guid, gpu_classes, parse_specs, render
from testbed.node import Node, alive, all_pids, cmdline, find_sshd, marked_prefix, ssh_banner

BRIDGE = "ctlbr0"
NET = "198.18.0"
BRIDGE_IP = f"{NET}.1"
FIRST_HOST, LAST_HOST = 10, 254
RUN_DIR = Path("/run/clusterctl-testbed")
STATE_FILE = "testbed.json"
INVENTORY_FILE = "inventory.yaml"
MODES = ("auto", "netns", "loopback")


class TestbedError(RuntimeError):
    """The testbed could not do what was asked; the message says why."""


# ---------------------------------------------------------------------------
# environment checks


def _cap_eff() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def netns_unavailable() -> str | None:
    """Why netns mode cannot work here (None if it can)."""
    if os.geteuid() != 0:
        return "not root"
    caps = _cap_eff()
    if not (caps >> 12) & 1 or not (caps >> 21) & 1:
        return "missing CAP_NET_ADMIN/CAP_SYS_ADMIN"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool, path="/usr/sbin:/usr/bin:/sbin:/bin") is None:
            return f"{tool} not found"
    return None


def unavailable_reason(mode: str = "auto") -> str | None:
    """Why no testbed can start in this mode (None if it can)."""
    if mode not in MODES:
        return f"unknown mode {mode!r} (use {', '.join(MODES)})"
    if find_sshd() is None:
        return "OpenSSH server not installed (sshd not found; apt-get install openssh-server)"
    if mode == "netns" and (why := netns_unavailable()):
        return f"netns mode needs root with network namespaces: {why}"
    return None


def detect_mode(mode: str = "auto") -> str:
    if mode == "auto":
        return "netns" if netns_unavailable() is None else "loopback"
    return mode


def testbed_prefix(directory: Path | str) -> str:
    return "tb" + hashlib.sha1(str(Path(directory).resolve()).encode()).hexdigest()[:5]


# ---------------------------------------------------------------------------
# small helpers


def _run(argv: Sequence[str], *, input_text: str | None = None, timeout: float = 30.0, check: bool = True) -> str:
    try:
        p = subprocess.run(list(argv), input=input_text, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"timed out after {timeout:g}s: {' '.join(argv)}") from None
    if check and p.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed (rc {p.returncode}): {p.stderr.strip()}")
    return p.stdout


def _ip_batch(lines: Sequence[str], *, netns: str | None = None, force: bool = False) -> None:
    if not lines:
        return
    argv = ["ip", *(["-n", netns] if netns else []), *(["-force"] if force else []), "-b", "-"]
    _run(argv, input_text="\n".join(lines) + "\n", timeout=60, check=not force)


@contextlib.contextmanager
def _flock(path: Path, timeout: float = 120.0) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TestbedError(f"could not lock {path} within {timeout:g}s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _sysctl_disable_ipv6(dev: str) -> None:
    p = Path(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6")
    if p.exists():
        with contextlib.suppress(OSError):
            p.write_text("1")


def _links() -> set[str]:
    try:
        return set(os.listdir("/sys/class/net"))
    except OSError:
        return set()


def _netns_names() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except OSError:
        return set()


def _keypair() -> tuple[bytes, bytes]:
    """A fresh ed25519 key pair in OpenSSH format (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    priv = k.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    pub = k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub


def _tail(path: Path, n: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:]) or "(empty log)"


# ---------------------------------------------------------------------------
# address registry (netns mode): which 198.18.0.N belongs to which testbed


def _registry_lock() -> contextlib.AbstractContextManager[None]:
    return _flock(RUN_DIR / "lock")


def _registry() -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    d = RUN_DIR / "ips"
    if d.is_dir():
        for f in d.iterdir():
            try:
                entry = json.loads(f.read_text())
                entry["_mtime"] = f.stat().st_mtime
                out[int(f.name.rsplit(".", 1)[-1])] = entry
            except (OSError, ValueError):
                continue
    return out


def _registry_drop(octet: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        (RUN_DIR / "ips" / f"{NET}.{octet}").unlink()


def _orphaned(entry: dict[str, Any]) -> bool:
    """A testbed whose folder or state file is gone (crashed test run, deleted tmp dir)."""
    d = Path(entry.get("dir", ""))
    st = d / STATE_FILE
    if not st.exists():
        return True
    try:
        return json.loads(st.read_text()).get("prefix") != entry.get("prefix")
    except (OSError, ValueError):
        return True


def _alloc_ips(prefix: str, directory: Path, names: Sequence[str]) -> dict[str, int]:
    """Claim one address per node (caller holds the registry lock)."""
    reg = _registry()
    for octet, e in list(reg.items()):
        if e.get("prefix") == prefix:
            _registry_drop(octet)
            del reg[octet]
    free = [o for o in range(FIRST_HOST, LAST_HOST + 1) if o not in reg]
    if len(free) < len(names):
        raise TestbedError(
            f"not enough addresses in {NET}.0/24: {len(names)} wanted, {len(free)} free "
            f"({len(reg)} used by other testbeds; all testbeds together are limited to "
            f"{LAST_HOST - FIRST_HOST + 1} nodes). Run `python -m testbed gc` to drop leftovers."
        )
    (RUN_DIR / "ips").mkdir(parents=True, exist_ok=True)
    out: dict[str, int] = {}
    for name, octet in zip(names, free, strict=False):
        entry = {"prefix": prefix, "dir": str(directory), "node": name, "netns": f"{prefix}-{name}"}
        (RUN_DIR / "ips" / f"{NET}.{octet}").write_text(json.dumps(entry))
        out[name] = octet
    return out


BRIDGE_MAC = "02:54:42:00:00:01"  # nodes are 02:54:42:00:00:<octet>, octets from FIRST_HOST up


def _ensure_bridge() -> None:
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        used = _run(["ip", "-4", "-o", "addr", "show", "to", f"{NET}.0/24"], check=False).strip()
        if used:
            raise TestbedError(f"{NET}.0/24 is already in use on this host: {used}")
        # A fixed address: a bridge otherwise takes the lowest MAC of its ports, and each change
        # (a node joining or leaving, any testbed's) flushes every neighbour entry on it,
        # the permanent ones that `partition` relies on included.
        _run(["ip", "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"])
        _sysctl_disable_ipv6(BRIDGE)
    if Path(f"/sys/class/net/{BRIDGE}/address").read_text().strip() != BRIDGE_MAC:  # made by an older testbed
        _run(["ip", "link", "set", BRIDGE, "address", BRIDGE_MAC])
    addrs = _run(["ip", "-4", "-o", "addr", "show", "dev", BRIDGE])
    if f" {BRIDGE_IP}/24 " not in addrs:
        _run(["ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])


def _maybe_remove_bridge() -> None:
    """Remove the shared bridge once no testbed uses it (caller holds the registry lock)."""
    brif = Path(f"/sys/class/net/{BRIDGE}/brif")
    if brif.is_dir() and not any(brif.iterdir()) and not _registry():
        _run(["ip", "link", "del", BRIDGE], check=False)


def _sshds_of(directory: Path) -> set[int]:
    """Listening sshds started for this folder (found by their config path)."""
    needle = f" -f {directory}/nodes/"
    return {p for p in all_pids() if needle in cmdline(p) and "sshd_config" in cmdline(p)}


def _teardown_prefix(
    prefix: str, nodes: Sequence[Node] = (), directory: Path | None = None, timeout: float = 10.0
) -> None:
    """Remove every trace of one testbed: processes, veths, netns, addresses, neighbours."""
    with ThreadPoolExecutor(max_workers=8) as ex:
        list(ex.map(lambda n: n.kill(timeout=5.0), [n for n in nodes if not n.killed]))
    namespaces = sorted(n for n in _netns_names() if n.startswith(prefix + "-"))
    victims: set[int] = set()
    for ns in namespaces:
        out = _run(["ip", "netns", "pids", ns], check=False, timeout=10)
        victims |= {int(p) for p in out.split() if p.isdigit()}
    victims |= marked_prefix(prefix)
    if directory is not None:
        victims |= _sshds_of(directory)
    victims.discard(os.getpid())
    for p in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in victims):
        time.sleep(0.02)
    if os.geteuid() != 0:
        return
    veths = sorted(x for x in _links() if x.startswith(prefix + "v"))
    with _registry_lock():
        reg = {o: e for o, e in _registry().items() if e.get("prefix") == prefix}
        # Separate batches: some ip errors end a batch even with -force. Flush is idempotent.
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            _ip_batch([f"neigh flush to {NET}.{o} dev {BRIDGE} nud permanent" for o in reg], force=True)
        _ip_batch([f"link del {v}" for v in veths], force=True)
        _ip_batch([f"netns del {ns}" for ns in namespaces], force=True)
        for o in reg:
            _registry_drop(o)
        while time.monotonic() < deadline and (
            any(x.startswith(prefix + "v") for x in _links()) or any(n.startswith(prefix + "-") for n in _netns_names())
        ):
            time.sleep(0.02)
        _maybe_remove_bridge()


def gc() -> list[str]:
    """Tear down testbeds whose folder or state file is gone; returns their prefixes."""
    if os.geteuid() != 0:
        return []
    with _registry_lock():
        reg = _registry()
        stale = {
            e["prefix"]: Path(e.get("dir", "/nonexistent")) for e in reg.values() if "prefix" in e and _orphaned(e)
        }
    for prefix, directory in sorted(stale.items()):
        _teardown_prefix(prefix, directory=directory)
    if os.geteuid() == 0:
        with _registry_lock():
            _maybe_remove_bridge()
    return sorted(stale)


# ---------------------------------------------------------------------------
# the cluster


class Cluster:
    """A running testbed. Create with :meth:`start`, reopen with :meth:`attach`.

    ``nodes`` maps name -> :class:`testbed.node.Node` (``.host``, ``.port``, ``.spec``,
    ``.state``). Fault injection: :meth:`kill`, :meth:`freeze`/:meth:`thaw`,
    :meth:`partition`/:meth:`heal`, :meth:`revive` (restart sshd on a killed node).
    """

    def __init__(self, directory: Path, prefix: str, mode: str, user: str, nodes: dict[str, Node]) -> None:
        self.dir = directory
        self.prefix = prefix
        self.mode = mode
        self.user = user
        self.nodes = nodes
        self._stopped = False
        self._atexit_registered = False

    # ---- paths ---------------------------------------------------------------
    @property
    def inventory_path(self) -> Path:
        return self.dir / INVENTORY_FILE

    @property
    def known_hosts_path(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def identity_file(self) -> Path:
        return self.dir / "id_ed25519"

    @property
    def state_path(self) -> Path:
        return self.dir / STATE_FILE

    # ---- lifecycle -------------------------------------------------------------
    @classmethod
    def start(
        cls,
        directory: Path | str,
        specs: str | Sequence[str | NodeSpec],
        *,
        mode: str = "auto",
        timeout: float | None = None,
        path_extra: Sequence[str] = (),
        stop_at_exit: bool = True,
    ) -> Cluster:
        """Start nodes from specs (see :mod:`testbed.hardware`), write keys + inventory, wait for sshd.

        Stale leftovers of an earlier run in the same ``directory`` are removed first.
        With ``stop_at_exit`` the nodes are torn down when the Python process exits.
        """
        if why := unavailable_reason(mode):
            raise TestbedError(why)
        mode = detect_mode(mode)
        nodespecs = parse_specs(specs)
        if not nodespecs:
            raise TestbedError("no nodes given")
        directory = Path(directory).resolve()
        if "%" in str(directory):  # sshd and ssh expand %-tokens in the paths it would write
            raise TestbedError(f"{directory}: a testbed folder must not contain '%'")
        if any(c.isspace() for c in str(directory)):  # ssh -o UserKnownHostsFile= splits on them
            raise TestbedError(f"{directory}: a testbed folder must not contain spaces")
        if directory.exists() and not directory.is_dir():
            raise TestbedError(f"{directory}: exists and is not a folder")
        directory.mkdir(parents=True, exist_ok=True)
        prefix = testbed_prefix(directory)
        timeout = timeout if timeout is not None else 20.0 + 0.5 * len(nodespecs)
        with _flock(directory / ".testbed.lock"):
            _cleanup_dir(directory, prefix)
            user = "root" if mode == "netns" else pwd.getpwuid(os.geteuid()).pw_name
            self = cls(directory, prefix, mode, user, {})
            try:
                self._start(nodespecs, timeout, tuple(path_extra))
            except BaseException:
                _teardown_prefix(prefix, list(self.nodes.values()), directory)
                with contextlib.suppress(FileNotFoundError):
                    self.state_path.unlink()
                raise
        if stop_at_exit:
            atexit.register(self._stop_at_exit)
            self._atexit_registered = True
        return self

    def _start(self, specs: list[NodeSpec], timeout: float, path_extra: tuple[str, ...]) -> None:
        t0 = time.monotonic()
        ident = self.identity_file
        if not (ident.exists() and ident.with_suffix(".pub").exists()):
            priv, pub = _keypair()
            _write_file(ident, priv, 0o600)
            _write_file(ident.with_suffix(".pub"), pub + b" clusterctl-testbed\n", 0o644)
        os.chmod(ident, 0o600)
        self._save("starting")  # a record for cleanup, written before anything is claimed
        if os.geteuid() == 0:  # sshd run as root needs its privilege separation folder (loopback mode too)
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        if self.mode == "netns":
            with _registry_lock():
                octets = _alloc_ips(self.prefix, self.dir, [s.name for s in specs])
            for i, s in enumerate(specs):
                o = octets[s.name]
                self.nodes[s.name] = Node(
                    name=s.name,
                    index=i,
                    spec=s,
                    dir=self.dir / "nodes" / s.name,
                    host=f"{NET}.{o}",
                    port=22,
                    marker=f"{self.prefix}:{s.name}",
                    netns=f"{self.prefix}-{s.name}",
                    veth=f"{self.prefix}v{i}",
                    mac=f"02:54:42:00:00:{o:02x}",
                )
            self._save("starting")
        else:
            ports = _free_ports(len(specs))
            for i, s in enumerate(specs):
                self.nodes[s.name] = Node(
                    name=s.name,
                    index=i,
                    spec=s,
                    dir=self.dir / "nodes" / s.name,
                    host="127.0.0.1",
                    port=ports[i],
                    marker=f"{self.prefix}:{s.name}",
                )
        for n in self.nodes.values():
            n.write_files(
                render(n.spec, n.index),
                authorized_keys=ident.with_suffix(".pub"),
                host_key=_keypair(),
                path_extra=path_extra,
            )
        if self.mode == "netns":
            self._setup_network()
        for n in self.nodes.values():
            n.launch()
        self._save("starting")
        self._wait_ready(list(self.nodes.values()), t0 + timeout)
        self._write_client_files()
        self._save("running")

    def _setup_network(self) -> None:
        nodes = list(self.nodes.values())
        with _registry_lock():
            _ensure_bridge()
            lines: list[str] = []
            for n in nodes:
                lines.append(f"netns add {n.netns}")
                lines.append(f"link add {n.veth} type veth peer name eth0 address {n.mac} netns {n.netns}")
            _ip_batch(lines)
            for n in nodes:
                assert n.veth
                _sysctl_disable_ipv6(n.veth)
            lines = []
            for n in nodes:
                lines += [
                    f"link set {n.veth} master {BRIDGE}",
                    f"link set {n.veth} up",
                    f"neigh replace {n.host} lladdr {n.mac} dev {BRIDGE} nud permanent",
                ]
            _ip_batch(lines)
        v6 = Path("/proc/sys/net/ipv6").exists()

        def inside(n: Node) -> None:
            cmds = ["link set lo up"]
            if v6:
                cmds.append("link set eth0 addrgenmode none")
            cmds += [f"addr add {n.host}/24 dev eth0", "link set eth0 up"]
            _ip_batch(cmds, netns=n.netns)

        with ThreadPoolExecutor(max_workers=8) as ex:
            list(ex.map(inside, nodes))

    def _wait_ready(self, nodes: list[Node], deadline: float, retry_ports: bool = True) -> None:
        def wait(n: Node) -> str | None:
            attempts = 0
            while True:
                if ssh_banner(n.host, n.port, timeout=1.0):
                    n.resolve()
                    return None
                rc = n.launcher_exited()
                if rc is not None:
                    log = _tail(n.log_path)
                    if n.mode == "loopback" and retry_ports and "Bind to port" in log and attempts < 3:
                        attempts += 1
                        n.port = _free_ports(1)[0]
                        n.config_path.write_text(
                            "\n".join(
                                f"Port {n.port}" if line.startswith("Port ") else line
                                for line in n.config_path.read_text().splitlines()
                            )
                            + "\n"
                        )
                        n.launch()
                        continue
                    return f"{n.name}: sshd exited (rc {rc}): {log}"
                if time.monotonic() > deadline:
                    return f"{n.name}: sshd not answering on {n.host}:{n.port}: {_tail(n.log_path)}"
                time.sleep(0.05)

        with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as ex:
            errors = [e for e in ex.map(wait, nodes) if e]
        if errors:
            raise TestbedError("nodes failed to start: " + "; ".join(errors[:5]))

    def _write_client_files(self) -> None:
        kh = []
        for n in self.nodes.values():
            pub = n.host_key_path.with_suffix(".pub").read_text().split()
            where = n.host if n.port == 22 else f"[{n.host}]:{n.port}"
            kh.append(f"{where} {pub[0]} {pub[1]}\n")
        self.known_hosts_path.write_text("".join(kh))
        specs = [n.spec for n in self.nodes.values()]
        fabrics = sorted(set().union(*(s.fabrics() for s in specs)))
        nodes_yaml: list[dict[str, Any]] = []
        for n in self.nodes.values():
            e: dict[str, Any] = {"name": n.name, "host": n.host}
            if n.port != 22:
                e["port"] = n.port
            if n.spec.fabric:
                e["fabric"] = n.spec.fabric
            if n.spec.hca_fabrics:
                e["hca_fabrics"] = dict(n.spec.hca_fabrics)
            if n.spec.labels:
                e["labels"] = dict(n.spec.labels)
            nodes_yaml.append(e)
        inv: dict[str, Any] = {
            "defaults": {
                "user": self.user,
                "port": 22,
                "identity_file": self.identity_file.name,
                "known_hosts": self.known_hosts_path.name,
            },
            "gpu_classes": gpu_classes(specs),
            "fabrics": {f: {"description": f"testbed fabric, master SM 0x{fabric_sm_guid(f):016x}"} for f in fabrics},
            "nodes": nodes_yaml,
        }
        header = (
            "# Generated by `python -m testbed up` (clusterctl testbed); paths are relative to this file.\n"
            f"# mode: {self.mode}; the simulated IB ports of nodes without fabric= share one subnet manager (the testbed's "
            f"{IMPLICIT_FABRIC!r} subnet); the inventory declares no fabric for them, so clusterctl assigns them none.\n"
        )
        self.inventory_path.write_text(header + yaml.safe_dump(inv, sort_keys=False, width=120))

    @classmethod
    def attach(cls, directory: Path | str) -> Cluster:
        """Open the testbed running in ``directory`` (started by another process or the CLI)."""
        directory = Path(directory).resolve()
        try:
            st = json.loads((directory / STATE_FILE).read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed in {directory} ({STATE_FILE} not found)") from None
        nodes = {d["name"]: Node.from_dict(d) for d in st["nodes"]}
        c = cls(directory, st["prefix"], st["mode"], st["user"], nodes)
        return c

    def _save(self, status: str = "running") -> None:
        data = {
            "version": 1,
            "dir": str(self.dir),
            "prefix": self.prefix,
            "mode": self.mode,
            "user": self.user,
            "bridge": BRIDGE if self.mode == "netns" else None,
            "status": status,
            "nodes": [n.to_dict() for n in self.nodes.values()],
        }
        fd, tmp = tempfile.mkstemp(prefix=".testbed.", suffix=".tmp", dir=self.dir)  # one per writer
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(data, indent=1))
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.state_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def stop(self) -> None:
        """Tear everything down: processes, namespaces, veths, addresses (idempotent)."""
        if self._atexit_registered:
            atexit.unregister(self._stop_at_exit)
            self._atexit_registered = False
        with _flock(self.dir / ".testbed.lock"):
            _teardown_prefix(self.prefix, list(self.nodes.values()), self.dir)
            with contextlib.suppress(FileNotFoundError):
                self.state_path.unlink()
        self._stopped = True

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- fault injection -----------------------------------------------------
    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise TestbedError(f"no node {name!r} (have: {', '.join(self.nodes)})") from None

    def kill(self, name: str) -> None:
        """SIGKILL everything on the node; new connections are refused."""
        self.node(name).kill()
        self._save()

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of the node: TCP stays open, nothing answers."""
        n = self.node(name)
        n.stop_processes()
        n.frozen = True
        self._save()

    def thaw(self, name: str) -> None:
        n = self.node(name)
        n.frozen = False
        if not (n.partitioned and self.mode == "loopback"):
            n.continue_processes()
        self._save()

    def partition(self, name: str) -> None:
        """Cut the node off the network (host veth down; packets vanish, no RST/ICMP).

        In loopback mode this freezes the node instead (connections hang the same way).
        """
        n = self.node(name)
        if self.mode == "netns":
            _run(["ip", "link", "set", str(n.veth), "down"])
        else:
            n.stop_processes()
        n.partitioned = True
        self._save()

    def heal(self, name: str) -> None:
        n = self.node(name)
        if self.mode == "netns":
            _run(["ip", "link", "set", str(n.veth), "up"])
        elif not n.frozen:
            n.continue_processes()
        n.partitioned = False
        self._save()

    def revive(self, name: str, timeout: float = 20.0) -> None:
        """Start a killed node again (same address, keys and hardware)."""
        n = self.node(name)
        if not n.killed:
            raise TestbedError(f"{name} is not killed (state: {n.state})")
        if n.partitioned:
            raise TestbedError(f"{name} is partitioned: heal it before reviving it")
        n.launch()
        try:
            # The same port: the inventory and known_hosts name it (no moving to a free one).
            self._wait_ready([n], time.monotonic() + timeout, retry_ports=False)
        except BaseException:
            n.kill()  # a revive that failed leaves nothing running behind the testbed's back
            raise
        finally:
            self._save()

    # ---- helpers for tests ---------------------------------------------------
    def expected(self, name: str) -> Rendered:
        """The pre-rendered outputs of a node (what each probe command should return)."""
        n = self.node(name)
        return render(n.spec, n.index)

    def ssh_argv(self, name: str, command: str, connect_timeout: float = 5.0) -> list[str]:
        """An OpenSSH client command line that runs ``command`` on the node, host key checked."""
        n = self.node(name)
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(self.identity_file),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts_path}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            f"ConnectTimeout={max(1, round(connect_timeout))}",
            "-o",
            "LogLevel=ERROR",
            "-p",
            str(n.port),
            f"{self.user}@{n.host}",
            "--",
            command,
        ]

    def ssh(self, name: str, command: str, timeout: float = 30.0) -> subprocess.CompletedProcess[bytes]:
        """Run ``command`` on the node with the OpenSSH client (bounded by ``timeout``)."""
        return subprocess.run(
            self.ssh_argv(name, command, connect_timeout=min(timeout, 5.0)),
            capture_output=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for n in self.nodes.values():
            up = False if n.killed or n.frozen or n.partitioned else ssh_banner(n.host, n.port, timeout=0.5)
            rows.append(
                {
                    "name": n.name,
                    "preset": n.spec.preset,
                    "host": n.host,
                    "port": n.port,
                    "state": n.state,
                    "processes": len(n.processes()),
                    "ssh": up,
                }
            )
        return rows


def _cleanup_dir(directory: Path, prefix: str) -> None:
    """Remove leftovers of an earlier (crashed or still running) testbed in this folder."""
    nodes: list[Node] = []
    st = directory / STATE_FILE
    if st.exists():
        try:
            nodes = [Node.from_dict(d) for d in json.loads(st.read_text()).get("nodes", [])]
        except (OSError, ValueError, TypeError, KeyError):
            nodes = []
    _teardown_prefix(prefix, nodes, directory)
    with contextlib.suppress(FileNotFoundError):
        st.unlink()
    if os.geteuid() == 0:
        gc()


def down(directory: Path | str) -> bool:
    """Stop the testbed in ``directory`` (also cleans up after a crashed run). True if one ran."""
    directory = Path(directory).resolve()
    prefix = testbed_prefix(directory)
    if not directory.is_dir():
        _cleanup_dir(directory, prefix)  # leftovers of a folder removed under a running testbed; creates nothing
        return False
    existed = (directory / STATE_FILE).exists()
    with _flock(directory / ".testbed.lock"):
        _cleanup_dir(directory, prefix)
    return existed


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_file(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)
