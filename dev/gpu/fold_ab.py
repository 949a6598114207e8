"""Grouped KV heads in the backward, A/B in one process: folded (a block per K/V head and key block walking the
group's query heads) against a block per query head + _kv_group_sum, toggled by runtime.kernel.FOLD_WAVES on the same
compiled kernel (fast-path tables cleared between modes), two rounds alternating; device time (torch.profiler) and
CUDA events per call. docs/benchmarks-journal.md "Grouped KV heads folded".

    python3 dev/gpu/fold_ab.py
    MASK_MODS=1 python3 dev/gpu/fold_ab.py          # the library's mask_mods that do not read h, at d = 128
    MASK_MODS=1 MASK_MODS_D=64 python3 ...          # ... at d = 64
    FAGEN_TREE=.ab_old MASK_MODS=1 python3 ...      # the same cases on another tree (its kernels, this script)
    PACKED=1 python3 dev/gpu/fold_ab.py             # packed batches: B x N tokens in sequences of N / 2 .. 3 N / 2

The mask_mods' inputs are `fagen bench modifiers`' (document ids of random lengths, a quarter-length prefix).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("FAGEN_TREE") or os.path.dirname(os.path.dirname(HERE)))   # the tree timed
sys.path.insert(0, HERE)

import random  # noqa: E402

import torch  # noqa: E402

from fagen import jit, runtime  # noqa: E402
from fagen.bench.model import packed_lengths  # noqa: E402
from fagen.spec import Spec  # noqa: E402
from kernel_times import kernel_table  # noqa: E402


def events_us(fn, reps=20):
    fn(); torch.cuda.synchronize()
    best = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps): fn()
        b.record(); torch.cuda.synchronize()
        best.append(a.elapsed_time(b) * 1000 / reps)
    return min(best)

CASES = [("d128 causal", Spec(head_dim=128, dtype="bf16", mask="causal"), 4, 32, 8, 4096),
         ("d128 causal", Spec(head_dim=128, dtype="bf16", mask="causal"), 16, 32, 8, 1024),
         ("d128 causal", Spec(head_dim=128, dtype="bf16", mask="causal"), 2, 32, 8, 8192),
         ("d128 none", Spec(head_dim=128, dtype="bf16", mask="none"), 4, 32, 8, 4096),
         ("d128 none", Spec(head_dim=128, dtype="bf16", mask="none"), 2, 32, 8, 8192),
         ("d64 causal", Spec(head_dim=64, dtype="bf16", mask="causal"), 4, 32, 8, 4096),
         ("d64 causal", Spec(head_dim=64, dtype="bf16", mask="causal"), 16, 32, 8, 1024),
         ("d64 causal", Spec(head_dim=64, dtype="bf16", mask="causal"), 2, 32, 8, 8192),
         ("d128 causal 16/4", Spec(head_dim=128, dtype="bf16", mask="causal"), 4, 16, 4, 4096),
         ("d128 causal MQA", Spec(head_dim=128, dtype="bf16", mask="causal"), 2, 32, 1, 4096),
         ("d64 window 1024", Spec(head_dim=64, dtype="fp16", mask="sliding_window", window=1024), 2, 32, 8, 8192)]
if os.environ.get("MASK_MODS"):
    d = int(os.environ.get("MASK_MODS_D", "128"))   # the mask_mod cases' head dim
    documents = Spec(head_dim=d, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
    prefix_lm = Spec(head_dim=d, dtype="bf16", mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"})
    sinks = Spec(head_dim=d, dtype="bf16", mask_mod="j <= i and (i - j < 256 or j < 4)")
    dilated = Spec(head_dim=d, dtype="fp16", mask="causal", mask_mod="(i - j) % 4 == 0")
    CASES = [(f"d{d} documents", documents, 16, 32, 8, 1024), (f"d{d} documents", documents, 4, 32, 8, 2048),
             (f"d{d} documents", documents, 2, 32, 8, 8192), (f"d{d} documents 16/4", documents, 4, 16, 4, 4096),
             (f"d{d} documents MHA", documents, 4, 32, 32, 2048), (f"d{d} prefix-LM", prefix_lm, 4, 32, 8, 2048),
             (f"d{d} window 256 + sinks", sinks, 4, 32, 8, 4096), (f"d{d} dilated", dilated, 4, 32, 8, 2048),
             (f"d{d} dilated MHA", dilated, 4, 32, 32, 2048)]
PACKED = bool(os.environ.get("PACKED"))
if PACKED:
    CASES = [("d128 causal", Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 16, 32, 8, 1024),
             ("d128 causal", Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 4, 32, 8, 4096),
             ("d128 none", Spec(head_dim=128, dtype="bf16", mask="none", layout="packed"), 4, 32, 8, 4096),
             ("d128 causal 16/4", Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 8, 16, 4, 2048),
             ("d64 causal", Spec(head_dim=64, dtype="bf16", mask="causal", layout="packed"), 16, 32, 8, 1024),
             ("d64 causal", Spec(head_dim=64, dtype="bf16", mask="causal", layout="packed"), 4, 32, 8, 4096),
             ("d64 window 256", Spec(head_dim=64, dtype="fp16", mask="sliding_window", window=256, layout="packed"),
              8, 32, 8, 2048),
             ("d96 causal", Spec(head_dim=96, dtype="bf16", mask="causal", layout="packed"), 8, 32, 8, 2048),
             ("d128 causal MHA (control)", Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 8, 32, 32, 2048)]


DEFAULT_WAVES = runtime.kernel.FOLD_WAVES
for label, spec, b, h, hkv, n in CASES:
    kernel = jit.compile(spec)
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    extra = {}
    if PACKED:
        lengths = packed_lengths(b * n, n, random.Random(0))   # (the bench-model packing's draw)
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32, device="cuda")
        q, do = (torch.randn(b * n, h, spec.head_dim, generator=g, device="cuda").to(dt) for _ in range(2))
        k, v = (torch.randn(b * n, hkv, spec.head_dim, generator=g, device="cuda").to(dt) for _ in range(2))
        extra.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    else:
        q, do = (torch.randn(b, h, n, spec.head_dim, generator=g, device="cuda").to(dt) for _ in range(2))
        k, v = (torch.randn(b, hkv, n, spec.head_dim, generator=g, device="cuda").to(dt) for _ in range(2))
    if spec.inputs:
        from fagen.bench.modifiers import make_case
        extra["inputs"] = make_case(spec, b, h, n).inputs
    o, lse = kernel.forward(q, k, v, **extra)
    res = {}
    grads = {}
    for mode, waves in (("per-head", 10**9), ("folded", 0), ("per-head", 10**9), ("folded", 0)):
        runtime.kernel.FOLD_WAVES = waves
        kernel._fast_backward.clear(); kernel._fast_backward_after.clear()
        fn = lambda: kernel.backward(q, k, v, o, lse, do, **extra)
        grads[mode] = fn()
        dev = sum(t for _, (t, _) in kernel_table(fn, 10))
        ev = events_us(fn)
        folded = any(c.folded for c in kernel._fast_backward.values())   # (packed calls remember theirs too)
        res.setdefault(mode, []).append((dev, ev, folded))
    same = [float((x.float() - y.float()).abs().max()) for x, y in zip(grads["per-head"], grads["folded"])]
    print(f"{label} B{b} H{h}/{hkv} N{n}: " + "; ".join(f"{m} device {min(r[0] for r in rs):.1f} us, events {min(r[1] for r in rs):.1f} us (folded={rs[0][2]})" for m, rs in res.items())
          + f"; max |diff| dq dk dv {same[0]:.2e} {same[1]:.2e} {same[2]:.2e}", flush=True)
    runtime.kernel.FOLD_WAVES = DEFAULT_WAVES
    kernel._fast_backward.clear()
    blocks = (len(lengths) * hkv * -(-max(lengths) // kernel.plans['backward'].block_c) if PACKED
              else b * hkv * -(-n // kernel.plans['backward'].block_c))
    print(f"   default rule folds: {kernel._folds(kernel.plans['backward'], blocks)} ({blocks} blocks)", flush=True)
