"""Host time of fagen.attention under torch.compile through the full ops and through the plain ops
(fagen.torch.PLAIN_OPS), on the CPU: the ops' CUDA kernels are replaced by CPU kernels that only allocate
the outputs, so what is timed is the route (dynamo's guards, the generated code, the dispatcher, fagen's
Autograd kernel and autograd), not attention. Needs torch (a CPU build is enough); no GPU.

    python dev/plain_ops_cost.py [--calls 5000]
"""
from __future__ import annotations

import argparse
import time

import torch

import fagen
import fagen.torch as fagen_torch

SPEC = '{"head_dim": 64, "dtype": "bf16", "mask": "causal"}'


def _outputs_only() -> None:
    def forward(q, k, v, spec, *rest):
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward(q, k, v, o, lse, grad_o, grad_lse, spec, *rest):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    for name in ("attention_forward", "attention_forward_plain"):
        fagen_torch._library.impl(name, forward, "CPU")
    for name in ("attention_backward", "attention_backward_plain"):
        fagen_torch._library.impl(name, backward, "CPU")


def _us(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    _outputs_only()
    q, k, v, grad = (torch.randn(1, 1, 128, 64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for round_number in range(2):
        for plain in (False, True):
            fagen_torch.PLAIN_OPS = plain
            torch._dynamo.reset()
            compiled = torch.compile(lambda q, k, v: fagen.attention(q, k, v, SPEC), fullgraph=True)
            forward = _us(lambda: compiled(q, k, v), args.calls)
            both = _us(lambda: torch.autograd.grad(compiled(*leaves), leaves, grad), args.calls)
            print(f"round {round_number} {'plain ops' if plain else 'full ops ':9s}: compiled forward {forward:7.2f} us, "
                  f"compiled forward + backward {both:7.2f} us")


if __name__ == "__main__":
    main()
