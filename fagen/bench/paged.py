"""`python -m fagen.bench paged`: packed query rows against a paged K/V cache (prefill, chunked prefill,
speculative decoding; spec layout packed, `Kernel.forward(..., block_table=)`), against the same call on the
keys gathered into a contiguous packed batch, and against SDPA's default dispatch on the contiguous keys where
every sequence has the same lengths (a (B, H, N, d) batch, causal aligned bottom-right). Kernel level, one
process, forward only (a paged cache is read at inference).

Each paged call is checked bit for bit against the contiguous one before it is timed, and SDPA's output against
fagen's within bf16's tolerance.
"""
from __future__ import annotations

import json as json_module
from pathlib import Path
from typing import Optional

import numpy as np

from fagen.bench.report import environment, make_console, reason
from fagen.bench.timing import DEVICE, MAX_SECONDS_PER_MEASUREMENT, relative_error, time_cuda
from fagen.spec import Spec

TOLERANCE = 2e-2

#: (name, query rows per sequence, keys per sequence): lists, one entry per sequence
BATCHES = (("prefill 8 x 2048", [2048] * 8, [2048] * 8),
           ("chunked prefill 8 x 512 after 7680", [512] * 8, [8192] * 8),
           ("speculative 32 x 8 rows, 4096 keys", [8] * 32, [4096] * 32),
           ("mixed 16 x 1..2048 rows, ..8192 keys",
            [int(n) for n in np.random.default_rng(0).integers(1, 2049, 16)],
            [int(n) for n in np.random.default_rng(1).integers(2048, 8193, 16)]))
PAGE_SIZES = (1, 16, 64, 256)


def run_paged(batches=BATCHES, page_sizes=PAGE_SIZES, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
              warmup: int = 5, repeats: int = 30, json: Optional[str] = None) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    kernel = jit.compile(Spec(head_dim=head_dim, dtype="bf16", mask="causal", layout="packed"))
    console.print(f"fagen bench paged on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: {kernel!r}")
    rows = []
    for label, lengths_q, lengths_k in batches:
        generator = torch.Generator(device=DEVICE).manual_seed(len(lengths_q))
        q = torch.randn(sum(lengths_q), heads, head_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
        cu_q, cu_k = ([0, *np.cumsum(n).tolist()] for n in (lengths_q, lengths_k))
        packed = {"cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
                  "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32, device=DEVICE),
                  "max_seqlen_q": max(lengths_q), "max_seqlen_k": max(lengths_k)}
        k = torch.randn(cu_k[-1], kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE, generator=generator)
        v = torch.randn_like(k)
        flops = sum(4 * heads * head_dim * _causal_pairs(nq, nk) for nq, nk in zip(lengths_q, lengths_k))
        row = {"batch": label, "sequences": len(lengths_q), "query_rows": cu_q[-1], "keys": cu_k[-1], "heads": heads,
               "kv_heads": kv_heads, "head_dim": head_dim, "us": {}, "tflops": {}, "notes": {}}
        with torch.no_grad():
            want_o, want_lse = kernel.forward(q, k, v, **packed)
            row["us"]["contiguous"] = 1e3 * time_cuda(lambda: kernel.forward(q, k, v, **packed), warmup, repeats,
                                                      MAX_SECONDS_PER_MEASUREMENT)
            for page_size in page_sizes:
                k_cache, v_cache, table = _paged(k, v, lengths_k, page_size, generator)
                o, lse = kernel.forward(q, k_cache, v_cache, block_table=table, **packed)
                if not (torch.equal(o, want_o) and torch.equal(lse, want_lse)):
                    row["notes"][f"page {page_size}"] = "FAIL: differs from the contiguous call"
                row["us"][f"page {page_size}"] = 1e3 * time_cuda(
                    lambda: kernel.forward(q, k_cache, v_cache, block_table=table, **packed), warmup, repeats,
                    MAX_SECONDS_PER_MEASUREMENT)
                del k_cache, v_cache, table, o, lse
            if len(set(lengths_q)) == 1 and len(set(lengths_k)) == 1:   # SDPA on the (B, H, N, d) batch
                try:
                    batch, nq, nk = len(lengths_q), lengths_q[0], lengths_k[0]
                    qb = q.view(batch, nq, heads, head_dim).transpose(1, 2)
                    kb, vb = (x.view(batch, nk, kv_heads, head_dim).transpose(1, 2) for x in (k, v))
                    bias = causal_lower_right(nq, nk) if nq != nk else None

                    def sdpa():
                        if bias is None:
                            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
                        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, enable_gqa=True)

                    theirs = sdpa().transpose(1, 2).reshape(q.shape)
                    error = relative_error(theirs, want_o)
                    if error > TOLERANCE:
                        row["notes"]["sdpa"] = f"FAIL: relative error {error:.2e}"
                    row["us"]["sdpa default"] = 1e3 * time_cuda(sdpa, warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)
                except Exception as err:  # a shape or mask the installed torch cannot run
                    row["notes"]["sdpa"] = reason(err, 120)
        for name, us in row["us"].items():
            row["tflops"][name] = flops / (us * 1e-6) / 1e12
        contiguous = row["us"]["contiguous"]
        row["paged_vs_contiguous"] = {name: contiguous / us for name, us in row["us"].items() if name.startswith("page")}
        if "sdpa default" in row["us"]:
            row["paged_vs_sdpa"] = {name: row["us"]["sdpa default"] / us for name, us in row["us"].items()
                                    if name.startswith("page")}
        rows.append(row)
        times = ", ".join(f"{n} {t:.0f} us ({row['tflops'][n]:.0f} TFLOP/s)" for n, t in row["us"].items())
        console.print(f"{label}, H={heads}/{kv_heads} d={head_dim} causal: {times}; paged / contiguous speed "
                      + " ".join(f"{n}: {r:.3f}x" for n, r in row["paged_vs_contiguous"].items())
                      + (f"; notes: {row['notes']}" if row["notes"] else ""))
        del q, k, v, want_o, want_lse
    if json:
        Path(json).write_text(json_module.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


def _causal_pairs(nq: int, nk: int) -> int:
    """Visible (query, key) pairs of a bottom-right causal sequence: row i sees keys j <= i + nk - nq."""
    return sum(max(0, min(nk, i + nk - nq + 1)) for i in range(nq))


def _paged(k, v, lengths_k, page_size: int, generator):
    """k, v (total_k, kv_heads, d) scattered into a shuffled pool of pages: (k_cache, v_cache, block_table)."""
    import torch

    pages_per_sequence = max(1, -(-max(lengths_k) // page_size))
    pool = len(lengths_k) * pages_per_sequence
    order = torch.randperm(pool, device=k.device, generator=generator)
    table = order.reshape(len(lengths_k), pages_per_sequence).to(torch.int32)
    caches = []
    for x in (k, v):
        cache = x.new_zeros(pool, page_size, *x.shape[1:])
        start = 0
        for b, n in enumerate(lengths_k):
            rows = cache[table[b].long()].flatten(0, 1)
            rows[:n] = x[start:start + n]
            cache[table[b].long()] = rows.view(pages_per_sequence, page_size, *x.shape[1:])
            start += n
        caches.append(cache)
    return caches[0], caches[1], table
