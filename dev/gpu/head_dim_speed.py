"""Forward and backward time of head dims that are not multiples of 16 against the next multiple of 16
(issue 11: odd dims within 10% of it), bf16, causal, N = 4096, batch 4 x 16 heads, one process.
    python dev/gpu/head_dim_speed.py"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import fagen
from fagen.bench.timing import time_cuda

PAIRS = [(59, 64), (111, 112), (72, 80), (40, 48), (3, 16)]
for odd, even in PAIRS:
    times = {}
    for d in (odd, even):
        kernel = fagen.compile(fagen.Spec(head_dim=d, dtype="bf16", mask="causal"))
        q, k, v, do = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = kernel.forward(q, k, v)
        fwd = time_cuda(lambda: kernel.forward(q, k, v), 3, 10)
        bwd = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), 3, 10)
        plans = {p: x["family"] for p, x in kernel.record["plans"].items()}
        times[d] = (fwd, bwd, plans)
    (f1, b1, p1), (f2, b2, p2) = times[odd], times[even]
    print(f"d={odd}: fwd {f1:.3f} ms bwd {b1:.3f} ms {p1} | d={even}: fwd {f2:.3f} ms bwd {b2:.3f} ms {p2} | "
          f"slowdown fwd {f1 / f2:.2f}x bwd {b1 / b2:.2f}x", flush=True)
