#!/usr/bin/env bash
# Install FlashInfer JIT caches brought from an earlier GPU machine (.ficache/*.tgz, each a
# tar of ~/.cache/flashinfer) as FlashInfer's ahead-of-time builds in SITE (default
# /tmp/site), so a fresh machine loads the compiled modules instead of JIT-compiling them
# (~90 s each). Only the .so files are used; FlashInfer checks nothing else for AOT
# modules, so the caches must come from the same FlashInfer version (their paths name it).
#   bash benchmarks/kernels/fi_aot_cache.sh [SITE]
SITE=${1:-/tmp/site}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TMP=$(mktemp -d)
for t in "$ROOT"/.ficache/*.tgz; do
  [[ -f "$t" ]] && tar xzf "$t" -C "$TMP"
done
n=0
for so in "$TMP"/flashinfer/*/*/cached_ops/*/*.so; do
  [[ -f "$so" ]] || continue
  name=$(basename "$so" .so)
  mkdir -p "$SITE/flashinfer/data/aot/$name" && cp "$so" "$SITE/flashinfer/data/aot/$name/" && n=$((n + 1))
done
rm -rf "$TMP"
echo "FlashInfer: $n cached module(s) installed as AOT builds in $SITE"
