"""Forward-only A/B of fagen trees on one GPU (bf16, median of 40 calls between CUDA events, no sync per launch),
driven by `AB_FORWARD=1 bash dev/gpu/ab_trees.sh . .ab_old`: `python3 dev/gpu/forward_ab.py TREE LABEL
[--compile-only]`. The cases: head dims 32-256 with and without masks and dropout (the set the copies' order was
chosen on); with WIDE=1, other shapes at d > 128 (odd lengths, long sequences, windows, d = 224, and d = 176 / 144,
which run forward_fa2_mma: controls). Each output's sum is printed beside its time, so that trees that disagree
show it."""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from fagen import jit, runtime
from fagen.bench.timing import time_cuda
from fagen.spec import Spec
CASES = [  # (d, mask, dropout, window, B, H, N)
 (192, "none", 0.0, None, 8, 8, 1024), (192, "none", 0.0, None, 16, 16, 1024), (192, "none", 0.0, None, 2, 16, 3001),
 (192, "causal", 0.0, None, 4, 16, 4096), (192, "causal", 0.1, None, 4, 16, 4096),
 (160, "causal", 0.0, None, 4, 16, 4096), (160, "none", 0.0, None, 8, 8, 1024),
 (256, "causal", 0.0, None, 4, 16, 4096), (256, "none", 0.0, None, 2, 16, 3000), (256, "none", 0.0, None, 8, 8, 1024),
 (64, "causal", 0.0, None, 4, 32, 4096), (64, "none", 0.0, None, 4, 32, 4096), (64, "causal", 0.0, None, 16, 16, 1024),
 (64, "causal", 0.1, None, 4, 32, 4096), (64, "sliding_window", 0.0, 1024, 2, 16, 8192),
 (96, "causal", 0.0, None, 4, 16, 4096), (32, "causal", 0.0, None, 4, 16, 4096),
]
if os.environ.get("WIDE"):
    CASES = [
     (192, "none", 0.0, None, 8, 8, 1024), (192, "none", 0.0, None, 2, 16, 3001),
     (192, "causal", 0.0, None, 4, 16, 4096), (192, "causal", 0.0, None, 16, 16, 1024), (192, "causal", 0.0, None, 1, 16, 16384),
     (192, "causal", 0.0, None, 2, 16, 3001), (192, "sliding_window", 0.0, 1024, 2, 16, 8192), (192, "none", 0.1, None, 2, 16, 2048),
     (160, "none", 0.0, None, 2, 16, 3000), (160, "causal", 0.0, None, 1, 16, 16384),
     (256, "causal", 0.0, None, 1, 16, 16384), (256, "causal", 0.0, None, 2, 16, 3000), (256, "none", 0.0, None, 16, 16, 1024),
     (256, "sliding_window", 0.0, 1024, 2, 16, 8192), (256, "causal", 0.1, None, 4, 16, 4096),
     (224, "causal", 0.0, None, 4, 16, 4096), (176, "none", 0.0, None, 4, 16, 2048), (144, "causal", 0.0, None, 4, 16, 4096),
    ]
specs = [Spec(head_dim=d, dtype="bf16", mask=m, dropout=p, window=w, passes=("forward",)) for d, m, p, w, *_ in CASES]
if "--compile-only" in sys.argv:
    jit.precompile(specs, jobs=8); sys.exit()
runtime.ensure_context()
runtime.CHECK_LAUNCHES = False
out = []
for spec, (d, m, p, w, B, H, N) in zip(specs, CASES):
    k = jit.compile(spec)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, kk, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    o, _ = k.forward(q, kk, v)
    s = float(o.float().abs().sum())
    out.append(f"d{d} {m}{'' if p == 0 else ' drop'} {B}x{H}x{N}: {1e3 * time_cuda(lambda: k.forward(q, kk, v), 5, 40):.0f} us (sum {s:.6e})")
print(sys.argv[2], "\n  " + "\n  ".join(out), flush=True)
