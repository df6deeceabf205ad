"""facts_from_outputs: raw probe outputs of one node -> NodeFacts (no SSH involved)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster_cli.config.inventory import Inventory, Node
from cluster_cli.probe.collect import facts_from_outputs
from cluster_cli.ssh.session import CommandResult

FIX = Path(__file__).parent / "fixtures" / "probes"

INV = Inventory(
    gpu_classes={"A100": ["NVIDIA A100 80GB PCIe"]},
    fabrics={"ib-a": None, "ib-b": None},
    nodes=[Node(name="gpu-01", host="198.18.0.10", fabric="ib-a", hca_fabrics={"mlx5_1": "ib-b"})],
)
NODE = INV.nodes[0]

GPUS = (
    "0, GPU-aaaa0000-0000-0000-0000-000000000000, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:17:00.0, 0, Disabled, No, No\n"
    "1, GPU-aaaa0000-0000-0000-0000-000000000001, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:31:00.0, 2, Disabled, No, No\n"
    "2, GPU-aaaa0000-0000-0000-0000-000000000002, NVIDIA A100 80GB PCIe, 81920, 4101, 00000000:B1:00.0, 0, Disabled, No, No\n"
    "3, GPU-aaaa0000-0000-0000-0000-000000000003, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:CA:00.0, 0, Disabled, No, Yes\n"
)
APPS = "GPU-aaaa0000-0000-0000-0000-000000000002, 4411, 4096, python3 train.py, --lr 1e-4\n"
IBSTAT = (
    "CA 'mlx5_0'\n\tCA type: MT4123\n\tNumber of ports: 1\n\tPort 1:\n\t\tState: Active\n"
    "\t\tPhysical state: LinkUp\n\t\tRate: 200\n\t\tBase lid: 12\n\t\tSM lid: 1\n"
    "\t\tPort GUID: 0x0c42a10300aa0001\n\t\tLink layer: InfiniBand\n"
    "CA 'mlx5_1'\n\tCA type: MT4123\n\tNumber of ports: 1\n\tPort 1:\n\t\tState: Active\n"
    "\t\tPhysical state: LinkUp\n\t\tRate: 200\n\t\tBase lid: 40\n\t\tSM lid: 7\n"
    "\t\tPort GUID: 0x0c42a10300aa0002\n\t\tLink layer: InfiniBand\n"
    "CA 'mlx5_2'\n\tCA type: MT4125\n\tNumber of ports: 1\n\tPort 1:\n\t\tState: Active\n"
    "\t\tPhysical state: LinkUp\n\t\tRate: 100\n\t\tBase lid: 0\n\t\tSM lid: 0\n"
    "\t\tPort GUID: 0x0000000000000000\n\t\tLink layer: Ethernet\n"
)
MEMINFO = (FIX / "proc-meminfo.16gb-host.txt").read_text()


def ok(text: str) -> CommandResult:
    return CommandResult(0, text, "")


def outputs(**over: CommandResult) -> dict[str, CommandResult]:
    base = {
        "gpus": ok(GPUS),
        "apps": ok(APPS),
        "topo": ok((FIX / "nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt").read_text()),
        "ibstat": ok(IBSTAT),
        "cpus": ok("208\n"),
        "meminfo": ok(MEMINFO),
    }
    base.update(over)
    return base


def test_full_node() -> None:
    f = facts_from_outputs(INV, NODE, outputs(), sm_guids={("mlx5_0", 1): 0xABC})
    assert f.reachable and f.cpus == 208
    assert f.memory_mib == 16201888 // 1024
    assert [g.gpu_class for g in f.gpus] == ["A100"] * 4
    free = [g.index for g in f.gpus if g.free]
    assert free == [0]
    by = {g.index: g for g in f.gpus}
    assert not by[1].healthy and by[1].problems[0].startswith("ecc")
    assert by[2].healthy and not by[2].free and "4411" in by[2].problems[0]
    assert by[3].problems[0].startswith("remap")
    assert f.nvlink_domains == ((0, 1), (2, 3))
    fabrics = {h.ca: h.fabric for h in f.hcas}
    assert fabrics == {"mlx5_0": "ib-a", "mlx5_1": "ib-b", "mlx5_2": None}  # RoCE port attaches to no fabric
    assert f.fabrics == {"ib-a", "ib-b"}
    assert {h.ca: h.sm_guid for h in f.hcas}["mlx5_0"] == 0xABC
    assert f.problems == ()


def test_cpu_only_node_has_no_gpus_and_no_nvlink() -> None:
    missing = CommandResult(127, "", "bash: line 1: nvidia-smi: command not found\n")
    f = facts_from_outputs(
        INV, NODE, outputs(gpus=missing, apps=missing, topo=missing, ibstat=CommandResult(127, "", "not found"))
    )
    assert f.gpus == () and f.nvlink_domains == ()
    assert any(p.startswith("fabric:") for p in f.problems)  # declared on ib-a, nothing Active
    assert not any(p.startswith("nvidia-smi") for p in f.problems)


@pytest.mark.parametrize(
    ("fixture", "rc", "word"),
    [
        ("nvidia-smi.err.no-driver.txt", 9, "driver"),
        ("nvidia-smi.err.driver-library-mismatch.drv535.txt", 18, "mismatch"),
        ("nvidia-smi.err.no-devices.txt", 6, "devices"),
    ],
)
def test_nvidia_smi_failures_are_node_problems(fixture: str, rc: int, word: str) -> None:
    text = (FIX / fixture).read_text()
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(rc, text, ""), apps=CommandResult(rc, text, "")))
    assert f.gpus == ()
    assert f.nvlink_domains is None  # unknown, never guessed
    (p,) = [p for p in f.problems if p.startswith("nvidia-smi")]
    assert word in p.lower() and "\n" not in p


def test_lost_gpu_is_recorded() -> None:
    lost = "Unable to determine the device handle for GPU 0000:CA:00.0: GPU is lost. Reboot the system to recover this GPU\n"
    text = "".join(GPUS.splitlines(keepends=True)[:3]) + lost
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(15, text, "")))
    lost_gpus = [g for g in f.gpus if g.lost]
    assert len(lost_gpus) == 1 and not lost_gpus[0].healthy
    assert lost_gpus[0].pci_bus_id == "0000:ca:00.0"
    assert len(f.gpus) == 4


@pytest.mark.parametrize("rc", [124, 6])
def test_a_gpu_list_cut_short_frees_nothing(rc: int) -> None:
    # nvidia-smi printed two rows, then timed out (or failed): the list may be incomplete.
    first_two = "".join(GPUS.splitlines(keepends=True)[:2])
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(rc, first_two, "")))
    assert len(f.gpus) == 2 and not any(g.free for g in f.gpus)
    assert all("unknown: GPU list incomplete" in g.problems for g in f.gpus)
    assert f.nvlink_domains is None  # not (0,1),(2,3): the topology names GPUs the list lacks
    assert any("may be incomplete" in p for p in f.problems)


@pytest.mark.parametrize(
    "text",
    [
        "".join(GPUS.splitlines(keepends=True)[:1]) + GPUS.splitlines()[1][:14],  # rc 0, the second row cut
        GPUS.splitlines(keepends=True)[0] + GPUS.splitlines(keepends=True)[0],  # the same index twice
        "".join(GPUS.splitlines(keepends=True)[:3]) + "3, GPU-aaaa\n",  # a short last row
    ],
)
def test_rows_cut_short_or_repeated_with_rc_0_free_nothing(text: str) -> None:
    f = facts_from_outputs(INV, NODE, outputs(gpus=ok(text)))
    assert f.gpus and not any(g.free for g in f.gpus)
    assert all("unknown: GPU list incomplete" in g.problems for g in f.gpus)
    assert f.nvlink_domains is None
    assert any("cut short or repeated" in p for p in f.problems)


def test_a_process_row_without_a_readable_pid_still_makes_its_gpu_busy() -> None:
    apps = APPS + "GPU-aaaa0000-0000-0000-0000-000000000000, [N/A], [N/A], [N/A]\n"
    f = facts_from_outputs(INV, NODE, outputs(apps=ok(apps)))
    by = {g.index: g for g in f.gpus}
    assert not by[0].free and "foreign-process: unreadable process row (pid unknown)" in by[0].problems
    assert all("unreadable process row" not in " ".join(g.problems) for i, g in by.items() if i != 0)
    assert not any("names no GPU we know" in p for p in f.problems)
    # A row whose UUID is cut short: which GPU is unknown, so every GPU counts as busy.
    f = facts_from_outputs(INV, NODE, outputs(apps=ok("GPU-aaaa0000-00, [N/A]\n")))
    assert not any(g.free for g in f.gpus)
    assert any("names no GPU we know" in p for p in f.problems)
    # A process row cut after its pid is a process.
    f = facts_from_outputs(INV, NODE, outputs(apps=ok("GPU-aaaa0000-0000-0000-0000-000000000001, 4411")))
    assert [g.index for g in f.gpus if any(p.startswith("foreign-process: pid 4411") for p in g.problems)] == [1]


def test_an_hca_override_for_a_card_the_node_lacks_is_a_problem() -> None:
    inv = Inventory(
        fabrics={"ib-a": None, "ib-b": None},
        nodes=[Node(name="gpu-01", host="h", fabric="ib-a", hca_fabrics={"mlx5_1": "ib-b", "mlx5_99": "ib-b"})],
    )
    f = facts_from_outputs(inv, inv.nodes[0], outputs())
    assert f.problems == ("fabric: hca_fabrics names mlx5_99, which ibstat does not list on this node",)
    failed = outputs(ibstat=CommandResult(127, "", "ibstat: command not found"))
    assert not any("hca_fabrics" in p for p in facts_from_outputs(inv, inv.nodes[0], failed).problems)


def test_gid_records_give_the_subnet_prefix_of_active_ib_ports() -> None:
    gids = {
        "gid:mlx5_0:1": CommandResult(0, "fec0:0000:0000:0001:0c42:a103:00aa:0001\n"),
        "gid:mlx5_1:1": CommandResult(1, "\n"),  # not readable there
        "gid:mlx5_2:1": CommandResult(0, "fe80:0000:0000:0000:0000:0000:0000:0001\n"),  # Ethernet: ignored
    }
    f = facts_from_outputs(INV, NODE, {**outputs(), **gids})
    assert {h.ca: h.subnet_prefix for h in f.hcas} == {"mlx5_0": 0xFEC0_0000_0000_0001, "mlx5_1": None, "mlx5_2": None}


LOST = (
    "Unable to determine the device handle for GPU 0000:C3:00.0: GPU is lost. Reboot the system to recover this GPU\n"
)


@pytest.mark.parametrize("rc", [124, None, 137])
def test_a_lost_gpu_does_not_excuse_a_gpu_list_cut_short(rc: int | None) -> None:
    """A lost GPU makes nvidia-smi exit non-zero after a whole list; killed by the probe
    timeout, a signal or a cut connection, the list may lack GPUs: nothing in it is free."""
    gpus = LOST + GPUS.splitlines(keepends=True)[0]
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(rc, gpus, ""), apps=ok("")))
    assert not any(g.free for g in f.gpus) and f.nvlink_domains is None
    assert any(
        p.startswith("nvidia-smi: ") and "after listing 1 GPU(s); the list may be incomplete" in p for p in f.problems
    )
    whole = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(15, gpus, ""), apps=ok("")))  # ended on its own
    assert [g.free for g in whole.gpus] == [True, False]  # the listed GPU, and the lost one


@pytest.mark.parametrize("rc", [124, None])
def test_a_process_list_cut_short_frees_no_gpu_even_with_a_lost_gpu(rc: int | None) -> None:
    gpus = CommandResult(15, GPUS.splitlines(keepends=True)[0] + LOST + GPUS.splitlines(keepends=True)[1], "")
    f = facts_from_outputs(INV, NODE, outputs(gpus=gpus, apps=CommandResult(rc, LOST, "")))
    assert "nvidia-smi: could not list compute processes; GPUs treated as busy" in f.problems
    assert not any(g.free for g in f.gpus)


def test_a_process_on_a_gpu_the_list_does_not_show_makes_every_gpu_busy() -> None:
    stranger = "GPU-ffff0000-0000-0000-0000-00000000000f, 555, 100, python3\n"
    f = facts_from_outputs(INV, NODE, outputs(apps=ok(APPS + stranger)))
    assert not any(g.free for g in f.gpus)
    assert any(
        "runs on GPU-ffff0000-0000-0000-0000-00000000000f, which the GPU list does not show" in p for p in f.problems
    )


def test_a_topology_of_other_gpus_than_the_list_is_unknown() -> None:
    two = CommandResult(0, "".join(GPUS.splitlines(keepends=True)[:2]), "")
    f = facts_from_outputs(INV, NODE, outputs(gpus=two, apps=ok("")))  # the topology shows four GPUs
    assert [g.index for g in f.gpus] == [0, 1] and f.nvlink_domains is None
    assert facts_from_outputs(INV, NODE, outputs()).nvlink_domains == (
        (0, 1),
        (2, 3),
    )  # the same matrix, all four listed


def _texts(obj: object) -> list[str]:
    """Every string in a facts object, nested."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, (tuple, list, frozenset)):
        return [t for x in obj for t in _texts(x)]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in (*_texts(k), *_texts(v))]
    if hasattr(obj, "__dataclass_fields__"):
        return [t for name in obj.__dataclass_fields__ for t in _texts(getattr(obj, name))]
    return []


