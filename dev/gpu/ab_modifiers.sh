# A/B of the score_mod / mask_mod code path across fagen trees on one GPU, against Flex in each run:
# `VARIANTS=alibi_bf16_d128,softcap_bf16_d128 bash dev/gpu/ab_modifiers.sh . .ab_old` (trees as in ab_trees.sh).
# Each tree runs `python -m fagen.bench modifiers` in its own process and kernel cache, JSON to $OUT/modifiers_<run>_<tree>.json.
source dev/gpu/device_prelude.sh
run=0
for tree in "$@"; do
  run=$((run + 1))   # numbered, so that a tree timed twice (. .ab_old .) keeps both files
  name=${run}_$(echo "$tree" | tr -c 'a-zA-Z0-9' _)
  (cd "$tree" && FAGEN_CACHE_DIR=/tmp/fagen-cache-mods-$name PYTHONPATH=$PWD:$PYTHONPATH timeout 300 python3 -m fagen.bench modifiers \
     ${VARIANTS:+--variants $VARIANTS} --json "$OUT/modifiers_$name.json" 2>&1 | grep -v -i warn | tail -12)
done
