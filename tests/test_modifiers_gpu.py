"""GPU tests of mask_mod / score_mod (fagen/expressions/): the variant library of examples/modifiers.yaml
and the same expressions on every template family (wgmma, mma.sync, SIMT, FA1), with dropout, grouped
KV heads and packed batches, forward and backward against the float64 reference, which evaluates
the same sympy expressions (and sympy's derivative of score_mod) in numpy.

Run on a GPU machine: python -m pytest -m gpu tests/test_modifiers_gpu.py
"""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from fagen.spec import Spec, load_specs
from fagen.testing import cases

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = load_specs(ROOT / "examples" / "modifiers.yaml")
FAMILIES = [
    # soft-capping (a derivative that is not 1) on mma.sync, and on CUDA cores in fp32 at an odd head dim
    Spec(head_dim=64, dtype="bf16", mask="causal", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"},
         arch="sm_80"),
    Spec(head_dim=59, dtype="fp32", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"}, dropout=0.1),
    # ALiBi with the FA1 loop order and a sliding window underneath (both masks apply)
    Spec(head_dim=64, dtype="fp16", mask="sliding_window", window=48, loop_order="fa1",
         score_mod="score - slope[h] * abs(i - j)", inputs={"slope": "float32"}),
    # document masking inside packed sequences, with dropout, and a deterministic backward
    Spec(head_dim=128, dtype="bf16", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}, dropout=0.1,
         layout="packed"),
    Spec(head_dim=64, dtype="fp16", mask_mod="i // 16 == j // 16 or j < 8", score_mod="score * 0.5 + 1",
         deterministic=True),
    # comparisons of integer fractions, compared exactly (parsed as 2 (i - j) < 3 * 16 ...): kernel and float64
    # reference agree on the pairs where a fraction meets its bound
    Spec(head_dim=64, dtype="bf16", mask="causal", mask_mod="(i - j) * 2 / 3 < 16 or j * 2 / 3 <= 5 + 1 / 3"),
    # the wide mma.sync backward (d = 192): soft-capping's derivative and a document mask from a summary
    Spec(head_dim=192, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", score_mod="cap * tanh(score / cap)",
         inputs={"doc": "int32", "cap": "scalar"}),
    # the warp-specialized forward (d = 128): its producer walks the tiles and hands the walk over with each K stage;
    # a document mask tested ahead of the tile, and a mask_mod of a few operations under a score_mod
    Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}),
    Spec(head_dim=128, dtype="fp16", mask_mod="j < prefix[b] or j <= i", score_mod="score - slope[h] * (i - j)",
         inputs={"prefix": "int32", "slope": "float32"}),
    # 64-byte swizzle panels (d = 96 on both wgmma passes) under a document mask's block-wide tile walk
    Spec(head_dim=96, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}),
    # gradients of score_mod's tensor inputs (fagen.testing checks them with input_grads=True): a derivative
    # that reads the score (wgmma), per-head sums on mma.sync, a per-position table on CUDA cores with the
    # deterministic dQ pass (which must not add them a second time) and on the wide mma.sync backward
    Spec(head_dim=64, dtype="bf16", mask="causal", score_mod="score + w[h] * tanh(score)", inputs={"w": "float32"}),
    Spec(head_dim=64, dtype="fp16", mask="causal", score_mod="score - slope[h] * (i - j)", inputs={"slope": "float32"},
         arch="sm_80"),
    Spec(head_dim=40, dtype="fp32", score_mod="score + bias[h, i - j + 16]", inputs={"bias": "float32"},
         deterministic=True),
    Spec(head_dim=192, dtype="bf16", score_mod="score + bias[h, i - j + 32]", inputs={"bias": "float32"}),
    # backward_wgmma's one plan at d = 128 with dropout (it spills 80 B with soft-capping), and a bias table's
    # per-element gradients on the warp-specialized backward (an additive score_mod)
    Spec(head_dim=128, dtype="bf16", mask="causal", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"},
         dropout=0.1),
    Spec(head_dim=96, dtype="fp16", score_mod="score + bias[h, i - j + 32]", inputs={"bias": "float32"}),
    # ... and in packed batches (b: the sequence), per-head sums and a per-sequence input whose derivative reads the score
    Spec(head_dim=64, dtype="bf16", mask="causal", score_mod="score - slope[h] * (i - j) + w[b, h] * tanh(score)",
         inputs={"slope": "float32", "w": "float32"}, layout="packed"),
]
SPECS = LIBRARY + FAMILIES


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.variant_name)
def test_modifiers_match_reference(spec):
    from fagen.testing import assert_matches_reference

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases(spec, max_seq=200, max_batch=3))
    def run(case):
        assert_matches_reference(spec, case, backward=True)

    run()


