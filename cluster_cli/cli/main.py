"""Root of the CLI: global options, the App object, and command registration.

Each command group lives in its own module and registers itself on ``app`` here;
the modules only wire the stages together and render results through ``ui``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import typer

from cluster_cli import __version__

DEFAULT_STATE = Path(".clusterctl/state.db")

app = typer.Typer(
    name="clusterctl",
    help="Turn a fleet of SSH-reachable servers into an LLM serving cluster.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass
class App:
    """Shared settings for every command (on ``ctx.obj``)."""

    state_path: Path
    verbose: bool = False


def _version(value: bool) -> None:
    if value:
        typer.echo(f"clusterctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    state: Path = typer.Option(
        None,
        "--state",
        envvar="CLUSTERCTL_STATE",
        help="State database (default .clusterctl/state.db).",
        show_default=False,
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="More detail on stderr."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    ctx.obj = App(state_path=state or Path(os.environ.get("CLUSTERCTL_STATE") or DEFAULT_STATE), verbose=verbose)


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``.
    import importlib

    for mod in ("discover", "cordon", "place", "serve_router"):
        try:
            importlib.import_module(f"cluster_cli.cli.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"cluster_cli.cli.{mod}":
                raise


_register()


def run() -> None:
    app()


if __name__ == "__main__":
    # Run through the imported module so commands registered on ``app`` are found.
    from cluster_cli.cli.main import run as _run

    _run()
