#!/usr/bin/env bash
# Smoke test of the one-file binary (`make dist`) on its own: every clusterctl command below is
# a copy of dist/clusterctl run from a folder outside the checkout with an empty environment
# (env -i: PATH=/usr/bin:/bin, a fresh HOME, no virtualenv, no PYTHONPATH). Only the harness
# uses the checkout's virtualenv: the SSH testbed, the tiny model, the simulated engine and
# the openai client.
#
#   bash scripts/dist-smoke.sh [BINARY]      (default dist/clusterctl)
#
# Checks: --version, --help, shell completion; discover of a testbed node, cordon/uncordon,
# place --dry-run; up, status, logs and down of one llama-server replica; serve-router (on
# uvloop) streaming a chat completion from the openai client in front of the simulated
# engine; the processes it starts (ssh_config `Match exec`) get the caller's LD_LIBRARY_PATH,
# not the bundle's; the first run unpacks once even when several start at once; a noexec
# TMPDIR or cache folder (root: a tmpfs mounted noexec) means a fallback or one clear error;
# as root also: it runs as user nobody; the wheel in dist/ installs into a clean virtualenv and
# runs (SMOKE_WHEEL=0 skips that: it needs the package index). Exit status 0 when every check
# passed. Cleans up (engines, router, testbed, the work folder) on exit; SMOKE_KEEP=1 keeps
# the work folder. Shell completion is checked when the package offers it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(realpath "${1:-$ROOT/dist/clusterctl}")
PY=${PY:-$ROOT/.venv/bin/python}
[ -x "$SRC" ] || { echo "dist-smoke: $SRC: no such executable (make dist builds it)" >&2; exit 2; }
WORK=$(mktemp -d "${SMOKE_TMP:-/var/tmp}/clusterctl-smoke.XXXXXX")
chmod 755 "$WORK"
TB=$WORK/tb
BIN=$WORK/bin/clusterctl  # the binary alone, outside the checkout
mkdir -p "$WORK/bin" "$WORK/home" "$WORK/run"
cp "$SRC" "$BIN"
cd "$WORK/run"
unset PYTHONPATH VIRTUAL_ENV

pass=0
fail=0
pids=()
mounted=()
ok() { pass=$((pass + 1)); printf '  ok    %s\n' "$*"; }
bad() { fail=$((fail + 1)); printf '  FAIL  %s\n' "$*"; }
skip() { printf '  skip  %s\n' "$*"; }
say() { printf '\n== %s\n' "$*"; }
# The binary with an empty environment; extra NAME=VALUE words go before the command.
ctl_env=(env -i PATH=/usr/bin:/bin HOME="$WORK/home" LANG=C.UTF-8 CLUSTERCTL_STATE="$WORK/state.db")
ctl() { "${ctl_env[@]}" "$BIN" "$@"; }
harness() { (cd "$ROOT" && exec "$PY" "$@"); }

