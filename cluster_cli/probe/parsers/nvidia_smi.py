"""Pure parsers for ``nvidia-smi`` output (query-gpu, query-compute-apps, failures).

Nothing here does I/O and nothing raises on any input: malformed lines are skipped,
non-numeric cells (``[N/A]``, ``[Not Supported]``, ``N/A``, empty, ...) become ``None``.
Columns are mapped by position (``commands.GPU_FIELDS`` / ``commands.APP_FIELDS``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cluster_cli.facts import UNREAD, Gpu, GpuProcess
from cluster_cli.probe.commands import APP_FIELDS, GPU_FIELDS

__all__ = [
    "GpuRow",
    "LostGpu",
    "SmiFailure",
    "build_gpus",
    "classify_failure",
    "killed",
    "normalize_pci_bus_id",
    "parse_compute_apps",
    "parse_lost",
    "parse_query_gpu",
    "unknown_field",
    "widen_query_gpu",
]


@dataclass(frozen=True)
class GpuRow:
    """One line of ``--query-gpu`` in ``commands.GPU_FIELDS`` order."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int | None
    memory_used_mib: int | None
    pci_bus_id: str | None  # normalized: 4-hex-digit domain, lowercase, e.g. "0000:83:00.0"
    ecc_uncorrected: int | None
    mig_mode: bool | None
    retired_pages_pending: bool | None
    remapped_rows_pending: bool | None
    # A cell of the row says the GPU is in a fault state (``[GPU is lost]``, ``[GPU requires
    # reset]``): the fault key (``lost``, ``reset``), else None.
    fault: str | None = None


@dataclass(frozen=True)
class LostGpu:
    """A GPU nvidia-smi could not get a handle for ("Unable to determine the device handle ...")."""

    pci_bus_id: str | None
    index: int | None
    message: str


@dataclass(frozen=True)
class SmiFailure:
    """nvidia-smi failed as a whole.

    ``kind`` is one of ``missing``, ``no-driver``, ``driver-mismatch``, ``no-devices``, ``failed``;
    ``message`` is a single human-readable line.
    """

    kind: str
    rc: int | None
    message: str


FAILURE_KINDS = frozenset({"missing", "no-driver", "driver-mismatch", "no-devices", "failed"})

# --------------------------------------------------------------------------- helpers

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_DIGITS = re.compile(r"[0-9]{1,18}")
# "81559" or "81559 MiB" (no nounits); up to 20 digits: an NVML counter is 64 bits unsigned
_INT = re.compile(r"([0-9]{1,20})(?:\s*[A-Za-z%]+)?")
_PCI = re.compile(r"(?:(?P<dom>[0-9A-Fa-f]{1,8}):)?(?P<bus>[0-9A-Fa-f]{1,2}):(?P<dev>[0-9A-Fa-f]{1,2})\.(?P<fn>[0-7])")
_LOST = re.compile(r"Unable to determine the device handle for\s+GPU", re.IGNORECASE)
_LOST_INDEX = re.compile(r"([0-9]{1,6})\s*:\s*")
# What nvidia-smi prints in place of a value of a GPU in a fault state (NVML_ERROR_GPU_IS_LOST,
# NVML_ERROR_RESET_REQUIRED): the row is still printed, with the fault in its cells.
_FAULT_CELLS = {"[gpu is lost]": "lost", "[gpu requires reset]": "reset"}

_N_GPU = len(GPU_FIELDS)
_N_APP = len(APP_FIELDS)


def _lines(text: object) -> list[str]:
    """Split into lines on ``\\n`` only, with ANSI escapes and ``\\r`` removed."""
    if not isinstance(text, str):
        return []
    return _ANSI.sub("", text).replace("\r", "").split("\n")


def _int(cell: str) -> int | None:
    """A non-negative integer cell, else None (``[N/A]``, ``N/A``, empty, ...)."""
    m = _INT.fullmatch(cell.strip())
    return int(m.group(1)) if m else None


def _enabled(cell: str) -> bool | None:
    v = cell.strip().lower()
    return True if v == "enabled" else False if v == "disabled" else None


