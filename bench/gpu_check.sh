#!/usr/bin/env bash
# GPU check for a bare H200 machine, sized to fit one device call (<= 8 min) per mode:
#   bash bench/gpu_check.sh          quick (default): wheels, the gpu-marked tests, the 0.5B rows
#   bash bench/gpu_check.sh long     a second call: the 7B rows, the memory/IPC phase, the engine-process row
#   bash bench/gpu_check.sh first    one call for a session with a single short lease: the tests, the 0.5B
#                                    throughput row (py-spy profile of it when carried), the 7B memory row and
#                                    the 0.5B GEMM floor at batch 256 (the throughput row's step against it)
# GPU_TESTS_K="expr" narrows the test phase to pytest -k expr (a rerun of what failed); each test is cut at 120 s.
# The phase timeouts of each mode add up to <= 420 s (printed at the start). Every phase prints its
# table row ("ROW | ... |"), or its failure with the reason, the moment it ends; test results are written
# as each test completes ($OUT/gpu_tests.jsonl, one JSON line per test, and $OUT/gpu_tests.log, pytest -rA
# -v), so a phase that dies or times out loses nothing before it. All results also go to
# $OUT/gpu_results.json (or /tmp/gpu_check_out without $OUT); the table is printed again at the end.
# The device tool brings back at most 8 files from $OUT: `first` writes 7 (add no more than one of your own).
# Wheels (no network there): on a networked machine, from the repo root,
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d build/gpu_wheels flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 torch-memory-saver==0.0.10 \
#     fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 \
#     typing-inspection==0.4.2 uvicorn==0.55.0 orjson opentelemetry-api==1.45.2 py-spy
# and carry build/gpu_wheels (27 MB; py-spy profiles the throughput phase, see bench()). The H200 image has the rest (ninja, einops, httpx, peft, ...); the
# server's wheels are for the test of the HTTP server's CUDA-IPC update (fastapi 0.165 imports opentelemetry).
set -u
cd "$(dirname "$0")/.."
MODE="${1:-quick}"
case "$MODE" in quick|long|first) ;; *) echo "usage: bash bench/gpu_check.sh [quick|long|first]"; exit 2 ;; esac
OUT_DIR="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.json"
rm -f "$RESULTS"
START=$(date +%s)
stamp() { echo "[gpu_check $MODE +$(( $(date +%s) - START ))s] $*"; }

# Phase timeouts (seconds). quick: 30 + 180 + 90 + 40 + 40 + 40 = 420. long: 30 + 150 + 60 + 120 + 60 = 420.
# first: 30 + 180 + 90 + 120 + 40 = 460 (the first test pays flashinfer's JIT builds: the tests took 85 s
# on the first H200 run).
T_WHEELS=30
if [ "$MODE" = first ]; then
  T_TESTS=180; T_TPUT=90; T_MEM=120; T_GEMM256=40
  BUDGET=$((T_WHEELS + T_TESTS + T_TPUT + T_MEM + T_GEMM256))
elif [ "$MODE" = quick ]; then
  T_TESTS=180; T_TPUT=90; T_GEMM64=40; T_GEMM256=40; T_PREFILL=40
  BUDGET=$((T_WHEELS + T_TESTS + T_TPUT + T_GEMM64 + T_GEMM256 + T_PREFILL))
else
  T_TPUT7=150; T_GEMM7=60; T_MEM=120; T_PROC=60
  BUDGET=$((T_WHEELS + T_TPUT7 + T_GEMM7 + T_MEM + T_PROC))
fi
stamp "phase budget $BUDGET s"
# One device call allows 10 minutes of command time: the phases must leave room for start-up and the table.
[ "$BUDGET" -le 480 ] || { stamp "phase budget $BUDGET s exceeds 480 s: lower a phase timeout"; exit 2; }

