"""`python -m fagen.bench decode`: decoding (one new query per sequence against a long KV cache, grouped
KV heads) timed against SDPA's backends and FlexAttention in one process, as bandwidth.

A decode step reads every cached key and value once: its speed is K/V bytes over time, compared with
the GPU's own copy bandwidth measured in the same run (a device-to-device copy of 4 GiB, bytes read
plus written over time). Each implementation's output is checked against SDPA's math backend first.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fagen.bench.peers import _backend
from fagen.bench.report import environment, make_console, reason, write_results
from fagen.bench.timing import DEVICE, relative_error, time_cuda
from fagen.spec import Spec

SDPA_BACKENDS = ("flash", "cudnn", "efficient")
TOLERANCE = 2e-2


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of a device-to-device copy (read + write), the HBM rate a kernel can hope for."""
    import torch

    elements = int(gib * 2**30) // 2
    source = torch.randn(elements, dtype=torch.bfloat16, device=DEVICE)
    target = torch.empty_like(source)
    ms = time_cuda(lambda: target.copy_(source), 3, 20)
    del source, target
    torch.cuda.empty_cache()
    return 2 * elements * 2 / (ms * 1e-3)


def run_decode(batches: Sequence[int] = (1, 32), kv_lens: Sequence[int] = (8192, 32768), heads: int = 32,
               kv_heads: int = 8, head_dim: int = 128, warmup: int = 10, repeats: int = 50,
               json: Optional[str] = None) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    spec = Spec(head_dim=head_dim, dtype="bf16", mask="causal", passes=["forward", "decode"])
    kernel = jit.compile(spec)
    bandwidth = copy_bandwidth()
    console.print(f"fagen bench decode on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: "
                  f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {kernel!r}")
    flex = None
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as err:  # no FlexAttention in this torch
        console.print(f"FlexAttention unavailable: {reason(err)}")
    rows, queries = [], 1
    for batch in batches:
        for kv_len in kv_lens:
            generator = torch.Generator(device=DEVICE).manual_seed(kv_len + batch)
            q = torch.randn(batch, heads, queries, head_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
            k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, dtype=torch.bfloat16, device=DEVICE,
                                generator=generator) for _ in range(2))
            kv_bytes = 2 * k.numel() * k.element_size()

            def sdpa(backend):
                with sdpa_kernel(_backend(backend)):
                    # one query: causal (bottom-right) sees every key, so no mask (SDPA aligns top-left)
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

            with torch.no_grad():
                expected = sdpa("math")
            row = {"batch": batch, "kv_len": kv_len, "heads": heads, "kv_heads": kv_heads, "queries": queries,
                   "kv_bytes": kv_bytes, "us": {}, "notes": {}, "errors": {}}
            candidates = {"fagen": lambda: kernel.forward(q, k, v)[0]}
            for backend in SDPA_BACKENDS:
                candidates[f"sdpa_{backend}"] = (lambda b=backend: sdpa(b))
            if flex is not None:
                candidates["flex"] = lambda: flex(q, k, v, enable_gqa=True)
            for name, call in candidates.items():
                try:
                    with torch.no_grad():
                        out = call()
                        torch.cuda.synchronize()
                        row["errors"][name] = relative_error(out, expected)
                        if row["errors"][name] > TOLERANCE:
                            row["notes"][name] = f"FAIL: relative error {row['errors'][name]:.2e}"
                        row["us"][name] = 1e3 * time_cuda(call, warmup, repeats)
                except Exception as err:  # a backend that cannot run this shape
                    row["notes"][name] = reason(err, 120)
            fagen_us = row["us"].get("fagen")
            peers = [row["us"][n] for n in row["us"] if n.startswith("sdpa_")]
            row["fagen_tbps"] = kv_bytes / (fagen_us * 1e-6) / 1e12 if fagen_us else None
            row["fraction_of_copy"] = kv_bytes / (fagen_us * 1e-6) / bandwidth if fagen_us else None
            row["speedup_vs_best_sdpa"] = min(peers) / fagen_us if fagen_us and peers else None
            row["speedup_vs_flex"] = row["us"]["flex"] / fagen_us if fagen_us and "flex" in row["us"] else None
            rows.append(row)
            times = ", ".join(f"{n} {t:.1f} us" for n, t in row["us"].items())
            console.print(f"B={batch} Nk={kv_len} H={heads}/{kv_heads} Nq={queries}: {times}; fagen "
                          f"{row['fagen_tbps'] or 0:.2f} TB/s = {100 * (row['fraction_of_copy'] or 0):.0f}% of copy, "
                          f"{row['speedup_vs_best_sdpa'] or 0:.2f}x best SDPA"
                          + (f", {row['speedup_vs_flex']:.2f}x Flex" if row["speedup_vs_flex"] else "")
                          + (f"; notes: {row['notes']}" if row["notes"] else ""))
            del q, k, v, expected
            torch.cuda.empty_cache()
    if json:
        write_results(json, {"meta": {**meta, "copy_bandwidth": bandwidth}, "rows": rows})
    return rows
