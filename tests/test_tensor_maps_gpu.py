"""The TMA's loads (fagen/runtime/tensor_maps.py; templates/forward_wgmma_ws.cu.j2, backward_wgmma_ws.cu.j2) against
the same kernel's cp.async loads: the same bits on every layout the maps see differently (the cp.async path is what the property suites
check against the float64 reference). A paged cache, which the maps do not take, runs on cp.async beside the
contiguous call's TMA: tests/test_paged_prefill_gpu.py holds the two to the same bits.

Run on a GPU machine: python -m pytest -m gpu tests/test_tensor_maps_gpu.py"""
import pytest

from fagen.runtime.tensor_maps import TensorMapParameter
from fagen.spec import Spec

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8_e4m3": "float8_e4m3fn"}


def _tensors(spec, shape, kv_heads, layout):
    """q, k, v of (batch, heads, n, d), k and v with kv_heads heads; `transposed`: (B, N, H, d) memory seen as
    (B, H, N, d)."""
    batch, heads, n, _ = shape
    dtype = getattr(torch, DTYPES[spec.dtype])
    out = []
    for h, d in ((heads, spec.head_dim), (kv_heads, spec.head_dim), (kv_heads, spec.value_dim)):
        if layout == "transposed":
            t = torch.randn(batch, n, h, d, device="cuda").to(dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, h, n, d, device="cuda").to(dtype)
        out.append(t)
    return out


CASES = [
    (Spec(head_dim=128, dtype="bf16", mask="causal"), (2, 4, 333, 128), 4, "contiguous"),
    (Spec(head_dim=128, dtype="bf16"), (2, 4, 257, 128), 4, "transposed"),
    (Spec(head_dim=128, dtype="fp16", mask="causal"), (1, 8, 190, 128), 2, "contiguous"),   # grouped heads
    (Spec(head_dim=120, dtype="fp16", dropout=0.1), (1, 2, 200, 120), 2, "contiguous"),    # d padded to 128
    (Spec(head_dim=128, value_head_dim=64, dtype="bf16", mask="causal"), (1, 2, 150, 128), 2, "contiguous"),
    (Spec(head_dim=128, dtype="fp8_e4m3", mask="causal"), (2, 4, 301, 128), 4, "contiguous"),
]


def _recording(monkeypatch, refuse=False):
    encoded = []
    original = TensorMapParameter.encode

    def encode(self, pointers):
        ok = False if refuse else original(self, pointers)
        if refuse:
            self._enabled.value = 0
        encoded.append(ok)
        return ok

    monkeypatch.setattr(TensorMapParameter, "encode", encode)
    return encoded


def _forward(kernel, q, k, v, **kw):
    """o and lse, poisoned before the launch (a row the kernel skips shows)."""
    o = torch.full(q.shape[:-1] + (kernel.spec.value_dim,), float("nan"), device="cuda",
                   dtype=torch.bfloat16 if kernel.spec.fp8 else q.dtype)
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    kernel.forward(q, k, v, out=(o, lse), **kw)
    return o, lse


@pytest.mark.parametrize("spec, shape, kv_heads, layout", CASES, ids=lambda x: getattr(x, "canonical_name", str(x)))
def test_tma_loads_give_the_cp_async_loads_bits(spec, shape, kv_heads, layout, monkeypatch):
    from fagen import jit

    kernel = jit.compile(spec)
    assert kernel.plans["forward"].tensor_map_columns, kernel.plans["forward"]
    q, k, v = _tensors(spec, shape, kv_heads, layout)
    encoded = _recording(monkeypatch)
    first = _forward(kernel, q, k, v, seed=7)
    again = _forward(kernel, q, k, v, seed=7)   # the fast path, its maps encoded for the same pointers
    assert encoded == [True, True]
    encoded = _recording(monkeypatch, refuse=True)
    copied = _forward(kernel, q, k, v, seed=7)
    assert encoded == [False]
    for a, b, c in zip(first, again, copied):
        assert not torch.isnan(a.float()).any()
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_packed_batch_maps_every_sequence_at_once(monkeypatch):
    from fagen import jit

    kernel = jit.compile(Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed", passes=["forward"]))
    lengths = [1, 130, 257, 64]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outputs = []
    for refuse in (False, True):
        encoded = _recording(monkeypatch, refuse)
        outputs.append(kernel.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=257, max_seqlen_k=257))
        assert encoded == [not refuse]
    (o, lse), (o_copied, lse_copied) = outputs
    assert torch.equal(o, o_copied) and torch.equal(lse, lse_copied)



