"""attn_implementation="fagen" on the GPU: small transformers models built from configs, random weights, bf16.

Run on a GPU machine:  python -m pytest -m gpu tests/test_integrations_transformers_gpu.py
Each model is compared with the same weights under attn_implementation="sdpa". Logits are compared
through a float32 model of the same (bf16-rounded) weights: fagen's error must be of the size of
SDPA's own bf16 error. Every test also checks that fagen's kernels really ran (no SDPA fallback).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

VOCAB = 1024
SEQ = 512
BATCH = 2


@pytest.fixture
def fagen_calls(monkeypatch):
    """Register "fagen"; count the calls that reach fagen's kernels; no fallback allowed unless a test says so."""
    import fagen.torch
    from fagen.integrations import transformers as fagen_hf

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    calls = []
    real = fagen.torch.attention

    def counted(q, k, v, spec, **kwargs):
        calls.append(spec)
        return real(q, k, v, spec, **kwargs)

    monkeypatch.setattr(fagen.torch, "attention", counted)
    yield calls
    reasons = fagen_hf.fallback_reasons()
    fagen_hf.reset_fallbacks()
    assert not reasons, f"fell back to SDPA: {sorted(reasons)}"


def config_for(head_dim, kv_heads, kind="llama", **extra):
    from transformers import LlamaConfig, MistralConfig

    hidden = 512
    fields = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=hidden // head_dim, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=4096)
    fields.update(extra)
    return (MistralConfig if kind == "mistral" else LlamaConfig)(**fields)


def models(config, implementations=("fagen", "sdpa"), reference="sdpa"):
    """{implementation: model} with the same random weights, bf16 on the GPU, plus "fp32": the same
    weights in float32 (`reference`'s attention), the reference for logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    out = {}
    for name in implementations:
        out[name] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                     dtype=torch.bfloat16).cuda()
    first = out[implementations[0]]
    for model in out.values():
        model.load_state_dict(first.state_dict())
    out["fp32"] = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference).cuda()
    out["fp32"].load_state_dict({k: v.float() for k, v in first.state_dict().items()})
    return out


def batch(seq=SEQ, size=BATCH, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (size, seq), device="cuda", generator=generator)


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_logits_like_sdpa(config):
    """fagen's bf16 logits are as far from the float32 model's as SDPA's bf16 logits are (within 2x)."""
    nets = models(config)
    x = batch()
    with torch.no_grad():
        logits = {name: model(x).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    sdpa_error = relative_error(logits["sdpa"], logits["fp32"])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)


CONFIGS = [(64, 2), (128, 2), (64, 8)]   # (head_dim, kv_heads): grouped KV heads at d = 64 and 128, and MHA
IDS = ["d64-gqa4", "d128-gqa2", "d64-mha"]


@pytest.mark.parametrize("head_dim, kv_heads", CONFIGS, ids=IDS)
def test_logits_match_sdpa_within_bf16_error(fagen_calls, head_dim, kv_heads):
    config = config_for(head_dim, kv_heads)
    assert_logits_like_sdpa(config)
    assert len(fagen_calls) == config.num_hidden_layers
    assert all('"mask": "causal"' in spec and f'"head_dim": {head_dim}' in spec and '"bf16"' in spec
               for spec in fagen_calls)


@pytest.mark.parametrize("head_dim, kv_heads", CONFIGS[:2], ids=IDS[:2])
def test_training_losses_match_sdpa(fagen_calls, head_dim, kv_heads):
    """Forward, backward and an AdamW step, five times on the same batch: the loss curves agree to 5e-3."""
    nets = models(config_for(head_dim, kv_heads))
    x = batch()
    curves = {}
    for name in ("fagen", "sdpa"):
        model = nets[name].train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        curve = []
        for _ in range(5):
            loss = model(x, labels=x).loss
            loss.backward()
            assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            curve.append(loss.item())
        curves[name] = curve
    differences = [abs(a - b) for a, b in zip(curves["fagen"], curves["sdpa"])]
    assert max(differences) < 5e-3, curves
    assert curves["fagen"][-1] < curves["fagen"][0]  # it learns
    assert len(fagen_calls) == 5 * 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_model_on_the_second_gpu_while_the_first_is_current(fagen_calls):
    """A model moved to cuda:1 without torch.cuda.set_device(1), as SDPA allows: fagen's launches go to cuda:1,
    the logits and a training step's loss and gradients are SDPA's within bf16 error, cuda:0 stays current."""
    torch.cuda.set_device(0)
    nets = {name: model.to("cuda:1") for name, model in models(config_for(64, 2)).items()}
    x = batch().to("cuda:1")
    with torch.no_grad():
        logits = {name: model(x).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    sdpa_error = relative_error(logits["sdpa"], logits["fp32"])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)
    losses, grads = {}, {}
    for name in ("fagen", "sdpa"):
        loss = nets[name](x, labels=x).loss
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.float().flatten() for p in nets[name].parameters() if p.grad is not None])
    assert abs(losses["fagen"] - losses["sdpa"]) < 5e-3, losses
    assert torch.isfinite(grads["fagen"]).all() and relative_error(grads["fagen"], grads["sdpa"]) < 5e-2
    assert torch.cuda.current_device() == 0
    assert len(fagen_calls) == 2 * 2   # two layers, two forwards: no fallback (the fixture checks that too)


