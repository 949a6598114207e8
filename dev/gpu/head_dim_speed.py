"""Forward and backward time of head dims that are not multiples of 16 against the next multiple of 16
(issue 11: odd dims within 10% of it), bf16, causal, N = 4096, batch 4 x 16 heads, one process.

    python dev/gpu/head_dim_speed.py 59:64 58:64 111:112 --layouts bhnd,bnhd
    python dev/gpu/head_dim_speed.py 59:64 58:64 111:112 --torch   # through fagen.attention: fwd, fwd + bwd
    python dev/gpu/head_dim_speed.py 59:64 --torch --shapes 4:16:4096,1:32:16384,32:16:512,3:16:3000

With --torch, SDPA held to its flash backend runs the odd d too, through autograd, on the same tensors
(PyTorch pads d to a multiple of 8 for it, as fagen does). --shapes: batch:heads:seq triples (default
4:16:4096).

Layouts: `bhnd` contiguous (B, H, N, d) tensors (row stride d: odd for an odd d, so such rows are not all
4-byte aligned and load element by element); `bnhd` (B, N, H, d) tensors seen as (B, H, N, d) (row stride
H d: even with 16 heads, so an even d loads by asynchronous 4-byte copies; an odd d only in the even heads,
whose slices start on a 4-byte boundary, the odd heads element by element). FAGEN_TREE=path imports fagen
from another tree (an A/B of a template change; give it its own FAGEN_CACHE_DIR)."""
import argparse
import os
import sys

sys.path.insert(0, os.environ.get("FAGEN_TREE") or
                os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import fagen
from fagen.bench.timing import time_cuda

parser = argparse.ArgumentParser()
parser.add_argument("pairs", nargs="*", default=["59:64", "111:112", "72:80", "40:48", "3:16"])
parser.add_argument("--layouts", default="bhnd")
parser.add_argument("--shapes", default="4:16:4096")
parser.add_argument("--torch", action="store_true",
                    help="time through fagen.attention (which pads d that are not multiples of 8) instead of the kernel")
args = parser.parse_args()
print(f"fagen from {os.path.dirname(fagen.__file__)}", flush=True)


def inputs(d, layout, b, h, n):
    if layout == "bnhd":
        return [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    return [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


for layout, shape, pair in ((l, s, p) for l in args.layouts.split(",") for s in args.shapes.split(",")
                            for p in args.pairs):
    b, h, n = (int(x) for x in shape.split(":"))
    odd, even = (int(x) for x in pair.split(":"))
    times = {}
    for d in (odd, even):
        kernel = fagen.compile(fagen.Spec(head_dim=d, dtype="bf16", mask="causal"))
        q, k, v, do = inputs(d, layout, b, h, n)
        if args.torch:   # forward alone, and forward + backward through autograd
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            spec = kernel.spec
            with torch.no_grad():
                fwd = time_cuda(lambda: fagen.attention(q, k, v, spec), 3, 10)
            bwd = time_cuda(lambda: torch.autograd.grad(fagen.attention(*leaves, spec), leaves, do), 3, 10)
        else:
            o, lse = kernel.forward(q, k, v)
            fwd = time_cuda(lambda: kernel.forward(q, k, v), 3, 10)
            bwd = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), 3, 10)
        plans = {p: x["family"] for p, x in kernel.record["plans"].items()}
        times[d] = (fwd, bwd, plans)
    (f1, b1, p1), (f2, b2, p2) = times[odd], times[even]
    peer = ""
    if args.torch:   # SDPA-flash at the odd d, same shapes
        q, k, v, do = inputs(odd, layout, b, h, n)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.no_grad():
            pf = time_cuda(lambda: sdpa_flash(q, k, v), 3, 10)
        pb = time_cuda(lambda: torch.autograd.grad(sdpa_flash(*leaves), leaves, do), 3, 10)
        peer = f" | SDPA-flash d={odd}: fwd {pf:.3f} ms fwd+bwd {pb:.3f} ms, fagen/flash speed {pf / f1:.2f}x {pb / b1:.2f}x"
    print(f"{layout} {b}x{h}x{n} d={odd}: fwd {f1:.3f} ms bwd {b1:.3f} ms {p1} | d={even}: fwd {f2:.3f} ms bwd {b2:.3f} ms "
          f"{p2} | slowdown fwd {f1 / f2:.2f}x bwd {b1 / b2:.2f}x{peer}", flush=True)
