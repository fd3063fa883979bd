#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the peer of bench/compare.py) once, and cache it outside the repo.
#
#   bench/build_llama_server.sh [--sdist PATH] [--version V] [--jobs N]
#
# The source is the llama.cpp tree vendored in PyPI's llama-cpp-python source distribution
# (`pip download --no-binary :all: --no-deps llama-cpp-python==V`, or the sdist given by --sdist).
# The binary lands in ${INFERD_PEER_DIR:-$HOME/.cache/inferd/llama-server}/bin/llama-server and
# the last line printed is its path. A run that finds the binary already there builds nothing
# and only prints the path. About 9 minutes on 2 cores; needs cmake and a C++ compiler
# (Debian: apt-get install -y cmake g++). The build log is kept in $PEER_DIR/build.log.
#
# cmake flags: GGML_NATIVE=ON (this machine's SIMD; the binary is not portable), no libcurl,
# no web UI (LLAMA_BUILD_UI/LLAMA_USE_PREBUILT_UI off: the UI build wants the network), no
# tests or examples, Release, static ggml/llama libraries (the binary is self-contained).
# AMX: some VMs list amx_tile in /proc/cpuinfo but trap on the instructions (seen: SIGILL on
# `tilezero` in ggml's AMX matmul at model load, in a Firecracker VM). When cpuinfo lists AMX,
# a tiny probe program runs the instructions first; if it fails, the build adds
# -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 (everything else stays native).
set -euo pipefail

VERSION=0.3.36
SDIST=""
JOBS=2
while [[ $# -gt 0 ]]; do
    case "$1" in
        --sdist) SDIST="$2"; shift 2 ;;
        --version) VERSION="$2"; shift 2 ;;
        --jobs|-j) JOBS="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

PEER_DIR="${INFERD_PEER_DIR:-$HOME/.cache/inferd/llama-server}"
BIN="$PEER_DIR/bin/llama-server"
if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

for tool in cmake c++; do
    if ! command -v "$tool" >/dev/null; then
        echo "error: $tool not found (Debian: apt-get install -y cmake g++)" >&2
        exit 1
    fi
done

mkdir -p "$PEER_DIR/bin"
WORK="$PEER_DIR/src"
rm -rf "$WORK"
mkdir -p "$WORK"

if [[ -z "$SDIST" ]]; then
    PIP=(python3 -m pip)
    here="$(cd "$(dirname "$0")/.." && pwd)"
    [[ -x "$here/.venv/bin/python" ]] && PIP=("$here/.venv/bin/python" -m pip)
    echo "downloading llama-cpp-python==$VERSION (source distribution)" >&2
    "${PIP[@]}" download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$WORK" >&2
    SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz | head -n1)"
fi
[[ -f "$SDIST" ]] || { echo "error: no sdist at $SDIST" >&2; exit 1; }

echo "unpacking $SDIST" >&2
tar -xzf "$SDIST" -C "$WORK"
LLAMA="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp | head -n1)"
[[ -f "$LLAMA/CMakeLists.txt" ]] || { echo "error: no vendor/llama.cpp in $SDIST" >&2; exit 1; }

EXTRA_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo; then
    cat >"$WORK/amx_probe.c" <<'EOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18), as ggml asks too */
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;
    unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;   /* palette 1 */
    cfg[16] = 64; /* tmm0: 64 bytes per row */
    cfg[48] = 16; /* tmm0: 16 rows */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
EOF
    if cc -O1 -mamx-tile "$WORK/amx_probe.c" -o "$WORK/amx_probe" 2>/dev/null && ("$WORK/amx_probe") >/dev/null 2>&1; then
        echo "AMX: usable" >&2
    else
        EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        echo "AMX: listed in /proc/cpuinfo but not usable here: building with $EXTRA_FLAGS" >&2
    fi
fi

LOG="$PEER_DIR/build.log"
echo "building llama-server in $LLAMA/build (log: $LOG; ~9 min on 2 cores)" >&2
start=$(date +%s)
{
    cmake -S "$LLAMA" -B "$LLAMA/build" \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS"
    cmake --build "$LLAMA/build" --target llama-server -j "$JOBS"
} >"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; echo "error: build failed (log: $LOG)" >&2; exit 1; }

built="$(find "$LLAMA/build" -type f -name llama-server -perm -u+x | head -n1)"
[[ -n "$built" ]] || { echo "error: no llama-server binary after the build (log: $LOG)" >&2; exit 1; }
cp "$built" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "built in $(( $(date +%s) - start )) s" >&2
rm -rf "$WORK"  # ~300 MB of sources and objects; a rebuild unpacks afresh anyway
echo "$BIN"