def test_gpt_oss_sinks_match_eager(fagen_calls):
    """gpt-oss (transformers has no SDPA path for it: its sinks): attention sinks applied through fagen's
    differentiable LSE, sliding window on alternate layers. Logits as close to the float32 eager model's as the
    bf16 eager model's, and a training step's loss and the sinks' gradients the bf16 eager model's."""
    from transformers import GptOssConfig

    config = GptOssConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=128, max_position_embeddings=4096)
    nets = models(config, implementations=("fagen", "eager"), reference="eager")
    with torch.no_grad():   # sinks large enough to matter (their initial values are ~0.02)
        for model in nets.values():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, 8))
    x = batch()
    with torch.no_grad():
        logits = {name: model(x).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    eager_error = relative_error(logits["eager"], logits["fp32"])
    # (no absolute bound: with bf16 weights the router of this mixture of experts picks other experts for some
    # tokens than the float32 model's, 2-4% of the logits' norm for both implementations)
    assert fagen_error <= 2 * eager_error + 1e-3, (fagen_error, eager_error)
    losses, sink_grads = {}, {}
    for name in ("fagen", "eager"):
        loss = nets[name](x, labels=x).loss
        loss.backward()
        losses[name] = loss.item()
        sink_grads[name] = torch.cat([layer.self_attn.sinks.grad.float() for layer in nets[name].model.layers])
    assert abs(losses["fagen"] - losses["eager"]) < 5e-3, losses
    assert torch.isfinite(sink_grads["fagen"]).all()
    assert relative_error(sink_grads["fagen"], sink_grads["eager"]) < 5e-2, sink_grads
    assert len(fagen_calls) == 2 * 2 and all('"sliding_window", "window": 128' in spec for spec in fagen_calls[::2])


def test_sliding_window_model_matches_sdpa(fagen_calls):
    assert_logits_like_sdpa(config_for(64, 2, kind="mistral", sliding_window=128))
    assert fagen_calls and all('"sliding_window", "window": 128' in spec for spec in fagen_calls)


def test_packed_sequences_match_sdpa_with_the_packed_mask(fagen_calls):
    """Sequences packed back to back (position_ids restarting at 0, no cache): fagen runs the document
    mask_mod with transformers' sequence ids; SDPA gets transformers' (N, N) packed mask."""
    nets = models(config_for(64, 2))
    x = batch()
    lengths = [[100, 1, 230, 17, 164], [512]]
    position_ids = torch.tensor([[p for n in row for p in range(n)] for row in lengths], device="cuda")
    with torch.no_grad():
        logits = {name: model(x, position_ids=position_ids, use_cache=False).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    sdpa_error = relative_error(logits["sdpa"], logits["fp32"])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)
    unpacked = relative_error(nets["fp32"](x, use_cache=False).logits, logits["fp32"])
    assert unpacked > 10 * sdpa_error, "the packing must matter for this check to mean anything"
    assert fagen_calls and all('"mask_mod": "doc[b, i] == doc[b, j]"' in spec for spec in fagen_calls)


def test_llama4_chunked_attention_matches_sdpa(fagen_calls):
    """Llama 4's chunked-attention layers as the documents mask_mod over chunk ids (chunks of 100 at d = 128, so that
    chunk boundaries fall inside the kernels' tiles; SDPA gets transformers' (N, N) chunked mask), its
    full-attention layer as causal."""
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, intermediate_size_mlp=1024,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              max_position_embeddings=4096, attention_chunk_size=100, num_local_experts=2)
    nets = models(config)
    x = batch()
    with torch.no_grad():
        logits = {name: model(x, use_cache=False).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    sdpa_error = relative_error(logits["sdpa"], logits["fp32"])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)
    chunked = [spec for spec in fagen_calls if '"mask_mod": "doc[b, i] == doc[b, j]"' in spec]
    assert len(chunked) == 3 and len(fagen_calls) == 4


