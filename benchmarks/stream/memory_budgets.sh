#!/usr/bin/env bash
# The GPU measurements of issue 29 (memory budgets, cost sweeps, FP8 K/V, FP8 GEMMs, accuracy) in one
# device call, most important first, each under its own time limit.
#   OUT=/path bash benchmarks/stream/memory_budgets.sh
# Needs FlashInfer's wheels installed on PYTHONPATH (see gpu_batch.sh) and LINGBOT_FIXTURES (the folder
# holding upstream_tiny). Writes into $OUT: memory_budgets.log (everything printed),
# budgets_{sdpa,fa2,fa3}.json, accuracy_{tiny,released}.json, fp8_kv_probe.log, fa3_build.log.
# The FA3 kernel build and the FP8 attention probe run in the background while SDPA and FA2 measure
# (the probe's timings therefore share the GPU: read its errors and compile results, not its speed).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./memory_budgets_out}
mkdir -p "$OUT"
LOG="$OUT/memory_budgets.log"
export PYTHONUNBUFFERED=1
echo "commit ${LINGBOT_COMMIT:-?}, $(date -u)" >>"$LOG"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >>"$LOG" 2>&1
run() { local limit=$1; shift; echo "== $(date -u +%T) $*" >>"$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "   exit $? $(date -u +%T)" >>"$LOG"; }
(timeout 200 python3 -c "from lingbot_map_ros.kernels import fa3_tiles; fa3_tiles.load(); print('fa3 tiles built')" \
  >"$OUT/fa3_build.log" 2>&1) &
BG=$!
(timeout 150 python3 benchmarks/kernels/fp8_kv_probe.py >"$OUT/fp8_kv_probe.log" 2>&1) &
run 50 python3 benchmarks/stream/memory_budgets.py --backend sdpa --budgets 8,12,16,24 --timed 10 --out "$OUT/budgets_sdpa.json"
run 70 python3 benchmarks/stream/memory_budgets.py --backend flashinfer-fa2 --budgets 8,12,16,24 --out "$OUT/budgets_fa2.json"
wait $BG
run 110 python3 benchmarks/stream/memory_budgets.py --backend flashinfer-fa3 --budgets 8,12,16,24 --windows 8,32,64,128 \
  --fp8-windows 64,128 --resolutions 280x210,392x294,518x294 --scale-frames 4 --fp8-gemm --out "$OUT/budgets_fa3.json"
run 50 python3 -m pytest -m gpu test/gpu/test_fp8_kv_gpu.py test/gpu/test_fp8_gemm_gpu.py -q -s -p no:cacheprovider
run 30 python3 benchmarks/stream/memory_budgets.py --accuracy 300 --fixture "$LINGBOT_FIXTURES/upstream_tiny" \
  --backend flashinfer-fa3 --out "$OUT/accuracy_tiny.json"
run 60 python3 benchmarks/stream/memory_budgets.py --accuracy 120 --backend flashinfer-fa3 --out "$OUT/accuracy_released.json"
wait
grep -E "passed|failed" "$LOG" | tail -2
echo "done $(date -u)" >>"$LOG"
