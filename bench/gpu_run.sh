#!/usr/bin/env bash
# The one script to run on the GPU machine, from the repository root:
#
#     bash bench/gpu_run.sh [STEP ...]        (default steps: info tests bench)
#
# Steps, run in the order given; each runs under `timeout`, its output goes to stdout and to $OUT/gpu_run.log,
# a failing step does not stop the next, and a summary of exit codes ends the run:
#   info      nvidia-smi, Python/torch/triton/CUDA versions, GPU properties, Liger-Kernel, compute-sanitizer
#   tests     python3 -m pytest -m gpu tests          (the GPU tests; pytest-xdist workers when installed)
#   alltests  python3 -m pytest tests                 (the whole suite, on the CUDA machine)
#   sanitize  compute-sanitizer --tool memcheck over a small representative subset of the GPU tests
#             (SAFEOPS_GPU_SMALL=1 shrinks their shapes; SANITIZE_K picks the tests)
#   sanitize2 the same for the attention and fp8 cast+transpose GPU tests (SANITIZE2_ARGS adds -k etc.)
#   gluon     memcheck, racecheck and synccheck over small Gluon-kernel GPU tests (GLUON_SAN_K picks them)
#   fused     the fused Gluon backward (off by default): its GPU tests (a deadlock shows as the step's timeout,
#             T_FUSED), then bench/attention.py's backward with it beside the default and cuDNN
#   bwdconfigs the attention backward's switched-off configurations: their GPU bit tests, then
#             bench/attention_bwd_configs.py --compile-first (BWDCONFIGS_ARGS, e.g. "--variants row_stats")
#   switched  the switched-off Gluon build (packed / window backward, GLUON_BWD_SEQ): GPU tests, memcheck on a
#             packed backward, timings (SWITCHED_ARGS for bench/attention_bwd_configs.py)
#   bench     python3 bench/softmax.py --out $OUT     (softmax.csv, softmax.md, softmax.png)
#   compile   python3 bench/compile.py                (a transformer block compiled stock vs safeops.register())
#   attention python3 bench/attention.py --out $OUT   (attention.{csv,md,png}; ATTENTION_ARGS, e.g. --quick)
#   cast      python3 bench/cast_transpose.py --out $OUT   (cast_transpose.{csv,md,png}; CAST_ARGS)
#   model     python3 bench/model.py                  (a ~1B Llama training step, sdpa vs safeops; MODEL_ARGS;
#             needs transformers: carry its wheels in .whl)
#   profile   Nsight Compute over one measured call per case of bench/profiling.py (PROFILE_CASES, default the
#             attention forward D64 / D128 and backward D128 (default and fused), cuDNN's forward / backward at D128
#             through SDPA (the same shapes: the yardstick of the gap), the 32K softmax backward, the 32K
#             cross-entropy forward, the rowwise fp8 cast), sections SpeedOfLight, ComputeWorkloadAnalysis
#             (pipe use: tensor, XU / MUFU, FMA), InstructionStats, WarpStateStats (stall reasons),
#             Occupancy, MemoryWorkloadAnalysis; then bench/profiling.py cast-compiled (torch.profiler: the
#             registered compiled fp8 path against stock Inductor, per call)
#
# The whole run stays inside BUDGET_S seconds (default 530, under the device's 10-minute command limit): a
# step gets at most its own timeout and what is left of the budget; the benchmark stops starting new shapes
# before its timeout and still writes what it measured. The full benchmark (32 shapes x 5 implementations,
# one torch.compile per shape) needs most of a call: run `bash bench/gpu_run.sh bench` on its own, or pass
# BENCH_ARGS=--quick. Outputs under $OUT stay few: gpu_run.log, the JUnit XML of the test steps and each
# benchmark's files.
#
# Environment: OUT (default bench/out), BUDGET_S, T_INFO, T_TESTS, T_ALLTESTS, T_SANITIZE, T_BENCH, ...
# (per-step timeouts, s), PYTEST_WORKERS (xdist workers for tests/alltests, default 4; 0 = none), MAXFAIL
# (default 30), PYTEST_ARGS, SANITIZE_K, BENCH_ARGS (e.g. "--quick", "--dtype bf16 --n 64K,1M"),
# ATTENTION_ARGS, CAST_ARGS, MODEL_ARGS, COMPILE_ARGS. Carry the wheels (Liger-Kernel) by naming .whl in the call's carry.
# .whl/ is git-ignored; fetch it on the development machine (the GPU machine has no network) with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform any -d .whl liger-kernel==0.8.5
# and, for the Hugging Face tests and bench/model.py, transformers with its dependencies (then delete the numpy
# wheel from .whl: the GPU machine's own numpy must stay):
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform any -d .whl transformers==5.24.0
# and pytest-xdist (the GPU suite is compile-bound: one process does not finish inside a 10-minute call, four
# workers do; the 2-GPU tests need the nvidia-h200-x2 kind):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform any -d .whl pytest-xdist execnet

