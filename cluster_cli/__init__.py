"""clusterctl: turn SSH-reachable servers into an LLM serving cluster."""

from cluster_cli.errors import ClusterctlError, ConfigError, ExitCode, Unschedulable
from cluster_cli.facts import Gpu, GpuProcess, HcaPort, NodeFacts

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