def test_a_hostile_node_cannot_put_terminal_escapes_on_the_operators_screen(tmp_path: Path) -> None:
    """A node's output reaches the operator's terminal (table, explanations, -v). ESC ] 52
    writes their clipboard, ESC c resets the terminal; the parsers' one-pass ANSI strip could
    even assemble a sequence ("ESC" + "ESC[0m" + "]52;..."). Every text is made printable."""
    from rich.console import Console

    from cluster_cli.cli import ui
    from cluster_cli.cli.discover import render
    from cluster_cli.state.store import Store

    inv = Inventory.model_validate({"nodes": [{"name": "g1", "host": "10.0.0.1"}]})
    uuid = "GPU-a253a8ad-1877-7c5b-5600-55eaf379e1f0"

    def bypass(body: str) -> str:
        return "\x1b\x1b[0m]" + body + "\x1b\x1b[0m\\"

    outs = {
        "gpus": CommandResult(
            0,
            f"0, {uuid}, NVIDIA {bypass('0;TITLE')}H200\x1bc\u009b2J, 143771, 0, 00000000:18:00.0, 0, Disabled, [N/A], No\n",
        ),
        "apps": CommandResult(0, f"{uuid}, 4411, 100, {bypass('52;c;cm0gLXJmIH4K')}python\n"),
        "topo": CommandResult(1, ""),
        "ibstat": CommandResult(0, "CA 'mlx5_\x1b]0;X\x07'\n\tCA type: MT4129\n\tPort 1:\n\t\tState: Active\n"),
        "cpus": CommandResult(0, "8\n"),
        "meminfo": CommandResult(0, "MemTotal: 1048576 kB\n"),
    }
    f = facts_from_outputs(inv, inv.nodes[0], outs)
    texts = _texts(f)
    assert not [t for t in texts if not t.isprintable()], texts
    assert any("\\x1b]52;c;" in t for t in texts)  # shown, escaped: the operator sees something odd was there
    console = Console(width=200, force_terminal=False, color_system=None)
    ui_out = ui.out
    ui.out = console
    try:
        with console.capture() as cap:
            render([f])
    finally:
        ui.out = ui_out
    assert "\x1b" not in cap.get() and "\u009b" not in cap.get()
    # Facts stored by an earlier version, with the raw bytes: cleaned when read back.
    raw = f.to_dict() | {"error": "ssh: \x1b]0;pwned\x07", "problems": ["\x1bc reset"]}
    with Store(tmp_path / "s.db") as s:
        s.save_discovery([f])
        s._b._db.execute("UPDATE nodes SET facts=?", (json.dumps(raw),))
        (back,) = s.nodes()
    assert all(t.isprintable() for t in _texts(back))
    assert back.error == "ssh: \\x1b]0;pwned\\x07"


