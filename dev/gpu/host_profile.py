"""Where a fagen call's host time goes (issue 10, point 4): the bench's per-call modes against SDPA,
then cProfile of fagen's forward + backward (eager) and forward (torch.compile) on the bench's tiny
shape, and a null autograd.Function as the floor of what autograd itself costs.

    python dev/gpu/host_profile.py [--calls 2000] [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F

import fagen
from fagen.bench.model import OVERHEAD_SHAPE, OVERHEAD_SPEC, _call, _per_call_us


class _Null(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad), torch.empty_like(grad), torch.empty_like(grad)


def profile(fn, calls: int, top: int, title: str, sort: str = "tottime") -> None:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    print(f"==== cProfile: {title} ({calls} calls; per-call us = tottime / {calls} * 1e6)")
    print(text.getvalue()[-9000:])


def per_op_us(fn, calls: int = 20000) -> float:
    for _ in range(1000):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return min(best)


def pieces(q, k, v, grad) -> None:
    """The fast path's pieces one at a time (min of 3 rounds of 20000 calls)."""
    import ctypes

    from fagen import cuda_driver as driver
    from fagen import runtime
    from fagen.runtime.call_inputs import CallInputs
    from fagen.torch import kernel_for

    kernel = kernel_for(OVERHEAD_SPEC, 0)
    o, lse = kernel.forward(q, k, v)
    kernel.backward(q, k, v, o, lse, grad)
    call = next(iter(kernel._fast_forward.values()))
    function, grid, threads, smem, symbol = call.launches[0]
    stream = torch.cuda.current_stream().cuda_stream
    lib = driver._load()
    u = ctypes.c_uint
    pre = (ctypes.c_void_p(function), u(grid[0]), u(grid[1]), u(grid[2]), u(threads), u(1), u(1), u(smem),
           ctypes.c_void_p(stream), call.params, None)
    raw = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value)
    rows = {
        "signature forward": lambda: kernel._signature("forward", (q, k, v), (q, k, v), CallInputs()),
        "signature backward": lambda: kernel._signature("backward", (q, k, v, o, lse, grad), (q, k, v, grad),
                                                         CallInputs()),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "torch.empty(n) fp32": lambda: torch.empty(4096, dtype=torch.float32, device=q.device),
        "torch.zeros(n) fp32": lambda: torch.zeros(4096, dtype=torch.float32, device=q.device),
        "current stream": lambda: runtime.device._TORCH["stream"](0),
        "driver.launch (fwd kernel)": lambda: driver.launch(function, grid, threads, smem, stream, call, symbol),
        "cuLaunchKernel, ctypes values": lambda: lib.cuLaunchKernel(*pre),
        "cuLaunchKernel, no argtypes": lambda: raw(*pre),
        "PreparedLaunch (fwd kernel)": lambda: call.prepared[0](stream, call.params),
        "FastCall.launch (fwd)": lambda: call.launch(0, stream, (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                                 o.data_ptr(), lse.data_ptr(), 0, 0, 0)),
        "kernel.forward (fast path)": lambda: kernel.forward(q, k, v),
        "kernel.backward (fast path)": lambda: kernel.backward(q, k, v, o, lse, grad),
    }
    for name, fn in rows.items():
        print(f"  {name:32s} {per_op_us(fn, 5000 if 'kernel.' in name else 20000):7.2f} us")


def ladder(q, k, v, grad) -> None:
    """fwd + bwd through autograd.grad, from a null autograd.Function up to fagen.attention, one step at a
    time (min of 5 rounds of 2000 calls, all in one process): where the host time comes from."""
    import fagen.torch as fagen_torch
    from fagen.torch import kernel_for

    kernel = kernel_for(OVERHEAD_SPEC, 0)

    class Saving(torch.autograd.Function):   # our Function's autograd shape, no kernels
        @staticmethod
        def forward(ctx, q, k, v, kernel, kwargs):
            o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            ctx.kernel, ctx.kwargs = kernel, kwargs
            ctx.save_for_backward(q, k, v, o, lse, None)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            q, k, v, o, lse, _ = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None

    class ForwardKernel(Saving):   # + the forward kernel
        @staticmethod
        def forward(ctx, q, k, v, kernel, kwargs):
            o, lse = kernel.forward(q, k, v, **kwargs)
            ctx.kernel, ctx.kwargs = kernel, kwargs
            ctx.save_for_backward(q, k, v, o, lse, None)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return o, lse

    class BothKernels(ForwardKernel):   # + the backward kernels
        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            q, k, v, o, lse, _ = ctx.saved_tensors
            return (*ctx.kernel.backward(q, k, v, o, lse, grad_o, **ctx.kwargs), None, None)

    kwargs = {"kv_lengths": None, "block_mask": None, "offset": 0, "seed": 0}
    steps = {
        "null Function": lambda q, k, v: _Null.apply(q, k, v),
        "+ saves, 2 outputs": lambda q, k, v: Saving.apply(q, k, v, kernel, kwargs)[0],
        "+ forward kernel": lambda q, k, v: ForwardKernel.apply(q, k, v, kernel, kwargs)[0],
        "+ backward kernels": lambda q, k, v: BothKernels.apply(q, k, v, kernel, kwargs)[0],
        "fagen.attention": lambda q, k, v: fagen.attention(q, k, v, OVERHEAD_SPEC),
        "fagen.attention (ops path)": None,
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }

    def ops_path(q, k, v):
        fagen_torch.EAGER_FAST_PATH = False
        try:
            return fagen.attention(q, k, v, OVERHEAD_SPEC)
        finally:
            fagen_torch.EAGER_FAST_PATH = True

    steps["fagen.attention (ops path)"] = ops_path
    samples = {name: [] for name in steps}
    calls = {name: _call(fn, q, k, v, grad, "forward+backward") for name, fn in steps.items()}
    for fn in calls.values():
        for _ in range(200):
            fn()
    for _ in range(5):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / 2000 * 1e6)
    for name, values in samples.items():
        print(f"  {name:28s} min {min(values):7.1f}  median {sorted(values)[2]:7.1f} us")


