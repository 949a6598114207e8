# The warp-specialized d = 128 forward with mask_mods (forward_wgmma_ws, its producer handing the walk over) against
# forward_wgmma's plan it replaced (128 x 128, 8 warps, one block), in one process per variant and length
# (dev/gpu/plan_time.py, the library's inputs), then the library's mask_mods at d = 128 against Flex (`fagen.bench
# modifiers --head-dim 128`; FLEX=0 leaves it out). TESTS=1 first runs the GPU tests that reach the template with a mask_mod.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
if [ "${TESTS:-0}" = 1 ]; then
  timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_modifiers_gpu.py \
    tests/test_integrations_transformers_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -6
fi
while read -r spec; do
  for n in ${SEQS-2048 8192}; do   # (SEQS= : none)
    timeout 200 python3 dev/gpu/plan_time.py "$spec" --modifier-inputs --seq "$n" \
      forward_wgmma@forward:128,128,8,8 forward_wgmma_ws@forward:128,128,12,12 2>&1 | grep -E "us|N =" | grep -v -i warn
  done
done <<'LIST'
{head_dim: 128, dtype: bf16, mask: causal, mask_mod: "doc[b, i] == doc[b, j]", inputs: {doc: int32}}
{head_dim: 128, dtype: bf16, mask_mod: "j < prefix[b] or j <= i", inputs: {prefix: int32}}
{head_dim: 128, dtype: bf16, mask_mod: "j <= i and (i - j < 256 or j < 4)"}
{head_dim: 128, dtype: fp16, mask: causal, mask_mod: "(i - j) % 4 == 0"}
LIST
[ "${FLEX:-1}" = 1 ] && timeout 400 python3 -m fagen.bench modifiers --head-dim 128 \
  --variants window_sinks_bf16_d64,prefix_lm_bf16_d64,documents_bf16_d64,dilated_fp16_d64_sm80 \
  --json "$OUT/modifiers_d128.json" 2>&1 | grep -E "N=" | grep -v -i warn
