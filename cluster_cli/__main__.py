"""``python -m cluster_cli`` runs the CLI."""

from cluster_cli.cli.entry import main

main()
