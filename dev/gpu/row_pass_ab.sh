# A/B of the backward's row passes (_delta, _dq_convert, _kv_group_sum) and its main kernel, device time per
# kernel (dev/gpu/kernel_times.py, torch.profiler): this tree's templates, then .ab/old/* in their place (the
# device's copy only), then this tree's again, each spec in its own process.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
SPECS=(
  "{head_dim: 128, dtype: bf16, mask: causal, mask_mod: 'doc[b, i] == doc[b, j]', inputs: {doc: int32}}|4x16x2048 4x16x8192"
  "{head_dim: 128, dtype: bf16, mask: causal}|4x16x2048"
  "{head_dim: 64, dtype: bf16, mask: causal}|4x16x2048"
)
mkdir -p /tmp/ab_new && for f in .ab/old/*; do cp templates/$(basename $f) /tmp/ab_new/; done
run() { echo "=== $1"; for entry in "${SPECS[@]}"; do
  timeout 150 python3 dev/gpu/kernel_times.py "${entry%%|*}" --shapes ${entry##*|} --backward 2>&1 | grep backward
  done; }
run "this tree"; cp .ab/old/* templates/; run "old templates"
cp /tmp/ab_new/* templates/; run "this tree again"
