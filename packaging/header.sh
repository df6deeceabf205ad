#!/bin/sh
# clusterctl @VERSION@ (bundle @ID@): one file holding clusterctl, its Python and every library
# it needs (a PyInstaller onedir build, as a tar@TAREXT@ after these lines; built by `make dist`).
# The first run unpacks it once into a per-user cache folder; every later run starts the unpacked
# program directly. Where (the first usable one; a folder on a noexec mount is skipped):
#   $CLUSTERCTL_CACHE_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/clusterctl/bin,
#   else ${TMPDIR:-/tmp}/clusterctl-$(id -u), else .clusterctl-bin/ beside this file.
# Each bundle has its own subfolder (@ID@); old ones may be deleted when no clusterctl runs.
# Needs /bin/sh, tail, tar@NEEDGZ@ and glibc @GLIBC@ or newer (the highest GLIBC_ symbol version
# the bundle uses).
id=@ID@
d=${CLUSTERCTL_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/clusterctl/bin}/$id
[ -x "$d/clusterctl" ] && exec "$d/clusterctl" "$@"

# --- first run (or a cache folder that cannot be used): unpack --------------------------------
off=@OFFSET@
self=$0
[ -f "$self" ] || self=$(command -v "$self") || self=$0
say() { printf 'clusterctl: %s\n' "$*" >&2; }

host_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null) || host_glibc=
host_glibc=${host_glibc#glibc }
need=@GLIBC@
if [ -z "$host_glibc" ]; then
  say "this build needs glibc $need or newer, and this host's C library is not glibc (getconf GNU_LIBC_VERSION says nothing); run clusterctl from its wheel or source here (README, Install)"
  exit 1
fi
hmaj=${host_glibc%%.*} hmin=${host_glibc#*.}; hmin=${hmin%%.*}
nmaj=${need%%.*} nmin=${need#*.}; nmin=${nmin%%.*}
if [ "$hmaj" -lt "$nmaj" ] 2>/dev/null || { [ "$hmaj" -eq "$nmaj" ] && [ "$hmin" -lt "$nmin" ]; } 2>/dev/null; then
  say "this build needs glibc $need or newer; this host has $host_glibc. Build dist/clusterctl on a distribution with glibc $host_glibc or older (README, Install), or use the wheel"
  exit 1
fi

tried=
tmp=
trap '[ -n "$tmp" ] && rm -rf "$tmp"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

try() {  # $1: a base folder; $2=trusted: one the user named. Unpacks into $1/$id unless there
  base=$1  # already; returns 0 when $1/$id/clusterctl can run.
  [ -n "$base" ] || return 1
  if ! (umask 077 && mkdir -p -- "$base") 2>/dev/null; then tried="$tried, $base (cannot create)"; return 1; fi
  # Someone else's folder (another user's /tmp/clusterctl-UID) could hold their program.
  if [ "${2:-}" != trusted ] && [ ! -O "$base" ]; then tried="$tried, $base (not owned by this user)"; return 1; fi
  # A program can be run from here (not a noexec mount, not a read-only folder)?
  probe=$base/.probe.$$
  if ! { printf '#!/bin/sh\nexit 0\n' >"$probe" && chmod 700 "$probe"; } 2>/dev/null; then
    rm -f -- "$probe" 2>/dev/null
    [ -x "$base/$id/clusterctl" ] && return 0  # read-only, but unpacked already
    tried="$tried, $base (not writable)"; return 1
  fi
  if ! "$probe" 2>/dev/null; then rm -f -- "$probe"; tried="$tried, $base (programs cannot run there: noexec mount?)"; return 1; fi
  rm -f -- "$probe"
  [ -x "$base/$id/clusterctl" ] && return 0
  tmp=$(mktemp -d "$base/.$id.XXXXXX" 2>/dev/null) || { tried="$tried, $base (mktemp failed)"; return 1; }
  if ! tail -c +"$off" -- "$self" | @UNPACK@ -C "$tmp" 2>"$tmp/.unpack-errors"; then
    tried="$tried, $base (unpacking failed: $(head -c 300 "$tmp/.unpack-errors" 2>/dev/null | tr '\n' ' '))"
    rm -rf -- "$tmp"; tmp=; return 1
  fi
  rm -f -- "$tmp/.unpack-errors"
  # Atomic: a first run beside this one either wins the rename or finds the winner's folder.
  mv -T -- "$tmp" "$base/$id" 2>/dev/null || { [ -e "$base/$id" ] || mv -- "$tmp" "$base/$id" 2>/dev/null; }
  [ -e "$tmp" ] && rm -rf -- "$tmp"
  tmp=
  [ -x "$base/$id/clusterctl" ] || { tried="$tried, $base (unpacked, but $base/$id/clusterctl is missing)"; return 1; }
}

set -f
if [ -n "${CLUSTERCTL_CACHE_DIR:-}" ]; then
  try "$CLUSTERCTL_CACHE_DIR" trusted && { trap - EXIT INT TERM; exec "$CLUSTERCTL_CACHE_DIR/$id/clusterctl" "$@"; }
  bases=  # given: that folder or an error, never another
else
  uid=$(id -u 2>/dev/null) || uid=unknown
  case $self in */*) here=${self%/*} ;; *) here=. ;; esac
  bases=
  if [ -n "${XDG_CACHE_HOME:-}" ]; then bases="$XDG_CACHE_HOME/clusterctl/bin
"
  elif [ -n "${HOME:-}" ] && [ -d "$HOME" ]; then bases="$HOME/.cache/clusterctl/bin
"  # (never a HOME that is not there: nobody's /nonexistent)
  fi
  bases="$bases${TMPDIR:-/tmp}/clusterctl-$uid
$here/.clusterctl-bin"
fi
IFS='
'
for base in $bases; do
  if try "$base"; then
    unset IFS
    trap - EXIT INT TERM
    exec "$base/$id/clusterctl" "$@"
  fi
done
say "cannot unpack itself into a folder it can run programs from; tried: ${tried#, }. Set CLUSTERCTL_CACHE_DIR to a writable folder on a mount without noexec"
exit 1
