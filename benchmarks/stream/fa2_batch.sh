#!/usr/bin/env bash
# The non-Hopper attention paths on one GPU, in one device call (issue 30's measurements).
#
#   OUT=/path bash benchmarks/stream/fa2_batch.sh
#
# Expects FlashInfer importable (PYTHONPATH) and the fixtures in LINGBOT_FIXTURES (GPU tests).
# Writes into $OUT (at most 8 files, as the device tool returns few):
#   fa2_class_ab.json   per-call global attention, 518x378 full window: FlashInfer FA2 paged
#                       (1..16 splits), FA2 ragged, PyTorch FlashAttention-2 varlen (backend sdpa,
#                       3..32 splits), the old gather SDPA (benchmarks/kernels/fa2_class_ab.py)
#   sdpa_378.json       stream_fps, backend sdpa (FlashAttention-2 varlen over the runs, CUDA graphs)
#   fa2_378.json        stream_fps, backend flashinfer-fa2 at the fastest split count of fa2_class_ab
#   fa2_default_378.json  stream_fps, flashinfer-fa2 at its automatic split count (1), as before
#   profile_fa2.txt, profile_sdpa.txt   benchmarks/stream/profile_step.py --graphs (kernels per frame)
#   gpu_tests.log       pytest -m gpu of the varlen backend and the graphed steps of fa2/sdpa
#   fa2_batch.log       everything printed
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=${OUT:-./fa2_batch_out}
FRAMES=${FRAMES:-150}
mkdir -p "$OUT"
LOG="$OUT/fa2_batch.log"
export PYTHONUNBUFFERED=1
echo "commit ${LINGBOT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(date -u), $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader)" | tee -a "$LOG"
run() { local limit=$1; shift; echo "== $*" >>"$LOG"; local t0=$SECONDS; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "   exit $? after $((SECONDS - t0)) s" | tee -a "$LOG"; }
summary() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['setting']['backend'], 'splits', d['setting']['kv_splits'], d['steady_state'], 'peak', d['peak_gpu_memory_gib'], 'bf16_vs_fp32', d.get('bf16_vs_fp32'))" "$1"; }
run 110 python3 benchmarks/kernels/fa2_class_ab.py --out "$OUT/fa2_class_ab.json"
grep -A40 "^variant" "$LOG" | head -30
best=$(python3 -c "import json,sys,re; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['variant'].startswith('flashinfer fa2 paged')]; print(re.search(r'(\d+) splits', min(r, key=lambda x: x['ms_per_call'])['variant']).group(1))" "$OUT/fa2_class_ab.json" 2>/dev/null || echo 4)
STREAM="--frames $FRAMES --one-at-a-time-frames 0 --breakdown-frames 0"
run 90 python3 benchmarks/stream/stream_fps.py --backend sdpa $STREAM --compare-frames 6 --out "$OUT/sdpa_378.json"
run 150 bash -c "python3 -m pytest -m gpu -q -p no:cacheprovider test/gpu/test_varlen_backend.py 'test/gpu/test_graphs.py::test_graphed_step_matches_eager' -k 'not fa3' > $OUT/gpu_tests.log 2>&1"
tail -3 "$OUT/gpu_tests.log"
run 80 python3 benchmarks/stream/stream_fps.py --backend flashinfer-fa2 --kv-splits "$best" $STREAM --compare-frames 0 --out "$OUT/fa2_378.json"
[[ "${DEFAULT_FA2:-1}" == 1 ]] && run 80 python3 benchmarks/stream/stream_fps.py --backend flashinfer-fa2 $STREAM --compare-frames 0 --out "$OUT/fa2_default_378.json"
run 60 bash -c "python3 benchmarks/stream/profile_step.py --graphs --queued --backend flashinfer-fa2 --frames 6 --top 25 > $OUT/profile_fa2.txt 2>&1"
run 60 bash -c "python3 benchmarks/stream/profile_step.py --graphs --queued --backend sdpa --frames 6 --top 25 > $OUT/profile_sdpa.txt 2>&1"
for f in "$OUT"/*_378.json; do summary "$f" | tee -a "$LOG"; done
head -8 "$OUT/profile_fa2.txt" "$OUT/profile_sdpa.txt"
