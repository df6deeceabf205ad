"""Run several probe commands as one remote exec, in parallel, and split the results.

One SSH channel per probe costs a channel open, a request and several packets each;
on a 64-node fleet that, not the handshakes, dominated discover's CPU. The batch is a
POSIX sh script, sent on stdin to ``sh -s`` (so any login shell can start it), that starts
every command in the background, waits, and prints:

    @@CC <token> RC
    <name> <rc>                  one line per record, in start order
    @@CC <token> DATA
    <out0>@@CC <token> SEP
    <err0>@@CC <token> SEP
    <out1>@@CC <token> SEP ...
    @@CC <token> END

One ``cat`` prints every output with a separator file between them; the token is random
per batch, so any output, binary junk included, splits exactly, and an output still
growing while it is read (a leftover child of a timed-out probe) can only lengthen its
own record. A record counts only when the separators after its stdout and its stderr
both arrived. The batch's own tools (``mktemp``, ``sleep``, ``cat``, ``rm``, ``awk``)
run as ``command -p``: from the system's default PATH, never from a wrapper or a
look-alike on the user's PATH (the probes themselves do use the user's PATH), except on
systems without tools in /bin or /usr/bin (NixOS, Guix), where the user's PATH is all there is.

Process cost matters as much as packets: on a shared box every extra ``fork``/``exec``
per node is paid 64 times. So a command runs directly as the background job (one
process, no wrapper), one watchdog (a subshell and a ``sleep`` at a time; it also ends the
batch within a second of its client going away) times out all of them
together (TERM to each job's process tree, KILL a second later, reported as rc 124; a job
that even KILL cannot stop, such as nvidia-smi in D state, is given up on a second after
that; a process a job left behind when it ended, under init since, is out of its reach:
the tools probed leave none), and the scratch files
live in ``/dev/shm`` where there is one (creating and removing files on a journalled
disk costs more than running the probes).

``then`` maps a record to a sh snippet that runs in the batch's shell as soon as that
record has finished with rc 0, while the others still run. ``$o`` is the record's
stdout file and ``run NAME CMD [ARG...]`` starts another record. A snippet's own
variables must not reuse the batch's names (``d g n o p R K w x<N> c s i l pp ws k q cs cf all sig js kr ka ks kp kq cc_rc cc_x``): prefix them ``cc_``. discover uses it to
start ``sminfo`` for every Active InfiniBand port that ``ibstat`` printed, without a
second round trip. ``val NAME TEXT`` adds a record that needs no process (stdout TEXT,
rc 0, or 1 when TEXT is empty): discover reads each such port's GID from sysfs with the
shell's own ``read``. Names are ``[A-Za-z0-9_.:-]+``; ``run`` and ``val`` skip any other.
A command given as :class:`Inline` is such a snippet itself, run once the commands before
it have started: a record read with builtins (``up`` reads its shards' ``/proc/PID/stat``
that way), no process.

Building the script and parsing its output are pure functions; nothing here does I/O.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping

from cluster_cli.ssh.session import CommandResult

TIMED_OUT = 124
NAME_RE = re.compile(r"[A-Za-z0-9_.:-]+")
# Shell syntax that a command must not contain to run directly as a background job.
_SHELL_SYNTAX = frozenset(';|&<>()$`\n\\"*?[]{}~#!')

_PRELUDE = r"""export LC_ALL=C
# The batch's own tools from the system's default PATH (never a look-alike on the user's),
# unless the system keeps them elsewhere (NixOS, Guix: only on the user's PATH).
if [ -x /bin/cat ] || [ -x /usr/bin/cat ]; then cc_p='command -p'; else cc_p=; fi
run() {
  case $1 in ''|*[!A-Za-z0-9_.:-]*) return 1;; esac
  [ -e "$d/t" ] && return 1  # the deadline has passed: start nothing more
  nm=$1; shift
  exec "$@" >"$d/$n.o" 2>"$d/$n.e" </dev/null &
  R="$R $n:$nm:$!"; n=$((n+1))
  echo $! >>"$d/p"
}
val() {  # a record that is already done: stdout $2, rc 0 (1 when $2 is empty); no process
  case $1 in ''|*[!A-Za-z0-9_.:-]*) return 1;; esac
  printf '%s\n' "$2" >"$d/$n.o"; : >"$d/$n.e"
  if [ -n "$2" ]; then eval "x$n=0"; else eval "x$n=1"; fi
  R="$R $n:$1:"; n=$((n+1))
}
ours() {  # is $1 a live (not zombie) child of $2? Without /proc: is there a process $1 at all?
  pp=$2
  if [ -r /proc/$$/stat ]; then
    l=; read -r l 2>/dev/null <"/proc/$1/stat" || return 1
    set -- ${l##*) }
    [ "$1" != Z ] && [ "$2" = "$pp" ]
  else kill -0 "$1" 2>/dev/null; fi
}
mine() {  # (in the watchdog) its parent is still the batch; without /proc, assume so
  l=; read -r l 2>/dev/null </proc/self/stat || return 0
  set -- ${l##*) }
  [ "$2" = "$$" ]
}
tree() {  # every process under the pids given, each thread's children too, into $all (no fork)
  all=; q=$*
  while set -- $q; [ $# -gt 0 ]; do
    c=$1; shift; q=$*; all="$all $c"
    for cf in /proc/$c/task/*/children; do cs=; read -r cs 2>/dev/null <"$cf"; q="$q $cs"; done
  done
}
kt() {  # KILL the trees under the pids given (ours): STOPped and walked again first, so none forks away
  kr=0; ka=; while [ $kr -lt 3 ]; do tree "$@"; kill -STOP $all 2>/dev/null; ka="$ka $all"; kr=$((kr+1)); done
  tree "$@"; kill -KILL $all $ka 2>/dev/null  # $ka too: one whose parent died since is no longer under it
}
stop_w() {  # end the watchdog and its sleep (w=), and reap it (bash would report it Killed)
  [ -n "$w" ] || return 0
  if [ -e "$d/t" ]; then
    # Past the deadline it is signalling the jobs' trees, then waits a second twice: it goes
    # with its tree, but only once the TERMs are out ($d/o), or a job's children could miss
    # theirs.
    c=0; while [ ! -e "$d/o" ] && [ $c -lt 100000 ] && ours "$w" $$; do c=$((c+1)); done
    ws=; kk
  else
    # Before it: KILL its sleep, whose pid it notes in $d/w, and it ends itself (KILL, not
    # TERM: a child forked but not yet exec'd still runs this shell's traps and would swallow
    # a TERM). Only pids still ours: one that has ended may belong to someone else now. The
    # flag $d/q ends it too where that sleep had just ended by itself (it sleeps in steps).
    : >"$d/q"
    c=0; while [ ! -s "$d/w" ] && [ $c -lt 100000 ] && ours "$w" $$; do c=$((c+1)); done
    ws=; read -r ws 2>/dev/null <"$d/w"
  fi
  if [ -n "$ws" ] && ours "$ws" "$w"; then kill -KILL "$ws" 2>/dev/null
  elif ! ours "$w" $$; then :
  elif [ -r /proc/$$/task/$$/children ]; then kt "$w"
  else kill -KILL "$w" 2>/dev/null; fi  # (a kernel without children lists: its sleep may stay)
  wait "$w" 2>/dev/null
  w=
}
cc_end() {  # on any exit: end everything the batch started, remove the scratch files
  cc_rc=${cc_rc:-$?} cc_x=1
  if [ -r /proc/$$/task/$$/children ]; then
    # Whatever it got to (a signal may land while jobs or the watchdog are being started).
    q=; read -r q 2>/dev/null <"/proc/$$/task/$$/children"
    [ -z "$q" ] || kt $q
    kk
  elif [ -n "$w" ]; then stop_w; kl TERM; fi
  [ -z "$d" ] || $cc_p rm -rf "$d"
  exit "$cc_rc"
}
kl() {
  sig=$1; js=
  while read -r k; do
    ours "$k" $$ || continue  # a finished job's pid may belong to someone else now
    [ "$sig" = TERM ] && echo "$k" >>"$d/t"
    js="$js $k"
  done <"$d/p"
  # Each job and everything it started (an `sh -c` probe's children would outlive it, still
  # writing to its output). KILL: as kt. TERM: the trees STOPped and walked again first (a
  # child forked after the walk, its parent then TERMed, would run on under init), then
  # TERMed and continued, so that each can end as it sees fit.
  if [ "$sig" = KILL ]; then [ -z "$js" ] || kt $js; return 0; fi
  all=; ka=
  if [ -n "$js" ]; then
    kr=0; while [ $kr -lt 3 ]; do tree $js; kill -STOP $all 2>/dev/null; ka="$ka $all"; kr=$((kr+1)); done
    tree $js; all="$all $ka"
  fi
  # What it signals, each pid with its start time (the same pid and start time is the same
  # process), noted before the TERM: a TERM-ignoring child of a job the TERM ends is out of
  # the job's tree at once, and only this list still finds it. $d/o: the TERMs are out.
  ks=
  for c in $all; do
    l=; read -r l 2>/dev/null <"/proc/$c/stat" || continue
    set -- ${l##*) }
    ks="$ks $c:${20}"
  done
  echo "$ks" >>"$d/k"
  [ -z "$all" ] || { kill -TERM $all 2>/dev/null; kill -CONT $all 2>/dev/null; }
  : >"$d/o"
}
kk() {  # KILL what the watchdog TERMed and still runs: a job that died may have left children
  [ -s "$d/k" ] || return 0
  while read -r kp; do
    for kq in $kp; do
      l=; read -r l 2>/dev/null <"/proc/${kq%%:*}/stat" || continue
      set -- ${l##*) }
      [ "$1" != Z ] && [ "${20}" = "${kq#*:}" ] && kill -KILL "${kq%%:*}" 2>/dev/null
    done
  done <"$d/k"
}
# Set up only now that every function is defined (a script cut short in the functions has
# started nothing), the exit trap before the scratch folder is made.
d=; w=; cc_rc=; cc_x=; trap 'cc_rc=${cc_rc:-$?}; [ -n "$cc_x" ] && exit "$cc_rc"; cc_end' EXIT
# The client left: clean up now, in the trap (cc_end exits with cc_rc: mksh would exit 0 from
# an EXIT trap, and runs none when it exits with a job STOPped, as at the deadline). Once
# cleaning up, a second signal (TERM then HUP, say) must not cut it short.
trap '[ -n "$cc_x" ] || { cc_rc=129; cc_end; }' HUP
trap '[ -n "$cc_x" ] || { cc_rc=141; cc_end; }' PIPE
trap '[ -n "$cc_x" ] || { cc_rc=143; cc_end; }' TERM INT
d=$($cc_p mktemp -d -p /dev/shm 2>/dev/null) || d=$($cc_p mktemp -d) || exit 97
g=; trap 'g=1' USR1  # from the watchdog: jobs that outlived KILL (D state) are given up on
R=; n=0
"""

# One watchdog for every job: at the deadline, flag it (``$d/t``), TERM the jobs still
# running (recording their pids), KILL what is left a second later, and a second after that
# wake the batch (USR1) so that it stops waiting for jobs that even KILL could not end.
# Only the batch ends it (``stop_w``, ``cc_end``): it ignores HUP, INT and TERM, so a signal
# to the whole group cannot end it and leave its sleep out of the batch's reach. A sleep that
# did not end by itself ends it too. It wakes the batch only while that is still there.
# It sleeps to the deadline in steps of {c} s, after each writing a newline to the batch's
# stdout (before the batch's own output, which is found by its token): a write that fails
# means the client is gone (sshd refuses a root session's signal requests, and writes
# nothing to a batch when its connection ends), and the batch is TERMed to clean up now,
# not at its deadline. ``mine``: the watchdog's parent is still the batch (a batch killed
# outright leaves no watchdog holding its output open, nor its scratch folder). ``$d/q``: the
# batch is done.
_WATCHDOG = (
    '( trap "" HUP INT TERM PIPE; n=0; while [ $n -lt {t} ]; do [ -e "$d/q" ] && exit; '
    '$cc_p sleep {c} & s=$!; echo $s >"$d/w"; wait $s || exit; [ -e "$d/q" ] && exit; '
    'mine || {{ $cc_p rm -rf "$d"; exit; }}; '
    "n=$((n+{c})); [ $n -ge {t} ] || echo || {{ mine && kill -TERM $$; exit; }}; done; "
    ': >"$d/t"; kl TERM; $cc_p sleep 1; kl KILL; $cc_p sleep 1; ours $$ $PPID && kill -USR1 $$; '
    'mine || $cc_p rm -rf "$d" ) '
    "2>/dev/null </dev/null & w=$!"
)

_COLLECT = r"""for x in $R; do
  i=${{x%%:*}}; pid=${{x##*:}}
  eval "r=\${{x$i-}}"
  if [ -z "$r" ]; then
    if [ -n "$g" ] && kill -0 "$pid" 2>/dev/null; then r={timed_out}  # unkillable: give up on it
    else
      wait "$pid"; r=$?
      if [ -n "$g" ] && [ "$r" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then r={timed_out}; fi
    fi
    eval "x$i=\$r"
  fi
done
stop_w
K=" "
if [ -e "$d/t" ]; then while read -r k; do K="$K$k "; done <"$d/t"; fi
echo "@@CC {token} RC"  # echo: a builtin in every sh (printf is a program in mksh)
set --
for x in $R; do
  i=${{x%%:*}}; x=${{x#*:}}; nm=${{x%:*}}; pid=${{x##*:}}
  eval "r=\$x$i"
  case $K in *" $pid "*) r={timed_out};; esac  # TERMed at the deadline, however it then ended
  echo "$nm $r"  # a checked name (no backslash) and a number
  set -- "$@" "$d/$i.o" "$d/s" "$d/$i.e" "$d/s"
done
echo "@@CC {token} SEP" >"$d/s"
echo "@@CC {token} DATA"
[ $# -gt 0 ] && $cc_p cat "$@" </dev/null
echo "@@CC {token} END"
exit 0
"""

# Words that are shell builtins or keywords, not programs: such a command needs its own sh.
_NOT_PROGRAMS = frozenset(
    (
        ".",
        ":",
        "[",
        "alias",
        "bg",
        "break",
        "cd",
        "command",
        "continue",
        "eval",
        "exec",
        "exit",
        "export",
        "fg",
        "getopts",
        "hash",
        "jobs",
        "kill",
        "local",
        "read",
        "readonly",
        "return",
        "set",
        "shift",
        "test",
        "times",
        "trap",
        "type",
        "ulimit",
        "umask",
        "unalias",
        "unset",
        "wait",
        "case",
        "do",
        "done",
        "elif",
        "else",
        "esac",
        "fi",
        "for",
        "if",
        "in",
        "then",
        "until",
        "while",
        "{",
        "}",
        "!",
    )
)


def _without_comment_lines(script: str) -> str:
    """The batch's own text without its comment lines: it goes to every node on every run."""
    return "".join(ln for ln in script.splitlines(keepends=True) if not ln.lstrip().startswith("#"))


_PRELUDE = _without_comment_lines(_PRELUDE)
_COLLECT = _without_comment_lines(_COLLECT)


class Inline(str):
    """Shell text that runs in the batch's own shell and makes its record with ``val``:
    builtins only (no process), variables prefixed ``cc_``; every value in it quoted."""

    __slots__ = ()


def _is_simple(cmd: str) -> bool:
    """Plain words and single-quoted words (what ``shlex.quote`` makes), no assignment first."""
    if cmd.count("'") % 2:
        return False
    bare = re.sub(r"'[^']*'", "''", cmd)  # anything goes inside single quotes
    words = bare.split()
    return bool(words) and "=" not in words[0] and words[0] not in _NOT_PROGRAMS and not (_SHELL_SYNTAX & set(bare))


# The remote command of a batch: the script itself goes on stdin. A script inside the
# command line would have to survive the user's login shell, and csh/tcsh cannot take a
# quoted string that spans lines.
BATCH_SHELL = "sh -s"


def build_script(
    commands: Mapping[str, str],
    *,
    per_command_timeout_s: float,
    token: str | None = None,
    then: Mapping[str, str] | None = None,
    check_s: float = 1,
) -> tuple[str, str]:
    """The sh script running ``commands`` in parallel (feed it to ``BATCH_SHELL``), and its token.

    Each command is shell text inserted as is (callers build it with ``shlex.quote``);
    it runs with ``LC_ALL=C``. ``then`` is described in the module docstring. Every
    ``check_s`` seconds (whole, at least 1) the batch checks that its client is still there.
    """
    token = token or secrets.token_hex(8)
    t = max(1, int(per_command_timeout_s))
    then = dict(then or {})
    names = list(commands)
    for name in [*names, *then]:
        if not NAME_RE.fullmatch(name):
            raise ValueError(f"batch record name {name!r} must match {NAME_RE.pattern}")
    if unknown := set(then) - set(names):
        raise ValueError(f"'then' names unknown records: {sorted(unknown)}")
    lines = [_PRELUDE]
    for i, (name, cmd) in enumerate(commands.items()):
        if isinstance(cmd, Inline):
            if name in then:
                raise ValueError(f"batch record {name!r} is inline: nothing can run after it")
            lines.append(cmd)
            continue
        # A simple command runs directly as the job; anything with shell syntax gets its own sh.
        argv = cmd if _is_simple(cmd) else f"sh -c {shlex.quote(cmd)}"
        lines.append(f"run {name} {argv}" + (f"; p{i}=$!" if name in then else ""))
    if any(not isinstance(cmd, Inline) for cmd in commands.values()):  # no job, nothing to watch
        lines.append(_WATCHDOG.format(t=t, c=max(1, min(t, int(check_s)))))
    for i, name in enumerate(names):
        if name in then:
            lines.append(f'wait "$p{i}"; x{i}=$?')
            lines.append(f'if [ "$x{i}" -eq 0 ]; then o="$d/{i}.o"\n{then[name].strip()}\nfi')
    lines.append(_COLLECT.format(token=token, timed_out=TIMED_OUT))
    return "\n".join(lines) + "\n", token


_RC_LINE = re.compile(rb"(" + NAME_RE.pattern.encode() + rb") (\d+)")


def parse_records(commands: Mapping[str, str], stdout: bytes, token: str) -> dict[str, CommandResult]:
    """Split the batch's stdout back into one result per record.

    Every name in ``commands`` gets a result; a record whose result is missing or cut
    short (the node died mid-way) gets ``rc=None``. Records started by ``then``
    snippets are added under their own names. Never raises.
    """
    missing = CommandResult(None, "", "no result (connection lost or batch cut short)")
    out: dict[str, CommandResult] = dict.fromkeys(commands, missing)
    tok = token.encode()
    m_rc = re.search(rb"@@CC " + re.escape(tok) + rb" RC\n", stdout)
    m_data = re.search(rb"@@CC " + re.escape(tok) + rb" DATA\n", stdout)
    if m_rc is None or m_data is None or m_rc.end() > m_data.start():
        return out
    records: list[tuple[str, int]] = []
    for line in stdout[m_rc.end() : m_data.start()].splitlines():
        m = _RC_LINE.fullmatch(line.strip())
        if m is None:
            return out  # not our framing: trust nothing
        records.append((m.group(1).decode(), int(m.group(2))))
    data = stdout[m_data.end() :]
    end = b"@@CC " + tok + b" END\n"
    finished = data.endswith(end)
    pieces = (data[: -len(end)] if finished else data).split(b"@@CC " + tok + b" SEP\n")
    complete = len(pieces) - 1  # every piece but the last was followed by its separator
    if complete > 2 * len(records) or (finished and (complete != 2 * len(records) or pieces[-1])):
        return out | {name: missing for name, _ in records}  # not the shape we printed: trust nothing
    for i, (name, rc) in enumerate(records):
        if 2 * i + 1 >= complete:
            out[name] = missing  # cut short before this record's stderr separator
            continue
        err = pieces[2 * i + 1].decode("utf-8", "replace")
        if rc == TIMED_OUT:
            err += "probe timed out\n"
        out[name] = CommandResult(rc, pieces[2 * i].decode("utf-8", "replace"), err)
    return out
