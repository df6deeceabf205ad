"""Cordons as operations on the state: keep new work off a node, or allow it again.

Cordons live in their own table, so a later ``discover`` never clears them; a cordon
outlives its node's removal from the inventory, so it can always be lifted.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_cli.errors import ConfigError
from cluster_cli.state.store import Store

MAX_REASON = 500  # characters: it is printed on every explanation line of the node


def check_reason(reason: str) -> str:
    """The reason, trimmed; a ConfigError when it is empty, holds a control character
    (newline, tab, ESC...) or is longer than ``MAX_REASON``. It is shown by discover and
    place, so it must be one line of plain text."""
    reason = reason.strip()
    if not reason:
        raise ConfigError("--reason must not be empty")
    bad = next((c for c in reason if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        raise ConfigError(f"--reason: control character U+{ord(bad):04X} not allowed: give one line of plain text")
    if len(reason) > MAX_REASON:
        raise ConfigError(f"--reason: {len(reason)} characters, at most {MAX_REASON}")
    return reason


@dataclass(frozen=True)
class Cordoned:
    """A cordon set: the node, its reason, and the cordon it replaced (``reason``,
    ``created_at``), None when the node was not cordoned."""

    node: str
    reason: str
    was: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "reason": self.reason, "was": self.was}


def cordon(store: Store, node: str, reason: str, *, inventory: Path, recorded: Path | None = None) -> Cordoned:
    """Cordon ``node`` (checked against ``inventory`` by the caller) with ``reason`` (see
    :func:`check_reason`). ``inventory`` is recorded when the state has none; it replaces
    ``recorded``, the one the state recorded before, when that file is gone (later
    commands without -i would otherwise keep failing on it until the next discover)."""
    gone = recorded is not None and not recorded.is_file()
    was = store.cordon(node, reason, inventory=inventory.resolve(), replace_inventory=gone)
    return Cordoned(node, reason, was)


def uncordon(store: Store, node: str) -> bool:
    """Lift ``node``'s cordon; whether it had one."""
    return store.uncordon(node)


def is_cordoned(state_path: Path, node: str) -> bool:
    """Whether the state at ``state_path`` (read only; none there: no) cordons ``node``."""
    if not state_path.exists():
        return False
    with Store(state_path, readonly=True) as store:
        return node in store.cordons()


def cordon_gpu(store: Store, node: str, gpu: int, reason: str) -> Cordoned:
    """Cordon GPU ``gpu`` of ``node`` (whose node the caller checked against the inventory).
    A node discover has seen must have that GPU; one not seen yet may be cordoned ahead."""
    facts = store.nodes([node])
    if facts and facts[0].gpus and all(g.index != gpu for g in facts[0].gpus):
        have = ", ".join(str(g.index) for g in facts[0].gpus)
        raise ConfigError(f"{node} has no GPU {gpu} (its GPUs: {have})")
    if facts and not facts[0].gpus and facts[0].reachable and facts[0].probed_at is not None:
        raise ConfigError(f"{node} has no GPUs (discover saw none)")
    was = store.cordon_gpu(node, gpu, reason)
    return Cordoned(f"{node} GPU {gpu}", reason, was)


def uncordon_gpu(store: Store, node: str, gpu: int) -> bool:
    """Lift the cordon of GPU ``gpu`` of ``node``; whether it had one."""
    return store.uncordon_gpu(node, gpu)
