"""The SSH testbed: simulated tool outputs, real sshd nodes, fault injection, clean teardown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncssh
import pytest

from cluster_cli.config.inventory import load_inventory
from cluster_cli.probe.commands import PROBES, sminfo_command
from cluster_cli.ssh.channels import AsyncsshSession
from testbed import Cluster, NodeSpec, parse_specs, render, unavailable_reason
from testbed import cluster as tb_cluster
from testbed import hardware as hw
from testbed.node import alive, all_pids, cmdline, ssh_banner

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
ROOT = Path(__file__).resolve().parent.parent
ClusterFactory = Callable[..., Cluster]


def _mode() -> str:
    return os.environ.get("CLUSTERCTL_TESTBED_MODE", "auto")


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _spec(text: str) -> NodeSpec:
    return parse_specs(text)[0]


# ---------------------------------------------------------------------------
# pure: rendered outputs against the real captures


def test_hgx_h200_topology_is_the_real_capture() -> None:
    out = hw.nvidia_smi(_spec("n=hgx-h200x8"), ["topo", "-m"])
    assert out.rc == 0
    assert out.stdout.decode() == _fixture("nvidia-smi-topo-m.hgx-h200x8-8nic.txt")


def test_a100_bridge_pairs_matrix_is_the_real_capture() -> None:
    got = hw.nvidia_smi(_spec("n=a100-pcie-4x"), ["topo", "-m"]).stdout.decode().splitlines()
    want = _fixture("nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt").splitlines()
    assert got[: len(want)] == want
    assert "NIC Legend:" not in got


def test_dgx_h100_topology_has_ib_and_roce_columns() -> None:
    lines = hw.nvidia_smi(_spec("n=dgx-h100"), ["topo", "-m"]).stdout.decode().splitlines()
    header = lines[0].split("\t")
    assert header[1:9] == [f"GPU{i}" for i in range(8)] and header[9:19] == [f"NIC{i}" for i in range(10)]
    assert lines[1].split("\t")[1:9] == [" X "] + ["NV18"] * 7
    assert lines[1].split("\t")[-4:] == ["0-55,112-167", "0", "", "N/A"]
    nic_row = next(line for line in lines if line.startswith("NIC1\t")).split("\t")
    assert nic_row[-4:] == ["", "", "", ""] and nic_row[9 + 2] == "PIX"  # the two RoCE ports share a card
    assert "  NIC9: mlx5_9" in lines


def test_pcie_only_presets_have_no_nvlink() -> None:
    for preset in ("rtx4090x8", "l40s-2x"):
        text = hw.nvidia_smi(_spec(f"n={preset}"), ["topo", "-m"]).stdout.decode()
        assert not re.search(r"\tNV\d+", text), preset


def test_query_gpu_rows_follow_probe_fields() -> None:
    spec = _spec("n=hgx-h200x8:ecc=1:remap=2:retire=3:foreign=0:4242:python3 -m vllm, serve:20000")
    r = render(spec, 0)
    rows = r.expected(PROBES["gpus"]).stdout.decode().splitlines()
    assert len(rows) == 8 and r.expected(PROBES["gpus"]).rc == 0
    cells = [row.split(", ") for row in rows]
    assert all(len(c) == 10 for c in cells)
    assert cells[0][2:6] == ["NVIDIA H200", "143771", "20000", "00000000:18:00.0"]
    assert re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", cells[0][1])
    assert cells[0][1] == hw.gpu_uuid("n", 0) and cells[0][1][:12] == cells[7][1][:12]
    assert cells[1][6] == hw.ECC_FAULT_COUNT and cells[0][6] == "0"
    assert cells[2][9] == "Yes" and cells[3][8] == "Yes" and cells[4][8:] == ["[N/A]", "No"]
    apps = r.expected(PROBES["apps"]).stdout.decode()
    assert apps == f"{cells[0][1]}, 4242, 20000, python3 -m vllm, serve\n"
    assert render(_spec("n=hgx-h200x8"), 0).expected(PROBES["apps"]).stdout == b""  # idle: nothing


def test_lost_gpu_drops_the_row_and_returns_15() -> None:
    out = render(_spec("n=dgx-h100:lost=2"), 0).expected(PROBES["gpus"])
    lines = out.stdout.decode().splitlines()
    assert out.rc == 15 and len(lines) == 8
    assert lines[2] == (
        "Unable to determine the device handle for GPU 0000:52:00.0: GPU is lost. Reboot the system to recover this GPU"
    )
    assert [line.split(", ")[0] for line in lines if not line.startswith("Unable")] == [
        "0",
        "1",
        "3",
        "4",
        "5",
        "6",
        "7",
    ]


@pytest.mark.parametrize(
    ("kind", "fixture", "rc"),
    [
        ("no-driver", "nvidia-smi.err.no-driver.txt", 9),
        ("driver-mismatch", "nvidia-smi.err.driver-library-mismatch.drv535.txt", 18),
        ("no-devices", "nvidia-smi.err.no-devices.txt", 6),
    ],
)
def test_smi_errors_are_the_captured_texts(kind: str, fixture: str, rc: int) -> None:
    r = render(_spec(f"n=hgx-h200x8:smi_error={kind}"), 0)
    for key in ("gpus", "apps", "topo"):
        out = r.expected(PROBES[key])
        assert (out.stdout.decode(), out.rc) == (_fixture(fixture), rc)


def test_cpu_only_node_has_no_gpu_or_ib_tools() -> None:
    r = render(_spec("n=cpu-only:cpus=12:mem_gib=48"), 0)
    out = r.expected(PROBES["gpus"])
    assert (out.stdout, out.stderr.decode(), out.rc) == (
        b"",
        _fixture("nvidia-smi.err.command-not-found.ssh-bash.txt"),
        127,
    )
    assert r.expected(PROBES["ibstat"]).rc == 127
    assert r.expected(PROBES["cpus"]).stdout == b"12\n"
    mem = r.expected(PROBES["meminfo"]).stdout.decode()
    assert mem.startswith(f"MemTotal:       {48 * 1024 * 1024} kB\n")
    keys = [line.split(":")[0] for line in _fixture("proc-meminfo.16gb-host.txt").splitlines()]
    assert [line.split(":")[0] for line in mem.splitlines()][:5] == keys[:5]


def test_ibstat_uses_tabs_and_the_captured_layout() -> None:
    text = render(_spec("n=dgx-h100:fabric=ib-a:ib_down=3"), 2).expected(PROBES["ibstat"]).stdout.decode()
    blocks = text.split("CA '")[1:]
    names = [b.split("'")[0] for b in blocks]
    assert names == sorted(names) and len(names) == 10
    captured = _fixture("ibstat.hgx-h100-12ca-ib-plus-roce.txt").split("CA '")[1]
    key_seq = [line.strip().split(":")[0] for line in captured.splitlines()[1:]]
    for b in blocks:
        lines = b.splitlines()[1:]
        assert [line.strip().split(":")[0] for line in lines] == key_seq
        assert all(line.startswith("\t") and not line.startswith(" ") for line in lines)
    mlx3 = next(b for b in blocks if b.startswith("mlx5_3'"))
    assert "\t\tState: Down\n" in mlx3 and "\t\tPhysical state: Polling\n" in mlx3
    roce = next(b for b in blocks if b.startswith("mlx5_1'"))
    assert "Link layer: Ethernet" in roce and "Port GUID: 0x0000000000000000" in roce


def test_sminfo_same_fabric_same_guid() -> None:
    a = render(_spec("a=hgx-h200x8:fabric=ib-a"), 0)
    b = render(_spec("b=dgx-h100:fabric=ib-a:hca=mlx5_9:ib-b"), 1)
    pat = re.compile(
        r"sminfo: sm lid (\d+) sm guid (0x[0-9a-f]+), activity count \d+ priority \d+ state 3 SMINFO_MASTER\n"
    )
    assert pat.fullmatch(_fixture("sminfo.master.txt"))  # the real capture has this shape

    def guid(r: hw.Rendered, ca: str) -> int:
        m = pat.fullmatch(r.expected(sminfo_command(ca, 1)).stdout.decode())
        assert m, ca
        return int(m.group(2), 16)

    assert guid(a, "mlx5_0") == guid(b, "mlx5_0") == hw.fabric_sm_guid("ib-a")
    assert guid(b, "mlx5_9") == hw.fabric_sm_guid("ib-b") != hw.fabric_sm_guid("ib-a")
    roce = b.expected(sminfo_command("mlx5_1", 1))
    assert roce.rc == 255 and roce.stdout == b"sminfo: iberror: failed: Failed to open 'mlx5_1' port '1'\n"
    forced = render(_spec("c=hgx-h200x8:fabric=ib-a:sm_guid=0x2c90200259201"), 2)
    assert guid(forced, "mlx5_3") == 0x2C90200259201


def test_spec_parsing() -> None:
    s = _spec("g=hgx-h200x8:fabric=ib-a:ecc=1+3:ecc=5:foreign=2:77:/usr/bin/python3:slow=0.5:garbage:label=rack/r1")
    assert s.ecc == (1, 3, 5) and s.slow == 0.5 and s.garbage and s.labels == {"rack": "r1"}
    assert s.foreign == (hw.Foreign(2, 77, "/usr/bin/python3"),)
    assert NodeSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert [x.name for x in hw.count_specs(3, "cpu-only")] == ["node-01", "node-02", "node-03"]
    for bad in (
        "g=hgx-h200x8:ecc=8",
        "g=nope",
        "g=hgx-h200x8:bogus=1",
        "g=cpu-only:lost=0",
        "g=a100-pcie-4x:ib_down=0",
    ):
        with pytest.raises(ValueError):
            parse_specs(bad)
    with pytest.raises(ValueError, match="duplicate"):
        parse_specs("a=cpu-only,a=cpu-only")


def test_presets_cover_the_brief() -> None:
    want = {"hgx-h200x8", "dgx-h100", "a100-pcie-4x", "rtx4090x8", "l40s-2x", "cpu-only"}
    assert want <= set(hw.PRESETS)
    assert hw.PRESETS["hgx-h200x8"].gpu == hw.H200 and hw.H200.memory_mib == 143771
    assert hw.PRESETS["dgx-h100"].gpu.memory_mib == 81559  # type: ignore[union-attr]
    links = [n.link_layer for n in hw.PRESETS["dgx-h100"].nics]
    assert links.count("InfiniBand") == 8 and links.count("Ethernet") == 2


# ---------------------------------------------------------------------------
# real sshd nodes


@contextlib.contextmanager
def _mux() -> Iterator[list[str]]:
    """OpenSSH connection sharing for many commands; masters are closed afterwards."""
    d = tempfile.mkdtemp(prefix="tbcm")
    opts = ["-o", "ControlMaster=auto", "-o", f"ControlPath={d}/%C", "-o", "ControlPersist=20"]
    try:
        yield opts
    finally:
        for sock in Path(d).iterdir():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True, timeout=10)
        with contextlib.suppress(OSError):
            for p in Path(d).iterdir():
                p.unlink()
            os.rmdir(d)


def _ssh(
    c: Cluster, name: str, cmd: str, extra: list[str] | None = None, timeout: float = 20
) -> subprocess.CompletedProcess[bytes]:
    argv = c.ssh_argv(name, cmd)
    argv[1:1] = extra or []
    return subprocess.run(argv, capture_output=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def _commands(c: Cluster, name: str) -> list[str]:
    cas = [n.ca for n in c.nodes[name].spec.hw.nics]
    return list(PROBES.values()) + [sminfo_command(ca, 1) for ca in cas]


def test_openssh_client_gets_each_probe_output(testbed: Cluster) -> None:
    assert testbed.known_hosts_path.read_text().count("ssh-ed25519") == len(testbed.nodes)
    with _mux() as mux:
        for name in testbed.nodes:
            exp = testbed.expected(name)
            for cmd in _commands(testbed, name):
                r = _ssh(testbed, name, cmd, mux)
                e = exp.expected(cmd)
                assert (r.stdout, r.stderr, r.returncode) == (e.stdout, e.stderr, e.rc), (name, cmd)
        # arguments that were not pre-rendered go to the slow path and still answer
        r = _ssh(testbed, "gpu-01", "nvidia-smi --query-gpu=index,name,memory.total --format=csv", mux)
        assert r.returncode == 0
        assert r.stdout.decode().splitlines()[:2] == ["index, name, memory.total [MiB]", "0, NVIDIA H200, 143771 MiB"]
        r = _ssh(testbed, "gpu-01", "hostname; echo $HOME; cat /etc/hostname >/dev/null && echo real-cat-ok", mux)
        lines = r.stdout.decode().split()
        assert lines[1].endswith("/nodes/gpu-01/home") and lines[2] == "real-cat-ok"
        if testbed.mode == "netns":
            assert lines[0] == "gpu-01"


def test_inventory_is_valid_and_relative(testbed: Cluster, testbed_inventory: Path) -> None:
    text = testbed_inventory.read_text()
    assert str(testbed.dir) not in text  # movable folder
    inv = load_inventory(testbed_inventory)
    assert [n.name for n in inv.nodes] == list(testbed.nodes)
    assert inv.gpu_classes["H200"] == ["NVIDIA H200"] and set(inv.fabrics) == {"ib-a", "ib-b"}
    t = inv.ssh_target(inv.nodes[0])
    assert t.identity_file == str(testbed.identity_file) and t.known_hosts == str(testbed.known_hosts_path)
    hosts = {n.host for n in inv.nodes}
    if testbed.mode == "netns":
        assert all(h.startswith("198.18.0.") for h in hosts) and len(hosts) == len(inv.nodes)
    else:
        assert hosts == {"127.0.0.1"}


async def _connect(c: Cluster, name: str, timeout: float = 5) -> asyncssh.SSHClientConnection:
    n = c.nodes[name]
    return await asyncio.wait_for(
        asyncssh.connect(
            n.host,
            port=n.port,
            username=c.user,
            client_keys=[str(c.identity_file)],
            known_hosts=str(c.known_hosts_path),
            config=None,
        ),
        timeout,
    )


def test_a_session_runs_with_the_nodes_home_not_the_users(testbed_factory: ClusterFactory, tmp_path: Path) -> None:
    """HOME is the node's own ``home/`` in every session, so the shell reads the node's
    ~/.bashrc (the testbed writes none), never the user's: theirs would add 90+ ms per
    command, and whatever it prints or exports. In netns mode the user's real home is
    shadowed, in the node's mount namespace only, by one whose ~/.bashrc leaves a marker."""
    c = testbed_factory("n=cpu-only")
    n = c.nodes["n"]
    user_home = Path(pwd.getpwnam(c.user).pw_dir)
    if Path(pwd.getpwnam(c.user).pw_shell).name != "bash":
        pytest.skip(f"{c.user}'s login shell is not bash: the ~/.bashrc checks do not apply")
    shadowed = c.mode == "netns" and not n.home.is_relative_to(user_home)
    if shadowed:
        fake = tmp_path / "user-home"
        fake.mkdir()
        (fake / ".bashrc").write_text("export TB_USER_BASHRC=read\n")
        assert n.sshd_pid is not None
        subprocess.run(["nsenter", "-t", str(n.sshd_pid), "-m", "--", "mount", "--bind", str(fake), str(user_home)],
                       check=True, timeout=30)  # fmt: skip
    # The node's own ~/.bashrc is read: the shell does source one, so the check below can fail.
    (n.home / ".bashrc").write_text("export TB_NODE_BASHRC=read\n")

    async def main() -> str:
        async with await _connect(c, "n") as conn:
            r = await asyncio.wait_for(conn.run("env"), 30)
            assert r.exit_status == 0, r.stderr
            return str(r.stdout)

    env = dict(line.split("=", 1) for line in asyncio.run(main()).splitlines() if "=" in line)
    assert env["HOME"] == str(n.home)
    assert env.get("TB_NODE_BASHRC") == "read"
    if shadowed:
        assert "TB_USER_BASHRC" not in env


