"""Host time per call on a tiny shape (launch-bound): packed forward (GPU offsets, fast path) against the
padded forward and SDPA, bf16 d128; then the packed backward (GQA 8 / 2 heads) on its fast path against its full
path (the fast path turned off), and forward + backward through fagen.attention's autograd, packed and padded.
python3 dev/gpu/packed_overhead.py (last: the packed autograd backward keyed by its forward, against unkeyed)"""
import sys, os, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import torch.nn.functional as F
from fagen import jit, runtime
from fagen.runtime.call_inputs import CallInputs
from fagen.spec import Spec

runtime.ensure_context()
packed = jit.compile(Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"))
padded = jit.compile(Spec(head_dim=128, dtype="bf16", mask="causal"))
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
         "_packed_signature": lambda: packed._packed_signature((q3, q3, q3), cu, cu, 156, 156, CallInputs())}
for name, fn in parts.items():
    print(f"{name}: {per_call(fn):.1f} us per call")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(200):
    packed.forward(q3, q3, q3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
end.record()
torch.cuda.synchronize()
print(f"packed forward, GPU time per call (events around 200 calls): {start.elapsed_time(end) / 200 * 1e3:.1f} us")

# the backward (grouped KV heads: 8 query heads, 2 K/V heads)
import fagen  # noqa: E402

k3 = torch.randn(256, 2, 128, device="cuda", dtype=torch.bfloat16)
o3, lse3 = packed.forward(q3, k3, k3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
backward = lambda: packed.backward(q3, k3, k3, o3, lse3, q3, cu_seqlens_q=cu, cu_seqlens_k=cu,  # noqa: E731
                                   max_seqlen_q=156, max_seqlen_k=156)
print(f"packed backward, fast path: {per_call(backward):.1f} us per call")
signature = runtime.Kernel._packed_signature
runtime.Kernel._packed_signature = lambda self, *args, **kwargs: None
print(f"packed backward, full path: {per_call(backward):.1f} us per call")
runtime.Kernel._packed_signature = signature
leaves3 = [t.detach().requires_grad_() for t in (q3, k3, k3)]
leaves4 = [t.detach().requires_grad_() for t in (q4, q4, q4)]
spec3 = '{"head_dim": 128, "dtype": "bf16", "mask": "causal", "layout": "packed"}'
spec4 = '{"head_dim": 128, "dtype": "bf16", "mask": "causal"}'
autograd = {"fagen.attention packed, forward + backward": lambda: torch.autograd.grad(
                fagen.attention(*leaves3, spec3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156),
                leaves3, q3),
            "fagen.attention padded, forward + backward": lambda: torch.autograd.grad(
                fagen.attention(*leaves4, spec4), leaves4, q4),
            "sdpa padded, forward + backward": lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(*leaves4, is_causal=True), leaves4, q4)}
for name, fn in autograd.items():
    print(f"{name}: {per_call(fn, 1000):.1f} us per call")

# the packed backward keyed by its forward (Kernel.backward_after) against the unkeyed route it replaced (the key
# dropped: the backward recomputes the packed signature on autograd's thread), rounds alternating in this process
keyed = runtime.Kernel.forward_keyed


def unkeyed(self, *args, **kwargs):
    o, lse, key = keyed(self, *args, **kwargs)
    return o, lse, (None if kwargs.get("cu_seqlens_q") is not None else key)


packed_step = autograd["fagen.attention packed, forward + backward"]
for round in range(3):
    for name, route in (("keyed", keyed), ("unkeyed", unkeyed)):
        runtime.Kernel.forward_keyed = route
        print(f"round {round}: packed forward + backward, backward {name}: {per_call(packed_step, 1000):.1f} us per call")
runtime.Kernel.forward_keyed = keyed
