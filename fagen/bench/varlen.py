"""`python -m fagen.bench varlen`: packed variable-length batches (spec layout packed) against SDPA on
the same sequences padded to the longest, in one process, forward and backward (kernel level).

A padded batch computes (and stores) every padded row: what packing saves is reported beside the
times, as the share of the padded batch's tokens that are padding. Each implementation's output is
checked against fagen's on the rows that hold tokens before it is timed.
"""
from __future__ import annotations

import json as json_module
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from fagen.bench.peers import _backend
from fagen.bench.report import environment, make_console, reason
from fagen.bench.timing import DEVICE, MAX_SECONDS_PER_MEASUREMENT, relative_error, time_cuda
from fagen.spec import Spec

SDPA_BACKENDS = ("flash", "cudnn")
TOLERANCE = 2e-2

#: (name, number of sequences, shortest, longest): lengths drawn uniformly, fixed seed
BATCHES = (("16 x 256..4096", 16, 256, 4096), ("64 x 32..1024", 64, 32, 1024), ("4 x 1..8192", 4, 1, 8192))


def sequence_lengths(count: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    return [int(n) for n in np.random.default_rng(seed).integers(shortest, longest + 1, size=count)]


def run_varlen(batches=BATCHES, heads: int = 32, kv_heads: int = 8, head_dim: int = 128, causal: bool = True,
               warmup: int = 5, repeats: int = 30, json: Optional[str] = None) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    spec = Spec(head_dim=head_dim, dtype="bf16", mask="causal" if causal else "none", layout="packed")
    kernel = jit.compile(spec)
    console.print(f"fagen bench varlen on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: {kernel!r}")
    rows = []
    for label, count, shortest, longest in batches:
        lengths = sequence_lengths(count, shortest, longest)
        total, longest_here = sum(lengths), max(lengths)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=DEVICE)
        generator = torch.Generator(device=DEVICE).manual_seed(count)
        make = lambda rows_, h: torch.randn(rows_, h, head_dim, dtype=torch.bfloat16, device=DEVICE,  # noqa: E731
                                            generator=generator)
        q, k, v, do = make(total, heads), make(total, kv_heads), make(total, kv_heads), make(total, heads)
        packed_args = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest_here,
                       "max_seqlen_k": longest_here}

        # the padded batch SDPA takes: (B, H, longest, d), the tokens of sequence b in rows [0, n_b)
        def pad(x):
            out = x.new_zeros(count, longest_here, x.shape[1], head_dim)
            for b, (start, n) in enumerate(zip(np.cumsum([0] + lengths[:-1]), lengths)):
                out[b, :n] = x[start:start + n]
            return out.transpose(1, 2).contiguous()

        def unpad(x):   # (B, H, longest, d) -> (total, H, d)
            return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])

        qp, kp, vp, dop = (pad(x) for x in (q, k, v, do))
        row = {"batch": label, "sequences": count, "tokens": total, "longest": longest_here, "heads": heads,
               "kv_heads": kv_heads, "head_dim": head_dim, "causal": causal,
               "padding_share": 1 - total / (count * longest_here), "us": {}, "notes": {}, "errors": {}}
        with torch.no_grad():
            o, lse = kernel.forward(q, k, v, **packed_args)
        grads = kernel.backward(q, k, v, o, lse, do, **packed_args)
        row["us"]["fagen_forward"] = 1e3 * time_cuda(lambda: kernel.forward(q, k, v, **packed_args), warmup, repeats,
                                                     MAX_SECONDS_PER_MEASUREMENT)
        row["us"]["fagen_backward"] = 1e3 * time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, **packed_args),
                                                      warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)
        for backend in SDPA_BACKENDS:
            name = f"sdpa_{backend}"
            try:
                leaves = tuple(t.detach().clone().requires_grad_(True) for t in (qp, kp, vp))
                with sdpa_kernel(_backend(backend)):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=kv_heads != heads)
                    sdpa_grads = torch.autograd.grad(out, leaves, dop, retain_graph=True)
                torch.cuda.synchronize()
                # compared on the rows that hold tokens (fagen's output is the reference here: it was
                # checked against the float64 reference by the GPU tests)
                row["errors"][name] = max(relative_error(unpad(out.detach()), o),
                                          *(relative_error(unpad(g), mine) for g, mine in zip(sdpa_grads, grads)))
                if row["errors"][name] > TOLERANCE:
                    row["notes"][name] = f"FAIL: relative error {row['errors'][name]:.2e}"

                def forward_only():
                    with torch.no_grad(), sdpa_kernel(_backend(backend)):
                        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=causal,
                                                              enable_gqa=kv_heads != heads)

                row["us"][f"{name}_forward"] = 1e3 * time_cuda(forward_only, warmup, repeats,
                                                               MAX_SECONDS_PER_MEASUREMENT)
                row["us"][f"{name}_backward"] = 1e3 * time_cuda(
                    lambda: torch.autograd.grad(out, leaves, dop, retain_graph=True), warmup, repeats,
                    MAX_SECONDS_PER_MEASUREMENT)
                del out, leaves, sdpa_grads
            except Exception as err:  # a backend that cannot run this shape
                row["notes"][name] = reason(err, 120)
        for pass_name in ("forward", "backward"):
            mine = row["us"][f"fagen_{pass_name}"]
            for backend in SDPA_BACKENDS:
                theirs = row["us"].get(f"sdpa_{backend}_{pass_name}")
                row[f"speedup_{pass_name}_vs_{backend}"] = theirs / mine if theirs else None
        rows.append(row)
        times = ", ".join(f"{n} {t:.0f} us" for n, t in row["us"].items())
        console.print(f"{label} (tokens {total}, longest {longest_here}, padding {100 * row['padding_share']:.0f}% "
                      f"of the padded batch), H={heads}/{kv_heads} d={head_dim}: {times}; fagen vs SDPA-flash "
                      f"fwd {row['speedup_forward_vs_flash'] or 0:.2f}x bwd {row['speedup_backward_vs_flash'] or 0:.2f}x"
                      f", vs cuDNN fwd {row['speedup_forward_vs_cudnn'] or 0:.2f}x bwd "
                      f"{row['speedup_backward_vs_cudnn'] or 0:.2f}x" + (f"; notes: {row['notes']}" if row["notes"] else ""))
        del q, k, v, do, qp, kp, vp, dop, o, lse, grads
        torch.cuda.empty_cache()
    if json:
        Path(json).parent.mkdir(parents=True, exist_ok=True)
        Path(json).write_text(json_module.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    return rows
