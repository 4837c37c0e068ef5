#!/usr/bin/env bash
# A/B of the global attention's FA3 kernel in the full stream (stream_fps, queued frames):
# FlashInfer's packaged module (backend flashinfer-fa3-stock, 192 x 128 tiles at head_dim 64)
# against the project-built one (flashinfer-fa3, kernels/fa3_tiles.py, 128 x 192 tiles),
# each at the given split counts (0 = automatic), runs interleaved over PAIRS rounds so that
# drift of the machine hits both alike. A run "tiled:SPLITS:QxKVxSTAGES" uses another shape
# of the project-built kernel (stream_fps.py --fa3-tiles). Builds the tiled modules first, in
# parallel (timed).
#
#   OUT=/tmp/out HEIGHT=378 PAIRS=2 FRAMES=160 bash benchmarks/kernels/fa3_tiles_ab.sh stock:12 tiled:0 tiled:12
#   OUT=/tmp/out PAIRS=1 bash benchmarks/kernels/fa3_tiles_ab.sh tiled:0 tiled:0:128x256x2 tiled:0:128x192x3
#
# Prints (and appends to $OUT/fa3_tiles_ab.log) one line per run: label, split count used,
# median / p95 ms per frame; the first tiled run also checks bf16 against fp32 (12 frames).
# Needs FlashInfer importable (PYTHONPATH) and nvcc (FlashInfer's JIT builder).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT=${OUT:-./fa3_tiles_ab_out}
HEIGHT=${HEIGHT:-378}
PAIRS=${PAIRS:-2}
FRAMES=${FRAMES:-160}
mkdir -p "$OUT"
LOG="$OUT/fa3_tiles_ab.log"
start=$SECONDS
shapes=$(printf '%s\n' "$@" | awk -F: '$1 == "tiled" {print ($3 == "" ? "default" : $3)}' | sort -u)
for shape in $shapes; do
  [[ "$shape" == default ]] && shape=""
  (python3 -c "from lingbot_map_ros.config import parse_fa3_tiles as p; from lingbot_map_ros.kernels import fa3_tiles as f; t=p('${shape:-128x192x2}'); f.load(t); print('tiled FA3 module', f.module_name(t))" \
    2>&1 | tail -3 | tee -a "$LOG") &
done
wait
echo "build/load: $((SECONDS - start)) s" | tee -a "$LOG"
compare=12
for ((round = 1; round <= PAIRS; round++)); do
  for run in "$@"; do
    IFS=: read -r kind splits shape <<<"$run"
    backend=flashinfer-fa3
    [[ "$kind" == stock ]] && backend=flashinfer-fa3-stock
    c=0
    [[ "$kind" == tiled ]] && { c=$compare; compare=0; }
    json=/tmp/fa3_ab_${kind}_${splits}_${shape}_${round}.json
    timeout 200 python3 "$ROOT/benchmarks/stream/stream_fps.py" --backend "$backend" --kv-splits "$splits" --fa3-tiles "${shape:-128x192x2}" --height "$HEIGHT" \
      --frames "$FRAMES" --one-at-a-time-frames 0 --breakdown-frames 0 --compare-frames "$c" --out "$json" \
      >/dev/null 2>>"$LOG"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=d['steady_state']
print(f\"round {sys.argv[2]} {sys.argv[3]:>20} splits {d['setting']['kv_splits']:>2} tiles {d['setting'].get('fa3_tiles')}: median {s['median_ms']:.2f} ms, p95 {s['p95_ms']:.2f}, graph GPU {d.get('graph_gpu_median_ms')}\", d['bf16_vs_fp32'] if d.get('bf16_vs_fp32') else '')" \
      "$json" "$round" "$run" 2>&1 | tee -a "$LOG"
  done
done