def test_gemma2_soft_capping_matches_eager(fagen_calls):
    """Gemma 2's logit soft-capping as fagen's score_mod (transformers' SDPA ignores softcap, so the
    float32 reference is the eager implementation)."""
    from transformers import Gemma2Config

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                          attn_logit_softcapping=5.0, final_logit_softcapping=None, sliding_window=128,
                          query_pre_attn_scalar=64)
    nets = models(config, implementations=("fagen", "eager"), reference="eager")
    x = batch()
    with torch.no_grad():
        logits = {name: model(x).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"], logits["fp32"])
    eager_error = relative_error(logits["eager"], logits["fp32"])
    assert fagen_error < 2e-2 and fagen_error <= 2 * eager_error + 1e-3, (fagen_error, eager_error)
    assert fagen_calls and all('"score_mod": "5.0 * tanh(score / 5.0)"' in spec for spec in fagen_calls)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_matches_sdpa(fagen_calls, cache):
    """Prefill, then one query at a time against a growing cache (Nq = 1 < Nk). With a static cache (keys up to
    its full length, the part past the queries still empty): the prefill as the mask_mod j <= i + end[b] - Nq, the
    steps as the padding mask with each row's end (the decode kernel's)."""
    nets = models(config_for(128, 2))
    prompt = batch(seq=64, size=1)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    generated = {name: nets[name].eval().generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                                  output_logits=True, return_dict_in_generate=True, **extra)
                 for name in ("fagen", "sdpa")}
    first_logits = {name: out.logits[0] for name, out in generated.items()}
    assert relative_error(first_logits["fagen"], first_logits["sdpa"]) < 2e-2
    assert len(fagen_calls) == 8 * 2
    # the 7 steps after the prefill (1 query x 2 heads per KV head) ask for the decode kernel
    assert sum('"decode"' in spec for spec in fagen_calls) == 7 * 2
    if cache == "static":
        assert sum('"mask": "padding"' in spec for spec in fagen_calls) == 7 * 2
        assert sum('"mask_mod": "j <= i + end[b] - Nq"' in spec for spec in fagen_calls) == 2
    # every decode step's logits, as long as both have generated the same tokens so far (greedy bf16
    # decoding may part ways at a near tie, after which the inputs differ)
    same_prefix = 64
    for step in range(8):
        if not torch.equal(generated["fagen"].sequences[:, :same_prefix], generated["sdpa"].sequences[:, :same_prefix]):
            break
        assert relative_error(generated["fagen"].logits[step], generated["sdpa"].logits[step]) < 2e-2, step
        same_prefix += 1
    assert same_prefix > 64 + 1, "at least the first decode step was compared"


def test_attention_dropout_is_reproducible_from_torchs_seed(fagen_calls):
    """Training with attention_dropout: a fresh dropout mask per call, the same one after torch.manual_seed."""
    nets = models(config_for(64, 2, attention_dropout=0.1), implementations=("fagen",))
    model = nets["fagen"].train()
    x = batch()

    def loss_after(seed):
        torch.manual_seed(seed)
        return model(x, labels=x).loss

    first, again, other = loss_after(0), loss_after(0), loss_after(1)
    assert first.item() == again.item() and first.item() != other.item()
    first.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert all('"dropout": 0.1' in spec for spec in fagen_calls)


def test_a_left_padded_batch_runs_on_fagen_on_the_gpu():
    """Left padding (issue 58): no fallback, logits at the real tokens as SDPA's on the same mask."""
    import warnings

    from fagen.integrations import transformers as fagen_hf

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    nets = models(config_for(64, 2))
    x = batch()
    mask = torch.ones_like(x)
    mask[0, :7] = 0
    with warnings.catch_warnings(record=True) as records, torch.no_grad():
        warnings.simplefilter("always")
        got = nets["fagen"](x, attention_mask=mask).logits
    # (the integration's fallback warning; on a cold cache PyCUDA also passes on nvcc's remarks, which name kernels)
    assert not [r for r in records if "fagen attention:" in str(r.message)], [str(r.message) for r in records]
    with torch.no_grad():
        expected = nets["sdpa"](x, attention_mask=mask).logits
    valid = mask.bool()
    assert not fagen_hf.fallback_reasons()
    assert relative_error(got[valid], expected[valid]) < 2e-2   # bf16 kernels against bf16 SDPA
    fagen_hf.reset_fallbacks()


def test_compiled_decoder_layers_run_fagen_forward_and_backward():
    """Each decoder layer compiled with fullgraph=True (regional compilation: transformers makes the masks
    eagerly, so they stay None) traces through fagen's custom ops and agrees with the eager model."""
    from fagen.integrations import transformers as fagen_hf

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    nets = models(config_for(64, 2), implementations=("fagen",))
    model = nets["fagen"].train()
    x = batch()
    eager = model(x, labels=x)
    eager.loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for layer in model.model.layers:
        layer.compile(fullgraph=True)
    compiled = model(x, labels=x)
    compiled.loss.backward()
    assert relative_error(compiled.logits, eager.logits) < 1e-2
    assert abs(compiled.loss.item() - eager.loss.item()) < 5e-3
    assert max(relative_error(p.grad, g) for p, g in zip(model.parameters(), eager_grads)) < 5e-2
    assert not fagen_hf.fallback_reasons()