# --- partial and failed probe outputs: cut-short lists, failed tools, lost GPUs, failed batches ---

TOPO_PAIR = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\t0-31\nGPU1\tNV12\t X \t0-31\n"


def test_a_gpu_list_cut_short_has_unknown_topology_even_where_topo_matches_it() -> None:
    first_two = "".join(GPUS.splitlines(keepends=True)[:2])
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(124, first_two, ""), topo=ok(TOPO_PAIR)))
    assert len(f.gpus) == 2 and f.nvlink_domains is None
    whole = facts_from_outputs(INV, NODE, outputs(gpus=ok(first_two), topo=ok(TOPO_PAIR)))
    assert whole.nvlink_domains == ((0, 1),)  # the same topology, read when the list is whole


def test_a_failed_topo_is_unknown_topology() -> None:
    first_two = "".join(GPUS.splitlines(keepends=True)[:2])
    f = facts_from_outputs(INV, NODE, outputs(gpus=ok(first_two), topo=CommandResult(1, TOPO_PAIR, "")))
    assert f.nvlink_domains is None


def test_a_node_whose_every_gpu_is_lost_lists_them_lost() -> None:
    lost = "Unable to determine the device handle for GPU 0000:CA:00.0: GPU is lost. Reboot the system to recover this GPU\n"
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(15, lost, ""), apps=CommandResult(15, lost, "")))
    assert [g.lost for g in f.gpus] == [True]
    assert "gpu: 1 GPU(s) lost" in f.problems


