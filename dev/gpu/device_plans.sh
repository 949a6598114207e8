# Device call: time candidate plans side by side with SDPA-flash (dev/gpu/plan_time.py), one spec per line.
source dev/gpu/device_prelude.sh
T="timeout 150 python3 dev/gpu/plan_time.py"
$T "{head_dim: 96, mask: causal, dtype: bf16}" forward:128,128,8,8 forward:128,64,8,16 forward:64,64,4,12 forward:64,128,4,8 \
   forward_fa2_mma@forward:128,64,4,8 backward:64,64,4,8 backward_fa2_mma@backward:64,128,8,8 backward_fa2_mma@backward:64,64,4,8
$T "{head_dim: 96, mask: causal, dtype: bf16, dropout: 0.1}" forward:128,128,8,8 forward:128,64,8,16 forward:64,64,4,12 \
   forward_fa2_mma@forward:128,64,4,8 backward:64,64,4,8
$T "{head_dim: 32, mask: causal, dtype: bf16}" forward:128,64,8,16 forward:128,128,8,8 forward_fa2_mma@forward:128,128,4,8 \
   backward:128,128,8,8 backward_fa2_mma@backward:128,128,8,8
$T "{head_dim: 160, mask: causal, dtype: bf16}" forward:128,128,8,8 forward:128,64,8,8 forward_fa2_mma_qsmem@forward:128,32,4,8
$T "{head_dim: 96, mask: none, dtype: bf16}" --batch 2 --seq 3000 forward:128,128,8,8 forward:128,64,8,16 forward_fa2_mma@forward:128,64,4,8 \
   backward:64,64,4,8 backward_fa2_mma@backward:64,128,8,8
