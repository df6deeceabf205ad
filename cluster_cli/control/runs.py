"""Which runs that change replicas (``up`` now, ``supervise`` next) are going on one state.

Each run holds an exclusive ``flock`` on a file of its own, ``STATE.runs/ID.lock``, for as
long as it lives; the kernel drops the lock when the process ends, however it ends. A
replica a run leaves ``planned`` or ``starting`` records that run's id: another run leaves
it be while that lock is held, and takes it over as an interrupted run's leftover once not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path
from typing import IO


class Runs:
    """This process's run on a state, and a way to ask whether another run is still alive.

    Use as a context manager. Where the state's folder is not writable the run holds no
    lock; it then tells no other run it is alive (the state refuses its writes anyway)."""

    def __init__(self, state_path: Path) -> None:
        self.dir = state_path.with_name(state_path.name + ".runs")
        self.id = secrets.token_hex(6)
        self._file: IO[str] | None = None

    def __enter__(self) -> Runs:
        try:
            self.dir.mkdir(mode=0o700, exist_ok=True)
            self._sweep()
            # Locked under a name no one checks, then renamed: a file under its final name is
            # locked from the moment it is seen.
            tmp = self.dir / f".{self.id}.tmp"
            f = open(tmp, "w")
        except OSError:
            return self
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self._path(self.id))
        except OSError:
            f.close()
            return self
        self._file = f
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path(self.id))
            self._file.close()
            self._file = None

    def alive(self, run_id: str | None) -> bool:
        """Whether run ``run_id`` (this one included) is still going."""
        if not run_id:
            return False
        if run_id == self.id:
            return True
        try:
            f = open(self._path(run_id))  # noqa: SIM115
        except (OSError, ValueError):
            return False
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            except OSError:
                return False
            return False

    def _path(self, run_id: str) -> Path:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"not a run id: {run_id!r}")
        return self.dir / f"{run_id}.lock"

    def _sweep(self) -> None:
        """Remove the files of runs that ended without removing their own (a kill -9)."""
        for p in [*self.dir.glob("*.lock"), *self.dir.glob(".*.tmp")]:
            try:
                with open(p) as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    p.unlink()
            except OSError:
                continue
