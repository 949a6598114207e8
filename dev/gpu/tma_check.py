"""forward_wgmma_ws through the TMA against its cp.async loads, on an H200: `python dev/gpu/tma_check.py [PART ...]`
(parts: layouts, bf16, fp8, bwd, host; default all).

First, correctness on layouts the TMA maps differently (contiguous, (B, N, H, d) transposed, grouped heads, a packed
batch, odd lengths): each call's error against a float64 reference, and whether its maps were encoded (enabled) or
the kernel fell back to cp.async. Then kernel-level TFLOP/s on FlashAttention-3's grid (B x N = 16k, 16 heads,
d = 128) with the maps and with them refused (TensorMapParameter.encode patched to say no), and SDPA's cuDNN; the
same A/B for the fp8 (e4m3) forward at d = 128 (o in bf16, no descales). `host`: host time per call of the fast
path (Kernel.forward, d = 128 bf16, one tiny block) with the maps patched (the default), encoded in full each call
(no address field), and refused (cp.async: no maps written); and TensorMapParameter.encode alone, patched and full."""
import math
import sys

import torch
import torch.nn.functional as F

from fagen import jit
from fagen.bench.timing import attention_flops, time_cuda
from fagen.runtime import tensor_maps
from fagen.spec import Spec

encoded = []
_encode = tensor_maps.TensorMapParameter.encode


def logging_encode(self, pointers):
    ok = _encode(self, pointers)
    encoded.append(ok)
    return ok


def refusing_encode(self, pointers):
    self._enabled.value = 0
    return False


