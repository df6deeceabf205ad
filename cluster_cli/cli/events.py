"""``clusterctl events``: what happened to the cluster, and who did it; newest last, ``-f`` follows.

The events come from the state (``cluster_cli.control.events``); this module only parses
the options, asks for them and renders. Event text may come from nodes: it is printed with control
characters shown as escapes and rich markup escaped.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.markup import escape

from cluster_cli.cli import ui
from cluster_cli.cli.main import App, app
from cluster_cli.control import events as log
from cluster_cli.control.events import EVENT_KINDS, Event, EventQuery
from cluster_cli.errors import ClusterctlError

EVENTS_EXAMPLE = """
Examples:

  clusterctl events
  clusterctl events -n 200 --since 2h
  clusterctl events --node gpu-03 --kind cordon --kind uncordon
  clusterctl events --replica tiny/0 -f
  clusterctl events -f -o json | jq -c 'select(.kind == "failed")'
  clusterctl events --keep 7d --keep-max 50000

Newest last. --since takes 30s, 10m, 2h, 7d, or an ISO-8601 time
(2024-05-01T12:00: local time unless it names its zone).
-f prints new events as they come, until Ctrl-C; with -o json, as JSON Lines
(one JSON object per line, one line per event).
--keep and --keep-max set how long and how many events the state keeps.
"""

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_REPLICA = re.compile(r"^[^/\s]+(/\d+)?$")
COLUMNS: list[tuple[str, int | None]] = [
    ("TIME", 0), ("KIND", 0), ("NODE", 12), ("REPLICA", 12), ("ACTOR", 0), ("MESSAGE", None),
]  # fmt: skip
_LINE = "{:<19}  {:<16}  {:<12}  {:<14}  {:<10}  {}"  # -f in a table: one line per event, as it comes


def duration_s(value: str) -> float | None:
    """``30s``, ``10m``, ``2h``, ``7d``, ``1w`` in seconds; None for anything else."""
    m = _DURATION.match(value)
    return float(m[1]) * _UNITS[m[2].lower()] if m else None


def since_time(value: str, now: float) -> float:
    """The Unix time ``--since`` means: ``now`` less a duration, or an ISO-8601 time (local
    unless it names its zone). A one-line error (exit 2) for anything else."""
    d = duration_s(value)
    if d is not None:
        return now - d
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        ui.abort(f"--since {value!r}: not a duration (30s, 10m, 2h, 7d) nor an ISO-8601 time (2024-05-01T12:00)")


def _query(lines: int, kind: list[str] | None, since: str | None, node: str | None, replica: str | None) -> EventQuery:
    if replica is not None and not _REPLICA.match(replica):
        ui.abort(f"--replica {replica!r}: give MODEL/N (tiny/0) or a model's name (tiny)")
    when = None if since is None else since_time(since, time.time())
    return EventQuery(lines, _kinds(kind), when, node, replica)


def _kinds(given: list[str] | None) -> frozenset[str]:
    """The kinds asked for (``--kind`` repeated or comma-separated); empty: all."""
    kinds = [k.strip() for g in given or () for k in g.split(",") if k.strip()]
    bad = next((k for k in kinds if k not in EVENT_KINDS), None)
    if bad is not None:
        ui.abort(f"--kind {bad!r}: not a kind of event (one of: {', '.join(EVENT_KINDS)})")
    return frozenset(kinds)


def _plain(text: object) -> str:
    """One line of text as it is, but control characters (ESC, newline...) shown as escapes."""
    s = str(text)
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)


def cells(e: Event) -> list[str]:
    """TIME (local), KIND, NODE, REPLICA (``tiny/0 g3``), ACTOR, MESSAGE; ``-`` when empty. Plain text."""
    replica = e.name or e.model
    if replica is not None and e.generation is not None:
        replica = f"{replica} g{e.generation}"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at))
    return [when] + [_plain(v) if v not in (None, "") else "-" for v in (e.kind, e.node, replica, e.actor, e.message)]


def _show(store: Any, query: EventQuery, output: ui.Output) -> None:
    found = log.newest(store, query)
    if output is not ui.Output.table:
        ui.emit_data({"events": [e.to_dict() for e in found]}, output)
    elif found:
        ui.print_table(COLUMNS, [[escape(c) for c in cells(e)] for e in found])
    elif log.is_empty(store):
        ui.info("no events yet")
    elif query.lines:
        ui.info("no events match")


class _Stream:
    """Events printed as they come: fixed-width lines under one header, JSON Lines, or YAML documents."""

    def __init__(self, output: ui.Output) -> None:
        self.output = output
        if output is ui.Output.table:
            header = _LINE.format(*(head for head, _ in COLUMNS))
            ui.out.print(f"[bold]{escape(header)}[/]", highlight=False)

    def write(self, found: list[Event]) -> None:
        for e in found:
            if self.output is ui.Output.json:
                sys.stdout.write(json.dumps(e.to_dict()) + "\n")
            elif self.output is ui.Output.yaml:
                sys.stdout.write(yaml.safe_dump(e.to_dict(), sort_keys=False, explicit_start=True))
            else:
                ui.out.print(escape(_LINE.format(*cells(e))), highlight=False)
        sys.stdout.flush()


def _follow(store: Any, query: EventQuery, output: ui.Output) -> None:
    """The newest matching events, then every new one as it is written, until Ctrl-C (exit 0)."""
    try:
        follow = log.Follow(store, query)
        first = follow.first()
        stream = _Stream(output)
        stream.write(first)
        if follow.was_empty and output is ui.Output.table:
            ui.info("no events yet; waiting for new ones (Ctrl-C to stop)")
        for new in follow:
            stream.write(new)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


def _span(days: float) -> str:
    seconds = days * 86400
    unit = next((u for u in "dhms" if seconds >= _UNITS[u] and seconds % _UNITS[u] == 0), None)
    return f"{seconds / _UNITS[unit]:g}{unit}" if unit else f"{days:g} days"


def _set_retention(path: Path, keep: str | None, keep_max: int | None, output: ui.Output) -> None:
    days = None
    if keep is not None:
        seconds = duration_s(keep)
        if seconds is None or seconds <= 0:
            ui.abort(f"--keep {keep!r}: give a duration above zero (12h, 7d, 30d)")
        days = seconds / 86400
    try:
        kept = log.set_retention(path, days=days, max_events=keep_max)
    except ClusterctlError as e:
        ui.fail(e)
    if output is not ui.Output.table:
        ui.emit_data({"retention": {"days": kept.days, "max_events": kept.max_events}}, output)
    else:
        ui.out.print(f"events kept for {_span(kept.days)}, at most {kept.max_events:,} of them", highlight=False)


@app.command(epilog=EVENTS_EXAMPLE)
def events(
    ctx: typer.Context,
    follow: bool = typer.Option(
        False, "-f", "--follow", help="Keep printing new events until Ctrl-C (-o json: JSON Lines, one per event)."
    ),
    lines: int = typer.Option(50, "-n", "--lines", min=0, help="The last N events (with -f: before following)."),
    since: str | None = typer.Option(
        None, "--since", metavar="DURATION", help="Only events since then: 30s, 10m, 2h, 7d, or an ISO-8601 time."
    ),
    node: str | None = typer.Option(None, "--node", metavar="NODE", help="Only events about this node."),
    replica: str | None = typer.Option(
        None, "--replica", metavar="MODEL/N", help="Only events about this replica (a model's name: all its replicas)."
    ),
    kind: list[str] | None = typer.Option(
        None, "--kind", metavar="KIND", help="Only events of this kind (repeatable): " + ", ".join(EVENT_KINDS) + "."
    ),
    keep: str | None = typer.Option(
        None, "--keep", metavar="DURATION", help="Keep events this long (7d, 30d); prints the retention."
    ),
    keep_max: int | None = typer.Option(
        None, "--keep-max", min=1, metavar="N", help="Keep at most N events; prints the retention."
    ),
    output: ui.Output = ui.OUTPUT_OPTION,
) -> None:
    """What happened to the cluster, newest last: time, kind, node, replica, actor, message."""
    state: App = ctx.obj
    if keep is not None or keep_max is not None:
        if follow:
            ui.abort("--keep and --keep-max set the retention: they do not go with -f")
        _set_retention(state.state_path, keep, keep_max, output)
        return
    query = _query(lines, kind, since, node, replica)
    try:
        store = log.open_log(state.state_path, follow=follow)
    except ClusterctlError as e:
        ui.fail(e)
    with store:
        try:
            (_follow if follow else _show)(store, query, output)
        except ClusterctlError as e:
            ui.fail(e)
