"""fagen.integrations.transformers on the CPU: the spec each call maps to, the masks, and the SDPA fallback.

fagen's kernels need a GPU, so `fagen.torch.attention` (what `fagen.attention` resolves to) is replaced
by a float64 torch reference of the spec it is given, and the integration is allowed to run on CPU
tensors. Models are tiny, built from configs with random weights, and compared with
attn_implementation="eager". GPU runs of real kernels: tests/test_integrations_transformers_gpu.py.
"""
import copy
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    causal_mask_function, chunked_causal_mask_function, sliding_window_causal_mask_function)

import fagen.torch  # noqa: E402
from fagen.integrations import transformers as fagen_hf  # noqa: E402
from fagen.spec import spec_from_dict  # noqa: E402

TOLERANCE = 1e-4
VOCAB = 97


class Calls(list):
    """What the reference was called with: one dict per call (the spec's fields, shapes, seed)."""

    @property
    def specs(self):
        return [call["spec"] for call in self]


@pytest.fixture
def calls(monkeypatch):
    """fagen attention on the CPU through the reference below; every call recorded."""
    recorded = Calls()

    def reference(q, k, v, spec, *, seed=0, offset=0, inputs=None, kv_lengths=None, return_lse=False):
        assert isinstance(spec, str), "the integration passes the spec as a JSON string (torch.compile folds it)"
        fields = json.loads(spec)
        spec_from_dict(fields)  # a valid fagen spec, or this raises
        recorded.append({"spec": fields, "q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape),
                         "seed": seed, "offset": offset, "inputs": inputs, "kv_lengths": kv_lengths,
                         "return_lse": return_lse})
        return reference_attention(q, k, v, fields, inputs, return_lse, kv_lengths)

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    monkeypatch.setattr(fagen.torch, "attention", reference)
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    yield recorded
    fagen_hf.reset_fallbacks()


