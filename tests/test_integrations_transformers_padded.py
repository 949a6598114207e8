"""fagen.integrations.transformers on padded batches, on the CPU: left- and right-padded attention masks in training
and generation (prefill and steps, with and without a KV cache) run on fagen's kernels, with no fallback.

fagen's kernels need a GPU, so `fagen.torch.attention` is replaced by a float64 stand-in that evaluates the spec it
is given through fagen's own reference (`fagen.reference.visible_mask`: the mask kind, bottom-right aligned, and the
mask_mod with its inputs, from the same expression the kernels are rendered from), and the integration is allowed
to run on CPU tensors. Models are tiny, built from configs with random weights, and compared with
attn_implementation="sdpa" (every row, the padding rows too: a query that sees no key gives 0 in both) and "eager"
(the rows that see a key; eager averages every key for the others). GPU runs of the real kernels:
tests/test_integrations_transformers_gpu.py.
"""
import copy
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    causal_mask_function, sdpa_mask, sliding_window_causal_mask_function)

import fagen.torch  # noqa: E402
from fagen.integrations import transformers as fagen_hf  # noqa: E402
from fagen.reference import visible_mask  # noqa: E402
from fagen.spec import spec_from_dict  # noqa: E402

TOLERANCE = 1e-4
VOCAB = 97


@pytest.fixture
def calls(monkeypatch):
    """fagen attention on the CPU through the stand-in below; every call recorded (spec fields, shapes, inputs)."""
    recorded = []

    def stand_in(q, k, v, spec, *, seed=0, offset=0, inputs=None, kv_lengths=None, return_lse=False):
        assert isinstance(spec, str), "the integration passes the spec as a JSON string (torch.compile folds it)"
        fields = json.loads(spec)
        recorded.append({"spec": fields, "q": tuple(q.shape), "k": tuple(k.shape), "inputs": inputs,
                         "kv_lengths": kv_lengths})
        return reference_attention(q, k, v, spec_from_dict(fields), inputs, kv_lengths, return_lse)

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    monkeypatch.setattr(fagen.torch, "attention", stand_in)
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    yield recorded
    fagen_hf.reset_fallbacks()


def reference_attention(q, k, v, spec, inputs=None, kv_lengths=None, return_lse=False):
    """softmax(scale * Q K^T, over the keys fagen's reference says are visible) V in float64, differentiable; rows
    with no visible key give 0 (lse -inf), as fagen's kernels do."""
    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[2]
    lengths = None if kv_lengths is None else kv_lengths.numpy()
    visible = torch.from_numpy(visible_mask(spec, batch, heads, seq_q, seq_k, kv_lengths=lengths, inputs=inputs))
    group = heads // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (spec.scale * q.double() @ k64.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    out = (torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64).to(q.dtype)
    return (out, torch.logsumexp(scores, dim=-1).float()) if return_lse else out


def tiny(config_class, **overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)
    fields.update(overrides)
    return config_class(**fields)


def models(config, names=("eager", "sdpa", "fagen")):
    """The same random weights under each attention implementation (float32, CPU, eval)."""
    torch.manual_seed(0)
    out = {name: AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name).eval()
           for name in names}
    for model in list(out.values())[1:]:
        model.load_state_dict(out[names[0]].state_dict())
    assert out["fagen"].config._attn_implementation == "fagen"
    return out


def tokens(batch, seq, seed=1):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def left_padded(pads, seq):
    """A 2-D attention mask, row b padded with its first pads[b] positions."""
    return torch.stack([torch.arange(seq) >= pad for pad in pads]).long()


def right_padded(lengths, seq):
    return torch.stack([torch.arange(seq) < length for length in lengths]).long()


def max_error(a, b):
    return (a - b).abs().max().item()


def fallback_warnings(records):
    return [w for w in records if "fagen attention" in str(w.message)]


def padded_calls(calls, text=fagen_hf.RUNS_MASK):
    return [call for call in calls if call["spec"].get("mask_mod") == text]