def _yes_no(cell: str) -> bool | None:
    v = cell.strip().lower()
    return True if v == "yes" else False if v == "no" else None


def normalize_pci_bus_id(value: str | None) -> str | None:
    """``00000000:83:00.0`` -> ``0000:83:00.0`` (4+ hex digit domain, lowercase); junk -> None."""
    if not isinstance(value, str):
        return None
    m = _PCI.fullmatch(value.strip())
    if not m:
        return None
    dom = int(m["dom"], 16) if m["dom"] else 0
    return f"{dom:04x}:{int(m['bus'], 16):02x}:{int(m['dev'], 16):02x}.{m['fn']}"


def _parse_lost(line: str) -> LostGpu | None:
    """Parse any of the four "Unable to determine the device handle for GPU..." spellings."""
    m = _LOST.search(line)
    if not m:
        return None
    message = _one_line(line[m.start() :])
    rest = line[m.end() :].lstrip()
    index: int | None = None
    pci: str | None = None
    pm = _PCI.match(rest)
    if pm and (pm.end() == len(rest) or rest[pm.end()] in ": \t"):
        pci = normalize_pci_bus_id(pm.group(0))
    else:
        im = _LOST_INDEX.match(rest)
        if im:
            index = int(im.group(1))
            pm = _PCI.match(rest, im.end())
            if pm:
                pci = normalize_pci_bus_id(pm.group(0))
    return LostGpu(pci_bus_id=pci, index=index, message=message)


def _one_line(text: str, limit: int = 300) -> str:
    """Collapse to one printable line, at most ``limit`` characters."""
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    cleaned = " ".join(cleaned.split())
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 3] + "..."


# --------------------------------------------------------------------------- parsers


def parse_query_gpu(text: str) -> tuple[list[GpuRow], list[LostGpu]]:
    """Parse ``--query-gpu`` (our column order, noheader, nounits) plus any lost-GPU lines.

    A header, blank or malformed line is skipped. The name is taken from between the
    fixed leading and trailing columns, so a name containing ", " still parses (such a
    row must carry a valid PCI bus id, else it is taken for a foreign column list).
    """
    rows: list[GpuRow] = []
    lost: list[LostGpu] = []
    for line in _lines(text):
        if not line.strip():
            continue
        gone = _parse_lost(line)
        if gone is not None:
            lost.append(gone)
            continue
        cells = line.split(",")
        if len(cells) < _N_GPU:
            continue
        if not _DIGITS.fullmatch(cells[0].strip()):
            continue
        index = int(cells[0].strip())
        tail = cells[-(_N_GPU - 3) :]
        pci = normalize_pci_bus_id(tail[2])
        if len(cells) > _N_GPU and pci is None:
            continue  # extra columns, but not a comma in the name: a different column list
        faults = {_FAULT_CELLS.get(c.strip().lower()) for c in cells[1:]}
        fault = "lost" if "lost" in faults else "reset" if "reset" in faults else None
        name = ",".join(cells[2 : -(_N_GPU - 3)]).strip()
        rows.append(
            GpuRow(
                index=index,
                uuid="" if _FAULT_CELLS.get(cells[1].strip().lower()) else cells[1].strip(),
                name=UNREAD if _FAULT_CELLS.get(name.lower()) else name,
                memory_total_mib=_int(tail[0]),
                memory_used_mib=_int(tail[1]),
                pci_bus_id=pci,
                ecc_uncorrected=_int(tail[3]),
                mig_mode=_enabled(tail[4]),
                retired_pages_pending=_yes_no(tail[5]),
                remapped_rows_pending=_yes_no(tail[6]),
                fault=fault,
            )
        )
    return rows, lost


def parse_lost(text: str) -> list[LostGpu]:
    """The lost-GPU lines of any nvidia-smi output (the process query prints them too)."""
    return [g for line in _lines(text) if (g := _parse_lost(line)) is not None]


_UNKNOWN_FIELD = re.compile(r'^Field "([A-Za-z0-9_.]{1,100})" is not a valid field to query')