def reference_attention(q, k, v, fields, inputs=None, return_lse=False, kv_lengths=None):
    """softmax(scale * Q K^T + mask) V in float64, with fagen's masks (bottom-right aligned) and the
    packed-sequence mask_mod the integration uses (doc[b, i] == doc[b, j]); with return_lse, (o, lse) as
    fagen.attention returns them (lse float32, differentiable)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]   # grouped KV heads: fagen takes k, v with their own head count
    k64, v64 = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)
    scores = fields.get("softmax_scale", q.shape[-1] ** -0.5) * q64 @ k64.transpose(-1, -2)
    seq_q, seq_k = q.shape[2], k.shape[2]
    distance = torch.arange(seq_q)[:, None] + (seq_k - seq_q) - torch.arange(seq_k)[None, :]
    visible = {"none": lambda: torch.ones_like(distance, dtype=torch.bool),
               "causal": lambda: distance >= 0,
               "sliding_window": lambda: (distance >= 0) & (distance < fields.get("window", 0)),
               "padding": lambda: torch.arange(seq_k)[None, None, None, :] < kv_lengths[:, None, None, None]
               }[fields["mask"]]()
    if "score_mod" in fields:   # the integration's soft-capping: "C * tanh(score / C)"
        cap = float(fields["score_mod"].split(" * ")[0])
        assert fields["score_mod"] == f"{cap!r} * tanh(score / {cap!r})"
        scores = cap * torch.tanh(scores / cap)
    if fields.get("mask_mod") == fagen_hf.CACHE_MASK:   # a static cache's rows: j <= i + end[b] - Nq
        assert fields["inputs"] == {"end": "int32"}
        last = inputs["end"][:, None] - seq_q + torch.arange(seq_q)[None, :]
        visible = visible & (torch.arange(seq_k)[None, None, None, :] <= last[:, None, :, None])
    elif "mask_mod" in fields:
        assert fields["mask_mod"] == "doc[b, i] == doc[b, j]" and fields["inputs"] == {"doc": "int32"}
        doc = inputs["doc"]
        visible = visible & (doc[:, None, :, None] == doc[:, None, None, :])
    scores = scores.masked_fill(~visible, float("-inf"))
    out = (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64).to(q.dtype)
    return (out, torch.logsumexp(scores, dim=-1).float()) if return_lse else out


def tiny(config_class, **overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    fields.update(overrides)
    return config_class(**fields)


def model_pair(config, dtype=None):
    """The same random weights with attn_implementation "eager" and "fagen" (float32 unless `dtype`, CPU, eval)."""
    torch.manual_seed(0)  # each model gets its own config: from_config records the implementation on it
    extra = {} if dtype is None else {"dtype": dtype}
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager", **extra).eval()
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="fagen", **extra).eval()
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == "fagen"
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def tokens(batch=2, seq=12, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def max_error(a, b):
    return (a - b).abs().max().item()


def fallback_warnings(records):
    return [w for w in records if "fagen attention" in str(w.message)]


# ---- registration ----------------------------------------------------------------------------
def test_register_is_idempotent_and_registers_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fagen_hf.register()
    fagen_hf.register()
    assert AttentionInterface._global_mapping["fagen"] is fagen_hf.attention_forward
    assert AttentionMaskInterface._global_mapping["fagen"] is fagen_hf.fagen_mask
    model = AutoModelForCausalLM.from_config(tiny(LlamaConfig), attn_implementation="fagen")
    assert model.config._attn_implementation == "fagen"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("fagen")
    assert model.config._attn_implementation == "fagen"


# ---- models against eager --------------------------------------------------------------------
def assert_training_step_matches(eager, ours, x, **kwargs):
    """Logits, and every parameter's gradient of the LM loss, agree with the eager model's."""
    expected = eager(x, labels=x, **kwargs)
    got = ours(x, labels=x, **kwargs)
    assert max_error(got.logits, expected.logits) < TOLERANCE
    expected.loss.backward()
    got.loss.backward()
    grads = dict(eager.named_parameters())
    for name, param in ours.named_parameters():
        assert max_error(param.grad, grads[name].grad) < TOLERANCE, name


def test_llama_with_grouped_kv_heads_matches_eager_forward_and_backward(calls):
    eager, ours = model_pair(tiny(LlamaConfig))
    assert_training_step_matches(eager, ours, tokens())
    assert len(calls) == 2 and not fagen_hf.fallback_reasons()  # one per layer
    for call in calls:
        assert call["spec"] == {"head_dim": 32, "dtype": "fp32", "mask": "causal", "softmax_scale": 32 ** -0.5}
        assert call["q"] == (2, 4, 12, 32) and call["k"] == call["v"] == (2, 2, 12, 32)  # grouped: no copies
        assert call["seed"] == 0 and call["offset"] == 0


#: Decoder families whose attention goes through AttentionInterface, beyond the ones tested one by one here
#: (names of transformers' config classes; one missing from the installed version is skipped)
MORE_FAMILIES = ["Qwen3Config", "Qwen3MoeConfig", "Qwen2MoeConfig", "Gemma3TextConfig", "GemmaConfig", "Phi3Config",
                 "MixtralConfig", "Olmo2Config", "Olmo3Config", "CohereConfig", "Cohere2Config", "GraniteConfig",
                 "SmolLM3Config", "Glm4Config", "Exaone4Config", "GPTNeoXConfig"]


@pytest.mark.parametrize("name", MORE_FAMILIES)
def test_more_decoder_families_train_on_fagen_and_match_eager(calls, name):
    """A training step of a tiny model of each family on fagen (logits and every parameter's gradient against
    eager), every attention call on fagen, none falling back."""
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    # (special token ids inside the tiny vocabulary: some families' defaults are an embedding's padding index)
    eager, ours = model_pair(tiny(config_class, pad_token_id=None, bos_token_id=None, eos_token_id=None))
    assert_training_step_matches(eager, ours, tokens(seq=20))
    assert len(calls) == 2 and not fagen_hf.fallback_reasons()


@pytest.mark.parametrize("name", ["Gemma3TextConfig", "Cohere2Config", "Olmo3Config", "Exaone4Config"])
def test_sliding_window_layers_of_more_families_run_as_fagens_window(calls, name):
    """Families whose layers are sliding-window ones by default (with a window shorter than the sequence here):
    every call is fagen's sliding_window mask with the config's window, and the step matches eager."""
    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    eager, ours = model_pair(tiny(config_class, pad_token_id=None, bos_token_id=None, eos_token_id=None, sliding_window=5))
    assert_training_step_matches(eager, ours, tokens(seq=20))
    assert not fagen_hf.fallback_reasons() and len(calls) == 2
    assert all(call["spec"]["mask"] == "sliding_window" and call["spec"]["window"] == 5 for call in calls)


@pytest.mark.parametrize("config_class", [LlamaConfig, MistralConfig], ids=["llama", "mistral-window"])
def test_packed_sequences_run_as_a_document_mask_and_match_eager(calls, config_class):
    """Sequences packed back to back in one row (position_ids restarting at 0, as transformers'
    DataCollatorWithFlattening makes them): the integration passes transformers' sequence ids to fagen
    as the mask_mod input instead of falling back to SDPA with an (N, N) mask."""
    overrides = {"sliding_window": 5} if config_class is MistralConfig else {}
    eager, ours = model_pair(tiny(config_class, **overrides))
    lengths = [[5, 1, 9, 3], [18]]   # row 2: one sequence (no packing in that row)
    x = tokens(batch=2, seq=18)
    position_ids = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
    # (transformers looks for packing only without a cache: use_cache=False, as in training)
    assert_training_step_matches(eager, ours, x, position_ids=position_ids, use_cache=False)
    assert not fagen_hf.fallback_reasons() and len(calls) == 2
    for call in calls:
        assert call["spec"]["mask_mod"] == "doc[b, i] == doc[b, j]"
        assert call["spec"]["mask"] == ("sliding_window" if overrides else "causal")
        ids = call["inputs"]["doc"]
        assert ids.dtype == torch.int32 and ids[0].tolist() == [0] * 5 + [1] + [2] * 9 + [3] * 3


def test_llama4_chunked_attention_runs_as_a_document_mask_of_chunks_and_matches_eager(calls):
    """Llama 4's chunked-attention layers (attend within the query's chunk of attention_chunk_size positions,
    causally) run on fagen as the documents mask_mod with each position's chunk id; its full-attention layer as
    plain causal. Forward and backward against the eager model, no fallback."""
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, intermediate_size_mlp=256,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=256, attention_chunk_size=4, num_local_experts=2)
    assert config.layer_types.count("chunked_attention") == 3
    eager, ours = model_pair(config)
    x = tokens(seq=13)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        expected, got = eager(x, use_cache=False).logits, ours(x, use_cache=False).logits
        assert max_error(got, expected) < TOLERANCE
        expected.square().sum().backward()
        got.square().sum().backward()
    assert not fallback_warnings(records) and not fagen_hf.fallback_reasons()
    grads = [(a.grad, b.grad) for a, b in zip(eager.parameters(), ours.parameters()) if a.grad is not None]
    assert grads and max(max_error(a, b) for a, b in grads) < 1e-3
    documents = [call for call in calls if call["spec"].get("mask_mod") == fagen_hf.DOCUMENT_MASK]
    assert len(documents) == 3 and len(calls) == 4   # 3 chunked layers, 1 full (the reference differentiates itself)
    assert all(call["inputs"]["doc"][0].tolist() == [p // 4 for p in range(13)] for call in documents)
    # a prefill into a cache (no cache before it) goes the same way
    calls.clear()
    with torch.no_grad():
        assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
    assert sum(call["spec"].get("mask_mod") == fagen_hf.DOCUMENT_MASK for call in calls) == 3
    assert not fagen_hf.fallback_reasons()


def test_gemma2_soft_capping_runs_as_a_score_mod_and_matches_eager(calls):
    """Gemma 2's attention logit soft-capping (and its alternating sliding-window layers) on fagen:
    the cap becomes the spec's score_mod, whose backward sympy derives; no fallback."""
    from transformers import Gemma2Config

    config = tiny(Gemma2Config, head_dim=32, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                  sliding_window=6, query_pre_attn_scalar=32)
    eager, ours = model_pair(config)
    assert_training_step_matches(eager, ours, tokens(seq=14))
    assert not fagen_hf.fallback_reasons() and len(calls) == 2
    assert all(call["spec"]["score_mod"] == "2.0 * tanh(score / 2.0)" for call in calls)
    assert {call["spec"]["mask"] for call in calls} == {"sliding_window", "causal"}