def _tcp(host: str, port: int, timeout: float = 1.0) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return f"error:{e.errno}"


def test_faults_kill_freeze_partition(testbed_factory: ClusterFactory) -> None:
    c = testbed_factory("k=l40s-2x,f=cpu-only,p=cpu-only")
    tag = f"tbengine-{secrets.token_hex(4)}"

    async def scenario() -> None:
        ck = await _connect(c, "k")
        cf = await _connect(c, "f")
        cp = await _connect(c, "p")
        # an "engine" that daemonizes away from the SSH session
        r = await ck.run(f"nohup bash -c 'exec -a {tag} sleep 300' >/dev/null 2>&1 & echo ok")
        assert r.stdout == "ok\n"
        engine: list[int] = []
        for _ in range(50):  # the background process may take a moment to exec under load
            engine = [p for p in all_pids() if tag in cmdline(p)]
            if engine:
                break
            await asyncio.sleep(0.1)
        assert engine
        # kill: the running command ends without exit status, everything is gone, connects are refused
        running = asyncio.create_task(ck.run(f"bash -c 'exec -a {tag}-cmd sleep 30'"))
        for _ in range(100):  # the command must be running when the node dies, under load too
            if any(f"{tag}-cmd" in cmdline(p) for p in c.nodes["k"].processes()):
                break
            await asyncio.sleep(0.05)
        await asyncio.to_thread(c.kill, "k")
        res = await asyncio.wait_for(running, 5)
        # The command dies with the node: usually the connection just drops (no exit status);
        # when sshd outlives its session child by a moment it reports the KILL instead.
        assert res.exit_status is None or (res.exit_signal is not None and res.exit_signal[0] == "KILL")
        assert not any(alive(p) for p in engine) and not c.nodes["k"].processes()
        k = c.nodes["k"]
        assert _tcp(k.host, k.port) == "refused"
        await asyncio.to_thread(c.revive, "k")
        assert ssh_banner(k.host, k.port)

        # freeze: TCP still accepts, nothing answers; thaw resumes even the old connection
        f = c.nodes["f"]
        await asyncio.to_thread(c.freeze, "f")
        assert _tcp(f.host, f.port) == "open" and not ssh_banner(f.host, f.port, timeout=1.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(cf.run("true"), 1.0)
        await asyncio.to_thread(c.thaw, "f")
        assert (await asyncio.wait_for(cf.run("echo back"), 10)).stdout == "back\n"
        assert ssh_banner(f.host, f.port, timeout=2.0)

        # partition: new connections time out (no RST), the old one survives a short cut
        p = c.nodes["p"]
        await asyncio.to_thread(c.partition, "p")
        assert c.nodes["p"].state == "partitioned"
        if c.mode == "netns":
            assert _tcp(p.host, p.port, timeout=1.0) == "timeout"
        else:  # loopback: emulated by freezing
            assert not ssh_banner(p.host, p.port, timeout=1.0)
        await asyncio.to_thread(c.heal, "p")
        assert (await asyncio.wait_for(cp.run("echo healed"), 15)).stdout == "healed\n"
        assert ssh_banner(p.host, p.port, timeout=2.0)
        for conn in (ck, cf, cp):
            conn.close()

    asyncio.run(scenario())
    assert [n.state for n in c.nodes.values()] == ["running"] * 3


def test_fault_options_over_ssh(testbed_factory: ClusterFactory) -> None:
    c = testbed_factory(
        "s=hgx-h200x8:slow=0.6:smi_error=driver-mismatch,"
        "g=l40s-2x:garbage,"
        "r=dgx-h100:fabric=ib-a:remap=2:retire=3:ecc=1:lost=4:foreign=0:4242:python3 -m vllm:ib_down=3:mem_gib=1536:cpus=96"
    )

    async def check(session: AsyncsshSession, name: str, cmd: str) -> None:
        t = time.perf_counter()
        rc, out, err = await session.run_raw(cmd, timeout=30)
        dt = time.perf_counter() - t
        e = c.expected(name).expected(cmd)
        assert (out, err, rc) == (e.stdout, e.stderr, e.rc), (name, cmd)
        if name == "s" and cmd == PROBES["gpus"]:
            assert dt >= 0.6 and rc == 18
        if name == "g" and cmd == PROBES["gpus"]:
            assert rc == 0 and b"\xff" in out

    async def scenario() -> None:
        # Every probe at once, on one connection: through clusterctl's session, which opens no
        # more channels at a time than the node's sshd (its default MaxSessions) allows.
        for name in c.nodes:
            async with await _connect(c, name) as conn:
                session = AsyncsshSession(conn, name)
                await asyncio.gather(*(check(session, name, cmd) for cmd in _commands(c, name)))

    asyncio.run(scenario())


def _leftovers(prefix: str, directory: Path) -> list[str]:
    out = [f"netns {n}" for n in tb_cluster._netns_names() if n.startswith(prefix + "-")]
    out += [f"link {x}" for x in tb_cluster._links() if x.startswith(prefix + "v")]
    out += [f"process {p}" for p in all_pids() if f"{directory}/nodes/" in cmdline(p)]
    if os.geteuid() == 0:
        out += [f"address {o}" for o, e in tb_cluster._registry().items() if e.get("prefix") == prefix]
        neigh = subprocess.run(["ip", "neigh", "show", "nud", "permanent"], capture_output=True, text=True, timeout=10)
        mine = {f"{tb_cluster.NET}.{o}" for o in range(256)} & set(neigh.stdout.split())
        registry = {f"{tb_cluster.NET}.{o}" for o in tb_cluster._registry()}
        out += [f"neighbour {ip}" for ip in mine - registry]
    return out


def test_down_leaves_nothing_and_up_cleans_a_crashed_run(testbed_factory: ClusterFactory, tmp_path: Path) -> None:
    d = tmp_path / "crashy"
    first = Cluster.start(d, "a=cpu-only,b=a100-pcie-4x", mode=_mode(), stop_at_exit=False)
    old = {p for p in all_pids() if f"{d.resolve()}/nodes/" in cmdline(p)}
    assert old
    (d / "testbed.json").unlink()  # the previous run "crashed" and lost its state
    second = Cluster.start(d, "c=cpu-only", mode=first.mode)
    assert not any(alive(p) for p in old)
    assert set(second.nodes) == {"c"} and ssh_banner(second.nodes["c"].host, second.nodes["c"].port)
    other = testbed_factory("z=cpu-only")  # two testbeds side by side
    if second.mode == "netns":
        assert other.nodes["z"].host != second.nodes["c"].host
    second.stop()
    assert _leftovers(second.prefix, second.dir) == []
    assert ssh_banner(other.nodes["z"].host, other.nodes["z"].port)
    other.stop()
    assert _leftovers(other.prefix, other.dir) == []
    if os.geteuid() == 0 and not tb_cluster._registry():
        assert not Path(f"/sys/class/net/{tb_cluster.BRIDGE}").exists()


@pytest.mark.testbed  # starts its testbed through the CLI, not through a fixture
def test_cli_up_status_down(tmp_path: Path) -> None:
    if why := unavailable_reason(_mode()):
        pytest.skip(f"SSH testbed unavailable: {why}")
    d = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "testbed", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    r = cli(
        "up", "--dir", str(d), "--mode", _mode(), "--nodes", "n1=cpu-only:cpus=3", "--count", "1", "--preset", "l40s-2x"
    )
    assert r.returncode == 0, r.stderr
    try:
        st = json.loads(cli("status", "--dir", str(d), "--json").stdout)
        assert [(n["name"], n["state"], n["ssh"]) for n in st["nodes"]] == [
            ("n1", "running", True),
            ("node-01", "running", True),
        ]
        c = Cluster.attach(d)
        assert _ssh(c, "n1", PROBES["cpus"]).stdout == b"3\n"
        assert cli("freeze", "--dir", str(d), "n1").returncode == 0
        assert json.loads(cli("status", "--dir", str(d), "--json").stdout)["nodes"][0]["state"] == "frozen"
        assert cli("thaw", "--dir", str(d), "n1").returncode == 0
        assert _ssh(c, "n1", "echo ok").stdout == b"ok\n"
        # Two at once (``freeze a & freeze b &``): each one's change is kept, none undone.
        for op, state in (("freeze", "frozen"), ("thaw", "running")):
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "testbed", op, "--dir", str(d), n],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                for n in ("n1", "node-01")
            ]
            assert [p.wait(60) for p in procs] == [0, 0], [p.stderr.read() for p in procs if p.stderr]
            st = json.loads(cli("status", "--dir", str(d), "--json").stdout)
            assert [n["state"] for n in st["nodes"]] == [state, state]
        assert not list(d.glob("*.tmp"))
    finally:
        assert cli("down", "--dir", str(d)).returncode == 0
    assert _leftovers(tb_cluster.testbed_prefix(d), d.resolve()) == []
    assert cli("status", "--dir", str(d)).returncode == 1