def _qkv(batch=2, heads=4, seq=300, d=128, dtype="bfloat16", seed=0):
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, seq, d, device="cuda", dtype=getattr(torch, dtype), generator=generator)
            for _ in range(3)]


def _as64(tensor):
    return tensor.detach().double().cpu().numpy()


@pytest.mark.parametrize("learned", [False, True], ids=["data", "learned"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "ops"])
def test_autograd_with_inputs_matches_reference(eager, learned, monkeypatch):
    """fagen.attention(..., inputs=...) through autograd, by the eager Function and by the torch ops; with
    learned ALiBi slopes (requires_grad), their gradient too."""
    import torch

    import fagen
    import fagen.torch as fagen_torch
    from fagen import reference

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", eager)
    spec = LIBRARY[0]   # ALiBi
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    slope = torch.tensor([0.5 ** (n + 1) for n in range(4)], device="cuda", requires_grad=learned)
    o = fagen.attention(q, k, v, spec, inputs={"slope": slope})
    do = torch.randn_like(o)
    o.backward(do)
    values = {"slope": _as64(slope)}
    args = (_as64(q), _as64(k), _as64(v))
    ref_o, _ = reference.attention_forward(*args, spec, inputs=values)
    ref_grads = reference.attention_backward(*args, _as64(do), spec, inputs=values, o=_as64(o))
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, q.grad, k.grad, v.grad), (ref_o, *ref_grads)):
        error = np.linalg.norm(_as64(got) - want) / np.linalg.norm(want)
        assert error < 1e-2, (name, error)
    if learned:
        want = reference.score_input_grads(*args, _as64(do), spec, inputs=values, o=_as64(o))["slope"]
        assert slope.grad is not None and slope.grad.shape == slope.shape and np.abs(want).max() > 1e-2
        error = np.linalg.norm(_as64(slope.grad) - want) / np.linalg.norm(want)
        assert error < 2e-2, error
    else:
        assert slope.grad is None


def test_fast_path_reads_each_calls_inputs():
    """A repeated call (the per-call fast path) must read the new call's tensor and scalar inputs."""
    import torch

    from fagen import reference
    from fagen.jit import compile as compile_spec

    softcap, alibi = LIBRARY[1], compile_spec(LIBRARY[0])
    q, k, v = _qkv(seq=130)
    for slope_value in (0.5, 0.01):
        slope = torch.full((4,), slope_value, device="cuda")
        o, _ = alibi.forward(q, k, v, inputs={"slope": slope})
        ref, _ = reference.attention_forward(_as64(q), _as64(k), _as64(v), alibi.spec,
                                             inputs={"slope": slope.cpu().numpy()})
        assert np.linalg.norm(_as64(o) - ref) / np.linalg.norm(ref) < 1e-2, slope_value
    capped = compile_spec(softcap)
    for cap in (30.0, 0.5):
        o, _ = capped.forward(q, k, v, inputs={"cap": cap})
        ref, _ = reference.attention_forward(_as64(q), _as64(k), _as64(v), softcap, inputs={"cap": cap})
        assert np.linalg.norm(_as64(o) - ref) / np.linalg.norm(ref) < 1e-2, cap


def test_input_errors_name_the_input():
    import torch

    from fagen.jit import compile as compile_spec
    from fagen.runtime import ArgumentError

    kernel = compile_spec(LIBRARY[4])   # documents: doc int32 (batch, positions)
    q, k, v = _qkv(d=64, seq=64)
    with pytest.raises(ArgumentError, match="missing.*doc"):
        kernel.forward(q, k, v)
    with pytest.raises(ArgumentError, match="unknown.*docs"):
        kernel.forward(q, k, v, inputs={"doc": torch.zeros(2, 64, dtype=torch.int32, device="cuda"), "docs": 1})
    with pytest.raises(ArgumentError, match="doc.*2-dimensional"):
        kernel.forward(q, k, v, inputs={"doc": torch.zeros(64, dtype=torch.int32, device="cuda")})
    with pytest.raises(ArgumentError, match="doc.*int32"):
        kernel.forward(q, k, v, inputs={"doc": torch.zeros(2, 64, device="cuda")})


@pytest.mark.parametrize("grouped, deterministic", [(False, False), (True, False), (False, True)],
                         ids=["mha", "gqa", "deterministic"])