def test_set_attn_implementation_switches_an_existing_model_to_fagen(calls):
    eager, _ = model_pair(tiny(LlamaConfig))
    x = tokens(batch=1, seq=9)
    expected = eager(x).logits
    eager.set_attn_implementation("fagen")
    assert max_error(eager(x).logits, expected) < TOLERANCE
    assert len(calls) == 2


def test_an_all_ones_padding_mask_stays_on_fagen(calls):
    eager, ours = model_pair(tiny(LlamaConfig))
    x = tokens()
    mask = torch.ones_like(x)
    assert max_error(ours(x, attention_mask=mask).logits, eager(x, attention_mask=mask).logits) < TOLERANCE
    assert len(calls) == 2 and not fagen_hf.fallback_reasons()


def test_mistral_sliding_window_maps_to_fagen_window(calls):
    eager, ours = model_pair(tiny(MistralConfig, sliding_window=5))
    x = tokens(seq=16)
    assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
    assert not fagen_hf.fallback_reasons()
    assert [c["mask"] for c in calls.specs] == ["sliding_window"] * 2
    assert all(c["window"] == 5 for c in calls.specs)


def test_a_configs_window_applies_only_where_the_layer_takes_it(monkeypatch):
    """The window comes from the call, the module, the config's layer_types naming the layer sliding, or else the
    pattern the mask function left to the kernels (the model builds one for every layer): a config's
    sliding_window alone is not the layer's (Moshi's and Kyutai's configs carry one their causal masks do not
    apply; PhiMoE's sliding masks do)."""
    class Module:
        def __init__(self, layer_types=None, layer_idx=0):
            self.config = type("Config", (), {"sliding_window": 5, "layer_types": layer_types})()
            self.layer_idx = layer_idx

    assert fagen_hf._window(Module(), 7) == 7 and fagen_hf._window(Module(), None) is None   # the call's
    types = ["sliding_attention", "full_attention"]
    assert fagen_hf._window(Module(types, 0), fagen_hf._NOT_GIVEN) == 5
    assert fagen_hf._window(Module(types, 1), fagen_hf._NOT_GIVEN) is None
    left = {}
    monkeypatch.setattr(fagen_hf, "_left_to_kernels", left)
    assert fagen_hf._window(Module(), fagen_hf._NOT_GIVEN) == 5          # no mask function ran: the config's
    for pattern, window in ((causal_mask_function, None), (sliding_window_causal_mask_function(4), 4)):   # (mask()'s
        # config has window 4)
        assert mask(mask_function=pattern, local_size=window) is None
        assert left == {"window": window} and fagen_hf._window(Module(), fagen_hf._NOT_GIVEN) == window
        assert fagen_hf._window(Module(types, 1), fagen_hf._NOT_GIVEN) is None   # layer_types first


