"""The shell scripts that start, inspect and stop a shard on its node (pure: text only).

Each script is POSIX ``sh``, sent on the standard input of ``sh -s`` over SSH, so that
nothing of it (an ``HF_TOKEN`` in the environment file included) is ever on a command line
that other users of the node can read. Every value is put in with ``shlex.quote``. A script
answers in lines ``@@<nonce> TAG payload``, its nonce fresh and random (``Script.nonce``):
what else it prints is ignored, and nothing it passes on (a log's tail, a path in an error)
can pass for an answer, as that text was written without knowing the nonce.

A shard runs detached in its own session (``setsid``), stdin from /dev/null, its output
appended (``>>``: O_APPEND) to ``log`` in the shard's folder, which also holds ``cmd``,
``env`` (mode 0600), ``pid`` ("PID STARTTIME") and ``log.1``, the log before the last start
or trim. Every process of the shard carries ``CLUSTERCTL_RUN=<token>`` in its environment:
stopping finds them all by it, workers that left the session or were reparented to init
included, and never signals a stranger that reused a PID.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cluster_cli.facts import printable

RUN_ENV = "CLUSTERCTL_RUN"
SYSTEMD_DIR = "/run/systemd/system"  # present where systemd is PID 1 (sd_booted(3))
LINGER_DIR = "/var/lib/systemd/linger"  # a file per user whose manager outlives their sessions
LOG_TAIL_LINES = 20
# Room kept in ``pid`` before the engine starts: "PID STARTTIME" (at most 7 + 1 + 20 digits)
# is then written over it in place, which needs no new block on a disk that filled meanwhile.
_PID_ROOM = " " * 40

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

# An answer whose payload is text (a path, a reason): printf prints it verbatim, where echo
# (dash's, busybox's) would act on its backslashes. Numbers are answered with echo (no process).
_SAY = r"""say() { printf '%s\n' "@@$nonce $*"; }"""


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
class Script:
    """A script's text, to run with ``sh -s``, and the nonce its answer lines carry: read
    what it said with ``answers(out, TAG)`` and ``log_lines(out)``."""

    text: str
    nonce: str

    def answers(self, out: str, tag: str) -> list[str]:
        return answers(out, tag, nonce=self.nonce)

    def log_lines(self, out: str) -> list[str]:
        return log_lines(out, nonce=self.nonce)


def _script(nonce: str, lines: list[str]) -> Script:
    return Script("\n".join(lines) + "\n", nonce)


def _framed() -> tuple[str, list[str]]:
    """A fresh nonce, and the script lines that set it and define ``say``."""
    nonce = secrets.token_hex(8)
    return nonce, [f"nonce={shlex.quote(nonce)}", _SAY]


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
    # Where the node shows it runs systemd, and where logind lists the users whose manager
    # outlives their sessions (lingering): other paths in tests only.
    systemd_dir: str = SYSTEMD_DIR
    linger_dir: str = LINGER_DIR


def unit_name(token: str) -> str:
    """The transient scope a shard runs in: ``clusterctl-<token>.scope``, the token's ``/``
    as ``-`` and any other character systemd refuses in a unit name as ``_``. Unique per
    shard run, as the token is (its last part is random)."""
    safe = re.sub(r"[^A-Za-z0-9:_.-]", "_", token.replace("/", "-"))
    return f"clusterctl-{safe[:230]}.scope"


def start_script(s: StartScript) -> Script:
    """Start a shard; answers ``OK PID STARTTIME BOOTID`` (the node's boot id, when it has
    one) or ``ERR <reason>``. Each file it writes (``env``, ``cmd``, ``pid``, the log's
    header) is checked: one that cannot be written (a full disk, a read-only folder) is
    ``ERR cannot write FILE in DIR (disk full or read-only?)`` and nothing is started. A
    ``log`` already there becomes ``log.1`` (a crashed instance's log outlives its restart)."""
    nonce, framing = _framed()
    env = {k: v for k, v in s.env.items() if k != RUN_ENV}
    # The marker last: an env file cut short lacks it, and the launcher then starts nothing.
    env[RUN_ENV] = s.token
    eof = f"__CLUSTERCTL_{secrets.token_hex(6)}__"
    lines = [
        "set -u",
        "umask 077",
        *framing,
        f"RUN_ENV={RUN_ENV}",
        f"token={shlex.quote(s.token)}",
        _FUNCS,
        f"d={dir_expr(s.run_dir)}",
        'err() { say ERR "$*"; exit 0; }',
        'cant() { err "cannot write $1 in $d (disk full or read-only?)"; }',
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
        # The previous instance's log (a crash's last lines) is kept, one generation.
        "if [ -f log ]; then mv -f -- log log.1 2>/dev/null || cant log.1; fi",
        "rm -f env cmd run pid started",
        f"cat >env <<'{eof}' 2>/dev/null || cant env",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        eof,
        f"cat >cmd <<'{eof}' 2>/dev/null || cant cmd",
        shlex.join(s.argv),
        eof,
        # What the shard runs: the engine, only once the env file gave it the marker (the
        # file's last line); ``started`` says it got that far. Run as ``sh ./run``, so that no
        # "$" is in what systemd-run is given (since systemd 254 it expands variables there).
        f"cat >run <<'{eof}' 2>/dev/null || cant run",
        f'unset {RUN_ENV}; . ./env && [ -n "${{{RUN_ENV}-}}" ] && : >started && exec {shlex.join(s.argv)}',
        eof,
        f"echo '{_PID_ROOM}' 2>/dev/null >pid || cant pid",
        'echo "== clusterctl: starting at $(date -u +%Y-%m-%dT%H:%M:%SZ)" 2>/dev/null >>log || cant log',
        *_detach_lines(s),
        'procstat "$pid" || { sleep 0.2; err "the engine exited at once"; }',
        "st=$ps_start",
        # Answer only once the child leads a process group of its own (setsid has run): before
        # that, the SSH connection closing could still take it down.
        'i=0; while [ "$ps_sess" != "$pid" ] && [ $i -lt 250 ]; do',
        "  sleep 0.02; i=$((i + 1))",
        '  procstat "$pid" && [ "$ps_start" = "$st" ] || err "the engine exited at once"',
        "done",
        '[ "$ps_sess" = "$pid" ] || err "the engine did not detach from the SSH session"',
        # Over the room kept (1<>: no truncation); should even that fail, nothing may run
        # that a stop could not find by its record.
        'echo "$pid $st" 2>/dev/null 1<>pid || { o=$(ours); kill -KILL $pid $o 2>/dev/null; cant pid; }',
        "boot=; { read -r boot </proc/sys/kernel/random/boot_id; } 2>/dev/null",
        'say VIA "$via"',
        'echo "@@$nonce OK $pid $st $boot"',
    ]
    return _script(nonce, lines)


def _detach_lines(s: StartScript) -> list[str]:
    """Start ``sh ./run`` detached from the SSH session; sets ``$pid`` (the engine's PID: every
    step before the engine execs in place) and ``$via``.

    Where systemd runs the node (``systemd_dir``), the shard gets a transient scope of its own
    (``unit_name``), which logind's KillUserProcesses= does not reach at logout: for root on the
    system manager (``systemd-run --scope``), for another user on their own manager
    (``systemd-run --user --scope``) only where they linger, since without lingering systemd
    stops that manager, and every scope in it, once they last log out. systemd-run
    --scope moves itself into the scope, then execs the command. A systemd-run that exits or
    is still there after 10 s without the launcher having run (no bus, an old systemd-run, a
    unit by that name) is killed and the shard is started with ``setsid`` alone, as where
    there is no systemd: so it starts once, and only once. Either way ``setsid`` makes it a
    session leader: the script has no job control, so the background child is no process
    group leader and setsid needs no fork."""
    unit = shlex.quote(unit_name(s.token))
    return [
        f"sd={shlex.quote(s.systemd_dir)}; lg={shlex.quote(s.linger_dir)}; via=setsid; pid=; scope=",
        'if [ -d "$sd" ] && command -v systemd-run >/dev/null 2>&1; then',
        "  uid=$(id -u 2>/dev/null)",
        '  if [ "$uid" = 0 ]; then scope="systemd-run --scope"',
        '  elif [ -n "$uid" ] && [ -e "$lg/$(id -un 2>/dev/null)" ]; then',
        '    scope="systemd-run --user --scope"; XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/run/user/$uid}; export XDG_RUNTIME_DIR',
        "  fi",
        "fi",
        'if [ -n "$scope" ]; then',
        f"  $scope --quiet --collect --unit={unit} -- setsid sh ./run </dev/null >>log 2>&1 &",
        "  pid=$!; i=0",
        '  while [ ! -e started ] && procstat "$pid" && [ $i -lt 500 ]; do sleep 0.02; i=$((i + 1)); done',
        f"  if [ -e started ]; then via={shlex.quote('scope ' + unit_name(s.token))}",
        "  else",
        '    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null',
        '    echo "== clusterctl: no systemd scope (see above), started with setsid" 2>/dev/null >>log; pid=',
        "  fi",
        "fi",
        'if [ -z "$pid" ]; then rm -f started; setsid sh ./run </dev/null >>log 2>&1 & pid=$!; fi',
    ]


@dataclass(frozen=True)
class ShardRef:
    """A shard as a script finds it again: its folder, marker and recorded process."""

    run_dir: str
    token: str
    pid: int | None = None
    start_time: int | None = None
    boot_id: str | None = None  # the node's boot id when it started: after a reboot its PID is another's


def _ending_lines(grace_s: float, relist: str) -> list[str]:
    """End the processes in ``$pids``: one TERM and a CONT each, up to ``grace_s`` for them to
    go (``relist`` sets ``$pids`` anew: what is still there), then KILL, and up to 5 s more.
    ``$pids`` is then what is left."""
    steps = max(1, int(grace_s / 0.2))
    return [
        # CONT after TERM (as systemd does): a stopped (frozen) process acts on its TERM at once.
        '[ -n "$pids" ] && { kill -TERM $pids; kill -CONT $pids; } 2>/dev/null',
        f'i=0; while [ -n "$pids" ] && [ $i -lt {steps} ]; do sleep 0.2; i=$((i + 1)); {relist}; done',
        f'if [ -n "$pids" ]; then kill -KILL $pids 2>/dev/null; i=0; while [ -n "$pids" ] && [ $i -lt 25 ]; do sleep 0.2; i=$((i + 1)); {relist}; done; fi',
    ]


def stop_script(ref: ShardRef, *, grace_s: float = 10.0, port: int | None = None, gpu_check: bool = False,
                remove: bool = True, tail: int = LOG_TAIL_LINES) -> Script:  # fmt: skip
    """Stop every process of a shard: TERM, up to ``grace_s``, then KILL; then check that none
    is left, that ``port`` is closed and (``gpu_check``) that nvidia-smi lists none of them.
    Answers ``LOG`` lines (the log's tail), then ``STOPPED N`` or ``LEFT PIDS``,
    ``PORT_OPEN P``, ``GPU PIDS``; ``GONE`` when the folder is not there."""
    nonce, framing = _framed()
    lines = [
        "set -u",
        *framing,
        f"RUN_ENV={RUN_ENV}",
        f"token={shlex.quote(ref.token)}",
        _FUNCS,
        f"d={dir_expr(ref.run_dir)}",
        'if [ -d "$d" ]; then cd -- "$d" || exit 0; else echo "@@$nonce GONE"; cd /; fi',
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
    lines += ["all=$pids", *_ending_lines(grace_s, "pids=$(ours)")]
    if ref.pid is not None and ref.start_time is not None:
        lines.append(f'procstat {ref.pid} && [ "$ps_start" = {ref.start_time} ] && kill -KILL {ref.pid} 2>/dev/null')
    lines += [
        # awk ends every line, a last one cut short included: the answers after it stay lines.
        f'[ -f log ] && tail -n {int(tail)} log | awk -v h="@@$nonce LOG" \'{{ print h " " $0 }}\'',
        "set -- $all; n=$#",
        "pids=$(ours)",
        'if [ -n "$pids" ]; then echo "@@$nonce LEFT" $pids; else echo "@@$nonce STOPPED $n"; fi',
    ]
    if port is not None:
        lines.append(f'listening {_port_hex(port)} && echo "@@$nonce PORT_OPEN {port}"')
    if gpu_check:
        # The recorded PID too, gone or not: a CUDA context can outlive its process, and a stop
        # run again (a fence being cleared) finds no process left to name it.
        if ref.pid is not None:
            lines.append(f'case " $all " in *" {ref.pid} "*) ;; *) all="$all {ref.pid}";; esac')
        lines += [
            'if [ -n "$all" ] && command -v nvidia-smi >/dev/null 2>&1; then',
            '  held=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d " ")',
            '  for p in $all; do for h in $held; do [ "$p" = "$h" ] && echo "@@$nonce GPU $p"; done; done',
            "fi",
        ]
    if remove:
        lines.append('if [ -z "$pids" ] && [ -d "$d" ]; then cd / && rm -rf -- "$d"; fi')
    return _script(nonce, lines)


def inspect_script(refs: Iterable[ShardRef], *, trim_bytes: int | None = None) -> Script:
    """For each shard: ``ALIVE I`` when its recorded process still runs (the same PID and
    start time, on the same boot of the node), else ``DEAD I`` (I: its position in ``refs``).
    With ``trim_bytes``, also trims the logs over it, as ``trim_script`` does."""
    refs = list(refs)
    nonce, framing = _framed()
    lines = ["set -u", *framing, f"RUN_ENV={RUN_ENV}", "token=", _FUNCS, *_alive_lines(refs)]
    if trim_bytes is not None:
        lines += _trim_lines(refs, trim_bytes)
    return _script(nonce, lines)


def _alive_lines(refs: Sequence[ShardRef]) -> list[str]:
    """Read the node's boot id into ``$boot``; answer ``ALIVE I`` or ``DEAD I`` for each ref
    (builtins only: no process is started)."""
    lines = ["boot=; { read -r boot </proc/sys/kernel/random/boot_id; } 2>/dev/null"]
    for i, r in enumerate(refs):
        if r.pid is None or r.start_time is None:
            lines.append(f'echo "@@$nonce DEAD {i}"')
            continue
        same_boot = f'{{ [ -z "$boot" ] || [ "$boot" = {shlex.quote(r.boot_id)} ]; }} && ' if r.boot_id else ""
        lines.append(
            f'if {same_boot}procstat {r.pid} && [ "$ps_start" = {r.start_time} ]; '
            f'then echo "@@$nonce ALIVE {i}"; else echo "@@$nonce DEAD {i}"; fi'
        )
    return lines


def trim_script(refs: Iterable[ShardRef], max_bytes: int) -> Script:
    """Cap each shard's log: one over ``max_bytes`` is copied to ``log.1`` (the one before
    is replaced) and emptied in place (copytruncate). The engine appends (O_APPEND), so its
    next line lands at the start of the emptied file, not past a hole; what it writes
    between the copy and the emptying is lost. Answers ``TRIMMED I`` for each log trimmed,
    ``TRIM_FAILED I <reason>`` for one that could not be copied (it is then left whole).
    Shards sharing a folder answer with the first one's I. Runs one ``find`` for all the
    logs that are not empty, and a ``cp`` per log trimmed: nothing per shard besides."""
    nonce, framing = _framed()
    return _script(nonce, ["set -u", *framing, *_trim_lines(list(refs), max_bytes)])


def _trim_lines(refs: Sequence[ShardRef], max_bytes: int) -> list[str]:
    first: dict[str, int] = {}
    for i, r in enumerate(refs):
        first.setdefault(r.run_dir, i)
    if not first:
        return []
    lines = [f"l{i}={dir_expr(run_dir)}/log" for run_dir, i in first.items()]
    lines.append("set --")
    lines += [f'[ -s "$l{i}" ] && set -- "$@" "$l{i}"' for i in first.values()]
    # find prints each path as it was given: the case maps it back to its shard.
    arms = " ".join(f'"$l{i}") i={i};;' for i in first.values())
    lines += [
        f'[ $# -eq 0 ] || find "$@" -type f -size +{max(0, int(max_bytes))}c 2>/dev/null | while IFS= read -r f; do',
        f"  case $f in {arms} *) continue;; esac",
        '  if cp -f -- "$f" "$f.1" 2>/dev/null && true 2>/dev/null >"$f"; then echo "@@$nonce TRIMMED $i"',
        '  else say TRIM_FAILED "$i cannot copy $f to $f.1 (disk full or read-only?)"; fi',
        "done",
    ]
    return lines


def listening_script() -> Script:
    """The TCP ports the node listens on, one ``PORT HEX`` line each."""
    nonce, framing = _framed()
    return _script(
        nonce,
        [
            *framing,
            'for f in /proc/net/tcp /proc/net/tcp6; do [ -r "$f" ] && '
            'awk -v h="@@$nonce PORT" \'$4 == "0A" { n = split($2, a, ":"); print h " " a[n] }\' "$f"; done',
        ],
    )


# ---- the node's marked processes and shard folders: list, fence, heartbeat ----------------

_TOKEN = re.compile(
    r"([A-Za-z0-9][A-Za-z0-9._-]{0,62})/(0|[1-9][0-9]{0,8})\.g(0|[1-9][0-9]{0,8})\.s(0|[1-9][0-9]{0,4})\.([0-9a-f]{16})"
)


@dataclass(frozen=True)
class TokenParts:
    """What a shard's marker says (``MODEL/N.gG.sR.HEX``, see ``shards._token``)."""

    model: str
    replica: int
    generation: int
    rank: int
    nonce: str  # the 16 hex digits that make the marker the run's own

    @property
    def replica_name(self) -> str:
        return f"{self.model}/{self.replica}"


def parse_token(token: str) -> TokenParts:
    """``MODEL/N.gG.sR.HEX`` read back; ValueError for anything else (a model name the catalog
    would refuse, a number with a sign or leading zero, a nonce not 16 lowercase hex digits,
    anything before or after)."""
    m = _TOKEN.fullmatch(token) if isinstance(token, str) else None
    if m is None:
        raise ValueError(f"not a clusterctl marker: {printable(str(token))[:120]!r}")
    return TokenParts(m[1], int(m[2]), int(m[3]), int(m[4]), m[5])


# One awk over every marker on the node, from ``grep -z`` over /proc/*/environ (a line
# "/proc/PID/environ:CLUSTERCTL_RUN=TOKEN" each, a newline in a value turned into \001 by tr),
# and over the shard folders given as its arguments (read with getline in BEGIN's stead: awk
# never opens them as input). It reads each process's /proc/PID/stat itself: no process per
# process. ``mode``: ``list`` (PROC and DIR lines), ``strays`` (the PIDs of the processes whose
# markers are all not in ENVIRON CLUSTERCTL_KEEP), ``targets`` (those, as TARGET lines),
# ``final`` (those still there, as LEFT lines; the folders of tokens not kept: HELD when
# something of theirs still runs, else "R NAME" for the shell to remove). A process in the
# script's own session is skipped when the script itself carries a marker (``sess``): its
# subshells and commands, before their exec, carry it too. Zombies do not run.
_MARKS_AWK = r"""
BEGIN {
  for (i = 1; i < ARGC; i++) dirs[++nd] = ARGV[i]
  ARGC = 1
  nk = split(ENVIRON["CLUSTERCTL_KEEP"], ka, "\n")
  for (i = 1; i <= nk; i++) if (ka[i] != "") keep[ka[i]] = 1
  key = "/environ:" name "="
  pre = "export " name "="
  q = "\047"
}
function stat(pid,   f, l, r, s) {
  f = "/proc/" pid "/stat"; l = ""
  r = (getline l < f); close(f)
  if (r <= 0 || !sub(/.*\) /, "", l)) return 0
  split(l, s, " ")
  if (s[1] == "Z" || s[1] == "X" || s[1] == "x") return 0
  sid = s[4]; start = s[20]
  return 1
}
function word(s) { gsub(/[ \t\r]/, "\001", s); return s }
function text(s) { gsub(/[\r\n]/, "\001", s); return s }
function folder(p,   n, nm, f, l, t, a, pid, st) {
  n = p; sub(/\/+$/, "", n); nm = n; sub(/.*\//, "", nm)
  t = ""; f = n "/env"
  while ((getline l < f) > 0) if (substr(l, 1, length(pre)) == pre) t = substr(l, length(pre) + 1)
  close(f)
  if (length(t) >= 2 && substr(t, 1, 1) == q && substr(t, length(t)) == q) t = substr(t, 2, length(t) - 2)
  pid = "-"; st = "-"; f = n "/pid"; l = ""
  if ((getline l < f) > 0 && split(l, a, " ") >= 2 && a[1] ~ /^[0-9]+$/ && a[2] ~ /^[0-9]+$/) { pid = a[1]; st = a[2] }
  close(f)
  if (mode == "list") { print h "DIR " pid " " st " " (t == "" ? "-" : word(t)) " " text(nm); return }
  if (t == "" || (t in keep)) return
  if ((t in live) || (pid != "-" && stat(pid) && start == st) || nm ~ /[\r\n]/) print h "HELD " text(nm)
  else print "R " nm
}
substr($0, 1, 6) == "/proc/" {
  i = index($0, key)
  pid = substr($0, 7, i - 7)
  if (i < 8 || pid !~ /^[0-9]+$/ || pid == self) next
  t = substr($0, i + length(key))
  if (t == "") next
  if (!(pid in tok)) { tok[pid] = t; order[++np] = pid }
  epid[++ne] = pid; etok[ne] = t
  if (t in keep) kept[pid] = 1
}
END {
  for (j = 1; j <= np; j++) {
    pid = order[j]
    if (!stat(pid) || (sess != "" && sid == sess)) continue
    run[pid] = 1
    if (mode == "list") print h "PROC " pid " " start " " text(tok[pid])
    else if (pid in kept) continue
    else if (mode == "strays") print pid
    else if (mode == "targets") print h "TARGET " pid " " start " " text(tok[pid])
    else if (mode == "final") print h "LEFT " pid " " start " " text(tok[pid])
  }
  for (j = 1; j <= ne; j++) if (epid[j] in run) live[etok[j]] = 1
  for (j = 1; j <= nd; j++) folder(dirs[j])
  if (mode == "list" || mode == "final") print h "END"
}
"""

# The shell side: which grep to use (one probe, no process per process unless the node's grep
# has no -z), and ``marks MODE`` (the folders of $d go with list and final). Needs ``$keep``
# (tokens kept, a line each), ``$d``, ``procstat`` and the framing.
_MARKS = (
    r"""
nl='
'
put() { case $1 in *\\*) printf '%s\n' "$1";; *) echo "$1";; esac; }
for c in grep tr awk; do command -v $c >/dev/null 2>&1 || { say ERR "no $c on the node"; exit 0; }; done
me=; if [ -n "${CLUSTERCTL_RUN-}" ] && procstat $$; then me=$ps_sess; fi
unset CLUSTERCTL_RUN
zgrep=; CLUSTERCTL_ZPROBE=1 grep -qz '^CLUSTERCTL_ZPROBE=1$' /proc/self/environ 2>/dev/null && zgrep=1
marks_awk="""
    + shlex.quote(_MARKS_AWK)
    + r"""
marks() {
  m_mode=$1
  if [ "$m_mode" = list ] || [ "$m_mode" = final ]; then set -- "$d"/*/; [ -e "$1" ] || set --; else set --; fi
  if [ -n "$zgrep" ]; then
    LC_ALL=C grep -szH -- "^$RUN_ENV=." /proc/[0-9]*/environ 2>/dev/null | tr '\n\000' '\001\n' |
      LC_ALL=C CLUSTERCTL_KEEP=$keep awk -v h="@@$nonce " -v mode="$m_mode" -v name="$RUN_ENV" -v self=$$ -v sess="$me" "$marks_awk" "$@"
  else
    for p in /proc/[0-9]*; do tr '\n\000' '\001\n' 2>/dev/null <"$p/environ" | sed -n "s#^$RUN_ENV=.#$p/environ:&#p"; done |
      LC_ALL=C CLUSTERCTL_KEEP=$keep awk -v h="@@$nonce " -v mode="$m_mode" -v name="$RUN_ENV" -v self=$$ -v sess="$me" "$marks_awk" "$@"
  fi
}
"""
)


def _marks_head(run_dir: str, keep: Sequence[str] = ()) -> tuple[str, list[str]]:
    nonce, framing = _framed()
    lines = [
        "set -u",
        *framing,
        f"RUN_ENV={RUN_ENV}",
        "token=",
        _FUNCS,
        f"d={dir_expr(run_dir)}",
        f"keep={shlex.quote(chr(10).join(keep))}",
        _MARKS,
    ]
    return nonce, lines


def runs_script(run_dir: str) -> Script:
    """Everything of clusterctl on the node: ``PROC PID START TOKEN`` for each process that
    carries a marker (GPU or CPU, any shard, whatever started it; START: /proc/PID/stat field
    22), ``DIR PID START TOKEN NAME`` for each folder under ``run_dir`` (PID and START from its
    ``pid`` file, TOKEN from its ``env`` file; ``-`` where there is none), ``BOOT ID``, then
    ``END`` (a listing without it was cut short: nothing can be concluded from it). A token's
    blanks are written as \\x01 where another field follows. Processes whose environ cannot be
    read (other users') are skipped quietly.

    It starts 4 processes however many run on the node (a ``grep -z`` that checks the node's
    grep reads NUL-separated input, then one ``grep -z | tr | awk`` over every
    /proc/PID/environ); the folders and the stat files are read by that awk, the rest is
    shell builtins. On a node whose grep has no ``-z`` it falls back to a ``tr | sed`` per
    process."""
    nonce, lines = _marks_head(run_dir)
    lines += [
        "boot=; { read -r boot </proc/sys/kernel/random/boot_id; } 2>/dev/null",
        'echo "@@$nonce BOOT $boot"',
        "marks list",
    ]
    return _script(nonce, lines)


def check_keep(keep: Iterable[str]) -> list[str]:
    """The tokens of ``keep``, each checked to be comparable as written (not empty, no blank
    nor control character): ValueError otherwise, since a fence must not stop a process
    because its token was mistyped into something else."""
    out = []
    for t in keep:
        if not isinstance(t, str) or not t or not t.isprintable() or any(c.isspace() for c in t):
            raise ValueError(f"fence: not a marker to keep: {printable(str(t))[:120]!r}")
        out.append(t)
    return out


def fence_script(run_dir: str, keep: Iterable[str], *, grace_s: float = 10.0) -> Script:
    """Stop every process on the node that carries a marker whose token is not in ``keep``
    (one whose markers include a kept one, and one with no marker at all, is never signalled),
    as the stop script does: one TERM and a CONT each, ``grace_s``, then KILL. Then remove the
    folders under ``run_dir`` whose ``env`` names a token not kept, once no process of that
    token runs and the process their ``pid`` file records (same start time) is gone too.

    Answers ``TARGET PID START TOKEN`` for each process it signalled first, ``LEFT PID START
    TOKEN`` for each process not kept still running at the end, ``REMOVED NAME`` for each
    folder removed, ``HELD NAME`` for each folder of a token not kept that stays (something of
    it still runs), then ``END``. A folder without a marker in its ``env`` is left alone."""
    kept = check_keep(keep)
    nonce, lines = _marks_head(run_dir, kept)
    lines += [
        "m=$(marks targets)",
        "pids=; set -f; IFS=$nl",
        'for l in $m; do put "$l"; l=${l#"@@$nonce TARGET "}; pids="$pids ${l%% *}"; done',
        "unset IFS; set +f",
        *_ending_lines(grace_s, "pids=$(marks strays)"),
        "out=$(marks final)",
        "set -f; IFS=$nl",
        "for l in $out; do",
        "  case $l in",
        '    "R "*) n=${l#"R "}; p=$d/$n',
        '      if [ -d "$p" ] && [ ! -L "$p" ] && rm -rf -- "$p" 2>/dev/null && [ ! -e "$p" ]; then put "@@$nonce REMOVED $n"; else put "@@$nonce HELD $n"; fi;;',
        '    *) put "$l";;',
        "  esac",
        "done",
        "unset IFS; set +f",
    ]
    return _script(nonce, lines)


def heartbeat_script(refs: Iterable[ShardRef], run_dir: str) -> Script:
    """One look at a node, cheap enough to run every 2 s: ``BOOT ID`` (the node's boot id),
    ``ALIVE I`` / ``DEAD I`` for each ref as ``inspect_script`` answers (the same PID, start
    time and boot), and the listing of ``runs_script`` (``PROC``, ``DIR``, ``END``). No
    nvidia-smi, nothing per shard or per process but shell builtins and awk's reads.

    It starts 4 processes on the node however many shards and processes it has (8 shards or
    none): the probe of grep's ``-z``, then ``grep -z``, ``tr`` and ``awk`` once each (under
    bash, dash, busybox sh and mksh alike, measured with ``strace -f``; see
    ``tests/test_heartbeat.py``)."""
    refs = list(refs)
    nonce, lines = _marks_head(run_dir)
    lines += [*_alive_lines(refs), 'echo "@@$nonce BOOT $boot"', "marks list"]
    return _script(nonce, lines)


def log_command(run_dir: str, *, lines: int, follow: bool, previous: bool = False) -> str:
    """The command that prints (``follow``: and follows) a shard's log; ``previous``: the log
    before its last start or trim (``log.1``)."""
    f = " -f" if follow else ""
    name = "log.1" if previous else "log"
    return f"tail -n {int(lines)}{f} -- {dir_expr(run_dir)}/{name}"


def answers(out: str, tag: str, *, nonce: str) -> list[str]:
    """The payloads of the ``@@<nonce> TAG`` lines of a script's output, in order, printable.
    Lines are split on ``\\n`` alone; only one that starts with exactly that prefix is an
    answer, and never one that holds a ``\\r`` (a terminal shows it as something else)."""
    if not nonce:
        raise ValueError("answers: no nonce")
    head = f"@@{nonce} {tag}"
    return [
        printable(line[len(head) :].strip())
        for line in out.split("\n")
        if "\r" not in line and (line == head or line.startswith(head + " "))
    ]


def log_lines(out: str, *, nonce: str) -> list[str]:
    """The log lines a script passed on (``@@<nonce> LOG <line>``), printable: shown, never
    believed (a ``\\r`` in one is the log's own, written out as ``\\x0d``)."""
    if not nonce:
        raise ValueError("log_lines: no nonce")
    head = f"@@{nonce} LOG"
    return [printable(line[len(head) + 1 :]) for line in out.split("\n") if line == head or line.startswith(head + " ")]