BACKWARD_CASES = [
    (Spec(head_dim=128, dtype="bf16", mask="causal"), (2, 4, 333, 128), 4, "contiguous"),
    (Spec(head_dim=128, dtype="bf16"), (1, 4, 257, 128), 4, "transposed"),
    (Spec(head_dim=128, dtype="fp16", mask="causal"), (1, 8, 190, 128), 2, "contiguous"),   # grouped heads
    (Spec(head_dim=64, dtype="bf16", mask="causal"), (2, 4, 201, 64), 4, "contiguous"),
    (Spec(head_dim=96, dtype="fp16"), (1, 2, 150, 96), 2, "contiguous"),                  # 64-byte panels
]


@pytest.mark.parametrize("spec, shape, kv_heads, layout", BACKWARD_CASES,
                         ids=lambda x: getattr(x, "canonical_name", str(x)))
def test_tma_loads_in_the_backward_give_the_cp_async_loads_gradients(spec, shape, kv_heads, layout, monkeypatch):
    """dK and dV to the bit (each block sums its own); dQ within fp32 rounding of the other run (its atomics add in
    any order)."""
    from fagen import jit

    kernel = jit.compile(spec)
    if not kernel.plans["backward"].tensor_map_columns:
        pytest.skip(f"{spec.canonical_name}'s backward plan ({kernel.plans['backward'].family}) takes no tensor maps")
    q, k, v = _tensors(spec, shape, kv_heads, layout)
    o, lse = kernel.forward(q, k, v)
    do = torch.randn_like(o)
    runs = []
    for refuse in (False, False, True):
        encoded = _recording(monkeypatch, refuse)
        runs.append(kernel.backward(q, k, v, o, lse, do))
        assert encoded == [not refuse]
    (dq, dk, dv), (dq2, dk2, dv2), (dq3, dk3, dv3) = runs
    for a in (dq, dk, dv):
        assert torch.isfinite(a.float()).all()
    assert torch.equal(dk, dk2) and torch.equal(dk, dk3) and torch.equal(dv, dv2) and torch.equal(dv, dv3)
    scale = dq.float().abs().max().item()
    assert (dq.float() - dq3.float()).abs().max().item() <= 2**-7 * scale


PACKED_SPECS = [
    Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"),
    Spec(head_dim=64, dtype="fp16", layout="packed"),
    Spec(head_dim=128, dtype="fp8_e4m3", mask="causal", layout="packed", passes=["forward"]),
]