@pytest.mark.parametrize("config_name, window", [("PhimoeConfig", 5), ("PhimoeConfig", None)])
def test_models_that_build_one_mask_for_every_layer_get_its_window(calls, config_name, window):
    """PhiMoE passes no window to its attention: its layers get the one its mask says (sliding where the config has a
    window, causal where it has none)."""
    config_class = getattr(transformers, config_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    config = tiny(config_class, sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    eager, ours = model_pair(config)
    assert_training_step_matches(eager, ours, tokens(seq=20))
    assert not fagen_hf.fallback_reasons() and len(calls) == 2
    assert all(call["spec"]["mask"] == ("sliding_window" if window else "causal") for call in calls)


def test_moshi_attends_to_every_earlier_token_as_its_sdpa_model_does(calls):
    """Moshi's config has a sliding_window (3000 by default) that its attention does not apply. (Against its SDPA
    model: transformers 5.17's eager Moshi differs from its own SDPA one.)"""
    config_class = getattr(transformers, "MoshiConfig", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no Moshi")
    config = config_class(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, ffn_dim=128, max_position_embeddings=256, sliding_window=5,
                          audio_vocab_size=64, num_codebooks=2,
                          depth_decoder_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, ffn_dim=128,
                                                    audio_vocab_size=64, num_codebooks=2))
    torch.manual_seed(0)
    sdpa = transformers.MoshiForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = transformers.MoshiForCausalLM._from_config(copy.deepcopy(config), attn_implementation="fagen").eval()
    ours.load_state_dict(sdpa.state_dict())
    x = tokens(batch=1, seq=20)
    with torch.no_grad():
        assert max_error(sdpa(x, use_cache=False).logits, ours(x, use_cache=False).logits) < TOLERANCE
    assert calls and all(call["spec"]["mask"] == "causal" for call in calls) and not fagen_hf.fallback_reasons()


@pytest.mark.parametrize("name", ["BloomConfig", "XGLMConfig", "GPTNeoXJapaneseConfig"])
def test_models_with_their_own_attention_code_get_their_masks_written_out(calls, name):
    """Models whose attention is their own code build their causal masks through the mask interface all the same: a
    mask skipped for fagen's kernels would leave them attending to the future. fagen_mask writes it out (the eager
    mask they add to their scores) and says so once; the model then matches eager."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = getattr(transformers, name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    sizes = dict(vocab_size=VOCAB, hidden_size=64, n_embed=64, d_model=64, num_hidden_layers=2, n_layer=2, num_layers=2,
                 num_attention_heads=4, n_head=4, attention_heads=4, intermediate_size=128, ffn_dim=128,
                 max_position_embeddings=64, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    defaults = config_class().to_dict()
    config = config_class(**{key: value for key, value in sizes.items() if key in defaults})
    assert CONFIG_MAPPING[config.model_type] is config_class
    eager, ours = model_pair(config)
    x = tokens(batch=1, seq=16)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with torch.no_grad():
            assert max_error(eager(x).logits, ours(x).logits) < TOLERANCE
    assert not calls and any("masks are written out" in str(w.message) for w in fallback_warnings(records))


def test_bigbird_pegasus_decoder_stays_causal(calls):
    """BigBirdPegasus uses the interface, but its decoder's self-attention modules say is_causal=False and it
    supports neither SDPA nor the attention backend: its causal masks are written out, so its decoder stays causal."""
    config_class = getattr(transformers, "BigBirdPegasusConfig", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no BigBirdPegasus")
    config = config_class(vocab_size=VOCAB, d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=2,
                          encoder_attention_heads=2, decoder_ffn_dim=128, encoder_ffn_dim=128, max_position_embeddings=64,
                          attention_type="original_full")
    torch.manual_seed(0)
    eager = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = transformers.AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="fagen").eval()
    ours.load_state_dict(eager.state_dict())
    x, d = tokens(batch=1, seq=16), tokens(batch=1, seq=10, seed=5)
    with torch.no_grad():
        assert max_error(eager(input_ids=x, decoder_input_ids=d).logits,
                         ours(input_ids=x, decoder_input_ids=d).logits) < TOLERANCE


def test_mistral_window_longer_than_the_sequence_runs_as_causal(calls):
    eager, ours = model_pair(tiny(MistralConfig, sliding_window=64))
    x = tokens(seq=16)
    assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
    assert [c["mask"] for c in calls.specs] == ["causal"] * 2


def test_qwen2_mixes_full_and_sliding_layers(calls):
    config = tiny(Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    eager, ours = model_pair(config)
    x = tokens(seq=14)
    assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
    assert [c["mask"] for c in calls.specs] == ["causal", "sliding_window"]
    assert calls.specs[1]["window"] == 4


@pytest.mark.parametrize("config_class, extra", [(LlamaConfig, {}), (MistralConfig, {"sliding_window": 6})],
                         ids=["llama", "mistral-sliding"])
def test_cached_prefill_and_decoding_match_eager(calls, config_class, extra):
    """A second chunk of queries against a cache (Nq < Nk, bottom-right aligned), then one-token steps."""
    eager, ours = model_pair(tiny(config_class, **extra))
    x = tokens(batch=1, seq=16)
    outputs = {}
    for name, model in (("eager", eager), ("fagen", ours)):
        first = model(x[:, :10], use_cache=True)
        second = model(x[:, 10:], past_key_values=first.past_key_values, use_cache=True)
        outputs[name] = second.logits
    assert max_error(outputs["fagen"], outputs["eager"]) < TOLERANCE
    assert any(call["q"][2] == 6 and call["k"][2] > 6 for call in calls)

    prompt = x[:, :5]
    generated = {name: model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
                 for name, model in (("eager", eager), ("fagen", ours))}
    assert torch.equal(generated["fagen"], generated["eager"])
    assert any(call["q"][2] == 1 for call in calls)
    assert not fagen_hf.fallback_reasons()


def test_static_cache_generation_runs_on_fagen_and_matches_eager(calls):
    """A static cache (keys 0 .. max_cache_len - 1, the part past the queries still empty): the prefill runs the
    mask_mod j <= i + end[b] - Nq with each row's end, the decoding steps the padding mask with kv_lengths = end
    (the decode kernel's); the same tokens as the eager model, with and without an all-ones padding mask, no
    fallback. A second chunk of several queries against the filled cache, likewise."""
    from transformers import StaticCache

    eager, ours = model_pair(tiny(LlamaConfig))
    prompt = tokens(batch=2, seq=5)
    ones = torch.ones_like(prompt)
    for mask in (None, ones):
        generated = {name: model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                          pad_token_id=0, cache_implementation="static")
                     for name, model in (("eager", eager), ("fagen", ours))}
        assert torch.equal(generated["fagen"], generated["eager"])
    prefills = [call for call in calls if call["spec"].get("mask_mod") == fagen_hf.CACHE_MASK]
    steps = [call for call in calls if call["spec"]["mask"] == "padding"]
    assert prefills and all(call["inputs"]["end"].tolist() == [5, 5] and call["k"][2] > 5 for call in prefills)
    assert steps and all(call["q"][2] == 1 and call["kv_lengths"].shape == (2,) for call in steps)
    assert sorted({call["kv_lengths"][0].item() for call in steps}) == list(range(6, 11))
    x = tokens(batch=1, seq=16)
    logits = {}
    for name, model in (("eager", eager), ("fagen", ours)):
        cache = StaticCache(config=model.config, max_cache_len=24)
        model(x[:, :10], past_key_values=cache, use_cache=True)
        logits[name] = model(x[:, 10:], past_key_values=cache, use_cache=True).logits
    assert max_error(logits["fagen"], logits["eager"]) < TOLERANCE
    assert any(call["inputs"] and call["inputs"].get("end") is not None and call["inputs"]["end"].tolist() == [16]
               for call in calls)
    assert not fagen_hf.fallback_reasons()


# ---- the attention function alone -------------------------------------------------------------
class Module(torch.nn.Module):
    """Stands in for an attention layer: what transformers' attention functions read off the module."""

    def __init__(self, is_causal=True, groups=1):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups


def qkv(batch=1, heads=2, kv_heads=2, seq_q=8, seq_k=8, head_dim=32, dtype=torch.float32):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, generator=generator).to(dtype)
    return q, k, v


def test_output_layout_scale_and_non_causal_modules(calls):
    q, k, v = qkv(seq_q=5, seq_k=7)
    out, weights = fagen_hf.attention_forward(Module(is_causal=False), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (1, 5, 2, 32) and out.is_contiguous()
    expected = reference_attention(q, k, v, {"mask": "none", "softmax_scale": 0.3}).transpose(1, 2)
    assert max_error(out, expected) < TOLERANCE
    # 5 query rows: few enough for the decode kernel, so the spec also builds it
    assert calls.specs[-1] == {"head_dim": 32, "dtype": "fp32", "mask": "none", "softmax_scale": 0.3,
                               "passes": ["forward", "backward", "decode"]}
    fagen_hf.attention_forward(Module(is_causal=False), q, k, v, None, is_causal=True)  # the kwarg wins
    assert calls.specs[-1]["mask"] == "causal" and "softmax_scale" not in calls.specs[-1]


def test_dropout_maps_to_the_spec_with_a_fresh_seed_per_call_from_torchs_generator(calls):
    """Each call's seed is a one-element int64 tensor drawn on the query's device (read by the kernels
    when they run, so that CUDA graphs replay new draws); torch.manual_seed reproduces the draws."""
    q, k, v = qkv()
    torch.manual_seed(7)
    for _ in range(3):
        fagen_hf.attention_forward(Module(), q, k, v, None, dropout=0.125)
    torch.manual_seed(7)
    fagen_hf.attention_forward(Module(), q, k, v, None, dropout=0.125)
    assert all(spec["dropout"] == 0.125 for spec in calls.specs)
    for call in calls:
        assert isinstance(call["seed"], torch.Tensor) and call["seed"].dtype == torch.int64
        assert call["seed"].shape == (1,) and call["seed"].device == q.device
    seeds = [int(call["seed"]) for call in calls]
    assert len(set(seeds[:3])) == 3 and seeds[3] == seeds[0]
    assert all(0 <= seed < 2**63 for seed in seeds)


@pytest.mark.parametrize("case, reason", [
    ({"head_dim": 264}, "head dims"),
    ({"dtype": torch.float64}, "dtypes"),
    ({"kwargs": {"output_attentions": True}}, "output_attentions"),
    ({"kwargs": {"position_bias": torch.zeros(1, 2, 8, 8)}}, "position_bias"),
    ({"dropout": 1.0}, "dropout"),
    ({"dropout": 1e-6}, "dropout"),   # below the 16-bit draws' resolution: it would drop nothing
], ids=["head-dim-264", "float64", "output-attentions", "position-bias", "dropout-1", "dropout-1e-6"])
def test_what_fagen_cannot_express_falls_back_with_one_warning(calls, case, reason):
    q, k, v = qkv(head_dim=case.get("head_dim", 32), dtype=case.get("dtype", torch.float32))
    kwargs = case.get("kwargs", {})
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for _ in range(2):
            fagen_hf.attention_forward(Module(), q, k, v, None, dropout=case.get("dropout", 0.0), **kwargs)
    found = fallback_warnings(records)
    assert len(found) == 1 and reason in str(found[0].message)
    assert not calls


def test_sinks_run_on_fagen_through_its_lse(calls):
    """gpt-oss's s_aux (a sink logit per query head in the softmax's denominator): fagen's o and lse, then
    o * sigmoid(lse - sink), against softmax over the scores with the sink's column appended (gpt-oss's eager
    maths); gradients reach q, k, v and the sinks. A sinks tensor fagen cannot take (a wrong shape) falls back,
    to the model's eager function where the module's file has one; this test module has none: an error."""
    q, k, v = (t.requires_grad_() for t in qkv(heads=4, kv_heads=2))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    out, _ = fagen_hf.attention_forward(Module(groups=2), q, k, v, None, s_aux=sinks)
    assert calls[-1]["return_lse"] and not fagen_hf.fallback_reasons()
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 32 ** -0.5
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    combined = torch.cat([scores, sinks[None, :, None, None].expand(1, 4, 8, 1)], dim=-1)
    expected = (torch.softmax(combined, -1)[..., :-1] @ v.repeat_interleave(2, 1)).transpose(1, 2)
    assert max_error(out, expected) < TOLERANCE
    got = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    want = torch.autograd.grad(expected.square().sum(), (q, k, v, sinks))
    for g, w in zip(got, want):
        assert max_error(g, w) < TOLERANCE
    with pytest.raises(ValueError, match="s_aux.*eager"):
        fagen_hf.attention_forward(Module(groups=2), q, k, v, None, s_aux=torch.zeros(3))


def test_arguments_sdpa_would_drop_go_to_an_eager_function_that_takes_them_or_raise(calls, monkeypatch):
    """A fallback with a keyword argument that changes the maths and that transformers' SDPA does not apply (a
    per-token `sinks`, a sparse `block_indices`) goes to the module's eager_attention_forward where that takes it by
    name, and raises where it does not: SDPA would drop it without a word."""
    import sys

    seen = []

    def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sinks=None,
                                **kwargs):
        seen.append(sinks)
        return query.transpose(1, 2), None

    monkeypatch.setattr(sys.modules[Module.__module__], "eager_attention_forward", eager_attention_forward, raising=False)
    q, k, v = qkv()
    sinks = torch.zeros(2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out, _ = fagen_hf.attention_forward(Module(), q, k, v, None, sinks=sinks)
    assert seen == [sinks] and torch.equal(out, q.transpose(1, 2)) and not calls
    with pytest.raises(ValueError, match="drop block_indices"):
        fagen_hf.attention_forward(Module(), q, k, v, None, block_indices=torch.zeros(1, 1, 8, 2, dtype=torch.long))


def test_gpt_oss_matches_eager_forward_and_backward(calls):
    """A tiny gpt-oss (sinks on every layer, sliding window on alternate ones, mixture of experts): logits and
    every parameter's gradient, the sinks' included, against attn_implementation="eager"."""
    GptOssConfig = pytest.importorskip("transformers").GptOssConfig
    config = tiny(GptOssConfig, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                  layer_types=["sliding_attention", "full_attention"])
    eager, ours = model_pair(config)
    assert_training_step_matches(eager, ours, tokens())
    assert len(calls) == 2 and not fagen_hf.fallback_reasons()
    assert [call["spec"]["mask"] for call in calls] == ["sliding_window", "causal"]
    assert all(call["return_lse"] for call in calls)


def test_neutral_keyword_arguments_stay_on_fagen(calls):
    q, k, v = qkv()
    fagen_hf.attention_forward(Module(), q, k, v, None, position_ids=torch.arange(8)[None], use_cache=True,
                               softcap=None, output_attentions=False, s_aux=None, logits_to_keep=1)   # (GOT-OCR2's)
    assert len(calls) == 1 and not fagen_hf.fallback_reasons()


def test_fallback_writes_out_masks_sdpa_cannot_infer(calls):
    """A head dim fagen has no kernel for, on masks fagen_mask() skipped: sliding window, and causal with
    Nq < Nk. SDPA's is_causal would get both wrong (no window; top-left alignment)."""
    eager, ours = model_pair(tiny(MistralConfig, hidden_size=1056, num_attention_heads=4, num_key_value_heads=2,
                                  sliding_window=5))  # head_dim 264, above fagen's 256
    x = tokens(batch=1, seq=16)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
        cached = ours(x[:, :10], use_cache=True)
        got = ours(x[:, 10:], past_key_values=cached.past_key_values).logits
    cached = eager(x[:, :10], use_cache=True)
    expected = eager(x[:, 10:], past_key_values=cached.past_key_values).logits
    assert max_error(got, expected) < TOLERANCE
    assert len(fallback_warnings(records)) == 1 and not calls


def test_bottom_right_mask_is_fagens_mask():
    mask = fagen_hf.bottom_right_mask(3, 6, 2, "cpu")[0, 0]
    assert mask.tolist() == [[False, False, True, True, False, False],
                             [False, False, False, True, True, False],
                             [False, False, False, False, True, True]]
    assert fagen_hf.bottom_right_mask(2, 3, None, "cpu")[0, 0].tolist() == [[True, True, False], [True, True, True]]


# ---- the mask function -----------------------------------------------------------------------
def mask(**kwargs):
    fields = dict(batch_size=2, q_length=8, kv_length=8, q_offset=0, kv_offset=0,
                  mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip=True,
                  config=tiny(MistralConfig, sliding_window=4), dtype=torch.float32, device="cpu")
    fields.update(kwargs)
    return fagen_hf.fagen_mask(**fields)


def test_mask_is_skipped_exactly_when_fagens_kernel_mask_is_exact():
    window = sliding_window_causal_mask_function(4)
    ones = torch.ones(2, 12, dtype=torch.bool)
    padded = ones.clone()
    padded[1, 0] = False
    assert mask() is None                                                    # plain causal
    assert mask(q_length=4, kv_length=12, q_offset=8) is None                # a chunk after a cache
    assert mask(q_length=1, kv_length=12, q_offset=11) is None               # decoding
    assert mask(q_length=4, kv_length=12, q_offset=8, attention_mask=ones) is None
    assert mask(mask_function=window, local_size=4) is None                  # the config's sliding window
    assert mask(mask_function=window, local_size=4, q_length=4, kv_length=7, q_offset=8, kv_offset=5) is None

    def materialised(result, q_length=8, kv_length=8):
        return isinstance(result, torch.Tensor) and result.shape == (2, 1, q_length, kv_length)

    assert materialised(mask(q_length=4, kv_length=12, q_offset=8, attention_mask=padded), 4, 12)
    # a static cache's prefill and steps (top-left in a cache longer than the queries): each row's key end
    assert mask(q_length=4, kv_length=12, q_offset=0).flatten().tolist() == [4, 4]
    assert mask(q_length=1, kv_length=12, q_offset=torch.tensor(8)).flatten().tolist() == [9, 9]
    assert mask(q_length=4, kv_length=12, q_offset=0, attention_mask=ones).flatten().tolist() == [4, 4]
    assert materialised(mask(q_length=4, kv_length=12, q_offset=0, attention_mask=padded), 4, 12)
    assert materialised(mask(mask_function=window, local_size=4, q_length=4, kv_length=12, q_offset=0), 4, 12)
    assert mask(q_length=4, kv_length=12, q_offset=torch.tensor(8)).flatten().tolist() == [12, 12]
    # allow_is_causal_skip=False: transformers' own (a compileable cache's decoding steps) takes the row ends; a model
    # whose code asks for its masks written out gets them
    # (both read from the model's module, as loaded with the model; Falcon's asks for written-out masks)
    import transformers.models.falcon.modeling_falcon  # noqa: F401
    import transformers.models.mistral.modeling_mistral  # noqa: F401
    from transformers import FalconConfig
    step = dict(allow_is_causal_skip=False, q_length=1, kv_length=12, q_offset=torch.tensor(8))
    assert mask(**step).flatten().tolist() == [9, 9]
    assert materialised(mask(**step, config=FalconConfig(vocab_size=VOCAB)), 1, 12)
    assert materialised(mask(allow_is_causal_skip=False))      # not a compileable cache's step: written out
    assert materialised(mask(allow_is_causal_skip=False, q_length=1, kv_length=12, q_offset=8), 1, 12)
    assert fagen_hf.asks_for_written_masks("create_causal_mask(**kw, allow_is_causal_skip=False)")
    assert fagen_hf.asks_for_written_masks('mask_kwargs = {"config": c, "allow_is_causal_skip": False}')
    assert not fagen_hf.asks_for_written_masks("create_causal_mask(**mask_kwargs)")
    chunked = chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    assert materialised(mask(mask_function=chunked, local_size=4))           # chunked attention is not a window
    # ... but where the config's attention_chunk_size says it is the model's chunked attention, over a whole
    # sequence: each position's chunk id, for the documents mask_mod (no (N, N) mask)
    chunk_config = tiny(LlamaConfig, attention_chunk_size=4)
    ids = mask(mask_function=chunked, local_size=4, config=chunk_config)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]] * 2
    assert mask(mask_function=chunked, local_size=4, config=chunk_config, kv_length=4, q_length=4) is None  # one chunk
    assert materialised(mask(mask_function=chunked, local_size=4, config=chunk_config, q_length=4, kv_length=12,
                             q_offset=8), 4, 12)                             # after a cache: written out
    assert materialised(mask(mask_function=chunked, local_size=4, config=chunk_config, attention_mask=padded[:, :8]))
    assert materialised(mask(mask_function=chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
                             local_size=4, config=chunk_config))
    # the chunks counted from each row's left padding, as transformers' overlay counts them (a direct call: through
    # transformers the padding mask would have been written out above)
    shifted = mask(mask_function=chunked_causal_mask_function(4, torch.tensor([0, 3])), local_size=4, config=chunk_config)
    assert shifted.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1], [-1, -1, -1, 0, 0, 0, 0, 1]]
    assert materialised(mask(mask_function=window, local_size=4, config=tiny(LlamaConfig)))
    assert materialised(mask(mask_function=sliding_window_causal_mask_function(3), local_size=4))


