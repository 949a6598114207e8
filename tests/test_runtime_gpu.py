"""GPU property tests of the forward and backward kernels against the float64 reference.

Run on a GPU machine: FAGEN_HYPOTHESIS_PROFILE=gpu python -m pytest -m gpu tests/test_runtime_gpu.py
Each spec is compiled once (nvcc through PyCUDA, cached on disk); hypothesis draws shapes
(Nq != Nk, 1, non-multiples of the tiles), layouts, masks' run-time arguments and dropout seeds.
"""
import pytest
from hypothesis import HealthCheck, given, settings

from fagen.spec import Spec
from fagen.testing import HEAD_DIMS, cases

pytestmark = pytest.mark.gpu

MASKS = [dict(mask="none"), dict(mask="causal"), dict(mask="sliding_window", window=37),
         dict(mask="padding"), dict(mask="block_sparse", block_size=64)]


def _specs():
    """Every mask x loop order x dtype, dropout on half of them, head dims rotating through 32..256."""
    specs = []
    n = 0
    for mask in MASKS:
        for loop_order in ("fa2", "fa1"):
            for dtype in ("fp16", "bf16", "fp32"):
                specs.append(Spec(head_dim=HEAD_DIMS[n % len(HEAD_DIMS)], dtype=dtype, loop_order=loop_order,
                                  dropout=0.2 if n % 2 else 0.0, **mask))
                n += 1
    return specs


SPECS = _specs() + [  # head dims that are not multiples of 16
    Spec(head_dim=40, dtype="fp16", mask="causal", dropout=0.1),
    Spec(head_dim=72, dtype="bf16", mask="sliding_window", window=50),
    # any head dim from 1 to 256: the user's tensors as they are (rows of odd length, no padding copy)
    Spec(head_dim=1, dtype="fp32", mask="padding"),
    Spec(head_dim=3, dtype="bf16", mask="none", dropout=0.1),
    Spec(head_dim=59, dtype="fp16", mask="causal", dropout=0.1),
    Spec(head_dim=58, dtype="bf16", mask="causal"),   # rows of whole 4-byte words: asynchronous 4-byte copies
    Spec(head_dim=96, dtype="bf16", mask="sliding_window", window=70),   # dQ split 64 + 32 over two warpgroups
    Spec(head_dim=111, dtype="bf16", mask="sliding_window", window=50),
    Spec(head_dim=111, dtype="bf16", mask="block_sparse", block_size=64, loop_order="fa1"),
    Spec(head_dim=255, dtype="fp16", mask="causal"),
    # multiples of 8 that are not the templates' own multiples: tensor cores with the head dim padded
    # inside the kernel (8 -> 16 on mma.sync; 120 -> 128, and 40 -> 64, 72 -> 96 above, on wgmma; 72 -> 80 on
    # mma.sync where the plan is for sm_80)
    Spec(head_dim=8, dtype="bf16", mask="padding"),
    Spec(head_dim=120, dtype="fp16", mask="none", dropout=0.2),
    Spec(head_dim=72, dtype="bf16", mask="causal", arch="sm_80"),
    # sm_80's mma.sync plans (fagen.testing.kernel_under_test compiles a spec's older-arch plans for this GPU), their
    # row pointers in shared memory (block_values_in_shared): the backward's at Br = 128 (d = 64) and Br = 64
    # (d = 128), held in registers at Br = 32 (d = 128 with dropout); the forward's O and LSE rows, Q in registers
    # (d = 64, 96) and re-read from shared memory (d = 128, with K's and V's rows there too); the lane offsets each
    # product derives afresh (tc::fresh_lane: the backwards without dropout, S's and dP's too for the window, and
    # the forward's P V where Q is re-read)
    Spec(head_dim=64, dtype="fp16", mask="none", arch="sm_80"),
    Spec(head_dim=96, dtype="bf16", mask="causal", arch="sm_80"),
    Spec(head_dim=128, dtype="bf16", mask="causal", arch="sm_80"),
    Spec(head_dim=128, dtype="fp16", mask="sliding_window", window=100, arch="sm_80"),
    Spec(head_dim=160, dtype="bf16", mask="causal", arch="sm_80"),
    Spec(head_dim=128, dtype="fp16", mask="causal", dropout=0.2, arch="sm_80")]