def reference(q, k, v, causal, cu=None):
    """float64 softmax(Q K^T / sqrt(d)) V per (batch, head), K/V heads repeated for grouped heads."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


parts = set(sys.argv[1:]) or {"layouts", "bf16", "fp8", "bwd", "host"}
tensor_maps.TensorMapParameter.encode = logging_encode
torch.manual_seed(0)
dev = "cuda"
for mask in ("none", "causal") if "layouts" in parts else ():
    kernel = jit.compile(Spec(head_dim=128, dtype="bf16", mask=mask, passes=["forward"]))
    causal = mask == "causal"
    cases = {
        "contiguous 2x16x1000": [torch.randn(2, 16, 1000, 128, device=dev, dtype=torch.bfloat16) for _ in range(3)],
        "(B,N,H,d) transposed 2x8x777": [torch.randn(2, 777, 8, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                                         for _ in range(3)],
        "grouped 32/8 heads 1x1531": [torch.randn(1, h, 1531, 128, device=dev, dtype=torch.bfloat16)
                                      for h in (32, 8, 8)],
        "batch 3 x 65 rows": [torch.randn(3, 4, 65, 128, device=dev, dtype=torch.bfloat16) for _ in range(3)],
    }
    for name, (q, k, v) in cases.items():
        encoded.clear()
        for _ in range(2):   # the full path, then the fast path
            o = torch.full_like(q, float("nan"))   # poisoned: a row the kernel skips shows
            lse = torch.full(q.shape[:3], float("nan"), device=dev)
            kernel.forward(q, k, v, out=(o, lse))
        error = (o.double() - reference(q, k, v, causal)).abs().max().item()
        print(f"{mask} {name}: max |o - ref| {error:.2e}, maps enabled {encoded}", flush=True)
    packed = jit.compile(Spec(head_dim=128, dtype="bf16", mask=mask, layout="packed", passes=["forward"]))
    lengths = [300, 1, 129, 1000]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(sum(lengths), 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    encoded.clear()
    o, _ = packed.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                          max_seqlen_k=max(lengths))
    error = 0.0
    for n in range(len(lengths)):
        a, b = int(cu[n]), int(cu[n + 1])
        ref = reference(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal)[0].transpose(0, 1)
        error = max(error, (o[a:b].double() - ref).abs().max().item())
    print(f"{mask} packed {lengths}: max |o - ref| {error:.2e}, maps enabled {encoded}", flush=True)

tensor_maps.TensorMapParameter.encode = _encode
heads, d = 16, 128
for dtype, mask in [(t, m) for t, part in (("bf16", "bf16"), ("fp8_e4m3", "fp8")) if part in parts
                    for m in ("none", "causal")]:
    kernel = jit.compile(Spec(head_dim=d, dtype=dtype, mask=mask, passes=["forward"]))
    for n in (512, 2048, 8192, 16384):
        batch = 16384 // n
        q, k, v = (torch.randn(batch, heads, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        if dtype == "fp8_e4m3":
            q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            q, k, v = (t.to(torch.bfloat16) for t in (q8, k8, v8))   # cuDNN's bf16 run on the values fp8 stands for
        flops = attention_flops(batch, heads, n, n, d, mask=mask, pass_name="forward")
        row = []
        for label, encode in (("tma", _encode), ("cp.async", refusing_encode), ("tma again", _encode)):
            tensor_maps.TensorMapParameter.encode = encode
            kernel._fast_forward.clear()
            inputs = (q8, k8, v8) if dtype == "fp8_e4m3" else (q, k, v)
            ms = time_cuda(lambda: kernel.forward(*inputs), 3, 20, 10.0)
            row.append(f"{label} {flops / ms / 1e9:.0f}")
        tensor_maps.TensorMapParameter.encode = _encode
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            ms = time_cuda(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal"), 3, 20, 10.0)
        row.append(f"cudnn {flops / ms / 1e9:.0f}")
        print(f"{dtype} d{d} {mask} N={n} B={batch}: " + ", ".join(row) + " TFLOP/s", flush=True)

# the backward (backward_wgmma_ws) at d = 128, bf16: TMA against cp.async, kernel level (Kernel.backward)
for mask in ("none", "causal") if "bwd" in parts else ():
    kernel = jit.compile(Spec(head_dim=d, dtype="bf16", mask=mask))
    for n in (2048, 8192, 16384):
        batch = 16384 // n
        q, k, v = (torch.randn(batch, heads, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        o, lse = kernel.forward(q, k, v)
        do = torch.randn_like(o)
        flops = 2.5 * attention_flops(batch, heads, n, n, d, mask=mask, pass_name="forward")
        row = []
        for label, encode in (("tma", _encode), ("cp.async", refusing_encode), ("tma again", _encode)):
            tensor_maps.TensorMapParameter.encode = encode
            kernel._fast_backward.clear()
            ms = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), 3, 10, 10.0)
            row.append(f"{label} {flops / ms / 1e9:.0f}")
        tensor_maps.TensorMapParameter.encode = _encode
        print(f"backward bf16 d{d} {mask} N={n} B={batch}: " + ", ".join(row) + " TFLOP/s", flush=True)

# host time per call: the maps patched, encoded in full, or refused (kernel level: Kernel.forward's fast path)
if "host" in parts:
    import time

    def per_call_us(fn, calls=5000):
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
        return best

    kernel = jit.compile(Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward"]))
    q, k, v = (torch.randn(1, 1, 128, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    found = tensor_maps.address_field
    for label, encode, field in (("patched", _encode, found), ("full encode", _encode, lambda g: None),
                                 ("refused (cp.async)", refusing_encode, found), ("patched again", _encode, found)):
        tensor_maps.TensorMapParameter.encode = encode
        tensor_maps.address_field = field
        kernel._fast_forward.clear()
        us = per_call_us(lambda: kernel.forward(q, k, v))
        print(f"host forward d128 bf16 (1,1,128,128), {label}: {us:.2f} us/call", flush=True)
    tensor_maps.TensorMapParameter.encode, tensor_maps.address_field = _encode, found
    geometries = [tensor_maps.map_geometry("bf16", 2, t.shape, t.stride(), 64, 128) for t in (q, k, v)]
    pointers = [t.data_ptr() for t in (q, k, v)]
    for label, patching in (("patched", True), ("full encode", False)):
        parameter = tensor_maps.TensorMapParameter(geometries)
        parameter.encode(pointers)
        assert parameter.patching, "no address field on this driver"
        if not patching:
            parameter._patches, parameter._fields = None, ()   # (fields looked up: every call encodes in full)
        start = time.perf_counter()
        for _ in range(20000):
            parameter.encode(pointers)
        us = (time.perf_counter() - start) / 20000 * 1e6
        print(f"host TensorMapParameter.encode (q, k, v), {label}: {us:.2f} us", flush=True)