def test_packed_sequence_masks_are_read_with_and_without_position_remapping():
    """transformers ANDs the pattern with the packed-sequence mask; newer versions (5.2x) first evaluate the pattern
    at each token's position inside its sequence (remap_positions_for_packed_sequence). Both forms give the ids and
    the pattern underneath, causal or the config's window; a pattern that is not exactly one of the kernels' (chunked,
    or a window or causal pattern with an overlay) still builds SDPA's mask, the exact one."""
    from transformers import masking_utils

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)
    forms = {"plain": lambda pattern: pattern}
    if remap is not None:
        forms["remapped"] = lambda pattern: remap(pattern, positions)
    for name, form in forms.items():
        packed = masking_utils.and_masks(form(causal_mask_function), masking_utils.packed_sequence_mask_function(ids))
        found = fagen_hf._packed_sequences(packed, 8)
        assert found is not None and found[0] is causal_mask_function, name
        assert found[1].dtype == torch.int32 and found[1].tolist() == ids.tolist(), name
        result = mask(batch_size=1, mask_function=packed, allow_is_causal_skip=False)
        assert isinstance(result, torch.Tensor) and result.dtype == torch.int32, name   # the ids, no (N, N) mask
        window = masking_utils.and_masks(form(sliding_window_causal_mask_function(4)),
                                         masking_utils.packed_sequence_mask_function(ids))
        result = mask(batch_size=1, mask_function=window, local_size=4, allow_is_causal_skip=False)
        assert isinstance(result, torch.Tensor) and result.dtype == torch.int32, name   # the config's window (4)
        # not the kernels' masks: SDPA's boolean mask, the exact one (an image block OR-ed in, a key AND-ed out:
        # neither shows at the few points a probe of the pattern would look at)
        block = lambda b, h, i, j: (i >= 5) & (j >= 5)   # noqa: E731
        not_key_6 = lambda b, h, i, j: j != 6   # noqa: E731
        others = {"chunked": chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
                  "window + block": masking_utils.or_masks(sliding_window_causal_mask_function(4), block),
                  "window - key 6": masking_utils.and_masks(sliding_window_causal_mask_function(4), not_key_6),
                  "causal + block": masking_utils.or_masks(causal_mask_function, block)}
        for other, pattern in others.items():
            function = masking_utils.and_masks(form(pattern), masking_utils.packed_sequence_mask_function(ids))
            result = mask(batch_size=1, mask_function=function, local_size=None if other.startswith("causal") else 4,
                          allow_is_causal_skip=False)
            exact = masking_utils.sdpa_mask(batch_size=1, q_length=8, kv_length=8, mask_function=function,
                                            allow_is_causal_skip=False)
            assert isinstance(result, torch.Tensor) and result.dtype == torch.bool, (name, other)
            assert torch.equal(result, exact), (name, other)


