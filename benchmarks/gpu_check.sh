#!/usr/bin/env bash
# The GPU check (issue 23, item 10; docs/performance.md, "The GPU check"): one prepared script
# for the day a GPU machine is lent. From the repository root:
#
#   benchmarks/gpu_check.sh                          # on the GPU: about 10 minutes at most
#   benchmarks/gpu_check.sh --device cpu --small --model DIR   # the CPU rehearsal (tests/test_gpu_check.py)
#
# Steps, each under its own time limit (seconds: --limits TESTS,BENCH,GRID,COMPARE), each logged:
#   1. the CUDA tests (pytest -k cuda over the files that hold them; on a CPU they skip);
#   2. benchmarks/bench_decode.py --device D --peer-device D: evictlab's loop, transformers'
#      generate, the shared prefill against the full cache's, and kvpress on the same device
#      when --peer-venv holds a python that imports kvpress (no venv: the kvpress runs are
#      skipped and the summary says so; the machine cannot fetch one);
#   3. one claim grid, `evictlab eval run --config experiments/gpu_check.toml` (4k-16k tokens),
#      then `evictlab eval compare` on it.
# Results go to --out (default runs/gpu_check): gpu_check.log, env.json, cuda_tests.log,
# bench_decode.json (+ its per-run folder), grid/ (results.parquet, pairs.parquet, pairs.md),
# summary.md and summary.json (every step's status, seconds and output). When $OUT is set (the
# device tool's return folder) the summary, logs, bench_decode.json and pairs.md are copied there.
#
# The machine needs evictlab's dependencies importable by --python (default python3): on a
# bare GPU image carry polars and the rest as wheels (--wheels DIR: installed with pip
# --no-index into a temporary folder), and the models in the evictlab model cache
# (~/.cache/evictlab/models) or as local folders (--model, --grid-models).
set -uo pipefail

DEVICE=cuda
SMALL=0
OUT_DIR=runs/gpu_check
PY=${PYTHON:-python3}
MODEL=smollm2-135m
GRID_MODELS=""
PEER_VENV=${HOME}/.cache/evictlab/bench/kvpress-0.5.5
CONFIG=experiments/gpu_check.toml
WHEELS=""
LIMITS=""

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --small) SMALL=1; shift ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --grid-models) GRID_MODELS=$2; shift 2 ;;
    --peer-venv) PEER_VENV=$2; shift 2 ;;
    --config) CONFIG=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --limits) LIMITS=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: gpu_check.sh: unknown argument $1. Fix: see --help" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "error: --device $DEVICE. Fix: use cuda or cpu" >&2; exit 2 ;; esac
[ -f "$CONFIG" ] || { echo "error: --config $CONFIG does not exist. Fix: run from the repository root" >&2; exit 2; }

if [ "$SMALL" = 1 ]; then
  # CPU-sized: a short context, one example, a small budget (the tiny models keep 4 + 16 always)
  # and three decode runs (each a fresh process: their start dominates at this size)
  CTX=160; NEW=4; KEPT=24; GRID_EXTRA=(--context 160 --n 1 --budget 24)
  RUNS=full,snapkv,shared_prefill
  DEFAULT_LIMITS=300,600,600,300
else
  CTX=4096; NEW=32; KEPT=0; GRID_EXTRA=()
  RUNS=hf_generate,full,snapkv,snapkv_onepass,shared_prefill
  DEFAULT_LIMITS=120,180,210,45   # the whole under 10 minutes
fi
IFS=, read -r LIM_TESTS LIM_BENCH LIM_GRID LIM_COMPARE <<< "${LIMITS:-$DEFAULT_LIMITS}"
[ -n "$GRID_MODELS" ] || { [ "$SMALL" = 1 ] && GRID_MODELS=$MODEL; }
[ -n "$GRID_MODELS" ] && GRID_EXTRA+=(--models "$GRID_MODELS")

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/gpu_check.log
: > "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
[ "$DEVICE" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG" >&2; }

if [ -n "$WHEELS" ]; then
  log "installing the wheels of $WHEELS into /tmp/gpu_check_site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    "$WHEELS"/*.whl >> "$LOG" 2>&1 || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/gpu_check_site
fi
EVICTLAB=("$PY" -c 'import sys; from evictlab.cli import main; sys.argv[0] = "evictlab"; main()')

STEPS=()   # name|status|seconds|detail
T_START=$(date +%s)
step() {  # step NAME LIMIT_S LOGFILE CMD...: run under a time limit, record status and seconds
  local name=$1 limit=$2 logfile=$3; shift 3
  local t0 rc status
  t0=$(date +%s)
  log "step $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$logfile" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status="timed out" ;; *) status="failed (exit $rc)" ;; esac
  STEPS+=("$name|$status|$(( $(date +%s) - t0 ))|$logfile")
  log "step $name: $status in $(( $(date +%s) - t0 )) s"
  tail -n 5 "$logfile" | sed 's/^/    /' >> "$LOG"
  return $rc
}

