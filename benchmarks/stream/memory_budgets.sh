#!/usr/bin/env bash
# The GPU measurements of issue 29 (memory budgets, cost sweeps, FP8 K/V, accuracy) in one device call.
#   OUT=/path bash benchmarks/stream/memory_budgets.sh
# Needs FlashInfer's wheels installed on PYTHONPATH (see gpu_batch.sh) and the fixtures (LINGBOT_FIXTURES).
# Writes into $OUT: memory_budgets.log (everything printed), budgets_{sdpa,fa2,fa3}.json,
# accuracy.json, fp8_kv_probe.log, fa3_build.log.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./memory_budgets_out}
mkdir -p "$OUT"
LOG="$OUT/memory_budgets.log"
export PYTHONUNBUFFERED=1
echo "commit ${LINGBOT_COMMIT:-?}, $(date -u)" >>"$LOG"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >>"$LOG" 2>&1
run() { local limit=$1; shift; echo "== $(date -u +%T) $*" >>"$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "   exit $?" >>"$LOG"; }
# the project-built FA3 kernel compiles (~90 s of nvcc) while the other backends measure
(timeout 240 python3 -c "from lingbot_map_ros.kernels import fa3_tiles; fa3_tiles.load(); print('fa3 tiles built')" \
  >"$OUT/fa3_build.log" 2>&1) &
BG=$!
run 70 python3 -m pytest -m gpu test/gpu/test_fp8_kv_gpu.py -q -s -p no:cacheprovider -k "not fa3"
run 60 python3 benchmarks/stream/memory_budgets.py --backend sdpa --budgets 8,12,16,24 --timed 10 --out "$OUT/budgets_sdpa.json"
run 60 python3 benchmarks/stream/memory_budgets.py --backend flashinfer-fa2 --budgets 8,12,16,24 --out "$OUT/budgets_fa2.json"
wait $BG
run 120 python3 benchmarks/stream/memory_budgets.py --backend flashinfer-fa3 --budgets 8,12,16,24 --windows 8,32,128 \
  --fp8-windows 64,128 --resolutions 280x210,392x294,518x294 --scale-frames 4 --out "$OUT/budgets_fa3.json"
run 40 python3 -m pytest -m gpu test/gpu/test_fp8_kv_gpu.py -q -s -p no:cacheprovider -k "fa3"
run 70 python3 benchmarks/stream/memory_budgets.py --accuracy 120 --backend flashinfer-fa3 --out "$OUT/accuracy.json"
run 60 python3 benchmarks/kernels/fp8_kv_probe.py >"$OUT/fp8_kv_probe.log" 2>&1
grep -E "passed|failed|error" "$LOG" | tail -5
echo "done $(date -u)" >>"$LOG"
