"""Tests for cluster_cli.probe.parsers.topology.parse_topo."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz import mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_cli.probe.parsers.topology import parse_topo

FIXTURES = Path(__file__).parent / "fixtures" / "probes"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL8 = ((0, 1, 2, 3, 4, 5, 6, 7),)

TOPO_EXPECTED = {
    "nvidia-smi-topo-m.hgx-h200x8-8nic.txt": ALL8,
    "nvidia-smi-topo-m.dgx-a100-mlx5-columns.txt": ALL8,
    "nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt": ((0, 1), (2, 3)),
    "nvidia-smi-topo-m.2xa100-pcie-no-nvlink.txt": (),
    "nvidia-smi-topo-m.8xrtx4090-pcie-only.txt": (),
    "nvidia-smi-topo-m.h100x1-ansi.txt": (),
}


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_every_topo_fixture_is_covered() -> None:
    assert sorted(p.name for p in FIXTURES.glob("nvidia-smi-topo-m.*")) == sorted(TOPO_EXPECTED)


@pytest.mark.parametrize(("fixture", "expected"), sorted(TOPO_EXPECTED.items()))
def test_fixtures(fixture: str, expected: tuple[tuple[int, ...], ...]) -> None:
    assert parse_topo(fx(fixture)) == expected


@pytest.mark.parametrize(("fixture", "expected"), sorted(TOPO_EXPECTED.items()))
def test_fixtures_tab_expanded(fixture: str, expected: tuple[tuple[int, ...], ...]) -> None:
    """Pasted copies are tab-expanded: whitespace splitting must give the same answer."""
    assert "\t" in fx(fixture)
    assert parse_topo(fx(fixture).expandtabs()) == expected
    assert parse_topo(fx(fixture).expandtabs(4)) == expected


@pytest.mark.parametrize(("fixture", "expected"), sorted(TOPO_EXPECTED.items()))
def test_fixtures_lines_stripped_and_crlf(fixture: str, expected: tuple[tuple[int, ...], ...]) -> None:
    text = "\r\n".join(line.strip() for line in fx(fixture).expandtabs().split("\n"))
    assert parse_topo(text) == expected


@pytest.mark.parametrize(("fixture", "expected"), sorted(TOPO_EXPECTED.items()))
def test_fixtures_without_legend(fixture: str, expected: tuple[tuple[int, ...], ...]) -> None:
    text = fx(fixture).split("\nLegend:")[0]
    assert parse_topo(text) == expected


def test_ansi_escapes_are_stripped() -> None:
    assert "\x1b[4m" in fx("nvidia-smi-topo-m.h100x1-ansi.txt")
    lines = fx("nvidia-smi-topo-m.hgx-h200x8-8nic.txt").split("\n")
    lines[0] = "\x1b[4m" + lines[0] + "\x1b[0m"
    lines[3] = lines[3].replace("NV18", "\x1b[1mNV18\x1b[0m")
    assert parse_topo("\n".join(lines)) == ALL8


def test_trimmed_self_cell() -> None:
    """dgx-a100 lost the trailing space of its last "X"; "X" without spaces everywhere works too."""
    assert "\t X\n" in fx("nvidia-smi-topo-m.dgx-a100-mlx5-columns.txt")
    assert parse_topo(fx("nvidia-smi-topo-m.hgx-h200x8-8nic.txt").replace(" X ", "X")) == ALL8


def test_gpu_numa_id_column_is_not_a_gpu() -> None:
    text = fx("nvidia-smi-topo-m.2xa100-pcie-no-nvlink.txt")
    assert "GPU NUMA ID" in text
    assert parse_topo(text) == ()


def test_nic_rows_ending_early_are_ignored() -> None:
    text = fx("nvidia-smi-topo-m.8xrtx4090-pcie-only.txt")
    assert text.split("\n")[-2].startswith("NIC1") and text.split("\n")[-2].endswith("X")
    assert parse_topo(text) == ()


def test_bridge_pairs_are_not_joined_through_sys() -> None:
    text = fx("nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt")
    assert parse_topo(text.replace("NV12", "PHB", 1)) is None  # one end shows no link: not a real matrix
    assert parse_topo(text.replace("NV12", "PHB")) == ()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "Failed to initialize NVML: Driver/library version mismatch\n",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        "bash: line 1: nvidia-smi: command not found\n",
        "No devices were found\n",
        "Legend:\n\n  X    = Self\n",
    ],
)
def test_errors_are_unknown(text: str) -> None:
    assert parse_topo(text) is None


def _lines(fixture: str) -> list[str]:
    return fx(fixture).split("\n")


def test_missing_gpu_row_is_unknown() -> None:
    lines = [ln for ln in _lines("nvidia-smi-topo-m.hgx-h200x8-8nic.txt") if not ln.startswith("GPU7")]
    assert parse_topo("\n".join(lines)) is None


def test_truncated_output_is_unknown() -> None:
    lines = _lines("nvidia-smi-topo-m.dgx-a100-mlx5-columns.txt")
    assert parse_topo("\n".join(lines[:5])) is None  # header + GPU0..GPU3
    assert parse_topo(lines[0]) is None  # header only


def test_gpu_row_ending_early_is_unknown() -> None:
    lines = _lines("nvidia-smi-topo-m.hgx-h200x8-8nic.txt")
    lines[8] = "\t".join(lines[8].split("\t")[:5])  # GPU7 row cut inside the GPU block
    assert parse_topo("\n".join(lines)) is None


def test_unknown_link_token_or_bad_diagonal_is_unknown() -> None:
    text = fx("nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt")
    assert parse_topo(text.replace("SYS", "???", 1)) is None
    assert parse_topo(text.replace(" X ", "NV12", 1)) is None


def test_duplicate_gpu_row_is_unknown() -> None:
    lines = _lines("nvidia-smi-topo-m.4xa100-pcie-nvlink-bridge-pairs.txt")
    assert parse_topo("\n".join([*lines[:3], lines[2], *lines[3:]])) is None


def test_old_soc_token_and_nv_without_space() -> None:
    text = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV1\tSOC\t0-7\nGPU1\tNV1\t X \tSOC\t0-7\nGPU2\tSOC\tSOC\t X \t8-15\n"
    assert parse_topo(text) == ((0, 1),)


def test_header_without_leading_tab() -> None:
    text = "GPU0\tGPU1\tmlx5_0\tCPU Affinity\nGPU0\t X \tNV1\tPHB\t0-7\nGPU1\tNV1\t X \tPHB\t0-7\nmlx5_0\tPHB\tPHB\t X \t\n"
    assert parse_topo(text) == ((0, 1),)


def test_noncontiguous_gpu_labels() -> None:
    text = "\tGPU2\tGPU5\nGPU2\t X \tNV4\nGPU5\tNV4\t X \n"
    assert parse_topo(text) == ((2, 5),)


# ----------------------------------------------------------------------------- properties

_PCIE = ["SYS", "NODE", "PHB", "PXB", "PIX"]


def _components(n: int, edges: set[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """Reference: BFS connected components of size >= 2."""
    adj: dict[int, set[int]] = {i: set() for i in range(n)}
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    seen: set[int] = set()
    out = []
    for s in range(n):
        if s in seen:
            continue
        comp, todo = set(), [s]
        while todo:
            v = todo.pop()
            if v not in comp:
                comp.add(v)
                todo.extend(adj[v] - comp)
        seen |= comp
        if len(comp) >= 2:
            out.append(tuple(sorted(comp)))
    return tuple(sorted(out))


@st.composite
def matrices(draw: st.DrawFn) -> tuple[str, tuple[tuple[int, ...], ...]]:
    n = draw(st.integers(1, 10))
    nics = draw(st.integers(0, 4))
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    edges = set(draw(st.lists(st.sampled_from(pairs), unique=True))) if pairs else set()
    cell: dict[tuple[int, int], str] = {}
    for a, b in pairs:
        if (a, b) in edges:
            cell[a, b] = cell[b, a] = f"NV{draw(st.integers(1, 18))}"
        else:
            cell[a, b] = cell[b, a] = draw(st.sampled_from(_PCIE))
    names = [f"GPU{i}" for i in range(n)] + [draw(st.sampled_from(["NIC", "mlx5_"])) + str(j) for j in range(nics)]
    numa = draw(st.booleans())
    header = ["", *names, "CPU Affinity", "NUMA Affinity"] + (["GPU NUMA ID"] if numa else [])
    rows = ["\t".join(header)]
    for i in range(n):
        gpu_cells = [" X " if i == j else cell[i, j] for j in range(n)]
        nic_cells = [draw(st.sampled_from(_PCIE)) for _ in range(nics)]
        rows.append("\t".join([f"GPU{i}", *gpu_cells, *nic_cells, "0-63,128-191", "0", *(["", "N/A"] if numa else [])]))
    for j in range(nics):
        tail = ["", "", "", ""][: draw(st.integers(0, 4))]
        rows.append("\t".join([names[n + j], *(draw(st.sampled_from(_PCIE)) for _ in range(n)), " X ", *tail]))
    text = "\n".join(rows) + "\n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
    if draw(st.booleans()):
        text = text.expandtabs(draw(st.sampled_from([4, 8])))
    return text, _components(n, edges)


@FUZZ
@given(matrices())
def test_random_matrices(case: tuple[str, tuple[tuple[int, ...], ...]]) -> None:
    text, expected = case
    assert parse_topo(text) == expected


def _valid(result: object) -> bool:
    if result is None:
        return True
    assert isinstance(result, tuple)
    flat = [g for dom in result for g in dom]
    assert len(flat) == len(set(flat))
    assert all(len(d) >= 2 and list(d) == sorted(d) for d in result)
    assert list(result) == sorted(result)
    return True


@FUZZ
@given(st.text())
def test_never_raises_on_text(text: str) -> None:
    assert _valid(parse_topo(text))


@FUZZ
@given(mutated([fx(f) for f in TOPO_EXPECTED]))
def test_never_raises_on_mutated_fixtures(text: str) -> None:
    assert _valid(parse_topo(text))


@FUZZ
@given(st.binary(max_size=400))
def test_never_raises_on_binaryish(blob: bytes) -> None:
    assert _valid(parse_topo(blob.decode("latin-1")))


def test_non_string_is_unknown() -> None:
    assert parse_topo(None) is None  # type: ignore[arg-type]


def test_a_topology_matrix_with_a_duplicated_gpu_column_is_unknown() -> None:
    text = "\tGPU0\tGPU1\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\tNV12\t0-31\nGPU1\tNV12\t X \tNV12\t0-31\n"
    assert parse_topo(text) is None
