"""The shell scripts that start, inspect and stop a shard on its node (pure: text only).

Each script is POSIX ``sh``, sent on the standard input of ``sh -s`` over SSH, so that
nothing of it (an ``HF_TOKEN`` in the environment file included) is ever on a command line
that other users of the node can read. Every value is put in with ``shlex.quote``. A script
answers in lines that start with ``@@``; what else it prints is ignored.

A shard runs detached in its own session (``setsid``), stdin from /dev/null, its output
appended to ``log`` in the shard's folder, which also holds ``cmd``, ``env`` (mode 0600) and
``pid`` ("PID STARTTIME"). Every process of the shard carries ``CLUSTERCTL_RUN=<token>`` in its
environment: stopping finds them all by it, workers that left the session or were reparented
to init included, and never signals a stranger that reused a PID.
"""

from __future__ import annotations

import secrets
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

RUN_ENV = "CLUSTERCTL_RUN"
LOG_TAIL_LINES = 20

# Shell functions the scripts share.
_FUNCS = r"""
procstat() {  # PID: sets ps_sess (its session) and ps_start; fails when none runs (a zombie's
  # resources are gone with it: it does not run). No process.
  ps_l=; { read -r ps_l <"/proc/$1/stat"; } 2>/dev/null || return 1
  ps_l=${ps_l##*\)}
  set -- $ps_l
  case $1 in Z|X|x) return 1;; esac
  ps_sess=$4; ps_start=${20}
}
listening() {
  for f in /proc/net/tcp /proc/net/tcp6; do
    [ -r "$f" ] || continue
    awk -v p="$1" '$4 == "0A" { n = split($2, a, ":"); if (a[n] == p) found = 1 } END { exit !found }' "$f" && return 0
  done
  return 1
}
ours() {
  if grep -lsxzF -- "$RUN_ENV=$token" /proc/self/environ >/dev/null 2>&1 || [ $? -le 1 ]; then
    grep -lsxzF -- "$RUN_ENV=$token" /proc/[0-9]*/environ 2>/dev/null | sed 's#^/proc/##; s#/environ$##' | grep -vx "$$"
  else
    for p in /proc/[0-9]*; do
      q=${p#/proc/}
      [ "$q" = "$$" ] && continue
      tr '\000' '\n' <"$p/environ" 2>/dev/null | grep -qxF -- "$RUN_ENV=$token" && echo "$q"
    done
  fi
}
"""


def new_token() -> str:
    return secrets.token_hex(8)


def dir_expr(run_dir: str) -> str:
    """``run_dir`` as a shell word: a leading ``~/`` is the node user's home ($HOME)."""
    if run_dir == "~":
        return '"$HOME"'
    if run_dir.startswith("~/"):
        return '"$HOME"/' + shlex.quote(run_dir[2:])
    return shlex.quote(run_dir)


def _port_hex(port: int) -> str:
    return f"{port:04X}"


@dataclass(frozen=True)
class StartScript:
    """What a shard's start needs: its folder, argv, environment, and what to check first."""

    run_dir: str  # the shard's own folder
    argv: Sequence[str]
    env: Mapping[str, str]
    token: str
    ports: Sequence[int] = ()  # must be free on the node
    binaries: Sequence[str] = ()  # must be found on the node's PATH (or be executable paths)
    files: Sequence[str] = ()  # must exist on the node (a model file)


