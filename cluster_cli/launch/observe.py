"""What ``up`` reads of its nodes inside discover's probe batch, so that a run with nothing
to do needs no exec of its own: whether each recorded shard process still runs (its
``/proc/PID/stat`` start time, read by the batch's shell itself: no process) and, when new
replicas are expected, which TCP ports listen (``/proc/net/tcp``: one ``cat``). The parsing
is pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cluster_cli.probe.batch import Inline
from cluster_cli.probe.modelfiles import stat_command
from cluster_cli.state.records import ShardRun

STAT, TCP, BOOT = "cc_stat", "cc_tcp", "cc_boot"
MODEL = "model."  # then the model's number in the list probed


def node_commands(runs: Iterable[ShardRun], *, ports: bool = True, models: Sequence[str] = ()) -> dict[str, str]:
    """The probe batch's extra records for a node with these shards on it (``ports``: also
    the listening TCP ports; ``models``: the listing of each of these models' files, for the
    memory-fit check, records ``model.0``, ``model.1``...)."""
    pids = sorted({r.pid for r in runs if r.pid is not None})
    # The node's boot id: a recorded PID is the same process only on the same boot.
    cmds: dict[str, str] = {
        BOOT: Inline('cc_b=; { read -r cc_b </proc/sys/kernel/random/boot_id; } 2>/dev/null; val cc_boot "$cc_b"')
    }
    if ports:
        cmds[TCP] = "cat /proc/net/tcp /proc/net/tcp6"
    for i, model in enumerate(models):
        cmds[f"{MODEL}{i}"] = stat_command(model)
    if pids:
        # PIDs are ints: nothing to quote. A PID that is gone adds no line.
        cmds[STAT] = Inline(
            f"cc_st=; for cc_pid in {' '.join(map(str, pids))}; do cc_l=; "
            '{ read -r cc_l <"/proc/$cc_pid/stat"; } 2>/dev/null && cc_st="$cc_st$cc_l\n"; done; '
            f'val {STAT} "$cc_st"'
        )
    return cmds


def parse_stat(text: str) -> dict[int, int]:
    """PID -> start time (clock ticks since boot, field 22) from ``/proc/PID/stat`` lines, for
    the processes that still run (zombies left out)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        pid, sep, _ = line.partition(" (")
        close = line.rfind(")")
        if not sep or not pid.isdigit() or close < 0:
            continue
        fields = line[close + 1 :].split()
        if len(fields) >= 20 and fields[19].isdigit() and fields[0] not in ("Z", "X", "x"):  # a zombie does not run
            out[int(pid)] = int(fields[19])
    return out


def parse_listening(text: str) -> set[int]:
    """The ports in LISTEN state (``st`` 0A) of ``/proc/net/tcp`` and ``tcp6`` tables."""
    ports: set[int] = set()
    for line in text.splitlines():
        f = line.split()
        if len(f) > 3 and f[3] == "0A" and ":" in f[1]:
            try:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
            except ValueError:
                continue
    return ports


@dataclass
class Observed:
    """Per node, what its probe batch saw (only nodes whose records came back)."""

    started: dict[str, dict[int, int]] = field(default_factory=dict)  # node -> pid -> start time
    listening: dict[str, set[int]] = field(default_factory=dict)
    boot_ids: dict[str, str] = field(default_factory=dict)
    models: dict[str, dict[int, str]] = field(default_factory=dict)  # node -> model's number -> its listing

    def record(self, node: str, outputs: Mapping[str, object]) -> None:
        boot = outputs.get(BOOT)
        if boot is not None and getattr(boot, "rc", None) == 0 and boot.stdout.strip():  # type: ignore[attr-defined]
            self.boot_ids[node] = boot.stdout.strip()  # type: ignore[attr-defined]
        tcp = outputs.get(TCP)
        if tcp is not None and getattr(tcp, "rc", None) == 0:
            self.listening[node] = parse_listening(tcp.stdout)  # type: ignore[attr-defined]
        for name, out in outputs.items():
            if name.startswith(MODEL) and getattr(out, "rc", None) == 0:
                self.models.setdefault(node, {})[int(name[len(MODEL) :])] = out.stdout  # type: ignore[attr-defined]
        stat = outputs.get(STAT)
        if stat is not None and getattr(stat, "rc", None) in (0, 1):  # 1: some PID is gone; not a timeout
            self.started[node] = parse_stat(stat.stdout)  # type: ignore[attr-defined]

    def alive(self, run: ShardRun) -> bool | None:
        """Whether ``run``'s process still runs; None when its node's batch did not say."""
        seen = self.started.get(run.node)
        if seen is None or run.pid is None:
            return None
        boot = self.boot_ids.get(run.node)
        if run.boot_id and boot and boot != run.boot_id:  # rebooted since: that PID is another's
            return False
        return seen.get(run.pid) == run.start_time
