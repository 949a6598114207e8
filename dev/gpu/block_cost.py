"""What a block costs apart from its tiles: one pass's main kernel's device time (torch.profiler) at one grid
(B x H x N / block) over masks that show each block a growing number of tiles (sliding windows; a window written as
a mask_mod; causal; the documents mask_mod with the modifier benchmark's document ids), with the visible (row block,
key block) pairs counted on the host. A straight line through time against pairs gives the cost per pair (its
slope) and per block (its intercept over the waves). dev/gpu/template_ab.sh runs it on two trees' templates.

    python3 dev/gpu/block_cost.py [--pass backward|forward] [--seq 2048] [--head-dim 128] [--only causal documents]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np
import torch

from dev.gpu.kernel_times import kernel_table
from fagen import jit, runtime
from fagen.bench.modifiers import document_ids
from fagen.spec import Spec


def visible_pairs(allowed, rows: int, br: int, bc: int) -> int:
    """(row block, key block) pairs with at least one allowed element; allowed(i, j) over numpy index grids."""
    i = np.arange(rows)[:, None]
    j = np.arange(rows)[None, :]
    a = allowed(i, j)
    nr, nc = -(-rows // br), -(-rows // bc)
    return int(sum(a[r * br:(r + 1) * br, c * bc:(c + 1) * bc].any() for r in range(nr) for c in range(nc)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--pass", dest="pass_name", choices=("forward", "backward"), default="backward")
    parser.add_argument("--only", nargs="*", help="the cases whose label is one of these")
    args = parser.parse_args()
    runtime.ensure_context()
    n, d, b, h = args.seq, args.head_dim, args.batch, args.heads
    base = {"head_dim": d, "dtype": "bf16"}
    cases = []
    for w in (1, 64, 192, 448, 960):
        cases.append((f"window {w}", {**base, "mask": "sliding_window", "window": w}, None,
                      lambda i, j, w=w: (j <= i) & (i - j < w)))
        cases.append((f"mask_mod window {w}", {**base, "mask": "causal", "mask_mod": f"i - j < {w}"}, None,
                      lambda i, j, w=w: (j <= i) & (i - j < w)))
    cases.append(("causal", {**base, "mask": "causal"}, None, lambda i, j: j <= i))
    prefix = n // 4   # the modifier benchmark's prefix length
    cases.append(("prefix_lm", {**base, "mask_mod": "j < prefix[b] or j <= i", "inputs": {"prefix": "int32"}},
                  {"prefix": torch.full((b,), prefix, dtype=torch.int32, device="cuda")},
                  lambda i, j: (j < prefix) | (j <= i)))
    docs = document_ids(b, n, seed=n)
    cases.append(("documents", {**base, "mask": "causal", "mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}},
                  {"doc": torch.from_numpy(docs).cuda()}, None))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(4))
    cases = [c for c in cases if not args.only or c[0] in args.only]
    jit.precompile([Spec(**fields) for _, fields, _, _ in cases], jobs=12)
    for label, fields, inputs, allowed in cases:
        kernel = jit.compile(Spec(**fields))
        plan = kernel.plans[args.pass_name]
        fargs = {"inputs": inputs} if inputs is not None else {}
        if allowed is None:
            pairs = sum(visible_pairs(lambda i, j, r=docs[s]: (j <= i) & (r[i] == r[j]), n, plan.block_r, plan.block_c)
                        for s in range(b)) * h
        else:
            pairs = visible_pairs(allowed, n, plan.block_r, plan.block_c) * b * h
        o, lse = kernel.forward(q, k, v, **fargs)
        call = (lambda: kernel.backward(q, k, v, o, lse, do, **fargs)) if args.pass_name == "backward" else \
            (lambda: kernel.forward(q, k, v, **fargs))
        rows = kernel_table(call, reps=20)
        main_us = rows[0][1][0]   # the slowest kernel of the call: the main one
        blocks = b * h * -(-n // (plan.block_c if args.pass_name == "backward" else plan.block_r))
        print(f"{label:24s} {plan.template:26s} {plan.block_r}x{plan.block_c} blocks {blocks} pairs {pairs:6d} "
              f"main {main_us:7.1f} us  per pair {main_us / pairs * 1000:6.2f} ns")


if __name__ == "__main__":
    main()