# ---- torch.compile ---------------------------------------------------------------------------
@pytest.fixture
def reference_op(monkeypatch):
    """The reference as a custom op with a string spec, like fagen's own ops, so that dynamo can trace a
    model through the integration (the CPU stand-in for fagen's kernels under torch.compile)."""
    try:
        op = torch.library.custom_op("fagen_test::reference_attention", mutates_args=())(_reference_op)
        op.register_fake(lambda q, k, v, spec: q.new_empty(q.shape))
    except RuntimeError:  # already defined by an earlier test in this process
        op = torch.ops.fagen_test.reference_attention.default
    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    monkeypatch.setattr(fagen.torch, "attention",
                        lambda q, k, v, spec, *, seed=0, offset=0, inputs=None, kv_lengths=None: op(q, k, v, spec))
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    yield
    fagen_hf.reset_fallbacks()


def _reference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: str) -> torch.Tensor:
    return reference_attention(q, k, v, json.loads(spec))


def test_decoder_layers_compile_with_fullgraph_through_the_integration(reference_op):
    """Regional compilation: the masks are made eagerly (None), each decoder layer is one graph with fagen in it."""
    eager, ours = model_pair(tiny(MistralConfig, sliding_window=5))
    x = tokens(seq=16)
    for layer in ours.model.layers:
        layer.compile(fullgraph=True, backend="eager")
    with torch.no_grad():
        assert max_error(ours(x).logits, eager(x).logits) < TOLERANCE
    assert not fagen_hf.fallback_reasons()