set -o pipefail
cd "$(dirname "$0")/.." || exit 2

START=$(date +%s)
BUDGET_S=${BUDGET_S:-530}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(info tests bench)

log() { echo "$*" | tee -a "$LOG"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tee -a "$LOG"; then
        export PYTHONPATH=/tmp/site:$PYTHONPATH
        log "installed carried wheels: $(cd .whl && echo *.whl)"
    else
        log "installing the carried wheels failed; continuing without them"
    fi
fi

SUMMARY=()
FAILED=0

# limit_for DEFAULT: the step's timeout, cut to what is left of the whole run's budget.
limit_for() {
    local want=$1 left
    left=$((BUDGET_S - ($(date +%s) - START) - 10))
    ((want > left)) && want=$left
    echo "$want"
}

# step NAME LIMIT COMMAND...
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    if ((limit < 20)); then
        log "=== $name: skipped, the run's ${BUDGET_S}s budget is used up"
        SUMMARY+=("$name: skipped (budget)")
        return
    fi
    log ""
    log "=== $name (timeout ${limit}s): $*"
    t0=$(date +%s)
    timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=$?
    local note=""
    ((rc == 124 || rc == 137)) && note=" TIMEOUT"
    ((rc != 0)) && FAILED=1
    SUMMARY+=("$name: exit $rc$note ($(($(date +%s) - t0)) s)")
}

info() {
    nvidia-smi || true
    python3 - <<'EOF'
import platform
import torch
import triton
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.get_device_name(0)}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.0f} GiB, L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MB")
else:
    print("torch.cuda.is_available() is False")
for name in ("liger_kernel", "xdist", "pytest_timeout", "matplotlib", "hypothesis"):
    try:
        module = __import__(name)
        print(f"{name}: {getattr(module, '__version__', 'importable')} ({getattr(module, '__file__', '')})")
    except Exception as e:
        print(f"{name}: not importable ({type(e).__name__}: {e})")
try:
    from liger_kernel.ops.softmax import LigerSoftmaxFunction  # noqa: F401
    print("liger_kernel.ops.softmax.LigerSoftmaxFunction: importable")
except Exception as e:
    print(f"liger_kernel.ops.softmax: not importable ({type(e).__name__}: {e})")
EOF
    compute-sanitizer --version 2>/dev/null | tail -1 || echo "compute-sanitizer: not found"
}

