"""Forward device time of the solver's top candidate plans for MLA specs (a value head dim unlike the query's), one
process, the same inputs: which tile the forward should take where V is narrower than Q and K.

    python3 dev/gpu/mla_plans.py          # 192 / 128 and 256 / 128, causal and not, N = 2048 and 8192
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from fagen import jit  # noqa: E402
from fagen.bench.timing import time_cuda  # noqa: E402
from fagen.runtime import device_target  # noqa: E402
from fagen.solver import solve, with_plan  # noqa: E402
from fagen.spec import Spec  # noqa: E402


def main():
    target = device_target(0)
    for head_dim, value_dim in ((192, 128), (256, 128)):
        for mask in ("none", "causal"):
            spec = Spec(head_dim=head_dim, value_head_dim=value_dim, dtype="bf16", mask=mask)
            solution = solve(spec, target)
            plans = [p for p in solution.candidates["forward"] if p.family == "forward_wgmma"][:4]
            for seq in (2048, 8192):
                batch = 16384 // seq
                q, k = (torch.randn(batch, 16, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                v = torch.randn(batch, 16, seq, value_dim, device="cuda", dtype=torch.bfloat16)
                want = None
                for plan in plans:
                    kernel = jit.kernel_for(spec, target, with_plan(solution, "forward", plan))
                    o, _ = kernel.forward(q, k, v)
                    same = "" if want is None else f" (max |diff| vs the first {(o.float() - want).abs().max().item():.1e})"
                    want = o.float() if want is None else want
                    us = 1e3 * time_cuda(lambda: kernel.forward(q, k, v), 3, 20)
                    pairs = batch * 16 * seq * seq / (2 if mask == "causal" else 1)
                    print(f"{head_dim}/{value_dim} {mask} N={seq}: {plan.block_r}x{plan.block_c} w{plan.warps} "
                          f"{us:.0f} us, {pairs * 2 * (head_dim + value_dim) / us / 1e6:.0f} TFLOP/s{same}", flush=True)


if __name__ == "__main__":
    main()
