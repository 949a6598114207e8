"""The implementations fagen is timed against: PyTorch SDPA with one backend forced (flash, cuDNN;
the memory-efficient one where a mask must be written out), run on the same inputs as fagen.
"""
from __future__ import annotations

from typing import Any

from fagen.bench.report import reason
from fagen.bench.timing import DEVICE, MAX_SECONDS_PER_MEASUREMENT, Inputs, time_cuda
from fagen.spec import Spec

#: SDPA is compared with (timed) only for masks it expresses itself: none (plain) and causal (is_causal).
SDPA_MASKS = ("none", "causal")


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_with(backend: str, causal: bool, q, k, v):
    """SDPA held to one backend (`_backend`'s names) on q, k, v: the benches' peer call where no mask is written out."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_backend(backend)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_kwargs(spec: Spec, inputs: Inputs, dropout: bool = True) -> dict:
    kwargs = {"is_causal": spec.mask == "causal", "dropout_p": spec.dropout if dropout else 0.0, "scale": spec.scale}
    if inputs.k.shape[1] != inputs.q.shape[1]:
        kwargs["enable_gqa"] = True   # grouped KV heads, as fagen takes them: no repeat in memory
    return kwargs


def sdpa_forward(backend: str, spec: Spec, inputs: Inputs, *, dropout: bool = True, attn_mask=None):
    """SDPA's output on the same inputs with one backend forced (raises where it cannot run)."""
    import torch
    from torch.nn.attention import sdpa_kernel

    kwargs = _sdpa_kwargs(spec, inputs, dropout)
    if attn_mask is not None:
        kwargs["is_causal"] = False
    with torch.no_grad(), sdpa_kernel(_backend(backend)):
        return torch.nn.functional.scaled_dot_product_attention(inputs.q, inputs.k, inputs.v, attn_mask=attn_mask,
                                                                **kwargs)


def sdpa_backward(backend: str, spec: Spec, inputs: Inputs, *, dropout: bool = True):
    """(o, grads-thunk, leaves): SDPA's forward run once under autograd; the thunk runs only its backward."""
    import torch
    from torch.nn.attention import sdpa_kernel

    leaves = tuple(t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    with sdpa_kernel(_backend(backend)):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, **_sdpa_kwargs(spec, inputs, dropout))
    do = inputs.do

    def grads():
        return torch.autograd.grad(o, leaves, do, retain_graph=True)

    return o, grads


def time_sdpa_forward(backend: str, spec: Spec, inputs: Inputs, warmup: int, repeats: int) -> float:
    import torch
    from torch.nn.attention import sdpa_kernel

    kwargs = _sdpa_kwargs(spec, inputs)
    q, k, v = inputs.q, inputs.k, inputs.v
    with torch.no_grad(), sdpa_kernel(_backend(backend)):
        return time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs),
                         warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)


def time_sdpa_backward(backend: str, spec: Spec, inputs: Inputs, warmup: int, repeats: int) -> float:
    # The forward runs once, outside the timed region; only autograd's backward of it is timed.
    _, grads = sdpa_backward(backend, spec, inputs)
    return time_cuda(grads, warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)


def reference_output(spec: Spec, inputs: Inputs) -> tuple[Any, str]:
    """SDPA's o on the same inputs, for checking fagen's (no dropout); (None, why) where there is none.

    none/causal: the flash backend (cuDNN where flash cannot run); padding and block_sparse run fully
    populated, so they are plain attention too; sliding_window: the memory-efficient backend with
    the window as a boolean mask."""
    attempts: list[tuple[str, Any]] = [("flash", None), ("cudnn", None)]
    if spec.mask == "sliding_window":
        import torch

        n = inputs.q.shape[2]
        rows = torch.arange(n, device=DEVICE)[:, None]
        cols = torch.arange(n, device=DEVICE)[None, :]
        distance = rows - cols
        attempts = [("efficient", (distance >= 0) & (distance < spec.window))]
    errors = []
    for backend, attn_mask in attempts:
        try:
            return sdpa_forward(backend, spec, inputs, dropout=False, attn_mask=attn_mask), backend
        except Exception as err:  # backend unavailable for this dtype / head dim / GPU
            errors.append(f"{backend}: {reason(err, 80)}")
    return None, "; ".join(errors)


def allow_flex_recompiles(torch) -> None:
    """Every variant and shape compiles flex_attention anew (new functions, new captured tensors): keep
    Dynamo from falling back to eager after its default 8 recompiles."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))
