"""GPU tests of a value head dim unlike the query's (Spec.value_head_dim: DeepSeek's MLA, 192 / 128): q and k of
head_dim, v, o, dO and dV of value_head_dim, on every template family that takes it (Hopper's warpgroup-MMA
forwards and backwards, sm_80's mma.sync ones run on this GPU, the split-KV decode kernel).

Each case runs on fresh random inputs with poisoned outputs against the float64 reference, forward and backward
(fagen.testing.assert_matches_reference, the dtype's tolerance), through the property suite's cases (odd lengths,
grouped heads, both memory layouts); then through torch (autograd, the fast path, q's layout kept for o), a
paged cache, and a DeepSeek-V3 model from transformers with no fallback.

Run on a GPU machine: python -m pytest -m gpu tests/test_value_head_dim_gpu.py
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fagen.spec import Spec

pytestmark = pytest.mark.gpu

SPECS = [
    Spec(head_dim=192, value_head_dim=128, dtype="bf16", mask="causal"),        # forward_wgmma, backward_wgmma_wide
    Spec(head_dim=96, value_head_dim=64, dtype="fp16"),                         # forward_wgmma, backward_wgmma_ws
    Spec(head_dim=64, value_head_dim=128, dtype="bf16", mask="causal"),         # v wider than q: the _ws templates
    Spec(head_dim=128, value_head_dim=64, dtype="bf16", dropout=0.1),           # dropout's stream, the other way round
    Spec(head_dim=256, value_head_dim=128, dtype="bf16", mask="sliding_window", window=100),
    Spec(head_dim=192, value_head_dim=128, dtype="bf16", mask="causal", layout="packed"),
    Spec(head_dim=192, value_head_dim=128, dtype="fp16", mask="causal", arch="sm_80"),   # mma.sync, the wide backward
    Spec(head_dim=96, value_head_dim=64, dtype="bf16", arch="sm_80", mask_mod="(i - j) % 3 != 1"),
    Spec(head_dim=128, value_head_dim=64, dtype="bf16", mask="padding", passes=("forward", "backward", "decode")),
    # backward_wgmma (not the _ws one); V's tiles narrowed past the values: 96 columns for 72 (64-byte panels, dP^T's
    # k-steps rounded up to 5 of 16), 32 for 24
    Spec(head_dim=96, value_head_dim=64, dtype="bf16", mask="block_sparse", block_size=64),
    Spec(head_dim=192, value_head_dim=72, dtype="bf16", mask="causal"),
    Spec(head_dim=64, value_head_dim=24, dtype="fp16"),
]
DECODE_SPEC = SPECS[8]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile([s for s in SPECS if s.arch == "sm_90"])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_value_head_dim_matches_the_reference(spec, data):
    from fagen.testing import assert_matches_reference, cases

    case = data.draw(cases(spec, max_seq=200))
    assert_matches_reference(spec, case, backward="backward" in spec.passes)


def test_decode_kernel_takes_a_narrower_value_head_dim(monkeypatch):
    """A call of few query rows (the decode pass: split-KV partials HEAD_DIM wide, combined into dv columns)."""
    import numpy as np
    import torch

    from fagen import jit, reference
    from fagen.testing import TOLERANCES, relative_error

    spec = DECODE_SPEC
    kernel = jit.compile(spec)
    decodes = []
    real = type(kernel)._decode
    monkeypatch.setattr(type(kernel), "_decode", lambda self, *a, **kw: decodes.append(1) or real(self, *a, **kw))
    torch.manual_seed(3)
    q = torch.randn(3, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 2, 3000, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, 2, 3000, 64, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([3000, 1, 1777], dtype=torch.int32, device="cuda")
    o = torch.full((3, 8, 1, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((3, 8, 1), float("nan"), device="cuda")
    kernel.forward(q, k, v, kv_lengths=lengths, out=(o, lse))
    ref_o, _ = reference.attention_forward(*(t.double().cpu().numpy() for t in (q, k, v)), spec,
                                           kv_lengths=lengths.cpu().numpy())
    assert relative_error(o.double().cpu().numpy(), ref_o) <= TOLERANCES["bf16"]
    assert np.isfinite(lse.cpu().numpy()).all()
    assert decodes == [1], "the call ran the decode kernel"
    # the same keys from a paged cache (pages of whole decode tiles, shuffled; its splits may differ: the tolerance)
    page = kernel.plans["decode"].block_c * 2
    pages = -(-3000 // page)
    order = torch.randperm(3 * pages, device="cuda")
    table = order.reshape(3, pages).to(torch.int32)
    caches = []
    for x in (k, v):
        cache = x.new_zeros(3 * pages, page, 2, x.shape[-1])
        rows = torch.nn.functional.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, pages * page - 3000))   # (3, keys, 2, d)
        cache[table.long()] = rows.reshape(3, pages, page, 2, x.shape[-1])
        caches.append(cache)
    paged_o, paged_lse = kernel.forward(q, *caches, block_table=table, kv_lengths=lengths)
    assert paged_o.shape == (3, 8, 1, 64) and decodes == [1, 1]
    assert relative_error(paged_o.double().cpu().numpy(), ref_o) <= TOLERANCES["bf16"]
    assert torch.allclose(paged_lse, lse, atol=1e-3)


def test_torch_attention_grads_match_sdpa_and_keep_qs_layout():
    """fagen.attention through autograd against SDPA's math backend (which takes E != Ev) on the same inputs;
    q, k, v as (batch, seq, heads, d) activations viewed as (batch, heads, seq, d): o keeps that layout. The second
    call takes the fast path and must give the same bits."""
    import torch
    import torch.nn.functional as F

    import fagen

    spec = SPECS[0]
    torch.manual_seed(0)
    q, k = (torch.randn(2, 1000, 8, 192, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    v = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    do = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    o = fagen.attention(*leaves, spec)
    assert o.shape == (2, 8, 1000, 128) and o.transpose(1, 2).is_contiguous()
    o.backward(do)
    again = fagen.attention(*(t.detach() for t in leaves), spec)
    assert torch.equal(again, o.detach())
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    ref.backward(do.double())
    for name, got, want in (("o", o, ref), *zip(("dq", "dk", "dv"), (t.grad for t in leaves),
                                                  (t.grad for t in exact))):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 1e-2, (name, error)


def test_paged_prefill_with_a_narrower_value_cache():
    """Packed query rows against pages whose V rows are narrower than K's: the contiguous packed call's bits."""
    import torch

    from fagen import jit

    spec = SPECS[5]
    kernel = jit.compile(spec)
    torch.manual_seed(1)
    lengths = ((130, 130), (5, 389), (0, 40))
    page, pages, pool = 16, 25, 80   # 25 pages of 16 rows hold the longest sequence's 389 keys
    k_cache = torch.randn(pool, page, 2, 192, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(pool, page, 2, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(pool, device="cuda")[:3 * pages].reshape(3, pages).to(torch.int32)
    q = torch.randn(sum(n for n, _ in lengths), 8, 192, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 130, 135, 135], dtype=torch.int32)
    cu_k = torch.tensor([0, 130, 519, 559], dtype=torch.int32)
    o, lse = kernel.forward(q, k_cache, v_cache, block_table=table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert o.shape == (135, 8, 128)
    gathered = [torch.cat([cache[table[b].long()].flatten(0, 1)[:nk] for b, (_, nk) in enumerate(lengths)])
                for cache in (k_cache, v_cache)]
    want_o, want_lse = kernel.forward(q, *gathered, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def test_shapes_that_do_not_match_the_spec_are_refused():
    import torch

    from fagen import jit
    from fagen.runtime import ArgumentError

    kernel = jit.compile(SPECS[0])
    q = torch.randn(1, 2, 64, 192, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="value_head_dim 128"):
        kernel.forward(q, q, q)   # v of q's head dim
    v = q[..., :128].contiguous()
    with pytest.raises(ArgumentError, match="o: head_dim 192 does not match the spec's value_head_dim 128"):
        kernel.backward(q, q, v, q, torch.zeros(1, 2, 64, device="cuda"), v)   # o of q's head dim
    with pytest.raises(ArgumentError, match=r"d_o: expected shape \(1, 2, 64, 128\) \(q's, with v's head dim\)"):
        kernel.backward(q, q, v, v, torch.zeros(1, 2, 64, device="cuda"), v[:, :, :63])   # dO of too few rows


def test_deepseek_v3_model_runs_on_fagen_with_no_fallback():
    """A DeepSeek-V3-style model (MLA: q, k of 192 = 128 + 64 rope dims, v of 128) from a config, random weights:
    logits as close to the float32 model's as SDPA's bf16 ones, a training step's loss SDPA's, every attention call
    on fagen's kernels."""
    import copy

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import fagen.torch
    from fagen.integrations import transformers as fagen_hf

    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096)
    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    calls, real = [], fagen.torch.attention

    def counted(q, k, v, spec, **kwargs):
        calls.append(spec)
        return real(q, k, v, spec, **kwargs)

    fagen.torch.attention = counted
    try:
        torch.manual_seed(0)
        nets = {name: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                                    dtype=torch.bfloat16).cuda()
                for name in ("fagen", "sdpa")}
        nets["sdpa"].load_state_dict(nets["fagen"].state_dict())
        exact = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").cuda()
        exact.load_state_dict({k: v.float() for k, v in nets["fagen"].state_dict().items()})
        x = torch.randint(0, 1024, (2, 384), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.no_grad():
            logits = {name: net(x).logits.float() for name, net in (*nets.items(), ("fp32", exact))}
        errors = {name: ((logits[name] - logits["fp32"]).norm() / logits["fp32"].norm()).item()
                  for name in ("fagen", "sdpa")}
        assert errors["fagen"] < 2e-2 and errors["fagen"] <= 2 * errors["sdpa"] + 1e-3, errors
        losses = {}
        for name, net in nets.items():
            loss = net.train()(x, labels=x).loss
            loss.backward()
            assert all(p.grad is None or torch.isfinite(p.grad).all() for p in net.parameters())
            losses[name] = loss.item()
        assert abs(losses["fagen"] - losses["sdpa"]) < 5e-3, losses
    finally:
        fagen.torch.attention = real
    reasons = fagen_hf.fallback_reasons()
    fagen_hf.reset_fallbacks()
    assert not reasons, f"fell back to SDPA: {sorted(reasons)}"
    assert len(calls) == 2 * 2 and all('"head_dim": 192' in s and '"value_head_dim": 128' in s for s in calls), calls


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph_with_a_value_head_dim_matches_eager(mode):
    """fagen.attention under torch.compile(fullgraph) with the spec as a JSON string: the ops' fake kernels give o
    v's head dim; a CUDA graph replays forward and backward (reduce-overhead). Loss and gradients as eager's."""
    import torch

    import fagen

    spec = '{"head_dim": 192, "value_head_dim": 128, "dtype": "bf16", "mask": "causal"}'
    torch._dynamo.reset()

    def step(q, k, v):
        return fagen.attention(q, k, v, spec).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for trial in range(4):   # reduce-overhead records a graph on the 2nd / 3rd call and replays after
        torch.compiler.cudagraph_mark_step_begin()
        generator = torch.Generator(device="cuda").manual_seed(trial)
        q, k = (torch.randn(2, 4, 333, 192, device="cuda", dtype=torch.bfloat16, generator=generator)
                for _ in range(2))
        v = torch.randn(2, 4, 333, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        loss = compiled(*leaves)
        loss.backward()
        got = (loss.item(), [t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
        eager = step(*leaves)
        eager.backward()
        assert abs(got[0] - eager.item()) <= 1e-3 * abs(eager.item()), trial
        for name, g, t in zip("qkv", got[1], leaves):
            assert ((g.float() - t.grad.float()).norm() / t.grad.float().norm()).item() < 2e-2, name   # (dQ: atomics)


def test_deepseek_v3_cached_generation_matches_sdpa(monkeypatch):
    """Greedy generation with a dynamic cache: the prefill on the forward kernel, each step (one query per head) on
    the decode kernel, at 192 / 128. The logits of every step SDPA's, as long as both generated the same tokens."""
    import copy

    import torch
    import transformers

    from fagen import runtime
    from fagen.integrations import transformers as fagen_hf

    config = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096)
    decodes, real = [], runtime.Kernel._decode   # (each step's first layer: the cache grew, a new call signature)
    monkeypatch.setattr(runtime.Kernel, "_decode", lambda self, *a, **kw: decodes.append(1) or real(self, *a, **kw))
    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    torch.manual_seed(0)
    nets = {name: transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                                dtype=torch.bfloat16).cuda().eval()
            for name in ("fagen", "sdpa")}
    nets["sdpa"].load_state_dict(nets["fagen"].state_dict())
    prompt = torch.randint(0, 1024, (1, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    out = {name: net.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True) for name, net in nets.items()}
    assert not fagen_hf.fallback_reasons(), fagen_hf.fallback_reasons()
    assert len(decodes) >= 7, "the steps after the prefill ran the decode kernel"
    same = 64
    for step in range(8):
        if not torch.equal(out["fagen"].sequences[:, :same], out["sdpa"].sequences[:, :same]):
            break
        got, want = (out[name].logits[step].float() for name in ("fagen", "sdpa"))
        assert ((got - want).norm() / want.norm()).item() < 2e-2, step
        same += 1
    assert same > 64 + 1, "at least the first decode step was compared"
