#!/usr/bin/env bash
# The non-Hopper attention paths on one GPU, in one device call (issue 30's measurements).
#
#   OUT=/path bash benchmarks/stream/fa2_batch.sh
#
# Expects FlashInfer importable (PYTHONPATH) and the fixtures in LINGBOT_FIXTURES (GPU tests).
# FRAMES (default 150): frames of each timed stream; AB=1 also runs the per-call kernel table.
# Writes into $OUT (at most 8 files, as the device tool returns few):
#   fa2_378.json        stream_fps, flashinfer-fa2: FlashInfer FA2 over the pool's runs, auto splits
#                       (the FA2-class path that auto picks on sm_80/86/87/89), with bf16 vs fp32
#   fa2_paged_378.json  stream_fps, flashinfer-fa2-paged: the paged FA2 kernel (the FA2 path before)
#   sdpa_378.json       stream_fps, sdpa: PyTorch's FlashAttention-2 varlen over the runs, CUDA graphs
#                       (the path without FlashInfer), with bf16 vs fp32
#   profiles.txt        benchmarks/stream/profile_step.py --graphs --queued for the three (kernels per frame)
#   gpu_tests.log       pytest -m gpu: the varlen backend, FlashInfer FA2 (ragged and paged, split-KV,
#                       graph mode), the graphed session steps of fa2 / fa2-paged / sdpa
#   fa2_class_ab.json   (AB=1) per-call global attention, benchmarks/kernels/fa2_class_ab.py
#   fa2_batch.log       everything printed
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./fa2_batch_out}
FRAMES=${FRAMES:-150}
mkdir -p "$OUT"
LOG="$OUT/fa2_batch.log"
export PYTHONUNBUFFERED=1
echo "commit ${LINGBOT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(date -u), $(nvidia-smi --query-gpu=name --format=csv,noheader)" | tee -a "$LOG"
run() { local limit=$1; shift; echo "== $*" >>"$LOG"; local t0=$SECONDS; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "   exit $? after $((SECONDS - t0)) s: ${*:1:5}" | tee -a "$LOG"; }
summary() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['setting']['backend'], 'splits', d['setting']['kv_splits'], d['steady_state'], 'peak', d['peak_gpu_memory_gib'], 'bf16_vs_fp32', d.get('bf16_vs_fp32'))" "$1"; }
STREAM="--frames $FRAMES --one-at-a-time-frames 0 --breakdown-frames 0"
run 100 python3 benchmarks/stream/stream_fps.py --backend flashinfer-fa2 $STREAM --out "$OUT/fa2_378.json"
run 70 python3 benchmarks/stream/stream_fps.py --backend sdpa $STREAM --out "$OUT/sdpa_378.json"
run 60 python3 benchmarks/stream/stream_fps.py --backend flashinfer-fa2-paged $STREAM --compare-frames 0 \
  --out "$OUT/fa2_paged_378.json"
for f in "$OUT"/*_378.json; do summary "$f" | tee -a "$LOG"; done
run 120 bash -c "python3 -m pytest -m gpu -q -p no:cacheprovider test/gpu/test_varlen_backend.py \
  test/gpu/test_flashinfer_backend.py test/gpu/test_graphs.py::test_graphed_step_matches_eager -k 'not fa3 and not ragged_graph_wrapper' \
  > $OUT/gpu_tests.log 2>&1"
tail -1 "$OUT/gpu_tests.log"
for b in flashinfer-fa2 sdpa flashinfer-fa2-paged; do
  run 45 bash -c "(echo '### profile_step --graphs --queued --backend $b'; \
    python3 benchmarks/stream/profile_step.py --graphs --queued --backend $b --frames 6 --top 25 2>&1 | grep -v RANDOM) \
    >>$OUT/profiles.txt 2>&1"
done
grep -A3 "^###" "$OUT/profiles.txt"
[[ "${AB:-0}" == 1 ]] && run 90 python3 benchmarks/kernels/fa2_class_ab.py --out "$OUT/fa2_class_ab.json"
exit 0
