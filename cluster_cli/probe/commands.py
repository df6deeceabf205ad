"""The exact remote commands discover runs (in parallel, as one batch: see batch.py).

Every command is a fixed string built from constants (no user input), so quoting is
trivial; anything that does take user input goes through ``shlex.quote``. Output is
read with ``LC_ALL=C`` so field names are never localized.

The simulated tools of the testbed answer exactly these argument lists.
"""

from __future__ import annotations

# Column order of --query-gpu; parsers map by position, never by header name.
GPU_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "pci.bus_id",
    "ecc.errors.uncorrected.volatile.total",
    "mig.mode.current",
    "retired_pages.pending",
    "remapped_rows.pending",
)

# Fields an older driver may not know (MIG and row remapping came with R450): nvidia-smi
# refuses a whole query that names one, so discover asks again without it and reads it as
# unknown. They are all after pci.bus_id, where the parser maps columns from the right.
OPTIONAL_GPU_FIELDS: frozenset[str] = frozenset(
    {"ecc.errors.uncorrected.volatile.total", "mig.mode.current", "retired_pages.pending", "remapped_rows.pending"}
)

# process_name goes last: it can contain ", " and is split from the right of the fixed columns.
APP_FIELDS: tuple[str, ...] = ("gpu_uuid", "pid", "used_memory", "process_name")


def query_gpu_args(fields: tuple[str, ...] = GPU_FIELDS) -> str:
    return f"--query-gpu={','.join(fields)} --format=csv,noheader,nounits"


QUERY_GPU_ARGS = query_gpu_args()
QUERY_APPS_ARGS = f"--query-compute-apps={','.join(APP_FIELDS)} --format=csv,noheader,nounits"

# The batch that runs these exports LC_ALL=C, so no output is localized.
PROBES: dict[str, str] = {
    "gpus": f"nvidia-smi {QUERY_GPU_ARGS}",
    "apps": f"nvidia-smi {QUERY_APPS_ARGS}",
    "topo": "nvidia-smi topo -m",
    "ibstat": "ibstat",
    "cpus": "nproc --all",
    "meminfo": "cat /proc/meminfo",
}


# The probes of what does not change while engines run: CPU count, memory size, the GPUs'
# NVLink topology. A probe that only checks running replicas may leave them out (and
# ``ibstat`` on a node without a multi-node replica) and take them from the node's earlier
# facts (``facts_from_outputs``' ``earlier``).
HARDWARE_PROBES: frozenset[str] = frozenset({"topo", "cpus", "meminfo"})

# Run inside the probe batch once ``ibstat`` succeeded (see batch.py's ``then``): start
# ``sminfo`` for every Active InfiniBand port it printed, while nvidia-smi still runs, so
# fabric identity needs no second round trip, and read the port's GID 0 from sysfs (its
# upper half is the subnet prefix) with the shell's own ``read``: no process, no root.
# ``$o`` is ibstat's output; ``$cc_p`` is the batch's ``command -p`` (or nothing where the
# system keeps its tools only on the user's PATH). Records are named ``sm:<ca>:<port>``
# (``sminfo_record``) and ``gid:<ca>:<port>`` (``gid_record``). This awk is only a shortcut:
# discover checks the ports against its own parser and asks sminfo again for any missed.
SMINFO_AFTER_IBSTAT = (
    "for x in $($cc_p awk '"
    '/^CA /{c=$2; gsub(/[^A-Za-z0-9_.-]/, "", c)} '
    '/^[ \\t]*Port [0-9]+:/{p=$2; sub(/:.*/, "", p); s=""} '
    "/^[ \\t]*State:/{s=$2} "
    '/^[ \\t]*Link layer:/{if (s == "Active" && $3 == "InfiniBand" && c != "") print c ":" p}'
    '\' "$o"); do run "sm:$x" sminfo -C "${x%:*}" -P "${x##*:}"; '
    'cc_gid=; { read -r cc_gid <"/sys/class/infiniband/${x%:*}/ports/${x##*:}/gids/0"; } 2>/dev/null; '
    'val "gid:$x" "$cc_gid"; done'
)


# Run inside the probe batch once the compute-process query succeeded with some output: the
# launch markers of the node's processes (cluster_cli/launch/remote.py), so that the GPU
# processes of the replicas clusterctl launched, their workers included, are not foreign.
# One grep, no shell; the glob is the batch shell's.
LAUNCHED_AFTER_APPS = "[ -s \"$o\" ] && run launched grep -Hsazo 'CLUSTERCTL_RUN=[!-~]*' /proc/[0-9]*/environ"


def sminfo_record(ca: str, port: int) -> str:
    """The batch record name of ``sminfo`` for one port."""
    return f"sm:{ca}:{int(port)}"


def gid_record(ca: str, port: int) -> str:
    """The batch record name of one port's GID 0 (read from sysfs)."""
    return f"gid:{ca}:{int(port)}"


def gid_command(ca: str, port: int) -> str:
    """Print one port's GID 0 (for a port the in-batch shortcut missed)."""
    import shlex

    return f"cat {shlex.quote(f'/sys/class/infiniband/{ca}/ports/{int(port)}/gids/0')}"


def sminfo_command(ca: str, port: int) -> str:
    """Ask the master SM's identity through one local port (needs umad access; may fail)."""
    import shlex

    return f"sminfo -C {shlex.quote(ca)} -P {int(port)}"
