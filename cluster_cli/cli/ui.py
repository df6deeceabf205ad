"""All terminal output goes through here: data to stdout, diagnostics to stderr."""

from __future__ import annotations

import json
import os
import sys
from enum import StrEnum
from typing import Any, NoReturn

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from cluster_cli.errors import ClusterctlError

# Not a terminal (a pipe, a file, CI): tables at their natural width, never squeezed into 80
# columns nor cut to "…" (a line a grep or a log keeps whole).
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 10_000
# No emoji codes: text from nodes and files is printed as is (":ab:" in a PCI address is not 🆎).
out = Console(soft_wrap=True, width=_WIDTH, emoji=False)
err = Console(stderr=True, soft_wrap=True, width=_WIDTH, emoji=False)


class Output(StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


OUTPUT_OPTION = typer.Option(Output.table, "--output", "-o", help="Output format: table, json or yaml.")


def emit_data(data: Any, fmt: Output) -> None:
    """Print machine-readable data (json/yaml) to stdout, plain, no markup."""
    if fmt is Output.json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    sys.stdout.flush()


def abort(message: str, code: int = 2) -> NoReturn:
    """Print one error line to stderr and exit with ``code``."""
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)
    raise typer.Exit(code)


def fail(e: ClusterctlError) -> NoReturn:
    abort(e.message, e.exit_code)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", markup=True, highlight=False)


def info(message: str) -> None:
    err.print(message, markup=False, highlight=False)


def fit_widths(natural: list[int], minimum: list[int], budget: int) -> list[int]:
    """Column widths for a table ``budget`` characters wide: each column at most its natural
    width and at least its minimum (its longest word: text wraps between words, never inside
    one); what is left over is shared fairly, the narrowest columns satisfied first. When
    even the minimums do not fit, the minimums (the terminal wraps the lines)."""
    widths = [min(m, n) for m, n in zip(minimum, natural, strict=True)]
    left = budget - sum(widths)
    wanting = sorted(range(len(widths)), key=lambda i: natural[i] - widths[i])
    for k, i in enumerate(wanting):
        give = max(0, min(natural[i] - widths[i], left // (len(wanting) - k)))
        widths[i] += give
        left -= give
    return widths


def print_table(columns: list[tuple[str, int | None]], rows: list[list[str]]) -> None:
    """Print a table of ``rows`` (rich markup) that fits the terminal without cutting anything to "…".

    Per column, ``keep``: ``0`` never narrower than its content (short columns: UP, CPUS);
    ``None`` wraps between words, never inside one; ``n`` (names, which have no spaces to
    wrap at) keeps up to 32 characters, down to ``n`` on a terminal too narrow for that, and
    folds what is longer. What is left is shared by the columns that wrap. Not on a
    terminal, every column takes its natural width (nothing wraps). On a terminal too narrow
    even for the columns' least widths, the lines are longer than it (the terminal wraps them)
    rather than squeezed until "yes" reads "ye/s".
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    plain = [[Text.from_markup(c).plain for c in row] for row in rows]
    natural, minimum = [], []
    for i, (head, keep) in enumerate(columns):
        lines = [line for c in (head, *(r[i] for r in plain)) for line in c.splitlines() or [""]]
        nat = max(len(line) for line in lines)
        word = max((len(w) for line in lines for w in line.split()), default=1)
        natural.append(nat)
        minimum.append(word if keep is None else nat if keep == 0 else min(nat, 32))
    budget = out.width - 2 * (len(columns) - 1)  # two spaces between columns, none at the edges
    excess = sum(minimum) - budget
    for i, (_, keep) in enumerate(columns):
        if excess > 0 and keep:
            cut = min(excess, max(0, minimum[i] - keep))
            minimum[i] -= cut
            excess -= cut
    widths = fit_widths(natural, minimum, budget)
    t = Table(header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for (head, _), w in zip(columns, widths, strict=True):
        t.add_column(head, width=w, overflow="fold")
    for row in rows:
        t.add_row(*row)
    needed = sum(widths) + 2 * (len(columns) - 1)
    if needed <= out.width:
        out.print(t)
        return
    width = out.width
    out.width = needed  # print's own width= is capped at the console's
    try:
        out.print(t, crop=False)
    finally:
        out.width = width
