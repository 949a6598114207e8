"""The head-dim padding kernel (fagen/pad_rows.py) against F.pad, on layouts the torch adapter passes it:
contiguous (B, H, N, d), (B, N, H, d) seen as (B, H, N, d), packed (total, H, d), a stride-0 (expanded)
gradient made contiguous, odd and even widths, fp16 and bf16; and fagen.attention's padded route against its
F.pad route (EAGER_FAST_PATH off) without gradients, with some inputs differentiable and with the LSE. The
kernel's checks write into NaN-filled outputs, so an element it did not write (a padding column included) is
NaN and fails the comparison."""
import pytest

pytestmark = pytest.mark.gpu


def _poisoned_pad(torch, pad_rows, tensors, padded: int) -> list:
    """pad(tensors) written into NaN-filled outputs of the padded shapes."""
    out = [torch.full((*t.shape[:-1], padded), float("nan"), dtype=t.dtype, device=t.device) for t in tensors]
    result = pad_rows.plan_for(tensors, padded).run(tensors, out=out)
    assert all(r is o for r, o in zip(result, out))
    return result


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
    padded_tensors = _poisoned_pad(torch, pad_rows, tensors, padded)
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


def test_padded_route_matches_the_f_pad_route_without_grads_with_some_and_with_the_lse():
    """Under no_grad the padded tensors come from the plan directly (no autograd nodes); with only q
    differentiable the kernel route gives q's gradient alone; return_lse passes the LSE through."""
    import torch
    import fagen
    import fagen.torch as fagen_torch

    spec = fagen.Spec(head_dim=59, dtype="bf16", mask="causal")
    base = [torch.randn(2, 3, 200, 59, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    results = {}
    for eager in (True, False):
        fagen_torch.EAGER_FAST_PATH = eager
        try:
            with torch.no_grad():
                o_plain = fagen.attention(*base, spec)
            q = base[0].clone().requires_grad_()
            o, lse = fagen.attention(q, base[1], base[2], spec, return_lse=True)
            (o.float() * torch.linspace(-1, 1, 59, device="cuda")).sum().backward()
            results[eager] = (o_plain, o, lse, q.grad)
        finally:
            fagen_torch.EAGER_FAST_PATH = True
    (plain, o, lse, dq), (plain_ref, o_ref, lse_ref, dq_ref) = results[True], results[False]
    assert plain.shape == o.shape == base[0].shape and lse.shape == base[0].shape[:-1]
    assert torch.equal(plain, plain_ref) and torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert not dq.isnan().any()
    assert ((dq.double() - dq_ref.double()).norm() / dq_ref.double().norm()).item() < 5e-3


def test_mixed_dtypes_are_refused_not_reinterpreted():
    import torch
    import fagen
    from fagen import pad_rows
    from fagen.runtime import ArgumentError

    q = torch.randn(1, 2, 64, 59, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 64, 59, device="cuda", dtype=torch.float16) for _ in range(2))
    assert pad_rows.plan_for((q, k, v), 64) is None
    with pytest.raises(ArgumentError, match="cannot be padded"):
        pad_rows.pad([q, k, v], 64)
    with pytest.raises(ArgumentError):   # fagen.attention: the spec's dtype check, as before the kernel route
        fagen.attention(q, k, v, fagen.Spec(head_dim=59, dtype="bf16", mask="causal"))
