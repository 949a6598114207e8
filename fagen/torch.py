"""PyTorch adapter: `fagen.attention(q, k, v, spec, **runtime_args)` with autograd.

The forward saves q, k, v, o and the LSE (no N x N tensor); the backward regenerates P and the
dropout mask from them (FlashAttention-1 Algorithm 4), so gradients flow through `loss.backward()`.
"""
from __future__ import annotations

import torch

from fagen.runtime import compile as compile_spec


class _FagenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel, runtime_args):
        o, lse = kernel.forward(q, k, v, **runtime_args)
        ctx.kernel, ctx.runtime_args = kernel, runtime_args
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        if "backward" not in ctx.kernel.solution.plans:
            raise RuntimeError(f"{ctx.kernel.spec.variant_name} has no backward pass: add 'backward' to its passes")
        # Gradients through the LSE output are not supported (it is returned for inspection only).
        dq, dk, dv = ctx.kernel.backward(q, k, v, o, lse, grad_o.contiguous(), **ctx.runtime_args)
        return dq, dk, dv, None, None


def attention(q, k, v, spec, *, kv_lengths=None, block_mask=None, seed: int = 0, offset: int = 0,
              return_lse: bool = False):
    """Attention of q, k, v (batch, heads, seq, head_dim) under `spec`, differentiable in q, k and v."""
    kernel = compile_spec(spec)
    runtime_args = {"kv_lengths": kv_lengths, "block_mask": block_mask, "seed": seed, "offset": offset}
    o, lse = _FagenAttention.apply(q, k, v, kernel, runtime_args)
    return (o, lse) if return_lse else o
