"""Run several probe commands as one remote exec, in parallel, and split the results.

One SSH channel per probe costs a channel open, a request and several packets each;
on a 64-node fleet that, not the handshakes, dominated discover's CPU. The batch is a
POSIX sh script that starts every command in the background (each under
``timeout`` where available, so one hung ``nvidia-smi`` cannot eat the others'
results), waits, and prints each result as a length-prefixed record:

    @@CC <token> <index> <rc> <stdout bytes> <stderr bytes>\\n<stdout><stderr>

Lengths are in bytes, so any output — binary junk included — splits exactly. Both
halves are pure functions; nothing here does I/O.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping

from cluster_cli.probe.runner import CommandResult

_HEADER = re.compile(rb"@@CC (?P<tok>[0-9a-f]+) (?P<i>\d+) (?P<rc>\d+|x) +(?P<o>\d+) +(?P<e>\d+)\n")


def build_command(commands: Mapping[str, str], *, per_command_timeout_s: float, token: str | None = None) -> tuple[str, str]:
    """The remote command (``sh -c`` + script) running ``commands`` in parallel, and its records' token."""
    token = token or secrets.token_hex(8)
    t = max(1, int(per_command_timeout_s))
    lines = [
        'd=$(mktemp -d 2>/dev/null || { mkdir -p "/tmp/clusterctl.$$" && echo "/tmp/clusterctl.$$"; }) || exit 97',
        "trap 'rm -rf \"$d\"' EXIT",
        f'if command -v timeout >/dev/null 2>&1; then T="timeout -k 2 {t}"; else T=""; fi',
    ]
    for i, cmd in enumerate(commands.values()):
        # Each command runs in its own subshell; its rc lands in a file of its own.
        lines.append(f'( $T sh -c {shlex.quote(cmd)} >"$d/{i}.o" 2>"$d/{i}.e" </dev/null; echo $? >"$d/{i}.r" ) &')
    lines.append("wait")
    for i in range(len(commands)):
        lines.append(
            f'printf "@@CC {token} {i} %s %s %s\\n" "$(cat "$d/{i}.r" 2>/dev/null || echo x)" '
            f'"$(wc -c <"$d/{i}.o")" "$(wc -c <"$d/{i}.e")"; cat "$d/{i}.o" "$d/{i}.e"'
        )
    return "sh -c " + shlex.quote("\n".join(lines) + "\n"), token


def parse_records(commands: Mapping[str, str], stdout: bytes, token: str) -> dict[str, CommandResult]:
    """Split the batch's stdout back into one result per command.

    A command whose record is missing or cut short (the node died mid-way) gets
    ``rc=None``. Never raises.
    """
    names = list(commands)
    found: dict[int, CommandResult] = {}
    pos = 0
    tok = token.encode()
    while True:
        m = _HEADER.search(stdout, pos)
        if m is None:
            break
        pos = m.end()
        if m["tok"] != tok:
            continue
        i, n_out, n_err = int(m["i"]), int(m["o"]), int(m["e"])
        rc = None if m["rc"] == b"x" else int(m["rc"])
        body = stdout[pos : pos + n_out + n_err]
        if len(body) < n_out + n_err or not 0 <= i < len(names):
            break
        out, err = body[:n_out], body[n_out:]
        pos += n_out + n_err
        found[i] = CommandResult(
            rc=rc,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace") + ("probe timed out\n" if rc in (124, 137) else ""),
        )
    return {n: found.get(i, CommandResult(None, "", "no result (connection lost or batch cut short)")) for i, n in enumerate(names)}

