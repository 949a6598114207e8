"""Device time per kernel of one spec's forward (and backward), by torch.profiler (CUPTI): what a launch costs
on the GPU, apart from the host's time per call that CUDA-event timings of small shapes include.

    python3 dev/gpu/kernel_times.py "{head_dim: 128, dtype: bf16, mask: causal}" --shapes 8x16x1024 4x16x2048 [--backward]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from fagen import jit
from fagen.bench.modifiers import make_case
from fagen.spec import Spec


def kernel_table(fn, reps: int = 10) -> list:
    """[(kernel name (70 characters), (device µs per call, launches per call))], slowest first: fn's kernels as
    torch.profiler (CUPTI) sees them over `reps` calls, after one call outside the profile."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.count:
            rows[event.key[:70]] = (event.device_time_total / reps, event.count / reps)
    return sorted(rows.items(), key=lambda kv: -kv[1][0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("--shapes", nargs="+", default=["4x16x2048"], help="BxHxN")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    spec = Spec(**yaml.safe_load(args.spec))
    kernel = jit.compile(spec)
    for shape in args.shapes:
        batch, heads, seq = map(int, shape.split("x"))
        case = make_case(spec, batch, heads, seq, seed=seq)
        extra = {"inputs": case.inputs} if case.inputs else {}
        o, lse = kernel.forward(case.q, case.k, case.v, **extra)
        passes = [("forward", lambda: kernel.forward(case.q, case.k, case.v, **extra))]
        if args.backward:
            passes.append(("backward", lambda: kernel.backward(case.q, case.k, case.v, o, lse, case.do, **extra)))
        for name, fn in passes:
            rows = kernel_table(fn, 20)
            print(f"{spec.variant_name} {shape} {name}: {sum(t for _, (t, _) in rows):.1f} us on the device: "
                  + ", ".join(f"{key[-28:]} {t:.1f}" for key, (t, _) in rows))


if __name__ == "__main__":
    main()
