"""What score_mod input gradients cost in the backward (kernel level): each variant of examples/modifiers.yaml
whose score_mod reads a float tensor, its backward with and without `input_grads=True`, in one process on the
same inputs; and for ALiBi, fwd + bwd through autograd with the slopes requiring grad, fagen against
FlexAttention (whose score_mod captures the tensor, so autograd gives it a gradient).

    python3 dev/gpu/input_grad_cost.py [--seq 4096] [--batch 4] [--heads 16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

import fagen
from fagen import jit
from fagen.bench.timing import time_cuda, unchecked_launches
from fagen.spec import load_specs


def flex_alibi_step(q, k, v, do, slope):
    """FlexAttention fwd + bwd of causal ALiBi with `slope` requiring grad (captured by the score_mod)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def score_mod(score, b, h, i, j):
        return score - slope[h] * (i - j)

    n = q.shape[2]
    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n)
    compiled = torch.compile(flex_attention)

    def step():
        o = compiled(q, k, v, score_mod=score_mod, block_mask=mask)
        return torch.autograd.grad(o, (q, k, v, slope), do)

    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    specs = [s for s in load_specs("examples/modifiers.yaml") if s.modifiers.kernel_input_grads]
    for spec in specs:
        kernel = jit.compile(spec)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(args.batch, args.heads, args.seq, spec.head_dim, device="cuda", dtype=dtype,
                                   generator=generator) for _ in range(4))
        shapes = spec.modifiers.input_shapes(args.batch, args.heads, args.seq, args.seq)
        inputs = {name: 0.05 * torch.randn(tuple(shapes[name]), device="cuda") for name, _, _ in spec.modifiers.tensors}
        extra = {"inputs": inputs, "seed": 1}
        with unchecked_launches():
            o, lse = kernel.forward(q, k, v, **extra)
            plain = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, **extra), 3, 20)
            with_grads = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, input_grads=True, **extra), 3, 20)
        line = (f"{spec.variant_name} (B={args.batch}, H={args.heads}, N={args.seq}): backward {plain:.3f} ms, "
                f"with input grads {with_grads:.3f} ms ({with_grads / plain:.2f}x)")
        if spec.variant_name.startswith("alibi"):   # the one with a Flex peer (relative_bias has dropout)
            slope = inputs["slope"].clone().requires_grad_(True)
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            flex = time_cuda(flex_alibi_step(*leaves, do, slope), 3, 20)

            def fagen_step():
                o = fagen.attention(*leaves, spec, inputs={"slope": slope})
                return torch.autograd.grad(o, (*leaves, slope), do)

            ours = time_cuda(fagen_step, 3, 20)
            line += f"; fwd + bwd learning the slopes, through autograd: fagen {ours:.3f} ms, Flex {flex:.3f} ms"
        print(line, flush=True)


if __name__ == "__main__":
    main()