def test_ibstat_not_installed_is_no_ibstat_failure() -> None:
    f = facts_from_outputs(INV, NODE, outputs(ibstat=CommandResult(127, "", "sh: 1: ibstat: not found\n")))
    assert not any(p.startswith("ibstat:") for p in f.problems)
    assert "fabric: declared on ib-a but no Active InfiniBand port" in f.problems
    broken = facts_from_outputs(INV, NODE, outputs(ibstat=CommandResult(1, "ibpanic: no HCAs\n", "")))
    assert any(p.startswith("ibstat: failed (rc 1)") for p in broken.problems)


class _OneAnswer:
    """A session that answers the batch with ``(rc, stdout, stderr)``; ``stdout`` may name the
    batch's token as ``{tok}`` (read from the script it is sent)."""

    def __init__(self, rc: int | None, out: str, err: bytes = b"") -> None:
        self.rc, self.out, self.err = rc, out, err
        self.timeouts: list[float] = []

    async def run_raw(self, command: str, *, timeout: float, input: bytes | None = None):
        self.timeouts.append(timeout)
        script = (input or b"").decode()
        tok = script.split("@@CC ", 1)[1].split(" ", 1)[0] if "@@CC " in script else ""
        return self.rc, self.out.replace("{tok}", tok).encode(), self.err


