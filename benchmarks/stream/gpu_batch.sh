#!/usr/bin/env bash
# The GPU measurements behind the README's performance tables, in one device call.
#
#   OUT=/path bash benchmarks/stream/gpu_batch.sh [--no-node]
#
# Runs, each under its own time limit, writing into $OUT (at most 8 files, as the
# device tool returns few):
#   nvidia_h200_fa3_378.json      stream_fps at 518x378 (300 frames queued + 300 one at a time,
#                                 stage breakdown, bf16 vs fp32)
#   nvidia_h200_fa3_378_uint8.json  the same with uint8 host frames, as the node gets them (150 frames)
#   nvidia_h200_fa3_378_kf2.json  keyframe interval 2 (300 frames)
#   nvidia_h200_fa3_294.json      stream_fps at 518x294 (200 frames)
#                                 (+ to the log: 518x378 on FlashInfer's packaged FA3 module, 160 frames)
#   gpu_tests_h200.log            pytest -m gpu test/gpu
#   node_latency_518x{378,294}.json  benchmarks/node/node_latency.sh (unless --no-node)
#   gpu_batch.log                 everything printed
# Needs FlashInfer's wheels in .whl/fi, the fixtures in .fixtures (GPU tests) and, for the
# node runs, the cp312 ROS bundle (.whl/ros312_bundle.tar.xz); see GPU.md and README.
# Optional: .ficache/*.tgz, FlashInfer JIT caches from an earlier machine (the compiled
# .so of each module is installed as FlashInfer's ahead-of-time build: no ~90 s JIT).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./gpu_batch_out}
NODE=1
[[ "${1:-}" == "--no-node" ]] && NODE=0
mkdir -p "$OUT"
LOG="$OUT/gpu_batch.log"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl >>"$LOG" 2>&1
export PYTHONPATH=/tmp/site:$ROOT LINGBOT_FIXTURES=$ROOT/.fixtures
bash benchmarks/kernels/fi_aot_cache.sh /tmp/site >>"$LOG" 2>&1
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a), $(date -u)" >>"$LOG"
summary() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], 'splits', d['setting']['kv_splits'], d['steady_state'], 'one at a time', d['one_at_a_time'], 'graph GPU', d['graph_gpu_median_ms'], 'peak', d['peak_gpu_memory_gib'], 'phase1', d['phase1_ms'], 'bf16_vs_fp32', d['bf16_vs_fp32'], d['stage_ms_per_frame'])" "$1"; }
run() { local limit=$1; shift; echo "== $*" >>"$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "   exit $?" >>"$LOG"; }
run 260 python3 benchmarks/stream/stream_fps.py --out "$OUT/nvidia_h200_fa3_378.json"
run 80 python3 benchmarks/stream/stream_fps.py --frames 150 --one-at-a-time-frames 150 --breakdown-frames 0 \
  --compare-frames 0 --uint8-frames --out "$OUT/nvidia_h200_fa3_378_uint8.json"
run 100 python3 benchmarks/stream/stream_fps.py --frames 300 --keyframe-interval 2 --breakdown-frames 0 \
  --compare-frames 0 --out "$OUT/nvidia_h200_fa3_378_kf2.json"
run 80 python3 benchmarks/stream/stream_fps.py --height 294 --frames 200 --one-at-a-time-frames 200 --breakdown-frames 0 \
  --compare-frames 0 --out "$OUT/nvidia_h200_fa3_294.json"
run 60 python3 benchmarks/stream/stream_fps.py --frames 160 --one-at-a-time-frames 0 --backend flashinfer-fa3-stock \
  --breakdown-frames 0 --compare-frames 0 --out /tmp/nvidia_h200_fa3_stock_378.json
summary /tmp/nvidia_h200_fa3_stock_378.json >>"$LOG"
for f in "$OUT"/nvidia_h200_fa3_*.json; do summary "$f" | tee -a "$LOG"; done
run 150 python3 -m pytest -m gpu test/gpu -q -p no:cacheprovider
grep -E "passed|failed" "$LOG" | tail -1 >"$OUT/gpu_tests_h200.log"
cat "$OUT/gpu_tests_h200.log"
if (( NODE )); then
  OUT=/tmp/gpu_batch_node run 330 bash benchmarks/node/node_latency.sh --frames 300 --rate 15 --heights "378 294" --deadline 320
  cp /tmp/gpu_batch_node/node_latency_518x*.json "$OUT/" 2>/dev/null
  grep "RESULT" "$LOG" | tail -2
fi
