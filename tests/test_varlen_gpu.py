"""GPU tests of packed variable-length batches (spec layout packed, FlashAttention-2's varlen
convention): q (total_q, H, d), k and v (total_k, H_kv, d), sequences located by cu_seqlens. Each
sequence must give what the float64 reference gives for it alone (fagen/reference.py packed_forward),
for every mask, dropout, grouped KV heads, empty and length-1 sequences, every template family.

Run on a GPU machine: python -m pytest -m gpu tests/test_varlen_gpu.py
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fagen.spec import Spec
from fagen.testing import Case, cases

pytestmark = pytest.mark.gpu

SPECS = [Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"),                       # wgmma
         Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.15, layout="packed"),             # wgmma + Philox
         Spec(head_dim=64, dtype="bf16", mask="sliding_window", window=40, layout="packed", arch="sm_80"),  # mma.sync
         Spec(head_dim=96, dtype="fp16", mask="padding", layout="packed", deterministic=True),     # deterministic dQ
         Spec(head_dim=32, dtype="bf16", mask="block_sparse", block_size=32, layout="packed"),
         Spec(head_dim=59, dtype="fp32", mask="causal", dropout=0.1, layout="packed"),             # SIMT, odd d
         Spec(head_dim=64, dtype="fp16", mask="causal", loop_order="fa1", layout="packed"),   # FA1 forward
         Spec(head_dim=256, dtype="bf16", mask="causal", layout="packed"),                     # wide backward
         # backward_wgmma's one plan at d = 128 (spilling with a score_mod) on sm_90, with dropout: padded up from 112,
         # and ALiBi
         Spec(head_dim=112, dtype="bf16", mask="causal", dropout=0.1, layout="packed"),
         Spec(head_dim=128, dtype="fp16", mask="causal", dropout=0.1, layout="packed",
              score_mod="score - slope[h] * (i - j)", inputs={"slope": "float32"})]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
def test_packed_batches_match_reference(spec):
    from fagen.testing import assert_matches_reference

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(spec, max_seq=200, max_batch=4))
    def run(case):
        assert_matches_reference(spec, case, backward=True)

    run()


def _packed_inputs(lengths_q, lengths_k, heads=4, kv_heads=2, d=128, seed=0):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda rows, h: torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16, generator=generator)  # noqa: E731
    q = make(sum(lengths_q), heads)
    k, v = make(sum(lengths_k), kv_heads), make(sum(lengths_k), kv_heads)
    cu = [torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device="cuda")
          for n in (lengths_q, lengths_k)]
    return q, k, v, cu


def test_autograd_with_device_offsets_matches_reference():
    """fagen.attention on packed tensors through autograd, offsets on the GPU (no host read-back)."""
    import torch

    import fagen
    from fagen import reference

    spec = SPECS[0]
    lengths = [130, 0, 1, 517, 64]
    q, k, v, (cu_q, cu_k) = _packed_inputs(lengths, lengths)
    for t in (q, k, v):
        t.requires_grad_(True)
    o = fagen.attention(q, k, v, spec, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=517, max_seqlen_k=517)
    do = torch.randn_like(o)
    o.backward(do)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    ref_o, _ = reference.packed_forward(as64(q), as64(k), as64(v), cu_q.cpu().numpy(), cu_k.cpu().numpy(), spec)
    ref_grads = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), cu_q.cpu().numpy(), cu_k.cpu().numpy(),
                                          spec, o=as64(o))
    for got, want in zip((o, q.grad, k.grad, v.grad), (ref_o, *ref_grads)):
        error = np.linalg.norm(as64(got) - want) / np.linalg.norm(want)
        assert error < 1e-2, error


def test_torch_compile_and_cuda_graph_take_packed_batches():
    """The custom ops carry cu_seqlens: torch.compile(fullgraph=True) traces them, and a CUDA graph
    captured once replays with new data in the same buffers."""
    import torch

    import fagen

    key = SPECS[0].canonical_json()
    lengths = [300, 17, 0, 250]
    q, k, v, (cu_q, cu_k) = _packed_inputs(lengths, lengths, seed=1)

    def attend(q, k, v, cu_q, cu_k):
        return fagen.attention(q, k, v, key, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=300, max_seqlen_k=300)

    eager = attend(q, k, v, cu_q, cu_k)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v, cu_q, cu_k)
    assert torch.equal(eager, compiled)
    static = [t.clone() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(*static, cu_q, cu_k)   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(*static, cu_q, cu_k)
    q2, k2, v2, _ = _packed_inputs(lengths, lengths, seed=2)
    for target, source in zip(static, (q2, k2, v2)):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, attend(q2, k2, v2, cu_q, cu_k))


def test_device_offsets_out_of_range_are_clamped_not_read_out_of_bounds():
    """Offsets on the GPU are not checked on the host (that would synchronise): the kernels clamp them
    into [0, rows] and each sequence to max_seqlen, so out-of-range offsets give a defined answer and
    never an access outside the tensors."""
    import torch

    from fagen import jit, reference

    kernel = jit.compile(SPECS[0])
    q, k, v, _ = _packed_inputs([100], [100], seed=3)
    bad = torch.tensor([-5, 40, 40, 10_000], dtype=torch.int32, device="cuda")   # below 0, past the end
    o, lse = kernel.forward(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=bad, max_seqlen_q=50, max_seqlen_k=50)
    torch.cuda.synchronize()
    # as the kernels read them: [0, 40), [40, 40), [40, 90) (100 rows, truncated to max_seqlen 50)
    clamped = np.array([0, 40, 40, 90])
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    ref_o, _ = reference.packed_forward(as64(q)[:90], as64(k)[:90], as64(v)[:90], clamped, clamped, SPECS[0])
    assert torch.isfinite(o).all() and not o[90:].any()
    error = np.linalg.norm(as64(o)[:90] - ref_o) / np.linalg.norm(ref_o)
    assert error < 1e-2, error


def test_packed_arguments_get_clear_errors():
    import torch

    from fagen import jit, runtime

    kernel = jit.compile(SPECS[0])
    q, k, v, (cu_q, cu_k) = _packed_inputs([10, 20], [10, 20])
    with pytest.raises(runtime.ArgumentError, match="layout packed: pass cu_seqlens_q"):
        kernel.forward(q, k, v)
    with pytest.raises(runtime.ArgumentError, match="pass max_seqlen_q"):
        kernel.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with pytest.raises(runtime.ArgumentError, match="shorter than the longest"):
        kernel.forward(q, k, v, cu_seqlens_q=[0, 10, 30], cu_seqlens_k=[0, 10, 30], max_seqlen_q=15)
    with pytest.raises(runtime.ArgumentError, match="non-decreasing"):
        kernel.forward(q, k, v, cu_seqlens_q=[0, 20, 10], cu_seqlens_k=[0, 10, 30])
    with pytest.raises(runtime.ArgumentError, match="same batch"):
        kernel.forward(q, k, v, cu_seqlens_q=[0, 30], cu_seqlens_k=[0, 10, 30])
    with pytest.raises(runtime.ArgumentError, match="3 dimensions"):
        kernel.forward(q[None], k, v, cu_seqlens_q=[0, 30], cu_seqlens_k=[0, 30])
    padded = jit.compile(Spec(head_dim=128, dtype="bf16", mask="causal"))
    with pytest.raises(runtime.ArgumentError, match="layout padded"):
        padded.forward(q[None], k[None], v[None], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.cuda.is_available()


def test_arrays_without_torch_take_the_packed_path():
    """PyCUDA arrays (any __cuda_array_interface__ object), fp16, host offsets with a spare row: the
    packed views are built from the interface's strides, and fresh outputs are PyCUDA arrays."""
    import pycuda.gpuarray as gpuarray

    from fagen import jit, reference, runtime

    spec = Spec(head_dim=64, dtype="fp16", mask="causal", layout="packed")
    kernel = jit.compile(spec)
    runtime.ensure_context()
    rng = np.random.default_rng(4)
    cu_q, cu_k = [0, 70, 70, 201], [0, 90, 91, 150]
    q, do = (rng.standard_normal((202, 4, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((150, 2, 64)).astype(np.float16) for _ in range(2))
    arrays = [gpuarray.to_gpu(x) for x in (q, k, v, do)]
    o, lse = kernel.forward(*arrays[:3], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dq, dk, dv = kernel.backward(*arrays[:3], o, lse, arrays[3], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    ref_o, ref_lse = reference.packed_forward(q, k, v, cu_q, cu_k, spec)
    ref_grads = reference.packed_backward(q, k, v, do, cu_q, cu_k, spec, o=o.get().astype(np.float64))
    assert not o.get()[201:].any() and np.isneginf(lse.get()[:, 201:]).all()
    for got, want in zip((o, dq, dk, dv), (ref_o, *ref_grads)):
        got = got.get().astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    assert np.allclose(lse.get()[:, :201], ref_lse[:, :201], atol=1e-3)


@pytest.mark.parametrize("arrays", ["torch", "pycuda"])
def test_outputs_given_for_a_batch_without_work_get_their_sequence_rows(arrays):
    """Every sequence empty of queries (or of keys): no kernel runs, yet outputs the caller passes in get the
    rows inside the sequences written (dk, dv 0 for keys no query sees; o 0 and lse -inf for queries without
    keys), and the rows outside every sequence stay the caller's (hypothesis found dk left as it was)."""
    import pycuda.gpuarray as gpuarray
    import torch

    from fagen import jit, runtime

    spec = Spec(head_dim=32, dtype="fp16", mask="causal", layout="packed")
    kernel = jit.compile(spec)
    runtime.ensure_context()
    rng = np.random.default_rng(7)
    q, do = (rng.standard_normal((3, 2, 32)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((4, 2, 32)).astype(np.float16) for _ in range(2))
    if arrays == "torch":
        move, read = (lambda x: torch.from_numpy(x).cuda()), (lambda x: x.cpu().numpy())
        poison = lambda shape, dtype=np.float16: torch.full(shape, float("nan"), device="cuda",  # noqa: E731
                                                            dtype=torch.float16 if dtype == np.float16 else torch.float32)
    else:
        move, read = gpuarray.to_gpu, (lambda x: x.get())
        poison = lambda shape, dtype=np.float16: gpuarray.to_gpu(np.full(shape, np.nan, dtype))  # noqa: E731
    q_, k_, v_, do_ = (move(x) for x in (q, k, v, do))
    # no queries at all; keys 0 .. 2 in sequences, key 3 outside every sequence
    grads = (poison((3, 2, 32)), poison((4, 2, 32)), poison((4, 2, 32)))
    o, lse = kernel.forward(q_, k_, v_, cu_seqlens_q=[0, 0, 0], cu_seqlens_k=[0, 2, 3])
    kernel.backward(q_, k_, v_, o, lse, do_, out=grads, cu_seqlens_q=[0, 0, 0], cu_seqlens_k=[0, 2, 3])
    dq, dk, dv = (read(g).astype(np.float64) for g in grads)
    assert np.isnan(dq).all()                      # no query row lies inside a sequence: all the caller's
    for grad in (dk, dv):
        assert not grad[:3].any() and np.isnan(grad[3:]).all()
    # queries 1 .. 2 in sequences without keys, query 0 outside every sequence
    out = (poison((3, 2, 32)), poison((2, 3), np.float32))
    kernel.forward(q_, k_, v_, out=out, cu_seqlens_q=[1, 2, 3], cu_seqlens_k=[0, 0, 0])
    o, lse = (read(t).astype(np.float64) for t in out)
    assert not o[1:].any() and np.isnan(o[:1]).all()
    assert np.isneginf(lse[:, 1:]).all() and np.isnan(lse[:, :1]).all()


def test_repeated_packed_calls_take_the_fast_path_and_read_the_new_offsets(monkeypatch):
    """A packed call whose signature was seen before (shapes, strides, max_seqlen; offsets on the GPU)
    skips the checks and launches at once; the offsets' contents are read by the kernel on every call."""
    import torch

    from fagen import jit, reference, runtime

    kernel = jit.compile(SPECS[0])
    first, second = [100, 50, 0, 78], [10, 200, 17, 1]      # same total, same count: one signature
    q, k, v, (cu_first, _) = _packed_inputs(first, first, seed=5)
    cu_second = torch.tensor(np.concatenate([[0], np.cumsum(second)]), dtype=torch.int32, device="cuda")
    kernel.forward(q, k, v, cu_seqlens_q=cu_first, cu_seqlens_k=cu_first, max_seqlen_q=200, max_seqlen_k=200)

    def full_path(*args, **kwargs):
        raise AssertionError("the second call with this signature took the full path")

    monkeypatch.setattr(runtime.Kernel, "_forward_packed", full_path)
    o, lse = kernel.forward(q, k, v, cu_seqlens_q=cu_second, cu_seqlens_k=cu_second, max_seqlen_q=200,
                            max_seqlen_k=200)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    ref_o, ref_lse = reference.packed_forward(as64(q), as64(k), as64(v), cu_second.cpu().numpy(),
                                              cu_second.cpu().numpy(), SPECS[0])
    assert np.linalg.norm(as64(o) - ref_o) / np.linalg.norm(ref_o) < 1e-2
    assert np.array_equal(np.isneginf(as64(lse)), np.isneginf(ref_lse))



@pytest.mark.parametrize("folded, permuted", [(False, False), (True, False), (True, True)],
                         ids=["per query head", "folded", "folded, (H, total, d) storage"])
def test_repeated_packed_backwards_take_the_fast_path_and_read_the_new_offsets(folded, permuted, monkeypatch):
    """The backward of a packed call seen before (offsets on the GPU) skips the checks and launches at once, as
    the forward does: gradients zeroed (rows outside every sequence read 0), grouped KV heads summed through the
    zeroed per-query-head workspace or folded; the offsets' contents read by the kernels on every call. Inputs
    stored (H, total, d) and seen as (total, H, d) get contiguous gradients, as on the full path (the remembered
    strides are the full path's: a review found the fast path writing them into storage laid out like q's)."""
    import torch

    from fagen import jit, reference, runtime

    monkeypatch.setattr(runtime.kernel, "FOLD_WAVES", 0 if folded else 10**9)
    kernel = jit.compile(SPECS[0])
    kernel._fast_backward.clear()
    # same count and maximum: one signature; the second call leaves 3 query and key rows after its last sequence
    first, second = [100, 50, 0, 78], [10, 200, 14, 1]
    q, k, v, (cu_first, _) = _packed_inputs(first, first, seed=6)
    if permuted:
        q, k, v = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v))
    cu_second = torch.tensor(np.concatenate([[0], np.cumsum(second)]), dtype=torch.int32, device="cuda")
    lengths = {"max_seqlen_q": 200, "max_seqlen_k": 200}
    do = torch.randn_like(q)
    o, lse = kernel.forward(q, k, v, cu_seqlens_q=cu_first, cu_seqlens_k=cu_first, **lengths)
    kernel.backward(q, k, v, o, lse, do, cu_seqlens_q=cu_first, cu_seqlens_k=cu_first, **lengths)
    assert [call.folded for call in kernel._fast_backward.values()] == [folded]

    def full_path(*args, **kwargs):
        raise AssertionError("the second backward with this signature took the full path")

    o, lse = kernel.forward(q, k, v, cu_seqlens_q=cu_second, cu_seqlens_k=cu_second, **lengths)
    monkeypatch.setattr(runtime.Kernel, "_backward_packed", full_path)
    # memory the allocator hands out next: the gradients' sizes, and the per-query-head dK, dV workspaces'
    poisoned = [torch.full_like(t, float("nan")) for t in (q, k, v, q, k, v)]
    poisoned += [torch.full((1, q.shape[1], k.shape[0], k.shape[2]), float("nan"), dtype=k.dtype, device="cuda")
                 for _ in range(2)]
    del poisoned
    grads = kernel.backward(q, k, v, o, lse, do, cu_seqlens_q=cu_second, cu_seqlens_k=cu_second, **lengths)
    kernel._fast_backward.clear()   # (the folded call stays out of later tests, which run at FOLD_WAVES)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    expected = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), cu_second.cpu().numpy(),
                                         cu_second.cpu().numpy(), SPECS[0], o=as64(o))
    for name, mine, ref in zip(("dq", "dk", "dv"), grads, expected):
        assert mine.is_contiguous(), name
        assert np.isfinite(as64(mine)).all(), name
        assert not as64(mine)[sum(second):].any(), f"{name}: rows after the last sequence are not 0"
        assert np.linalg.norm(as64(mine) - ref) / np.linalg.norm(ref) < 1e-2, name


def test_packed_autograd_backward_is_keyed_by_its_forward(monkeypatch):
    """fagen.attention on packed tensors, offsets on the GPU, three times with one signature: from the second call
    on, the backward on autograd's thread finds its launch by the forward's key (Kernel.backward_after) without
    recomputing the packed signature, and reads the new offsets and data; against the float64 reference each time,
    rows after the last sequence 0 in every gradient."""
    import torch

    import fagen
    from fagen import jit, reference, runtime

    spec = SPECS[0]
    kernel = jit.compile(spec)
    kernel._fast_backward_after.clear()
    lengths = {"max_seqlen_q": 200, "max_seqlen_k": 200}
    signatures = []
    real = runtime.Kernel._packed_signature

    def counted(self, tensors, *args, **kwargs):
        signatures.append(len(tensors))   # 3: a forward's, 5: a backward's
        return real(self, tensors, *args, **kwargs)

    monkeypatch.setattr(runtime.Kernel, "_packed_signature", counted)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    for call, sequence_lengths in enumerate(([100, 50, 0, 78], [10, 200, 14, 4], [200, 1, 1, 26])):   # one total
        q, k, v, (cu, _) = _packed_inputs(sequence_lengths, sequence_lengths, seed=20 + call)
        q, k, v = (torch.cat([t, torch.randn_like(t[:3])]).requires_grad_() for t in (q, k, v))  # 3 rows after
        signatures.clear()
        o = fagen.attention(q, k, v, spec, cu_seqlens_q=cu, cu_seqlens_k=cu, **lengths)
        do = torch.randn_like(o)
        o.backward(do)
        assert signatures == ([3, 5] if call == 0 else [3]), (call, signatures)
        cu64 = cu.cpu().numpy()
        want_o, _ = reference.packed_forward(as64(q), as64(k), as64(v), cu64, cu64, spec)
        want = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), cu64, cu64, spec, o=want_o)
        for name, got, ref in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
            assert np.isfinite(as64(got)).all() and not as64(got)[sum(sequence_lengths):].any(), (call, name)
            assert np.linalg.norm(as64(got) - ref) / np.linalg.norm(ref) < 1e-2, (call, name)
    assert any(key[0] == "packed" for key in kernel._fast_backward_after)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "ops"])
