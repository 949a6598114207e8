"""GPU tests of the fp8 (e4m3) forward (Spec dtype fp8_e4m3: FP8 wgmma on sm_90, V transposed in shared memory,
q_descale / k_descale / v_descale at run time, o in bf16).

Each case runs on fresh random e4m3 inputs with poisoned outputs against the float64 reference on the values they
stand for (e4m3 times descale: fagen.testing.assert_matches_reference, tolerance 2^-4, e4m3's relative half-ulp),
through the property suite's cases (odd lengths, grouped heads, both memory layouts, packed batches with empty
sequences), on every mask kind, a mask_mod, a score_mod and dropout; then longer sequences, the fast path's
descale pointers, fagen.attention, and bad arguments.

Run on a GPU machine: python -m pytest -m gpu tests/test_fp8_gpu.py
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fagen.spec import Spec

pytestmark = pytest.mark.gpu

SPECS = [
    Spec(head_dim=128, dtype="fp8_e4m3"),
    Spec(head_dim=128, dtype="fp8_e4m3", mask="causal"),
    Spec(head_dim=64, dtype="fp8_e4m3", mask="causal"),
    Spec(head_dim=256, dtype="fp8_e4m3"),
    Spec(head_dim=192, dtype="fp8_e4m3", mask="sliding_window", window=100),
    Spec(head_dim=128, dtype="fp8_e4m3", mask="padding"),
    Spec(head_dim=64, dtype="fp8_e4m3", mask="block_sparse", block_size=64),
    Spec(head_dim=128, dtype="fp8_e4m3", mask="causal", layout="packed"),
    Spec(head_dim=128, dtype="fp8_e4m3", dropout=0.1),
    # a score_mod sees true scores (S descaled first); a mask_mod reading key positions
    Spec(head_dim=128, dtype="fp8_e4m3", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"}),
    Spec(head_dim=64, dtype="fp8_e4m3", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}),
]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fp8_forward_matches_the_reference(spec, data):
    from fagen.testing import assert_matches_reference, cases

    case = data.draw(cases(spec, max_seq=300))
    assert_matches_reference(spec, case)


@pytest.mark.parametrize("spec", [SPECS[1], SPECS[3]], ids=lambda s: s.canonical_name)
def test_long_sequences_and_grouped_heads(spec):
    """Many key blocks (2,000 keys: the online softmax's rescaling across them) and 8 query heads on 2 K/V heads."""
    from fagen.testing import Case, assert_matches_reference

    errors = assert_matches_reference(spec, Case(batch=1, heads=8, seq_q=1000, seq_k=2000, layout="bnhd",
                                                 data_seed=5, seed=0, offset=0, kv_heads=2))
    assert errors["o"] > 0   # (e4m3's rounding of P~ shows: the check compares real numbers)


def _inputs(batch=2, heads=4, kv_heads=2, seq=300, dim=128, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(batch, kv_heads, seq, dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
    return q, k, v


def test_descales_through_the_fast_path_and_attention():
    """Numbers and tensors of descales give the same o; the fast path refills the descale pointers (new values, new
    o); identical calls give identical bits; fagen.attention returns bf16 o of q's shape."""
    import torch

    import fagen
    from fagen.jit import compile as compile_spec

    spec = SPECS[1]
    kernel = compile_spec(spec)
    q, k, v = _inputs()
    scales = {"q_descale": 0.5, "k_descale": 1.5, "v_descale": 2.0}
    as_tensors = {name: torch.full((2, 2), value, device="cuda") for name, value in scales.items()}
    o_numbers, lse_numbers = kernel.forward(q, k, v, **scales)
    o_first, lse_first = kernel.forward(q, k, v, **as_tensors)   # full path, then remembered
    o_fast, lse_fast = kernel.forward(q, k, v, **as_tensors)
    assert o_numbers.dtype == torch.bfloat16 and o_numbers.shape == q.shape
    assert torch.equal(o_first, o_fast) and torch.equal(lse_first, lse_fast)
    assert torch.equal(o_numbers, o_first)
    doubled = {**as_tensors, "v_descale": as_tensors["v_descale"] * 2}
    o_doubled, _ = kernel.forward(q, k, v, **doubled)           # the fast path, other descale tensors
    assert torch.allclose(o_doubled.float(), 2 * o_first.float(), rtol=1e-2, atol=1e-3)
    unscaled, _ = kernel.forward(q, k, v)
    assert not torch.equal(unscaled, o_first)
    o_attention = fagen.attention(q, k, v, spec, **scales)
    assert torch.equal(o_attention, o_numbers)


def test_fp8_against_the_bf16_kernel_on_the_same_values():
    """On the values the e4m3 inputs stand for, fagen's bf16 forward and its fp8 one agree within 2^-4."""
    import torch

    from fagen.jit import compile as compile_spec

    q, k, v = _inputs(seq=1024, seed=3)
    descale = torch.rand(2, 2, device="cuda") + 0.5
    o8, lse8 = compile_spec(SPECS[1]).forward(q, k, v, q_descale=descale, k_descale=descale, v_descale=descale)
    expand = descale.repeat_interleave(2, dim=1)[:, :, None, None]
    q16 = (q.float() * expand).bfloat16()
    k16, v16 = ((t.float() * descale[:, :, None, None]).bfloat16() for t in (k, v))
    o16, lse16 = compile_spec(Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward"])).forward(q16, k16, v16)
    error = ((o8.float() - o16.float()).norm() / o16.float().norm()).item()
    assert 0 < error < 2**-4, error
    assert torch.allclose(lse8, lse16, rtol=1e-2, atol=2e-2)


def test_bad_fp8_arguments_are_refused_by_name():
    import torch

    import fagen
    from fagen.jit import compile as compile_spec
    from fagen.runtime import ArgumentError

    kernel = compile_spec(SPECS[0])
    q, k, v = _inputs()
    with pytest.raises(ArgumentError, match="q_descale: expected one element or shape"):
        kernel.forward(q, k, v, q_descale=torch.ones(3, device="cuda"))
    with pytest.raises(ArgumentError, match="k_descale: expected float32"):
        kernel.forward(q, k, v, k_descale=torch.ones(1, device="cuda", dtype=torch.float16))
    with pytest.raises(ArgumentError, match="dtype bf16 does not match the spec's dtype fp8_e4m3"):
        kernel.forward(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with pytest.raises(ArgumentError, match="are for dtype fp8_e4m3 specs"):
        compile_spec(Spec(head_dim=128, dtype="bf16", passes=["forward"])).forward(q.bfloat16(), k.bfloat16(),
                                                                                   v.bfloat16(), q_descale=1.0)
    with pytest.raises(ArgumentError, match="without the backward pass"):
        o, lse = kernel.forward(q, k, v)
        kernel.backward(q, k, v, o, lse, o)
    with pytest.raises(ArgumentError, match="no backward yet"):
        fagen.attention(q.clone().requires_grad_(), k, v, SPECS[0])


@pytest.mark.parametrize("page_size", [1, 48, 256])
def test_a_paged_cache_gives_the_contiguous_calls_bits(page_size):
    """Packed query rows against a paged e4m3 K/V cache (chunked prefill, a decoding step, empty sequences) with
    per-sequence descales: bit for bit the same call on each sequence's keys gathered into a packed batch."""
    import numpy as np
    import torch

    from fagen.jit import compile as compile_spec

    spec = SPECS[7]
    lengths = ((130, 130), (77, 610), (1, 301), (0, 40), (3, 0))
    g = torch.Generator(device="cuda").manual_seed(page_size)
    pages = max(1, -(-610 // page_size)) + 1
    pool = len(lengths) * pages + 3
    k_cache, v_cache = (torch.randn(pool, page_size, 2, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
                        for _ in range(2))
    table = torch.randperm(pool, device="cuda", generator=g)[:len(lengths) * pages].reshape(len(lengths), -1)
    table = table.to(torch.int32)
    q = torch.randn(sum(n for n, _ in lengths), 8, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
    cu_q, cu_k = ([0, *np.cumsum([n[i] for n in lengths]).tolist()] for i in (0, 1))
    descales = {name: torch.rand(len(lengths), 2, device="cuda", generator=g) + 0.5
                for name in ("q_descale", "k_descale", "v_descale")}
    kernel = compile_spec(spec)
    o, lse = kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **descales)
    k, v = (torch.cat([cache[table[b].long()].flatten(0, 1)[:nk] for b, (_, nk) in enumerate(lengths)])
            for cache in (k_cache, v_cache))
    want_o, want_lse = kernel.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **descales)
    assert o.dtype == torch.bfloat16 and torch.equal(o, want_o) and torch.equal(lse, want_lse)
    assert o.float().abs().sum() > 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_gives_the_eager_bits(mode):
    """fagen.attention on e4m3 tensors under torch.compile(fullgraph=True) (the op fagen::attention_forward_fp8,
    a number descale made a tensor in the graph; CUDA graphs replaying it) gives the eager call's bits."""
    import torch

    import fagen

    torch._dynamo.reset()
    key = SPECS[1].canonical_json()
    q, k, v = _inputs(seed=7)
    per_head = torch.rand(2, 2, device="cuda") + 0.5

    def call(q, k, v):
        return fagen.attention(q, k, v, key, q_descale=per_head, k_descale=0.75, v_descale=per_head,
                               return_lse=True)

    want_o, want_lse = call(q, k, v)
    compiled = torch.compile(call, fullgraph=True, mode=mode)
    for _ in range(3):   # reduce-overhead records on the 2nd / 3rd call
        o, lse = compiled(q, k, v)
        assert o.dtype == torch.bfloat16 and torch.equal(o, want_o) and torch.equal(lse, want_lse)