GRAD_SPECS = [s for s in SPECS if s.loop_order == "fa2"] + [
    Spec(head_dim=64, dtype="fp16", mask="causal", dropout=0.1, deterministic=True),
    # d > 128: backward_wgmma_wide on sm_90 (d = 160 padded to 192, 192 in 64-byte panels, 256; an odd d padded to
    # 256), backward_fa2_mma_wide where an sm_80 plan runs (Br = 32 at d = 256) and at an odd d up to 160 on sm_90
    Spec(head_dim=256, dtype="bf16", mask="none"),
    Spec(head_dim=160, dtype="fp16", mask="causal"),
    Spec(head_dim=145, dtype="bf16", mask="causal"),
    Spec(head_dim=192, dtype="bf16", mask="sliding_window", window=100, dropout=0.1),
    Spec(head_dim=256, dtype="bf16", mask="causal", arch="sm_80"),
    Spec(head_dim=250, dtype="fp16", mask="padding"),
    Spec(head_dim=128, dtype="bf16", mask="block_sparse", block_size=128, dropout=0.3),
    # 64-key mask blocks at d = 97-128 on sm_90: backward_wgmma_wide at d = 128 (backward_wgmma's 128 keys do not
    # divide them)
    Spec(head_dim=128, dtype="fp16", mask="block_sparse", block_size=64, dropout=0.1),
    Spec(head_dim=112, dtype="bf16", mask="block_sparse", block_size=64)]


@pytest.fixture(scope="session", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS + GRAD_SPECS + [spec for spec, *_ in MANY_PAIRS] + [spec for spec, _ in ROW_PASS_CASES])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
def test_forward_matches_reference(spec):
    from fagen.testing import assert_matches_reference

    @settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(spec))
    def check(case):
        assert_matches_reference(spec, case)

    check()


@pytest.mark.parametrize("spec", GRAD_SPECS, ids=lambda s: s.canonical_name)
def test_backward_matches_reference(spec):
    from fagen.testing import assert_matches_reference

    @settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(spec, max_seq=200))
    def check(case):
        assert_matches_reference(spec, case, backward=True)

    check()


@pytest.mark.parametrize("spec", [Spec(head_dim=64, dtype="bf16", mask="causal"),
                                  Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.1),
                                  Spec(head_dim=128, dtype="bf16", mask="sliding_window", window=300),
                                  Spec(head_dim=96, dtype="bf16", mask="causal", dropout=0.1),
                                  # mask_mods: the producer walks the row blocks alone and hands each stage over
                                  # with the next visible one and whether the mask_mod sees every pair of it
                                  Spec(head_dim=64, dtype="bf16", mask_mod="j <= i and (i - j < 256 or j < 4)"),
                                  Spec(head_dim=64, dtype="fp16", mask_mod="(i - j) % 3 == 0", dropout=0.1),
                                  # keys past 200 seen by no query: those key blocks load nothing, dK = dV = 0
                                  Spec(head_dim=128, dtype="bf16", mask_mod="j < 200"),
                                  # document ids: the producer's walk reads their run-time summaries (sorted ids in
                                  # 0-3: empty, full and partial tiles)
                                  Spec(head_dim=64, dtype="bf16", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"},
                                       dropout=0.1),
                                  Spec(head_dim=128, dtype="fp16", mask="causal", mask_mod="doc[b, i] == doc[b, j]",
                                       inputs={"doc": "int32"}),
                                  # additive score_mods (d score_mod / d score = 1), their inputs' gradients summed
                                  # per warp (slope[h]) and added per element (bias[h, i - j]) by the consumers only
                                  Spec(head_dim=128, dtype="bf16", mask="causal", score_mod="score - slope[h] * (i - j)",
                                       inputs={"slope": "float32"}),
                                  Spec(head_dim=64, dtype="fp16", mask="sliding_window", window=300,
                                       score_mod="score + bias[h, i - j]", inputs={"bias": "float32"})],
                         ids=lambda s: s.canonical_name)