def test_fast_path_with_run_time_summaries_reads_each_calls_documents(grouped, deterministic, monkeypatch):
    """Document ids decide tiles through a summary kernel; a repeated call must take the fast path (the
    full path is made to fail), with the summary launch and per-call workspaces, and use the new ids."""
    import torch

    from fagen import jit, reference, runtime

    spec = LIBRARY[4].model_copy(update={"deterministic": deterministic, "name": None})
    kernel = jit.compile(spec)
    q, k, v = _qkv(d=64, seq=333)
    if grouped:
        k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    do = torch.randn_like(q)

    def full_path(*args, **kwargs):
        raise AssertionError("the second call with this signature took the full path")

    for seed in (1, 2):
        lengths = np.random.default_rng(seed).integers(1, 90, size=40)
        ids = np.repeat(np.arange(40), lengths)[:333]
        ids = np.pad(ids, (0, 333 - ids.size), mode="edge")
        doc = torch.tensor(np.stack([ids, np.zeros_like(ids)]), dtype=torch.int32, device="cuda")
        o, lse = kernel.forward(q, k, v, inputs={"doc": doc})
        grads = kernel.backward(q, k, v, o, lse, do, inputs={"doc": doc})
        values = {"doc": doc.cpu().numpy()}
        ref_o, _ = reference.attention_forward(_as64(q), _as64(k), _as64(v), spec, inputs=values)
        ref_grads = reference.attention_backward(_as64(q), _as64(k), _as64(v), _as64(do), spec, inputs=values,
                                                 o=_as64(o))
        for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (ref_o, *ref_grads)):
            error = np.linalg.norm(_as64(got) - want) / np.linalg.norm(want)
            assert error < 1e-2, (seed, name, error)
        if seed == 1:   # the second iteration must not run the full paths
            monkeypatch.setattr(runtime.Kernel, "_forward", full_path)
            monkeypatch.setattr(runtime.Kernel, "_backward", full_path)
    # (other cases' shapes share the kernel) the forward launches its summary kernel first; the backward's _delta,
    # its first launch, writes the summaries itself
    for table, first in ((kernel._fast_forward, "_summary"), (kernel._fast_backward, "_delta")):
        for call in table.values():
            assert runtime.arguments._SLOT["mod_summary0"][0] in call.slots and call.workspaces == ((2 * 6, 2),)
            assert call.launches[0][4].endswith(first)
            assert not any(launch[4].endswith("_summary") for launch in call.launches[1:])


@pytest.mark.parametrize("head_dim, mask_mod", [(64, "documents"), (96, "documents"), (128, "documents"),
                                               (128, "window_sinks")])
def test_tile_walk_past_one_block_of_tiles(head_dim, mask_mod):
    """A block classifies THREADS tiles at a time (TileWalk); a longer walk refills its bits. At N = 20000 the
    d = 64 forward walks 157 key tiles (Bc = 128, 128 threads), the d = 96 backward 313 query tiles (Br = 64,
    128 threads), the d = 128 documents forward 313 key tiles (forward_wgmma, Bc = 64) and the d = 128
    warp-specialized forward (a window with sinks, which reads no input) 157 key tiles (its producer's 128
    threads): o, dq, dk, dv against SDPA in fp32 with the same mask as a boolean tensor (causal, within documents
    that cross the refill boundaries; or a band of 3000 keys and the first 4, whose tiles change class across
    them)."""
    import torch
    import torch.nn.functional as F

    from fagen.jit import compile as compile_spec

    seq = 20000
    positions = torch.arange(seq, device="cuda")
    causal = positions[None, :] <= positions[:, None]
    if mask_mod == "documents":
        spec = Spec(head_dim=head_dim, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]",
                    inputs={"doc": "int32"})
        lengths = [7000, 1, 9500, seq - 16501]   # boundaries inside the first and second chunk of tiles
        doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda", dtype=torch.int32),
                                      torch.tensor(lengths, device="cuda"))[None]
        inputs = {"doc": doc}
        allowed = causal & (doc[0][:, None] == doc[0][None, :])
    else:
        spec = Spec(head_dim=head_dim, dtype="bf16", mask_mod="j <= i and (i - j < 3000 or j < 4)")
        inputs = None
        allowed = causal & ((positions[:, None] - positions[None, :] < 3000) | (positions[None, :] < 4))
    kernel = compile_spec(spec)
    if head_dim == 128:   # documents: forward_wgmma's 64 x 64 (timed faster); otherwise the warp-specialized forward
        expected = "forward_wgmma" if mask_mod == "documents" else "forward_wgmma_ws"
        assert kernel.plans["forward"].family == expected
    q, k, v = _qkv(batch=1, heads=2, seq=seq, d=head_dim)
    do = torch.randn_like(q)
    o, lse = kernel.forward(q, k, v, inputs=inputs)
    dq, dk, dv = kernel.backward(q, k, v, o, lse, do, inputs=inputs)

    q32, k32, v32 = (t.float().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=allowed)
    ref.backward(do.float())
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (ref, q32.grad, k32.grad, v32.grad)):
        error = (torch.linalg.norm(got.float() - want) / torch.linalg.norm(want)).item()
        assert error < 2e-2, (name, error)
