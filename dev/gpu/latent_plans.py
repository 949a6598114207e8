"""Times the latent-cache decode (576 / 512 bf16, 64-row pages) at kernel level on plans the solver does not offer
as well as its own: (Bc, warps, cp.async stages) with the shared memory worked out for the stage count, each at
the runtime's split count and twice it. One line per (shape, plan): us per call and TB/s of cache read.

    python3 dev/gpu/latent_plans.py [LABEL]
"""
import dataclasses
import sys

import torch

from fagen import jit, runtime
from fagen.bench.decode import copy_bandwidth
from fagen.bench.mla_decode import HEAD_DIM, PAGE_SIZE, VALUE_DIM, _first_sequence_reference
from fagen.bench.timing import relative_error, time_cuda
from fagen.solver import solve
from fagen.spec import Spec

label = sys.argv[1] if len(sys.argv) > 1 else ""
scale = 192 ** -0.5
spec = Spec(head_dim=HEAD_DIM, value_head_dim=VALUE_DIM, latent_kv=True, dtype="bf16", mask="padding",
            softmax_scale=scale)
target = runtime.device_target(0)
solution = solve(spec, target)
base = solution.plans["decode"]
PLANS = ((64, 8, 2), (64, 4, 2), (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 4, 5))
SHAPES = ((32, 16, 32768), (128, 16, 4096), (128, 16, 32768), (64, 16, 8192), (1, 128, 32768), (16, 128, 8192))


def smem_bytes(block_c: int, warps: int, stages: int) -> int:   # decode_latent_mma's footprint at STAGES stages
    pitch = HEAD_DIM + 8
    return 2 * (16 * pitch + stages * block_c * pitch + 16 * (block_c + 8)) + 4 * warps * 16


kernels = {}
for block_c, warps, stages in PLANS:
    smem = smem_bytes(block_c, warps, stages)
    if smem > target.smem_per_block:
        print(f"{label} {block_c}x{warps}s{stages}: {smem} bytes of shared memory do not fit", flush=True)
        continue
    plan = dataclasses.replace(base, block_c=block_c, warps=warps, threads=32 * warps, stages=stages, smem_bytes=smem)
    chosen = dataclasses.replace(solution, plans={**solution.plans, "decode": plan},
                                 candidates={**solution.candidates, "decode": (plan,)})
    kernels[(block_c, warps, stages)] = jit.kernel_for(spec, target, chosen)
print(f"{label} solver's plan: {base.block_c}x{base.warps}s{base.stages}; copy bandwidth "
      f"{copy_bandwidth() / 1e12:.2f} TB/s", flush=True)

default_splits = runtime.kernel.decode_splits
for batch, heads, kv_len in SHAPES:
    generator = torch.Generator(device="cuda").manual_seed(batch + kv_len)
    pages = kv_len // PAGE_SIZE
    pool = torch.randn(batch * pages, PAGE_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=generator)
    table = torch.randperm(batch * pages, device="cuda", generator=generator).reshape(batch, pages).to(torch.int32)
    lengths = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, 1, HEAD_DIM, dtype=torch.bfloat16, device="cuda", generator=generator)
    k0 = pool[table[0].long()].reshape(1, kv_len, 1, HEAD_DIM).transpose(1, 2)
    expected = _first_sequence_reference(q[:1], k0, scale)
    cache_bytes = pool.numel() * 2
    results = []
    for name, kernel in kernels.items():
        for factor in (1, 2):
            chosen = []

            def splits(*args, factor=factor, chosen=chosen, **kwargs):
                chosen.append(max(1, min(factor * default_splits(*args, **kwargs), args[1])))
                return chosen[-1]

            runtime.kernel.decode_splits = splits
            kernel._fast_forward.clear()
            call = lambda: kernel.forward(q, pool, None, block_table=table, kv_lengths=lengths)[0]
            with torch.no_grad():
                error = relative_error(call()[0], expected)
                assert error < 2e-2, f"{name} B={batch}: relative error {error:.2e}"
                us = time_cuda(call, 5, 20) * 1e3
            results.append(f"{name[0]}x{name[1]}s{name[2]}/{chosen[0]} {us:.0f} us {cache_bytes / us / 1e6:.2f}")
    runtime.kernel.decode_splits = default_splits
    print(f"{label} B={batch} H={heads} Nk={kv_len} (plan/splits us TB/s): " + "; ".join(results), flush=True)
    del pool, q
    torch.cuda.empty_cache()
