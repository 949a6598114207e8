"""GPU tests of packed query rows against a paged K/V cache (Kernel.forward(q, k_cache, v_cache, block_table=,
cu_seqlens_q=, cu_seqlens_k=) with a layout packed spec): prefill, chunked prefill and speculative decoding as
serving engines run them. Sequence b's keys are the first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows of its
pages, which a block table scatters over a shared pool.

Each call must give, bit for bit, what the same kernel gives on the keys gathered into a contiguous packed
batch, and within the dtype's tolerance what the float64 reference gives per sequence (causal aligned
bottom-right); pages no sequence names must not matter, and poisoned outputs must be overwritten.

Run on a GPU machine: python -m pytest -m gpu tests/test_paged_prefill_gpu.py
"""
import numpy as np
import pytest

from fagen.spec import Spec

pytestmark = pytest.mark.gpu

SPECS = [Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"),              # forward_wgmma_ws
         Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.1, layout="packed"),     # forward_wgmma, Philox
         Spec(head_dim=96, dtype="bf16", mask="sliding_window", window=70, layout="packed"),   # 64-byte panels
         Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed",                 # a mask_mod (the ws walk)
              mask_mod="j <= i and (i - j < 100 or j < 4)")]

#: (query rows, keys) per sequence: a prefill with no history, a chunk after a long history, one query row
#: (a decoding step), speculative decoding's few rows, a sequence without queries and one without keys.
LENGTHS = ((130, 130), (77, 610), (1, 301), (5, 389), (0, 40), (3, 0))


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS)


def _torch_dtype(spec):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]


def _paged_batch(spec, page_size, lengths=LENGTHS, heads=8, kv_heads=2, seed=0):
    """q (total_q, heads, d); k_cache, v_cache (pool, page_size, kv_heads, d) with 3 pages no sequence names;
    block_table (batch, pages per sequence) int32, a random permutation of the pool; cu_seqlens_q, _k."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtype = _torch_dtype(spec)
    pages_per_sequence = max(1, -(-max(nk for _, nk in lengths) // page_size)) + 1   # one page to spare
    pool = len(lengths) * pages_per_sequence + 3
    k_cache, v_cache = (torch.randn(pool, page_size, kv_heads, spec.head_dim, device="cuda", dtype=dtype,
                                    generator=generator) for _ in range(2))
    order = torch.randperm(pool, device="cuda", generator=generator)
    table = order[:len(lengths) * pages_per_sequence].reshape(len(lengths), -1).to(torch.int32)
    q = torch.randn(sum(nq for nq, _ in lengths), heads, spec.head_dim, device="cuda", dtype=dtype,
                    generator=generator)
    cu_q, cu_k = ([0, *np.cumsum([n[i] for n in lengths]).tolist()] for i in (0, 1))
    return q, k_cache, v_cache, table, cu_q, cu_k, order[len(lengths) * pages_per_sequence:]


def _gathered(cache, table, lengths):
    """Each sequence's keys gathered from its pages: the contiguous packed (total_k, kv_heads, d) batch."""
    import torch

    rows = [cache[table[b].long()].flatten(0, 1)[:nk] for b, (_, nk) in enumerate(lengths)]
    return torch.cat(rows).contiguous()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
@pytest.mark.parametrize("page_size", [1, 16, 48, 256])
def test_paged_prefill_equals_the_contiguous_call_and_the_reference(spec, page_size):
    import torch

    from fagen import jit, reference
    from fagen.testing import TOLERANCES, _lse_error, relative_error

    kernel = jit.compile(spec)
    q, k_cache, v_cache, table, cu_q, cu_k, unused = _paged_batch(spec, page_size, seed=page_size)
    # outputs poisoned: every row of a sequence with queries is written, rows without keys as 0 / -inf
    o = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seed=5, offset=1,
                   out=(o, lse))
    k, v = _gathered(k_cache, table, LENGTHS), _gathered(v_cache, table, LENGTHS)
    want_o, want_lse = kernel.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seed=5, offset=1)
    torch.cuda.synchronize()
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse), "the paged call differs from the contiguous one"
    as64 = lambda t: t.double().cpu().numpy()  # noqa: E731
    ref_o, ref_lse = reference.packed_forward(as64(q), as64(k), as64(v), cu_q, cu_k, spec, seed=5, offset=1)
    assert relative_error(as64(o), ref_o) <= TOLERANCES[spec.dtype]
    assert _lse_error(as64(lse), ref_lse) <= TOLERANCES[spec.dtype]
    # the pages no sequence names, and the rows of its pages past a sequence's keys, are never read
    k_cache[unused] = float("nan")
    v_cache[unused] = float("nan")
    for cache in (k_cache, v_cache):
        for b, (_, nk) in enumerate(LENGTHS):
            tail = cache[table[b].long()].flatten(0, 1)
            tail[nk:] = float("nan")
            cache[table[b].long()] = tail.view(-1, page_size, *tail.shape[1:])
    again, again_lse = kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                      seed=5, offset=1)
    assert torch.equal(again, o) and torch.equal(again_lse, lse)


def test_paged_prefill_offsets_on_the_gpu():
    """cu_seqlens on the GPU (the serving engines' case: no host read-back) with max_seqlen_q / _k."""
    import torch

    from fagen import jit

    spec = SPECS[0]
    kernel = jit.compile(spec)
    q, k_cache, v_cache, table, cu_q, cu_k, _ = _paged_batch(spec, 16, seed=3)
    on_gpu = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k)]
    o, lse = kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=on_gpu[0], cu_seqlens_k=on_gpu[1],
                            max_seqlen_q=max(n for n, _ in LENGTHS), max_seqlen_k=max(n for _, n in LENGTHS))
    want_o, want_lse = kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def test_paged_prefill_arguments_get_clear_errors():
    import torch

    from fagen import jit
    from fagen.runtime import ArgumentError

    kernel = jit.compile(SPECS[0])
    q, k_cache, v_cache, table, cu_q, cu_k, _ = _paged_batch(SPECS[0], 16)
    with pytest.raises(ArgumentError, match="do not fit a row of the block table"):
        kernel.forward(q, k_cache, v_cache, block_table=table[:, :2], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ArgumentError, match="one per sequence"):
        kernel.forward(q, k_cache, v_cache, block_table=table[:-1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ArgumentError, match="block_table: expected int32"):
        kernel.forward(q, k_cache, v_cache, block_table=table.long(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(ArgumentError, match="pass cu_seqlens_q"):
        kernel.forward(q, k_cache, v_cache, block_table=table)
    odd = torch.zeros(*k_cache.shape[:3], 129, device="cuda", dtype=k_cache.dtype)[..., :128]   # heads 258 B apart
    with pytest.raises(ArgumentError, match="16-byte boundaries"):
        kernel.forward(q, odd, odd, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    fp32 = jit.compile(Spec(head_dim=64, dtype="fp32", mask="causal", layout="packed"))
    cache = torch.zeros(4, 16, 2, 64, device="cuda")
    with pytest.raises(ArgumentError, match="does not read paged"):
        fp32.forward(torch.zeros(3, 8, 64, device="cuda"), cache, cache, block_table=table[:1, :2],
                     cu_seqlens_q=[0, 3], cu_seqlens_k=[0, 20])
