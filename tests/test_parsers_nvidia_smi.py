"""Tests for cluster_cli.probe.parsers.nvidia_smi (query-gpu, compute-apps, failures, build_gpus)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fuzz import mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.facts import Gpu, GpuProcess
from cluster_cli.probe.commands import APP_FIELDS, GPU_FIELDS, OPTIONAL_GPU_FIELDS
from cluster_cli.probe.parsers.nvidia_smi import (
    FAILURE_KINDS,
    GpuRow,
    LostGpu,
    SmiFailure,
    build_gpus,
    classify_failure,
    normalize_pci_bus_id,
    parse_compute_apps,
    parse_lost,
    parse_query_gpu,
    unknown_field,
    unreadable_app_gpus,
    unreadable_gpu_rows,
    widen_query_gpu,
)

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
ZERO_UUID = "GPU-00000000-0000-0000-0000-000000000000"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def h200(i: int, bus: str, **kw: object) -> GpuRow:
    base: dict[str, object] = dict(
        index=i,
        uuid=f"GPU-00000000-0000-0000-0000-00000000000{i}",
        name="NVIDIA H200",
        memory_total_mib=143771,
        memory_used_mib=0,
        pci_bus_id=f"0000:{bus}:00.0",
        ecc_uncorrected=0,
        mig_mode=False,
        retired_pages_pending=None,
        remapped_rows_pending=False,
    )
    base.update(kw)
    return GpuRow(**base)  # type: ignore[arg-type]


H200_BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]
H200X8 = [h200(i, b) for i, b in enumerate(H200_BUSES)]

H100 = GpuRow(0, ZERO_UUID, "NVIDIA H100 80GB HBM3", 81559, 19818, "0000:00:09.0", 0, False, None, False)
H200_MIG = GpuRow(0, ZERO_UUID, "NVIDIA H200", 143771, 16959, "0000:83:00.0", 0, True, None, None)
L40S = GpuRow(0, ZERO_UUID, "NVIDIA L40S", 46068, 1235, "0000:01:00.0", 0, None, None, False)
GB10 = GpuRow(0, ZERO_UUID, "NVIDIA GB10", None, None, "000f:01:00.0", None, None, None, None)

LOST_VARIANTS = [
    LostGpu("0000:0b:00.0", None, "Unable to determine the device handle for GPU 0000:0B:00.0: Unknown Error"),
    LostGpu("0000:a1:00.0", None, "Unable to determine the device handle for GPU0000:A1:00.0: Unknown Error"),
    LostGpu(
        "0000:02:00.0",
        None,
        "Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost. "
        "Reboot the system to recover this GPU",
    ),
    LostGpu("0000:34:00.0", 1, "Unable to determine the device handle for GPU1: 0000:34:00.0: Unknown Error"),
]
LOST_GPU3 = LostGpu(
    "0000:5d:00.0",
    None,
    "Unable to determine the device handle for GPU 00000000:5D:00.0: GPU is lost. "
    "Reboot the system to recover this GPU",
)


def klass(name: str) -> str:
    return name.split()[-1].lower() if name else "unknown"


# ----------------------------------------------------------------------------- query-gpu


@pytest.mark.parametrize(
    ("fixture", "rows", "lost"),
    [
        ("nvidia-smi-query-gpu.h100x1.DERIVED.csv", [H100], []),
        ("nvidia-smi-query-gpu.h200-mig.DERIVED.csv", [H200_MIG], []),
        ("nvidia-smi-query-gpu.l40s.DERIVED.csv", [L40S], []),
        ("nvidia-smi-query-gpu.gb10.DERIVED.csv", [GB10], []),
        ("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv", H200X8, []),
        ("nvidia-smi-query-gpu.hgx-h200x8-gpu3-lost.DERIVED.txt", H200X8[:3] + H200X8[4:], [LOST_GPU3]),
        ("nvidia-smi.err.gpu-lost.variants.txt", [], LOST_VARIANTS),
        # Captures in other column lists / formats must not be misread as our rows.
        ("nvidia-smi-query-gpu.hgx-h200x8.csv", [], []),
        ("nvidia-smi-query-gpu.gb10-unified-memory.csv", [], []),
        ("nvidia-smi-query-gpu.rtx2080ti-unknown-error.csv", [], []),
        ("nvidia-smi-query-gpu.h100x1.projected-noheader-nounits.csv", [], []),
        ("nvidia-smi-query-gpu.h100x1.allfields.csv", [], []),
        ("nvidia-smi.err.no-devices.txt", [], []),
        ("nvidia-smi.err.driver-library-mismatch.drv535.txt", [], []),
        ("nvidia-smi-query-compute-apps.h100x1.load.DERIVED.csv", [], []),
    ],
)
def test_parse_query_gpu_fixtures(fixture: str, rows: list[GpuRow], lost: list[LostGpu]) -> None:
    assert parse_query_gpu(fx(fixture)) == (rows, lost)


def test_query_gpu_h200x8_matches_capture_columns() -> None:
    """The derived 8-GPU file agrees with the real capture on index, name and memory.total."""
    rows, _ = parse_query_gpu(fx("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv"))
    captured = [ln.split(", ") for ln in fx("nvidia-smi-query-gpu.hgx-h200x8.csv").splitlines()[1:]]
    assert [(r.index, r.name, r.memory_total_mib) for r in rows] == [
        (int(c[0]), c[1], int(c[2].removesuffix(" MiB"))) for c in captured
    ]


def test_projected_captures_agree_with_derived() -> None:
    """The derived rows carry exactly the values of the projected real rows."""
    for g, row in [("h100x1", H100), ("h200-mig", H200_MIG), ("l40s", L40S)]:
        cells = fx(f"nvidia-smi-query-gpu.{g}.projected-noheader-nounits.csv").strip().split(", ")
        # projected order: ..., mig.mode.current(7), ..., remapped_rows.pending(10), retired_pages.pending(11)
        reordered = ", ".join([*cells[:8], cells[11], cells[10]])
        assert parse_query_gpu(reordered) == ([row], [])


def test_query_gpu_header_line_and_crlf_are_tolerated() -> None:
    header = ", ".join(GPU_FIELDS)
    text = header + "\r\n" + fx("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv").replace("\n", "\r\n")
    assert parse_query_gpu(text) == (H200X8, [])


def test_query_gpu_without_nounits() -> None:
    line = f"0, {ZERO_UUID}, NVIDIA H100 80GB HBM3, 81559 MiB, 19818 MiB, 00000000:00:09.0, 0, Disabled, [N/A], No"
    assert parse_query_gpu(line) == ([H100], [])


def test_query_gpu_name_with_comma() -> None:
    line = "3, GPU-abc, Weird, Inc. GPU, 100, 5, 00000000:0A:00.0, 2, Enabled, Yes, Yes"
    (row,), lost = parse_query_gpu(line)
    assert lost == []
    assert row == GpuRow(3, "GPU-abc", "Weird, Inc. GPU", 100, 5, "0000:0a:00.0", 2, True, True, True)


def test_query_gpu_values_and_ansi() -> None:
    line = "\x1b[1m1, GPU-x, A100, [Unknown Error], , 0000:3B:00.0, [Not Supported], N/A, no, YES\x1b[0m"
    assert parse_query_gpu(line) == (
        [GpuRow(1, "GPU-x", "A100", None, None, "0000:3b:00.0", None, None, False, True)],
        [],
    )


def _non_numeric_cells() -> list[str]:
    """Every non-numeric value that appears in the real all-fields captures (plus rtx/GB10 tokens)."""
    cells: set[str] = set()
    for g in ("h100x1", "h200-mig", "l40s"):
        data = fx(f"nvidia-smi-query-gpu.{g}.allfields.csv").splitlines()[1]
        cells.update(c.strip() for c in data.split(", "))
    cells.add(fx("nvidia-smi-query-gpu.rtx2080ti-unknown-error.csv").splitlines()[1].split(", ")[-1])
    cells.update(fx("nvidia-smi-query-gpu.gb10-unified-memory.csv").splitlines()[1].split(", "))
    cells.update({"[Not Supported]", "[Insufficient Permissions]", "N/A", ""})
    return sorted(c for c in cells if not re.fullmatch(r"[0-9]+(?: [A-Za-z%]+)?", c) and "," not in c)


NON_NUMERIC = _non_numeric_cells()


def test_non_numeric_capture_cells_are_listed() -> None:
    for token in ("[N/A]", "[Unknown Error]", "[Requested functionality has been deprecated]", "N/A", ""):
        assert token in NON_NUMERIC


@pytest.mark.parametrize("cell", NON_NUMERIC)
def test_non_numeric_cells_become_none(cell: str) -> None:
    """Any value that is not a plain number is missing, never int()-ed."""
    line = f"0, {ZERO_UUID}, X, {cell}, {cell}, 00000000:00:09.0, {cell}, {cell}, {cell}, {cell}"
    (row,), _ = parse_query_gpu(line)
    assert row.memory_total_mib is None and row.memory_used_mib is None and row.ecc_uncorrected is None
    assert row.mig_mode == {"Enabled": True, "Disabled": False}.get(cell)
    assert row.retired_pages_pending == {"Yes": True, "No": False}.get(cell)
    assert row.remapped_rows_pending == {"Yes": True, "No": False}.get(cell)


def test_unknown_error_fixture_token_in_our_row() -> None:
    token = fx("nvidia-smi-query-gpu.rtx2080ti-unknown-error.csv").splitlines()[1].split(", ")[-1]
    assert token == "[Unknown Error]"
    line = fx("nvidia-smi-query-gpu.h100x1.DERIVED.csv").replace(", 0, Disabled", f", {token}, Disabled")
    (row,), _ = parse_query_gpu(line)
    assert row.ecc_uncorrected is None and row.memory_total_mib == 81559


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("00000000:83:00.0", "0000:83:00.0"),
        ("0000000F:01:00.0", "000f:01:00.0"),
        ("0000:0B:00.0", "0000:0b:00.0"),
        ("3b:00.0", "0000:3b:00.0"),
        ("00010000:E1:1F.7", "10000:e1:1f.7"),
        (" 00000000:00:09.0 ", "0000:00:09.0"),
        ("[N/A]", None),
        ("", None),
        ("0000:83:00.8", None),
        ("00000000:83:00", None),
        (None, None),
    ],
)
def test_normalize_pci_bus_id(raw: str | None, norm: str | None) -> None:
    assert normalize_pci_bus_id(raw) == norm


def test_pci_ids_join_across_formats() -> None:
    """query-gpu (8-digit domain), compute-apps gpu_bus_id and lost lines all normalize alike."""
    (row,), _ = parse_query_gpu(fx("nvidia-smi-query-gpu.h200-mig.DERIVED.csv"))
    apps_bus = fx("nvidia-smi-query-compute-apps.h200-mig.load.csv").splitlines()[1].split(", ")[2]
    assert normalize_pci_bus_id(apps_bus) == row.pci_bus_id == "0000:83:00.0"


# ----------------------------------------------------------------------------- compute-apps


def procs(uuid: str, *items: tuple[int, int | None, str]) -> list[GpuProcess]:
    return [GpuProcess(pid=p, name=n, gpu_uuid=uuid, used_mib=m) for p, m, n in items]


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "nvidia-smi-query-compute-apps.h100x1.load.DERIVED.csv",
            procs(
                ZERO_UUID,
                (11327, 2566, "/root/tools/memhog"),
                (11328, 1542, "/root/tools/memhog"),
                (11345, 15690, "./gpu_burn"),
            ),
        ),
        (
            "nvidia-smi-query-compute-apps.h200-mig.load.DERIVED.csv",
            procs(
                ZERO_UUID,
                (12249, 2194, "/root/tools/memhog"),
                (12250, 1170, "/root/tools/memhog"),
                (12267, 13526, "./gpu_burn"),
            ),
        ),
        (
            "nvidia-smi-query-compute-apps.l40s.load.DERIVED.csv",
            procs(ZERO_UUID, (20037, 538, "ffmpeg"), (20038, 681, "ffmpeg")),
        ),
        # header only (idle) -> nothing
        ("nvidia-smi-query-compute-apps.h100x1.idle.csv", []),
        ("nvidia-smi-query-compute-apps.h200-mig.idle.csv", []),
        ("nvidia-smi-query-compute-apps.l40s.idle.csv", []),
        # a different column list is not misread
        ("nvidia-smi-query-compute-apps.h100x1.load.csv", []),
        ("nvidia-smi.err.gpu-lost.variants.txt", []),
        ("nvidia-smi.err.no-driver.txt", []),
        ("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv", []),
    ],
)
def test_parse_compute_apps_fixtures(fixture: str, expected: list[GpuProcess]) -> None:
    assert parse_compute_apps(fx(fixture)) == expected


def test_compute_apps_derived_matches_capture() -> None:
    """Same pids, names and memory as the real (differently ordered, with units) capture."""
    for g in ("h100x1", "h200-mig", "l40s"):
        captured = [ln.split(", ") for ln in fx(f"nvidia-smi-query-compute-apps.{g}.load.csv").splitlines()[1:]]
        parsed = parse_compute_apps(fx(f"nvidia-smi-query-compute-apps.{g}.load.DERIVED.csv"))
        assert [(p.gpu_uuid, p.pid, p.name, p.used_mib) for p in parsed] == [
            (c[4], int(c[5]), c[6], int(c[7].removesuffix(" MiB"))) for c in captured
        ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("\n\n", []),
        (", ".join(APP_FIELDS), []),
        ("gpu_uuid, pid, used_gpu_memory [MiB], process_name", []),
        ("GPU-a, 7, 10, python3 -c import a, b, c", procs("GPU-a", (7, 10, "python3 -c import a, b, c"))),
        ("GPU-a, 7, [N/A], /opt/my app/bin/serve", procs("GPU-a", (7, None, "/opt/my app/bin/serve"))),
        ("GPU-a, 7, 10 MiB, x", procs("GPU-a", (7, 10, "x"))),
        ("GPU-a, 7, 10, ", procs("GPU-a", (7, 10, ""))),
        ("GPU-a, 7, 10", procs("GPU-a", (7, 10, ""))),  # cut short after the pid: still a process
        ("GPU-a, 7", procs("GPU-a", (7, None, ""))),
        ("GPU-a, -7, 10, x", []),
        (", 7, 10, x", []),
        ("GPU-a, ², 10, x", []),
        ("GPU-a, 7, 10, x\r\nGPU-b, 8, 0, y\r\n", procs("GPU-a", (7, 10, "x")) + procs("GPU-b", (8, 0, "y"))),
    ],
)
def test_parse_compute_apps_cases(text: str, expected: list[GpuProcess]) -> None:
    assert parse_compute_apps(text) == expected


# ----------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("fixture", "rc", "kind"),
    [
        ("nvidia-smi.err.command-not-found.ssh-bash.txt", 127, "missing"),
        ("nvidia-smi.err.command-not-found.ssh-bash.txt", None, "missing"),
        ("nvidia-smi.err.driver-library-mismatch.drv535.txt", 18, "driver-mismatch"),
        ("nvidia-smi.err.driver-library-mismatch.drv535.txt", None, "driver-mismatch"),
        ("nvidia-smi.err.driver-library-mismatch.drv470.txt", 18, "driver-mismatch"),
        ("nvidia-smi.err.driver-library-mismatch.drv470.txt", 0, "driver-mismatch"),
        ("nvidia-smi.err.no-driver.txt", 9, "no-driver"),
        ("nvidia-smi.err.no-driver.txt", 255, "no-driver"),
        ("nvidia-smi.err.no-devices.txt", 6, "no-devices"),
        ("nvidia-smi.err.no-devices.txt", 0, "no-devices"),
    ],
)
def test_classify_failure_fixtures(fixture: str, rc: int | None, kind: str) -> None:
    failure = classify_failure(rc, fx(fixture))
    assert failure is not None
    assert failure.kind == kind and failure.rc == rc
    assert "\n" not in failure.message and failure.message == failure.message.strip()
    assert failure.message.startswith(fx(fixture).splitlines()[0])


def test_classify_failure_mismatch_message_is_one_line() -> None:
    failure = classify_failure(18, fx("nvidia-smi.err.driver-library-mismatch.drv535.txt"))
    assert failure == SmiFailure(
        "driver-mismatch",
        18,
        "Failed to initialize NVML: Driver/library version mismatch; NVML library version: 535.161",
    )


@pytest.mark.parametrize(
    ("rc", "output", "expected"),
    [
        (0, fx("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv"), None),
        (0, "", None),  # compute-apps with noheader and nothing running
        (0, fx("nvidia-smi-topo-m.hgx-h200x8-8nic.txt"), None),
        (0, fx("nvidia-smi-query-compute-apps.h100x1.load.DERIVED.csv"), None),
        # lost-GPU lines alone are not a whole failure, whatever rc says
        (15, fx("nvidia-smi.err.gpu-lost.variants.txt"), None),
        (0, fx("nvidia-smi-query-gpu.hgx-h200x8-gpu3-lost.DERIVED.txt"), None),
        (255, fx("nvidia-smi-query-gpu.hgx-h200x8-gpu3-lost.DERIVED.txt"), None),
        (None, fx("nvidia-smi-query-gpu.hgx-h200x8.DERIVED.csv"), None),
        (127, "", SmiFailure("missing", 127, "nvidia-smi not found (rc 127)")),
        (127, "sh: 1: nvidia-smi: not found\n", SmiFailure("missing", 127, "sh: 1: nvidia-smi: not found")),
        (
            None,
            "zsh:1: command not found: nvidia-smi",
            SmiFailure("missing", None, "zsh:1: command not found: nvidia-smi"),
        ),
        (
            126,
            "bash: /usr/bin/nvidia-smi: No such file or directory",
            SmiFailure("missing", 126, "bash: /usr/bin/nvidia-smi: No such file or directory"),
        ),
        (9, "", SmiFailure("no-driver", 9, "NVIDIA driver not loaded (nvidia-smi cannot talk to it) (rc 9)")),
        (6, "", SmiFailure("no-devices", 6, "no NVIDIA devices found (rc 6)")),
        (
            255,
            "Failed to initialize NVML: Unknown Error",
            SmiFailure("failed", 255, "nvidia-smi exited with rc 255: Failed to initialize NVML: Unknown Error"),
        ),
        (2, "", SmiFailure("failed", 2, "nvidia-smi exited with rc 2")),
        (
            2,
            'Field "foo" is not a valid field to query.\n\n',
            SmiFailure("failed", 2, 'nvidia-smi exited with rc 2: Field "foo" is not a valid field to query.'),
        ),
        (None, "", SmiFailure("failed", None, "nvidia-smi gave no exit status and no output")),
        # a process name that mentions "not found" is data, not an error
        (0, "GPU-a, 7, 10, /opt/nvidia-smi not found/x", None),
    ],
)
def test_classify_failure_cases(rc: int | None, output: str, expected: SmiFailure | None) -> None:
    assert classify_failure(rc, output) == expected


# ----------------------------------------------------------------------------- build_gpus


def test_build_gpus_h100_with_foreign_processes() -> None:
    rows, lost = parse_query_gpu(fx("nvidia-smi-query-gpu.h100x1.DERIVED.csv"))
    apps = parse_compute_apps(fx("nvidia-smi-query-compute-apps.h100x1.load.DERIVED.csv"))
    (gpu,) = build_gpus(rows, apps, lost, gpu_class=klass, own_pids=frozenset({11327}))
    assert gpu == Gpu(
        index=0,
        uuid=ZERO_UUID,
        product="NVIDIA H100 80GB HBM3",
        gpu_class="hbm3",
        memory_total_mib=81559,
        memory_used_mib=19818,
        pci_bus_id="0000:00:09.0",
        ecc_uncorrected=0,
        retired_pages_pending=None,
        remapped_rows_pending=False,
        mig_mode=False,
        lost=False,
        processes=tuple(apps),
        problems=("foreign-process: pid 11328 (/root/tools/memhog)", "foreign-process: pid 11345 (./gpu_burn)"),
    )
    assert gpu.healthy and not gpu.free


def test_build_gpus_h200_mig_joins_parent_uuid() -> None:
    rows, lost = parse_query_gpu(fx("nvidia-smi-query-gpu.h200-mig.DERIVED.csv"))
    apps = parse_compute_apps(fx("nvidia-smi-query-compute-apps.h200-mig.load.DERIVED.csv"))
    own = frozenset(p.pid for p in apps)
    (gpu,) = build_gpus(rows, apps, lost, gpu_class=klass, own_pids=own)
    assert gpu.mig_mode is True and len(gpu.processes) == 3
    assert gpu.problems == ("mig: MIG mode enabled",)
    assert gpu.healthy and not gpu.free


def test_build_gpus_idle_l40s_is_free() -> None:
    rows, lost = parse_query_gpu(fx("nvidia-smi-query-gpu.l40s.DERIVED.csv"))
    (gpu,) = build_gpus(rows, parse_compute_apps(""), lost, gpu_class=klass)
    assert gpu.free and gpu.problems == () and gpu.gpu_class == "l40s"


def test_build_gpus_lost_gpu_on_h200x8() -> None:
    rows, lost = parse_query_gpu(fx("nvidia-smi-query-gpu.hgx-h200x8-gpu3-lost.DERIVED.txt"))
    gpus = build_gpus(rows, [], lost, gpu_class=klass)
    # The lost GPU takes the gap in the indices (nvidia-smi numbers GPUs 0..N-1 in PCI order).
    assert [g.index for g in gpus] == [0, 1, 2, 3, 4, 5, 6, 7]
    gone = gpus[3]
    assert gone == Gpu(
        index=3,
        uuid="",
        product="unknown",
        gpu_class="unknown",
        pci_bus_id="0000:5d:00.0",
        lost=True,
        problems=(f"lost: {LOST_GPU3.message}",),
    )
    assert not gone.healthy
    assert all(g.free for g in gpus if not g.lost)
    # In the JSON (discover -o json, the state store) what nvidia-smi could not read is null,
    # and it reads back as the same GPU.
    d = gone.to_dict()
    assert (d["product"], d["class"], d["uuid"]) == (None, None, None)
    assert Gpu.from_dict(d) == gone
    assert gpus[2].to_dict()["class"] == gpus[2].gpu_class != "unknown"


def test_build_gpus_lost_variants_index_assignment() -> None:
    gpus = build_gpus([], [], LOST_VARIANTS, gpu_class=klass)
    # GPU1: names its index; the others fill the free indices in PCI bus order.
    assert [(g.index, g.pci_bus_id) for g in gpus] == [
        (0, "0000:02:00.0"),
        (1, "0000:34:00.0"),
        (2, "0000:0b:00.0"),
        (3, "0000:a1:00.0"),
    ]
    assert all(g.lost and g.problems[0].startswith("lost: Unable") for g in gpus)


def test_build_gpus_lost_named_index_taken_by_row() -> None:
    rows = [h200(1, "2a")]
    lost = [LostGpu("0000:34:00.0", 1, "x"), LostGpu(None, 5, "y"), LostGpu(None, None, "z")]
    gpus = build_gpus(rows, [], lost, gpu_class=klass)
    # x names index 1, which a row holds: it and z take the gaps (no bus id sorts first).
    assert [(g.index, g.lost, g.problems) for g in gpus] == [
        (0, True, ("lost: z",)),
        (1, False, ()),
        (2, True, ("lost: x",)),
        (5, True, ("lost: y",)),
    ]


def test_build_gpus_lost_matching_row_marks_row_and_dedupes() -> None:
    rows = H200X8[:2]
    lost = [LostGpu("0000:2a:00.0", None, "m"), LostGpu("0000:2a:00.0", None, "m again")]
    gpus = build_gpus(rows, [], lost, gpu_class=klass)
    assert len(gpus) == 2
    assert gpus[1].lost and gpus[1].problems == ("lost: m",) and gpus[1].uuid == rows[1].uuid
    assert not gpus[1].healthy and gpus[0].free


def test_build_gpus_joins_by_uuid_not_index() -> None:
    rows = [h200(0, "18", uuid="GPU-b"), h200(1, "2a", uuid="GPU-a")]
    apps = [GpuProcess(4411, "python3", "GPU-a", 100), GpuProcess(9, "orphan", "GPU-zzz", 1)]
    gpus = build_gpus(list(reversed(rows)), apps, [], gpu_class=klass)
    assert [g.uuid for g in gpus] == ["GPU-b", "GPU-a"]
    assert gpus[0].processes == () and gpus[0].free
    assert gpus[1].processes == (apps[0],)
    assert gpus[1].problems == ("foreign-process: pid 4411 (python3)",)


def test_build_gpus_problem_strings_and_order() -> None:
    row = h200(0, "18", ecc_uncorrected=3, retired_pages_pending=True, remapped_rows_pending=True, mig_mode=True)
    apps = [GpuProcess(4411, "python3", row.uuid), GpuProcess(5, "", row.uuid), GpuProcess(6, "mine", row.uuid)]
    (gpu,) = build_gpus([row], apps, [LostGpu("0000:18:00.0", 0, "gone")], gpu_class=klass, own_pids=frozenset({6}))
    assert gpu.problems == (
        "ecc: 3 uncorrected ECC errors",
        "retired-pages: page retirement pending",
        "remap: row remap pending",
        "lost: gone",
        "foreign-process: pid 4411 (python3)",
        "foreign-process: pid 5",
        "mig: MIG mode enabled",
    )
    assert [p.split(" ", 1)[0] for p in gpu.problems] == [
        "ecc:",
        "retired-pages:",
        "remap:",
        "lost:",
        "foreign-process:",
        "foreign-process:",
        "mig:",
    ]
    one = build_gpus([h200(0, "18", ecc_uncorrected=1)], [], [], gpu_class=klass)[0]
    assert one.problems == ("ecc: 1 uncorrected ECC error",) and not one.healthy


def test_build_gpus_unknown_health_is_not_a_problem() -> None:
    (gpu,) = build_gpus(parse_query_gpu(fx("nvidia-smi-query-gpu.gb10.DERIVED.csv"))[0], [], [], gpu_class=klass)
    assert gpu.free and gpu.memory_total_mib is None and gpu.pci_bus_id == "000f:01:00.0"


def test_build_gpus_sorted_and_gpu_class_called_with_product() -> None:
    seen: list[str] = []

    def cls(name: str) -> str:
        seen.append(name)
        return "c"

    rows = [h200(5, "18"), h200(2, "2a", name="NVIDIA L40S")]
    gpus = build_gpus(rows, [], [], gpu_class=cls)
    assert [g.index for g in gpus] == [2, 5]
    assert sorted(seen) == ["NVIDIA H200", "NVIDIA L40S"]


# ----------------------------------------------------------------------------- properties

_TOKENS = ["[N/A]", "[Not Supported]", "[Unknown Error]", "N/A", ""]
_name_chars = st.characters(categories=["L", "N"], include_characters=" -_()./,")
_int_or_none = st.one_of(st.none(), st.integers(0, 2**40))


@st.composite
def gpu_rows(draw: st.DrawFn) -> GpuRow:
    name = draw(st.text(_name_chars, max_size=30)).strip()
    uuid = draw(st.text(st.characters(categories=["L", "N"], include_characters="-"), min_size=1, max_size=40))
    return GpuRow(
        index=draw(st.integers(0, 10**6)),
        uuid=uuid,
        name=name,
        memory_total_mib=draw(_int_or_none),
        memory_used_mib=draw(_int_or_none),
        pci_bus_id=draw(
            st.builds(
                lambda d, b, v, f: f"{d:04x}:{b:02x}:{v:02x}.{f}",
                st.integers(0, 0xFFFF),
                st.integers(0, 255),
                st.integers(0, 31),
                st.integers(0, 7),
            )
        ),
        ecc_uncorrected=draw(_int_or_none),
        mig_mode=draw(st.one_of(st.none(), st.booleans())),
        retired_pages_pending=draw(st.one_of(st.none(), st.booleans())),
        remapped_rows_pending=draw(st.one_of(st.none(), st.booleans())),
    )


def render_row(draw: st.DrawFn, r: GpuRow) -> str:
    """Render as nvidia-smi would, with random missing-value tokens and case/width variations."""

    def num(v: int | None) -> str:
        return str(v) if v is not None else draw(st.sampled_from(_TOKENS))

    def flag(v: bool | None, yes: str, no: str) -> str:
        return (yes if v else no) if v is not None else draw(st.sampled_from(_TOKENS))

    assert r.pci_bus_id
    dom, rest = r.pci_bus_id.split(":", 1)
    pci = draw(st.sampled_from([f"{int(dom, 16):08X}:{rest.upper()}", r.pci_bus_id]))
    cells = [
        str(r.index),
        r.uuid,
        r.name,
        num(r.memory_total_mib),
        num(r.memory_used_mib),
        pci,
        num(r.ecc_uncorrected),
        flag(r.mig_mode, "Enabled", "Disabled"),
        flag(r.retired_pages_pending, "Yes", "No"),
        flag(r.remapped_rows_pending, "Yes", "No"),
    ]
    return ", ".join(cells)


@FUZZ
@given(st.data(), st.lists(gpu_rows(), max_size=8))
def test_render_parse_roundtrip(data: st.DataObject, rows: list[GpuRow]) -> None:
    text = "\n".join(render_row(data.draw, r) for r in rows)
    newline = data.draw(st.sampled_from(["\n", "\r\n"]))
    assert parse_query_gpu(text.replace("\n", newline) + newline) == (rows, [])


@FUZZ
@given(
    st.lists(
        st.builds(
            GpuProcess,
            pid=st.integers(0, 2**31),
            name=st.text(_name_chars, max_size=40).map(str.strip),
            gpu_uuid=st.text(st.characters(categories=["L", "N"], include_characters="-"), min_size=1, max_size=40),
            used_mib=_int_or_none,
        ),
        max_size=10,
    )
)
def test_compute_apps_roundtrip(items: list[GpuProcess]) -> None:
    text = "\n".join(f"{p.gpu_uuid}, {p.pid}, {'[N/A]' if p.used_mib is None else p.used_mib}, {p.name}" for p in items)
    assert parse_compute_apps(text) == items


@FUZZ
@given(st.integers(0, 999), st.integers(0, 0xFFFF), st.integers(0, 255), st.integers(0, 31), st.integers(0, 7))
def test_lost_line_spellings_roundtrip(index: int, dom: int, bus: int, dev: int, fn: int) -> None:
    want = f"{dom:04x}:{bus:02x}:{dev:02x}.{fn}"
    pci = f"{dom:08X}:{bus:02X}:{dev:02X}.{fn}"
    head = "Unable to determine the device handle for "
    _, lost = parse_query_gpu(
        f"{head}GPU {pci}: Unknown Error\n{head}GPU{pci}: Unknown Error\n{head}GPU{index}: {pci}: Unknown Error"
    )
    assert [(g.pci_bus_id, g.index) for g in lost] == [(want, None), (want, None), (want, index)]


def _fixture_texts() -> list[str]:
    return [p.read_text(errors="replace") for p in sorted(FIXTURES.glob("nvidia-smi*"))]


TEXTS = _fixture_texts()


def _check_all(text: str, rc: int | None) -> None:
    rows, lost = parse_query_gpu(text)
    assert all(isinstance(r, GpuRow) and r.index >= 0 for r in rows)
    for r in rows:
        assert r.pci_bus_id is None or normalize_pci_bus_id(r.pci_bus_id) == r.pci_bus_id
    assert all(isinstance(g, LostGpu) and "\n" not in g.message for g in lost)
    apps = parse_compute_apps(text)
    assert all(isinstance(p, GpuProcess) and p.pid >= 0 and p.gpu_uuid for p in apps)
    failure = classify_failure(rc, text)
    if failure is not None:
        assert failure.kind in FAILURE_KINDS
        assert failure.message and failure.message.isprintable() and len(failure.message) <= 300
    gpus = build_gpus(rows, apps, lost, gpu_class=klass)
    assert [g.index for g in gpus] == sorted(g.index for g in gpus)
    if len({r.index for r in rows}) == len(rows):
        assert len({g.index for g in gpus}) == len(gpus)


@FUZZ
@given(st.text(), st.one_of(st.none(), st.integers(-300, 300)))
def test_never_raises_on_text(text: str, rc: int | None) -> None:
    _check_all(text, rc)


@FUZZ
@given(mutated(TEXTS), st.one_of(st.none(), st.sampled_from([0, 2, 6, 9, 15, 18, 127, 255])))
def test_never_raises_on_mutated_fixtures(text: str, rc: int | None) -> None:
    _check_all(text, rc)


@FUZZ
@given(st.binary(max_size=300))
def test_never_raises_on_binaryish(blob: bytes) -> None:
    _check_all(blob.decode("latin-1"), 0)


def test_non_string_input_is_empty() -> None:
    assert parse_query_gpu(None) == ([], [])  # type: ignore[arg-type]
    assert parse_compute_apps(b"GPU-a, 1, 2, x") == []  # type: ignore[arg-type]
    assert classify_failure(0, None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("GPU-a, 7, 10, x\n", []),
        ("GPU-a, 7\n", []),  # parsed (cut after the pid)
        ("GPU-abc-1, [N/A], [N/A], [N/A]\n", ["GPU-abc-1"]),
        ("GPU-abc-1, 4\u00b2\n", ["GPU-abc-1"]),
        ("GPU-ab", ["GPU-ab"]),  # a UUID-looking cell alone: which GPU it is stays a guess
        ("GPU-ab, \n", ["GPU-ab"]),
        ("GPU-\u00e9\u00e9, [N/A]\n", [""]),  # names no readable UUID
        ("No running processes found\n", []),
        ("WARNING: infoROM is corrupted at gpu 0000:81:00.0\n", []),
    ],
)
def test_unreadable_app_rows(text: str, expected: list[str]) -> None:
    assert unreadable_app_gpus(text) == expected


def test_unreadable_gpu_rows_counts_cut_and_repeated_rows() -> None:
    lines = [f"{i}, GPU-{i:08x}, NVIDIA H200, 143771, 0, 00000000:{0x18 + i:02X}:00.0, 0, Disabled, No, No"
             for i in range(4)]  # fmt: skip
    whole = "\n".join(lines) + "\n"
    assert len(parse_query_gpu(whole)[0]) == 4 and unreadable_gpu_rows(whole) == 0
    assert unreadable_gpu_rows("\n".join(lines[:-1]) + "\n" + lines[-1][:12]) == 1  # the last row cut
    assert unreadable_gpu_rows("\n".join([lines[0], lines[1][:30], lines[2]])) == 1  # one cut in the middle
    assert unreadable_gpu_rows("\n".join([lines[0], lines[0]])) == 1  # an index repeated
    assert unreadable_gpu_rows("") == 0
    assert unreadable_gpu_rows("WARNING: infoROM is corrupted at gpu 0000:81:00.0\n" + whole) == 0


@FUZZ
@given(st.text(max_size=400))
def test_unreadable_helpers_never_raise(text: str) -> None:
    assert unreadable_gpu_rows(text) >= 0
    assert all(isinstance(u, str) for u in unreadable_app_gpus(text))


def test_a_hung_nvidia_smi_is_said_to_have_been_killed_not_to_have_exited() -> None:
    failure = classify_failure(124, "probe timed out\n")  # the batch watchdog's rc and note
    assert failure is not None and failure.kind == "failed"
    assert failure.message == "nvidia-smi did not answer within the probe timeout and was killed"


# ----------------------------------------------------------------------------- fault cells

_A100 = "NVIDIA A100-SXM4-80GB"


def _fault_row(index: int, bus: str, token: str, *, name: str = _A100, uuid: str | None = None) -> str:
    uuid = uuid or f"GPU-{index:08x}-0000-0000-0000-000000000000"
    return f"{index}, {uuid}, {name}, {token}, {token}, 00000000:{bus}:00.0, {token}, {token}, {token}, {token}"


def _gpus(text: str) -> dict[int, Gpu]:
    rows, lost = parse_query_gpu(text)
    return {g.index: g for g in build_gpus(rows, [], lost, gpu_class=lambda n: n.removeprefix("NVIDIA "))}


def test_a_row_of_lost_cells_is_a_lost_gpu() -> None:
    """nvidia-smi still prints the row of a GPU that fell off the bus, with ``[GPU is lost]``
    in its value cells: that GPU is lost, not free with unknown health."""
    healthy = "0, GPU-00000000-0000-0000-0000-000000000000, NVIDIA A100-SXM4-80GB, 81920, 5, 00000000:07:00.0, 0, Disabled, No, No"
    by = _gpus(healthy + "\n" + _fault_row(1, "0B", "[GPU is lost]") + "\n")
    assert by[0].free and not by[0].lost
    assert by[1].lost and not by[1].healthy and not by[1].free
    assert by[1].problems == ("lost: nvidia-smi reports the GPU is lost",)
    assert by[1].product == _A100 and by[1].pci_bus_id == "0000:0b:00.0"


def test_a_lost_row_without_a_name_or_uuid_has_no_product() -> None:
    (g,) = _gpus(_fault_row(3, "0D", "[GPU is lost]", name="[GPU is lost]", uuid="[GPU is lost]")).values()
    assert g.lost and g.uuid == ""
    d = g.to_dict()
    assert d["product"] is None and d["class"] is None and d["uuid"] is None


def test_a_gpu_that_requires_a_reset_is_unhealthy() -> None:
    (g,) = _gpus(_fault_row(2, "0C", "[GPU requires reset]")).values()
    assert not g.lost and not g.healthy and not g.free
    assert g.problems == ("unhealthy: nvidia-smi reports the GPU requires a reset",)
    # One such cell is enough (the others readable).
    line = "2, GPU-1, NVIDIA A100-SXM4-80GB, 81920, 0, 00000000:0C:00.0, [GPU requires reset], Disabled, No, No"
    (g,) = _gpus(line).values()
    assert not g.healthy and g.memory_total_mib == 81920


def test_unknown_error_alone_is_not_a_fault() -> None:
    """``[Unknown Error]`` is a value NVML could not read (a GeForce card's power limit, say),
    not a fault state of the GPU: it stays missing, as SOURCES.md says."""
    (g,) = _gpus(_fault_row(0, "07", "[Unknown Error]")).values()
    assert g.free and g.ecc_uncorrected is None


def test_a_64_bit_counter_is_read_not_dropped() -> None:
    line = "0, GPU-1, NVIDIA A100-SXM4-80GB, 81920, 0, 00000000:07:00.0, 18446744073709551615, Disabled, No, No"
    (g,) = _gpus(line).values()
    assert g.ecc_uncorrected == 2**64 - 1 and not g.healthy


def test_a_loader_error_is_a_broken_install_not_a_missing_tool() -> None:
    out = "nvidia-smi: error while loading shared libraries: libnvidia-ml.so.1: cannot open shared object file: No such file or directory\n"
    f = classify_failure(127, out)
    assert f is not None and f.kind == "failed" and "libnvidia-ml.so.1" in f.message
    assert classify_failure(127, "bash: line 1: nvidia-smi: command not found\n").kind == "missing"  # type: ignore[union-attr]


def test_lost_lines_of_any_output() -> None:
    text = (
        "GPU-aaaa, 4411, 100, python\n"
        "Unable to determine the device handle for GPU 0000:31:00.0: GPU is lost.  Reboot the system to recover this GPU\n"
    )
    assert [g.pci_bus_id for g in parse_lost(text)] == ["0000:31:00.0"]
    assert parse_lost("GPU-aaaa, 4411, 100, python\n") == []


# ----------------------------------------------------------------------------- older drivers

_OPTIONAL = sorted(OPTIONAL_GPU_FIELDS)


def test_the_refused_field_is_read_from_the_answer() -> None:
    refusal = 'Field "mig.mode.current" is not a valid field to query.\n\n'
    assert unknown_field(2, refusal) == "mig.mode.current"
    assert unknown_field(0, refusal) is None  # a whole answer is never a refusal
    assert unknown_field(2, "Failed to initialize NVML: Unknown Error\n") is None


def test_optional_fields_all_follow_the_bus_id() -> None:
    """widen_query_gpu maps the optional columns from the right: they must all be there."""
    assert all(GPU_FIELDS.index(f) > GPU_FIELDS.index("pci.bus_id") for f in OPTIONAL_GPU_FIELDS)


@FUZZ
@given(st.lists(st.sampled_from(_OPTIONAL), unique=True), st.data())
def test_a_narrowed_query_reads_as_the_full_one_with_unknowns(dropped: list[str], data: st.DataObject) -> None:
    """Rows of a query without some optional fields, widened, parse as the full query's rows
    with each left-out value unknown; lost-GPU lines pass through untouched."""
    name = data.draw(st.sampled_from(["NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB", "NVIDIA A, B, C"]))
    full = {
        "index": "0", "uuid": ZERO_UUID, "name": name, "memory.total": "32768", "memory.used": "5",
        "pci.bus_id": "00000000:07:00.0", "ecc.errors.uncorrected.volatile.total": "3",
        "mig.mode.current": "Disabled", "retired_pages.pending": "Yes", "remapped_rows.pending": "No",
    }  # fmt: skip
    fields = tuple(f for f in GPU_FIELDS if f not in dropped)
    lost = "Unable to determine the device handle for GPU 0000:31:00.0: GPU is lost.\n"
    narrow = ", ".join(full[f] for f in fields) + "\n" + lost
    widened = widen_query_gpu(narrow, fields)
    (row,), (gone,) = parse_query_gpu(widened)
    want = {f: (full[f] if f not in dropped else "[N/A]") for f in GPU_FIELDS}
    (expected,), _ = parse_query_gpu(", ".join(want.values()))
    assert row == expected and row.name == name
    assert gone.pci_bus_id == "0000:31:00.0"
    assert widen_query_gpu(narrow, GPU_FIELDS) == narrow


def test_a_query_gpu_row_with_one_column_too_many_and_no_bus_id_is_not_ours() -> None:
    line = "0, GPU-aaa, NVIDIA H100, 81559, 0, [N/A], 0, Disabled, No, No, extra"
    assert parse_query_gpu(line) == ([], [])