def start_script(s: StartScript) -> str:
    """Start a shard; answers ``@@OK PID STARTTIME BOOTID`` (the node's boot id, when it has
    one) or ``@@ERR <reason>``."""
    env = dict(s.env)
    env[RUN_ENV] = s.token
    eof = f"__CLUSTERCTL_{secrets.token_hex(6)}__"
    lines = [
        "set -u",
        "umask 077",
        f"RUN_ENV={RUN_ENV}",
        f"token={shlex.quote(s.token)}",
        _FUNCS,
        f"d={dir_expr(s.run_dir)}",
        'err() { echo "@@ERR $*"; exit 0; }',
        'mkdir -p -- "$d" 2>/dev/null || err "cannot create the run folder $d"',
        'cd -- "$d" || err "cannot enter the run folder $d"',
        'if [ -f pid ]; then read -r opid ost <pid; procstat "$opid" && [ "$ps_start" = "$ost" ] && err "already running here (pid $opid)"; fi',
        # A folder left by an earlier run (its stop did not finish): none of its processes,
        # workers included, may still run. Its marker is in its env file.
        "if [ -f env ]; then",
        f'  while read -r l; do case $l in "export {RUN_ENV}="*) token=${{l#*=}};; esac; done <env',
        "  case $token in \\'*\\') token=${token#\\'}; token=${token%\\'};; esac",
        f'  [ "$token" = {shlex.quote(s.token)} ] || {{ o=$(ours); [ -z "$o" ] || err "processes of an earlier run of this shard still run here (pids" $o")"; }}',
        f"  token={shlex.quote(s.token)}",
        "fi",
    ]
    for b in s.binaries:
        q = shlex.quote(b)
        lines.append(f"command -v -- {q} >/dev/null 2>&1 || err {shlex.quote(f'engine binary not found: {b}')}")
    for f in s.files:
        q = shlex.quote(f)
        lines.append(f"[ -e {q} ] || err {shlex.quote(f'model file not found: {f}')}")
        lines.append(f"[ -r {q} ] || err {shlex.quote(f'model file not readable: {f}')}")
    for p in s.ports:
        lines.append(f"listening {_port_hex(p)} && err {shlex.quote(f'port {p} is in use on the node')}")
    lines += [
        "rm -f env cmd pid",
        f"cat >env <<'{eof}'",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        eof,
        f"cat >cmd <<'{eof}'",
        shlex.join(s.argv),
        eof,
        'echo "== clusterctl: starting at $(date -u +%Y-%m-%dT%H:%M:%SZ)" >>log',
        # No job control here: the background child is no process group leader, so setsid
        # makes it a session leader without forking, and $! is the shard's PID.
        f"setsid sh -c '. ./env && exec \"$@\"' clusterctl-shard {shlex.join(s.argv)} </dev/null >>log 2>&1 &",
        "pid=$!",
        'procstat "$pid" || { sleep 0.2; err "the engine exited at once"; }',
        "st=$ps_start",
        # Answer only once the child leads a process group of its own (setsid has run): before
        # that, the SSH connection closing could still take it down.
        'i=0; while [ "$ps_sess" != "$pid" ] && [ $i -lt 250 ]; do',
        "  sleep 0.02; i=$((i + 1))",
        '  procstat "$pid" && [ "$ps_start" = "$st" ] || err "the engine exited at once"',
        "done",
        '[ "$ps_sess" = "$pid" ] || err "the engine did not detach from the SSH session"',
        'echo "$pid $st" >pid',
        "boot=; { read -r boot </proc/sys/kernel/random/boot_id; } 2>/dev/null",
        'echo "@@OK $pid $st $boot"',
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ShardRef:
    """A shard as a script finds it again: its folder, marker and recorded process."""

    run_dir: str
    token: str
    pid: int | None = None
    start_time: int | None = None
    boot_id: str | None = None  # the node's boot id when it started: after a reboot its PID is another's


def stop_script(ref: ShardRef, *, grace_s: float = 10.0, port: int | None = None, gpu_check: bool = False,
                remove: bool = True, tail: int = LOG_TAIL_LINES) -> str:  # fmt: skip
    """Stop every process of a shard: TERM, up to ``grace_s``, then KILL; then check that none
    is left, that ``port`` is closed and (``gpu_check``) that nvidia-smi lists none of them.
    Answers ``@@LOG`` lines (the log's tail), then ``@@STOPPED N`` or ``@@LEFT PIDS``,
    ``@@PORT_OPEN P``, ``@@GPU PIDS``; ``@@GONE`` when the folder is not there."""
    steps = max(1, int(grace_s / 0.2))
    lines = [
        "set -u",
        f"RUN_ENV={RUN_ENV}",
        f"token={shlex.quote(ref.token)}",
        _FUNCS,
        f"d={dir_expr(ref.run_dir)}",
        'if [ -d "$d" ]; then cd -- "$d" || exit 0; else echo "@@GONE"; cd /; fi',
        "pids=$(ours); set -- $pids; pids=$*",
    ]
    if ref.pid is not None and ref.start_time is not None:
        # The recorded leader, if it is still the process that was started (not a reused PID),
        # and not already found by its marker: each process gets one TERM (a second one makes
        # llama-server and vLLM's API server skip their clean shutdown).
        lines.append(
            f'procstat {ref.pid} && [ "$ps_start" = {ref.start_time} ] && '
            f'case " $pids " in *" {ref.pid} "*) ;; *) pids="$pids {ref.pid}";; esac'
        )
    lines += [
        "all=$pids",
        # CONT after TERM (as systemd does): a stopped (frozen) process acts on its TERM at once.
        '[ -n "$pids" ] && { kill -TERM $pids; kill -CONT $pids; } 2>/dev/null',
        f'i=0; while [ -n "$pids" ] && [ $i -lt {steps} ]; do sleep 0.2; i=$((i + 1)); pids=$(ours); done',
        'if [ -n "$pids" ]; then kill -KILL $pids 2>/dev/null; i=0; while [ -n "$pids" ] && [ $i -lt 25 ]; do sleep 0.2; i=$((i + 1)); pids=$(ours); done; fi',
    ]
    if ref.pid is not None and ref.start_time is not None:
        lines.append(f'procstat {ref.pid} && [ "$ps_start" = {ref.start_time} ] && kill -KILL {ref.pid} 2>/dev/null')
    lines += [
        f'[ -f log ] && tail -n {int(tail)} log | sed "s/^/@@LOG /"',
        "set -- $all; n=$#",
        "pids=$(ours)",
        'if [ -n "$pids" ]; then echo "@@LEFT" $pids; else echo "@@STOPPED $n"; fi',
    ]
    if port is not None:
        lines.append(f"listening {_port_hex(port)} && echo '@@PORT_OPEN {port}'")
    if gpu_check:
        lines += [
            'if [ -n "$all" ] && command -v nvidia-smi >/dev/null 2>&1; then',
            '  held=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d " ")',
            '  for p in $all; do for h in $held; do [ "$p" = "$h" ] && echo "@@GPU $p"; done; done',
            "fi",
        ]
    if remove:
        lines.append('if [ -z "$pids" ] && [ -d "$d" ]; then cd / && rm -rf -- "$d"; fi')
    return "\n".join(lines) + "\n"


def inspect_script(refs: Iterable[ShardRef]) -> str:
    """For each shard: ``@@ALIVE I`` when its recorded process still runs (the same PID and
    start time, on the same boot of the node), else ``@@DEAD I`` (I: its position in ``refs``)."""
    lines = ["set -u", f"RUN_ENV={RUN_ENV}", "token=", _FUNCS,
             "boot=; { read -r boot </proc/sys/kernel/random/boot_id; } 2>/dev/null"]  # fmt: skip
    for i, r in enumerate(refs):
        if r.pid is None or r.start_time is None:
            lines.append(f"echo '@@DEAD {i}'")
            continue
        same_boot = f'{{ [ -z "$boot" ] || [ "$boot" = {shlex.quote(r.boot_id)} ]; }} && ' if r.boot_id else ""
        lines.append(
            f'if {same_boot}procstat {r.pid} && [ "$ps_start" = {r.start_time} ]; '
            f'then echo "@@ALIVE {i}"; else echo "@@DEAD {i}"; fi'
        )
    return "\n".join(lines) + "\n"


def listening_script() -> str:
    """The TCP ports the node listens on, one ``@@PORT HEX`` line each."""
    return (
        'for f in /proc/net/tcp /proc/net/tcp6; do [ -r "$f" ] && '
        'awk \'$4 == "0A" { n = split($2, a, ":"); print "@@PORT " a[n] }\' "$f"; done\n'
    )


def log_command(run_dir: str, *, lines: int, follow: bool) -> str:
    """The command that prints (``follow``: and follows) a shard's log."""
    f = " -f" if follow else ""
    return f"tail -n {int(lines)}{f} -- {dir_expr(run_dir)}/log"


def answers(out: str, tag: str) -> list[str]:
    """The payloads of a script's ``@@TAG`` lines, in order."""
    head = f"@@{tag}"
    return [line[len(head) :].strip() for line in out.splitlines() if line == head or line.startswith(head + " ")]


def log_lines(out: str) -> list[str]:
    head = "@@LOG "
    return [line[len(head) :] for line in out.splitlines() if line.startswith(head) or line == "@@LOG"]
