"""One simulated node: its folder (host key, sshd_config, fake tools, outputs) and its processes.

Layout of ``DIR/nodes/NAME/``::

    sshd_config  ssh_host_ed25519_key(.pub)  sshd.log  spec.json
    home/        HOME of every SSH session (keeps the user's ~/.bashrc out: ~90+ ms per command)
    bin/         nvidia-smi ibstat sminfo nproc cat   (first on PATH; tiny POSIX sh scripts)
    out/         pre-rendered stdout/stderr the scripts cat

Modes:

* ``netns``: ``nsenter --net=<netns> unshare --pid --fork --kill-child --mount-proc sshd -D``.
  sshd is PID 1 of the node's PID namespace, so killing it kills everything started on the
  node; ``ps``/``pkill`` on the node only see the node.
* ``loopback``: ``sshd -D`` on 127.0.0.1:PORT in its own session. A node's processes are
  sshd's descendants plus anything carrying ``TESTBED_NODE=<marker>`` in its environment
  (sshd sets it for every session), which also finds daemonized engines.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.hardware import NodeSpec, Rendered, ToolOutput, spec_json

REPO_ROOT = Path(__file__).resolve().parent.parent
_SYS_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def find_sshd() -> str | None:
    return shutil.which("sshd", path="/usr/sbin:/usr/local/sbin:/sbin:/usr/bin:/usr/local/bin")


def _which(tool: str) -> str:
    p = shutil.which(tool, path=_SYS_PATH)
    if p is None:
        raise RuntimeError(f"{tool} not found in {_SYS_PATH}")
    return p


def _cfg_quote(value: str) -> str:
    if any(c in value for c in "\"'\n"):
        raise ValueError(f"path {value!r} contains quotes or newlines: not usable in sshd_config")
    return f'"{value}"' if any(c.isspace() for c in value) else value


def _netns_pids(netns: str) -> set[int]:
    try:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.split() if x.isdigit()}


# ---------------------------------------------------------------------------
# /proc helpers


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2 :].split()
    return rest[0].decode(), int(rest[1])


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def pidns_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def pids_in_pidns(ns: str) -> list[int]:
    me = os.getpid()
    return [p for p in all_pids() if p != me and pidns_of(p) == ns]


def descendants(root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for p in all_pids():
        st = _stat(p)
        if st:
            kids.setdefault(st[1], []).append(p)
    out: set[int] = set()
    todo = [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def marked(marker: str) -> set[int]:
    """Processes whose environment holds TESTBED_NODE=<marker> (own processes only unless root)."""
    needle = f"TESTBED_NODE={marker}".encode()
    me = os.getpid()
    out: set[int] = set()
    for p in all_pids():
        if p == me:
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.add(p)
    return out


def marked_prefix(prefix: str) -> set[int]:
    """Processes of any node of one testbed (marker ``<prefix>:<name>``)."""
    needle = f"TESTBED_NODE={prefix}:".encode()
    me = os.getpid()
    out: set[int] = set()
    for p in all_pids():
        if p == me:
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if any(e.startswith(needle) for e in env.split(b"\0")):
            out.add(p)
    return out


def _signal(pids: set[int] | list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def ssh_banner(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when something accepts TCP on host:port and sends an SSH banner in time."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


# ---------------------------------------------------------------------------
# The node


@dataclass
class Node:
    """A running (or killed) simulated node. ``host``/``port`` are what the inventory says."""

    name: str
    index: int
    spec: NodeSpec
    dir: Path
    host: str
    port: int
    marker: str
    netns: str | None = None
    veth: str | None = None
    mac: str | None = None
    pid: int | None = None  # launcher: unshare (netns) or sshd (loopback)
    sshd_pid: int | None = None  # the listening sshd, as seen from the host
    pidns: str | None = None
    killed: bool = False
    frozen: bool = False
    partitioned: bool = False
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    # ---- paths -----------------------------------------------------------
    @property
    def mode(self) -> str:
        return "netns" if self.netns else "loopback"

    @property
    def config_path(self) -> Path:
        return self.dir / "sshd_config"

    @property
    def log_path(self) -> Path:
        return self.dir / "sshd.log"

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def out_dir(self) -> Path:
        return self.dir / "out"

    @property
    def host_key_path(self) -> Path:
        return self.dir / "ssh_host_ed25519_key"

    @property
    def state(self) -> str:
        if self.killed:
            return "killed"
        flags = [f for f, on in (("frozen", self.frozen), ("partitioned", self.partitioned)) if on]
        return "+".join(flags) or "running"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "spec": self.spec.to_dict(),
            "dir": str(self.dir),
            "host": self.host,
            "port": self.port,
            "marker": self.marker,
            "netns": self.netns,
            "veth": self.veth,
            "mac": self.mac,
            "pid": self.pid,
            "sshd_pid": self.sshd_pid,
            "pidns": self.pidns,
            "killed": self.killed,
            "frozen": self.frozen,
            "partitioned": self.partitioned,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Node:
        d = dict(d)
        d["spec"] = NodeSpec.from_dict(d["spec"])
        d["dir"] = Path(d["dir"])
        return cls(**d)

    # ---- files -------------------------------------------------------------
    def write_files(
        self,
        rendered: Rendered,
        *,
        authorized_keys: Path,
        host_key: tuple[bytes, bytes],
        path_extra: tuple[str, ...] = (),
    ) -> None:
        """Write everything the node needs (idempotent; keeps an existing host key)."""
        for d in (self.dir, self.home, self.bin_dir, self.out_dir):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / ".hushlogin").touch()
        if not self.host_key_path.exists():
            _write(self.host_key_path, host_key[0], 0o600)
            _write(self.host_key_path.with_suffix(".pub"), host_key[1], 0o644)
        (self.dir / "spec.json").write_text(spec_json(self.spec, self.index))
        self._write_tools(rendered)
        self._write_sysfs(rendered)
        path = ":".join([str(self.bin_dir), *path_extra, _SYS_PATH])
        # A login shell (``bash -l``, an interactive ssh) resets PATH in /etc/profile: its
        # ~/.profile puts the node's tools back first, as they are on a real GPU server's PATH.
        profile = f"PATH={shlex.quote(path)}; export PATH\n"
        for name in (".profile", ".bash_profile"):
            (self.home / name).write_text(profile)
        env = {"PATH": path, "HOME": str(self.home), "TESTBED_NODE": self.marker, "TESTBED_NODE_NAME": self.name}
        lines = [
            f"# generated by the clusterctl testbed for node {self.name} ({self.spec.preset})",
            f"ListenAddress {self.host}",
            f"Port {self.port}",
            f"HostKey {_cfg_quote(str(self.host_key_path))}",
            "PidFile none",
            f"AuthorizedKeysFile {_cfg_quote(str(authorized_keys))}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "PermitUserRC no",
            "PermitUserEnvironment no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "X11Forwarding no",
            "AllowTcpForwarding yes",
            # MaxSessions stays at OpenSSH's default (10 per connection), as on a stock node.
            # MaxStartups does not: bench/discover.py --jump has ansible log in to one jump host
            # 64 times at once, and the default 10:30:100 drops about a third of those logins.
            "MaxStartups 128:30:256",
            "LoginGraceTime 30",
            "AcceptEnv LANG LC_*",
            "Subsystem sftp internal-sftp",
            "SetEnv " + " ".join(_cfg_quote(f"{k}={v}") for k, v in env.items()),
            "LogLevel INFO",
        ]
        self.config_path.write_text("\n".join(lines) + "\n")

    @property
    def sys_class_dir(self) -> Path:
        """Mounted over ``/sys/class`` inside the node (netns mode): its HCAs' GIDs."""
        return self.dir / "sys-class"

    def _write_sysfs(self, r: Rendered) -> None:
        if self.sys_class_dir.exists():
            shutil.rmtree(self.sys_class_dir)
        for rel, text in r.sysfs.items():
            p = self.sys_class_dir / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            _write(p, text.encode(), 0o444)

    def _write_tools(self, r: Rendered) -> None:
        cat = _which("cat")
        sleep = f"{_which('sleep')} {self.spec.slow:g}\n" if self.spec.slow > 0 else ""
        for old in self.bin_dir.iterdir():
            old.unlink()
        for old in self.out_dir.iterdir():
            old.unlink()
        for tool in r.missing:
            msg = shlex.quote(f"bash: line 1: {tool}: command not found")
            _write_script(self.bin_dir / tool, f"printf '%s\\n' {msg} >&2\nexit 127\n")
        fallback = (
            f"PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}} "
            f"exec {shlex.quote(sys.executable)} -m testbed.tool @TOOL@ "
            f'{shlex.quote(str(self.dir / "spec.json"))} "$@"\n'
        )
        for tool, branches in r.tools.items():
            body = [sleep, 'case "$*" in\n']
            for k, (args, out) in enumerate(branches.items()):
                body.append(f"{shlex.quote(args) if args else chr(39) * 2}) {self._emit(tool, k, out, cat)};;\n")
            if tool == "nproc":
                default = self._emit(tool, 0, branches["--all"], cat)
            else:
                default = fallback.replace("@TOOL@", tool).rstrip("\n")
            body.append(f"*) {default};;\nesac\n")
            _write_script(self.bin_dir / tool, "".join(body))
        _write_script(
            self.bin_dir / "cat",
            "# /proc/meminfo answers from the node's description; anything else is the real cat\n"
            f'if [ "$#" -eq 1 ] && [ "$1" = /proc/meminfo ]; then\n{sleep}'
            f'{self._print("meminfo", r.meminfo.stdout, cat)}; exit 0\nfi\nexec {cat} "$@"\n',
        )

    def _emit(self, tool: str, k: int, out: ToolOutput, cat: str) -> str:
        """Shell text that prints ``out`` and exits with its rc.

        Text goes out through sh's own ``printf`` (no process beyond the tool's sh, like a
        real tool that is one process); bytes that sh cannot hold (NUL, invalid UTF-8)
        are ``cat`` from a file.
        """
        parts = []
        for data, stream, redirect in ((out.stderr, "err", " >&2"), (out.stdout, "out", "")):
            if data:
                parts.append(self._print(f"{tool}.{k}.{stream}", data, cat) + redirect)
        parts.append(f"exit {out.rc}")
        return "; ".join(parts)

    def _print(self, name: str, data: bytes, cat: str) -> str:
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if text is not None and "\0" not in text and len(data) <= 1 << 16:
            return f"printf '%s' {shlex.quote(text)}"
        p = self.out_dir / name
        _write(p, data, 0o644)
        return f"{cat} {shlex.quote(str(p))}"

    # ---- processes -------------------------------------------------------
    def launch(self) -> None:
        """Start sshd (does not wait for it)."""
        sshd = find_sshd()
        if sshd is None:
            raise RuntimeError("sshd not found (install openssh-server)")
        argv = [sshd, "-D", "-e", "-f", str(self.config_path)]
        if self.netns:
            argv = [
                _which("nsenter"),
                f"--net=/run/netns/{self.netns}",
                "--",
                _which("unshare"),
                "--pid",
                "--fork",
                "--kill-child",
                "--uts",
                "--mount-proc",
                "--propagation",
                "slave",
                "/bin/sh",
                "-c",
                # The node's own /sys/class (its HCAs' sysfs) and /dev/shm, in its own mount
                # namespace only: what a killed node left in /dev/shm goes with it, as with a
                # machine that died (discover's probe batch keeps its scratch files there).
                'echo "$0" >/proc/sys/kernel/hostname && '
                "mount -t tmpfs -o mode=1777,size=64m tmpfs /dev/shm && "
                f"{{ [ ! -d {shlex.quote(str(self.sys_class_dir))} ] || "
                f"mount --bind {shlex.quote(str(self.sys_class_dir))} /sys/class; }} && "
                'exec "$@"',
                self.name,
                *argv,
            ]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        finally:
            log.close()
        self.pid = self._proc.pid
        self.sshd_pid = None if self.netns else self.pid
        self.pidns = None
        self.killed = self.frozen = False

    def launcher_exited(self) -> int | None:
        """Exit status of the launcher if it has died (only known in the starting process)."""
        if self._proc is not None:
            return self._proc.poll()
        return None if alive(self.pid) else -1

    def resolve(self) -> None:
        """After the banner is up: find the listening sshd and its PID namespace."""
        if self.netns and self.pid:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.sshd_pid is None:
                # unshare's only child is PID 1 of the namespace: sh exec'ing sshd
                kids = [p for p in all_pids() if (_stat(p) or ("", 0))[1] == self.pid]
                if kids and "sshd" in cmdline(kids[0]):
                    self.sshd_pid = kids[0]
                else:
                    time.sleep(0.01)
            if self.sshd_pid:
                self.pidns = pidns_of(self.sshd_pid)

    def _verified(self, pid: int | None) -> bool:
        return alive(pid) and str(self.config_path) in cmdline(pid or 0)

    def processes(self) -> set[int]:
        """Every process of this node, as host PIDs."""
        me = os.getpid()
        if self.netns:
            if not (self.pidns and self._verified(self.sshd_pid)):
                return set()
            return set(pids_in_pidns(self.pidns)) - {me}
        out = marked(self.marker)
        if self._verified(self.sshd_pid):
            assert self.sshd_pid is not None
            out |= {self.sshd_pid} | descendants(self.sshd_pid)
        return out - {me}

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL everything on the node (engines included) and wait, bounded, for it to be gone."""
        deadline = time.monotonic() + timeout
        if self.netns:
            victims = self.processes()
            for p in (self.sshd_pid, self.pid):
                if p and self._verified(p):
                    victims.add(p)
            # Anything else living in the node's network namespace is on the node too (a
            # process entered with `ip netns exec`, an sshd the testbed lost track of).
            victims |= _netns_pids(self.netns) - {os.getpid()}
            _signal(victims, signal.SIGKILL)  # PID 1 of the namespace first: the kernel does the rest
            while time.monotonic() < deadline and any(alive(p) for p in victims):
                time.sleep(0.02)
        else:
            while time.monotonic() < deadline:
                victims = self.processes()
                if not victims:
                    break
                _signal(victims, signal.SIGKILL)
                time.sleep(0.02)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.killed = True
        self.frozen = False
        self.sshd_pid = None
        self.pidns = None

    def stop_processes(self, timeout: float = 2.0) -> None:
        """Send SIGSTOP to every process until all are stopped (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pending = [p for p in self.processes() if (_stat(p) or ("X", 0))[0] not in "TtZX"]
            if not pending:
                return
            _signal(pending, signal.SIGSTOP)
            time.sleep(0.005)

    def continue_processes(self) -> None:
        for _ in range(2):
            _signal(self.processes(), signal.SIGCONT)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def _write_script(path: Path, body: str) -> None:
    _write(path, ("#!/bin/sh\n# generated by the clusterctl testbed\n" + body).encode(), 0o755)
