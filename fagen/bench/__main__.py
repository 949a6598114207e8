"""`python -m fagen.bench`: helpers around saved `fagen bench` results.

`extras` (compile and cache-load time, the bf16 GEMM rate and the ptxas report, for BENCHMARKS.md),
`decode` (one query against a long KV cache, against SDPA and FlexAttention, as bandwidth),
`varlen` (packed variable-length batches against SDPA on the padded batch),
`paged` (packed query rows against a paged K/V cache, against the contiguous call and SDPA),
`mla` (a value head dim unlike the query's, DeepSeek's 192 / 128, against cuDNN, SDPA-flash and Flex),
`mla-decode` (decoding from MLA's latent cache, 576 / 512, paged, as bandwidth against the copy rate and peers),
`fp8` (the e4m3 forward against cuDNN's and fagen's bf16 forwards on the same values),
`modifiers` (the mask_mod / score_mod variants of examples/modifiers.yaml against FlexAttention),
`plot` (redraw a PNG from a saved JSON) and `markdown` (the tables of BENCHMARKS.md from a saved JSON).
"""
from __future__ import annotations

import json as json_module
from pathlib import Path
from typing import Optional, Sequence

from fagen.bench.extras import measure_compile_times, measure_gemm_tflops, ptxas_report
from fagen.bench.report import BenchReport, efficiency, environment, markdown, plot_report, reason
from fagen.spec import Spec


