#!/usr/bin/env bash
# `make demo`: a local testbed cluster of real sshd nodes, and clusterctl run against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CTL=${CTL:-.venv/bin/clusterctl}
DIR=${DEMO_DIR:-.demo}
export CLUSTERCTL_STATE="$DIR/state.db"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
KEEP=${DEMO_KEEP:-0}  # DEMO_KEEP=1: leave the testbed running after a demo that went through
ok=0
stop_engines() {  # the replicas a DEMO_KEEP=1 run left up
  [ -f "$DIR/state.db" ] && [ -f "$DIR/testbed.json" ] || return 0
  "$CTL" down --all >/dev/null 2>&1 || true
}
cleanup() {
  [ "$KEEP" = 1 ] && [ "$ok" = 1 ] && return 0
  stop_engines
  "$PY" -m testbed down --dir "$DIR" >/dev/null 2>&1 || true
}
[ "${1:-}" = down ] && { trap - EXIT; stop_engines; "$PY" -m testbed down --dir "$DIR"; exit; }
trap cleanup EXIT

say "Starting a testbed: 6 simulated servers, each a real sshd with its own nvidia-smi/ibstat"
stop_engines  # a DEMO_KEEP=1 run's replicas (the testbed itself is replaced by `up`)
rm -rf "$DIR"
"$PY" -m testbed up --dir "$DIR" --nodes "\
h200-01=hgx-h200x8:fabric=ib-a,\
h200-02=hgx-h200x8:fabric=ib-a:ecc=3:foreign=5:4411:python3 train.py,\
h100-01=dgx-h100:fabric=ib-b,\
a100-01=a100-pcie-4x:lost=2,\
cpu-01=cpu-only:cpus=32:mem_gib=128,\
cpu-02=cpu-only:cpus=32:mem_gib=128"
echo
sed -n '1,12p' "$DIR/inventory.yaml"; echo "  ..."

say "clusterctl discover -i $DIR/inventory.yaml"
"$CTL" discover -i "$DIR/inventory.yaml"

say "clusterctl cordon a100-01 --reason 'GPU 2 fell off the bus'"
"$CTL" cordon a100-01 -i "$DIR/inventory.yaml" --reason "GPU 2 fell off the bus"

say "clusterctl discover again: the cordon survives re-discovery"
"$CTL" discover -i "$DIR/inventory.yaml" -o json | "$PY" -c '
import json, sys
for n in json.load(sys.stdin)["nodes"]:
    free = sum(g["free"] for g in n["gpus"])
    print("  %-8s reachable=%s cordoned=%s (%s) free GPUs %d/%d" % (
        n["name"], n["reachable"], n["cordoned"], n["cordon_reason"] or "-", free, len(n["gpus"])))'

say "clusterctl place --dry-run -i $DIR/inventory.yaml -c examples/catalog.yaml"
set +e
"$CTL" place --dry-run -i "$DIR/inventory.yaml" -c examples/catalog.yaml
rc=$?
set -e
echo "(exit code $rc: 0 all placed, 3 some replica unplaced, with the reasons above)"
[ "$rc" = 0 ] || [ "$rc" = 3 ]

say "A node dies: discover reports it and keeps going"
"$PY" -m testbed kill --dir "$DIR" h100-01 >/dev/null
set +e
"$CTL" discover -i "$DIR/inventory.yaml" --timeout 5
rc=$?
set -e
[ "$rc" -lt 128 ] || exit "$rc"  # Ctrl-C (clusterctl exits 130): the demo stops here too
[ "$rc" = 1 ] || { echo "expected exit code 1 (a node did not answer), got $rc" >&2; exit 1; }
echo "(exit code $rc: 1 = some node did not answer; the others' facts are saved)"

if [ "${DEMO_ROUTER:-1}" = 1 ]; then
  say "clusterctl up: real llama-server replicas of a tiny model, behind clusterctl serve-router"
  "$PY" -m testbed revive --dir "$DIR" h100-01 >/dev/null
  if [ -z "${LLAMA_SERVER:-}" ]; then
    LLAMA_SERVER="$(PYTHON="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" bash scripts/install-llama-server.sh)"  # a failed install stops the demo
  fi
  # DEMO_KEEP=1: the two replicas stay up for the tour's router step (make demo-down stops them).
  LLAMA_SERVER="$LLAMA_SERVER" "$PY" scripts/demo_router.py --dir "$DIR" $([ "$KEEP" = 1 ] && echo --keep)
  say "clusterctl events -n 12: what happened, and which command did it"
  "$CTL" events -n 12
fi

ok=1
if [ "$KEEP" = 1 ]; then
  "$PY" -m testbed revive --dir "$DIR" h100-01 >/dev/null 2>&1 || true
  say "Done. The testbed keeps running (h100-01 revived); state is in $DIR/state.db"
  echo "Try:   . .venv/bin/activate && export CLUSTERCTL_STATE=$DIR/state.db"
  echo "       clusterctl discover -i $DIR/inventory.yaml"
  echo "       clusterctl status; clusterctl serve-router --config $DIR/router.yaml --port 8000"
  echo "Stop:  make demo-down"
else
  say "Done. The testbed is stopped on exit (DEMO_KEEP=1 keeps it); state is in $DIR/state.db"
fi