def test_offsets_refilled_before_the_backward_are_an_error_not_other_gradients(eager, monkeypatch):
    """A packing buffer refilled in place for the next micro-batch before this one's backward: the backward would
    read the new offsets with the old activations. Both routes (the eager autograd.Function and the ops) save
    cu_seqlens for the backward, so this is torch's in-place error; a buffer left alone still gives the
    reference's gradients."""
    import torch

    import fagen
    import fagen.torch as fagen_torch
    from fagen import reference

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", eager)
    spec = SPECS[0]
    lengths = [60, 0, 77, 3]
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    for refill in (True, False):
        q, k, v, (cu, _) = _packed_inputs(lengths, lengths, seed=41)
        for t in (q, k, v):
            t.requires_grad_(True)
        o = fagen.attention(q, k, v, spec, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=77, max_seqlen_k=77)
        do = torch.randn_like(o)
        if refill:
            cu.copy_(torch.tensor([0, 70, 70, 137, 140], dtype=torch.int32, device="cuda"))
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                o.backward(do)
            continue
        o.backward(do)
        cu64 = cu.cpu().numpy()
        want_o, _ = reference.packed_forward(as64(q), as64(k), as64(v), cu64, cu64, spec)
        want = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), cu64, cu64, spec, o=want_o)
        for got, ref in zip((q.grad, k.grad, v.grad), want):
            assert np.linalg.norm(as64(got) - ref) / np.linalg.norm(ref) < 1e-2


