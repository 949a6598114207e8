"""The decode kernel's split count (fagen.runtime.decode_splits) against other counts, same process, same
inputs, beside SDPA's cuDNN and flash backends: Nq = 1, 32 query / 8 K/V heads, d = 128, bf16.

    python dev/gpu/decode_splits_ab.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen
from fagen import runtime
from fagen.bench.timing import time_cuda

default_splits = runtime.decode_splits
kernel = fagen.compile(fagen.Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward", "decode"]))
for batch, kv_len in ((32, 8192), (32, 32768), (8, 16384), (1, 32768)):
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv_bytes = 2 * k.numel() * 2
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).double()
    line = [f"B={batch} Nk={kv_len}:"]
    for name, rule in (("default", lambda n: n), ("x2", lambda n: 2 * n), ("x4", lambda n: 4 * n),
                       ("x8", lambda n: 8 * n)):
        chosen = []

        def splits(*args, rule=rule, chosen=chosen, **kwargs):
            n = rule(default_splits(*args, **kwargs))
            n = max(1, min(n, args[1]))   # at most one split per tile of keys
            chosen.append(n)
            return n

        runtime.decode_splits = splits
        kernel._fast_forward.clear()   # a remembered call keeps the split count it was made with
        o = kernel.forward(q, k, v)[0]
        error = ((o.double() - want).norm() / want.norm()).item()
        us = time_cuda(lambda: kernel.forward(q, k, v), 10, 50) * 1e3
        line.append(f"{name} ({chosen[0]} splits) {us:.1f} us {kv_bytes / us / 1e6:.2f} TB/s err {error:.1e};")
    runtime.decode_splits = default_splits
    kernel._fast_forward.clear()
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        with torch.no_grad(), sdpa_kernel(backend):
            us = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 10, 50) * 1e3
        line.append(f"{backend.name} {us:.1f} us {kv_bytes / us / 1e6:.2f} TB/s;")
    print(" ".join(line), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
