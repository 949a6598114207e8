"""The head-dim padding kernel (fagen/pad_rows.py) timed against F.pad and against a plain copy of the same
bytes (torch's clone of contiguous tensors: what moving them costs at best), q, k, v at once, bf16.

    python dev/gpu/pad_rows_speed.py      # (B, H, N, d) = (4, 16, 4096, d) contiguous and (B, N, H, d) transposed
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from fagen import pad_rows
from fagen.bench.timing import time_cuda

for d, padded in ((59, 64), (111, 112), (3, 8), (200, 208)):
    for layout in ("bhnd", "bnhd"):
        shape = (4, 16, 4096, d) if layout == "bhnd" else (4, 4096, 16, d)
        qkv = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        if layout == "bnhd":
            qkv = [t.transpose(1, 2) for t in qkv]
        ours = pad_rows.pad(qkv, padded)
        assert all(torch.equal(p, torch.nn.functional.pad(t, (0, padded - d))) for t, p in zip(qkv, ours))
        kernel = time_cuda(lambda: pad_rows.pad(qkv, padded), 5, 30) * 1e3
        f_pad = time_cuda(lambda: [torch.nn.functional.pad(t, (0, padded - d)) for t in qkv], 5, 30) * 1e3
        copy = time_cuda(lambda: [p.clone() for p in ours], 5, 30) * 1e3
        moved = sum(t.numel() * 2 + p.numel() * 2 for t, p in zip(qkv, ours))
        print(f"d={d}->{padded} {layout}: pad_rows {kernel:.1f} us ({moved / kernel / 1e6:.2f} TB/s), F.pad x3 "
              f"{f_pad:.1f} us, clone of the padded x3 {copy:.1f} us ({sum(p.numel() * 4 for p in ours) / copy / 1e6:.2f} TB/s)",
              flush=True)