cleanup() {
  rc=$?
  set +e
  if [ -f "$WORK/state.db" ] && [ -f "$TB/inventory.yaml" ]; then
    ctl down --all -i "$TB/inventory.yaml" >/dev/null 2>&1
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  [ -d "$TB" ] && harness -m testbed down --dir "$TB" >/dev/null 2>&1
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null; done
  cd /
  if [ "${SMOKE_KEEP:-0}" = 1 ]; then echo "work folder kept: $WORK"; else rm -rf "$WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

version=$(cd "$ROOT" && "$PY" -c 'import cluster_cli; print(cluster_cli.__version__)')

say "Start-up, help, completion ($BIN, $(du -h "$BIN" | cut -f1))"
t0=$(date +%s%N)
got=$(ctl --version) && [ "$got" = "clusterctl $version" ] && ok "first run (unpacks): --version: $got ($((($(date +%s%N) - t0) / 1000000)) ms)" || bad "--version: '$got'"
t0=$(date +%s%N)
got=$(ctl --version) && [ "$got" = "clusterctl $version" ] && ok "second run: --version ($((($(date +%s%N) - t0) / 1000000)) ms)" || bad "second --version: '$got'"
n=$(find "$WORK/home/.cache/clusterctl/bin" -mindepth 1 -maxdepth 1 | wc -l)
[ "$n" = 1 ] && ok "unpacked once into ~/.cache/clusterctl/bin/$(ls "$WORK/home/.cache/clusterctl/bin")" || bad "the cache holds $n entries"
out=$(ctl --help 2>&1) && grep -q discover <<<"$out" && grep -q serve-router <<<"$out" && ok "--help lists the commands" || bad "--help: $out"
helpless=
for c in discover cordon uncordon place up down status logs serve-router; do
  ctl "$c" --help >/dev/null 2>&1 || helpless="$helpless $c"
done
[ -z "$helpless" ] && ok "every command's --help" || bad "--help failed for:$helpless"
# Shell completion: the binary completes as the package does (Typer's protocol; the package
# offers it once cluster_cli/cli/main.py enables it).
VENV_CTL=$(dirname "$PY")/clusterctl
if env -i PATH=/usr/bin:/bin HOME="$WORK/home" _CLUSTERCTL_COMPLETE=source_bash "$VENV_CTL" 2>/dev/null | grep -q 'complete '; then
  out=$("${ctl_env[@]}" _CLUSTERCTL_COMPLETE=source_bash "$BIN" 2>&1) && grep -q 'complete ' <<<"$out" \
    && ok "bash completion script (_CLUSTERCTL_COMPLETE=source_bash)" || bad "completion script: ${out:0:300}"
  out=$("${ctl_env[@]}" _CLUSTERCTL_COMPLETE=complete_bash COMP_WORDS="clusterctl serve-r" COMP_CWORD=1 "$BIN" 2>&1) \
    && grep -q serve-router <<<"$out" && ok "bash completion of 'clusterctl serve-r'" || bad "completion: ${out:0:300}"
  out=$("${ctl_env[@]}" _CLUSTERCTL_COMPLETE=complete_bash COMP_WORDS="clusterctl discover --par" COMP_CWORD=2 "$BIN" 2>&1) \
    && grep -q -- --parallel <<<"$out" && ok "bash completion of 'clusterctl discover --par'" || bad "completion: ${out:0:300}"
  out=$("${ctl_env[@]}" _CLUSTERCTL_COMPLETE=complete_zsh _TYPER_COMPLETE_ARGS="clusterctl disc" "$BIN" 2>&1) \
    && grep -q discover <<<"$out" && ok "zsh completion of 'clusterctl disc'" || bad "zsh completion: ${out:0:300}"
  if "$VENV_CTL" --help 2>/dev/null | grep -q -- --show-completion; then
    out=$("${ctl_env[@]}" SHELL=/bin/bash "$BIN" --show-completion bash 2>&1) && grep -q 'complete ' <<<"$out" \
      && ok "--show-completion bash" || bad "--show-completion bash: ${out:0:300}"
  fi
else
  skip "shell completion: the package has none either (Typer add_completion=False in cluster_cli/cli/main.py)"
fi

say "Several first runs at once (a fresh cache): one unpacked folder, no leftovers"
cc=$WORK/cache-race
for i in 1 2 3 4; do ("${ctl_env[@]}" CLUSTERCTL_CACHE_DIR="$cc" "$BIN" --version >"$WORK/race.$i" 2>&1; echo $? >>"$WORK/race.rc") & done
wait
if [ "$(sort -u "$WORK/race.rc")" = 0 ] && [ "$(cat "$WORK"/race.[1-4] | sort -u)" = "clusterctl $version" ]; then
  ok "4 first runs at once all answered"
else
  bad "4 first runs at once: $(cat "$WORK"/race.*)"
fi
left=$(ls -A "$cc" | wc -l)
[ "$left" = 1 ] && ok "one folder in the cache, no temporary ones left ($(ls -A "$cc"))" || bad "cache after the race: $(ls -A "$cc" | tr '\n' ' ')"

say "Unwritable and noexec folders, an old glibc"
mkdir -p "$WORK/tmpdir" && chmod 1777 "$WORK/tmpdir"
: >"$WORK/home-is-a-file"  # a HOME under which no folder can be made (even by root)
out=$(env -i PATH=/usr/bin:/bin HOME="$WORK/home-is-a-file" TMPDIR="$WORK/tmpdir" "$BIN" --version 2>&1; echo "rc=$?")
[ "$out" = "clusterctl $version
rc=0" ] && [ -d "$WORK/tmpdir/clusterctl-$(id -u)" ] && ok "HOME unusable: unpacked into \$TMPDIR/clusterctl-$(id -u)" || bad "HOME unusable: $out"
if [ "$(id -u)" = 0 ] && mkdir -p "$WORK/noexec" && mount -t tmpfs -o noexec,size=512m tmpfs "$WORK/noexec" 2>/dev/null; then
  mounted+=("$WORK/noexec")
  out=$(env -i PATH=/usr/bin:/bin HOME="$WORK/home-is-a-file" TMPDIR="$WORK/noexec" "$BIN" --version 2>&1; echo "rc=$?")
  [ "$out" = "clusterctl $version
rc=0" ] && [ -d "$WORK/bin/.clusterctl-bin" ] && ok "TMPDIR noexec (tmpfs): fell back to .clusterctl-bin beside the binary" || bad "TMPDIR noexec: $out"
  mkdir -p "$WORK/noexec/home"
  out=$(env -i PATH=/usr/bin:/bin HOME="$WORK/noexec/home" TMPDIR="$WORK/tmpdir" "$BIN" --version 2>&1; echo "rc=$?")
  [ "$out" = "clusterctl $version
rc=0" ] && [ -z "$(ls -A "$WORK/noexec/home/.cache/clusterctl/bin")" ] \
    && ok "HOME on a noexec mount: skipped, \$TMPDIR used" || bad "HOME noexec: $out"
  out=$(env -i PATH=/usr/bin:/bin HOME="$WORK/home" CLUSTERCTL_CACHE_DIR="$WORK/noexec/cache" "$BIN" --version 2>&1; echo "rc=$?")
  if grep -q "rc=1" <<<"$out" && grep -q "CLUSTERCTL_CACHE_DIR" <<<"$out" && [ "$(grep -c . <<<"$out")" = 2 ]; then
    ok "CLUSTERCTL_CACHE_DIR on a noexec mount: one line: $(head -1 <<<"$out")"
  else
    bad "CLUSTERCTL_CACHE_DIR noexec: $out"
  fi
else
  skip "noexec mount (needs root and tmpfs)"
fi
mkdir -p "$WORK/oldglibc"
printf '#!/bin/sh\necho "glibc 2.17"\n' >"$WORK/oldglibc/getconf" && chmod 755 "$WORK/oldglibc/getconf"
out=$(env -i PATH="$WORK/oldglibc:/usr/bin:/bin" HOME="$WORK/home" CLUSTERCTL_CACHE_DIR="$WORK/cache-oldglibc" "$BIN" --version 2>&1; echo "rc=$?")
grep -q "rc=1" <<<"$out" && grep -q "needs glibc" <<<"$out" && [ "$(grep -c . <<<"$out")" = 2 ] \
  && ok "a host with glibc 2.17 (a fake getconf): one line: $(head -1 <<<"$out")" || bad "old glibc: $out"

if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 && command -v runuser >/dev/null; then
  say "As a normal user (nobody)"
  mkdir -p "$WORK/nobody-home" && chown nobody "$WORK/nobody-home"
  out=$(runuser -u nobody -- env -i PATH=/usr/bin:/bin HOME="$WORK/nobody-home" "$BIN" --version 2>&1; echo "rc=$?")
  [ "$out" = "clusterctl $version
rc=0" ] && ok "nobody: --version (unpacked into its own ~/.cache)" || bad "nobody: $out"
  out=$(runuser -u nobody -- env -i PATH=/usr/bin:/bin HOME="$WORK/nobody-home" "$BIN" place --help 2>&1) && ok "nobody: place --help" || bad "nobody: place --help: ${out:0:300}"
  out=$(runuser -u nobody -- env -i PATH=/usr/bin:/bin HOME="$WORK/home-is-a-file" TMPDIR="$WORK/tmpdir" "$BIN" --version 2>&1; echo "rc=$?")
  [ "$out" = "clusterctl $version
rc=0" ] && ok "nobody, no HOME: \$TMPDIR/clusterctl-$(id -u nobody)" || bad "nobody, no HOME: $out"
  # root's folder there is not nobody's: never used by it
  [ -d "$WORK/tmpdir/clusterctl-$(id -u nobody)" ] && ok "nobody got its own folder, not root's" || bad "nobody's TMPDIR folder missing"
else
  skip "runs as nobody (needs root and runuser)"
fi

say "The SSH testbed (harness: $PY -m testbed)"
harness -m testbed up --dir "$TB" --nodes "cpu-01=cpu-only:cpus=4:mem_gib=8" >/dev/null
INV=$TB/inventory.yaml
ok "testbed up: cpu-01"
out=$(ctl discover -i "$INV" 2>&1) && grep -q cpu-01 <<<"$out" && ok "discover" || bad "discover: $out"
out=$(ctl discover -i "$INV" -o json 2>&1) && "$PY" -c '
import json, sys
nodes = json.loads(sys.argv[1])["nodes"]
assert [n["name"] for n in nodes] == ["cpu-01"] and nodes[0]["reachable"], nodes' "$out" && ok "discover -o json: cpu-01 reachable" || bad "discover -o json: ${out:0:500}"
out=$(ctl cordon cpu-01 -i "$INV" --reason "smoke test" 2>&1) && ok "cordon" || bad "cordon: $out"
out=$(ctl uncordon cpu-01 -i "$INV" 2>&1) && ok "uncordon" || bad "uncordon: $out"

# The processes clusterctl starts itself: an ssh_config `Match exec` writes its environment.
printf 'Match exec "env > %s"\n' "$WORK/child-env" >"$TB/ssh_config-env"
{ cat "$INV"; printf '\nssh_config: ssh_config-env\n'; } >"$TB/inventory-env.yaml"
rm -f "$WORK/child-env"
if ctl discover -i "$TB/inventory-env.yaml" >/dev/null 2>&1 && [ -s "$WORK/child-env" ]; then
  if grep -q '^LD_LIBRARY_PATH=' "$WORK/child-env"; then
    bad "a child process got LD_LIBRARY_PATH=$(sed -n 's/^LD_LIBRARY_PATH=//p' "$WORK/child-env") (the caller had none)"
  else
    ok "a child process (Match exec) gets no LD_LIBRARY_PATH, as the caller had none"
  fi
  leaked=$(grep -E '^(_PYI|_MEI|LD_LIBRARY_PATH_ORIG)' "$WORK/child-env" | cut -d= -f1 | tr '\n' ' ' || true)
  [ -z "$leaked" ] && ok "and no PyInstaller variables" || echo "  note  the child also sees: $leaked"
  rm -f "$WORK/child-env"
  "${ctl_env[@]}" LD_LIBRARY_PATH=/opt/smoke/lib "$BIN" discover -i "$TB/inventory-env.yaml" >/dev/null 2>&1
  got=$(sed -n 's/^LD_LIBRARY_PATH=//p' "$WORK/child-env" 2>/dev/null)
  [ "$got" = /opt/smoke/lib ] && ok "a child process gets the caller's LD_LIBRARY_PATH=/opt/smoke/lib back" || bad "child LD_LIBRARY_PATH: '$got'"
else
  bad "discover with an ssh_config Match exec (the child's environment was not written)"
fi

say "place --dry-run; up, status, logs, down of one llama-server replica"
LLAMA_SERVER=${LLAMA_SERVER:-$(PYTHON="$PY" bash "$ROOT/scripts/install-llama-server.sh")}
MODEL=$(harness -c 'import sys; sys.path.insert(0, "tests"); from pathlib import Path
from gguf_tiny import make_tiny_gguf; print(make_tiny_gguf(Path(sys.argv[1])))' "$WORK/tiny.gguf")
cat >"$WORK/catalog.yaml" <<EOF
engines:
  llamacpp: {command: $LLAMA_SERVER}
models:
  - name: tiny
    replicas: 1
    profiles:
      - {name: cpu, engine: llamacpp, cpus: 1, memory_gib: 0.25, model: $MODEL}
EOF
out=$(ctl place --dry-run -i "$INV" -c "$WORK/catalog.yaml" 2>&1) && grep -q cpu-01 <<<"$out" && ok "place --dry-run: tiny on cpu-01" || bad "place --dry-run: $out"
if out=$(ctl up -i "$INV" -c "$WORK/catalog.yaml" --timeout 120 2>&1); then
  ok "up: one llama-server replica"
  pgrep -f "$MODEL" >/dev/null && ok "its llama-server runs" || bad "no llama-server process with $MODEL"
else
  bad "up: $out"
fi
out=$(ctl status -i "$INV" 2>&1) && grep -q tiny <<<"$out" && ok "status" || bad "status: $out"
out=$(ctl logs tiny/0 -n 3 -i "$INV" 2>&1) && ok "logs tiny/0 -n 3" || bad "logs: $out"
out=$(ctl down --all -i "$INV" 2>&1) && ok "down --all" || bad "down: $out"
for _ in $(seq 50); do pgrep -f "$MODEL" >/dev/null || break; sleep 0.2; done
pgrep -f "$MODEL" >/dev/null && bad "a llama-server still runs after down" || ok "no llama-server left"

say "serve-router in front of the simulated engine, the openai client streaming"
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
EP=$(free_port)
(cd "$ROOT" && exec "$PY" tests/simengine.py --port "$EP" --model sim --tokens 12) >"$WORK/simengine.log" 2>&1 &
pids+=($!)
RP=$(free_port)
cat >"$WORK/router.yaml" <<EOF
models:
  sim:
    endpoints:
      - {url: "http://127.0.0.1:$EP", engine: vllm, replica: r0}
EOF
"${ctl_env[@]}" "$BIN" serve-router --config "$WORK/router.yaml" --port "$RP" --access-log off >"$WORK/router.log" 2>&1 &
router=$!
pids+=("$router")
if "$PY" - "$RP" <<'EOF'
import sys, time
import httpx
from openai import OpenAI

base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 30
while True:
    try:
        if any(m["id"] == "sim" for m in httpx.get(f"{base}/v1/models", timeout=1).json()["data"]):
            break
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the router did not serve model sim within 30 s")
    time.sleep(0.2)
client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
stream = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], stream=True)
chunks = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
assert len(chunks) >= 10, chunks
print(f"{len(chunks)} chunks")
EOF
then
  ok "a streamed chat completion through the router"
else
  bad "streamed chat completion (router log: $(tail -5 "$WORK/router.log"))"
fi
# uvloop: its loop module is mapped into the router process (or the child the bootloader runs).
procs="$router $(pgrep -P "$router" || true)"
if (for p in $procs; do grep -q 'uvloop/loop' "/proc/$p/maps" 2>/dev/null && exit 0; done; exit 1); then
  ok "the router runs on uvloop"
else
  bad "uvloop is not loaded in the router (pids $procs)"
fi
kill "$router" 2>/dev/null
wait "$router" 2>/dev/null && ok "the router stopped on SIGTERM (exit 0)" || bad "router exit status $? on SIGTERM"

wheel=$(ls "$ROOT"/dist/clusterctl-*.whl 2>/dev/null | tail -1 || true)
if [ "${SMOKE_WHEEL:-1}" = 1 ] && [ -n "$wheel" ]; then
  say "The wheel in a clean virtualenv ($(basename "$wheel"); its dependencies from the package index)"
  base=$("$PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
  if "$base" -m venv "$WORK/wheel-venv" && "$WORK/wheel-venv/bin/pip" install -q "$wheel" >"$WORK/wheel.log" 2>&1; then
    got=$(env -i PATH=/usr/bin:/bin HOME="$WORK/home" "$WORK/wheel-venv/bin/clusterctl" --version 2>&1) || true
    [ "$got" = "clusterctl $version" ] && ok "pip install of the wheel; clusterctl --version: $got" || bad "the wheel's clusterctl: $got"
  else
    bad "pip install of the wheel: $(tail -3 "$WORK/wheel.log")"
  fi
fi

say "Result: $pass passed, $fail failed"
[ "$fail" = 0 ]