class _Connector:
    def __init__(self, session: _OneAnswer) -> None:
        self.s = session

    @contextlib.asynccontextmanager
    async def session(self, target):
        yield self.s


def test_a_batch_that_failed_says_how() -> None:
    from cluster_cli.errors import SSHError
    from cluster_cli.probe.collect import run_batch

    with pytest.raises(SSHError, match=r"^probe script failed \(rc 255\): ssh: boom$"):
        asyncio.run(run_batch(_OneAnswer(255, "", b"ssh: boom\n"), {"a": "true"}, 10))
    with pytest.raises(SSHError, match=r"^probe script was killed by SIGKILL: no output$"):
        asyncio.run(run_batch(_OneAnswer(137, ""), {"a": "true"}, 10))
    # A login refused by a nologin shell, as sshd and nologin word it (user nobody): the cause
    # is nologin's line, not sshd's warning before it.
    err = b"Could not chdir to home directory /nonexistent: No such file or directory\nThis account is currently not available.\n"
    with pytest.raises(SSHError, match=r"^probe script failed \(rc 1\): This account is currently not available\.$"):
        asyncio.run(run_batch(_OneAnswer(1, "", err), {"a": "true"}, 10))


def test_a_killed_batch_keeps_the_records_it_finished() -> None:
    from cluster_cli.probe.collect import run_batch

    out = "@@CC {tok} RC\na 0\nb 0\n@@CC {tok} DATA\nfrom a\n@@CC {tok} SEP\n@@CC {tok} SEP\nhalf of b"
    res = asyncio.run(run_batch(_OneAnswer(143, out), {"a": "echo a", "b": "echo b"}, 10))
    assert (res["a"].rc, res["a"].stdout) == (0, "from a\n")
    assert res["b"].rc is None


