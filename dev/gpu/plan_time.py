"""Time chosen tile plans of one spec side by side with SDPA-flash, in one process, on the same inputs: what
the solver's ranking would gain from another plan, including plans it rejects (a resident-block count
its register estimate rules out, which `__launch_bounds__` then enforces).

    python3 dev/gpu/plan_time.py "{head_dim: 96, mask: causal, dtype: bf16}" forward:128,128,8,8 forward:128,64,8,16 \
        backward:64,64,4,8 --batch 4 --heads 16 --seq 4096

Each plan is pass:Br,Bc,W,resident_warps; a plan of another family is given as family@pass:... . Every plan's
output is compared with the solver's own plan before it is timed (relative error printed). The median of
`--repeats` calls between CUDA events, after warm-up; fagen launches without a sync after each.
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import yaml

from fagen import jit, runtime, solver
from fagen.bench.peers import time_sdpa_backward, time_sdpa_forward
from fagen.bench.timing import make_inputs, relative_error, time_cuda, unchecked_launches
from fagen.compiler import CompileError
from fagen.cuda_driver import CudaError
from fagen.spec import Spec
from fagen.target import target_for


def parse_plan(text: str):
    head, numbers = text.split(":")
    family, _, pass_name = head.rpartition("@")
    block_r, block_c, warps, resident = map(int, numbers.split(","))
    return family or None, pass_name, block_r, block_c, warps, resident


def kernel_with(spec: Spec, family, pass_name, block_r, block_c, warps, resident):
    """The kernel of `spec` with this plan in place of the solver's. A plan outside the solver's candidates
    (a warp count or tile the family does not list, a broken constraint) is evaluated all the same, its
    broken constraints printed: the timing says whether the solver should offer it."""
    target = target_for(spec.arch)
    solution = solver.solve(spec, target)
    plan = next((p for p in solution.candidates[pass_name] if (p.block_r, p.block_c, p.warps) == (block_r, block_c, warps)
                 and (family is None or p.family == family)), None)
    if plan is None:
        chosen = solver.family_named(family or solution.plans[pass_name].family)
        plan, broken = solver.evaluate(chosen, spec, target, pass_name, block_r, block_c, warps,
                                       solution.plans[pass_name].head_dim)
        print(f"  {chosen.name} {block_r},{block_c},{warps}: not a candidate; breaks {broken or 'nothing'}")
    plan = dataclasses.replace(plan, resident_warps=resident)
    solution = dataclasses.replace(solution, plans={**solution.plans, pass_name: plan})
    return runtime.Kernel(spec, target, solution), plan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("plans", nargs="+")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--modifier-inputs", action="store_true",
                        help="mask_mod / score_mod inputs as `fagen.bench modifiers` makes them (document ids, prefix "
                             "lengths...) instead of make_inputs' (int inputs 0: one document)")
    parser.add_argument("--compile-only", action="store_true",
                        help="build (and cache) every plan's kernel, time nothing: run several at once before timing")
    args = parser.parse_args()
    spec = Spec(**yaml.safe_load(args.spec))
    if args.compile_only:
        jit.compile(spec)
        for text in args.plans:
            kernel_with(spec, *parse_plan(text))
        return
    inputs = make_inputs(spec, args.batch, args.heads, args.seq)
    if args.modifier_inputs:
        from fagen.bench.modifiers import make_case

        inputs.runtime_args["inputs"] = make_case(spec, args.batch, args.heads, args.seq).inputs
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
    if spec.layout == "packed":   # the batch as one packed batch of equal sequences (SDPA times the padded one)
        import torch

        q, k, v, do = (t.transpose(1, 2).reshape(args.batch * args.seq, args.heads, spec.head_dim).contiguous()
                       for t in (q, k, v, do))
        cu_seqlens = torch.arange(0, args.batch + 1, dtype=torch.int32, device=q.device) * args.seq
        inputs = dataclasses.replace(inputs, runtime_args={**inputs.runtime_args, "cu_seqlens_q": cu_seqlens,
                                                           "cu_seqlens_k": cu_seqlens, "max_seqlen_q": args.seq,
                                                           "max_seqlen_k": args.seq})
    base = jit.compile(spec)
    o_ref, lse_ref = base.forward(q, k, v, **inputs.runtime_args)
    grads_ref = base.backward(q, k, v, o_ref, lse_ref, do, **inputs.runtime_args) if "backward" in spec.passes else None
    print(f"{spec.variant_name} B x H = {args.batch} x {args.heads}, N = {args.seq}; solver: "
          + ", ".join(f"{p} {plan.family} Br={plan.block_r} Bc={plan.block_c} w={plan.warps} resident {plan.resident_warps}"
                      for p, plan in base.solution.plans.items()))
    flash = {"forward": 1e3 * time_sdpa_forward("flash", spec, inputs, 5, args.repeats)}
    if grads_ref is not None:
        flash["backward"] = 1e3 * time_sdpa_backward("flash", spec, inputs, 5, args.repeats)
    print("  SDPA-flash: " + ", ".join(f"{p} {us:.0f} us" for p, us in flash.items()))
    with unchecked_launches():
        for text in args.plans:
            family, pass_name, *numbers = parse_plan(text)
            try:
                kernel, plan = kernel_with(spec, family, pass_name, *numbers)
            except (CudaError, CompileError) as err:   # a plan past the device's limits (its shared memory): say so, time the rest
                print(f"  {text}: does not load ({type(err).__name__}: {err})")
                continue
            o, lse = kernel.forward(q, k, v, **inputs.runtime_args)
            if pass_name == "forward":
                error = relative_error(o, o_ref)
                us = 1e3 * time_cuda(lambda: kernel.forward(q, k, v, **inputs.runtime_args), 5, args.repeats)
            else:
                grads = kernel.backward(q, k, v, o, lse, do, **inputs.runtime_args)
                error = max(relative_error(g, r) for g, r in zip(grads, grads_ref))
                us = 1e3 * time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, **inputs.runtime_args), 5, args.repeats)
            print(f"  {pass_name} {plan.family} Br={plan.block_r} Bc={plan.block_c} w={plan.warps} resident {plan.resident_warps}: "
                  f"{us:.0f} us, flash/fagen {flash[pass_name] / us:.2f}x, err {error:.1e}")


if __name__ == "__main__":
    main()
