"""`python -m fagen.bench mla`: a value head dim unlike the query's (DeepSeek's MLA in training and prefill: q, k of
192 dims, v, o of 128), forward and backward at kernel level, against SDPA's cuDNN, flash and default dispatch and
FlexAttention on the same inputs, in one process. Batch x N tokens and heads x dv held fixed, causal and not.

Each peer's output is checked against fagen's (within bf16's tolerance) before it is timed; a peer that refuses the
shapes is reported with its reason. FLOPs: 2 (d + dv) per visible pair forward (S = Q K^T, O = P V), 2 (3 d + 2 dv)
backward (S again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q); causal counts half the pairs.
"""
from __future__ import annotations

import json as json_module
from pathlib import Path
from typing import Optional, Sequence

from fagen.bench.peers import allow_flex_recompiles, sdpa_with
from fagen.bench.report import environment, make_console, reason
from fagen.bench.timing import DEVICE, MAX_SECONDS_PER_MEASUREMENT, attention_flops, relative_error, time_cuda
from fagen.spec import Spec

TOLERANCE = 2e-2
PEERS = ("cudnn", "flash", "sdpa default", "flex")


def mla_flops(batch: int, heads: int, seq: int, head_dim: int, value_dim: int, causal: bool, pass_name: str) -> float:
    return attention_flops(batch, heads, seq, seq, head_dim, mask="causal" if causal else "none", pass_name=pass_name,
                           value_dim=value_dim)


def run_mla(seqlens: Sequence[int] = (512, 2048, 8192, 16384), tokens: int = 16384, value_model_dim: int = 2048,
            head_dim: int = 192, value_dim: int = 128, warmup: int = 3, repeats: int = 10,
            json: Optional[str] = None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    console.print(f"fagen bench mla on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: "
                  f"d {head_dim} / dv {value_dim}, bf16, kernel level")
    flex = None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        allow_flex_recompiles(torch)
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as err:  # no FlexAttention in this torch
        console.print(f"flex: {reason(err, 120)}")
    heads = max(1, value_model_dim // value_dim)
    rows = []
    for causal in (False, True):
        kernel = jit.compile(Spec(head_dim=head_dim, value_head_dim=value_dim, dtype="bf16",
                                  mask="causal" if causal else "none"))
        for seq in seqlens:
            batch = max(1, tokens // seq)
            generator = torch.Generator(device=DEVICE).manual_seed(seq)
            q, k = (torch.randn(batch, heads, seq, head_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
                    for _ in range(2))
            v = torch.randn(batch, heads, seq, value_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
            do = torch.randn(batch, heads, seq, value_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
            row = {"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "value_dim": value_dim,
                   "causal": causal, "us": {"forward": {}, "backward": {}}, "tflops": {"forward": {}, "backward": {}},
                   "notes": {}}
            o, lse = kernel.forward(q, k, v)
            row["us"]["forward"]["fagen"] = 1e3 * time_cuda(lambda: kernel.forward(q, k, v), warmup, repeats,
                                                            MAX_SECONDS_PER_MEASUREMENT)
            row["us"]["backward"]["fagen"] = 1e3 * time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), warmup,
                                                             repeats, MAX_SECONDS_PER_MEASUREMENT)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            peers = {}
            for name in ("cudnn", "flash"):
                peers[name] = (lambda backend: lambda *t: sdpa_with(backend, causal, *t))(name)
            peers["sdpa default"] = lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal)
            if flex is not None:
                mask = (create_block_mask(lambda b, h, i, j: i >= j, None, None, seq, seq, device=DEVICE) if causal
                        else None)
                peers["flex"] = lambda *t: flex(*t, block_mask=mask)
            for name, call in peers.items():
                try:
                    with torch.no_grad():
                        theirs = call(q, k, v)
                    error = relative_error(theirs, o)
                    if error > TOLERANCE:
                        row["notes"][name] = f"FAIL: relative error {error:.2e} against fagen"
                        continue
                    row["us"]["forward"][name] = 1e3 * time_cuda(lambda: _no_grad(torch, call, q, k, v), warmup,
                                                                 repeats, MAX_SECONDS_PER_MEASUREMENT)
                    out = call(*leaves)
                    row["us"]["backward"][name] = 1e3 * time_cuda(
                        lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), warmup, repeats,
                        MAX_SECONDS_PER_MEASUREMENT)
                except Exception as err:  # the backend refuses these shapes
                    row["notes"][name] = reason(err, 120)
            for pass_name in ("forward", "backward"):
                flops = mla_flops(batch, heads, seq, head_dim, value_dim, causal, pass_name)
                for name, us in row["us"][pass_name].items():
                    row["tflops"][pass_name][name] = flops / (us * 1e-6) / 1e12
            row["fagen_vs"] = {pass_name: {name: row["us"][pass_name][name] / row["us"][pass_name]["fagen"]
                                           for name in row["us"][pass_name] if name != "fagen"}
                               for pass_name in ("forward", "backward")}
            rows.append(row)
            line = "; ".join(f"{p} " + ", ".join(f"{n} {t:.0f} us ({row['tflops'][p][n]:.0f} TFLOP/s)"
                                                  for n, t in row["us"][p].items()) for p in ("forward", "backward"))
            console.print(f"{'causal' if causal else 'none'} {batch} x {heads} x {seq}: {line}"
                          + (f"; notes: {row['notes']}" if row["notes"] else ""))
    if json:
        Path(json).write_text(json_module.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


def _no_grad(torch, call, *tensors):
    with torch.no_grad():
        return call(*tensors)
