"""Pure parser for ``nvidia-smi topo -m``: NVLink domains of a node.

Only the GPU x GPU block of the matrix is read. Anything that does not look like a
complete, consistent matrix gives ``None`` (unknown), never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Collection

__all__ = ["parse_topo"]

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_GPU = re.compile(r"GPU([0-9]{1,6})")
_NVLINK = re.compile(r"NV[0-9]{1,4}")
_PCIE_LINKS = frozenset({"SYS", "NODE", "PHB", "PXB", "PIX", "SOC"})


def _cells(line: str) -> list[str]:
    """Tab-separated cells when the line has tabs, else whitespace-separated tokens."""
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return line.split()


def _gpu_index(cell: str) -> int | None:
    m = _GPU.fullmatch(cell)
    return int(m.group(1)) if m else None


def parse_topo(text: str, gpus: Collection[int] | None = None) -> tuple[tuple[int, ...], ...] | None:
    """NVLink domains (connected components of >= 2 GPUs joined by ``NV#`` cells).

    ``()`` when the matrix is known but has no NVLink (PCIe only, single GPU);
    ``None`` when the text is empty, an error, or not a complete GPU matrix, or, given the
    indices of the GPUs nvidia-smi listed (``gpus``), a matrix of other GPUs than those:
    which one is right is not known, so neither is the topology.
    """
    if not isinstance(text, str):
        return None
    lines = _ANSI.sub("", text).replace("\r", "").split("\n")

    header: list[str] | None = None
    rows: dict[int, list[str]] = {}
    for line in lines:
        if header is None:
            cells = _cells(line)
            while cells and not cells[0]:
                cells.pop(0)
            if any(_gpu_index(c) is not None for c in cells):
                header = cells
            continue
        if not line.strip():
            if rows:
                break  # the matrix ends at the first blank line; the legend follows
            continue
        cells = _cells(line)
        label = _gpu_index(cells[0]) if cells else None
        if label is None:
            continue  # NIC / mlx5_N rows
        if label in rows:
            return None
        rows[label] = cells[1:]

    if header is None:
        return None
    columns = {idx: pos for pos, c in enumerate(header) if (idx := _gpu_index(c)) is not None}
    if len(columns) != sum(1 for c in header if _gpu_index(c) is not None):
        return None  # duplicate GPU column
    if set(columns) != set(rows) or (gpus is not None and set(columns) != set(gpus)):
        return None

    parent = {g: g for g in columns}
    nv: set[tuple[int, int]] = set()

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for src, cells in rows.items():
        for dst, pos in columns.items():
            if pos >= len(cells):
                return None  # row ends before the GPU block does
            cell = cells[pos]
            if src == dst:
                if cell != "X":
                    return None
            elif _NVLINK.fullmatch(cell):
                nv.add((src, dst))
                a, b = find(src), find(dst)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            elif cell not in _PCIE_LINKS:
                return None

    if any((dst, src) not in nv for src, dst in nv):
        return None  # a link that one end of it does not show: not a matrix nvidia-smi prints
    groups: dict[int, list[int]] = {}
    for g in columns:
        groups.setdefault(find(g), []).append(g)
    return tuple(sorted(tuple(sorted(m)) for m in groups.values() if len(m) >= 2))
