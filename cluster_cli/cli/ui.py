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

# Not a terminal (a pipe, a file, CI): keep tables readable instead of squeezing them into 80 columns.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
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
