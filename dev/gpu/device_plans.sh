# Device call: time candidate plans side by side with SDPA-flash (dev/gpu/plan_time.py), one spec per line.
# Every line's kernels compile first, all lines at once; then the lines time one after another.
# PRE: a command run first (e.g. a few GPU tests) while nothing is timed.
# `bash dev/gpu/device_plans.sh FILE`: the lines of FILE instead of the ones below ($OLD, $WS... expand there).
source dev/gpu/device_prelude.sh
T="timeout 200 python3 dev/gpu/plan_time.py"
WS="forward_wgmma_ws@forward"; WSF="forward_wgmma_ws_free@forward"; OLD="forward_wgmma@forward"
LINES=(
 "'{head_dim: 32, mask: causal, dtype: bf16}' --batch 4 --heads 32 --seq 4096 $OLD:128,64,8,16 $WSF:128,128,12,12"
 "'{head_dim: 96, mask: causal, dtype: bf16}' --batch 4 --seq 4096 $OLD:128,64,8,16 $WS:128,128,12,12 $WSF:128,128,12,12"
 "'{head_dim: 160, mask: causal, dtype: bf16}' --batch 4 --seq 4096 $OLD:128,128,8,8 $WS:128,128,12,12 $WS:128,64,12,12"
 "'{head_dim: 192, mask: none, dtype: bf16}' --batch 16 --seq 1024 $OLD:128,64,8,8 $WS:128,64,12,12"
 "'{head_dim: 192, mask: causal, dtype: bf16}' --batch 4 --seq 4096 $OLD:128,64,8,8 $WS:128,64,12,12"
 "'{head_dim: 256, mask: causal, dtype: bf16}' --batch 4 --seq 4096 $OLD:128,64,8,8 $WS:128,64,12,12"
 "'{head_dim: 64, mask: causal, dtype: bf16, dropout: 0.1}' --batch 4 --seq 4096 $OLD:128,64,8,16 $WSF:128,128,12,12 $WS:128,128,12,12"
 "'{head_dim: 64, mask: causal, dtype: bf16}' --batch 16 --seq 1024 $OLD:128,64,8,16 $WSF:128,128,12,12 $WS:128,128,12,12"
 "'{head_dim: 128, mask: causal, dtype: bf16}' --batch 4 --seq 8192 $OLD:128,128,8,8 $WS:128,128,12,12 $WSF:128,128,12,12"
)
[ -n "${1:-}" ] && mapfile -t LINES < <(grep -v '^#' "$1" | grep .)
for line in "${LINES[@]}"; do eval "$T $line --compile-only" > /dev/null 2>&1 & done
[ -n "${PRE:-}" ] && eval "$PRE"
wait
for line in "${LINES[@]}"; do eval "$T $line"; done