@pytest.mark.parametrize("spec", PACKED_SPECS, ids=lambda s: s.canonical_name)
def test_a_packed_batch_reads_no_row_past_a_sequence(spec, monkeypatch):
    """A packed batch's map spans every sequence, so a tile running past one would read the next sequence's rows or
    the tensor's unused tail. Those tiles go by cp.async (zeros): an Inf in one sequence, or NaN in the tail past
    cu_seqlens[-1], leaves every other sequence's output and gradients as they were, with the maps in use."""
    from fagen import jit

    kernel = jit.compile(spec)
    mapped = lambda name: [True] if kernel.plans[name].tensor_map_columns else []  # noqa: E731
    assert mapped("backward" if "backward" in spec.passes else "forward"), "no pass of this spec takes the maps"
    lengths, tail, heads = [1, 130, 257, 64], 77, 4
    starts = [0] + torch.tensor(lengths).cumsum(0).tolist()
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    used, total = starts[-1], starts[-1] + tail
    dtype = getattr(torch, DTYPES[spec.dtype])
    clean = [torch.randn(total, heads, spec.head_dim, device="cuda").to(dtype) for _ in range(3)]
    for t in clean:
        t[used:] = 0
    poisoned = [t.clone() for t in clean]
    for t in poisoned:
        t[used:] = float("nan")
        t[starts[1]:starts[2]] = float("inf")   # sequence 1: its own outputs are not compared
    keep = torch.ones(total, dtype=torch.bool, device="cuda")
    keep[starts[1]:starts[2]] = False
    keep[used:] = False
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
    runs = []
    for tensors in (clean, poisoned):
        encoded = _recording(monkeypatch)
        o, lse = kernel.forward(*tensors, **packed)
        assert encoded == mapped("forward"), "the maps were refused"
        runs.append((o, lse))
    (o, lse), (o_poisoned, lse_poisoned) = runs
    assert torch.isfinite(o[keep].float()).all()
    assert torch.equal(o[keep], o_poisoned[keep]) and torch.equal(lse[:, keep], lse_poisoned[:, keep])
    if "backward" not in spec.passes:
        return
    do = torch.randn_like(o)
    do[used:] = 0
    do_poisoned = do.clone()
    do_poisoned[used:] = float("nan")
    do_poisoned[starts[1]:starts[2]] = float("inf")
    grads = []
    for tensors, (out, stats), d_o in ((clean, runs[0], do), (poisoned, runs[1], do_poisoned)):
        encoded = _recording(monkeypatch)
        grads.append(kernel.backward(*tensors, out, stats, d_o, **packed))
        assert encoded == mapped("backward")
    (dq, dk, dv), (dq2, dk2, dv2) = grads
    for a in (dq, dk, dv):
        assert torch.isfinite(a[keep].float()).all()
    assert torch.equal(dk[keep], dk2[keep]) and torch.equal(dv[keep], dv2[keep])
    scale = dq[keep].float().abs().max().item()
    assert (dq[keep].float() - dq2[keep].float()).abs().max().item() <= 2**-7 * scale


def test_this_drivers_maps_are_patched_not_encoded_and_give_the_same_bits(monkeypatch):
    """The driver's address field is found (tensor_maps.address_field) for every geometry the kernels use here, and
    once a geometry's is known a call writes only the address words: no cuTensorMapEncodeTiled, on the general path
    (out=) and the fast path, with the same outputs as the cp.async loads of the same inputs, call after call with
    new tensors."""
    from fagen import cuda_driver, jit
    from fagen.runtime import tensor_maps

    for spec, shape, kv_heads, layout in CASES:
        kernel = jit.compile(spec)
        geometries = [tensor_maps.map_geometry(spec.dtype, t.element_size(), t.shape, t.stride(),
                                               kernel.plans["forward"].tensor_map_columns, 128)
                      for t in _tensors(spec, shape, kv_heads, layout)]
        for g in geometries:
            field = tensor_maps.address_field(g)
            assert field is not None, f"{spec.canonical_name}: no address field found in {g}"
            for t in _tensors(spec, shape, kv_heads, layout):   # real pointers, beside the random ones it checked
                patched = field.patched(t.data_ptr()).to_bytes(8, "little")
                assert tensor_maps._encoded(g, t.data_ptr()) == \
                    field.template[:8 * field.word] + patched + field.template[8 * field.word + 8:]
    spec, shape, kv_heads, layout = CASES[0]
    kernel = jit.compile(spec)
    encodes = []
    real = cuda_driver.encode_tensor_map
    monkeypatch.setattr(cuda_driver, "encode_tensor_map", lambda *a: encodes.append(a) or real(*a))
    for call in range(5):
        q, k, v = _tensors(spec, shape, kv_heads, layout)
        encodes.clear()
        o, lse = _forward(kernel, q, k, v)
        if call >= 1:   # (the first call's geometries may be new: address_field encodes its probes)
            assert encodes == [], f"call {call} encoded {len(encodes)} maps"
        o_fast, lse_fast = kernel.forward(q, k, v)   # the fast path's own parameter (out= calls take the general one)
        assert call == 0 or encodes == []
        assert torch.equal(o_fast, o) and torch.equal(lse_fast, lse)
        with monkeypatch.context() as refused:
            _recording(refused, refuse=True)
            o_copied, lse_copied = _forward(kernel, q, k, v)
        assert torch.equal(o, o_copied) and torch.equal(lse, lse_copied), f"call {call}"