def unknown_field(rc: int | None, output: str) -> str | None:
    """The field a ``--query-gpu`` was refused for (an older driver does not know it), else None."""
    if rc in (0, None):
        return None
    for line in _lines(output):
        if m := _UNKNOWN_FIELD.match(line.strip()):
            return m.group(1)
    return None


def widen_query_gpu(text: str, fields: Sequence[str]) -> str:
    """``--query-gpu`` output of ``fields`` (``GPU_FIELDS`` less some of its columns after
    ``pci.bus_id``) as if all of ``GPU_FIELDS`` had been asked: ``[N/A]`` in each column
    left out. Lost-GPU lines and lines that are no row of ``fields`` stay as they are."""
    fields = list(fields)
    if fields == list(GPU_FIELDS):
        return text
    keep = GPU_FIELDS.index("pci.bus_id") + 1
    if fields[:keep] != list(GPU_FIELDS[:keep]) or not set(fields) <= set(GPU_FIELDS):
        return text  # not a narrowing this can undo: leave it to the parser to refuse
    tail = fields[keep:]
    out = []
    for line in _lines(text):
        cells = line.split(",")
        if _parse_lost(line) is not None or len(cells) < len(fields) or not _DIGITS.fullmatch(cells[0].strip()):
            out.append(line)
            continue
        have = dict(zip(tail, cells[len(cells) - len(tail) :], strict=True)) if tail else {}
        head = cells[: len(cells) - len(tail)] if tail else cells
        out.append(",".join([*head, *[have.get(f, " [N/A]") for f in GPU_FIELDS[keep:]]]))
    return "\n".join(out)


def _app_row(line: str) -> GpuProcess | None:
    """One ``--query-compute-apps`` row, or None when it names no GPU and readable pid."""
    cells = line.split(",", _N_APP - 1)
    if len(cells) < 2:
        return None
    uuid = cells[0].strip()
    pid_cell = cells[1].strip()
    if not uuid or not _DIGITS.fullmatch(pid_cell):
        return None
    return GpuProcess(
        pid=int(pid_cell),
        name=cells[3].strip() if len(cells) > 3 else "",
        gpu_uuid=uuid,
        used_mib=_int(cells[2]) if len(cells) > 2 else None,
    )


def parse_compute_apps(text: str) -> list[GpuProcess]:
    """Parse ``--query-compute-apps`` (gpu_uuid, pid, used_memory, process_name; noheader, nounits).

    The process name is last and may contain ", ". Header-only or empty output gives ``[]``.
    A row cut short after its pid still counts (memory and name unknown): a process is
    there. Rows naming a GPU but no readable pid are :func:`unreadable_app_gpus`.
    """
    return [p for line in _lines(text) if (p := _app_row(line)) is not None]


_GPU_UUID = re.compile(r"(?:GPU|MIG)-[0-9A-Za-z-]+")


def unreadable_app_gpus(text: str) -> list[str]:
    """UUIDs named by ``--query-compute-apps`` rows that :func:`parse_compute_apps` cannot
    read (``[N/A]`` or cut pid). Someone computes there; who is unknown. ``""`` stands for a
    row that looks like a process row but names no readable UUID at all."""
    out: list[str] = []
    for line in _lines(text):
        if not line.strip() or _app_row(line) is not None:
            continue
        uuid = line.split(",", 1)[0].strip()
        if _GPU_UUID.fullmatch(uuid):
            out.append(uuid)
        elif uuid.startswith(("GPU-", "MIG-")):
            out.append("")  # a UUID cut short: which GPU is unknown
    return out


_ROW_START = re.compile(r"\s*[0-9]{1,18}\s*,")


def unreadable_gpu_rows(text: str, rows: Sequence[GpuRow] | None = None) -> int:
    """How many ``--query-gpu`` lines start like a GPU row (``N,``) but do not parse, plus
    rows repeating an index: signs of a list cut short or garbled. 0 for a whole list.
    ``rows`` is ``parse_query_gpu(text)[0]`` when the caller has it already."""
    if rows is None:
        rows, _ = parse_query_gpu(text)
    starts = sum(1 for line in _lines(text) if _ROW_START.match(line) and _parse_lost(line) is None)
    indices = [r.index for r in rows]
    return (starts - len(rows)) + (len(indices) - len(set(indices)))


