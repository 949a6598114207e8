# A/B of the d = 128 forward across fagen trees (`bash dev/gpu/forward_d128_ab.sh .ab_prev`, the other tree with
# dev/gpu/kernel_times.py copied in): device time per call (dev/gpu/kernel_times.py) on short and long shapes and
# masks, each tree in its own process and kernel cache, twice, alternating. (Used for the persistent warp-specialized
# forward tried on 2026-11-25, docs/benchmarks-journal.md.)
source dev/gpu/device_prelude.sh >/dev/null 2>&1
old=$1
for tree in . "$old" . "$old"; do
  echo "== tree $tree"
  while read -r shapes spec; do
    (cd "$tree" && FAGEN_CACHE_DIR=/tmp/fagen-cache-ab-$(basename "$tree") PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python3 dev/gpu/kernel_times.py \
       "$spec" --shapes ${shapes//,/ } 2>&1 | grep "on the device" | sed -E 's/ on the device:.*//')
  done <<'LIST'
16x16x1024,4x16x2048,4x16x4096,1x16x16384 {head_dim: 128, dtype: bf16, mask: causal}
8x16x1024,4x16x4096 {head_dim: 128, dtype: bf16}
4x16x2048 {head_dim: 128, dtype: bf16, mask: causal, dropout: 0.1}
4x16x2048,4x16x8192 {head_dim: 128, dtype: bf16, mask: causal, mask_mod: "doc[b, i] == doc[b, j]", inputs: {doc: int32}}
4x16x2048 {head_dim: 128, dtype: bf16, mask_mod: "j < prefix[b] or j <= i", inputs: {prefix: int32}}
2x16x8192 {head_dim: 128, dtype: fp16, mask: sliding_window, window: 1024}
LIST
done
