"""Host time per call on a tiny shape (launch-bound): packed forward (GPU offsets, fast path) against the
padded forward and SDPA, bf16 d128. python3 dev/gpu/packed_overhead.py"""
import sys, os, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import torch.nn.functional as F
from fagen import runtime
from fagen.spec import Spec

runtime.ensure_context()
packed = runtime.compile(Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"))
padded = runtime.compile(Spec(head_dim=128, dtype="bf16", mask="causal"))
q3 = torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
q4 = torch.randn(2, 8, 128, 128, device="cuda", dtype=torch.bfloat16)


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


rows = {"fagen packed (GPU offsets)": lambda: packed.forward(q3, q3, q3, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=156, max_seqlen_k=156),
        "fagen packed (host offsets)": lambda: packed.forward(q3, q3, q3, cu_seqlens_q=[0, 100, 256],
                                                              cu_seqlens_k=[0, 100, 256]),
        "fagen padded": lambda: padded.forward(q4, q4, q4),
        "sdpa": lambda: F.scaled_dot_product_attention(q4, q4, q4, is_causal=True)}
with torch.no_grad():
    for name, fn in rows.items():
        print(f"{name}: {per_call(fn):.1f} us per call")

# where the packed call's time goes
parts = {"torch.zeros + torch.full": lambda: (torch.zeros(q3.shape, dtype=q3.dtype, device="cuda"),
                                               torch.full((8, 256), -1.0, device="cuda")),
         "_packed_signature": lambda: packed._packed_signature((q3, q3, q3), cu, cu, 156, 156, None, None, 0, 0)}
for name, fn in parts.items():
    print(f"{name}: {per_call(fn):.1f} us per call")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(200):
    packed.forward(q3, q3, q3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
end.record()
torch.cuda.synchronize()
print(f"packed forward, GPU time per call (events around 200 calls): {start.elapsed_time(end) / 200 * 1e3:.1f} us")
