"""Decode-kernel time of one fagen tree, beside SDPA's cuDNN and flash backends, for A/B runs of the decode
template (Nq = 1, 32 query / 8 K/V heads, d = 128, bf16; every output checked against SDPA's math backend).

    FAGEN_TREE=.ab_old FAGEN_CACHE_DIR=/tmp/c-old python3 dev/gpu/decode_time.py old
    DECODE_PLAN=64x4 python3 dev/gpu/decode_time.py bc64   # the decode pass on Bc = 64, 4 warps (an autotune entry)
    SPLIT_FACTORS=1,2,4,8 python3 dev/gpu/decode_time.py splits   # also at 2, 4, 8 times the runtime's split count
"""
import os
import sys

sys.path.insert(0, os.environ.get("FAGEN_TREE") or
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen
from fagen import runtime, tuning
from fagen.bench.timing import time_cuda

label = sys.argv[1] if len(sys.argv) > 1 else "tree"
spec = fagen.Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward", "decode"])
if os.environ.get("DECODE_PLAN"):   # before any compile: a plan cached on disk would be taken as it is
    from fagen import solver

    block_c, warps = (int(x) for x in os.environ["DECODE_PLAN"].split("x"))
    target = runtime.device_target(0)
    tuning.store(spec.model_copy(update={"arch": target.arch}), target.name,
                 {"passes": {"decode": {"family": "decode_splitkv_mma", "block_r": 16, "block_c": block_c,
                                        "warps": warps, "stages": getattr(solver, "DECODE_STAGES", 2)}}})
kernel = fagen.compile(spec)
plan = kernel.plans["decode"]
default_splits = runtime.kernel.decode_splits
SPLIT_FACTORS = [int(x) for x in os.environ.get("SPLIT_FACTORS", "1").split(",")]
print(f"{label}: fagen from {os.path.dirname(fagen.__file__)}, decode plan Bc={plan.block_c} warps={plan.threads // 32} "
      f"stages={plan.stages} smem={plan.smem_bytes}", flush=True)
for batch, kv_len in ((32, 8192), (32, 32768), (8, 16384), (4, 4096), (1, 32768)):
    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, kv_len, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv_bytes = 2 * k.numel() * 2
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).double()
    line, base_us = [f"{label} B={batch} Nk={kv_len}:"], None
    for factor in SPLIT_FACTORS:
        chosen = []

        def splits(*args, factor=factor, chosen=chosen, **kwargs):   # at most one split per tile of keys (args[1])
            chosen.append(max(1, min(factor * default_splits(*args, **kwargs), args[1])))
            return chosen[-1]

        runtime.kernel.decode_splits = splits
        kernel._fast_forward.clear()   # a remembered call keeps the split count it was made with
        o = kernel.forward(q, k, v)[0]
        error = ((o.double() - want).norm() / want.norm()).item()
        assert error < 1e-2, f"B={batch} Nk={kv_len}: relative error {error:.2e}"
        us = time_cuda(lambda: kernel.forward(q, k, v), 10, 50) * 1e3
        base_us = base_us or us   # the peers are compared with the first factor's time
        line.append(f"fagen ({chosen[0]} splits) {us:.1f} us {kv_bytes / us / 1e6:.2f} TB/s (err {error:.1e});")
    runtime.kernel.decode_splits = default_splits
    kernel._fast_forward.clear()
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        with torch.no_grad(), sdpa_kernel(backend):
            peer = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), 10, 50) * 1e3
        line.append(f"{backend.name.split('_')[0].lower()} {peer:.1f} us (fagen {peer / base_us:.2f}x);")
    print(" ".join(line), flush=True)
    del q, k, v, want
    torch.cuda.empty_cache()
