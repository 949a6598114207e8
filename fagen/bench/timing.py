"""How `fagen bench` measures: FLOP counts, CUDA-event timing, inputs and the error measure.

One process, the same inputs for every implementation, CUDA events around each call, warm-up runs
first, the median of the timed runs (docs/design.md, "Measuring speed"). The FLOP counts and the timing
helper's logic run without a GPU (tests/test_bench.py gives it a fake torch).
"""
from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fagen.runtime.tensors import TORCH_DTYPES
from fagen.spec import Spec

#: One measurement is cut to fewer timed runs (at least MIN_REPEATS) when it would take longer than this.
MAX_SECONDS_PER_MEASUREMENT = 5.0
MIN_REPEATS = 5
DROPOUT_SEED = 1234
#: Where inputs are made. Always "cuda" in use; a CPU smoke test of the bench's logic may point it elsewhere.
DEVICE = "cuda"


# ==== FLOPs ====================================================================================
def visible_pairs(seq_q: int, seq_k: int, mask: str = "none", window: Optional[int] = None) -> float:
    """(query, key) pairs one (batch, head) computes, by the FlashAttention convention.

    none, padding and block_sparse: Nq*Nk (the bench runs the last two fully populated: every key
    valid, every block on). causal: half of that, the convention. sliding_window: the pairs actually
    inside the window (each query sees itself and the window-1 keys before it), counted exactly."""
    if mask == "causal":
        return seq_q * seq_k / 2
    if mask == "sliding_window":
        if not window:
            raise ValueError("sliding_window needs a window to count its FLOPs")
        shift = seq_k - seq_q  # bottom-right aligned, as fagen's reference: query i sees keys <= i + shift
        return float(sum(max(0, min(i + shift + 1, seq_k) - max(0, i + shift - window + 1)) for i in range(seq_q)))
    return float(seq_q * seq_k)


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, *, mask: str = "none",
                    window: Optional[int] = None, pass_name: str = "forward", value_dim: Optional[int] = None) -> float:
    """2 FLOPs per multiply-add of each product over the visible pairs (causal: half of them), each product at its
    own head dim: fwd 2 (d + dv) (S = Q K^T, O = P V), bwd 2 (3 d + 2 dv) (S again, dQ, dK over d; dP, dV over dv).
    With dv = d (`value_dim` None): fwd = 4*B*H*Nq*Nk*d, bwd = 2.5 x fwd."""
    pairs = batch * heads * visible_pairs(seq_q, seq_k, mask, window)
    d, dv = head_dim, value_dim or head_dim
    if pass_name == "forward":
        return 2.0 * (d + dv) * pairs
    if pass_name == "backward":
        return 2.0 * (3 * d + 2 * dv) * pairs
    raise ValueError(f"unknown pass {pass_name!r}: forward or backward")


def spec_flops(spec: Spec, batch: int, heads: int, seq_len: int, pass_name: str) -> float:
    return attention_flops(batch, heads, seq_len, seq_len, spec.head_dim, mask=spec.mask, window=spec.window,
                           pass_name=pass_name, value_dim=spec.value_dim)


def shape_for(spec: Spec, seq_len: int, tokens: int, model_dim: int) -> tuple[int, int]:
    """(batch, heads): batch x N = tokens and heads x d = model_dim held fixed, each at least 1."""
    return max(1, tokens // seq_len), max(1, model_dim // spec.head_dim)

# ==== timing (GPU) =============================================================================
def time_cuda(fn: Callable[[], Any], warmup: int = 10, repeats: int = 50,
              max_seconds: Optional[float] = None) -> float:
    """Median milliseconds of `repeats` calls of fn, each between two CUDA events, after `warmup` calls.

    The events are recorded on PyTorch's current stream, and fagen launches its kernels on that same
    stream (fagen/runtime/), so fagen and its peers are timed alike. Calls are
    queued back to back and synchronised once at the end. With max_seconds, a slow fn gets fewer
    timed runs (never fewer than MIN_REPEATS, nor more than asked) so that one measurement stays
    near that long; the first warm-up call is the estimate."""
    import torch

    if max_seconds is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end), 1e-3)
        budget = max_seconds * 1e3
        repeats = max(min(repeats, MIN_REPEATS), min(repeats, int(budget / estimate)))
        warmup = max(0, min(warmup - 1, int(budget / 4 / estimate)))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


