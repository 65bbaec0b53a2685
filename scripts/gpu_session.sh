#!/usr/bin/env bash
# The one prepared script a GPU session runs with the device tool (issue 5): CUDA conformance,
# then the benchmark, then the end-to-end step time, every result written under $OUT.
#
#   device run:  bash scripts/gpu_session.sh            (timeout_s 600; ~9.3 min worst case)
#   here, first: OUT=/tmp/gpu-smoke bash scripts/gpu_session.sh --cpu-smoke
#
# Runs in the repository root (the device tool's copy of the working tree). Every step has its
# own `timeout` and is non-fatal: its exit code and time go to summary.md and the run goes on.
# CuPy missing, or no CuPy backend / kernel module yet, is logged as such, never a failure of
# the script. The device returns at most 8 files from $OUT, so exactly these are written:
#   summary.md    one line per step (exit code, seconds), then the bench and e2e tables
#   session.log   everything every step printed
#   bench.json bench.md bench.png    gpu/bench.py (JSON rewritten after every case)
#   e2e.json e2e.md                  gpu/bench.py --e2e
#   all.tar.gz    the work folder: per-step logs, junit XML, partial outputs
# Exit code: 0 when every step passed, 1 otherwise (the files come back either way).
#
# Knobs (environment): PYTHON (default python3: on the device it is the one with torch),
# BENCH_ARGS (extra gpu.bench arguments), CUPY_BACKEND (the --backend spec of the CuPy port for
# raggedspec.conformance.runner; default "cupy"), T_PORT, T_KERN, T_RUNNER, T_CUPY, T_BENCH, BENCH_BUDGET,
# T_E2E (seconds).
set -uo pipefail

MODE=gpu
[[ "${1:-}" == "--cpu-smoke" ]] && MODE=cpu-smoke
: "${OUT:?set OUT to the output folder}"
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
WORK=$(mktemp -d /tmp/gpu-session.XXXXXX)
mkdir -p "$OUT"
LOG="$OUT/session.log"
SUMMARY="$WORK/steps.md"
: >"$LOG"
: >"$SUMMARY"
FAILED=0
T0=$(date +%s)

if [[ $MODE == gpu ]]; then
    DEV=cuda
    # worst case (every step at its limit) ~9.3 min: env 20 + port 60 + kernels 75 + bench 130
    # + replot 30 + runner 60 + cupy 75 + e2e 60 + e2e_cupy 60; a typical run is shorter. The
    # summary is rewritten after every step, so the device tool's 600 s limit loses nothing
    # that finished.
    T_PORT=${T_PORT:-60} T_KERN=${T_KERN:-75} T_RUNNER=${T_RUNNER:-60} T_CUPY=${T_CUPY:-75}
    T_BENCH=${T_BENCH:-130} BENCH_BUDGET=${BENCH_BUDGET:-90} T_E2E=${T_E2E:-60}
    BENCH_MODE=()
    E2E_MODE=(--device cuda)
else
    DEV=cpu
    T_PORT=${T_PORT:-240} T_KERN=${T_KERN:-120} T_RUNNER=${T_RUNNER:-240} T_CUPY=${T_CUPY:-60}
    T_BENCH=${T_BENCH:-120} BENCH_BUDGET=${BENCH_BUDGET:-100} T_E2E=${T_E2E:-60}
    BENCH_MODE=(--smoke)
    E2E_MODE=(--smoke)
fi

log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# collect: copy what exists to $OUT and rewrite summary.md. Called after every step, so a run
# killed from outside (the device tool's limit) still returns everything that finished.
collect() {
    local f
    for f in bench/bench.json bench/bench.md bench/bench.png e2e/e2e.json e2e/e2e.md; do
        [[ -f $WORK/$f ]] && cp "$WORK/$f" "$OUT/"
    done
    {
        echo "# GPU session summary ($MODE, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - T0)) s)"
        echo
        echo "| step | exit | seconds | command |"
        echo "|---|---|---|---|"
        cat "$SUMMARY"
        echo
        for f in port_conformance kernels runner_torch runner_cupy; do
            [[ -f $WORK/$f.log ]] && { echo "## $f (tail)"; echo '```'; tail -n 25 "$WORK/$f.log"; echo '```'; }
        done
        [[ -f $WORK/bench/bench.md ]] && { echo "## bench"; echo; cat "$WORK/bench/bench.md"; }
        [[ -f $WORK/e2e/e2e.md ]] && { echo "## e2e"; echo; cat "$WORK/e2e/e2e.md"; }
        [[ -f $WORK/e2e_cupy/e2e.md ]] && { echo "## e2e, cupy backend"; echo; cat "$WORK/e2e_cupy/e2e.md"; }
    } >"$OUT/summary.md"
    return 0
}

# step NAME SECONDS CMD...: run with a timeout, log everything, record rc and time; never fatal.
step() {
    local name=$1 limit=$2
    shift 2
    log "=== $name (timeout ${limit}s): $*"
    local t=$(date +%s) rc
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    cat "$WORK/$name.log" >>"$LOG"
    local dt=$(($(date +%s) - t)) note=""
    [[ $rc == 124 || $rc == 137 ]] && note=" TIMED OUT"
    log "=== $name: exit $rc after ${dt}s$note"
    echo "| $name | $rc$note | $dt | \`$*\` |" >>"$SUMMARY"
    collect
    return $rc
}

note() { log "NOTE: $*"; echo "| note | - | - | $* |" >>"$SUMMARY"; }

