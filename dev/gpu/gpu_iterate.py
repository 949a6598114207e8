"""One device call while a template is being developed: correctness of chosen specs against the
float64 reference (hypothesis cases), then every candidate plan of a pass timed against SDPA-flash.

    source dev/gpu/device_prelude.sh && python3 dev/gpu/gpu_iterate.py [--pass backward] [--examples 15]
"""
import argparse
import sys
import time

from hypothesis import HealthCheck, given, settings

from fagen import jit, runtime, solver
from fagen.bench import peers, timing
from fagen.bench.report import reason
from fagen.spec import Spec
from fagen.target import from_device
from fagen.testing import assert_matches_reference, cases

CHECK_SPECS = [Spec(head_dim=d, dtype=dtype, mask=mask, dropout=p, **extra)
               for d, dtype, mask, p, extra in [
                   (64, "fp16", "none", 0.0, {}), (64, "bf16", "causal", 0.0, {}), (128, "bf16", "none", 0.0, {}),
                   (128, "fp16", "causal", 0.2, {}), (32, "bf16", "sliding_window", 0.0, {"window": 37}),
                   (96, "fp16", "padding", 0.1, {}), (64, "bf16", "block_sparse", 0.0, {"block_size": 64}),
                   (128, "bf16", "block_sparse", 0.3, {"block_size": 128}), (64, "fp16", "causal", 0.2, {})]]
TIME_SPECS = [Spec(head_dim=d, dtype="bf16", mask=mask) for d in (64, 128) for mask in ("none", "causal")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pass", dest="pass_name", default="backward")
    parser.add_argument("--examples", type=int, default=15)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--seqlens", default="")
    args = parser.parse_args()
    runtime.ensure_context()
    target = from_device()
    specs = [s.model_copy(update={"arch": target.arch}) for s in CHECK_SPECS + TIME_SPECS]
    t0 = time.time()
    jit.precompile(specs, jobs=16)
    from concurrent.futures import ThreadPoolExecutor

    from fagen.compiler import cached_cubin
    from fagen.render import render
    from fagen.sources import TEMPLATE_DIR
    sources = []
    for spec in specs[len(CHECK_SPECS):]:
        solution = solver.solve(spec, target)
        for candidate in solution.candidates[args.pass_name][:args.top]:
            sources.append(render(spec, solver.with_plan(solution, args.pass_name, candidate)))
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda text: cached_cubin(text, target.arch, TEMPLATE_DIR),
                      [text for r in sources for text in r.pass_texts.values()]))
    print(f"precompiled {len(specs)} specs in {time.time() - t0:.0f} s", flush=True)

    failures = 0
    for spec in specs[:len(CHECK_SPECS)] if args.examples else []:
        plan = solver.solve(spec, target).plans[args.pass_name]
        worst = {}

        @settings(max_examples=args.examples, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=cases(spec, max_seq=200))
        def check(case):
            errors = assert_matches_reference(spec, case, backward=args.pass_name == "backward")
            for key, value in errors.items():
                if isinstance(value, float):
                    worst[key] = max(worst.get(key, 0.0), value)
        try:
            check()
            status = "ok"
        except Exception as err:
            failures += 1
            status = "FAIL " + " ".join(str(err).split())[:600]
        print(f"{spec.canonical_name:40s} {plan.family} Br={plan.block_r} Bc={plan.block_c} W={plan.warps}: {status} "
              + " ".join(f"{k}={v:.2e}" for k, v in sorted(worst.items())), flush=True)

    import torch
    for spec in specs[len(CHECK_SPECS):] if args.top else []:
        batch, heads = timing.shape_for(spec, args.seqlen, 16384, 2048)
        inputs = timing.make_inputs(spec, batch, heads, args.seqlen)
        flops = timing.spec_flops(spec, batch, heads, args.seqlen, args.pass_name)
        if args.pass_name == "backward":
            sdpa = peers.time_sdpa_backward("flash", spec, inputs, 5, 20)
        else:
            sdpa = peers.time_sdpa_forward("flash", spec, inputs, 5, 20)
        print(f"{spec.canonical_name} N={args.seqlen} B={batch} H={heads}: sdpa-flash {flops / sdpa / 1e9:.0f} TFLOP/s", flush=True)
        solution = solver.solve(spec, target)
        for candidate in solution.candidates[args.pass_name][:args.top]:
            try:
                kernel = runtime.Kernel(spec, target, solver.with_plan(solution, args.pass_name, candidate))
                q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
                o, lse = kernel.forward(q, k, v)
                with timing.unchecked_launches():
                    if args.pass_name == "backward":
                        ms = timing.time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), 5, 20)
                    else:
                        ms = timing.time_cuda(lambda: kernel.forward(q, k, v), 5, 20)
                print(f"   {candidate.family:22s} Br={candidate.block_r:3d} Bc={candidate.block_c:3d} W={candidate.warps}: "
                      f"{flops / ms / 1e9:6.0f} TFLOP/s  {sdpa / ms:.2f}x", flush=True)
            except Exception as err:
                print(f"   Br={candidate.block_r} W={candidate.warps}: {reason(err)}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
