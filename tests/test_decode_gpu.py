"""GPU tests of the decode pass (templates/decode_splitkv.cu.j2): forward calls with few query rows
(group x Nq <= 16) take the split-KV kernel, and must give the forward's answer (float64 reference),
for every mask it takes, grouped and plain KV heads, long and short caches, every dtype, with a score_mod.

Run on a GPU machine: python -m pytest -m gpu tests/test_decode_gpu.py
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fagen.spec import Spec
from fagen.testing import Case, input_fields

pytestmark = pytest.mark.gpu

SPECS = [Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward", "decode"]),
         Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.2, passes=["forward", "decode"]),
         Spec(head_dim=256, dtype="bf16", mask="sliding_window", window=300, passes=["forward", "decode"]),
         Spec(head_dim=96, dtype="fp32", mask="padding", passes=["forward", "decode"]),
         Spec(head_dim=40, dtype="fp16", mask="causal", passes=["forward", "backward", "decode"]),   # padded to 48
         Spec(head_dim=104, dtype="bf16", mask="sliding_window", window=700, passes=["forward", "backward", "decode"]),
         # score_mod per row (each row its own query head and position): on the tensor-core decode and the CUDA-core one
         Spec(head_dim=128, dtype="bf16", mask="causal", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"},
              passes=["forward", "decode"]),
         Spec(head_dim=64, dtype="fp16", mask="padding", score_mod="score - slope[h] * (i - j)",
              inputs={"slope": "float32"}, passes=["forward", "decode"], arch="sm_80"),
         Spec(head_dim=64, dtype="fp32", score_mod="score + bias[h, j // 64] * 0.5", inputs={"bias": "float32"},
              passes=["forward", "decode"])]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS + PAGED_SPECS)


@st.composite
def decode_cases(draw, spec: Spec) -> Case:
    """Rows that fit one decode block (group x Nq <= 16), caches from 1 key to several splits' worth."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    seq_q = draw(st.integers(1, max(1, 16 // group)))
    seq_k = draw(st.one_of(st.integers(1, 200), st.integers(seq_q, 5000)))
    batch = draw(st.integers(1, 3))
    kv_lengths = None
    if spec.mask == "padding":
        kv_lengths = tuple(draw(st.lists(st.integers(0, seq_k), min_size=batch, max_size=batch)))
    inputs = {}
    if spec.modifiers.tensors or spec.modifiers.scalars:   # score_mod's inputs, as the property tests draw them
        scalars = [draw(st.sampled_from([1.0, 2.5, 30.0])) for _ in spec.modifiers.scalars]
        inputs = input_fields(spec, batch, kv_heads * group, seq_q, seq_k, draw(st.integers(0, 2**31 - 1)), scalars)
    return Case(batch, kv_heads * group, seq_q, seq_k, draw(st.sampled_from(["bhnd", "bnhd"])),
                draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)),
                kv_lengths, None, kv_heads, **inputs)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
def test_decode_matches_reference(spec, monkeypatch):
    from fagen import jit, runtime
    from fagen.testing import assert_matches_reference

    kernel = jit.compile(spec)
    taken = []
    original = runtime.Kernel._decode

    def counting(self, *args, **kwargs):
        taken.append(args[3])   # the shape
        return original(self, *args, **kwargs)

    monkeypatch.setattr(runtime.Kernel, "_decode", counting)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=decode_cases(spec))
    def check(case):
        before = len(taken)
        assert_matches_reference(kernel, case, backward="backward" in spec.passes)
        assert len(taken) == before + 1, "the call took the decode kernel"

    check()


