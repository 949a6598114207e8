"""Times the fp8 forward's candidate plans (and fagen's bf16 forward on the same values) at kernel level on one
FlashAttention-3 grid row per head dim: `python dev/gpu/fp8_plans.py [LABEL]`. One line per plan, TFLOP/s."""
import sys

import torch

from fagen import jit
from fagen.bench.timing import attention_flops, time_cuda
from fagen.solver import solve, with_plan
from fagen.spec import Spec
from fagen.target import target_for

label = sys.argv[1] if len(sys.argv) > 1 else ""
target = target_for("sm_90")
for head_dim, heads, wanted in ((128, 16, ((128, 128, 12), (128, 64, 12), (128, 128, 8), (64, 128, 4), (128, 64, 8), (64, 64, 4))),
                                (256, 8, ((128, 64, 8), (64, 64, 4), (64, 128, 4)))):
    for mask in ("none", "causal"):
        spec = Spec(head_dim=head_dim, dtype="fp8_e4m3", mask=mask)
        solution = solve(spec, target)
        q, k, v = (torch.randn(2, heads, 8192, head_dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
        flops = attention_flops(2, heads, 8192, 8192, head_dim, mask=mask, pass_name="forward")
        results = []
        for plan in solution.candidates["forward"]:
            if (plan.block_r, plan.block_c, plan.warps) not in wanted:
                continue
            kernel = jit.kernel_for(spec, target, with_plan(solution, "forward", plan))
            ms = time_cuda(lambda: kernel.forward(q, k, v), 3, 10, 10.0)
            results.append(f"{plan.family} {plan.block_r}x{plan.block_c}w{plan.warps} {flops / ms / 1e9:.0f}")
        bf16 = jit.compile(Spec(head_dim=head_dim, dtype="bf16", mask=mask, passes=["forward"]))
        q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
        ms = time_cuda(lambda: bf16.forward(q16, k16, v16), 3, 10, 10.0)
        print(f"{label} d{head_dim} {mask}: fp8 " + ", ".join(results) + f"; bf16 {flops / ms / 1e9:.0f} TFLOP/s",
              flush=True)
