#!/usr/bin/env bash
# One-shot GPU check for a bare H200 machine, ~8 minutes, flashinfer JIT included (the per-step timeouts bound it at ~10.5):
#   1. install the carried wheels (build/gpu_wheels/: flashinfer-python 0.6.13, apache-tvm-ffi,
#      torch-memory-saver 0.0.10, and the small pure-python dependencies) into /tmp/site, no network;
#   2. run the gpu-marked tests (tests/gpu) with torch_memory_saver's preload hook;
#   3. run bench/gpu_bench.py phase by phase, each in its own process with its own timeout, appending to
#      one JSON file ($OUT/gpu_results.json when $OUT is set) so a phase that fails or runs out of time
#      does not lose the others;
#   4. print one table last.
# Get the wheels on a networked machine first (run from the repo root):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d build/gpu_wheels flashinfer-python==0.6.13 \
#     apache-tvm-ffi==0.1.15.post2 torch-memory-saver==0.0.10 ninja nvidia-ml-py einops tabulate click
# and carry build/gpu_wheels. Usage: bash bench/gpu_check.sh [quick]   ("quick": tests and the 0.5B rows only)
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_results.json"
rm -f "$RESULTS"
START=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

# ---- 1. wheels ---------------------------------------------------------------------------------
SITE=/tmp/site
if ls build/gpu_wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install --quiet --no-index --no-deps --target "$SITE" build/gpu_wheels/*.whl \
    || stamp "pip install of the carried wheels failed"
else
  stamp "no wheels in build/gpu_wheels: flashinfer and torch_memory_saver tests will be skipped"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# One JIT cache for the whole run: the tests compile the head_dim-64 kernels, the benchmarks reuse them.
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer_cache
export MAX_JOBS=16
unset PYTORCH_CUDA_ALLOC_CONF  # torch_memory_saver refuses expandable segments
TMS_SO=$(python3 -c "import torch_memory_saver.utils as u; print(u.get_binary_path_from_package('torch_memory_saver_hook_mode_preload'))" 2>/dev/null || true)
PRELOAD=""
if [ -n "$TMS_SO" ] && [ -f "$TMS_SO" ]; then PRELOAD="$TMS_SO"; fi
stamp "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'); preload hook: ${PRELOAD:-none}"
python3 - <<'EOF'
import importlib.util
for m in ("flashinfer", "torch_memory_saver", "ninja"):
    print(f"  {m}: {'present' if importlib.util.find_spec(m) else 'MISSING'}")
EOF

# ---- 2. gpu-marked tests ------------------------------------------------------------------------
stamp "tests/gpu"
LD_PRELOAD="$PRELOAD" timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu \
  -o junit_family=xunit1 --junitxml="$OUT_DIR/gpu_tests.xml" 2>&1 | tail -25
TESTS_RC=${PIPESTATUS[0]}
stamp "tests rc=$TESTS_RC"

# ---- 3. benchmarks --------------------------------------------------------------------------------
bench() {  # bench TIMEOUT ARGS...
  local t=$1; shift
  stamp "gpu_bench $*"
  LD_PRELOAD="$PRELOAD" timeout "$t" python3 -m bench.gpu_bench --json "$RESULTS" "$@" 2>&1 | grep -v Warning | tail -4
  if [ "${PIPESTATUS[0]}" = 124 ]; then
    python3 - "$RESULTS" "$*" <<'EOF'
import json, pathlib, sys
p = pathlib.Path(sys.argv[1]); rows = json.loads(p.read_text()) if p.is_file() else []
rows.append({"phase": "timeout", "shape": "", "batch": "", "args": sys.argv[2]}); p.write_text(json.dumps(rows))
EOF
  fi
}
bench 110 --phase throughput --shape 0.5b --batch 256 --in 128 --out 256
bench 40 --phase gemm --shape 0.5b --batch 64
bench 40 --phase gemm --shape 0.5b --batch 256
if [ "${1:-}" != "quick" ]; then
  bench 130 --phase throughput --shape 7b --batch 64 --in 128 --out 128
  bench 40 --phase gemm --shape 7b --batch 64
  bench 90 --phase memory --shape 7b
fi

# ---- 4. the table ------------------------------------------------------------------------------------
stamp "done (tests rc=$TESTS_RC)"
python3 -m bench.gpu_bench --phase table --json "$RESULTS"