PACKED_FOLD_CASES = [(Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 2),
                     (Spec(head_dim=64, dtype="fp16", mask="none", layout="packed"), 1),            # MQA
                     (Spec(head_dim=96, dtype="bf16", mask="sliding_window", window=70, layout="packed"), 2),
                     (Spec(head_dim=128, dtype="fp16", mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"},
                           layout="packed"), 1)]


@pytest.mark.parametrize("spec, kv_heads", PACKED_FOLD_CASES, ids=lambda x: x.canonical_name if isinstance(x, Spec) else str(x))
def test_grouped_kv_heads_folded_in_packed_batches(spec, kv_heads, monkeypatch):
    """Packed batches with grouped KV heads on backward_wgmma_ws, every block walking its K/V head's group of query
    heads for its sequence (runtime.kernel.FOLD_WAVES at 0: folded at any size): no per-query-head dK, dV workspace and no
    _kv_group_sum launched. A query head's LSE, D and dQ accumulator rows are a whole (heads, total_q) row apart
    there, not a sequence's. Sequences of other query and key lengths, empty and of one row, keys after the last
    sequence; offsets on the GPU (outputs zeroed) and from the host into the caller's poisoned outputs (the rows
    inside sequences written, the key rows outside left as given). Against the float64 reference per sequence."""
    import torch

    from fagen import jit, reference, runtime
    from fagen.sources import folds_kv_group
    from fagen.testing import CANCELLATION_FLOOR, TOLERANCES, relative_error

    monkeypatch.setattr(runtime.kernel, "FOLD_WAVES", 0)
    launched = []
    launch = runtime.Kernel._launch
    monkeypatch.setattr(runtime.Kernel, "_launch", lambda self, device, symbol, *rest: (
        launched.append(symbol), launch(self, device, symbol, *rest))[1])
    kernel = jit.compile(spec)
    assert folds_kv_group(spec, kernel.plans["backward"])
    lengths_q, lengths_k = [130, 0, 1, 517, 64], [200, 7, 0, 517, 33]
    heads, d, outside = 4, spec.head_dim, 5       # key rows after the last sequence
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    generator = torch.Generator(device="cuda").manual_seed(11)
    make = lambda rows, h: torch.randn(rows, h, d, device="cuda", generator=generator).to(dtype)  # noqa: E731
    q, do = make(sum(lengths_q), heads), make(sum(lengths_q), heads)
    k, v = make(sum(lengths_k) + outside, kv_heads), make(sum(lengths_k) + outside, kv_heads)
    offsets = [np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lengths_q, lengths_k)]
    inputs = {"inputs": {"prefix": torch.tensor([40, 3, 0, 300, 70], dtype=torch.int32, device="cuda")}} \
        if spec.modifiers.tensors else {}
    on_gpu = {"cu_seqlens_q": torch.from_numpy(offsets[0]).cuda(), "cu_seqlens_k": torch.from_numpy(offsets[1]).cuda(),
              "max_seqlen_q": 517, "max_seqlen_k": 517}
    o, lse = kernel.forward(q, k, v, **on_gpu, **inputs)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    magnitudes = {}
    expected = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), *offsets, spec, o=as64(o),
                                         magnitudes=magnitudes,
                                         inputs={"prefix": inputs["inputs"]["prefix"].cpu().numpy()} if inputs else None)
    inside = slice(0, sum(lengths_k))
    for call in ("device offsets", "host offsets, given outputs"):
        launched.clear()
        if call == "device offsets":
            grads = kernel.backward(q, k, v, o, lse, do, **on_gpu, **inputs)
        else:
            grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
            kernel.backward(q, k, v, o, lse, do, out=grads, cu_seqlens_q=offsets[0].tolist(),
                            cu_seqlens_k=offsets[1].tolist(), **inputs)
            for name, grad in zip(("dk", "dv"), grads[1:]):
                assert torch.isnan(grad[inside.stop:]).all(), f"{name} ({call}): rows outside every sequence overwritten"
        assert launched and not any(symbol.endswith("_kv_group_sum") for symbol in launched), \
            f"the backward did not fold the group: {launched}"
        for name, mine, ref in zip(("dq", "dk", "dv"), grads, expected):
            rows = slice(None) if name == "dq" or call == "device offsets" else inside
            assert np.isfinite(as64(mine[rows])).all(), f"{name} ({call}): not finite"
            error = relative_error(as64(mine[rows]), ref[rows], CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
            assert error <= TOLERANCES[spec.dtype], f"{name} ({call}): relative error {error:.3g}"
