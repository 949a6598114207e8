"""`python -m fagen.bench fp8`: the fp8 (e4m3) forward at kernel level, on FlashAttention-3's grid (batch x N = 16k
tokens, heads x d = 2048, causal and not), against the bf16 forwards a user would otherwise run on the values the
e4m3 inputs stand for: SDPA's cuDNN backend (SDPA's default on Hopper) and fagen's own bf16 forward, in one process.
Each is checked against fagen's fp8 output (within fp8's tolerance) before it is timed. SDPA in this torch takes no
fp8 inputs; the attempt is reported with its reason. FLOPs: 4 d per visible pair; causal counts half the pairs.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fagen.bench.peers import sdpa_with
from fagen.bench.report import environment, make_console, reason, write_results
from fagen.bench.timing import DEVICE, MAX_SECONDS_PER_MEASUREMENT, attention_flops, relative_error, time_cuda
from fagen.spec import Spec

TOLERANCE = 2.0**-4   # fagen.testing.TOLERANCES["fp8_e4m3"]


def run_fp8(seqlens: Sequence[int] = (512, 2048, 8192, 16384), tokens: int = 16384, model_dim: int = 2048,
            head_dims: Sequence[int] = (64, 128, 256), warmup: int = 3, repeats: int = 10,
            json: Optional[str] = None) -> list[dict]:
    import torch

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    console.print(f"fagen bench fp8 on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: fp8 e4m3 "
                  "forward (o bf16) against bf16 forwards on the same values, kernel level")
    rows = []
    for head_dim in head_dims:
        heads = max(1, model_dim // head_dim)
        for causal in (False, True):
            mask = "causal" if causal else "none"
            fp8 = jit.compile(Spec(head_dim=head_dim, dtype="fp8_e4m3", mask=mask))
            bf16 = jit.compile(Spec(head_dim=head_dim, dtype="bf16", mask=mask, passes=["forward"]))
            for seq in seqlens:
                batch = max(1, tokens // seq)
                generator = torch.Generator(device=DEVICE).manual_seed(seq)
                q, k, v = (torch.randn(batch, heads, seq, head_dim, device=DEVICE, generator=generator)
                           .to(torch.float8_e4m3fn) for _ in range(3))
                descale = {name: torch.full((batch, heads), 0.5, device=DEVICE)
                           for name in ("q_descale", "k_descale", "v_descale")}
                q16, k16, v16 = ((t.float() * 0.5).bfloat16() for t in (q, k, v))
                row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
                       "us": {}, "tflops": {}, "notes": {}}
                o, _ = fp8.forward(q, k, v, **descale)
                row["us"]["fagen fp8"] = 1e3 * time_cuda(lambda: fp8.forward(q, k, v, **descale), warmup, repeats,
                                                         MAX_SECONDS_PER_MEASUREMENT)
                peers = {"fagen bf16": lambda: bf16.forward(q16, k16, v16)[0],
                         "cudnn bf16": lambda: sdpa_with("cudnn", causal, q16, k16, v16)}
                for name, call in peers.items():
                    try:
                        with torch.no_grad():
                            error = relative_error(call(), o)
                        if error > TOLERANCE:
                            row["notes"][name] = f"FAIL: relative error {error:.2e} against fagen fp8"
                            continue
                        row["us"][name] = 1e3 * time_cuda(call, warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)
                    except Exception as err:  # the backend refuses these shapes
                        row["notes"][name] = reason(err, 120)
                try:
                    with torch.no_grad():
                        sdpa_with("cudnn", causal, q, k, v)
                    row["notes"]["cudnn fp8"] = "ran (not timed: no descale interface)"
                except Exception as err:  # what SDPA says to fp8 inputs
                    row["notes"]["cudnn fp8"] = reason(err, 120)
                flops = attention_flops(batch, heads, seq, seq, head_dim, mask=mask, pass_name="forward")
                row["tflops"] = {name: flops / (us * 1e-6) / 1e12 for name, us in row["us"].items()}
                row["fagen_fp8_vs"] = {name: row["us"][name] / row["us"]["fagen fp8"]
                                       for name in row["us"] if name != "fagen fp8"}
                rows.append(row)
                line = ", ".join(f"{n} {t:.0f} us ({row['tflops'][n]:.0f} TFLOP/s)" for n, t in row["us"].items())
                console.print(f"d {head_dim} {mask} {batch} x {heads} x {seq}: {line}"
                              + (f"; notes: {row['notes']}" if row["notes"] else ""))
    if json:
        write_results(json, {"meta": meta, "rows": rows})
    return rows
