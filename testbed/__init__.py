"""clusterctl testbed: real OpenSSH nodes with simulated GPU/InfiniBand tools.

Each node is an ``sshd`` in its own network + PID namespace (root) or on a loopback port
(non-root fallback), whose PATH starts with tiny scripts that print realistic captured
``nvidia-smi``/``ibstat``/``sminfo``/``nproc``/``/proc/meminfo`` outputs for a hardware
preset. See ``python -m testbed --help`` and :class:`testbed.cluster.Cluster`.
"""

from testbed.cluster import Cluster, TestbedError, detect_mode, down, gc, unavailable_reason
from testbed.hardware import PRESETS, Foreign, NodeSpec, Rendered, ToolOutput, count_specs, parse_specs, render
from testbed.node import Node

__all__ = [
    "PRESETS",
    "Cluster",
    "Foreign",
    "Node",
    "NodeSpec",
    "Rendered",
    "TestbedError",
    "ToolOutput",
    "count_specs",
    "detect_mode",
    "down",
    "gc",
    "parse_specs",
    "render",
    "unavailable_reason",
]