pytest_opts() {  # options shared by the test steps; $1 names the JUnit XML (failure messages survive a timeout)
    local opts=(-q -rfEs -p no:cacheprovider "--maxfail=${MAXFAIL:-30}" "--junitxml=$OUT/junit_$1.xml")
    local workers=${PYTEST_WORKERS:-4}
    if [ "$workers" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
        opts+=(-n "$workers")
    fi
    if python3 -c "import pytest_timeout" 2>/dev/null; then
        opts+=(--timeout=300)
    fi
    echo "${opts[@]}"
}

DEFAULT_SANITIZE_K="matches_oracle or seed_scalar or empty_nan_inf or loop_backward or \
(layouts_match_oracle and (dim0 or mask_broadcast or many_batch_dims or expanded_x))"

for s in "${STEPS[@]}"; do
    case "$s" in
    info)
        export -f info
        step info "$(limit_for "${T_INFO:-60}")" bash -c info
        ;;
    tests)
        # shellcheck disable=SC2046
        step tests "$(limit_for "${T_TESTS:-300}")" python3 -m pytest -m gpu tests $(pytest_opts tests) ${PYTEST_ARGS:-}
        ;;
    alltests)
        # shellcheck disable=SC2046
        step alltests "$(limit_for "${T_ALLTESTS:-400}")" python3 -m pytest tests $(pytest_opts alltests) ${PYTEST_ARGS:-}
        ;;
    sanitize)
        step sanitize "$(limit_for "${T_SANITIZE:-420}")" env SAFEOPS_GPU_SMALL=1 \
            compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
            python3 -m pytest tests/test_softmax_gpu.py -q -rfEs -p no:cacheprovider --maxfail=10 \
            -k "${SANITIZE_K:-$DEFAULT_SANITIZE_K}"
        ;;
    sanitize2)
        # shellcheck disable=SC2086
        step sanitize2 "$(limit_for "${T_SANITIZE2:-420}")" env SAFEOPS_GPU_SMALL=1 \
            compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
            python3 -m pytest tests/test_attention_gpu.py tests/test_cast_transpose_gpu.py -q -rfEs \
            -p no:cacheprovider --maxfail=10 ${SANITIZE2_ARGS:-}
        ;;
    gluon)
        # The Gluon kernels (forward, the backward's dK / dV and dQ, sinks) under memcheck, racecheck and
        # synccheck, on the small cases of their GPU tests (racecheck: compare any hazard with the baseline
        # in shared/gluon/README.md, between the prologue and the warp_specialize entry).
        for tool in memcheck racecheck synccheck; do
            step "gluon-$tool" "$(limit_for "${T_GLUON_SAN:-200}")" compute-sanitizer --tool "$tool" \
                --error-exitcode 99 --print-limit 10 python3 -m pytest -q -rfEs -p no:cacheprovider \
                tests/test_attention_gluon_bwd_gpu.py tests/test_attention_gluon_gpu.py \
                -k "${GLUON_SAN_K:-keys_no_query_sees or test_sinks and causal-128-bf16 or test_sinks and not oracle and not varlen or test_exact_rows and causal-128}"
        done
        ;;
    fused)
        # shellcheck disable=SC2046
        step fused-tests "$(limit_for "${T_FUSED:-200}")" python3 -m pytest -m gpu $(pytest_opts fused) \
            tests/test_attention_gluon_bwd_gpu.py -k fused
        lim=$(limit_for "${T_ATTENTION:-300}")
        step fused-bench "$lim" python3 bench/attention.py --out "$OUT" --budget-s $((lim > 90 ? lim - 45 : 30)) \
            --quick --directions bwd --impl "safeops,safeops gluon fused,safeops triton dq,sdpa cudnn"
        ;;
    bwdconfigs)
        # shellcheck disable=SC2046
        step bwdconfigs-tests "$(limit_for "${T_BWDCONFIGS_TESTS:-150}")" python3 -m pytest -m gpu \
            $(pytest_opts bwdconfigs) tests/test_attention_row_stats.py tests/test_attention_gluon_bwd_gpu.py \
            -k "row_stats or operand_orders or seq_"
        # shellcheck disable=SC2086
        step bwdconfigs "$(limit_for "${T_BWDCONFIGS:-300}")" python3 bench/attention_bwd_configs.py \
            --compile-first ${BWDCONFIGS_ARGS:-}
        ;;
    switched)
        # The switched-off Gluon build waiting for a GPU (GLUON_BWD_SEQ: packed sequences and windows in the
        # backward): its GPU tests, memcheck on a packed backward, then its timings (bwdconfigs' bench with
        # SWITCHED_ARGS) and the softcap forward's.
        # shellcheck disable=SC2046
        step switched-tests "$(limit_for "${T_SWITCHED_TESTS:-240}")" python3 -m pytest -m gpu \
            $(pytest_opts switched) tests/test_attention_gluon_bwd_gpu.py -k "seq_"
        step switched-memcheck "$(limit_for "${T_SWITCHED_SAN:-120}")" compute-sanitizer --tool memcheck \
            --error-exitcode 99 --print-limit 10 python3 -m pytest -q -rfEs -p no:cacheprovider \
            tests/test_attention_gluon_bwd_gpu.py -k "seq_packed_equals_dense_values and causal_window-128"
        # shellcheck disable=SC2086
        step switched-bwd "$(limit_for "${T_SWITCHED_BWD:-200}")" python3 bench/attention_bwd_configs.py \
            ${SWITCHED_ARGS:---variants gluon_seq --rep-ms 100 --shapes docs16k-d128-causal,b4s4k-d128-causal-w1k,b4s4k-d128,b4s4k-d128-causal,docs16k-d64-causal,b4s4k-d64-w1k}
        step switched-softcap "$(limit_for "${T_SWITCHED_SOFTCAP:-150}")" python3 bench/attention.py --quick \
            --softcap 50 --directions fwd --d 128,256 --impl "safeops,safeops gluon softcap" \
            --out "$OUT/softcap" --budget-s 120
        ;;
    bench)
        lim=$(limit_for "${T_BENCH:-520}")
        # shellcheck disable=SC2086
        step bench "$lim" python3 bench/softmax.py --out "$OUT" --budget-s $((lim > 90 ? lim - 60 : 30)) \
            ${BENCH_ARGS:-}
        ;;
    compile)
        step compile "$(limit_for "${T_COMPILE:-300}")" python3 bench/compile.py --out "$OUT/compile.md" \
            ${COMPILE_ARGS:-}
        ;;
    attention)
        lim=$(limit_for "${T_ATTENTION:-420}")
        # shellcheck disable=SC2086
        step attention "$lim" python3 bench/attention.py --out "$OUT" --budget-s $((lim > 90 ? lim - 45 : 30)) \
            ${ATTENTION_ARGS:-}
        ;;
    cast)
        lim=$(limit_for "${T_CAST:-240}")
        # shellcheck disable=SC2086
        step cast "$lim" python3 bench/cast_transpose.py --out "$OUT" --budget-s $((lim > 60 ? lim - 30 : 20)) \
            ${CAST_ARGS:-}
        ;;
    model)
        # shellcheck disable=SC2086
        step model "$(limit_for "${T_MODEL:-240}")" python3 bench/model.py --out "$OUT/model.md" ${MODEL_ARGS:-}
        ;;
    profile)
        NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        for c in ${PROFILE_CASES:-attn-fwd-d64 attn-fwd-d128 cudnn-fwd-d128 attn-bwd-d128 cudnn-bwd-d128 \
                 attn-bwd-d128-fused softmax-bwd-32k \
                 xent-fwd-32k cast-rowwise-4k}; do
            if [ -z "$NCU" ]; then
                log "=== profile-$c: skipped, ncu not found"
                SUMMARY+=("profile-$c: no ncu")
                continue
            fi
            step "profile-$c" "$(limit_for "${T_PROFILE:-150}")" "$NCU" --profile-from-start off \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
                --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
                python3 bench/profiling.py "$c"
        done
        step profile-cast-compiled "$(limit_for "${T_PROFILE:-150}")" python3 bench/profiling.py cast-compiled
        ;;
    *)
        log "unknown step '$s' (steps: info tests alltests sanitize sanitize2 gluon fused bench compile attention cast model profile)"
        SUMMARY+=("$s: unknown step")
        FAILED=1
        ;;
    esac
done

log ""
log "=== summary ($(($(date +%s) - START)) s of ${BUDGET_S} s budget; outputs in $OUT)"
for line in "${SUMMARY[@]}"; do
    log "  $line"
done
exit $FAILED
