"""The head-dim padding kernel (fagen/pad_rows.py) against F.pad, on layouts the torch adapter passes it:
contiguous (B, H, N, d), (B, N, H, d) seen as (B, H, N, d), packed (total, H, d), a stride-0 (expanded)
gradient made contiguous, odd and even widths, fp16 and bf16. The outputs come from PyTorch's caching
allocator, so NaN is written into the memory they will reuse first: an element the kernel did not write
stays NaN and fails the comparison."""
import pytest

pytestmark = pytest.mark.gpu


def _poison_allocator(torch, nbytes: int):
    """Fill a block the size of what comes next with NaN and free it: the next allocations reuse it."""
    block = torch.full((nbytes // 2 + 4096,), float("nan"), dtype=torch.float16, device="cuda")
    del block


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("width,padded", [(59, 64), (111, 112), (3, 8), (58, 64), (1, 8)])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "packed"])
def test_pad_matches_f_pad(dtype, width, padded, layout):
    import torch
    from fagen import pad_rows

    dtype = getattr(torch, dtype)
    generator = torch.Generator(device="cuda").manual_seed(width * 31 + padded)
    shapes = {"bhnd": (2, 3, 77, width), "bnhd": (2, 77, 3, width), "packed": (131, 3, width)}
    tensors = [torch.randn(*shapes[layout], generator=generator, device="cuda").to(dtype) for _ in range(3)]
    if layout == "bnhd":
        tensors = [t.transpose(1, 2) for t in tensors]
    tensors[1] = tensors[1][..., :40, :] if layout != "packed" else tensors[1][:90]   # k, v: other lengths
    torch.cuda.synchronize()
    _poison_allocator(torch, sum(t.numel() for t in tensors) // width * padded * 2)
    padded_tensors = pad_rows.pad(tensors, padded)
    for t, p in zip(tensors, padded_tensors):
        assert p.is_contiguous() and p.shape == (*t.shape[:-1], padded)
        want = torch.nn.functional.pad(t, (0, padded - width))
        assert torch.equal(p, want), (layout, width, (p != want).nonzero()[:4].tolist())


def test_pad_runs_on_the_current_stream_and_refuses_what_it_cannot_take():
    import torch
    from fagen import pad_rows
    from fagen.runtime import ArgumentError

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        source = torch.randn(4, 8, 1000, 59, device="cuda", dtype=torch.bfloat16) * 3   # made on `stream`
        (padded,) = pad_rows.pad([source], 64)
        want = torch.nn.functional.pad(source, (0, 5))
    stream.synchronize()
    assert torch.equal(padded, want)
    with pytest.raises(ArgumentError, match="cannot be padded"):
        pad_rows.pad([torch.randn(2, 3, 4, 59, device="cuda")], 64)   # fp32
    with pytest.raises(ArgumentError, match="cannot be padded"):
        pad_rows.pad([torch.randn(2, 3, 59, 4, device="cuda", dtype=torch.float16).transpose(-1, -2)], 64)


def test_head_dim_59_gradients_with_an_expanded_output_gradient():
    """o.sum().backward() hands the output's backward a stride-0 gradient: it is made contiguous, padded, and
    the result matches F.pad's route (EAGER_FAST_PATH off pads with F.pad through the ops): the output bit for
    bit, the gradients to float atomics' order (dQ is summed with atomics in either route)."""
    import torch
    import fagen
    import fagen.torch as fagen_torch

    spec = fagen.Spec(head_dim=59, dtype="bf16", mask="causal")
    base = [torch.randn(2, 4, 300, 59, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grads, outputs = {}, {}
    for eager in (True, False):
        fagen_torch.EAGER_FAST_PATH = eager
        try:
            leaves = [t.clone().requires_grad_() for t in base]
            outputs[eager] = fagen.attention(*leaves, spec)
            outputs[eager].float().sum().backward()
            grads[eager] = [t.grad for t in leaves]
        finally:
            fagen_torch.EAGER_FAST_PATH = True
    assert outputs[True].shape == base[0].shape and torch.equal(outputs[True], outputs[False])
    for name, fast, ops in zip("qkv", grads[True], grads[False]):
        assert fast.shape == base[0].shape and not fast.isnan().any(), name
        assert ((fast.double() - ops.double()).norm() / ops.double().norm()).item() < 5e-3, name