def test_an_unreachable_nodes_error_is_made_printable_and_probes_fit_the_deadline() -> None:
    from cluster_cli.probe.collect import discover

    hostile = _OneAnswer(1, "", b"\x1b]52;c;aGk=\x07boom\n")
    (f,) = asyncio.run(discover(INV, connector=_Connector(hostile), node_timeout_s=5))
    assert not f.reachable and "\x1b" not in (f.error or "") and "boom" in (f.error or "")
    # The inventory's command timeout is 30 s; the node has 5 s: its probes get less than that.
    assert hostile.timeouts and hostile.timeouts[0] <= 5


def test_a_gpu_the_process_query_finds_lost_is_lost() -> None:
    """The process query runs beside the GPU list; when it is the one to find GPU 1 gone
    (by bus id), GPU 1 is lost, not free."""
    lost = "Unable to determine the device handle for GPU 0000:31:00.0: GPU is lost.  Reboot the system to recover this GPU\n"
    f = facts_from_outputs(INV, NODE, outputs(apps=CommandResult(15, APPS + lost, "")))
    by = {g.index: g for g in f.gpus}
    assert by[1].lost and not by[1].free
    assert [g.index for g in f.gpus if g.lost] == [1] and len(f.gpus) == 4
    assert "gpu: 1 GPU(s) lost" in f.problems
    # Named by index alone it is ambiguous: nothing is marked from it.
    by_index = "Unable to determine the device handle for GPU1: GPU is lost.\n"
    f = facts_from_outputs(INV, NODE, outputs(apps=CommandResult(15, APPS + by_index, "")))
    assert not any(g.lost for g in f.gpus)


def test_a_row_of_lost_cells_explains_a_non_zero_exit() -> None:
    """nvidia-smi exits non-zero for a GPU printed with ``[GPU is lost]`` cells: the rest of
    the list is whole, so the other GPUs stay usable and the NVLink domains known."""
    gpus = GPUS.replace(
        "1, GPU-aaaa0000-0000-0000-0000-000000000001, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:31:00.0, 2, Disabled, No, No",
        "1, GPU-aaaa0000-0000-0000-0000-000000000001, NVIDIA A100 80GB PCIe, [GPU is lost], [GPU is lost], "
        "00000000:31:00.0, [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost]",
    )
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(15, gpus, "")))
    by = {g.index: g for g in f.gpus}
    assert by[1].lost and by[0].free
    assert f.nvlink_domains == ((0, 1), (2, 3))
    assert not any("incomplete" in p for p in f.problems)


def test_a_broken_nvidia_smi_install_is_a_problem_not_a_cpu_node() -> None:
    err = "nvidia-smi: error while loading shared libraries: libnvidia-ml.so.1: cannot open shared object file\n"
    f = facts_from_outputs(INV, NODE, outputs(gpus=CommandResult(127, "", err)))
    assert f.gpus == () and f.nvlink_domains is None
    assert any(p.startswith("nvidia-smi:") and "libnvidia-ml" in p for p in f.problems)