def time_us_after_first_call(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median microseconds of fn (time_cuda, capped at MAX_SECONDS_PER_MEASUREMENT) after one untimed call
    that compiles and allocates, so that time_cuda's estimate is of a warm call."""
    import torch

    fn()
    torch.cuda.synchronize()
    return 1e3 * time_cuda(fn, warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)


@contextlib.contextmanager
def unchecked_launches():
    """fagen.runtime.CHECK_LAUNCHES off (no synchronise after each launch) inside; restored after."""
    from fagen import runtime

    saved = runtime.CHECK_LAUNCHES
    runtime.CHECK_LAUNCHES = False
    try:
        yield
    finally:
        runtime.CHECK_LAUNCHES = saved


@dataclass
class Inputs:
    """q, k, v and the output gradient do, (batch, heads, N, d) contiguous, and fagen's run-time args."""

    q: Any
    k: Any
    v: Any
    do: Any
    runtime_args: dict


def timed_elsewhere(spec: Spec) -> Optional[str]:
    """Why the benches and the autotuner, which time forward and backward calls on q, k, v against SDPA's, do not take
    `spec`, and what times it instead; None where they do."""
    if spec.fp8:
        return (f"{spec.variant_name} is fp8_e4m3, which this timing does not take; python -m fagen.bench fp8 times "
                "the fp8 forward against fagen's and cuDNN's bf16 forwards")
    if spec.latent_kv:
        return (f"{spec.variant_name} reads a latent cache (latent_kv: the decode pass alone, v from k), which this "
                "timing does not take; python -m fagen.bench mla-decode times it")
    return None


def refuse_timed_elsewhere(spec: Spec, what: str) -> None:
    """timed_elsewhere's reason as an error."""
    reason = timed_elsewhere(spec)
    if reason:
        raise ValueError(f"{what}: {reason}")


def make_inputs(spec: Spec, batch: int, heads: int, seq_len: int, seed: int = 0, kv_heads: Optional[int] = None) -> Inputs:
    """Fresh torch.randn inputs on the GPU (never zeros: zeros make every kernel look fast); k and v
    with `kv_heads` heads (grouped KV heads) when given.

    padding gets every key valid and block_sparse every block on, so that their FLOPs are the dense
    count; dropout gets a fixed seed and offset."""
    import torch

    refuse_timed_elsewhere(spec, "timing inputs")
    dtype = getattr(torch, TORCH_DTYPES[spec.dtype])
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    # (v and do of the spec's value_dim: its value_head_dim where it has one)
    shapes = {"q": (batch, heads, seq_len, spec.head_dim), "k": (batch, kv_heads or heads, seq_len, spec.head_dim),
              "v": (batch, kv_heads or heads, seq_len, spec.value_dim), "d": (batch, heads, seq_len, spec.value_dim)}
    q, k, v, do = (torch.randn(shapes[name], dtype=dtype, device=DEVICE, generator=generator) for name in "qkvd")
    args: dict = {"seed": DROPOUT_SEED, "offset": 0} if spec.dropout else {}
    if spec.mask == "padding":
        args["kv_lengths"] = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    if spec.mask == "block_sparse":
        blocks = math.ceil(seq_len / spec.block_size)
        args["block_mask"] = torch.ones((blocks, blocks), dtype=torch.uint8, device=DEVICE)
    mods = spec.modifiers
    if mods.tensors or mods.scalars:
        # mask_mod / score_mod inputs: scalars 1, float tensors small normals, int tensors 0 (one document:
        # every tile the mask kind allows is computed). `python -m fagen.bench modifiers` uses meaningful ones.
        shapes = mods.input_shapes(batch, heads, seq_len, seq_len)
        inputs = {name: (0.1 * torch.randn(shapes[name], device=DEVICE, generator=generator) if kind == "float32"
                         else torch.zeros(shapes[name], dtype=torch.int32, device=DEVICE))
                  for name, kind, _ in mods.tensors}
        inputs.update({name: 1.0 for name in mods.scalars})
        args["inputs"] = inputs
    return Inputs(q, k, v, do, args)


def relative_error(out: Any, ref: Any) -> float:
    """||out - ref||_F / ||ref||_F in float32 on the GPU; NaN or inf anywhere -> inf."""
    import torch

    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    denominator = float(torch.linalg.vector_norm(ref))
    difference = float(torch.linalg.vector_norm(out - ref))
    return difference / denominator if denominator > 0 else difference