def test_a_whole_compiled_model_falls_back_without_breaking_the_graph(reference_op):
    """Traced whole, transformers writes the causal mask out (its packed-sequence check cannot run while
    tracing): fagen falls back to SDPA, and says so, inside one graph."""
    eager, ours = model_pair(tiny(LlamaConfig))
    x = tokens(seq=16)
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as records, torch.no_grad():
        warnings.simplefilter("always")
        assert max_error(compiled(x, use_cache=False).logits, eager(x, use_cache=False).logits) < TOLERANCE
    assert len(fallback_warnings(records)) == 1


@pytest.mark.parametrize("attention_mask", [False, True])
def test_a_whole_compiled_model_with_a_cache_runs_on_fagen_without_a_mask(reference_op, attention_mask):
    """Traced whole with a cache (use_cache's default, a training step's too), transformers skips the causal mask
    (it checks for packed sequences only without one) and every layer runs on fagen; an attention_mask, even all
    ones, is unreadable while tracing and falls back (transformers 5.17 and 5.24 alike)."""
    eager, ours = model_pair(tiny(LlamaConfig))
    x = tokens(seq=16)
    kwargs = {"attention_mask": torch.ones_like(x)} if attention_mask else {}
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    with warnings.catch_warnings(record=True) as records, torch.no_grad():
        warnings.simplefilter("always")
        assert max_error(compiled(x, use_cache=True, **kwargs).logits, eager(x, use_cache=True).logits) < TOLERANCE
    assert len(fallback_warnings(records)) == (1 if attention_mask else 0)
    assert bool(fagen_hf.fallback_reasons()) == attention_mask


