#!/usr/bin/env bash
# The GPU check of inferd's CUDA path: kernel tests, kernel benchmark, engine benchmark, one report.
#
#   bench/gpu_check.sh [REPORT]        REPORT defaults to $OUT/gpu_check.md ($OUT unset: /tmp)
#
# Runs on a plain copy of the repo: no venv, inferd not installed; python3 (or $PYTHON) needs
# torch, cupy, numpy and pytest, nothing else. Steps, each under `timeout`, and all of them inside
# one deadline (TOTAL_S) so the check ends in under 8 minutes however the steps go:
#   tests    python3 -m pytest tests/kernels but test_cpu_* (GPU kernel tests, NVRTC compile test, references) 220 s
#   cpu      python3 -m pytest tests/kernels/test_cpu_*.py (our CPU kernels, built for the host CPU:        80 s
#            decode and prefill attention, and where the host has AMX the block products on its tiles)
#   kernels  python3 bench/kernels/gpu_kernels.py --out <report dir>/gpu_kernels.md                              120 s
#   engine   python3 bench/kernels/gpu_engine.py  --out <report dir>/gpu_engine.md   (only if the file exists)   150 s
# The steps' exit codes: 0 passed; 2 from a bench script: skipped, no CUDA device; 124 or 137:
# killed at its time limit; anything else failed (pytest's 5, no tests collected, included).
# This script's exit code: 0 every step passed on a CUDA machine; 1 a step failed or timed out;
# 2 nothing failed but there is no CUDA device, so the GPU tests and benchmarks were skipped.
#
# NOTE: pytest reads pyproject.toml's [tool.pytest.ini_options] (markers, filterwarnings) as usual;
# without pytest-asyncio its asyncio_default_fixture_loop_scope key is unknown, which pytest only
# warns about (PytestConfigWarning), so that one warning category is silenced with -W.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
REPORT=${1:-${OUT:-/tmp}/gpu_check.md}
REPORT_DIR=$(dirname "$REPORT")
TOTAL_S=470  # the whole check, header included: under 8 minutes
mkdir -p "$REPORT_DIR" || exit 1
LOGS=$(mktemp -d) || exit 1
trap 'rm -rf "$LOGS"' EXIT

# header: machine and versions
{
    echo "# inferd GPU check"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    if git rev-parse --short HEAD >/dev/null 2>&1; then
        echo "- commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- 2>/dev/null || echo ' + local changes')"
    else
        echo "- commit: n/a (not a git checkout)"
    fi
    echo "- nvidia-smi -L:"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>&1 | sed 's/^/    /'
    else
        echo "    (nvidia-smi not found)"
    fi
    "$PY" - <<'EOF' 2>&1
import platform
print(f"- python {platform.python_version()} ({platform.machine()})")
try:
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}): {dev}")
except Exception as e:
    print(f"- torch: not importable ({e})")
try:
    import cupy
    print(f"- cupy {cupy.__version__}")
except Exception as e:
    print(f"- cupy: not importable ({type(e).__name__}: {e})")
try:
    import pytest
    print(f"- pytest {pytest.__version__}")
except Exception as e:
    print(f"- pytest: not importable ({e})")
EOF
    echo
} >"$REPORT"
cat "$REPORT"
HAS_CUDA=0
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && HAS_CUDA=1

SUMMARY=()
FAILED=0

# run_step NAME LIMIT_S BENCH_OUT COMMAND...: runs COMMAND under timeout, records its status and
# appends its output to the report. BENCH_OUT: the markdown file a bench script writes ("" for none);
# a bench's exit 2 means skipped for want of a CUDA device.
run_step() {
    local name=$1 limit=$2 bench_out=$3
    shift 3
    local log="$LOGS/$name.log" left=$((TOTAL_S - SECONDS - 15)) start=$SECONDS rc status
    if ((left < limit)); then limit=$left; fi
    echo
    echo "== $name: $* (time limit ${limit}s)"
    if [[ -n $bench_out ]]; then rm -f "$bench_out"; fi  # no stale report from an earlier run
    if ((limit < 10)); then  # the deadline is (nearly) spent: don't start it
        rc=-1
        echo "not started: ${left}s left of the ${TOTAL_S}s deadline" | tee "$log"
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    fi
    local took=$((SECONDS - start))
    if ((rc == 0)); then
        status="passed"
    elif [[ -n $bench_out ]] && ((rc == 2)); then
        status="skipped (no GPU)"
    elif ((rc == -1)); then
        status="failed (no time left)"
        FAILED=1
    elif ((rc == 124 || rc == 137)); then
        status="failed (timed out at ${limit}s)"
        FAILED=1
    else
        status="failed (exit $rc)"
        FAILED=1
    fi
    # pytest's last line says how many passed and were skipped
    local detail=""
    if [[ -z $bench_out ]]; then detail=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$log" | tail -n 1); fi
    SUMMARY+=("$(printf '%-8s %-32s %4ss  %s' "$name" "$status" "$took" "$detail")")
    {
        echo "## $name: $status, ${took}s"
        echo
        echo "\`$*\` (exit $rc)"
        echo
        if [[ -n $bench_out && -s $bench_out && $rc == 0 ]]; then
            cat "$bench_out"
        else
            echo '```'
            tail -n 400 "$log"
            echo '```'
        fi
        echo
    } >>"$REPORT"
}

# (our CPU kernels apart: their extension, built for the device's host CPU, once crashed pytest
# there (issue 43's run, rope_write_kv), and took the GPU tests' results with it)
run_step tests 220 "" "$PY" -m pytest -q -rs -p no:cacheprovider -W "ignore::pytest.PytestConfigWarning" \
    --durations=10 --ignore-glob='tests/kernels/test_cpu_*' tests/kernels
run_step cpu 80 "" "$PY" -m pytest -q -rs -p no:cacheprovider -W "ignore::pytest.PytestConfigWarning" \
    tests/kernels/test_cpu_attention.py tests/kernels/test_cpu_layer_ops.py tests/kernels/test_cpu_matmul.py
run_step kernels 120 "$REPORT_DIR/gpu_kernels.md" "$PY" bench/kernels/gpu_kernels.py --out "$REPORT_DIR/gpu_kernels.md"
if [[ -f bench/kernels/gpu_engine.py ]]; then
    run_step engine 150 "$REPORT_DIR/gpu_engine.md" "$PY" bench/kernels/gpu_engine.py --out "$REPORT_DIR/gpu_engine.md"
else
    SUMMARY+=("$(printf '%-8s %-32s' engine 'not run (no bench/kernels/gpu_engine.py)')")
fi

{
    echo "## Summary"
    echo
    echo '```'
    printf '%s\n' "${SUMMARY[@]}"
    echo '```'
} >>"$REPORT"
echo
echo "== summary (report: $REPORT, ${SECONDS}s)"
printf '%s\n' "${SUMMARY[@]}"
if ((FAILED)); then exit 1; fi
if ((!HAS_CUDA)); then
    echo "no CUDA device: the GPU tests and benchmarks were skipped"
    exit 2
fi
exit 0
