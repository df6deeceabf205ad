"""Root of the CLI: global options, the App object, and command registration.

Each command group lives in its own module and registers itself on ``app`` here. A
command parses its options, calls one operation of ``cluster_cli.control`` and renders
the result through ``ui``; command modules import neither the probe, the state nor the placer.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from cluster_cli import __version__

DEFAULT_STATE = Path(".clusterctl/state.db")


def tidy_metavars(cmd: Any, ctx: Any) -> None:
    """Help shows what an option takes: nothing for a flag (Typer's rich help would print
    ``<bool>``), and the value's name for a repeatable one (``NODE``, not ``<list[str]>``).
    Typer carries its own copy of click, so options are told by their attributes."""
    for p in cmd.get_params(ctx):
        if getattr(p, "param_type_name", None) != "option" or p.metavar is not None:
            continue
        if getattr(p, "is_flag", False) or getattr(p, "count", False):
            p.metavar = ""
        elif getattr(p, "multiple", False) and p.name:
            p.metavar = p.name.upper()


# The click that Typer uses (its own copy since 0.16, the click package before).
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


_WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})  # what a write to a full disk says


@contextmanager
def _one_line_errors(command_path: str = "") -> Iterator[None]:
    """A usage error (unknown option, bad value, missing argument) as one ``error:`` line
    naming the command, like every other error, instead of Typer's usage-and-panel block; an
    OSError no command handled (output that cannot be written) as one line, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.EPIPE:  # a reader that left (``| head``): Typer ends quietly
            raise
        # Most often stdout itself (a full disk under ``> file``): then its unwritten rest goes
        # nowhere, so that the exit does not fail on it a second time with a traceback.
        output_failed = e.filename is None and e.errno in _WRITE_ERRORS
        if output_failed:
            with suppress(OSError, ValueError):
                sys.stdout.flush()
            with suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        from cluster_cli.cli import ui

        where = f"{e.filename}: " if e.filename else "cannot write the output: " if output_failed else ""
        ui.err.print(f"[bold red]error:[/] {ui.escape(where + (e.strerror or str(e)))}", highlight=False)
        raise typer.Exit(2) from None
    except _ClickException as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # no arguments: the help is the answer
            raise
        from cluster_cli.cli import ui

        ctx = getattr(e, "ctx", None)
        # Click raises a missing option value with no context: the caller names the command.
        path = getattr(ctx, "command_path", "") or command_path or "clusterctl"
        message = " ".join(e.format_message().split())
        ui.err.print(f"[bold red]error:[/] {ui.escape(f'{path}: {message} (see: {path} -h)')}", highlight=False)
        raise typer.Exit(e.exit_code) from None


class _Group(TyperGroup):
    """The root command: its own help and every subcommand's get tidy metavars; usage
    errors on one line."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with _one_line_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or []
        args = [*protected, *ctx.args]
        sub = f"{ctx.command_path} {args[0]}" if args and args[0] in self.commands else ""
        with _one_line_errors(sub):
            return super().invoke(ctx)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            tidy_metavars(cmd, ctx)
        return cmd

    def format_help(self, ctx: Any, formatter: Any) -> None:
        tidy_metavars(self, ctx)
        super().format_help(ctx, formatter)


app = typer.Typer(
    cls=_Group,
    name="clusterctl",
    help="Turn a fleet of SSH-reachable servers into an LLM serving cluster.\n\nGlobal options (--state, -v) may also follow the command.",
    epilog=(
        "Examples:\n\n"
        "  clusterctl discover -i inventory.yaml\n\n"
        '  clusterctl cordon gpu-03 --reason "ECC storm"\n\n'
        "  clusterctl place --dry-run -c catalog.yaml\n\n"
        "  clusterctl serve-router --config router.yaml --port 8000"
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass
class App:
    """Shared settings for every command (on ``ctx.obj``)."""

    state: str  # --state / CLUSTERCTL_STATE as given, checked when a command first uses it
    verbose: bool = False

    @cached_property
    def state_path(self) -> Path:
        """The state database's path (checked once); a path that cannot be one is a one-line error (exit 2)."""
        return checked_state_path(self.state)