def _pick_variant(specs: list[Spec], name: Optional[str]) -> Spec:
    if name:
        for spec in specs:
            if spec.variant_name == name:
                return spec
        raise SystemExit(f"no variant named {name!r}; the file has: {', '.join(s.variant_name for s in specs)}")
    for spec in specs:  # the issue's: the d = 128 forward, bf16, no dropout, not causal
        if spec.head_dim == 128 and spec.dtype == "bf16" and not spec.dropout and spec.mask == "none":
            return spec
    return specs[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fagen.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    extras = sub.add_parser("extras", help="GPU: cold compile / cache-load time, bf16 GEMM rate, ptxas report")
    extras.add_argument("spec_file")
    extras.add_argument("--variant", help="default: the first bf16, d=128, mask none, no-dropout variant")
    extras.add_argument("--json", dest="json_path", help="write the results here too")
    extras.add_argument("--skip-compile-times", action="store_true")
    decode = sub.add_parser("decode", help="GPU: decoding against SDPA and FlexAttention, as HBM bandwidth")
    decode.add_argument("--batches", default="1,32")
    decode.add_argument("--kv-lens", default="8192,32768")
    decode.add_argument("--heads", type=int, default=32)
    decode.add_argument("--kv-heads", type=int, default=8)
    decode.add_argument("--head-dim", type=int, default=128)
    decode.add_argument("--json", dest="json_path")
    varlen = sub.add_parser("varlen", help="GPU: packed variable-length batches against SDPA on the padded batch")
    varlen.add_argument("--heads", type=int, default=32)
    varlen.add_argument("--kv-heads", type=int, default=8)
    varlen.add_argument("--head-dim", type=int, default=128)
    varlen.add_argument("--no-causal", action="store_true")
    varlen.add_argument("--json", dest="json_path")
    paged = sub.add_parser("paged", help="GPU: packed query rows against a paged K/V cache (prefill, chunked "
                           "prefill, speculative decoding) against the same call on contiguous keys and SDPA")
    paged.add_argument("--page-sizes", default="1,16,64,256")
    paged.add_argument("--heads", type=int, default=32)
    paged.add_argument("--kv-heads", type=int, default=8)
    paged.add_argument("--head-dim", type=int, default=128)
    paged.add_argument("--json", dest="json_path")
    mla = sub.add_parser("mla", help="GPU: a value head dim unlike the query's (MLA, 192 / 128), forward and "
                         "backward, against SDPA's cuDNN, flash and default dispatch and FlexAttention")
    mla.add_argument("--seqlens", default="512,2048,8192,16384")
    mla.add_argument("--tokens", type=int, default=16384)
    mla.add_argument("--head-dim", type=int, default=192)
    mla.add_argument("--value-dim", type=int, default=128)
    mla.add_argument("--json", dest="json_path")
    mla_decode = sub.add_parser("mla-decode", help="GPU: decoding from MLA's latent cache (576 / 512, paged), as "
                                "bandwidth against the copy rate, SDPA and FlexAttention")
    mla_decode.add_argument("--batches", default="1,32,128")
    mla_decode.add_argument("--kv-lens", default="4096,32768")
    mla_decode.add_argument("--heads", default="16,128")
    mla_decode.add_argument("--queries", default="1,2")
    mla_decode.add_argument("--no-peers", action="store_true", help="fagen alone (paged and contiguous)")
    mla_decode.add_argument("--json", dest="json_path")
    fp8 = sub.add_parser("fp8", help="GPU: the fp8 (e4m3) forward against SDPA's cuDNN and fagen's bf16 forwards "
                         "on the same values")
    fp8.add_argument("--seqlens", default="512,2048,8192,16384")
    fp8.add_argument("--tokens", type=int, default=16384)
    fp8.add_argument("--head-dims", default="64,128,256")
    fp8.add_argument("--json", dest="json_path")
    modifiers = sub.add_parser("modifiers", help="GPU: the mask_mod / score_mod variants of examples/modifiers.yaml "
                               "against FlexAttention, forward and backward")
    modifiers.add_argument("--seq-lens", default="2048,8192", help="comma-separated N (q and k alike)")
    modifiers.add_argument("--batch", type=int, default=4)
    modifiers.add_argument("--heads", type=int, default=16)
    modifiers.add_argument("--spec-file", help="default: examples/modifiers.yaml")
    modifiers.add_argument("--variants", help="comma-separated variant names (default: every variant of the file)")
    modifiers.add_argument("--head-dim", type=int, help="time every variant at this head dim instead of its own")
    modifiers.add_argument("--first-call", action="store_true",
                           help="also time a first call (cold compile + forward + backward) of fagen and of Flex, "
                                "each in a fresh process, at N=2048")
    modifiers.add_argument("--json", dest="json_path")
    corners = sub.add_parser("corners", help="GPU: every head dim, dropout and the masks SDPA lacks against "
                             "SDPA-flash, SDPA-cuDNN and FlexAttention, forward and backward (issue 13)")
    corners.add_argument("--only", help="comma-separated substrings: run the rows whose variant name has one")
    corners.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the rows' dtype (default: bf16)")
    corners.add_argument("--json", dest="json_path")
    redraw = sub.add_parser("plot", help="redraw the PNG from a `fagen bench --json` file")
    redraw.add_argument("report")
    redraw.add_argument("png")
    tables = sub.add_parser("markdown", help="BENCHMARKS.md's tables from a `fagen bench --json` file")
    tables.add_argument("report")
    tables.add_argument("--extras", help="JSON from `python -m fagen.bench extras` (efficiency section)")
    args = parser.parse_args(argv)

    if args.command == "decode":
        from fagen.bench.decode import run_decode

        run_decode([int(x) for x in args.batches.split(",")], [int(x) for x in args.kv_lens.split(",")],
                   args.heads, args.kv_heads, args.head_dim, json=args.json_path)
        return 0
    if args.command == "varlen":
        from fagen.bench.varlen import run_varlen

        run_varlen(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, causal=not args.no_causal,
                   json=args.json_path)
        return 0
    if args.command == "paged":
        from fagen.bench.paged import BATCHES, run_paged

        run_paged(BATCHES, [int(x) for x in args.page_sizes.split(",")], args.heads, args.kv_heads, args.head_dim,
                  json=args.json_path)
        return 0
    if args.command == "mla":
        from fagen.bench.mla import run_mla

        run_mla([int(x) for x in args.seqlens.split(",")], args.tokens, head_dim=args.head_dim,
                value_dim=args.value_dim, json=args.json_path)
        return 0
    if args.command == "mla-decode":
        from fagen.bench.mla_decode import run_mla_decode

        numbers = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
        run_mla_decode(numbers(args.batches), numbers(args.kv_lens), numbers(args.heads), numbers(args.queries),
                       peers=not args.no_peers, json=args.json_path)
        return 0
    if args.command == "fp8":
        from fagen.bench.fp8 import run_fp8

        run_fp8([int(x) for x in args.seqlens.split(",")], args.tokens,
                head_dims=[int(x) for x in args.head_dims.split(",")], json=args.json_path)
        return 0
    if args.command == "modifiers":
        from fagen.bench import modifiers as modifiers_bench

        modifiers_bench.run_modifiers([int(x) for x in args.seq_lens.split(",")], args.batch, args.heads,
                                      spec_file=args.spec_file or modifiers_bench.SPEC_FILE,
                                      variants=args.variants.split(",") if args.variants else None,
                                      first_call=args.first_call, json=args.json_path, head_dim=args.head_dim)
        return 0
    if args.command == "corners":
        from fagen.bench.corners import corners_in, run_corners

        wanted = args.only.split(",") if args.only else None
        rows = [c for c in corners_in(args.dtype) if not wanted or any(w in c.spec.variant_name for w in wanted)]
        result = run_corners(rows, json=args.json_path)
        return 1 if result["failed"] else 0
    if args.command == "plot":
        plot_report(BenchReport.load(args.report), args.png)
        return 0
    if args.command == "markdown":
        report = BenchReport.load(args.report)
        meta = report.meta
        print(f"Measured {meta.get('date')} on {meta.get('gpu')}, torch {meta.get('torch')} (CUDA {meta.get('cuda')}, "
              f"cuDNN {meta.get('cudnn')}), fagen {meta.get('fagen')}:\n\n    {meta.get('command')}\n")
        for title, pass_name, dropout in (("Forward", "forward", False), ("Backward", "backward", False),
                                          ("Dropout, forward", "forward", True),
                                          ("Dropout, backward", "backward", True)):
            body = markdown(report, pass_name, dropout)
            if body.count("\n") > 2:
                print(f"### {title}\n\n{body}")
        if args.extras:
            data = json_module.loads(Path(args.extras).read_text())
            if data.get("gemm_tflops"):
                for item in efficiency(report, data["gemm_tflops"]):
                    print(f"- {item['spec']} N={item['seq_len']}: {item['tflops']:.1f} TFLOP/s = "
                          f"{100 * item['fraction_of_gemm']:.1f}% of the measured bf16 GEMM rate "
                          f"({data['gemm_tflops']:.0f} TFLOP/s)")
        return 0
    # extras (GPU)
    from fagen.spec import load_specs

    spec = _pick_variant(load_specs(args.spec_file), args.variant)
    import torch

    torch.cuda.init()
    result: dict = {"variant": spec.variant_name, **environment(torch)}
    if not args.skip_compile_times:
        result["compile"] = measure_compile_times(spec)
        print(f"compile {spec.variant_name}: cold {result['compile']['cold_s']:.2f} s, "
              f"warm (cache load) {result['compile']['warm_s']:.3f} s", flush=True)
    from fagen import runtime

    runtime.ensure_context()
    result["gemm_tflops"] = measure_gemm_tflops()
    print(f"bf16 GEMM 8192^3: {result['gemm_tflops']:.1f} TFLOP/s", flush=True)
    try:
        result["ptxas"] = ptxas_report(spec)
        for pass_name, kernels in result["ptxas"]["kernels"].items():
            for name, res in kernels.items():
                print(f"ptxas {pass_name} {name}: {res.get('registers')} registers, "
                      f"{res.get('spill_stores')} B spill stores, {res.get('spill_loads')} B spill loads, "
                      f"{res.get('stack_bytes')} B stack", flush=True)
    except Exception as err:  # no nvcc on PATH, say
        result["ptxas"] = {"error": reason(err, 400)}
        print(f"ptxas report unavailable: {result['ptxas']['error']}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_module.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