def test_long_cache_splits_and_fast_path_follow_new_data():
    """Batch 1 with a 32k cache is cut into many splits; the second call with the same shapes takes the
    fast path (its own split workspaces) and must follow new data."""
    import torch

    import fagen

    kernel = fagen.compile(SPECS[0])
    torch.manual_seed(0)
    k, v = (torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    before = len(kernel._fast_forward)
    for trial in range(3):
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        o, lse = kernel.forward(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        error = ((o.float() - ref).norm() / ref.norm()).item()
        assert error < 1e-2, f"trial {trial}: relative error {error:.3g}"
    assert len(kernel._fast_forward) == before + 1
    call = next(iter(kernel._fast_forward.values())) if before == 0 else None
    if call is not None:
        assert call.launches[0][1][0] > 1, "a batch of one is split over several blocks"


# Paged K/V caches (Kernel.forward(..., block_table=)): the tensor-core decode (bf16 / fp16, with dropout)
# and the CUDA-core one (fp32); pages of one and of two of the plan's key tiles.
PAGED_SPECS = [Spec(head_dim=128, dtype="bf16", mask="padding", passes=["forward", "decode"]),
               Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.2, passes=["forward", "decode"]),
               Spec(head_dim=64, dtype="fp32", mask="padding", passes=["forward", "decode"])]


@pytest.mark.parametrize("spec", PAGED_SPECS, ids=lambda s: s.canonical_name)
@pytest.mark.parametrize("tiles_per_page", [1, 2])
def test_paged_cache_matches_the_reference_on_the_gathered_keys(spec, tiles_per_page):
    """k_cache, v_cache (pages, page_size, kv_heads, d) shuffled over the pool by a block table, lengths
    from 0 to every page full: each sequence must get what the float64 reference gives on its keys
    gathered into a contiguous tensor, on the full call path and then on the fast one (a new table and
    new queries), and the pages no table names must not matter."""
    import numpy as np
    import torch

    from fagen import jit, reference
    from fagen.testing import TOLERANCES, _lse_error, relative_error

    kernel = jit.compile(spec)
    page_size = tiles_per_page * kernel.plans["decode"].block_c
    batch, heads, kv_heads, pages_per_sequence, seq_q = 4, 8, 2, 5, 2 if spec.dtype == "fp32" else 1
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec.dtype]
    generator = torch.Generator(device="cuda").manual_seed(tiles_per_page)
    pool = batch * pages_per_sequence + 3   # 3 pages belong to no sequence
    k_cache, v_cache = (torch.randn(pool, page_size, kv_heads, spec.head_dim, device="cuda", dtype=dtype,
                                    generator=generator) for _ in range(2))
    keys = pages_per_sequence * page_size
    lengths = None   # on the GPU: what the fast path takes
    if spec.mask == "padding":
        lengths = torch.tensor([0, 1, keys // 2 + 3, keys], dtype=torch.int32, device="cuda")
    as64 = lambda t: t.double().cpu().numpy()  # noqa: E731
    before = len(kernel._fast_forward)
    for call in range(2):
        order = torch.randperm(pool, device="cuda", generator=generator)
        table = order[:batch * pages_per_sequence].reshape(batch, pages_per_sequence).to(torch.int32)
        q = torch.randn(batch, heads, seq_q, spec.head_dim, device="cuda", dtype=dtype, generator=generator)
        o, lse = kernel.forward(q, k_cache, v_cache, block_table=table, kv_lengths=lengths, seed=11, offset=2)
        torch.cuda.synchronize()
        # the same keys, gathered: (batch, kv_heads, keys, d)
        gathered = [cache[table.long()].reshape(batch, keys, kv_heads, spec.head_dim).transpose(1, 2)
                    for cache in (k_cache, v_cache)]
        ref_o, ref_lse = reference.attention_forward(as64(q), *(as64(t) for t in gathered), spec,
                                                     kv_lengths=None if lengths is None else lengths.tolist(),
                                                     seed=11, offset=2)
        assert relative_error(as64(o), ref_o) <= TOLERANCES[spec.dtype], f"call {call}: o"
        assert _lse_error(as64(lse), ref_lse) <= TOLERANCES[spec.dtype], f"call {call}: lse"
        assert np.isfinite(as64(o)).all()
    assert len(kernel._fast_forward) == before + 1, "the second call took the fast path"
    # the pages no sequence uses: poisoning them changes nothing
    unused = order[batch * pages_per_sequence:]
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    again, _ = kernel.forward(q, k_cache, v_cache, block_table=table, kv_lengths=lengths, seed=11, offset=2)
    assert torch.equal(again, o)


def test_paged_cache_arguments_get_clear_errors():
    import torch

    from fagen import jit
    from fagen.runtime import ArgumentError

    kernel = jit.compile(PAGED_SPECS[0])
    tile = kernel.plans["decode"].block_c
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(6, tile, 2, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(ArgumentError, match="multiple of"):
        kernel.forward(q, cache[:, :tile // 2], cache[:, :tile // 2], block_table=table, kv_lengths=[1, 2])
    with pytest.raises(ArgumentError, match="block_table: expected int32"):
        kernel.forward(q, cache, cache, block_table=table.long(), kv_lengths=[1, 2])
    with pytest.raises(ArgumentError, match="query rows per K/V head"):
        kernel.forward(torch.randn(2, 8, 9, 128, device="cuda", dtype=torch.bfloat16), cache, cache,
                       block_table=table, kv_lengths=[1, 2])
    with pytest.raises(ArgumentError, match="decode pass"):
        jit.compile(Spec(head_dim=128, dtype="bf16", mask="padding")).forward(q, cache, cache, block_table=table,
                                                                                 kv_lengths=[1, 2])
