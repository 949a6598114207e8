"""The compiled forward's host route, one layer at a time (issue 10, point 4): from Kernel.forward up to
torch.compile(fagen.attention), against SDPA eager and compiled, on the bench's tiny shape. Each row is the
min of 3 rounds of 20000 calls, all in one process.

    python dev/gpu/op_route.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fagen
import fagen.torch as fagen_torch
from fagen.bench.model import OVERHEAD_SHAPE, OVERHEAD_SPEC

from dev.gpu.host_profile import per_op_us


def main() -> None:
    q, k, v = (torch.randn(OVERHEAD_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    key = OVERHEAD_SPEC
    kernel = fagen_torch.kernel_for(key, 0)
    op = torch.ops.fagen.attention_forward.default
    plain = torch.ops.fagen.attention_forward_plain.default

    def below_autograd():
        with torch._C._AutoDispatchBelowAutograd():
            return op(q, k, v, key)

    fagen_compiled = torch.compile(lambda q, k, v: fagen.attention(q, k, v, key), fullgraph=True)
    sdpa_compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                  fullgraph=True)
    rows = {
        "sdpa eager": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa compiled": lambda: sdpa_compiled(q, k, v),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "Kernel.forward": lambda: kernel.forward(q, k, v),
        "_forward_cuda": lambda: fagen_torch._forward_cuda(q, k, v, key),
        "op below autograd": below_autograd,
        "op (dispatcher, autograd kernel)": lambda: op(q, k, v, key),
        "plain op (dispatcher, autograd kernel)": lambda: plain(q, k, v, key),
        "fagen.attention eager": lambda: fagen.attention(q, k, v, key),
        "fagen.attention compiled": lambda: fagen_compiled(q, k, v),
    }
    for _ in range(2):
        for name, fn in rows.items():
            print(f"  {name:34s} {per_op_us(fn):7.2f} us", flush=True)
        print()


if __name__ == "__main__":
    main()
