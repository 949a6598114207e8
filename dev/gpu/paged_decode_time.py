"""Decode from a paged K/V cache against the same keys contiguous (kernel level, CUDA events):
python dev/gpu/paged_decode_time.py. Prints µs and the K/V read rate (bytes read once per group)."""
import torch

import fagen

spec = fagen.Spec(head_dim=128, dtype="bf16", mask="padding", passes=["forward", "decode"])
kernel = fagen.compile(spec)
tile = kernel.plans["decode"].block_c


def timed(fn, repeats=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, decode tile {tile}")
for batch in (1, 32):
    for keys in (8192, 32768):
        for page_size in (tile, 256):
            heads, kv_heads, d = 32, 8, 128
            q = torch.randn(batch, heads, 1, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(batch, kv_heads, keys, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            pages = keys // page_size
            order = torch.randperm(batch * pages, device="cuda")
            table = order.reshape(batch, pages).to(torch.int32)
            k_cache, v_cache = (torch.empty(batch * pages, page_size, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                                for _ in range(2))
            for cache, src in ((k_cache, k), (v_cache, v)):   # the same keys, scattered over the pool
                cache[table.long().flatten()] = src.transpose(1, 2).reshape(batch * pages, page_size, kv_heads, d)
            lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
            o1, _ = kernel.forward(q, k, v, kv_lengths=lengths)
            o2, _ = kernel.forward(q, k_cache, v_cache, block_table=table, kv_lengths=lengths)
            same = torch.equal(o1, o2)
            t1 = timed(lambda: kernel.forward(q, k, v, kv_lengths=lengths))
            t2 = timed(lambda: kernel.forward(q, k_cache, v_cache, block_table=table, kv_lengths=lengths))
            gb = 2 * batch * kv_heads * keys * d * 2 / 1e9
            print(f"B={batch} N_k={keys} page={page_size}: contiguous {t1:.1f} us ({gb / t1 * 1e6:.0f} GB/s), "
                  f"paged {t2:.1f} us ({gb / t2 * 1e6:.0f} GB/s), paged/contiguous time {t2 / t1:.3f}, same bits {same}")
