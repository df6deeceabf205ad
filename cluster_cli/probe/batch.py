"""Run several probe commands as one remote exec, in parallel, and split the results.

One SSH channel per probe costs a channel open, a request and several packets each;
on a 64-node fleet that, not the handshakes, dominated discover's CPU. The batch is a
POSIX sh script that starts every command in the background (each under
``timeout`` where available, so one hung ``nvidia-smi`` cannot eat the others'
results), waits, and then prints, with as few extra processes as possible:

    @@CC <token> RC <rc0> <rc1> ...
    <`wc -c` of out0 err0 out1 err1 ...>
    @@CC <token> DATA
    <out0><err0><out1><err1>...

Byte counts let any output, binary junk included, be split exactly. Building the
script and parsing its output are pure functions; nothing here does I/O.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping

from cluster_cli.probe.runner import CommandResult

_TIMED_OUT = (124, 137)
# Shell syntax that a command must not contain to run directly under ``timeout``.
_SHELL_SYNTAX = frozenset(";|&<>()$`\n\\\"*?[]{}~#!")


def _is_simple(cmd: str) -> bool:
    """Plain words and single-quoted words (what ``shlex.quote`` makes) only."""
    return not (_SHELL_SYNTAX & set(cmd)) and cmd.count("'") % 2 == 0


def build_command(
    commands: Mapping[str, str], *, per_command_timeout_s: float, token: str | None = None
) -> tuple[str, str]:
    """The remote command (``sh -c`` + script) running ``commands`` in parallel, and its token.

    Each command is shell text inserted as is (callers build it with ``shlex.quote``);
    it runs with ``LC_ALL=C``.
    """
    token = token or secrets.token_hex(8)
    t = max(1, int(per_command_timeout_s))
    n = len(commands)
    lines = [
        "export LC_ALL=C",
        "d=$(mktemp -d) || exit 97",
        "trap 'rm -rf \"$d\"' EXIT",
        f'if command -v timeout >/dev/null 2>&1; then T="timeout -k 1 {t}"; else T=""; fi',
    ]
    for i, cmd in enumerate(commands.values()):
        # A simple command runs directly under timeout; anything with shell syntax gets its own sh.
        run = cmd if _is_simple(cmd) else f"sh -c {shlex.quote(cmd)}"
        lines.append(f'( $T {run} >"$d/{i}.o" 2>"$d/{i}.e" </dev/null; echo $? >"$d/{i}.r" ) &')
    files = " ".join(f'"$d/{i}.o" "$d/{i}.e"' for i in range(n))
    lines += [
        "wait",
        f"printf '@@CC {token} RC'",
        f"for i in {' '.join(map(str, range(n)))}; do r=x; read r <\"$d/$i.r\" 2>/dev/null; printf ' %s' \"$r\"; done",
        "printf '\\n'",
        f"wc -c {files}",
        f"printf '@@CC {token} DATA\\n'",
        f"cat {files}",
    ]
    return "sh -c " + shlex.quote("\n".join(lines) + "\n"), token


def parse_records(commands: Mapping[str, str], stdout: bytes, token: str) -> dict[str, CommandResult]:
    """Split the batch's stdout back into one result per command.

    A command whose result is missing or cut short (the node died mid-way) gets
    ``rc=None``. Never raises.
    """
    names = list(commands)
    n = len(names)
    missing = CommandResult(None, "", "no result (connection lost or batch cut short)")
    tok = re.escape(token.encode())
    m_rc = re.search(rb"@@CC " + tok + rb" RC([^\n]*)\n", stdout)
    m_data = re.search(rb"\n?@@CC " + tok + rb" DATA\n", stdout)
    if m_rc is None or m_data is None or m_data.start() < m_rc.end():
        return dict.fromkeys(names, missing)
    rcs: list[int | None] = [int(x) if x.isdigit() else None for x in m_rc.group(1).split()]
    sizes = [int(line.split()[0]) for line in stdout[m_rc.end() : m_data.start()].splitlines()
             if line.split() and line.split()[0].isdigit()]  # fmt: skip
    if len(rcs) < n or len(sizes) < 2 * n:
        return dict.fromkeys(names, missing)
    out: dict[str, CommandResult] = {}
    pos = m_data.end()
    for i, name in enumerate(names):
        n_out, n_err = sizes[2 * i], sizes[2 * i + 1]
        body = stdout[pos : pos + n_out + n_err]
        if len(body) < n_out + n_err:
            # Cut short: this and every later record are lost (never shift one into the next).
            out.update(dict.fromkeys(names[i:], missing))
            break
        pos += n_out + n_err
        rc = rcs[i]
        err = body[n_out:].decode("utf-8", "replace")
        if rc in _TIMED_OUT:
            err += "probe timed out\n"
        out[name] = CommandResult(rc, body[:n_out].decode("utf-8", "replace"), err)
    return out
