# A/B of the backward's row passes (_delta, _dq_convert, _kv_group_sum) and its main kernel, device time per
# kernel (dev/gpu/kernel_times.py, torch.profiler): this tree's templates, then .ab/old/* in their place (the
# device's copy only), then this tree's again, each spec in its own process.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
SPECS=(
  "{head_dim: 128, dtype: bf16, mask: causal, mask_mod: 'doc[b, i] == doc[b, j]', inputs: {doc: int32}}|4x16x2048 4x16x8192"
  "{head_dim: 128, dtype: bf16, mask: causal}|4x16x2048"
  "{head_dim: 64, dtype: bf16, mask: causal}|4x16x2048"
)
run() { echo "=== $1"; for entry in "${SPECS[@]}"; do
  timeout 150 python3 dev/gpu/kernel_times.py "${entry%%|*}" --shapes ${entry##*|} --backward 2>&1 | grep backward
  done; }
ab_templates run
