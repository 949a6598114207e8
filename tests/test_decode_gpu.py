"""GPU tests of the decode pass (templates/decode_splitkv.cu.j2): forward calls with few query rows
(group x Nq <= 16) take the split-KV kernel, and must give the forward's answer (float64 reference),
for every mask it takes, grouped and plain KV heads, long and short caches, every dtype.

Run on a GPU machine: python -m pytest -m gpu tests/test_decode_gpu.py
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fagen.spec import Spec
from fagen.testing import Case

pytestmark = pytest.mark.gpu

SPECS = [Spec(head_dim=128, dtype="bf16", mask="causal", passes=["forward", "decode"]),
         Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.2, passes=["forward", "decode"]),
         Spec(head_dim=256, dtype="bf16", mask="sliding_window", window=300, passes=["forward", "decode"]),
         Spec(head_dim=96, dtype="fp32", mask="padding", passes=["forward", "decode"]),
         Spec(head_dim=40, dtype="fp16", mask="causal", passes=["forward", "backward", "decode"]),   # padded to 48
         Spec(head_dim=104, dtype="bf16", mask="sliding_window", window=700, passes=["forward", "backward", "decode"])]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.runtime import precompile

    precompile(SPECS)


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
    return Case(batch, kv_heads * group, seq_q, seq_k, draw(st.sampled_from(["bhnd", "bnhd"])),
                draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)),
                kv_lengths, None, kv_heads)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
def test_decode_matches_reference(spec, monkeypatch):
    from fagen import runtime
    from fagen.testing import assert_matches_reference

    kernel = runtime.compile(spec)
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
