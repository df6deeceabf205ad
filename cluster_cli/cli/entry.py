"""The ``clusterctl`` command's entry point: a Ctrl-C while the CLI is still loading (its
imports take a few tenths of a second) ends it quietly with 130, as a Ctrl-C later does,
instead of a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from cluster_cli.cli.main import run
    except KeyboardInterrupt:
        sys.exit(130)
    run()