def worker_thread_costs(q, k, v, grad) -> None:
    """kernel.backward and its pieces timed inside autograd's backward (the device's worker thread)
    against the same calls made directly (the main thread): mean us per call over 2000 calls."""
    import threading
    from collections import defaultdict

    from fagen import runtime
    from fagen.torch import kernel_for

    kernel = kernel_for(OVERHEAD_SPEC, 0)
    totals = defaultdict(float)
    threads = set()

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
        return wrapper

    launch, signature = runtime.FastCall.launch, runtime.Kernel._signature
    runtime.FastCall.launch = timed("FastCall.launch", launch)
    runtime.Kernel._signature = timed("Kernel._signature", signature)
    empty_like = torch.empty_like

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o, lse = kernel.forward(q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.mark_non_differentiable(lse)
            ctx.set_materialize_grads(False)
            return o, lse

        @staticmethod
        def backward(ctx, grad_o, grad_lse):
            threads.add(threading.get_ident())
            q, k, v, o, lse = ctx.saved_tensors
            start = time.perf_counter()
            grads = kernel.backward(q, k, v, o, lse, grad_o)
            totals["kernel.backward"] += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(3):
                empty_like(q)
            totals["3x torch.empty_like"] += time.perf_counter() - start
            return grads

    try:
        for where in ("worker thread (autograd)", "main thread (direct)"):
            totals.clear()
            o, lse = kernel.forward(q, k, v)
            for n in range(2200):
                if n == 200:
                    torch.cuda.synchronize()
                    totals.clear()
                if where.startswith("worker"):
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    torch.autograd.grad(Timed.apply(*leaves)[0], leaves, grad)
                else:
                    start = time.perf_counter()
                    kernel.backward(q, k, v, o, lse, grad)
                    totals["kernel.backward"] += time.perf_counter() - start
                    start = time.perf_counter()
                    for _ in range(3):
                        empty_like(q)
                    totals["3x torch.empty_like"] += time.perf_counter() - start
            torch.cuda.synchronize()
            print(f"  {where}: " + ", ".join(f"{name} {value / 2000 * 1e6:.1f}" for name, value in totals.items()))
        print(f"  backward ran on {len(threads)} thread(s), main is {threading.get_ident() in threads}")
    finally:
        runtime.FastCall.launch, runtime.Kernel._signature = launch, signature


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--pieces-only", action="store_true")
    parser.add_argument("--ladder-only", action="store_true")
    parser.add_argument("--compiled-only", action="store_true", help="cProfile the compiled forwards only")
    args = parser.parse_args()
    q, k, v, grad = (torch.randn(OVERHEAD_SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    forwards = {"fagen": lambda q, k, v: fagen.attention(q, k, v, OVERHEAD_SPEC),
                "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "null": lambda q, k, v: _Null.apply(q, k, v)}
    if args.compiled_only:
        for name in ("sdpa", "fagen"):
            fn = torch.compile(forwards[name], fullgraph=True)
            print(f"{name} compiled forward: {_per_call_us(_call(fn, q, k, v, grad, 'forward'), args.calls, 5):.1f} us")
            profile(_call(fn, q, k, v, grad, "forward"), args.calls, args.top, f"{name} fwd compiled", "cumulative")
        return
    print("==== backward on autograd's worker thread")
    worker_thread_costs(q, k, v, grad)
    print("==== fwd + bwd ladder")
    ladder(q, k, v, grad)
    if args.ladder_only:
        return
    print("==== pieces")
    pieces(q, k, v, grad)
    if args.pieces_only:
        return
    compiled = {name: torch.compile(fn, fullgraph=True) for name, fn in forwards.items() if name != "null"}
    for rounds in range(2):
        for mode in ("forward", "forward+backward"):
            line = []
            for name, fn in forwards.items():
                line.append(f"{name} {_per_call_us(_call(fn, q, k, v, grad, mode), args.calls, 5):7.1f}")
            for name, fn in compiled.items():
                line.append(f"{name}+compile {_per_call_us(_call(fn, q, k, v, grad, mode), args.calls, 5):7.1f}")
            print(f"round {rounds} {mode:17s} us/call: " + ", ".join(line))
    # GPU time per call (to see that the host, not the GPU, bounds the tiny shape)
    for name in ("fagen", "sdpa"):
        fn = _call(forwards[name], q, k, v, grad, "forward+backward")
        for _ in range(20):
            fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        gpu = sum(e.device_time_total for e in prof.key_averages()) / 50
        kernels = sum(e.count for e in prof.key_averages()) / 50
        print(f"{name} fwd+bwd GPU time {gpu:.1f} us/call, {kernels:.1f} GPU activities/call")
    profile(_call(forwards["fagen"], q, k, v, grad, "forward+backward"), args.calls, args.top, "fagen fwd+bwd eager")
    profile(_call(forwards["sdpa"], q, k, v, grad, "forward+backward"), args.calls, args.top, "sdpa fwd+bwd eager")
    profile(_call(compiled["fagen"], q, k, v, grad, "forward"), args.calls, args.top, "fagen fwd compiled")
    profile(_call(compiled["fagen"], q, k, v, grad, "forward+backward"), args.calls, args.top,
            "fagen fwd+bwd compiled")


if __name__ == "__main__":
    main()