def test_loopback_mode_serves_discover_without_namespaces(testbed_factory: ClusterFactory) -> None:
    # The fallback for users without root: plain sshds on 127.0.0.1 ports. Forced here so that
    # a root CI run covers it too.
    from cluster_cli.probe.collect import discover
    from cluster_cli.ssh.connect import AsyncsshConnector

    c = testbed_factory("a=hgx-h200x8:fabric=ib-a,b=cpu-only", mode="loopback")
    assert c.mode == "loopback"
    assert all(n.host == "127.0.0.1" and n.netns is None for n in c.nodes.values())
    inv = load_inventory(c.inventory_path)
    facts = {f.name: f for f in asyncio.run(discover(inv, connector=AsyncsshConnector()))}
    assert facts["a"].reachable and len(facts["a"].gpus) == 8
    assert {h.sm_guid for h in facts["a"].hcas if h.is_ib_attachment} == {hw.fabric_sm_guid("ib-a")}
    assert facts["b"].reachable and facts["b"].gpus == ()
    c.kill("b")
    facts = {f.name: f for f in asyncio.run(discover(inv, connector=AsyncsshConnector()))}
    assert facts["a"].reachable and not facts["b"].reachable


def test_another_testbed_coming_and_going_never_undoes_a_partition(testbed_factory: ClusterFactory) -> None:
    a = testbed_factory("a1=cpu-only")
    if a.mode != "netns":
        pytest.skip("partition by neighbour entries is a netns-mode feature")
    assert Path(f"/sys/class/net/{tb_cluster.BRIDGE}/address").read_text().strip() == tb_cluster.BRIDGE_MAC
    a.partition("a1")
    host = a.node("a1").host

    def permanent() -> str:
        return subprocess.run(["ip", "neigh", "show", "dev", tb_cluster.BRIDGE, "nud", "permanent"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    assert f"{host} " in permanent()
    b = testbed_factory("b1=cpu-only,b2=cpu-only")  # joins the bridge, then leaves it
    b.stop()
    assert f"{host} " in permanent(), "a partition was undone by another testbed"
    assert _tcp(host, 22, timeout=1.0) == "timeout"


def test_bad_folders_are_refused_and_down_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "not-there"
    assert tb_cluster.down(target) is False
    assert not target.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for bad, needle in (
        (a_file, "not a folder"),
        (tmp_path / "p%u", "must not contain '%'"),
        (tmp_path / "sp ace", "must not contain spaces"),
    ):
        with pytest.raises(tb_cluster.TestbedError, match=needle):
            Cluster.start(bad, "n=cpu-only", mode="loopback")


def test_revive_keeps_the_address_or_fails_leaving_nothing_behind(testbed_factory: ClusterFactory) -> None:
    c = testbed_factory("r=cpu-only", mode="loopback")
    n = c.node("r")
    port = n.port
    c.partition("r")
    c.kill("r")
    with pytest.raises(tb_cluster.TestbedError, match="heal it before reviving"):
        c.revive("r")
    c.heal("r")
    with socket.socket() as squatter:  # someone else took the node's port meanwhile
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(tb_cluster.TestbedError):
            c.revive("r", timeout=5)
        assert c.node("r").killed and c.node("r").port == port
        assert not [p for p in all_pids() if str(n.config_path) in cmdline(p)], "a failed revive left an sshd"
    c.revive("r")
    assert c.node("r").port == port and _tcp("127.0.0.1", port) == "open"


def _stuck(pid: int) -> str:
    """Where a process that never got going waits, and what it started (for a failure message)."""
    out = []
    for q in [pid, *[k for k in all_pids() if (_ppid(k) == pid)]]:
        try:
            wchan = Path(f"/proc/{q}/wchan").read_text()
            state = Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            wchan = state = "?"
        out.append(f"pid {q} ({cmdline(q)!r}) state {state} waiting in {wchan or '-'}")
    return "; ".join(out)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def test_kill_also_ends_what_lives_only_in_the_nodes_network(testbed_factory: ClusterFactory) -> None:
    c = testbed_factory("z=cpu-only")
    if c.mode != "netns":
        pytest.skip("network namespaces only")
    n = c.node("z")
    tag = f"tbnet-{secrets.token_hex(4)}"
    # Entered with `ip netns exec`: in the node's network, outside its PID namespace.
    p = subprocess.Popen(["ip", "netns", "exec", str(n.netns), "bash", "-c", f"exec -a {tag} sleep 300"],
                         stderr=subprocess.PIPE, text=True)  # fmt: skip

    def tagged() -> list[int]:  # the sleep itself (argv[0] is the tag once bash has exec'd it)
        return [q for q in all_pids() if cmdline(q).split(" ")[0] == tag]

    try:
        deadline = time.monotonic() + 30
        # Not "tag in cmdline": bash's own command line holds the tag too, and reads empty for
        # a moment while it execs the sleep.
        while not (found := tagged()) and time.monotonic() < deadline:
            assert p.poll() is None, f"ip netns exec failed (rc {p.returncode}): {p.stderr.read() if p.stderr else ''}"
            time.sleep(0.05)
        assert found, _stuck(p.pid)
        c.kill("z")
        assert p.wait(timeout=5) is not None
        assert not [q for q in all_pids() if tag in cmdline(q)]
    finally:
        p.kill()
        p.wait()


def test_a_node_has_its_own_dev_shm_and_login_shells_find_its_tools(testbed_factory: ClusterFactory) -> None:
    """What a node leaves in /dev/shm (discover's scratch files, if it is killed mid-probe)
    is the node's, gone with it, not the host's; a login shell (which resets PATH from
    /etc/profile) still finds nvidia-smi, as on a real GPU server."""
    c = testbed_factory("g=hgx-h200x8")
    assert _ssh(c, "g", "bash -lc 'command -v nvidia-smi'").stdout.decode().strip() == str(
        c.nodes["g"].bin_dir / "nvidia-smi"
    )
    if c.mode != "netns":
        return  # loopback nodes share the host's mounts
    marker = f"tb-shm-{os.getpid()}"
    assert _ssh(c, "g", f"touch /dev/shm/{marker} && ls /dev/shm").stdout.split() == [marker.encode()]
    assert not (Path("/dev/shm") / marker).exists()