# --------------------------------------------------------------------------- failures

_FATAL_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "missing",
        re.compile(
            r"^[^,]*(?:nvidia-smi\W[^,]*(?:not found|no such file or directory)"
            r"|command not found:\s*\S*nvidia-smi)",
            re.IGNORECASE,
        ),
    ),
    ("no-driver", re.compile(r"^NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")),
    ("driver-mismatch", re.compile(r"^Failed to initialize NVML:\s*Driver/library version mismatch")),
    ("no-devices", re.compile(r"^No devices were found")),
    ("failed", re.compile(r"^Failed to initialize NVML\b")),
)

_RC_KINDS = {127: "missing", 9: "no-driver", 18: "driver-mismatch", 6: "no-devices"}

_DEFAULT_MESSAGES = {
    "missing": "nvidia-smi not found",
    "no-driver": "NVIDIA driver not loaded (nvidia-smi cannot talk to it)",
    "driver-mismatch": "NVIDIA driver/library version mismatch",
    "no-devices": "no NVIDIA devices found",
}


def killed(rc: int | None) -> bool:
    """nvidia-smi did not end on its own: killed by the probe timeout (124) or a signal
    (128 + its number, as the shell reports it; 255 is nvidia-smi's own exit(-1)), or no
    exit status at all (the connection or the batch was cut)."""
    return rc is None or rc == 124 or 128 < rc < 192


def classify_failure(rc: int | None, output: str) -> SmiFailure | None:
    """Decide whether an nvidia-smi run failed as a whole, and how.

    Returns None when the output is usable: rc 0 without an error message, or output
    whose only complaints are lost-GPU lines (those become lost GPUs, not a failure).
    """
    lines = [ln.strip() for ln in _lines(output) if ln.strip()]
    rc = rc if isinstance(rc, int) and not isinstance(rc, bool) else None

    def fail(kind: str) -> SmiFailure:
        joined = _one_line("; ".join(lines))  # only on failure: a full GPU list is long
        if kind == "failed":
            if rc is None:
                msg = f"nvidia-smi failed: {joined}" if joined else "nvidia-smi gave no exit status and no output"
            elif rc == 124:  # the batch's watchdog (or timeout(1)) killed it: it never answered
                msg = "nvidia-smi did not answer within the probe timeout and was killed"
            else:
                msg = f"nvidia-smi exited with rc {rc}: {joined}" if joined else f"nvidia-smi exited with rc {rc}"
        else:
            msg = joined or f"{_DEFAULT_MESSAGES[kind]} (rc {rc})"
        return SmiFailure(kind=kind, rc=rc, message=_one_line(msg))

    if rc == 127:
        # The shell's "not found", or the loader's: nvidia-smi is there but cannot start.
        loader = any("error while loading shared libraries" in ln for ln in lines)
        return fail("failed" if loader else "missing")
    for kind, pattern in _FATAL_PATTERNS:
        if any(pattern.search(ln) for ln in lines):
            return fail(kind)
    if any(_LOST.search(ln) for ln in lines) and not killed(rc):
        return None  # it ended on its own: what it printed besides the lost GPUs is whole
    if rc in _RC_KINDS:
        return fail(_RC_KINDS[rc])
    if rc is None:
        return None if lines else fail("failed")
    return None if rc == 0 else fail("failed")


# --------------------------------------------------------------------------- assembly


def _row_problems(row: GpuRow) -> list[str]:
    problems: list[str] = []
    if row.ecc_uncorrected:
        n = row.ecc_uncorrected
        problems.append(f"ecc: {n} uncorrected ECC error{'s' if n != 1 else ''}")
    if row.retired_pages_pending:
        problems.append("retired-pages: page retirement pending")
    if row.remapped_rows_pending:
        problems.append("remap: row remap pending")
    if row.fault == "reset":
        problems.append("unhealthy: nvidia-smi reports the GPU requires a reset")
    return problems