def test_a_lost_gpu_is_counted_once_when_its_row_has_no_bus_id() -> None:
    """A row of ``[GPU is lost]`` cells (its bus id too) and the process query's line for the
    same GPU are one lost GPU, not two."""
    gpus = GPUS.replace(
        "1, GPU-aaaa0000-0000-0000-0000-000000000001, NVIDIA A100 80GB PCIe, 81920, 5, 00000000:31:00.0, 2, Disabled, No, No",
        "1, [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], [GPU is lost], "
        "[GPU is lost], [GPU is lost]",
    )
    lost = "Unable to determine the device handle for GPU 0000:31:00.0: GPU is lost.\n"
    f = facts_from_outputs(
        INV, NODE, outputs(gpus=CommandResult(15, gpus, ""), apps=CommandResult(15, APPS + lost, ""))
    )
    assert len(f.gpus) == 4 and [g.index for g in f.gpus if g.lost] == [1]
    assert "gpu: 1 GPU(s) lost" in f.problems


# ---- probes left out, their facts taken from the node's earlier ones -------------------

LEFT_OUT = ("cpus", "meminfo", "topo", "ibstat")


def _without(out: dict[str, CommandResult], names: set[str]) -> dict[str, CommandResult]:
    return {k: v for k, v in out.items() if k not in names}


@given(
    left=st.sets(st.sampled_from(LEFT_OUT)),
    cpu_node=st.booleans(),
    gpus_cut=st.booleans(),
)
def test_a_probe_left_out_gives_the_facts_that_running_it_gives(left: set[str], cpu_node: bool, gpus_cut: bool) -> None:
    """Left out, a probe's facts are the earlier ones: the same node, probed in full, and
    probed again without it, gives the same facts, whatever else it found."""
    missing = CommandResult(127, "", "sh: 1: nvidia-smi: not found\n")
    over: dict[str, CommandResult] = {}
    if cpu_node:
        over = {"gpus": missing, "apps": missing, "topo": missing}
    elif gpus_cut:
        over = {"gpus": CommandResult(124, GPUS.splitlines(keepends=True)[0], "")}
    full_out = outputs(**over)
    if cpu_node and "topo" in left:  # nvidia-smi found no GPU: it may be left out whole
        left = left | {"gpus", "apps"}
    sm = {("mlx5_0", 1): 0xABC}
    full = facts_from_outputs(INV, NODE, full_out, sm_guids=sm)
    again = facts_from_outputs(INV, NODE, _without(full_out, left), sm_guids=sm, earlier=full)
    assert again == full


def test_without_earlier_facts_a_probe_left_out_is_unknown() -> None:
    f = facts_from_outputs(INV, NODE, _without(outputs(), {"cpus", "meminfo", "topo"}))
    assert f.cpus is None and f.memory_mib is None and f.nvlink_domains is None
    assert {p.split(":")[0] for p in f.problems} == {"cpu", "memory"}


def test_an_earlier_topology_of_other_gpus_is_not_taken() -> None:
    full = facts_from_outputs(INV, NODE, outputs())
    swapped = GPUS.replace("0000-000000000001", "0000-0000000000ff")  # GPU 1 replaced
    f = facts_from_outputs(INV, NODE, _without(outputs(gpus=ok(swapped)), {"topo"}), earlier=full)
    assert full.nvlink_domains == ((0, 1), (2, 3)) and f.nvlink_domains is None
    same = facts_from_outputs(INV, NODE, _without(outputs(), {"topo"}), earlier=full)
    assert same.nvlink_domains == full.nvlink_domains


def test_earlier_ports_are_put_on_the_fabrics_the_inventory_declares_now() -> None:
    full = facts_from_outputs(INV, NODE, outputs())
    moved = Node(name="gpu-01", host="198.18.0.10", fabric="ib-b", hca_fabrics={"mlx5_1": "ib-a"})
    inv = Inventory(gpu_classes=INV.gpu_classes, fabrics=INV.fabrics, nodes=[moved])
    f = facts_from_outputs(inv, moved, _without(outputs(), {"ibstat"}), earlier=full)
    assert {h.ca: h.fabric for h in f.hcas} == {"mlx5_0": "ib-b", "mlx5_1": "ib-a", "mlx5_2": None}
    assert f.fabrics == {"ib-a", "ib-b"} and f.problems == ()
