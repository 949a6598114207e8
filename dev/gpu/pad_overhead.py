"""Host time per call of fagen.attention at a launch-bound shape (1 x 8 x 128), d = 64 against d = 59 (padded
to 64 by fagen/pad_rows.py), forward under no_grad and forward + backward; then where d = 59's forward spends it
(cProfile, top entries by own time).

    python3 dev/gpu/pad_overhead.py
"""
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import fagen
from dev.gpu.runtime_probe import per_call_us

CALLS = 500

for d in (64, 59):
    spec = fagen.Spec(head_dim=d, dtype="bf16", mask="causal")
    q, k, v = (torch.randn(1, 8, 128, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        forward = per_call_us(lambda: fagen.attention(q, k, v, spec), CALLS)
    both = per_call_us(lambda: torch.autograd.grad(fagen.attention(q, k, v, spec).sum(), (q, k, v)), CALLS)
    print(f"d={d}: forward {forward:.1f} us per call, forward + backward {both:.1f} us", flush=True)

spec = fagen.Spec(head_dim=59, dtype="bf16", mask="causal")
q, k, v = (torch.randn(1, 8, 128, 59, device="cuda", dtype=torch.bfloat16) for _ in range(3))
profile = cProfile.Profile()
with torch.no_grad():
    profile.enable()
    for _ in range(200):
        fagen.attention(q, k, v, spec)
    profile.disable()
torch.cuda.synchronize()
pstats.Stats(profile).sort_stats("tottime").print_stats(14)

q, k, v = (t.requires_grad_() for t in (q, k, v))
profile = cProfile.Profile()
profile.enable()
for _ in range(100):
    torch.autograd.grad(fagen.attention(q, k, v, spec).sum(), (q, k, v))
profile.disable()
torch.cuda.synchronize()
print("forward + backward:")
pstats.Stats(profile).sort_stats("tottime").print_stats(14)
