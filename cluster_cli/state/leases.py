"""Leases: which process may act alone on the cluster (``supervise``), and a fence on its
writes (a part of ``Store``).

A lease has a name, a holder (with its host and PID, for the operator who must find it), an
expiry and an epoch. Taking a lease that is free or expired raises its epoch; renewing keeps
it. A handle that writes under a lease (``Store.lease``) has every write refused, in the same
transaction, once the lease's epoch in the state is no longer its own or it expired: a
supervisor paused past its expiry (a frozen VM, a stopped process) whose lease another one
took cannot overwrite what the new one did.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster_cli.errors import StateError
from cluster_cli.state.backend import Tx


class LeaseHeld(StateError):
    """Another holder has the lease, and it has not expired."""


class LeaseLost(StateError):
    """A write under a lease whose epoch is stale, or that expired: another may act now."""


@dataclass(frozen=True)
class Lease:
    name: str
    holder: str
    host: str
    pid: int
    epoch: int
    acquired_at: float
    expires_at: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "holder": self.holder,
            "host": self.host,
            "pid": self.pid,
            "epoch": self.epoch,
            "acquired_at": self.acquired_at,
            "expires_at": self.expires_at,
        }

    def who(self) -> str:
        return f"{self.holder} (pid {self.pid} on {self.host})"


_COLUMNS = "name, holder, host, pid, epoch, acquired_at, expires_at"


class Leases:
    """Mixed into ``Store``."""

    path: Any

    if TYPE_CHECKING:  # provided by Store

        def _read(self) -> Any: ...
        def _tx(self, *, bump: bool = False) -> Any: ...
        def _event(self, tx: Tx, kind: str, message: str, **kw: Any) -> None: ...

    def acquire_lease(
        self, name: str, holder: str, ttl_s: float, *, host: str | None = None, pid: int | None = None
    ) -> Lease:
        """Take lease ``name`` for ``ttl_s`` seconds. The same holder renews it (same epoch);
        a free or expired one is taken with the next epoch. Raises LeaseHeld naming the holder."""
        host = host or socket.gethostname()
        pid = pid if pid is not None else os.getpid()
        now = time.time()
        with self._tx() as tx:
            cur = _lease(tx, name)
            if cur is not None and cur.holder != holder and cur.expires_at > now:
                raise LeaseHeld(
                    f"{self.path}: the {name} lease is held by {cur.who()} until "
                    f"{time.strftime('%H:%M:%S', time.localtime(cur.expires_at))}"
                )
            if cur is not None and cur.holder == holder and cur.expires_at > now:
                epoch, acquired = cur.epoch, cur.acquired_at
            else:
                epoch, acquired = (cur.epoch + 1 if cur is not None else 1), now
            tx.execute(
                f"INSERT INTO leases({_COLUMNS}) VALUES (?,?,?,?,?,?,?) ON CONFLICT (name) DO UPDATE SET "
                "holder=excluded.holder, host=excluded.host, pid=excluded.pid, epoch=excluded.epoch, "
                "acquired_at=excluded.acquired_at, expires_at=excluded.expires_at",
                (name, holder, host, pid, epoch, acquired, now + ttl_s),
            )
            if cur is None or epoch != cur.epoch:
                was = f" (taken over from {cur.who()}, expired)" if cur is not None and cur.holder != holder else ""
                self._event(tx, "lease", f"{name} lease taken by {holder}, epoch {epoch}{was}",
                            detail={"lease": name, "holder": holder, "host": host, "pid": pid, "epoch": epoch})  # fmt: skip
            return Lease(name, holder, host, pid, epoch, acquired, now + ttl_s)

    def renew_lease(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend ``lease``. Raises LeaseLost when its epoch is stale or it expired."""
        now = time.time()
        with self._tx() as tx:
            self._check_lease(tx, lease)
            tx.execute(
                "UPDATE leases SET expires_at=? WHERE name=? AND epoch=?", (now + ttl_s, lease.name, lease.epoch)
            )
        return Lease(lease.name, lease.holder, lease.host, lease.pid, lease.epoch, lease.acquired_at, now + ttl_s)

    def release_lease(self, lease: Lease) -> bool:
        """Give ``lease`` up (if still ours): another may take it at once."""
        with self._tx() as tx:
            n = tx.execute(
                "UPDATE leases SET expires_at=? WHERE name=? AND epoch=? AND holder=?",
                (0.0, lease.name, lease.epoch, lease.holder),
            ).rowcount
            if n:
                self._event(tx, "lease", f"{lease.name} lease released by {lease.holder}")
        return n > 0

    def lease_of(self, name: str) -> Lease | None:
        with self._read() as tx:
            return _lease(tx, name)

    def _check_lease(self, tx: Tx, lease: Lease) -> None:
        cur = _lease(tx, lease.name)
        if cur is None or cur.epoch != lease.epoch:
            who = cur.who() if cur is not None else "no one"
            raise LeaseLost(
                f"{self.path}: the {lease.name} lease of epoch {lease.epoch} is stale: "
                f"{who} holds it now (epoch {cur.epoch if cur else '-'}); nothing was written"
            )
        if cur.expires_at <= time.time():
            raise LeaseLost(
                f"{self.path}: the {lease.name} lease of {lease.holder} expired; renew it first (nothing was written)"
            )


def _lease(tx: Tx, name: str) -> Lease | None:
    row = tx.execute(f"SELECT {_COLUMNS} FROM leases WHERE name=?", (name,)).fetchone()
    return Lease(*row) if row else None