# 0. the environment (device, versions, commit)
"$PY" - "$DEVICE" > "$OUT_DIR/env.json" 2>> "$LOG" <<'EOF'
import json, os, platform, subprocess, sys
import torch
dev = sys.argv[1]
out = {"device": dev, "python": platform.python_version(), "torch": torch.__version__,
       "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(), "load": os.getloadavg()}
if torch.cuda.is_available():
    out["gpu"] = torch.cuda.get_device_name(0)
try:
    import transformers
    out["transformers"] = transformers.__version__
except ImportError as e:
    out["transformers"] = f"missing: {e}"
try:
    out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    out["commit"] = ""
print(json.dumps(out))
EOF
if [ "$DEVICE" = cuda ] && ! grep -q '"cuda_available": true' "$OUT_DIR/env.json"; then
  log "--device cuda but torch sees no GPU (env.json); use --device cpu for the rehearsal"
  exit 1
fi

# 1. the CUDA tests (every test named *cuda*, in the files that hold them)
step cuda_tests "$LIM_TESTS" "$OUT_DIR/cuda_tests.log" "$PY" -m pytest -q -p no:cacheprovider -k cuda \
  tests/test_kv_ragged.py tests/test_methods_scorers.py tests/test_capture_sources.py tests/test_gates_train.py

# 2. the decode benchmark, kvpress on the same device when its venv is there
PEER_NOTE="kvpress skipped: no python importing kvpress in $PEER_VENV (pass --peer-venv)"
if [ -x "$PEER_VENV/bin/python" ] && "$PEER_VENV/bin/python" -c "import kvpress" > /dev/null 2>&1; then
  RUNS=$RUNS,kvpress_full,kvpress_snapkv
  PEER_NOTE="kvpress from $PEER_VENV on $DEVICE"
fi
log "$PEER_NOTE"
step bench_decode "$LIM_BENCH" "$OUT_DIR/bench_decode.log" "$PY" benchmarks/bench_decode.py --runs "$RUNS" \
  --model "$MODEL" --context "$CTX" --new "$NEW" --kept "$KEPT" --reps 1 --prefill-reps 2 --device "$DEVICE" \
  --peer-device "$DEVICE" --peer-venv "$PEER_VENV" --work "$OUT_DIR/bench_decode" --out "$OUT_DIR/bench_decode.json"

# 3. one claim grid at 4k-16k tokens, then its comparison
rm -rf "$OUT_DIR/grid"
if step grid "$LIM_GRID" "$OUT_DIR/grid.log" "${EVICTLAB[@]}" eval run --config "$CONFIG" --device "$DEVICE" \
     --out "$OUT_DIR/grid" --quiet "${GRID_EXTRA[@]}"; then
  step compare "$LIM_COMPARE" "$OUT_DIR/compare.log" "${EVICTLAB[@]}" eval compare "$OUT_DIR/grid" --n-boot 500
fi

# the summary
TOTAL=$(( $(date +%s) - T_START ))
{
  echo "# GPU check ($DEVICE$([ "$SMALL" = 1 ] && echo ', small'))"
  echo
  echo "Command: \`benchmarks/gpu_check.sh --device $DEVICE$([ "$SMALL" = 1 ] && echo ' --small') --out $OUT_DIR\`;" \
       "$TOTAL s in all; $PEER_NOTE. Environment: \`$(cat "$OUT_DIR/env.json")\`."
  echo
  echo "| step | status | seconds | output |"
  echo "|---|---|---:|---|"
  for s in "${STEPS[@]}"; do IFS='|' read -r n st sec f <<< "$s"; echo "| $n | $st | $sec | $(basename "$f") |"; done
  if [ -f "$OUT_DIR/cuda_tests.log" ]; then echo; echo "CUDA tests: $(tail -n 1 "$OUT_DIR/cuda_tests.log")"; fi
  if [ -f "$OUT_DIR/bench_decode.log" ]; then
    echo; echo "Decode benchmark (bench_decode.json):"; echo
    sed -n '/^| run /,$p' "$OUT_DIR/bench_decode.log"
  fi
} > "$OUT_DIR/summary.md"
"$PY" - "$OUT_DIR" "$TOTAL" "${STEPS[@]}" > "$OUT_DIR/summary.json" <<'EOF'
import json, sys
out, total, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = [dict(zip(("step", "status", "seconds", "output"), s.split("|"))) for s in steps]
for r in rows:
    r["seconds"] = int(r["seconds"])
print(json.dumps({"out": out, "total_s": total, "steps": rows, "ok": all(r["status"] == "ok" for r in rows)}))
EOF
log "done in $TOTAL s: $OUT_DIR/summary.md"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  for f in summary.md summary.json gpu_check.log env.json cuda_tests.log bench_decode.json grid.log; do
    [ -f "$OUT_DIR/$f" ] && cp "$OUT_DIR/$f" "$OUT/"
  done
  [ -f "$OUT_DIR/grid/pairs.md" ] && cp "$OUT_DIR/grid/pairs.md" "$OUT/"
fi
grep -q '"ok": true' "$OUT_DIR/summary.json"
