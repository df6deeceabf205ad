"""Pieces the benchmarks share (run as scripts: ``bench/`` is on their path)."""

from __future__ import annotations

import compileall
import os
import shutil
import statistics
import sys
import threading
from pathlib import Path
from typing import Any


class Series:
    """The runs of one command; a run has ``ok`` and ``wall_s`` (and what else it measured).
    Its medians and minimum are None once any run failed: a failure is never timed."""

    def __init__(self) -> None:
        self.runs: list[Any] = []

    @property
    def good(self) -> list[Any]:
        return [r for r in self.runs if r.ok]

    @property
    def failed(self) -> list[Any]:
        return [r for r in self.runs if not r.ok]

    def median(self, attr: str = "wall_s") -> float | None:
        g = self.good
        return statistics.median(getattr(r, attr) for r in g) if g and not self.failed else None

    def min(self) -> float | None:
        g = self.good
        return min(r.wall_s for r in g) if g and not self.failed else None


class Sampler:
    """Calls ``sample()`` every ``every`` seconds on a thread of its own, while in a ``with``."""

    every = 1.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


class LoadSampler(Sampler):
    """Samples the 1-minute load average once a second while running."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[float] = [os.getloadavg()[0]]

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        if not self.samples:
            return "-"
        return f"{statistics.mean(self.samples):.1f} (max {max(self.samples):.1f})"


def tool(name: str, bench: str) -> str:
    """The real entry point ``name`` next to this interpreter (not a pyenv shim), else PATH.
    For ``clusterctl``, the checkout's bytecode is compiled first: an installed package has
    its ``.pyc`` files, and a run that compiles a module the other commands had cached (or
    that cannot write its cache, under ``PYTHONDONTWRITEBYTECODE``) measures the compiler."""
    if name == "clusterctl":
        compileall.compile_dir(str(Path(__file__).resolve().parent.parent / "cluster_cli"), quiet=1)
    p = Path(sys.executable).parent / name
    if p.exists():
        return str(p)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{bench} bench: {name} not found")
    return found
