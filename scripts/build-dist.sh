#!/usr/bin/env bash
# `make dist`: build dist/clusterctl, one executable file that runs on a Linux machine with no
# Python set up, and the wheel and sdist beside it.
#
# dist/clusterctl is a PyInstaller onedir build (the interpreter, clusterctl and every library
# it imports) packed as a tar.gz behind a small /bin/sh header (packaging/header.sh). Its first
# run unpacks the folder once into a per-user cache (${XDG_CACHE_HOME:-~/.cache}/clusterctl/bin/
# <bundle id>, atomically); later runs exec the unpacked program at once, so they start as fast
# as the onedir build, unlike PyInstaller's --onefile, which unpacks itself on every run.
#
#   bash scripts/build-dist.sh                          the binary, the wheel and the sdist
#   bash scripts/build-dist.sh pack DIR OUT VERSION [GLIBC]
#        only pack a onedir folder DIR (holding an executable DIR/clusterctl) into OUT (the tests)
#
# Knobs (environment):
#   PY                   the Python that builds (default .venv/bin/python; needs the `dist` extra)
#   DIST_COMPRESS        payload: gz (default), none (larger file, a faster first run), xz
#   DIST_STRIP=0         keep the symbols of the bundle's shared libraries (the default strips them:
#                        37 -> 23 MB; pyenv's libpython alone carries 20 MB of them)
#   DIST_ONEFILE=1       also build PyInstaller's own --onefile into build/dist/onefile/ (for
#                        bench/startup.py --extra onefile=build/dist/onefile/clusterctl)
#   DIST_SKIP_PACKAGES=1 skip the wheel and sdist
#
# Prints a summary (also in build/dist/summary.txt): sizes, build time, and the highest GLIBC_
# symbol version the bundle needs (the oldest glibc it runs on).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
COMPRESS=${DIST_COMPRESS:-gz}
OUT=dist
WORK=build/dist
say() { printf '== %s\n' "$*" >&2; }
die() { printf 'build-dist: %s\n' "$*" >&2; exit 1; }

pack() {  # $1: onedir folder, $2: output file, $3: version, $4: glibc needed
  local dir=$1 out=$2 version=$3 glibc=$4 ext needgz unpack payload id off n
  [ -x "$dir/clusterctl" ] || die "$dir/clusterctl: not an executable file"
  case $COMPRESS in
    gz) ext=.gz needgz=" (with gzip)" unpack="tar -xzf -" ;;
    xz) ext=.xz needgz=" (with xz)" unpack="tar -xJf -" ;;
    none) ext= needgz= unpack="tar -xf -" ;;
    *) die "DIST_COMPRESS=$COMPRESS: gz, xz or none" ;;
  esac
  payload=$(mktemp "$out.payload.XXXXXX")
  # Reproducible: sorted names, fixed times and owners, no gzip timestamp: the same build, the same id.
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu -C "$dir" -cf - . |
    case $COMPRESS in gz) gzip -n -6 ;; xz) xz -T0 -6 ;; none) cat ;; esac >"$payload"
  id="$version-$(sha256sum "$payload" | cut -c1-16)"
  # The header states the payload's byte offset: find the fixed point of its own length.
  off=0
  while :; do
    sed -e "s/@VERSION@/$version/g" -e "s/@ID@/$id/g" -e "s/@GLIBC@/$glibc/g" -e "s/@OFFSET@/$off/g" \
      -e "s/@TAREXT@/$ext/g" -e "s/@NEEDGZ@/$needgz/g" -e "s/@UNPACK@/$unpack/g" packaging/header.sh >"$out.header"
    n=$(($(wc -c <"$out.header") + 1))
    [ "$n" = "$off" ] && break
    off=$n
  done
  if grep -q '@[A-Z]*@' "$out.header"; then rm -f "$payload" "$out.header"; die "a placeholder is left in the header"; fi
  cat "$out.header" "$payload" >"$out.tmp"
  rm -f "$payload" "$out.header"
  chmod 755 "$out.tmp"
  mv -f "$out.tmp" "$out"
  echo "$id"
}

