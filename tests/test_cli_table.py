"""The discover table on a narrow terminal and in a pipe: values wrap, never get cut to "…"."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from cluster_cli.cli import ui
from cluster_cli.cli.discover import render
from cluster_cli.facts import Gpu, HcaPort, NodeFacts


def _fleet(name: str) -> list[NodeFacts]:
    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-{i}", product="NVIDIA H200", gpu_class="H200", memory_total_mib=143771)
        for i in range(8)
    )
    ib = [
        HcaPort(ca=f"mlx5_{i}", port=1, state="Active", physical_state="LinkUp", link_layer="InfiniBand", fabric=fab)
        for i, fab in enumerate(("ib-a", "ib-b", "ib-storage"))
    ]
    return [
        NodeFacts(
            name=name,
            host="h",
            cpus=224,
            memory_mib=2_063_000,
            gpus=gpus,
            nvlink_domains=(tuple(range(8)),),
            hcas=tuple(ib),
        ),
        NodeFacts(name="a1", host="h", cpus=64, memory_mib=512_000, gpus=gpus[:4], nvlink_domains=((0, 1), (2, 3))),
        NodeFacts(name="d1", host="h", reachable=False, error="connect timed out"),
    ]


def _render(monkeypatch: pytest.MonkeyPatch, width: int, facts: list[NodeFacts]) -> list[str]:
    console = Console(width=width, soft_wrap=True, emoji=False, force_terminal=False, color_system=None)
    monkeypatch.setattr(ui, "out", console)
    with console.capture() as cap:
        render(facts)
    return cap.get().splitlines()


@pytest.mark.parametrize("name", ["gpu-node-01", "a-rather-long-node-name-21"])
def test_an_80_column_terminal_wraps_values_and_cuts_none(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    lines = _render(monkeypatch, 80, _fleet(name))
    text = "\n".join(lines)
    assert "…" not in text
    assert all(len(line.rstrip()) <= 80 for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("NODE"))
    for col in ("UP", "FREE/TOTAL", "NVLINK", "FABRICS", "CPUS", "GiB", "CORDON", "PROBLEMS"):
        assert col in lines[header - 1] + lines[header]  # every column is there, its header whole
    rows = lines[header + 2 :]
    assert rows[0].split()[1:3] == ["yes", "8/8"] and "{0-7}" in rows[0] and "224" in rows[0]
    node_col = "".join(line[: line.index("  ")] for line in rows if line[:1].strip() and "  " in line)  # names fold
    assert name in node_col
    assert "ib-storage" in text and "{2,3}" in text
    d1 = next(line for line in rows if line.startswith("d1"))
    assert d1.split()[:2] == ["d1", "no"]


def test_not_on_a_terminal_every_row_is_one_whole_line(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "gpu-node-with-a-very-long-fully-qualified-name.dc1.example.com"
    lines = _render(monkeypatch, 10_000, _fleet(name))  # what ui.out is in a pipe
    row = next(line for line in lines if line.startswith(name))
    assert row.split()[:3] == [name, "yes", "8/8"]
    assert "ib-a, ib-b, ib-storage" in row and row.split()[-4:] == ["224", "2015", "-", "-"]


def test_a_terminal_too_narrow_for_the_short_columns_gets_longer_lines_not_squeezed_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = _render(monkeypatch, 50, _fleet("gpu-node-01"))
    assert not any(line.strip() in ("ye", "s") for line in lines)
    row = next(line for line in lines if line.startswith("gpu-node-01"))
    assert row.split()[1] == "yes"


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=9),
    st.integers(0, 200),
)
def test_fit_widths_stays_between_least_and_natural_and_within_the_budget(
    cols: list[tuple[int, int]], budget: int
) -> None:
    minimum = [m for m, _ in cols]
    natural = [m + extra for m, extra in cols]
    widths = ui.fit_widths(natural, minimum, budget)
    assert all(m <= w <= n for m, w, n in zip(minimum, widths, natural, strict=True))
    if sum(minimum) <= budget:
        assert sum(widths) <= budget
        # nothing left unused while some column still wants more
        assert sum(widths) == budget or widths == natural
        # fair: a column below its natural width is no narrower than another's share beyond its minimum
        short = [w - m for m, w, n in zip(minimum, widths, natural, strict=True) if w < n]
        if short:
            assert max(short) - min(short) <= 1
    else:
        assert widths == minimum


def test_a_node_never_reached_shows_its_gpus_as_unknown_not_none(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _render(monkeypatch, 200, [NodeFacts(name="g1", host="h", reachable=False, error="host key unknown")])
    row = next(line for line in lines if line.startswith("g1"))
    assert row.split()[:4] == ["g1", "no", "?", "?"]  # GPUS "?" like NVLINK: a GPU node must not look CPU-only


def test_an_unreachable_node_says_why_and_its_old_problems_say_how_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """``discover > report.txt``: the reason a node was not reached is in the report (it went to
    stderr only), and what it showed before is marked as of its last answer, not as live."""
    import time

    gpu = Gpu(index=4, uuid="GPU-4", product="NVIDIA H200", gpu_class="H200", memory_total_mib=1,
              problems=("ecc: 2 uncorrected ECC errors",))  # fmt: skip
    f = NodeFacts(name="h2", host="h", reachable=False, error="no answer within 3s", gpus=(gpu,),
                  problems=("ib-port-down: mlx5_2 port 1 was Active, now Down (Polling)",),
                  last_seen_at=time.time() - 300)  # fmt: skip
    lines = _render(monkeypatch, 200, [f])
    assert "h2 unreachable: no answer within 3s" in lines
    assert "h2 gpu4 ecc: 2 uncorrected ECC errors (as last seen, 5 min ago)" in lines
    assert "h2 ib-port-down: mlx5_2 port 1 was Active, now Down (Polling) (as last seen, 5 min ago)" in lines


def test_a_lost_gpu_counts_once_among_the_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's "gpu: 1 GPU(s) lost" sums up the GPU's own "lost:" line: the table counted
    both (6 problems for 5 faults); the node's facts keep both."""
    from cluster_cli.facts import lost_gpus_problem

    gpus = tuple(
        Gpu(index=i, uuid=f"GPU-{i}", product="NVIDIA H100", gpu_class="H100", memory_total_mib=81559) for i in range(4)
    )
    lost = Gpu(index=2, uuid="GPU-2", product="NVIDIA H100", gpu_class="H100", memory_total_mib=81559,
               lost=True, problems=("lost: Unable to determine the device handle for GPU0000:2A:00.0",))  # fmt: skip
    ecc = Gpu(index=3, uuid="GPU-3", product="NVIDIA H100", gpu_class="H100", memory_total_mib=81559,
              problems=("ecc: 2 uncorrected",))  # fmt: skip
    f = NodeFacts(name="d1", host="h", cpus=8, memory_mib=1024, gpus=(*gpus[:2], lost, ecc), nvlink_domains=None,
                  problems=(lost_gpus_problem(1), "cpu: unreadable"))  # fmt: skip
    text = "\n".join(_render(monkeypatch, 200, [f]))
    row = next(line for line in text.splitlines() if line.startswith("d1 "))
    assert row.split()[-1] == "3"  # the lost GPU, the ECC fault, the CPU
    assert text.count("lost") == 2 and "d1 gpu2 lost: Unable" in text and "GPU(s) lost" not in text
    assert lost_gpus_problem(1) in f.problems
