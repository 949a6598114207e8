"""Where a model training step's GPU time goes, per implementation (device only, development aid).

Builds bench-model's Llama for one shape, runs a few training steps under torch.profiler for fagen,
SDPA-flash and SDPA default, and prints each one's step time, its GPU busy time, the attention
kernels' share and the top kernels. Also times the attention op alone on the model's layout.

    python3 dev/gpu/profile_model_step.py --head-dim 128 --seq-len 4096 [--kv-groups 1]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM

import fagen
from fagen.bench.model import llama_config, model_shapes
from fagen.integrations import transformers as fagen_hf

ATTENTION_WORDS = ("flash", "fmha", "attention", "fagen", "cudnn", "sdpa")


def is_attention(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in ATTENTION_WORDS)


def profile_impl(model, batches, impl: str, top: int) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    backend = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if impl == "flash" else contextlib.nullcontext()
    model.set_attn_implementation("fagen" if impl == "fagen" else "sdpa")

    def step(tokens):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with backend:
        for tokens in batches[:3]:
            step(tokens)
        torch.cuda.synchronize()
        times = []
        for tokens in batches[3:]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(tokens)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(batches[0])
            torch.cuda.synchronize()
    kernels = defaultdict(float)
    counts = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time / 1e3
            counts[event.name] += 1
    busy = sum(kernels.values())
    attention = sum(t for name, t in kernels.items() if is_attention(name))
    print(f"== {impl}: step {statistics.median(times):.2f} ms (median of {len(times)}), GPU busy {busy:.2f} ms, "
          f"attention kernels {attention:.2f} ms ({attention / busy:.0%})")
    for name, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {t:8.3f} ms  x{counts[name]:<4d} {name[:130]}")


def op_alone(shape: dict) -> None:
    """fwd+bwd of the attention call alone on the model's layout (q: (B, N, H, d) viewed as (B, H, N, d))."""
    b, h, n, d, hk = shape["batch"], shape["heads"], shape["seq_len"], shape["head_dim"], shape["kv_heads"]
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    spec = f'{{"head_dim": {d}, "dtype": "bf16", "mask": "causal"}}'
    impls = {"fagen": lambda: fagen.attention(q, k, v, spec),
             "flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for label, fn in impls.items():
        for mode in ("fwd", "fwd+bwd"):
            def call():
                out = fn()
                if mode == "fwd+bwd":
                    torch.autograd.grad(out, (q, k, v), grad)
            ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if label == "flash" else contextlib.nullcontext()
            with ctx:
                for _ in range(5):
                    call()
                torch.cuda.synchronize()
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
                for s, e in events:
                    s.record(); call(); e.record()
                torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in events)
            print(f"   op alone {label:5s} {mode:8s} {ms:.3f} ms per layer call (B={b} H={h} N={n} d={d})")
    del hk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--kv-groups", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    fagen_hf.register()
    shape = model_shapes((args.head_dim,), (args.seq_len,), kv_groups=(args.kv_groups,))[0]
    print(f"shape {shape}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(shape, hidden=2048, layers=args.layers, vocab=32000),
                                             attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
    batches = [torch.randint(0, 32000, (shape["batch"], shape["seq_len"]), device="cuda") for _ in range(8)]
    for impl in ("fagen", "flash", "sdpa"):
        profile_impl(model, batches, impl, args.top)
    op_alone(shape)


if __name__ == "__main__":
    main()
