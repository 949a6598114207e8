"""What a score_mod costs the decode pass (kernel level): one new query per sequence against a KV cache
(H = 32 query heads, 8 K/V heads, d = 128, bf16), the plain spec against soft-capping (a tanh per score)
and ALiBi (slopes read per row), in one process on the same inputs, as time and K/V bytes per second.

    python3 dev/gpu/decode_mod_cost.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from fagen import jit
from fagen.bench.timing import time_cuda, unchecked_launches
from fagen.spec import Spec

VARIANTS = {
    "plain": (Spec(head_dim=128, dtype="bf16", passes=["forward", "decode"]), lambda heads: {}),
    "softcap": (Spec(head_dim=128, dtype="bf16", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"},
                     passes=["forward", "decode"]), lambda heads: {"inputs": {"cap": 30.0}}),
    "alibi": (Spec(head_dim=128, dtype="bf16", score_mod="score - slope[h] * (i - j)", inputs={"slope": "float32"},
                   passes=["forward", "decode"]),
              lambda heads: {"inputs": {"slope": torch.tensor([2.0 ** -(n + 1) for n in range(heads)], device="cuda")}}),
}


def main() -> None:
    heads, kv_heads, d = 32, 8, 128
    kernels = {name: (jit.compile(spec), extra(heads)) for name, (spec, extra) in VARIANTS.items()}
    for batch in (1, 32):
        for seq_k in (8192, 32768):
            generator = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16, generator=generator)
            k, v = (torch.randn(batch, kv_heads, seq_k, d, device="cuda", dtype=torch.bfloat16, generator=generator)
                    for _ in range(2))
            kv_bytes = 2 * batch * kv_heads * seq_k * d * 2
            line = [f"B={batch} Nk={seq_k}:"]
            with unchecked_launches():
                for name, (kernel, extra) in kernels.items():
                    ms = time_cuda(lambda: kernel.forward(q, k, v, **extra), 10, 50)
                    line.append(f"{name} {1e3 * ms:.1f} us ({kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s)")
            print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
