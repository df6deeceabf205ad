"""Command line: ``python -m testbed up|down|status|kill|freeze|thaw|partition|heal|revive|gc|presets``.

Examples::

    python -m testbed up --dir /tmp/tb --nodes 'gpu-01=hgx-h200x8:fabric=ib-a,gpu-02=a100-pcie-4x,cpu-01=cpu-only'
    python -m testbed up --dir /tmp/tb64 --count 64 --preset hgx-h200x8:fabric=ib-a
    python -m testbed freeze --dir /tmp/tb gpu-02
    python -m testbed down --dir /tmp/tb
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.cluster import MODES, Cluster, TestbedError, _flock, down, gc
from testbed.hardware import NodeSpec, count_specs, describe_presets, parse_specs

_OPS = ("kill", "freeze", "thaw", "partition", "heal", "revive")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m testbed",
        description="SSH testbed: simulated GPU servers as real sshd nodes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="node options: fabric=NAME cpus=N mem_gib=N ecc=IDX remap=IDX retire=IDX "
        "foreign=IDX:PID:NAME[:MIB] lost=IDX smi_error=no-driver|driver-mismatch|no-devices "
        "slow=SECONDS garbage sm_guid=0xHEX prefix=HEX16 ib_down=IDX hca=CA:FABRIC label=KEY/VALUE driver=VERSION\n\n"
        "presets:\n" + describe_presets(),
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a testbed (replaces one already in DIR)")
    up.add_argument("--dir", required=True)
    up.add_argument("--nodes", action="append", default=[], metavar="SPEC", help="NAME=PRESET[:opt...],...")
    up.add_argument("--count", type=int, default=0, help="add COUNT nodes of --preset")
    up.add_argument("--preset", default="hgx-h200x8", help="preset (with options) for --count")
    up.add_argument("--name-prefix", default="node", help="names for --count nodes: PREFIX-01...")
    up.add_argument("--mode", choices=MODES, default="auto")
    up.add_argument("--timeout", type=float, default=None, help="seconds to wait for all sshd")
    up.add_argument("--path-extra", action="append", default=[], help="extra PATH entry on nodes")
    dn = sub.add_parser(
        "down", help="stop the testbed in DIR: its processes, namespaces, links and addresses (its files stay)"
    )
    dn.add_argument("--dir", required=True)
    st = sub.add_parser("status", help="show nodes and whether sshd answers")
    st.add_argument("--dir", required=True)
    st.add_argument("--json", action="store_true")
    for op in _OPS:
        o = sub.add_parser(op, help=f"{op} node(s)")
        o.add_argument("--dir", required=True)
        o.add_argument("nodes", nargs="+", metavar="NODE")
    sub.add_parser("gc", help="remove testbeds whose folder or state file is gone (root)")
    sub.add_parser("presets", help="list hardware presets")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (TestbedError, ValueError) as e:
        print(f"testbed: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `... | head`
        return 0
    except OSError as e:  # a --dir that is not ours (another user's /tmp/tb), a full disk...
        where = f": {e.filename}" if e.filename else ""
        print(f"testbed: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.cmd == "presets":
        print(describe_presets())
        return 0
    if args.cmd == "gc":
        stale = gc()
        print(f"removed {len(stale)} orphaned testbed(s){': ' + ', '.join(stale) if stale else ''}")
        return 0
    if args.cmd == "up":
        specs: list[NodeSpec] = []
        for s in args.nodes:
            specs += parse_specs(s)
        if args.count:
            specs += count_specs(args.count, args.preset, args.name_prefix)
        if not specs:
            raise TestbedError("give --nodes SPEC and/or --count N")
        t = time.monotonic()
        c = Cluster.start(
            args.dir, specs, mode=args.mode, timeout=args.timeout, path_extra=args.path_extra, stop_at_exit=False
        )
        dt = time.monotonic() - t
        print(f"testbed up: {len(c.nodes)} node(s), mode {c.mode}, {dt:.1f}s")
        print(f"inventory: {c.inventory_path}")
        first = next(iter(c.nodes))
        print("try: " + " ".join(_q(a) for a in c.ssh_argv(first, "nvidia-smi -L")))
        return 0
    if args.cmd == "down":
        had = down(args.dir)
        print("testbed down" if had else "no testbed state found; cleaned up leftovers (if any)")
        return 0
    if args.cmd != "status":
        # Several of these at once (``kill a & kill b &``) read, change and write one state
        # file: one at a time, or the last writer undoes what the others recorded.
        with _flock(Path(args.dir) / ".testbed.lock"):
            c = Cluster.attach(args.dir)
            for name in args.nodes:
                getattr(c, args.cmd)(name)
                print(f"{name}: {c.node(name).state}")
        return 0
    c = Cluster.attach(args.dir)
    if args.cmd == "status":
        rows = c.status()
        if args.json:
            print(json.dumps({"mode": c.mode, "dir": str(c.dir), "nodes": rows}, indent=1))
        else:
            print(f"mode {c.mode}, {len(rows)} node(s), inventory {c.inventory_path}")
            print(f"{'NAME':<16}{'PRESET':<14}{'ADDRESS':<22}{'STATE':<20}{'PROCS':>5}  SSH")
            for r in rows:
                addr = f"{r['host']}:{r['port']}"
                ssh = "up" if r["ssh"] else "-"
                print(f"{r['name']:<16}{r['preset']:<14}{addr:<22}{r['state']:<20}{r['processes']:>5}  {ssh}")
        return 0
    return 0


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
