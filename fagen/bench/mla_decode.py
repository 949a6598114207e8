"""`python -m fagen.bench mla-decode`: decoding from DeepSeek's latent cache (Spec latent_kv: k of 576 columns, the
512 latent ones then 64 rope ones, v = k's first 512), one latent head for 16 (a tensor-parallel rank's) or 128
query heads, 1 or 2 queries per sequence (2: speculative decoding's next token), paged in 64-row pages and
contiguous, at kernel level, against the peers this GPU's torch has, in one process.

A step reads the cache once, so its floor is the cache's bytes over the GPU's copy bandwidth, measured in the same
run (a device-to-device copy, bytes read plus written); FLOPs: 2 (576 + 512) per (query row, key). Peers get the
same values: SDPA (each backend torch has) and FlexAttention on v = k[..., :512] with enable_gqa. Every output, fagen's
included, is checked against an fp32 reference on the first sequence before it is timed; an implementation that
refuses the shapes is reported with its reason.
"""
from __future__ import annotations

from typing import Optional, Sequence

from fagen.bench.decode import copy_bandwidth
from fagen.bench.peers import _backend, allow_flex_recompiles
from fagen.bench.report import environment, make_console, reason, write_results
from fagen.bench.timing import DEVICE, relative_error, time_cuda
from fagen.spec import Spec

HEAD_DIM, VALUE_DIM, PAGE_SIZE = 576, 512, 64
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
TOLERANCE = 2e-2


def run_mla_decode(batches: Sequence[int] = (1, 32, 128), kv_lens: Sequence[int] = (4096, 32768),
                   heads_list: Sequence[int] = (16, 128), queries_list: Sequence[int] = (1, 2), warmup: int = 10,
                   repeats: int = 30, peers: bool = True, json: Optional[str] = None) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    scale = 192 ** -0.5   # DeepSeek-V3's: its q / k head dim in training
    spec = Spec(head_dim=HEAD_DIM, value_head_dim=VALUE_DIM, latent_kv=True, dtype="bf16", mask="padding",
                softmax_scale=scale)
    kernel = jit.compile(spec)
    bandwidth = copy_bandwidth()
    console.print(f"fagen bench mla-decode on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: copy "
                  f"bandwidth {bandwidth / 1e12:.2f} TB/s; {kernel!r}; kernel level")
    flex = None
    if peers:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            allow_flex_recompiles(torch)
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as err:  # no FlexAttention in this torch
            console.print(f"flex: {reason(err, 120)}")
    rows = []
    for heads in heads_list:
        for queries in queries_list:
            for batch in batches:
                for kv_len in kv_lens:
                    rows.append(_row(torch, F, sdpa_kernel, kernel, flex, console, bandwidth, scale, batch, heads,
                                     queries, kv_len, warmup, repeats, peers))
                    torch.cuda.empty_cache()
    if json:
        write_results(json, {"meta": {**meta, "copy_bandwidth": bandwidth}, "rows": rows})
    return rows


def _row(torch, F, sdpa_kernel, kernel, flex, console, bandwidth, scale, batch, heads, queries, kv_len, warmup,
         repeats, peers) -> dict:
    generator = torch.Generator(device=DEVICE).manual_seed(kv_len + batch + heads)
    pages = kv_len // PAGE_SIZE
    pool = torch.randn(batch * pages, PAGE_SIZE, 1, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE, generator=generator)
    table = torch.randperm(batch * pages, device=DEVICE, generator=generator).reshape(batch, pages).to(torch.int32)
    lengths = torch.full((batch,), kv_len, dtype=torch.int32, device=DEVICE)
    k = pool[table.long()].reshape(batch, kv_len, 1, HEAD_DIM).transpose(1, 2).contiguous()   # the same keys, in order
    v = k[..., :VALUE_DIM]
    q = torch.randn(batch, heads, queries, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE, generator=generator)
    cache_bytes = k.numel() * k.element_size()
    flops = 2 * batch * heads * queries * kv_len * (HEAD_DIM + VALUE_DIM)
    row = {"batch": batch, "heads": heads, "queries": queries, "kv_len": kv_len, "cache_bytes": cache_bytes,
           "us": {}, "notes": {}, "errors": {}}
    candidates = {"fagen paged": lambda: kernel.forward(q, pool, None, block_table=table, kv_lengths=lengths)[0],
                  "fagen contiguous": lambda: kernel.forward(q, k, None, kv_lengths=lengths)[0]}
    if peers:
        for backend in SDPA_BACKENDS:
            if backend == "math" and batch * heads * queries * kv_len > 2**28:
                continue   # (its fp32 scores would not be a fair minute's wait)
            candidates[f"sdpa {backend}"] = (lambda b=backend: _sdpa(F, sdpa_kernel, b, q, k, v, scale))
        if flex is not None:
            candidates["flex"] = lambda: flex(q, k, v, scale=scale, enable_gqa=True)
    with torch.no_grad():
        expected = _first_sequence_reference(q, k, scale)
        for name, call in candidates.items():
            try:
                out = call()
                torch.cuda.synchronize()
                row["errors"][name] = relative_error(out[0], expected)
                if row["errors"][name] > TOLERANCE:
                    row["notes"][name] = f"FAIL: relative error {row['errors'][name]:.2e} against the fp32 reference"
                    continue
                row["us"][name] = 1e3 * time_cuda(call, warmup, repeats)
            except Exception as err:  # a backend that cannot run this shape
                row["notes"][name] = reason(err, 100)
    fagen_us = row["us"].get("fagen paged")
    if fagen_us:
        row["fagen_tbps"] = cache_bytes / (fagen_us * 1e-6) / 1e12
        row["fraction_of_copy"] = cache_bytes / (fagen_us * 1e-6) / bandwidth
        row["fagen_tflops"] = flops / (fagen_us * 1e-6) / 1e12
        row["paged_vs_contiguous"] = row["us"].get("fagen contiguous", float("nan")) / fagen_us
        row["fagen_vs"] = {name: us / fagen_us for name, us in row["us"].items() if not name.startswith("fagen")}
    times = ", ".join(f"{n} {t:.1f} us" for n, t in row["us"].items())
    console.print(f"B={batch} H={heads} Nq={queries} Nk={kv_len}: {times}; fagen paged "
                  f"{row.get('fagen_tbps', 0):.2f} TB/s = {100 * row.get('fraction_of_copy', 0):.0f}% of copy, "
                  f"{row.get('fagen_tflops', 0):.0f} TFLOP/s"
                  + (f"; notes: {row['notes']}" if row["notes"] else ""))
    return row


def _first_sequence_reference(q, k, scale):
    """The first sequence's o in fp32 (every cached key visible): what each implementation's output is checked
    against before it is timed."""
    keys = k[0, 0].float()                                      # (Nk, 576); v is its first 512 columns
    weights = ((q[0].float() @ keys.T) * scale).softmax(dim=-1)   # (H, Nq, Nk)
    return weights @ keys[:, :VALUE_DIM]


def _sdpa(F, sdpa_kernel, backend, q, k, v, scale):
    with sdpa_kernel(_backend(backend)):
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
