#!/usr/bin/env bash
# GPU checks of fcp's FLA interop, one script, under 8 minutes on a cold machine.
#
#   bash scripts/gpu_check.sh          # or: make gpu-check
#
# Installs nothing: uses the repo's venv ($PY, default .venv/bin/python). Steps:
#   1. every @pytest.mark.gpu test: tests/test_fla_gpu.py (the "fla" and "fla_varlen" KDA
#      backends vs the pure-PyTorch operators, fwd + bwd, bf16 and fp32; the op's initial-state
#      path; FLA-varlen conv; a reduce-overhead (CUDA graph) training step replaying new packings
#      without recompiling), tests/test_gla_gpu.py (the same for fcp.gla's "fla" backend on
#      FLA's simple_gla kernels) and the FlexAttention tests of tests/test_attention.py;
#   2. benchmarks/bench_fla_gpu.py: static mode vs FLA's varlen chunk_kda (and fcp-varlen, pure
#      PyTorch) at 8k-64k tokens, fwd + bwd times and the static/varlen ratio (target <= 1.10);
#   3. a summary: agreement lines of both steps, times, pass/fail.
#
# Time box: Triton autotuning is bounded (FCP_FLA_AUTOTUNE_MAX, tests/support/triton_tuning.py; default 1
# config per kernel for the tests, 2 for the benchmark; 0 = full autotune), compiled kernels are
# shared between steps through TRITON_CACHE_DIR, and each step has its own timeout. Logs and the
# benchmark JSON go to $OUT (when set, e.g. on the device runner) or .cache/gpu_check.
# Exit status: 0 all passed, 1 a test or the benchmark failed, 2 no CUDA device.
set -u -o pipefail
cd "$(dirname "$0")/.."

PY="${PY:-.venv/bin/python}"
LOG_DIR="${OUT:-.cache/gpu_check}"
TEST_TIMEOUT="${GPU_CHECK_TEST_TIMEOUT:-300}"
TOTAL_BUDGET="${GPU_CHECK_BUDGET:-470}"
mkdir -p "$LOG_DIR"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to check"
    exit 2
fi
"$PY" -c "import torch, triton; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__)"

echo "=== [1/2] GPU tests (timeout ${TEST_TIMEOUT}s) ==="
FCP_FLA_AUTOTUNE_MAX="${FCP_FLA_AUTOTUNE_MAX_TESTS:-1}" timeout "$TEST_TIMEOUT" \
    "$PY" -m pytest tests property_tests -m gpu -q -s -rA -p no:cacheprovider --durations=0 \
    2>&1 | tee "$LOG_DIR/tests.log"
tests_rc=${PIPESTATUS[0]}
echo "[gpu_check] tests finished with status $tests_rc after $(elapsed)s"

left=$(( TOTAL_BUDGET - $(elapsed) ))
bench_rc=124
if (( left > 30 )); then
    echo "=== [2/2] benchmark (timeout ${left}s) ==="
    FCP_FLA_AUTOTUNE_MAX="${FCP_FLA_AUTOTUNE_MAX_BENCH:-2}" timeout "$left" \
        "$PY" benchmarks/bench_fla_gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG_DIR/bench.log"
    bench_rc=${PIPESTATUS[0]}
    tail -n 1 "$LOG_DIR/bench.log" > "$LOG_DIR/bench.json" 2>/dev/null || true
else
    echo "[gpu_check] no time left for the benchmark"
fi

echo
echo "==================== gpu_check summary ($(elapsed)s) ===================="
echo "-- agreement with fcp's pure-PyTorch operators (max|x-ref|/max|ref|), from the tests:"
grep -hE "\[(fla|gla)-gpu\]" "$LOG_DIR/tests.log" || echo "   (no agreement lines: tests did not get that far)"
echo "-- tests:"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$LOG_DIR/tests.log" || true
grep -E "[0-9]+ (passed|failed)|error" "$LOG_DIR/tests.log" | tail -n 1 || true
echo "-- benchmark (fwd+bwd ms; agreement vs pure PyTorch fp32):"
if [[ -f "$LOG_DIR/bench.log" ]]; then
    grep -E "^(device|agreement|static/varlen)|^ *[0-9]+ " "$LOG_DIR/bench.log" | grep -v "^{" || true
else
    echo "   (not run)"
fi
echo "-- status: tests=$tests_rc benchmark=$bench_rc (logs in $LOG_DIR)"
if (( tests_rc != 0 || bench_rc != 0 )); then
    exit 1
fi
exit 0
