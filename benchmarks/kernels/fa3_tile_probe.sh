#!/usr/bin/env bash
# Probe, not part of the package: what FlashInfer's FA3 kernel would give the global
# attention with other tile sizes than the (192 queries, 128 keys) it uses at head_dim 64.
# A frame's 1005 queries fill 6 tiles of 192 (1152 rows, 13% padding); 128-query tiles
# would compute 1024 rows. For each "Q KV" pair this copies the installed FlashInfer
# (SITE) to a scratch folder, changes the tile size in its kernel dispatch and in its
# scheduler's plan (the two places that name it), lets FlashInfer JIT-compile the module
# from that copy (all variants compile in parallel first), then runs stream_fps on it.
#
#   SITE=/tmp/site OUT=/tmp/out bash benchmarks/kernels/fa3_tile_probe.sh "128 128" "128 192"
#
# Writes $OUT/tile_<Q>_<KV>.json (stream_fps, queued frames, bf16 vs fp32 check).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SITE=${SITE:-/tmp/site}
OUT=${OUT:-./tile_probe_out}
mkdir -p "$OUT"
HDR=flashinfer/data/include/flashinfer/attention
WARM=/tmp/fa3_tile_warm.py  # compiles the ragged FA3 module (head_dim 64, bf16) of one copy, checks it once
cat >"$WARM" <<'EOF'
import torch, flashinfer
ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
qo = torch.tensor([0, 300], dtype=torch.int32)
w.plan(qo, torch.tensor([0, 700], dtype=torch.int32), 4, 4, 64, causal=False, q_data_type=torch.bfloat16,
       kv_data_type=torch.bfloat16)
q, k = torch.randn(300, 4, 64, device="cuda", dtype=torch.bfloat16), torch.randn(700, 4, 64, device="cuda", dtype=torch.bfloat16)
o = w.run(q, k, k)
ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(), k.transpose(0, 1).float()).transpose(0, 1)
print("compiled; max |diff| vs SDPA", float((o.float() - ref).abs().max()))
EOF
for tiles in "$@"; do
  read -r q kv <<<"$tiles"
  dst=/tmp/site_tile_${q}_${kv}
  rm -rf "$dst" && cp -r "$SITE" "$dst" && rm -rf "$dst/flashinfer/data/aot"
  sed -i "s/return std::make_tuple(192, 128);/return std::make_tuple($q, $kv);/" "$dst/$HDR/hopper/prefill_sm90.cuh"
  sed -i "s/cta_tile_q = 192;/cta_tile_q = $q;/" "$dst/$HDR/scheduler.cuh"
  grep -c "make_tuple($q, $kv)" "$dst/$HDR/hopper/prefill_sm90.cuh" >/dev/null || { echo "patch failed"; exit 1; }
  (FLASHINFER_WORKSPACE_BASE=/tmp/ws_${q}_${kv} PYTHONPATH=$dst timeout 300 python3 "$WARM" \
    >"$OUT/compile_${q}_${kv}.log" 2>&1; echo "compile $q $kv exit $?" >>"$OUT/compile_${q}_${kv}.log") &
done
wait
for tiles in "$@"; do
  read -r q kv <<<"$tiles"
  tail -2 "$OUT/compile_${q}_${kv}.log"
  FLASHINFER_WORKSPACE_BASE=/tmp/ws_${q}_${kv} PYTHONPATH=/tmp/site_tile_${q}_${kv}:$ROOT timeout 150 \
    python3 "$ROOT/benchmarks/stream/stream_fps.py" --frames 160 --one-at-a-time-frames 0 --breakdown-frames 0 \
    --compare-frames 12 --out "$OUT/tile_${q}_${kv}.json" >/dev/null 2>>"$OUT/compile_${q}_${kv}.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('tiles', sys.argv[2], d['steady_state'], d['bf16_vs_fp32'])" \
    "$OUT/tile_${q}_${kv}.json" "$q x $kv"
done
