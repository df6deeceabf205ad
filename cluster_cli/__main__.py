"""``python -m cluster_cli`` runs the CLI."""

from cluster_cli.cli.main import run

run()