# ------------------------------------------------------------------ 0. the machine
cat >"$WORK/env.py" <<'EOF'
import importlib, platform
print('python', platform.python_version())
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('gpu', p.name, 'sm', p.multi_processor_count, 'mem GiB', round(p.total_memory / 2**30, 1))
for name in ('cupy', 'numpy', 'hypothesis', 'pytest', 'matplotlib', 'triton'):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, '__version__', '?'))
    except Exception as exc:
        print(name, 'NOT importable:', type(exc).__name__, exc)
try:
    import cupy
    print('cupy CUDA available:', cupy.cuda.is_available())
except Exception as exc:
    print('cupy unavailable:', type(exc).__name__, exc)
EOF
cat >"$WORK/env.sh" <<EOF
echo mode=$MODE device=$DEV; date -u; uname -a; nproc
command -v nvidia-smi >/dev/null && nvidia-smi || echo 'no nvidia-smi'
$PY "$WORK/env.py"
EOF
step env 20 bash "$WORK/env.sh" || FAILED=1

CUPY_OK=0
$PY -c "import cupy, sys; sys.exit(0 if cupy.cuda.is_available() else 1)" >/dev/null 2>&1 && CUPY_OK=1
[[ $CUPY_OK == 1 ]] || note "CuPy absent or without CUDA here: the CuPy conformance is not run (the kernel tests and the bench's cupy slot use the g++ emulator where g++ is)"

# ------------------------------------------------------------------ 1. the port's conformance on the device
PORT_TESTS=(conformance/test_port_*.py)
step port_conformance "$T_PORT" env RAGGEDSPEC_DEVICE=$DEV $PY -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$WORK/port_conformance.xml" "${PORT_TESTS[@]}" || FAILED=1

# ------------------------------------------------------------------ 1b. the hand-written kernels
# conformance/test_cupy_kernels.py: the CuPy runner on the GPU (and the g++ emulator where g++ is)
step kernels "$T_KERN" $PY -m pytest -q -p no:cacheprovider -rfEs --junitxml="$WORK/kernels.xml" \
    conformance/test_cupy_kernels.py || FAILED=1

# ------------------------------------------------------------------ 2. the benchmark
# JSON is rewritten after every case and the headline case runs first, so a timeout keeps it;
# the replot makes bench.md / bench.png from whatever JSON there is.
# shellcheck disable=SC2086
step bench "$T_BENCH" $PY -m gpu.bench "${BENCH_MODE[@]}" --device $DEV --budget-s "$BENCH_BUDGET" \
    --out "$WORK/bench" ${BENCH_ARGS:-} || FAILED=1
if [[ -f $WORK/bench/bench.json ]]; then
    step bench_replot 30 $PY -m gpu.bench --replot "$WORK/bench/bench.json" -q || FAILED=1
else
    note "the bench wrote no bench.json"
    FAILED=1
fi

# ------------------------------------------------------------------ 3. raggedspec.conformance.runner (backend protocol)
if [[ -f conformance/runner.py ]]; then
    mapfile -t BACKEND_TESTS < <(grep -l "conformance.backends\|RAGGEDSPEC_BACKEND" conformance/test_*.py 2>/dev/null)
    if ((${#BACKEND_TESTS[@]})); then
        step runner_torch "$T_RUNNER" $PY -m raggedspec.conformance.runner --backend torch --device $DEV \
            --tests "${BACKEND_TESTS[@]}" || FAILED=1
        if [[ $CUPY_OK == 1 || $MODE == cpu-smoke ]]; then
            # exit 2 = the runner does not know the backend (no CuPy port yet) or CuPy cannot use
            # the device: logged, not a failure of this script
            step runner_cupy "$T_CUPY" $PY -m raggedspec.conformance.runner --backend "${CUPY_BACKEND:-cupy}" --device $DEV \
                --tests "${BACKEND_TESTS[@]}"
            rc=$?
            if [[ $rc == 2 ]]; then
                note "raggedspec.conformance.runner --backend ${CUPY_BACKEND:-cupy}: not run (exit 2: the backend cannot load or cannot use $DEV; see runner_cupy.log)"
            elif [[ $rc != 0 ]]; then
                FAILED=1
            fi
        else
            note "raggedspec.conformance.runner --backend cupy: not run (CuPy absent or without CUDA)"
        fi
    else
        note "conformance/runner.py present but no backend-parametrized test file found"
    fi
else
    note "no conformance/runner.py: the backend-protocol conformance is not run"
fi

# ------------------------------------------------------------------ 4. end-to-end step time
if [[ -f reference/backend.py && -f gpu/backend.py ]]; then
    step e2e "$T_E2E" $PY -m gpu.bench --e2e "${E2E_MODE[@]}" --out "$WORK/e2e" -q || FAILED=1
    # cut short: e2e.json holds the runs that finished; make e2e.md from it
    if [[ -f $WORK/e2e/e2e.json && ! -f $WORK/e2e/e2e.md ]]; then
        step e2e_replot 30 $PY -m gpu.bench --replot "$WORK/e2e/e2e.json" -q || FAILED=1
    fi
    if [[ $CUPY_OK == 1 ]]; then
        # the same runs on the cupy backend (attention and RoPE of the forward by the kernels)
        step e2e_cupy "$T_E2E" $PY -m gpu.bench --e2e "${E2E_MODE[@]}" --e2e-backend cupy --out "$WORK/e2e_cupy" -q \
            || FAILED=1
    else
        note "e2e on the cupy backend: not run (CuPy absent or without CUDA)"
    fi
else
    note "no backend protocol (reference/backend.py, gpu/backend.py): e2e not run"
fi

# ------------------------------------------------------------------ collect (at most 8 files)
collect
cp "$LOG" "$WORK/session.log"
tar -czf "$OUT/all.tar.gz" -C "$WORK" . 2>/dev/null
rm -rf "$WORK"
echo
cat "$OUT/summary.md"
echo
log "done: failed=$FAILED; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
