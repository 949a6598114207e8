"""Where a latent-cache decode call's time goes, for one shape: the host's time per call (200 calls queued, then one
synchronise), whether the calls took the fast path, and each kernel's GPU time (torch.profiler).

    python3 dev/gpu/latent_host.py BATCH HEADS KV_LEN
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from fagen import jit
from fagen.spec import Spec

batch, heads, kv_len = (int(x) for x in sys.argv[1:4])
spec = Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", mask="padding", softmax_scale=192 ** -0.5)
kernel = jit.compile(spec)
pages = kv_len // 64
pool = torch.randn(batch * pages, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
table = torch.randperm(batch * pages, device="cuda").reshape(batch, pages).to(torch.int32)
lengths = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
q = torch.randn(batch, heads, 1, 576, dtype=torch.bfloat16, device="cuda")
call = lambda: kernel.forward(q, pool, None, block_table=table, kv_lengths=lengths)  # noqa: E731
for _ in range(5):
    call()
torch.cuda.synchronize()
remembered = len(kernel._fast_forward)
start = time.perf_counter()
for _ in range(200):
    call()
host = (time.perf_counter() - start) / 200
torch.cuda.synchronize()
wall = (time.perf_counter() - start) / 200
print(f"B={batch} H={heads} Nk={kv_len}: host {1e6 * host:.1f} us per call, wall {1e6 * wall:.1f} us; fast calls "
      f"remembered {remembered} -> {len(kernel._fast_forward)}")
if os.environ.get("PROFILE_HOST"):   # the host's time by function, 200 calls
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        call()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
for event in prof.key_averages():
    if event.device_type == torch.autograd.DeviceType.CUDA:
        print(f"  {event.key[-40:]}: {event.device_time_total / event.count:.1f} us x {event.count}")
