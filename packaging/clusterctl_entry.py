"""The frozen program's main script: the same entry point as the ``clusterctl`` console script."""

from cluster_cli.cli.entry import main

main()
