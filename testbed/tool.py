"""Slow path of the simulated tools: arguments that were not pre-rendered.

The per-node sh scripts answer the probe's exact command lines from pre-rendered files;
anything else lands here (``python -m testbed.tool TOOL SPEC_JSON ARGS...``), ~50 ms.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from testbed.hardware import NodeSpec, ToolOutput, garbage_output, ibstat, nvidia_smi, sminfo


def _sminfo_args(spec: NodeSpec, args: Sequence[str]) -> ToolOutput:
    ca, port = None, 1
    it = iter(args)
    for a in it:
        if a in ("-C", "--Ca"):
            ca = next(it, None)
        elif a in ("-P", "--Port"):
            try:
                port = int(next(it, "1"), 0)
            except ValueError:
                port = -1
        else:
            return ToolOutput(b"", 2, b"(testbed: these sminfo arguments are not simulated)\n")
    if ca is None:
        ca = min((n.ca for n in spec.hw.nics if n.link_layer == "InfiniBand"), default="mlx5_0")
    return sminfo(spec, ca, port)


def run(tool: str, spec_path: str, args: Sequence[str]) -> ToolOutput:
    data = json.loads(Path(spec_path).read_text())
    spec, index = NodeSpec.from_dict(data["spec"]), int(data["index"])
    if tool == "nvidia-smi":
        if spec.garbage:
            return garbage_output("gpus", spec)
        return nvidia_smi(spec, args)
    if tool == "ibstat":
        return garbage_output("ibstat", spec) if spec.garbage else ibstat(spec, index, args)
    if tool == "sminfo":
        return garbage_output("sminfo", spec) if spec.garbage else _sminfo_args(spec, args)
    return ToolOutput(b"", 2, f"(testbed: no simulated tool {tool!r})\n".encode())


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: python -m testbed.tool TOOL SPEC_JSON [ARGS...]\n")
        return 2
    out = run(argv[0], argv[1], argv[2:])
    sys.stdout.buffer.write(out.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(out.stderr)
    sys.stderr.flush()
    return out.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
