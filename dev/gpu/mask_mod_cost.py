"""What a mask_mod's tile tests cost: the document mask (examples/modifiers.yaml) timed with real document
ids, with one document (every causal tile visible, every tile still tested), and the plain causal spec,
in one process, same inputs; plus the number of visible (Br x Bc) tiles each case computes.

    python3 dev/gpu/mask_mod_cost.py [--seq 8192] [--batch 4] [--heads 16]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch

from fagen import jit
from fagen.bench.modifiers import document_ids
from fagen.bench.timing import time_cuda, unchecked_launches
from fagen.spec import Spec, load_specs


def visible_tiles(doc: np.ndarray, block_r: int, block_c: int) -> int:
    """Tiles of block_r queries x block_c keys holding a causal pair of one document, over the batch."""
    count = 0
    n = doc.shape[1]
    for row in doc:
        for r0 in range(0, n, block_r):
            rows = np.arange(r0, min(r0 + block_r, n))
            for c0 in range(0, min(n, r0 + block_r), block_c):
                cols = np.arange(c0, min(c0 + block_c, n))
                same = row[rows][:, None] == row[cols][None, :]
                if (same & (cols[None, :] <= rows[:, None])).any():
                    count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    spec = next(s for s in load_specs("examples/modifiers.yaml") if s.variant_name == "documents_bf16_d64")
    plain = Spec(head_dim=spec.head_dim, dtype=spec.dtype, mask=spec.mask)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(args.batch, args.heads, args.seq, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    docs = document_ids(args.batch, args.seq)
    cases = {"documents": (spec, {"inputs": {"doc": torch.from_numpy(docs).cuda()}}),
             "one document": (spec, {"inputs": {"doc": torch.zeros_like(torch.from_numpy(docs)).cuda()}}),
             "causal, no mask_mod": (plain, {})}
    with unchecked_launches():
        for name, (case_spec, extra) in cases.items():
            kernel = jit.compile(case_spec)
            o, lse = kernel.forward(q, k, v, **extra)
            forward = time_cuda(lambda: kernel.forward(q, k, v, **extra), 3, 20)
            backward = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, **extra), 3, 20)
            plan = kernel.solution.plans["forward"]
            ids = docs if name == "documents" else np.zeros_like(docs)
            tiles = visible_tiles(ids, plan.block_r, plan.block_c)
            print(f"{name}: forward {1e3 * forward:.0f} us, backward {1e3 * backward:.0f} us; forward tiles "
                  f"({plan.block_r} x {plan.block_c}) {tiles} per head, {1e6 * forward / (tiles * args.heads):.2f} ns per tile-head")


if __name__ == "__main__":
    main()