def test_warp_specialized_backward_reuses_its_stages(spec):
    """backward_wgmma_ws hands two stages of Q_i, dO_i and two dS^T tiles between its warpgroups by barrier phases:
    at least 5 row blocks (Br = 128 at d = 64, 64 above), so that every stage, dS^T tile and dQ staging area is
    reused and both parities of every barrier wrap (the property tests' 200 rows reach 2 blocks at d = 64).
    With a mask_mod, row blocks are skipped and tiles are full or partial, as the producer's walk hands them over;
    with a score_mod, its inputs' gradients as well (assert_matches_reference)."""
    from fagen.jit import compile as compile_spec
    from fagen.testing import Case, assert_matches_reference, input_fields

    kernel = compile_spec(spec)
    if kernel.plans["backward"].family != "backward_wgmma_ws":
        pytest.skip(f"this device's plan is {kernel.plans['backward'].family}")
    for seq_q, seq_k in ((5 * 128 + 37, 5 * 128 + 37), (700, 900)):
        assert_matches_reference(kernel, Case(batch=2, heads=3, seq_q=seq_q, seq_k=seq_k, layout="bnhd", data_seed=seq_q,
                                              seed=7, offset=11, **input_fields(spec, 2, 3, seq_q, seq_k, seq_k, ())),
                                 backward=True)


@pytest.mark.parametrize("spec", [Spec(head_dim=192, dtype="bf16", mask="causal", dropout=0.1),
                                  Spec(head_dim=186, dtype="fp16", mask="sliding_window", window=300),
                                  Spec(head_dim=192, dtype="bf16", mask="none",
                                       score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"})],
                         ids=lambda s: s.canonical_name)
def test_d192_forward_on_112_key_blocks(spec):
    """forward_wgmma at d = 192 walks 112 keys a block (not a power of two): several whole blocks and a partial one,
    causal and windowed tiles that cross 112-key edges, Nq != Nk."""
    from fagen.jit import compile as compile_spec
    from fagen.testing import Case, assert_matches_reference, input_fields

    kernel = compile_spec(spec)
    plan = kernel.plans["forward"]
    if (plan.block_r, plan.block_c) != (128, 112):
        pytest.skip(f"this device's forward plan is {plan.family} {plan.block_r} x {plan.block_c}")
    for seq_q, seq_k in ((5 * 112 + 37, 5 * 112 + 37), (300, 1000)):
        assert_matches_reference(kernel, Case(batch=2, heads=3, seq_q=seq_q, seq_k=seq_k, layout="bnhd", data_seed=seq_k,
                                              seed=5, offset=3, **input_fields(spec, 2, 3, seq_q, seq_k, seq_k, (8.0,))),
                                 backward=True)


def test_forward_backward_at_32k_tokens_without_quadratic_memory():
    """Issue 4's memory check: N = 32k, d = 64, batch 1, 16 heads, fp16, forward + backward.
    An N x N fp32 buffer alone would need 16 * 32768^2 * 4 B = 64 GiB; we allow a few times the inputs."""
    import numpy as np
    import torch

    from fagen import reference
    from fagen.jit import compile as compile_spec

    spec = Spec(head_dim=64, dtype="fp16", mask="none")
    kernel = compile_spec(spec)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 16, 32768, 64, device="cuda", dtype=torch.float16, generator=generator)
                   for _ in range(4))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    o, lse = kernel.forward(q, k, v)
    dq, dk, dv = kernel.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - baseline
    input_bytes = q.numel() * q.element_size()
    assert extra < 12 * input_bytes, f"peak extra memory {extra / 2**20:.0f} MiB for {input_bytes / 2**20:.0f} MiB inputs"
    for t in (o, lse, dq, dk, dv):
        assert torch.isfinite(t).all()
    rows = [0, 12345, 32767]  # a few query rows against the float64 reference over all 32k keys
    head = 3
    qn = q[:, head:head + 1, rows].double().cpu().numpy()
    kn, vn = (t[:, head:head + 1].double().cpu().numpy() for t in (k, v))
    ref_o, ref_lse = reference.attention_forward(qn, kn, vn, spec)
    got = o[:, head:head + 1, rows].double().cpu().numpy()
    assert np.linalg.norm(got - ref_o) / np.linalg.norm(ref_o) < 1e-2
    assert np.allclose(lse[:, head:head + 1, rows].double().cpu().numpy(), ref_lse, rtol=1e-4)


