"""The event log as operations: what happened to the cluster, and who did it, newest last;
following it as it is written; how long it is kept.

Events come from the state (``Store.events``). A kind is not a filter the store has: it
is applied here. Nothing here prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_cli.errors import StateError
from cluster_cli.state.eventlog import Event, Retention
from cluster_cli.state.schema import EVENT_KINDS
from cluster_cli.state.store import Store

__all__ = ["EVENT_KINDS", "POLL_S", "Event", "EventQuery", "Follow", "Retention", "newest", "open_log", "set_retention"]

POLL_S = 0.5  # how often a follower asks the state for new events


@dataclass(frozen=True)
class EventQuery:
    """Which events: the newest ``lines`` that match every filter given; ``kinds`` empty:
    every kind. ``since`` is a Unix time; ``replica`` is MODEL/N or a model's name."""

    lines: int = 50
    kinds: frozenset[str] = frozenset()
    since: float | None = None
    node: str | None = None
    replica: str | None = None

    def filters(self) -> dict[str, Any]:
        """The filters the store applies itself."""
        return {"since": self.since, "node": self.node, "replica": self.replica}


def open_log(state_path: Path, *, follow: bool = False) -> Store:
    """The state at ``state_path``, read only, to read events from (the caller closes it).
    ``follow``: a StateError for a state at an older schema, since a follower reads the
    file as this clusterctl writes it, and a read-only open only reads a migrated copy."""
    store = Store(state_path, readonly=True)
    if follow and store.on_disk_schema < store.schema:
        store.close()
        raise StateError(
            f"{state_path}: the state is at schema {store.on_disk_schema}: -f follows the file as this "
            f"clusterctl writes it ({store.schema}); a command that writes upgrades it ('clusterctl status --no-check')"
        )
    return store


def newest(store: Store, query: EventQuery) -> list[Event]:
    """The newest ``query.lines`` events that match, newest last. With ``kinds``, more events
    are read, four times as many each round, until enough match."""
    lines, kinds, filters = query.lines, query.kinds, query.filters()
    if not kinds:
        return store.events(lines, **filters)
    want = max(lines, 1)
    while lines:
        got = store.events(want, **filters)
        hit = [e for e in got if e.kind in kinds]
        if len(hit) >= lines or len(got) < want:
            return hit[-lines:]
        want *= 4
    return []


def is_empty(store: Store) -> bool:
    """Whether the state has never held an event (or every one was pruned)."""
    return store.last_event_id() == 0


class Follow:
    """The events of ``query`` as they come: :meth:`first` the newest that match, then each
    iteration one batch of new matching ones, polled every ``poll_s``; forever (a caller
    ends it, on Ctrl-C). Nothing written between the first read and the polls is missed."""

    def __init__(
        self, store: Store, query: EventQuery, *, poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.store = store
        self.query = query
        self.poll_s = poll_s
        self._sleep = sleep
        self._cursor = 0
        self.was_empty = False  # the state held no event at the first read

    def first(self) -> list[Event]:
        cursor = self.store.last_event_id()  # before the first read: nothing written meanwhile is missed
        found = newest(self.store, self.query)
        self.was_empty = cursor == 0
        self._cursor = max([cursor, *(e.id for e in found)])
        return found

    def __iter__(self) -> Iterator[list[Event]]:
        kinds, filters = self.query.kinds, self.query.filters()
        while True:
            self._sleep(self.poll_s)
            new = self.store.events(None, after_id=self._cursor, **filters)
            if new:
                self._cursor = new[-1].id
                yield [e for e in new if not kinds or e.kind in kinds]
            elif self.store.last_event_id() < self._cursor:  # every event was pruned: ids start again from 1
                self._cursor = 0


def set_retention(state_path: Path, *, days: float | None = None, max_events: int | None = None) -> Retention:
    """Keep events ``days`` long and at most ``max_events`` of them (None: as it is); the
    retention now. The state must exist."""
    with Store(state_path, create=False, actor="events") as store:
        return store.set_retention(days=days, max_events=max_events)
