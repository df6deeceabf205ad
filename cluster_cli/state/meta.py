"""The ``meta`` table's key/value rows inside a transaction, and the state version: what every
part of the store reads and writes through, so that each is spelt once."""

from __future__ import annotations

from cluster_cli.state.backend import Tx


def get_meta(tx: Tx, key: str) -> str | None:
    row = tx.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return row[0] if row else None


def set_meta(tx: Tx, key: str, value: str) -> None:
    tx.execute(
        "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value", (key, value)
    )


def bump(tx: Tx) -> None:
    """A new state version: what a plan computed from the old one must not be applied."""
    tx.execute("UPDATE meta SET value = CAST(CAST(value AS INTEGER) + 1 AS TEXT) WHERE key = 'state_version'")