def checked_state_path(given: str) -> Path:
    from cluster_cli.cli import ui

    if not given.strip():
        ui.abort("empty state path (--state / CLUSTERCTL_STATE): give the database's file, e.g. .clusterctl/state.db")
    path = Path(given)
    try:
        if path.is_dir():
            ui.abort(f"{given}: is a folder, not a state database file (--state / CLUSTERCTL_STATE)")
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    ui.abort(f"{given}: {parent} is a file, not a folder (--state / CLUSTERCTL_STATE)")
                break
    except OSError:
        pass  # a folder that cannot be entered: opening the state says so, as for any path
    return path


def _version(value: bool) -> None:
    if value:
        typer.echo(f"clusterctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    state: str = typer.Option(
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
    if state is None:
        state = os.environ.get("CLUSTERCTL_STATE") or str(DEFAULT_STATE)
    ctx.obj = App(state=state, verbose=verbose)


def _register() -> None:
    # Imported for their side effect of adding commands to ``app``.
    import importlib

    for mod in ("discover", "cordon", "place", "launch", "supervise", "drain", "events", "serve_router"):
        try:
            importlib.import_module(f"cluster_cli.cli.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"cluster_cli.cli.{mod}":
                raise


_register()


_GLOBAL_FLAGS = ("-v", "--verbose")
_GLOBAL_VALUED = ("--state",)


def hoist_global_options(args: list[str]) -> list[str]:
    """Let ``--state``/``-v`` follow the command too (``clusterctl discover -i x --state s.db``).

    They are moved in front of the command name, which is where click looks for them. The
    values of the command's own options are skipped, never mistaken for global options, and
    nothing after ``--`` moves.
    """
    if not any(a in _GLOBAL_FLAGS or a.split("=", 1)[0] in _GLOBAL_VALUED for a in args[1:]):
        return args  # the common case: nothing to move, and no second build of the command tree
    import typer.main

    group = typer.main.get_command(app)
    i, n = 0, len(args)
    while i < n and args[i].startswith("-"):  # global options before the command
        i += 2 if args[i] in _GLOBAL_VALUED else 1
    if i >= n or not hasattr(group, "commands") or args[i] not in group.commands:
        return args
    sub = group.commands[args[i]]
    takes_value = {o for p in sub.params if getattr(p, "opts", None) and not getattr(p, "is_flag", True)
                   for o in (*p.opts, *p.secondary_opts)}  # fmt: skip
    front, rest = args[: i + 1], []
    hoisted: list[str] = []
    j = i + 1
    while j < n:
        a = args[j]
        if a == "--":
            rest += args[j:]
            break
        if a in _GLOBAL_FLAGS:
            hoisted.append(a)
        elif a in _GLOBAL_VALUED and j + 1 < n:
            hoisted += [a, args[j + 1]]
            j += 1
        elif a.split("=", 1)[0] in _GLOBAL_VALUED and "=" in a:
            hoisted.append(a)
        else:
            rest.append(a)
            if a in takes_value and j + 1 < n:
                rest.append(args[j + 1])
                j += 1
        j += 1
    return [*hoisted, *front, *rest]


def run() -> None:
    if "_CLUSTERCTL_COMPLETE" in os.environ:
        # Shell completion (eval "$(_CLUSTERCTL_COMPLETE=source_bash clusterctl)"): Typer's
        # completion classes answer click's protocol, without --install-completion in every help.
        from typer._completion_classes import completion_init

        completion_init()
    app(args=hoist_global_options(sys.argv[1:]), prog_name="clusterctl")


if __name__ == "__main__":
    # Run through the imported module so commands registered on ``app`` are found.
    from cluster_cli.cli.main import run as _run

    _run()