#: The masks the op below was run with, in order (recorded when it runs, outside dynamo's trace).
CACHE_OP_MASKS = []


def _reference_cache_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: str, end: torch.Tensor | None,
                        kv_lengths: torch.Tensor | None) -> torch.Tensor:
    fields = json.loads(spec)
    CACHE_OP_MASKS.append(fields.get("mask_mod", fields["mask"]))
    return reference_attention(q, k, v, fields, None if end is None else {"end": end}, False, kv_lengths)


def test_a_whole_compiled_model_decodes_from_a_static_cache_on_fagen(monkeypatch):
    """Traced whole (fullgraph) with a static cache, a prefill and one-token steps: the row ends are made inside the
    graph from the cache position (a tensor), and every call runs on fagen (the prefill's mask_mod, the steps'
    padding mask with kv_lengths), matching eager."""
    from transformers import StaticCache

    try:
        op = torch.library.custom_op("fagen_test::reference_cache_attention", mutates_args=())(_reference_cache_op)
        op.register_fake(lambda q, k, v, spec, end, kv_lengths: q.new_empty(q.shape))
    except RuntimeError:  # already defined by an earlier test in this process
        op = torch.ops.fagen_test.reference_cache_attention.default
    CACHE_OP_MASKS.clear()

    def attention(q, k, v, spec, *, seed=0, offset=0, inputs=None, kv_lengths=None):
        return op(q, k, v, spec, None if not inputs else inputs["end"], kv_lengths)

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    monkeypatch.setattr(fagen.torch, "attention", attention)
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    eager, ours = model_pair(tiny(LlamaConfig))
    x = tokens(batch=2, seq=6)
    logits = {}
    for name, model in (("eager", eager), ("fagen", ours)):
        cache = StaticCache(config=model.config, max_cache_len=16)
        forward = torch.compile(model.forward, fullgraph=True, backend="eager") if name == "fagen" else model.forward
        with torch.no_grad():
            out = forward(input_ids=x, past_key_values=cache, use_cache=True, cache_position=torch.arange(6))
            steps = [out.logits[:, -1]]
            for step in range(3):
                out = forward(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True,
                              cache_position=torch.tensor([6 + step]))
                steps.append(out.logits[:, -1])
        logits[name] = torch.stack(steps)
    assert max_error(logits["fagen"], logits["eager"]) < TOLERANCE
    assert CACHE_OP_MASKS == [fagen_hf.CACHE_MASK] * 2 + ["padding"] * 6
    assert not fagen_hf.fallback_reasons()
    fagen_hf.reset_fallbacks()


def _deepseek_v3(**overrides):
    config_class = getattr(transformers, "DeepseekV3Config", None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV3Config")
    fields = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    return config_class(**fields)


def test_deepseek_v3_mla_runs_on_fagen_with_its_value_head_dim(calls):
    """MLA's q, k of 48 dims (32 + 16 rope dims) and v of 32 go to fagen as they are, with value_head_dim in the
    spec: bf16 logits and a training step's gradients as eager's (to bf16's rounding), no fallback."""
    eager, ours = model_pair(_deepseek_v3(), dtype=torch.bfloat16)
    x = tokens(seq=20)
    expected, got = eager(x, labels=x), ours(x, labels=x)
    scale = expected.logits.float().abs().max().item()
    assert max_error(got.logits.float(), expected.logits.float()) < 3e-2 * scale
    expected.loss.backward()
    got.loss.backward()
    theirs = dict(eager.named_parameters())
    for name, param in ours.named_parameters():   # every gradient as eager's, to bf16's rounding
        want = theirs[name].grad.float()
        assert torch.isfinite(param.grad).all() and (param.grad.float() - want).norm() <= 5e-2 * want.norm() + 1e-6, name
    assert len(calls) == 2 and not fagen_hf.fallback_reasons()
    for call in calls:
        assert call["spec"]["head_dim"] == 48 and call["spec"]["value_head_dim"] == 32
        assert call["q"] == (2, 4, 20, 48) and call["v"] == (2, 4, 20, 32)


def test_deepseek_v3_in_float32_falls_back_naming_the_value_head_dim(calls):
    """fp32 runs on the CUDA-core templates, which take one head dim: the fallback says so, once."""
    eager, ours = model_pair(_deepseek_v3())
    with pytest.warns(UserWarning, match="a value head dim unlike the query's"):
        got = ours(tokens(seq=12)).logits
    assert max_error(got, eager(tokens(seq=12)).logits) < TOLERANCE
    assert not calls


def test_deepseek_v3_cached_generation_asks_for_the_decode_kernel_with_its_value_head_dim(calls):
    """Generation with a cache: the prefill as a plain causal spec, each step (one query) as the spec with the decode
    pass, both with value_head_dim (valid specs: the fixture builds each); the prefill's logits eager's."""
    eager, ours = model_pair(_deepseek_v3(), dtype=torch.bfloat16)
    prompt = tokens(batch=1, seq=12)
    out = {name: net.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True) for name, net in (("eager", eager), ("fagen", ours))}
    first = [out[name].logits[0].float() for name in ("fagen", "eager")]
    assert max_error(*first) < 3e-2 * first[1].abs().max().item()
    assert len(calls) == 4 * 2 and not fagen_hf.fallback_reasons()
    assert all(call["spec"]["value_head_dim"] == 32 for call in calls)
    steps = [call for call in calls if call["q"][2] == 1]
    assert len(steps) == 3 * 2 and all("decode" in call["spec"].get("passes", ()) for call in steps)