# ---- wheels -------------------------------------------------------------------------------------------
SITE=/tmp/site
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  timeout "$T_WHEELS" python3 -m pip install --quiet --no-index --no-deps --target "$SITE" build/gpu_wheels/*.whl \
    && stamp "ROW | wheels | | | installed $(ls build/gpu_wheels/*.whl | wc -l) wheels | |" \
    || stamp "ROW | wheels | | | FAILED: pip install of the carried wheels (rc $?) | |"
else
  stamp "ROW | wheels | | | none in build/gpu_wheels: flashinfer / torch_memory_saver tests will skip | |"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1
# One JIT cache for the whole run: the tests compile the head_dim-64 kernels, the benchmarks reuse them.
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_cache
export MAX_JOBS=16
unset PYTORCH_CUDA_ALLOC_CONF  # torch_memory_saver refuses expandable segments
TMS_SO=$(python3 -c "import torch_memory_saver.utils as u; print(u.get_binary_path_from_package('torch_memory_saver_hook_mode_preload'))" 2>/dev/null || true)
PRELOAD=""
if [ -n "$TMS_SO" ] && [ -f "$TMS_SO" ]; then PRELOAD="$TMS_SO"; fi
stamp "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'); preload hook: ${PRELOAD:-none}"
python3 - <<'PY'
for m in ("flashinfer", "torch_memory_saver", "ninja"):
    try:
        __import__(m)
        print(f"  {m}: imports")
    except Exception as e:  # noqa: BLE001
        print(f"  {m}: does not import ({type(e).__name__}: {e})")
PY

# A phase that is killed or crashes before writing its row gets one here, with the reason.
fail_row() {  # fail_row NAME RC LOGFILE
  local why="exit code $2"
  [ "$2" = 124 ] || [ "$2" = 137 ] && why="TIMEOUT (killed at its limit)"
  local tail_msg
  tail_msg=$(grep -v -i warning "$3" | tail -2 | tr '\n|' '  ' | cut -c1-240)
  stamp "ROW | $1 | | | FAILED: $why; last output: $tail_msg | |"
  python3 - "$RESULTS" "$1" "$why" "$tail_msg" <<'PY'
import json, pathlib, sys
p = pathlib.Path(sys.argv[1]); rows = json.loads(p.read_text()) if p.is_file() else []
rows.append({"phase": sys.argv[2], "shape": "", "batch": "", "error": f"{sys.argv[3]}: {sys.argv[4]}"})
p.write_text(json.dumps(rows, indent=1))
PY
}

bench() {  # bench NAME TIMEOUT ARGS...
  local name=$1 t=$2; shift 2
  local log="$OUT_DIR/bench_$name.log"
  stamp "$name: gpu_bench $* (limit ${t}s)"
  local marker="/tmp/gpu_bench_profile_$name" watcher=""
  rm -f "$marker.go"
  if [ "$name" = throughput-0.5b ] && command -v py-spy >/dev/null; then
    # The throughput phase generates untimed for ~8 s while $marker.go exists: py-spy samples every
    # thread of it then (never a timed run). A py-spy that cannot attach costs only its profile.
    export GPU_BENCH_PROFILE="$marker"
    ( for _ in $(seq 1 $((t * 5))); do [ -f "$marker.go" ] && break; sleep 0.2; done
      [ -f "$marker.go" ] && timeout 20 py-spy record --pid "$(cat "$marker.go")" --duration 6 --rate 200 \
        --format raw --threads --nonblocking -o "$OUT_DIR/pyspy_$name.txt" >"/tmp/pyspy_$name.log" 2>&1 ) &
    watcher=$!
  else
    unset GPU_BENCH_PROFILE
  fi
  LD_PRELOAD="$PRELOAD" timeout -k 5 "$t" python3 -m bench.gpu_bench --json "$RESULTS" "$@" >"$log" 2>&1
  local rc=$?
  if [ -n "$watcher" ]; then  # py-spy's own lines (or why it failed) join the phase's log: $OUT holds 8 files
    kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null; unset GPU_BENCH_PROFILE
    cat "/tmp/pyspy_$name.log" >>"$log" 2>/dev/null
  fi
  grep '^ROW ' "$log" | sed "s/^/[gpu_check $MODE] /"
  grep -q '^ROW ' "$log" || fail_row "$name" "$rc" "$log"
}

if [ "$MODE" != long ]; then
  # ---- gpu-marked tests, results streamed as they complete -------------------------------------------
  stamp "tests/gpu (limit ${T_TESTS}s)"
  export GPU_TEST_RESULTS="$OUT_DIR/gpu_tests.jsonl"
  rm -f "$GPU_TEST_RESULTS"
  LD_PRELOAD="$PRELOAD" timeout -k 5 "$T_TESTS" python3 -m pytest -v -rA -m gpu -p no:cacheprovider tests/gpu \
    --timeout 120 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} >"$OUT_DIR/gpu_tests.log" 2>&1
  TESTS_RC=$?
  PASSED=$(grep -c '"outcome": "passed"' "$GPU_TEST_RESULTS" 2>/dev/null); PASSED=${PASSED:-0}
  FAILED=$(grep -c '"outcome": "failed"' "$GPU_TEST_RESULTS" 2>/dev/null); FAILED=${FAILED:-0}
  SKIPPED=$(grep -c '"outcome": "skipped"' "$GPU_TEST_RESULTS" 2>/dev/null); SKIPPED=${SKIPPED:-0}
  grep -E '^(FAILED|ERROR)' "$OUT_DIR/gpu_tests.log" | cut -c1-300
  if [ "$TESTS_RC" = 124 ] || [ "$TESTS_RC" = 137 ]; then TESTS_NOTE="TIMEOUT; "; else TESTS_NOTE=""; fi
  stamp "ROW | tests/gpu | | | ${TESTS_NOTE}rc=$TESTS_RC passed=$PASSED failed=$FAILED skipped=$SKIPPED | all pass |"
fi
if [ "$MODE" = first ]; then
  bench throughput-0.5b "$T_TPUT" --phase throughput --shape 0.5b --batch 256 --in 128 --out 256
  bench memory-7b "$T_MEM" --phase memory --shape 7b
  bench gemm-0.5b-256 "$T_GEMM256" --phase gemm --shape 0.5b --batch 256
elif [ "$MODE" = quick ]; then

  # ---- 0.5B rows -----------------------------------------------------------------------------------
  bench throughput-0.5b "$T_TPUT" --phase throughput --shape 0.5b --batch 256 --in 128 --out 256
  bench gemm-0.5b-64 "$T_GEMM64" --phase gemm --shape 0.5b --batch 64
  bench gemm-0.5b-256 "$T_GEMM256" --phase gemm --shape 0.5b --batch 256
  bench prefill-graphs-0.5b "$T_PREFILL" --phase prefill --shape 0.5b --batch 8 --in 128
else
  bench throughput-7b "$T_TPUT7" --phase throughput --shape 7b --batch 64 --in 128 --out 128
  bench gemm-7b-64 "$T_GEMM7" --phase gemm --shape 7b --batch 64
  bench memory-7b "$T_MEM" --phase memory --shape 7b
  bench engine-process-0.5b "$T_PROC" --phase engine_process --shape 0.5b
fi

stamp "done"
python3 -m bench.gpu_bench --phase table --json "$RESULTS"