def seen_any_key(mask, window=None):
    """(B, N) booleans: the query rows of a causal (or sliding-window) padded batch that see at least one key."""
    counts = torch.nn.functional.pad(mask.long().cumsum(-1), (1, 0))   # counts[:, i + 1]: valid keys up to i
    if window is None:
        return counts[:, 1:] > 0
    first = (torch.arange(mask.shape[-1]) - window + 1).clamp(min=0)
    return counts[:, 1:] - counts[:, first] > 0


# ---- training ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config_class, extra", [(LlamaConfig, {}), (MistralConfig, {"sliding_window": 5})],
                         ids=["llama", "mistral-window"])
def test_right_padded_training_batch_matches_sdpa_and_eager(calls, config_class, extra):
    """A right-padded training batch (one row not padded, one wholly padded): the loss and every parameter's gradient
    against SDPA's and eager's with the same mask, labels -100 at the padding; and against SDPA's with the padding's
    labels kept (every row is SDPA's, the padding rows too). Every call on fagen: the layer's mask with the runs
    mask_mod, no fallback."""
    nets = models(tiny(config_class, **extra))
    x = tokens(4, 14)
    mask = right_padded([14, 9, 3, 0], 14)
    labels = x.masked_fill(mask == 0, -100)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        results = {}
        for name, model in nets.items():
            model.train()   # (attention_dropout 0: the same maths as eval)
            for target in ("ignored", "kept"):
                if target == "kept" and name == "eager":
                    continue
                model.zero_grad(set_to_none=True)
                out = model(x, attention_mask=mask, labels=labels if target == "ignored" else x, use_cache=False)
                out.loss.backward()
                results[name, target] = (out.loss.item(), out.logits.detach(),
                                         {n: p.grad.clone() for n, p in model.named_parameters()})
    assert not fallback_warnings(records) and not fagen_hf.fallback_reasons()
    for other, target in (("sdpa", "ignored"), ("eager", "ignored"), ("sdpa", "kept")):
        loss, logits, grads = results["fagen", target]
        expected_loss, expected_logits, expected_grads = results[other, target]
        assert abs(loss - expected_loss) < TOLERANCE, (other, target)
        rows = (seen_any_key(mask, extra.get("sliding_window")) if other == "eager"
                else torch.ones_like(mask, dtype=torch.bool))
        assert max_error(logits[rows], expected_logits[rows]) < TOLERANCE, (other, target)
        for name, grad in grads.items():
            assert max_error(grad, expected_grads[name]) < TOLERANCE, (other, target, name)
    assert calls and len(padded_calls(calls)) == len(calls)   # (the stand-in differentiates itself: forwards only)
    assert {call["spec"]["mask"] for call in calls} == ({"sliding_window"} if extra else {"causal"})
    assert all(call["inputs"]["rows"].tolist() == [[0, 14], [0, 9], [0, 3], [0, 0]] for call in calls)


