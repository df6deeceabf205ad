#!/usr/bin/env python3
"""Start-up time of the one-file binary against the virtualenv's console script.

``dist/clusterctl`` (``make dist``) and ``.venv/bin/clusterctl`` run side by side,
interleaved, ``--repeat`` times each (after ``--warmup`` runs not counted), for each of
``--version`` and ``--help``; any ``--extra LABEL=PATH`` (e.g. PyInstaller's own one-file
build, ``DIST_ONEFILE=1 make dist``: ``--extra onefile=build/dist/onefile/clusterctl``) runs
in the same rounds. Each run is a fresh process, timed wall-clock from spawn to exit, with
its output checked (``--version`` must print ``clusterctl <version>``).

The binary unpacks itself on its first run; here it unpacks into a cache folder of its own
(``CLUSTERCTL_CACHE_DIR``, a temporary folder), so the user's cache is left alone. The
first-run row times ``--version`` with an empty cache folder each time (``--cold`` runs; the
unpacking included). Prints medians, minima and the ratio binary / virtualenv (the target:
1.5x or less), and the files' sizes. ``--json PATH`` writes the same figures.

    python bench/startup.py
    python bench/startup.py --repeat 20 --extra onefile=build/dist/onefile/clusterctl --json startup.json
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.5


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"startup: {' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return dt, p.stdout


def size(path: str) -> int:
    p = Path(path)
    if (p.parent / "_internal").is_dir():  # a PyInstaller onedir program: its whole folder
        p = p.parent
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return p.stat().st_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=str(ROOT / "dist" / "clusterctl"), help="the one-file build")
    ap.add_argument("--venv", default=str(ROOT / ".venv" / "bin" / "clusterctl"), help="the console script")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=PATH", help="another build to time")
    ap.add_argument("--repeat", "-n", type=int, default=10, help="timed runs of each (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="runs of each not counted (default 2)")
    ap.add_argument("--cold", type=int, default=3, help="first runs, each with an empty cache (default 3)")
    ap.add_argument("--commands", default="--version,--help", help="comma-separated argument lists")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    a = ap.parse_args()

    contenders: dict[str, str] = {"binary": a.binary, "venv": a.venv}
    for e in a.extra:
        label, sep, path = e.partition("=")
        if not sep or not label or not path:
            ap.error(f"--extra {e}: give LABEL=PATH")
        contenders[label] = path
    for label, path in contenders.items():
        if not os.access(path, os.X_OK):
            hint = " (make dist builds it)" if label == "binary" else ""
            raise SystemExit(f"startup: {label}: {path} is not an executable file{hint}")

    # The console script's package with its bytecode, as an installed one has it.
    compileall.compile_dir(str(ROOT / "cluster_cli"), quiet=1)
    cache = tempfile.mkdtemp(prefix="clusterctl-startup-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLUSTERCTL_", "_CLUSTERCTL_"))}
    env["CLUSTERCTL_CACHE_DIR"] = cache
    env.pop("PYTHONPATH", None)
    commands = [c.split() for c in a.commands.split(",") if c.strip()]
    try:
        expected = timed([a.venv, "--version"], env)[1].strip()  # what both must print
        # First runs: an empty cache folder each time (the unpacking included).
        cold: list[float] = []
        for i in range(a.cold):
            fresh = os.path.join(cache, f"cold-{i}")
            dt, out = timed([a.binary, "--version"], {**env, "CLUSTERCTL_CACHE_DIR": fresh})
            if out.strip() != expected:
                raise SystemExit(f"startup: binary --version printed {out.strip()!r}, the venv {expected!r}")
            cold.append(dt)
            shutil.rmtree(fresh, ignore_errors=True)

        times: dict[str, dict[str, list[float]]] = {" ".join(c): {k: [] for k in contenders} for c in commands}
        for r in range(a.warmup + a.repeat):
            for cmd in commands:
                key = " ".join(cmd)
                order = list(contenders.items())
                if r % 2:  # alternate who goes first, so neither always runs on a warmer cache
                    order.reverse()
                for label, path in order:
                    dt, out = timed([path, *cmd], env)
                    if cmd == ["--version"] and out.strip() != expected:
                        raise SystemExit(f"startup: {label} --version printed {out.strip()!r}, the venv {expected!r}")
                    if r >= a.warmup:
                        times[key][label].append(dt)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    print(
        f"clusterctl start-up: {a.repeat} runs each after {a.warmup} warm-ups, interleaved; "
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print()
    print(f"{'command':<12} {'build':<10} {'median s':>9} {'min s':>7} {'max s':>7} {'vs venv':>8}")
    result: dict[str, object] = {"repeat": a.repeat, "warmup": a.warmup, "commands": {}}
    ok = True
    for key, per in times.items():
        venv_median = statistics.median(per["venv"])
        rows = {}
        for label, ts in per.items():
            med = statistics.median(ts)
            ratio = med / venv_median
            print(f"{key:<12} {label:<10} {med:>9.3f} {min(ts):>7.3f} {max(ts):>7.3f} {ratio:>7.2f}x")
            rows[label] = {"median_s": med, "min_s": min(ts), "max_s": max(ts), "ratio_vs_venv": ratio, "runs": ts}
            if label == "binary" and key == "--version" and ratio > TARGET:
                ok = False
        result["commands"][key] = rows  # type: ignore[index]
        print()
    cold_median = statistics.median(cold) if cold else None
    if cold_median is not None:
        print(
            f"first run (empty cache, unpacking included), --version: median {cold_median:.3f} s, min {min(cold):.3f} s"
        )
    sizes = {label: size(path) for label, path in contenders.items()}
    venv_dir = Path(a.venv).resolve().parent.parent
    print(f"size: binary {sizes['binary'] / 1e6:.1f} MB", end="")
    for label, n in sizes.items():
        if label not in ("binary", "venv"):
            print(f", {label} {n / 1e6:.1f} MB", end="")
    print(f" (the virtualenv's folder: {size(str(venv_dir)) / 1e6:.0f} MB, test tools included)")
    bmed = statistics.median(times["--version"]["binary"]) if "--version" in times else None
    vmed = statistics.median(times["--version"]["venv"]) if "--version" in times else None
    if bmed is not None and vmed is not None:
        verdict = "meets" if bmed / vmed <= TARGET else "MISSES"
        print(f"--version: binary / venv = {bmed / vmed:.2f}x: {verdict} the target of {TARGET}x or less")
    result.update({"first_run_s": cold, "first_run_median_s": cold_median, "sizes_bytes": sizes, "target": TARGET})
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