if [ "${1:-}" = pack ]; then
  [ $# -ge 4 ] || die "usage: build-dist.sh pack DIR OUT VERSION [GLIBC]"
  pack "$2" "$3" "$4" "${5:-2.17}" >/dev/null
  exit 0
fi

t0=$(date +%s.%N)
"$PY" -c 'import PyInstaller' 2>/dev/null || die "PyInstaller is not installed in $PY: pip install -e '.[dist]' (make dist does)"
version=$("$PY" -c 'import cluster_cli; print(cluster_cli.__version__)')
rm -rf "$WORK/onedir" "$OUT/clusterctl"
mkdir -p "$WORK" "$OUT"

pyi() {  # $1: onedir or onefile, $2: dist folder
  CLUSTERCTL_PYI_MODE=$1 CLUSTERCTL_PYI_STRIP=${DIST_STRIP:-1} "$PY" -m PyInstaller --noconfirm --clean \
    --log-level WARN --distpath "$2" --workpath "$WORK/work-$1" packaging/clusterctl.spec
}

say "PyInstaller onedir build ($("$PY" -m PyInstaller --version), Python $("$PY" -c 'import platform; print(platform.python_version())'))"
pyi onedir "$WORK/onedir"
bundle=$WORK/onedir/clusterctl
got=$(env -i PATH=/usr/bin:/bin "$bundle/clusterctl" --version) || true
[ "$got" = "clusterctl $version" ] || die "the bundle says '$got', not 'clusterctl $version'"

# The newest glibc symbol version any ELF file of the bundle asks for: the oldest host it runs on.
glibc=$({ find "$bundle" -type f -exec objdump -T {} + 2>/dev/null || true; } | grep -o 'GLIBC_[0-9][0-9.]*' |
  sed 's/GLIBC_//' | sort -u -V | tail -1)
[ -n "$glibc" ] || die "found no GLIBC_ symbol versions in the bundle (is objdump, binutils, installed?)"
needs=$(find "$bundle" -type f -print0 | while IFS= read -r -d '' f; do
  case $(objdump -T "$f" 2>/dev/null || true) in *"(GLIBC_$glibc)"*) printf '%s ' "${f#"$bundle"/}" ;; esac
done)

say "Packing the bundle ($COMPRESS) behind packaging/header.sh"
id=$(pack "$bundle" "$OUT/clusterctl" "$version" "$glibc")
check=$(mktemp -d)  # it runs from a fresh cache, with an empty environment
got=$(env -i PATH=/usr/bin:/bin HOME="$check" "$OUT/clusterctl" --version) || true
rm -rf "$check"
[ "$got" = "clusterctl $version" ] || die "dist/clusterctl says '$got'"
t_bin=$(date +%s.%N)

if [ "${DIST_ONEFILE:-0}" = 1 ]; then
  say "PyInstaller --onefile build (for comparison): $WORK/onefile/clusterctl"
  pyi onefile "$WORK/onefile"
fi

if [ "${DIST_SKIP_PACKAGES:-0}" != 1 ]; then
  say "Wheel and sdist (python -m build)"
  rm -f "$OUT"/clusterctl-*.whl "$OUT"/clusterctl-*.tar.gz
  "$PY" -m build --outdir "$OUT" . >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log" >&2; die "python -m build failed"; }
fi
t1=$(date +%s.%N)

mb() { du -sb "$1" | cut -f1 | awk '{printf "%.1f MB", $1 / 1e6}'; }
{
  echo "dist/clusterctl   $(mb "$OUT/clusterctl") (bundle $id; unpacked $(mb "$bundle"))"
  for f in "$OUT"/clusterctl-*.whl "$OUT"/clusterctl-*.tar.gz; do [ -e "$f" ] && echo "$f   $(mb "$f")"; done
  [ "${DIST_ONEFILE:-0}" = 1 ] && echo "$WORK/onefile/clusterctl   $(mb "$WORK/onefile/clusterctl")"
  echo "needs glibc $glibc or newer (GLIBC_$glibc is used by: ${needs% })"
  awk -v a="$t0" -v b="$t_bin" -v c="$t1" 'BEGIN { printf "build time %.0f s (the binary: %.0f s)\n", c - a, b - a }'
} | tee "$WORK/summary.txt"
