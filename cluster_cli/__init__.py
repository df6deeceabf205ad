"""clusterctl: turn SSH-reachable servers into an LLM serving cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "ClusterctlError",
    "ConfigError",
    "ExitCode",
    "Gpu",
    "GpuProcess",
    "HcaPort",
    "NodeFacts",
    "Unschedulable",
    "__version__",
]

if TYPE_CHECKING:
    from cluster_cli.errors import ClusterctlError, ConfigError, ExitCode, Unschedulable
    from cluster_cli.facts import Gpu, GpuProcess, HcaPort, NodeFacts

_LAZY = {
    "ClusterctlError": "cluster_cli.errors",
    "ConfigError": "cluster_cli.errors",
    "ExitCode": "cluster_cli.errors",
    "Unschedulable": "cluster_cli.errors",
    "Gpu": "cluster_cli.facts",
    "GpuProcess": "cluster_cli.facts",
    "HcaPort": "cluster_cli.facts",
    "NodeFacts": "cluster_cli.facts",
}


def __getattr__(name: str) -> Any:
    """The package's names are imported when first used: importing the package (as the
    ``clusterctl`` command does before anything else) costs nothing."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cluster_cli' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
