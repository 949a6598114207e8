"""Run one fagen kernel a few times so that a profiler can look at it (no timing of its own).

    ncu --clock-control none --launch-skip 2 --launch-count 1 -k regex:fagen_fwd \
        python3 dev/gpu/profile_one.py --head-dim 128 --seqlen 4096 [--mask causal] [--block-c 128] [--family forward_wgmma]
"""
import argparse

import torch
import yaml

from fagen import runtime, solver
from fagen.bench import timing
from fagen.spec import Spec
from fagen.target import from_device


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--mask", default="none")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--pass", dest="pass_name", default="forward")
    parser.add_argument("--family", default="")
    parser.add_argument("--block-c", type=int, default=0)
    parser.add_argument("--block-r", type=int, default=0)
    parser.add_argument("--spec", default="", help="more spec fields as inline YAML, e.g. "
                        "\"{score_mod: 'score + slope[h]', inputs: {slope: float32}}\"")
    args = parser.parse_args()
    runtime.ensure_context()
    target = from_device()
    extra = yaml.safe_load(args.spec) if args.spec else {}
    spec = Spec(**{"head_dim": args.head_dim, "dtype": args.dtype, "mask": args.mask, "arch": target.arch, **extra})
    solution = solver.solve(spec, target)
    chosen = [c for c in solution.candidates[args.pass_name]
              if (not args.family or c.family == args.family) and (not args.block_c or c.block_c == args.block_c)
              and (not args.block_r or c.block_r == args.block_r)][0]
    print("plan:", chosen)
    kernel = runtime.Kernel(spec, target, solver.with_plan(solution, args.pass_name, chosen))
    batch, heads = timing.shape_for(spec, args.seqlen, 16384, 2048)
    inputs = timing.make_inputs(spec, batch, heads, args.seqlen)
    o, lse = kernel.forward(inputs.q, inputs.k, inputs.v, **inputs.runtime_args)
    for _ in range(3):
        if args.pass_name == "forward":
            kernel.forward(inputs.q, inputs.k, inputs.v, **inputs.runtime_args)
        else:
            kernel.backward(inputs.q, inputs.k, inputs.v, o, lse, inputs.do, **inputs.runtime_args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