def _foreign(procs: Iterable[GpuProcess], own_pids: frozenset[int]) -> list[str]:
    out = []
    for p in procs:
        if p.pid not in own_pids:
            out.append(f"foreign-process: pid {p.pid} ({p.name})" if p.name else f"foreign-process: pid {p.pid}")
    return out


def build_gpus(
    rows: Sequence[GpuRow],
    procs: Sequence[GpuProcess],
    lost: Sequence[LostGpu],
    *,
    gpu_class: Callable[[str], str],
    own_pids: frozenset[int] = frozenset(),
) -> tuple[Gpu, ...]:
    """Join rows, processes (by UUID) and lost GPUs into ``Gpu`` facts, sorted by index.

    Processes whose UUID matches no row are dropped. A lost GPU whose PCI id matches a
    row marks that row lost; otherwise it becomes its own ``Gpu`` (index from the message,
    else the gaps in the known indices, then after them). Duplicate lost reports of one GPU are merged.
    """
    by_uuid: dict[str, list[GpuProcess]] = {}
    for p in procs:
        by_uuid.setdefault(p.gpu_uuid, []).append(p)

    # Deduplicate lost reports; attach those matching a row's PCI id to that row.
    row_pcis = {r.pci_bus_id for r in rows if r.pci_bus_id}
    lost_on_row: dict[str, LostGpu] = {}
    standalone: list[LostGpu] = []
    seen: set[object] = set()
    for g in lost:
        key: object = ("pci", g.pci_bus_id) if g.pci_bus_id else ("msg", g.index, g.message)
        if key in seen:
            continue
        seen.add(key)
        if g.pci_bus_id and g.pci_bus_id in row_pcis:
            lost_on_row[g.pci_bus_id] = g
        else:
            standalone.append(g)

    gpus: list[Gpu] = []
    for r in rows:
        attached = tuple(by_uuid.get(r.uuid, ())) if r.uuid else ()
        gone = lost_on_row.get(r.pci_bus_id) if r.pci_bus_id else None
        problems = _row_problems(r)
        if gone is not None:
            problems.append(f"lost: {gone.message}")
        elif r.fault == "lost":
            problems.append("lost: nvidia-smi reports the GPU is lost")
        problems.extend(_foreign(attached, own_pids))
        if r.mig_mode:
            problems.append("mig: MIG mode enabled")
        gpus.append(
            Gpu(
                index=r.index,
                uuid=r.uuid,
                product=r.name,
                gpu_class=UNREAD if r.name == UNREAD else gpu_class(r.name),
                memory_total_mib=r.memory_total_mib,
                memory_used_mib=r.memory_used_mib,
                pci_bus_id=r.pci_bus_id,
                ecc_uncorrected=r.ecc_uncorrected,
                retired_pages_pending=r.retired_pages_pending,
                remapped_rows_pending=r.remapped_rows_pending,
                mig_mode=r.mig_mode,
                lost=gone is not None or r.fault == "lost",
                processes=attached,
                problems=tuple(problems),
            )
        )

    used = {g.index for g in gpus}
    placed: list[tuple[int | None, LostGpu]] = []
    for g in standalone:
        if g.index is not None and g.index not in used:
            used.add(g.index)
            placed.append((g.index, g))
        else:
            placed.append((None, g))
    # nvidia-smi numbers GPUs 0..N-1 in PCI order: a lost GPU without an index in its message
    # takes the gaps in the known indices first (in bus-id order), then the indices after them.
    unindexed = sorted((g for i, g in placed if i is None), key=lambda g: g.pci_bus_id or "")
    slots = iter(i for i in range(len(used) + len(unindexed) + 1 + max(used, default=0)) if i not in used)
    assigned = {id(g): next(slots) for g in unindexed}
    for maybe_index, g in placed:
        index = assigned[id(g)] if maybe_index is None else maybe_index
        gpus.append(
            Gpu(
                index=index,
                uuid="",
                product=UNREAD,
                gpu_class=UNREAD,
                pci_bus_id=g.pci_bus_id,
                lost=True,
                problems=(f"lost: {g.message}",),
            )
        )
    return tuple(sorted(gpus, key=lambda g: g.index))
