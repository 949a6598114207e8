"""Run the decode kernel a few times for a profiler (no timing of its own): Nq = 1, 32 query / 8 K/V heads,
d = 128, bf16, B x N_k from the command line (default 32 x 8192).

    ncu --launch-skip 3 --launch-count 1 -k regex:fordec_br16 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python3 dev/gpu/profile_decode.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import fagen

batch, kv_len = (int(x) for x in (sys.argv[1:3] if len(sys.argv) > 2 else (32, 8192)))
kernel = fagen.compile(fagen.Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward", "decode"]))
q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(batch, 8, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(6):
    kernel.forward(q, k, v)
torch.cuda.synchronize()