def test_left_padded_training_batch_matches_sdpa(calls):
    nets = models(tiny(LlamaConfig), names=("sdpa", "fagen"))
    x = tokens(3, 12)
    mask = left_padded([0, 4, 11], 12)
    labels = x.masked_fill(mask == 0, -100)
    grads = {}
    for name, model in nets.items():
        loss = model(x, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        grads[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(grads["fagen"][0] - grads["sdpa"][0]) < TOLERANCE
    assert all(max_error(g, grads["sdpa"][1][n]) < TOLERANCE for n, g in grads["fagen"][1].items())
    assert calls and all(call["inputs"]["rows"].tolist() == [[0, 12], [4, 12], [11, 12]] for call in calls)
    assert not fagen_hf.fallback_reasons()


# ---- prefill and generation -------------------------------------------------------------------
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
def test_left_padded_prefill_logits_are_sdpas(calls, use_cache):
    """A left-padded prefill (with a fully padded row, and one not padded): every position's logits SDPA's, the
    non-padded positions' eager's too."""
    nets = models(tiny(LlamaConfig))
    x = tokens(4, 13)
    mask = left_padded([0, 2, 7, 13], 13)
    with torch.no_grad():
        logits = {name: model(x, attention_mask=mask, use_cache=use_cache).logits for name, model in nets.items()}
    assert max_error(logits["fagen"], logits["sdpa"]) < TOLERANCE
    valid = mask.bool()
    assert max_error(logits["fagen"][valid], logits["eager"][valid]) < TOLERANCE
    assert len(padded_calls(calls)) == len(calls) == 2 and not fagen_hf.fallback_reasons()
    assert calls[0]["inputs"]["rows"].tolist() == [[0, 13], [2, 13], [7, 13], [0, 0]]


@pytest.mark.parametrize("config_class, extra", [(LlamaConfig, {}), (MistralConfig, {"sliding_window": 6}),
                                                 (Qwen2Config, {"use_sliding_window": True, "sliding_window": 4,
                                                                "max_window_layers": 1})],
                         ids=["llama", "mistral-window", "qwen2-mixed"])
def test_left_padded_batched_generation_matches_eager_and_sdpa(calls, config_class, extra):
    """Left-padded batched greedy generation with a dynamic cache: the same tokens as eager's and SDPA's. The prefill
    and every step run on fagen (the runs mask_mod, one query against the cache in the steps), no fallback. Mistral's
    window is shorter than the prompt plus the new tokens: its cache keeps only the window (keys from an offset), the
    padding of those keys is what the mask says, and once the padding has left the window a step runs the kernels'
    own window mask (and the decode kernel's spec)."""
    nets = models(tiny(config_class, **extra))
    x = tokens(3, 9)
    mask = left_padded([0, 3, 6], 9)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        generated = {name: model.generate(x, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
                     for name, model in nets.items()}
    assert torch.equal(generated["fagen"], generated["eager"])
    assert torch.equal(generated["fagen"], generated["sdpa"])
    assert not fallback_warnings(records) and not fagen_hf.fallback_reasons()
    assert len(calls) == 7 * 2 and len([call for call in calls if call["q"][2] == 1]) == 6 * 2
    padded = padded_calls(calls)
    assert all(call["spec"].get("mask_mod") in (None, fagen_hf.RUNS_MASK) for call in calls)
    assert not any("passes" in call["spec"] for call in padded)   # (the decode kernel takes no mask_mod)
    assert all("mask_mod" in call["spec"] for call in calls if call["q"][2] == 9)   # the prefill
    if config_class is not MistralConfig:   # the first layer's calls (full attention): every one with the padding
        full = calls[0::2]
        assert all(call["spec"]["mask"] == "causal" and "mask_mod" in call["spec"] for call in full)
        assert full[-1]["k"][2] == 9 + 6 and full[-1]["inputs"]["rows"].tolist() == [[0, 15], [3, 15], [6, 15]]
    if config_class is MistralConfig:   # the window's keys only (5 cached + the new one), the padding sliced likewise
        assert any(call["k"][2] == 6 and call["inputs"]["rows"].tolist() == [[0, 6], [0, 6], [1, 6]] for call in padded)
        assert calls[-1]["k"][2] == 6 and "mask_mod" not in calls[-1]["spec"]


def test_generation_without_padding_keeps_the_kernel_masks(calls):
    """A batch with an all-ones attention mask: no mask_mod, the layers' own masks, the decode kernel's spec for the
    steps (as without a mask)."""
    nets = models(tiny(LlamaConfig), names=("eager", "fagen"))
    x = tokens(2, 8)
    generated = {name: model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False,
                                      pad_token_id=0) for name, model in nets.items()}
    assert torch.equal(generated["fagen"], generated["eager"])
    assert calls and not any("mask_mod" in call["spec"] for call in calls)
    assert all(call["spec"].get("passes") == ["forward", "backward", "decode"] for call in calls if call["q"][2] == 1)
    assert not fagen_hf.fallback_reasons()


def test_right_padded_generation_runs_the_keys_mask_mod(calls):
    """Right-padded prompts (transformers warns that they are a mistake, and decodes them all the same): the prefill's
    valid keys are one run per row, the steps' are not (the gap between each prompt and its new tokens): those run
    the keys mask_mod with the padding itself. The same tokens as eager's, no fallback."""
    nets = models(tiny(LlamaConfig), names=("eager", "fagen"))
    x = tokens(3, 8)
    mask = right_padded([8, 5, 2], 8)
    generated = {name: model.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
                 for name, model in nets.items()}
    assert torch.equal(generated["fagen"], generated["eager"])
    assert len(padded_calls(calls)) == 2   # the prefill
    keys = padded_calls(calls, fagen_hf.KEYS_MASK)
    assert len(keys) == 4 * 2 and not fagen_hf.fallback_reasons()
    assert keys[-1]["inputs"]["keys"].tolist() == [[1] * 12, [1] * 5 + [0] * 3 + [1] * 4, [1] * 2 + [0] * 6 + [1] * 4]


def test_a_chunk_after_a_left_padded_cache_matches_sdpa(calls):
    """Several queries against a left-padded cache (Nq < Nk, bottom-right aligned): the runs mask_mod."""
    nets = models(tiny(LlamaConfig), names=("sdpa", "fagen"))
    x = tokens(2, 14)
    mask = left_padded([0, 5], 14)
    logits = {}
    with torch.no_grad():
        for name, model in nets.items():
            first = model(x[:, :9], attention_mask=mask[:, :9], use_cache=True)
            logits[name] = model(x[:, 9:], attention_mask=mask, past_key_values=first.past_key_values).logits
    assert max_error(logits["fagen"], logits["sdpa"]) < TOLERANCE
    assert any(call["q"][2] == 5 and call["k"][2] == 14 for call in padded_calls(calls))
    assert not fagen_hf.fallback_reasons()


def test_static_cache_left_padded_generation_runs_on_fagen(calls):
    """A static cache with left-padded prompts: the prefill and the steps as the static runs mask_mod (each row's run of
    valid keys and its end, mask none), the same tokens as eager's; without padding, as before (the decode kernel's
    padding mask for the steps)."""
    nets = models(tiny(LlamaConfig), names=("eager", "fagen"))
    x = tokens(3, 6)
    mask = left_padded([0, 2, 5], 6)
    generated = {name: model.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                                      cache_implementation="static") for name, model in nets.items()}
    assert torch.equal(generated["fagen"], generated["eager"])
    static = padded_calls(calls, fagen_hf.STATIC_RUNS_MASK)
    assert len(static) == len(calls) == 5 * 2 and all(call["spec"]["mask"] == "none" for call in static)
    assert static[0]["inputs"]["rows"].tolist() == [[0, 6, 6], [2, 6, 6], [5, 6, 6]]
    assert static[-1]["inputs"]["rows"].tolist() == [[0, 10, 10], [2, 10, 10], [5, 10, 10]]
    assert not fagen_hf.fallback_reasons()


# ---- the mask function ------------------------------------------------------------------------
def mask(**kwargs):
    fields = dict(batch_size=3, q_length=8, kv_length=8, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                  attention_mask=None, allow_is_causal_skip=True, config=tiny(MistralConfig, sliding_window=4),
                  dtype=torch.float32, device="cpu")
    fields.update(kwargs)
    return fagen_hf.fagen_mask(**fields)


def test_the_mask_function_hands_on_the_padding_of_the_keys(monkeypatch):
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    ones = torch.ones(3, 8, dtype=torch.bool)
    assert mask(attention_mask=ones) is None                                   # no padding: the kernels' own mask
    left = left_padded([0, 3, 8], 8).bool()                                     # (row 2 wholly padded)
    runs = mask(attention_mask=left)
    assert runs.dtype == torch.int32 and runs.shape == (3, 1, 2, 1) and fagen_hf._padded_kind(runs) == "runs"
    assert runs.view(3, 2).tolist() == [[0, 8], [3, 8], [0, 0]]
    both = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]] * 3, dtype=torch.bool)       # padded on both sides: one run
    assert mask(attention_mask=both).view(3, 2).tolist() == [[1, 6]] * 3
    gaps = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 1]]).bool()
    keys = mask(attention_mask=gaps)                                            # not one run: the padding itself
    assert keys.shape == (3, 1, 1, 8) and fagen_hf._padded_kind(keys) == "keys"
    assert keys.view(3, 8).tolist() == gaps.int().tolist()
    # a step after a cache: the mask covers the cache and the query; a sliding window's keys from an offset
    step = mask(q_length=1, kv_length=12, q_offset=11, attention_mask=left_padded([0, 3, 5], 12).bool())
    assert step.view(3, 2).tolist() == [[0, 12], [3, 12], [5, 12]]
    window = sliding_window_causal_mask_function(4)
    sliced = mask(mask_function=window, local_size=4, q_length=1, kv_length=4, q_offset=11, kv_offset=8,
                  attention_mask=left_padded([0, 3, 9], 12).bool())
    assert sliced.view(3, 2).tolist() == [[0, 4], [0, 4], [1, 4]]
    shorter = mask(kv_length=8, attention_mask=torch.ones(3, 6, dtype=torch.bool))   # keys past the mask: padding
    assert shorter.view(3, 2).tolist() == [[0, 6]] * 3
    # a static cache (keys up to its full length): each row's run and its end; no padding among the filled keys: the
    # row ends, as before
    static = mask(q_length=4, kv_length=12, q_offset=0, attention_mask=left_padded([0, 1, 3], 4).bool())
    assert fagen_hf._padded_kind(static) == "static runs"
    assert static.view(3, 3).tolist() == [[0, 4, 4], [1, 4, 4], [3, 4, 4]]
    assert mask(q_length=1, kv_length=12, q_offset=torch.tensor(8), attention_mask=left_padded([0, 1, 3], 9).bool()
                ).view(3, 3).tolist() == [[0, 9, 9], [1, 9, 9], [3, 9, 9]]
    assert mask(q_length=4, kv_length=12, q_offset=0, attention_mask=torch.ones(3, 4, dtype=torch.bool)
                ).flatten().tolist() == [4, 4, 4]
    # not the kernels' pattern, a static cache's gaps, or a device fagen has no kernel for: SDPA's mask, written out
    chunked = transformers.masking_utils.chunked_causal_mask_function(4, torch.zeros(3, dtype=torch.long))
    for written in (mask(mask_function=chunked, local_size=4, attention_mask=left),
                    mask(allow_is_causal_skip=False, attention_mask=left),
                    mask(q_length=4, kv_length=12, q_offset=0, attention_mask=gaps[:, :4])):
        assert written.dtype == torch.bool and written.dim() == 4
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda",))
    written = mask(attention_mask=left)
    assert torch.equal(written, sdpa_mask(batch_size=3, q_length=8, kv_length=8, attention_mask=left))


