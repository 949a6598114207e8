"""Where a variant's time goes, fagen against FlexAttention: each pass's kernels (torch.profiler, CUPTI),
and the same spec without its mask_mod / score_mod (the mask kind alone) on both sides, so that what the
modifier costs each library shows apart from the base kernel's speed.

    python3 dev/gpu/variant_profile.py documents_bf16_d64 prefix_lm_bf16_d64 --seq-lens 2048 8192 [--head-dim 128]
"""
import argparse

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dev.gpu.kernel_times import kernel_table
from fagen import jit, runtime
from fagen.bench import modifiers as mb
from fagen.bench.timing import time_us_after_first_call
from fagen.spec import Spec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, help="the variants at this head dim (fagen.bench modifiers --head-dim)")
    args = parser.parse_args()
    runtime.ensure_context()
    mb.allow_flex_recompiles(torch)
    flex = torch.compile(flex_attention, dynamic=False)
    for spec in mb._load(mb.SPEC_FILE, args.variants, args.head_dim):
        # the base: every variant of the library is causal or narrower, so plain causal is its mask kind alone
        base_spec = Spec(**{**spec.model_dump(exclude_none=True), "mask_mod": None, "score_mod": None,
                            "inputs": None, "mask": "causal", "name": spec.variant_name + "_base"})
        kernels = {"variant": jit.compile(spec), "base": jit.compile(base_spec)}
        for n in args.seq_lens:
            case = mb.make_case(spec, args.batch, args.heads, n, seed=n)
            mods = mb.flex_mods(spec, case.inputs)
            flex_cases = {"variant": (mods.score_mod, mb._block_mask(create_block_mask, mods, args.batch, n))}
            flex_cases["base"] = (None, create_block_mask(mb._causal, None, None, n, n, device="cuda"))
            print(f"==== {spec.variant_name} N={n} B={args.batch} H={args.heads} (base: causal)")
            for label, kernel in kernels.items():
                fargs = mb._fagen_args(spec, case) if label == "variant" else {}
                o, lse = kernel.forward(case.q, case.k, case.v, **fargs)
                fwd = lambda: kernel.forward(case.q, case.k, case.v, **fargs)
                bwd = lambda: kernel.backward(case.q, case.k, case.v, o, lse, case.do, **fargs)
                for pname, fn in (("fwd", fwd), ("bwd", bwd)):
                    us = time_us_after_first_call(fn, 10, 30)
                    print(f"fagen {label:8s} {pname}: {us:8.1f} us")
                    for key, (t, c) in kernel_table(fn)[:4]:
                        print(f"      {t:8.1f} us x{c:.0f}  {key}")
            for label, (score_mod, block_mask) in flex_cases.items():
                leaves = tuple(t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
                out = flex(*leaves, score_mod=score_mod, block_mask=block_mask)

                def fwd():
                    with torch.no_grad():
                        return flex(case.q, case.k, case.v, score_mod=score_mod, block_mask=block_mask)

                bwd = lambda: torch.autograd.grad(out, leaves, case.do, retain_graph=True)
                for pname, fn in (("fwd", fwd), ("bwd", bwd)):
                    us = time_us_after_first_call(fn, 10, 30)
                    print(f"flex  {label:8s} {pname}: {us:8.1f} us")
                    for key, (t, c) in kernel_table(fn)[:4]:
                        print(f"      {t:8.1f} us x{c:.0f}  {key}")
            del case
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