# More (sequence, head) pairs than a grid's y dimension holds (65535): the runtime folds them over z.
# One spec per kind of main kernel: wgmma forward + backward with dropout, mma.sync padded d, the CUDA-core
# templates, a packed batch of 33k one- and two-row sequences (two heads), and the split-KV decode.
MANY_PAIRS = [(Spec(head_dim=64, dtype="bf16", mask="causal", dropout=0.1), 1100, 64, None),
              (Spec(head_dim=40, dtype="fp16", mask="sliding_window", window=2), 70001, 1, None),
              (Spec(head_dim=59, dtype="fp32", mask="none"), 35000, 2, None),
              (Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"), 33000, 2, "packed"),
              (Spec(head_dim=128, dtype="fp16", mask="none", passes=["forward", "decode"]), 70000, 1, "decode")]


@pytest.mark.parametrize("spec, batch, heads, kind", MANY_PAIRS, ids=lambda x: getattr(x, "canonical_name", str(x)))
def test_more_sequence_head_pairs_than_a_grid_dimension_holds(spec, batch, heads, kind):
    """batch x heads > 65535 used to be refused by the driver at launch; every pair, the last ones
    included, must match the float64 reference (forward and, where the spec has it, backward)."""
    from fagen.testing import Case, assert_matches_reference

    assert batch * heads > 65535
    if kind == "packed":   # lengths 1, 2, 1, 2, ...: sequence b's rows start at 1.5 b
        lengths = tuple(1 + b % 2 for b in range(batch))
        case = Case(batch, heads, sum(lengths), sum(lengths), "bhnd", 11, 5, 3, q_lengths=lengths, k_lengths=lengths)
    else:
        seq_q = 1 if kind == "decode" else 3
        case = Case(batch, heads, seq_q, 5, "bhnd", 11, 2**40 + 5, 3)
    assert_matches_reference(spec, case, backward="backward" in spec.passes)


AUTOGRAD_SPECS = [Spec(head_dim=64, dtype="fp16", dropout=p, **mask) for mask in MASKS for p in (0.0, 0.2)]


@pytest.mark.parametrize("spec", AUTOGRAD_SPECS, ids=lambda s: s.canonical_name)
def test_autograd_gradients_match_reference(spec):
    """Issue 4's acceptance: fagen.attention(q, k, v, spec).backward() against the float64 reference."""
    import numpy as np
    import torch

    import fagen
    from fagen import reference
    from fagen.testing import CANCELLATION_FLOOR, TOLERANCES, Case, make_inputs, relative_error

    case = Case(batch=2, heads=3, seq_q=150, seq_k=133, layout="bnhd", data_seed=11, seed=5, offset=9,
                kv_lengths=(133, 60) if spec.mask == "padding" else None,
                block_mask=((1, 0, 1), (0, 1, 1), (1, 1, 0)) if spec.mask == "block_sparse" else None)
    q, k, v = (t.requires_grad_() for t in make_inputs(spec, case))
    (do,) = make_inputs(spec, Case(**{**case.__dict__, "data_seed": 12}), names=("do",))
    runtime = case.runtime_args()
    o = fagen.attention(q, k, v, spec, **runtime)
    (o.float() * do.float()).sum().backward()
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    magnitudes = {}
    ref = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), spec,
                                       kv_lengths=runtime.get("kv_lengths"), block_mask=runtime.get("block_mask"),
                                       seed=case.seed, offset=case.offset, o=as64(o), magnitudes=magnitudes)
    for name, tensor, expected in zip(("dq", "dk", "dv"), (q, k, v), ref):
        assert tensor.grad is not None and tensor.grad.dtype == tensor.dtype
        error = relative_error(as64(tensor.grad), expected, CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
        assert error <= TOLERANCES[spec.dtype], f"{name}: relative error {error:.3g}"
    assert np.isfinite(as64(o)).all()


ROW_PASS_CASES = [(Spec(head_dim=64, dtype="bf16", mask="causal"), 4),
                  (Spec(head_dim=128, dtype="fp16", mask="none"), 2),
                  (Spec(head_dim=96, dtype="bf16", mask="sliding_window", window=70), 1)]


@pytest.mark.parametrize("spec, kv_heads", ROW_PASS_CASES,
                         ids=lambda x: x.canonical_name if isinstance(x, Spec) else f"kv{x}")
def test_backward_row_passes_take_rows_that_are_not_16_byte_aligned(spec, kv_heads):
    """The backward's row passes (_delta, _dq_convert, _kv_group_sum) move 16-byte vectors where every row of
    the tensors they touch starts 16-byte aligned, else one element at a time. Both, in one call each: o a
    view 8 bytes off its storage (the backward reads it as given), the caller's dq, dk, dv (out=) 4 bytes off,
    with grouped KV heads so that the group sum writes those dk, dv. Against the float64 reference, and the
    aligned call against the same reference."""
    import numpy as np
    import torch

    import fagen
    from fagen import reference
    from fagen.testing import CANCELLATION_FLOOR, TOLERANCES, relative_error

    kernel = fagen.compile(spec)
    generator = torch.Generator(device="cuda").manual_seed(3)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    batch, heads, seq, d = 2, 4, 333, spec.head_dim
    q, do = (torch.randn(batch, heads, seq, d, generator=generator, device="cuda").to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, d, generator=generator, device="cuda").to(dtype) for _ in range(2))
    o, lse = kernel.forward(q, k, v)

    def offset_like(tensor, elements):
        """A tensor equal to `tensor` whose storage starts `elements` elements into a larger buffer."""
        buffer = torch.full((tensor.numel() + 16,), float("nan"), dtype=tensor.dtype, device="cuda")
        view = buffer[elements:elements + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        return view

    o_off = offset_like(o, 4)                        # 8 bytes off
    out = tuple(offset_like(torch.full_like(t, float("nan")), 2) for t in (q, k, v))   # 4 bytes off, poisoned
    assert all(t.data_ptr() % 16 for t in (o_off, *out))
    aligned = kernel.backward(q, k, v, o, lse, do)
    unaligned = kernel.backward(q, k, v, o_off, lse, do, out=out)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    magnitudes = {}
    expected = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), spec, o=as64(o), magnitudes=magnitudes)
    for name, mine_aligned, mine_unaligned, ref in zip(("dq", "dk", "dv"), aligned, unaligned, expected):
        floor = CANCELLATION_FLOOR * magnitudes.get(name, 0.0)
        for label, mine in (("aligned", mine_aligned), ("unaligned", mine_unaligned)):
            assert np.isfinite(as64(mine)).all(), f"{name} ({label}): not finite"
            error = relative_error(as64(mine), ref, floor)
            assert error <= TOLERANCES[spec.dtype], f"{name} ({label}): relative error {error:.3g}"