# ---- what still falls back ----------------------------------------------------------------------
def sdpa_spy(monkeypatch, module):
    """Records the attention_mask every call of `module`'s sdpa_attention_forward gets (the real one then runs)."""
    seen = []
    real = module.sdpa_attention_forward

    def spy(module_, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return real(module_, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(module, "sdpa_attention_forward", spy)
    return seen


def test_a_fallback_passes_sdpa_the_mask_transformers_gives_it(monkeypatch):
    """A padded batch that cannot run on fagen (here: CPU tensors, fagen's kernels run on CUDA) falls back with the
    mask transformers builds for SDPA, built once per forward (every layer gets that same tensor), and nothing else:
    the SDPA model's own masks, the same logits."""
    from transformers import AttentionInterface
    from transformers.integrations import sdpa_attention

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    ours = sdpa_spy(monkeypatch, fagen_hf)
    theirs = []
    real = sdpa_attention.sdpa_attention_forward

    def spy(module_, query, key, value, attention_mask, **kwargs):
        theirs.append(attention_mask)
        return real(module_, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", spy)
    nets = models(tiny(LlamaConfig), names=("sdpa", "fagen"))
    x = tokens(3, 10)
    mask = left_padded([0, 4, 7], 10)
    with warnings.catch_warnings(record=True) as records, torch.no_grad():
        warnings.simplefilter("always")
        logits = {name: model(x, attention_mask=mask).logits for name, model in nets.items()}
    assert torch.equal(logits["fagen"], logits["sdpa"])
    assert len(ours) == len(theirs) == 2 and ours[0] is ours[1]
    assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.bool for a, b in zip(ours, theirs))
    assert len(fallback_warnings(records)) == 1
    fagen_hf.reset_fallbacks()


def test_a_call_that_falls_back_builds_the_padded_batchs_mask_once(calls, monkeypatch):
    """A padded batch whose calls fall back one by one (output_attentions, which SDPA cannot give either) gets
    SDPA's boolean mask for the padding, built by the first layer and taken by the others: transformers' own."""
    seen = sdpa_spy(monkeypatch, fagen_hf)
    nets = models(tiny(LlamaConfig), names=("sdpa", "fagen"))
    x = tokens(3, 10)
    mask = left_padded([0, 4, 7], 10)
    with warnings.catch_warnings(record=True), torch.no_grad():
        warnings.simplefilter("always")
        logits = {name: model(x, attention_mask=mask, output_attentions=True).logits for name, model in nets.items()}
    assert max_error(logits["fagen"], logits["sdpa"]) < TOLERANCE
    assert not calls and len(seen) == 2 and seen[0] is seen[1]
    expected = sdpa_mask(batch_size=3, q_length=10, kv_length=10, attention_mask=mask.bool())
    assert torch.equal(seen[0], expected)
    assert any("output_attentions" in reason for reason in fagen_hf.fallback_reasons())


# ---- torch.compile ---------------------------------------------------------------------------
#: The masks the op below ran (recorded when it runs, outside dynamo's trace).
OP_MASKS = []


def _padded_reference_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: str, mod: torch.Tensor | None,
                         kv_lengths: torch.Tensor | None) -> torch.Tensor:
    fields = json.loads(spec)
    OP_MASKS.append(fields.get("mask_mod", fields["mask"]))
    inputs = None if mod is None else {next(iter(fields["inputs"])): mod}
    return reference_attention(q, k, v, spec_from_dict(fields), inputs, kv_lengths)


def test_compiled_decoder_layers_take_a_padded_batch_on_fagen(monkeypatch):
    """Regional compilation (each decoder layer compiled with fullgraph=True; transformers makes the masks eagerly): a
    left-padded prefill traces through the integration with the runs tensor as the mask_mod's input, every call on
    fagen, SDPA's logits."""
    try:
        op = torch.library.custom_op("fagen_test::padded_reference_attention", mutates_args=())(_padded_reference_op)
        op.register_fake(lambda q, k, v, spec, mod, kv_lengths: q.new_empty(q.shape))
    except RuntimeError:  # already defined by an earlier test in this process
        op = torch.ops.fagen_test.padded_reference_attention.default

    def attention(q, k, v, spec, *, seed=0, offset=0, inputs=None, kv_lengths=None):
        return op(q, k, v, spec, None if not inputs else next(iter(inputs.values())), kv_lengths)

    fagen_hf.register()
    fagen_hf.reset_fallbacks()
    monkeypatch.setattr(fagen.torch, "attention", attention)
    monkeypatch.setattr(fagen_hf, "DEVICE_TYPES", ("cuda", "cpu"))
    OP_MASKS.clear()
    nets = models(tiny(MistralConfig, sliding_window=5), names=("sdpa", "fagen"))
    for layer in nets["fagen"].model.layers:
        layer.compile(fullgraph=True, backend="eager")
    x = tokens(3, 12)
    mask = left_padded([0, 3, 12], 12)
    with torch.no_grad():
        logits = {name: model(x, attention_mask=mask).logits for name, model in nets.items()}
    assert max_error(logits["fagen"], logits["sdpa"]) < TOLERANCE
    assert OP_MASKS == [fagen_hf.RUNS_MASK] * 2 and not fagen_hf.fallback_reasons()
    fagen_hf.reset_fallbacks()