# ---- padded batches (issue 58 item 5): on fagen, no fallback -----------------------------------
RUNS_SPEC = '"mask_mod": "rows[b, 0] <= j < rows[b, 1]"'


def padded_mask(pads, side, seq=SEQ):
    """A 2-D attention mask: row b padded with pads[b] positions on the left or on the right."""
    positions = torch.arange(seq, device="cuda")
    return torch.stack([(positions >= pad) if side == "left" else (positions < seq - pad) for pad in pads]).long()


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_logits_and_training_step_match_sdpa(fagen_calls, side):
    """A padded batch (4 x 512, padding 0/7/100/300) on fagen's kernels (the runs mask_mod, every call): the logits at
    the non-padding positions as close to the float32 model's as SDPA's bf16 ones, and a training step's loss (labels
    -100 at the padding) SDPA's within bf16 error, its gradients too."""
    nets = models(config_for(64, 2))
    x = batch(size=4)
    mask = padded_mask([0, 7, 100, 300], side)
    valid = mask.bool()
    with torch.no_grad():
        logits = {name: model(x, attention_mask=mask, use_cache=False).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"][valid], logits["fp32"][valid])
    sdpa_error = relative_error(logits["sdpa"][valid], logits["fp32"][valid])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)
    labels = x.masked_fill(~valid, -100)
    losses, grads = {}, {}
    for name in ("fagen", "sdpa"):
        model = nets[name].train()
        loss = model(x, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    assert abs(losses["fagen"] - losses["sdpa"]) < 5e-3, losses
    assert torch.isfinite(grads["fagen"]).all() and relative_error(grads["fagen"], grads["sdpa"]) < 5e-2
    assert len(fagen_calls) == 2 * 2 and all(RUNS_SPEC in spec for spec in fagen_calls)


def test_padding_with_gaps_runs_the_keys_mask_mod(fagen_calls):
    """Padding that is not one run of keys per row (gaps inside a row): the keys mask_mod with the padding itself as its
    input (a run-time summary per call), the logits at the valid positions SDPA's."""
    nets = models(config_for(64, 2))
    x = batch()
    mask = torch.ones_like(x)
    mask[0, 100:230] = 0
    mask[1, 3::5] = 0
    valid = mask.bool()
    with torch.no_grad():
        logits = {name: model(x, attention_mask=mask, use_cache=False).logits for name, model in nets.items()}
    fagen_error = relative_error(logits["fagen"][valid], logits["fp32"][valid])
    sdpa_error = relative_error(logits["sdpa"][valid], logits["fp32"][valid])
    assert fagen_error < 2e-2 and fagen_error <= 2 * sdpa_error + 1e-3, (fagen_error, sdpa_error)
    assert fagen_calls and all('"mask_mod": "keys[b, j] != 0"' in spec for spec in fagen_calls)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_generation_matches_sdpa(fagen_calls, cache):
    """Left-padded batched greedy generation (4 prompts of 64, padding 0/7/20/50) with a cache: the prefill and every
    step on fagen (the runs mask_mod; a static cache's with each row's end), the tokens SDPA's. Greedy bf16 decoding
    may part ways at a near tie: a row's first differing token must be one where SDPA's own two best logits are
    closer than fagen's and SDPA's logits differ, and each step's logits are compared while the row's tokens agree."""
    nets = models(config_for(128, 2))
    prompt = batch(seq=64, size=4)
    mask = padded_mask([0, 7, 20, 50], "left", seq=64)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    generated = {name: nets[name].eval().generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                                  pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                                  **extra)
                 for name in ("fagen", "sdpa")}
    ours, theirs = generated["fagen"], generated["sdpa"]
    agreed = 0
    for row in range(4):
        for step in range(8):
            a, b = ours.logits[step][row].float(), theirs.logits[step][row].float()
            assert relative_error(a, b) < 2e-2, (row, step)
            if ours.sequences[row, 64 + step] != theirs.sequences[row, 64 + step]:
                top = b.topk(2).values
                assert top[0] - top[1] <= 2 * (a - b).abs().max(), (row, step, "not a near tie")
                break
            agreed += 1
    assert agreed >= 4 * 8 // 2, f"only {agreed} of 32 tokens compared"
    text = RUNS_SPEC if cache == "dynamic" else \
        '"mask_mod": "rows[b, 0] <= j < rows[b, 1] and j <= i + rows[b, 2] - Nq"'
    assert len(fagen_calls) == 8 * 2 and all(text in spec for spec in fagen_calls)