FOLD_CASES = [(Spec(head_dim=64, dtype="bf16", mask="causal"), 2, 333, 333),
              (Spec(head_dim=128, dtype="fp16", mask="none"), 1, 200, 333),
              (Spec(head_dim=96, dtype="bf16", mask="sliding_window", window=70), 2, 333, 257),
              (Spec(head_dim=128, dtype="bf16", mask="causal"), 1, 129, 400),
              (Spec(head_dim=64, dtype="fp16", mask="padding"), 2, 190, 333),   # kv_lengths (100, 333) below
              # mask_mods that do not read h: every head of a group walks the first head's tiles (doc, prefix below)
              (Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]",
                    inputs={"doc": "int32"}), 2, 333, 333),
              (Spec(head_dim=128, dtype="fp16", mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"}), 1, 257, 300),
              (Spec(head_dim=128, dtype="bf16", mask_mod="j <= i and (i - j < 100 or j < 4)"), 2, 400, 400),
              # d = 96 (64-row blocks too); keys past the last query: key block 2 sees no row block (dK, dV = 0)
              (Spec(head_dim=96, dtype="fp16", mask_mod="j <= i and (i - j < 100 or j < 4)"), 1, 200, 333),
              # d = 64 (128-row blocks)
              (Spec(head_dim=64, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]",
                    inputs={"doc": "int32"}), 2, 333, 333),
              (Spec(head_dim=64, dtype="fp16", mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"}), 1, 257, 300),
              (Spec(head_dim=64, dtype="bf16", mask_mod="j <= i and (i - j < 100 or j < 4)"), 1, 200, 333)]


@pytest.mark.parametrize("spec, kv_heads, seq_q, seq_k", FOLD_CASES,
                         ids=lambda x: x.canonical_name if isinstance(x, Spec) else str(x))
def test_grouped_kv_heads_folded_into_one_block_per_kv_head(spec, kv_heads, seq_q, seq_k, monkeypatch):
    """Grouped KV heads on backward_wgmma_ws with every block walking its K/V head's whole group of query heads
    (runtime.kernel.FOLD_WAVES at 0: folded at any size, where by default only grids of FOLD_WAVES blocks per SM are):
    dK, dV summed in registers and written by the kernel into the caller's poisoned tensors, no workspace and no
    _kv_group_sum. MQA and GQA, Nq != Nk, lengths off the tiles, a padding mask's per-sequence key lengths, mask_mods
    that do not read h (documents, prefix-LM, window + sinks: the producer walks the first head's tiles once per
    head), tensors in (B, H, N, d) and as (B, N, H, d) viewed so (the head stride a folded block steps by). Against
    the float64 reference: a call into given outputs, then the full path's and the remembered fast path's calls."""
    import numpy as np
    import torch

    import fagen
    from fagen import reference, runtime
    from fagen.sources import folds_kv_group
    from fagen.testing import CANCELLATION_FLOOR, TOLERANCES, relative_error

    monkeypatch.setattr(runtime.kernel, "FOLD_WAVES", 0)
    kernel = fagen.compile(spec)
    assert folds_kv_group(spec, kernel.plans["backward"])
    generator = torch.Generator(device="cuda").manual_seed(5)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    batch, heads, d = 2, 4, spec.head_dim
    q, do = (torch.randn(batch, heads, seq_q, d, generator=generator, device="cuda").to(dtype) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq_k, d, generator=generator, device="cuda").to(dtype) for _ in range(2))
    if kv_heads == 2:   # (B, N, H, d) activations seen as (B, H, N, d): q, k, v, dO with the head stride d
        q, k, v, do = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, do))
    lengths = {"kv_lengths": torch.tensor([100, seq_k], dtype=torch.int32, device="cuda")} if spec.mask == "padding" else {}
    positions = torch.arange(max(seq_q, seq_k), device="cuda")
    inputs = {"doc": torch.stack([positions // 97, (positions + 30) // 150]).to(torch.int32),   # documents of 97 / 150
              "prefix": torch.tensor([40, 200], dtype=torch.int32, device="cuda")}
    inputs = {name: inputs[name] for name, _, _ in spec.modifiers.tensors}
    if inputs:
        lengths["inputs"] = inputs
    o, lse = kernel.forward(q, k, v, **lengths)
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    magnitudes = {}
    expected = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), spec, o=as64(o), magnitudes=magnitudes,
                                            kv_lengths=lengths["kv_lengths"].cpu().numpy() if "kv_lengths" in lengths else None,
                                            inputs={name: t.cpu().numpy() for name, t in inputs.items()} or None)
    before = set(kernel._fast_backward)
    for call in ("full path, given outputs", "full path", "fast path"):
        if call == "full path, given outputs":   # poisoned: the kernels must write every element
            grads = kernel.backward(q, k, v, o, lse, do, out=tuple(torch.full_like(t, float("nan")) for t in (q, k, v)),
                                    **lengths)
        else:
            grads = kernel.backward(q, k, v, o, lse, do, **lengths)
        for name, mine, ref in zip(("dq", "dk", "dv"), grads, expected):
            assert np.isfinite(as64(mine)).all(), f"{name} ({call}): not finite"
            error = relative_error(as64(mine), ref, CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
            assert error <= TOLERANCES[spec.dtype], f"{name} ({call}): relative error {error:.3g}"
    remembered = [kernel._fast_backward[key] for key in set(kernel._fast_backward) - before]
    kernel._fast_backward.clear()   # (the folded calls stay out of later tests, which run at FOLD_WAVES)
    kernel._fast_backward_after.clear()
    assert remembered and all(call.folded for call in remembered), "the backward did not fold the group"
