"""Hugging Face transformers: `attn_implementation="fagen"`.

    import fagen.integrations.transformers
    fagen.integrations.transformers.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen")   # or
    model.set_attn_implementation("fagen")

`register()` adds two entries named "fagen": `attention_forward` to transformers' AttentionInterface
and `fagen_mask` to its AttentionMaskInterface. The second one is not optional: for a name the
mask interface does not know, transformers builds no mask at all, and a padding mask would be dropped
without a word.

Gemma-2-style logit soft-capping (`softcap`) becomes the spec's score_mod `cap * tanh(score / cap)`.
gpt-oss's attention sinks (`s_aux`, a learned logit per head added to the softmax's denominator with no
value) are applied to fagen's output through its LSE, which is differentiable: o * sigmoid(lse - sink).

`fagen_mask` builds SDPA's boolean masks, but returns None when the mask is one fagen's kernels
apply by themselves: no padding, the queries being the last positions of the keys (fagen aligns the
two sequences at the bottom right), and the pattern plain causal or the model's sliding window.
Packed sequences (several sequences back to back in one row, found by transformers from position_ids
restarting at 0) are one more: fagen_mask then returns the (B, N) int32 sequence ids transformers
derived, and attention_forward runs the spec's causal (or window) mask AND the mask_mod
`doc[b, i] == doc[b, j]` with those ids, tiles across two sequences skipped (fagen/expressions/'s
run-time summaries). Nothing is read back to the host, and no (N, N) mask is built. (transformers
looks for packed sequences only when the model makes no KV cache: train on packed rows with
use_cache=False, or every attention implementation attends across the sequences' boundaries.)
Llama 4's chunked attention over a whole sequence (no cache before it) goes the same way: the ids are each
position's chunk, position // attention_chunk_size. A static cache's causal mask (keys up to the cache's full
length, the part past the queries empty) comes as each row's key end, a (B, 1, 1, 1) int32 tensor: the mask_mod
`j <= i + end[b] - Nq`, or for one query the padding mask with kv_lengths = end.
Padded batches (a 2-D attention_mask with zeros: left-padded generation, right-padded training batches, with or
without a cache, prefill, chunks and one-token steps) come as the padding of the keys, read from transformers'
2-D padding mask once per mask function call (where transformers' SDPA path reads it too): each row's run of
valid keys [lo, hi) as a (B, 1, 2, 1) int32 tensor, the mask_mod `rows[b, 0] <= j < rows[b, 1]` ANDed with the
layer's causal or window mask (per-row values: the tiles' tests stay arithmetic, tiles wholly among padding are
skipped); in a static cache with each row's end too; a pattern that is not one run per row (right-padded
generation's steps) as the keys' padding itself, the mask_mod `keys[b, j] != 0`. Every row is SDPA's (a query
that sees no key gives 0, as SDPA's does). See "padded batches" below.
`attention_forward` then runs fagen with the module's causal flag, scale, dropout and window. Every
other case (a mask tensor, a head dim, dtype or device fagen has no kernel for, keyword arguments that
change the maths) goes to transformers' own SDPA path, with one warning per reason and process -- except
calls with an argument SDPA would drop without a word (soft-capping, sinks, sparse indices): those go to the
model's own eager attention function where it takes the argument, and raise where none does rather than answer
wrongly. Models whose attention is their own code (Bloom, ...) get every mask written out: no kernel of fagen's
would apply a mask left to it.
"""
from __future__ import annotations

import sys
import warnings

try:
    import torch
    from transformers import AttentionInterface
except ModuleNotFoundError as err:   # the extra is not installed: say which one, not just the module
    raise ModuleNotFoundError("fagen.integrations.transformers needs PyTorch and transformers: pip install "
                              "'fagen[transformers]'", name=err.name) from None
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, eager_mask, sdpa_mask
from transformers.utils.import_utils import is_tracing

import fagen.torch as fagen_torch
from fagen.spec import MIN_DROPOUT

NAME = "fagen"
#: Device types fagen's kernels run on; tensors elsewhere take the SDPA path.
DEVICE_TYPES = ("cuda",)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
HEAD_DIMS = frozenset(range(1, 257))   # the spec's head_dim: any from 1 to 256
#: Keyword arguments transformers passes along that do not change the attention maths.
NEUTRAL_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "past_key_values", "position_embeddings",
                            "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch",
                            "layer_idx", "max_length_q", "max_length_k", "logits_to_keep"})
_NOT_GIVEN = object()
#: Calls with (query heads / KV heads) x Nq up to this many rows run the decode kernel (its plan's Br).
DECODE_ROWS = 16
#: Keyword arguments that change the maths and that the models' eager attention functions apply, where their
#: signatures do not always name them (gpt-oss reads `s_aux`); transformers' SDPA path drops them without a word.
SDPA_DROPS = ("softcap", "s_aux")
#: The keyword arguments that change the maths which transformers' SDPA path does apply (or, for
#: output_attentions, says it does not). A fallback with any other goes to the model's eager attention function
#: where that takes it (SDPA_DROPS, or a parameter of that name: Inkling's `sinks`), else raises (MiniMax-M3's
#: `block_indices`, whose sparse mask the model builds only for its own implementations).
SDPA_HONOURS = frozenset({"position_bias", "output_attentions"})

_warned: set[str] = set()


def register() -> None:
    """Make "fagen" a valid `attn_implementation`. Calling it again changes nothing."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, fagen_mask)


def fallback_reasons() -> frozenset:
    """Why calls went to SDPA since the process started (or since `reset_fallbacks()`): one line each."""
    return frozenset(_warned)


def reset_fallbacks() -> None:
    """Forget the reasons seen so far, so that each warns again once."""
    _warned.clear()


# ---- the attention function ------------------------------------------------------------------
def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=_NOT_GIVEN, **kwargs):
    """transformers' attention-function contract: query (B, H, Nq, d), key and value (B, H_kv, Nk, d);
    returns (attn_output (B, Nq, H, d), None)."""
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = _window(module, sliding_window) if is_causal else None
    if torch.is_autocast_enabled(query.device.type):
        # SDPA runs in the autocast dtype; fagen's op is not on autocast's lists, so cast as SDPA would.
        low = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(low), key.to(low), value.to(low)
    documents = attention_mask if _is_documents(attention_mask) else None
    ends = attention_mask.reshape(-1).to(query.device) if _is_cache_ends(attention_mask) else None
    padded = _padded_kind(attention_mask)   # a padded batch: "runs", "static runs" or "keys" (see fagen_mask)
    sinks = _sinks(kwargs.get("s_aux"), query)
    ours = documents is not None or ends is not None or padded is not None
    reason = _unsupported(query, key, value, None if ours else attention_mask,
                          dropout, kwargs if sinks is None else {name: v for name, v in kwargs.items() if name != "s_aux"})
    if ends is not None and reason is None and (not is_causal or window is not None):
        reason = "a static cache's mask on a layer that is not plain causal"
    if padded is not None and reason is None:
        reason = _padded_unsupported(padded, attention_mask, query, key, is_causal, window)
    if reason is not None and documents is not None:   # SDPA needs the boolean mask the ids stand for
        attention_mask = documents_mask(documents, window if is_causal else None, is_causal)
    if reason is not None and ends is not None:   # ... or the row ends
        attention_mask = cache_mask(ends, query.shape[2], key.shape[2])
    if reason is not None and padded is not None:   # ... or the padding (built once per mask, not once per layer)
        attention_mask = padded_sdpa_mask(padded, attention_mask, query.shape[2], key.shape[2],
                                          window if is_causal else None, is_causal)
    cap = _softcap(kwargs.get("softcap"))
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, window,
                         kwargs)

    head_dim, seq_q, seq_k = query.shape[3], query.shape[2], key.shape[2]
    # Grouped KV heads go to the kernels as they are: query head h reads KV head h // (H / H_kv), which
    # is repeat_kv's order, and the backward sums each group's dK, dV.

    # The spec travels as a JSON string built from plain Python values, so that torch.compile folds it
    # into a constant; fagen resolves and caches the kernel per distinct string.
    if not is_causal:
        mask = '"none"'
    elif ends is not None:   # a static cache: one query (decoding) sees the keys before its row's end, as padding does
        mask = '"padding"' if seq_q == 1 else '"none"'
    elif padded == "static runs":   # a static cache's causal pattern is in the mask_mod (its rows' ends)
        mask = '"none"'
    elif window is not None and window < seq_k:
        mask = f'"sliding_window", "window": {int(window)}'
    else:
        mask = '"causal"'  # a window covering every key is plain causal: the same answer, one kernel fewer
    extra = "" if scaling is None else f', "softmax_scale": {float(scaling)!r}'
    seed = 0
    if dropout:
        extra += f', "dropout": {float(dropout)!r}'
        # Drawn on the GPU by torch's CUDA generator and read by the kernels when they run: a CUDA graph
        # (torch.compile "reduce-overhead") replays a new draw each step, and no host read-back breaks a
        # torch.compile graph. torch.manual_seed reproduces a run, and activation checkpointing, which
        # restores the CUDA generator before recomputing, regenerates the same mask.
        seed = fagen_torch.dropout_seed(query.device)
    inputs = None
    if cap is not None:   # soft-capping: a score_mod with the cap written in (one spec per model)
        extra += f', "score_mod": "{cap!r} * tanh(score / {cap!r})"'
    if documents is not None:   # packed sequences: a key is visible only within its query's sequence
        extra += f', "mask_mod": "{DOCUMENT_MASK}", "inputs": {{"doc": "int32"}}'
        inputs = {"doc": documents}
    elif ends is not None and seq_q > 1:   # a static cache's rows past its first: causal from each row's end
        extra += f', "mask_mod": "{CACHE_MASK}", "inputs": {{"end": "int32"}}'
        inputs = {"end": ends}
    elif padded is not None:   # a padded batch: each row's keys, ANDed with the layer's causal or window mask
        name, text = ("keys", KEYS_MASK) if padded == "keys" else ("rows", RUNS_MASK if padded == "runs"
                                                                   else STATIC_RUNS_MASK)
        extra += f', "mask_mod": "{text}", "inputs": {{"{name}": "int32"}}'
        # (B, 2 or 3) or (B, Nk): a view (on the query's device where a model is split over several)
        inputs = {name: attention_mask.view(attention_mask.shape[0], -1).to(query.device)}
    elif cap is None and seq_q * (query.shape[1] // key.shape[1]) <= DECODE_ROWS:
        # (the decode kernel takes no score_mod: soft-capped decoding runs the forward kernel)
        # generation's steps (one new token against the cache): the spec that also builds the split-KV
        # decode kernel, which the runtime takes for calls this small; prefill keeps the plain spec
        extra += ', "passes": ["forward", "backward", "decode"]'
    kv_lengths = ends if ends is not None and seq_q == 1 else None   # (the padding mask's row ends)
    if value.shape[3] != head_dim:   # DeepSeek's MLA: v and o narrower than q and k
        extra += f', "value_head_dim": {value.shape[3]}'
    spec = f'{{"head_dim": {head_dim}, "dtype": "{DTYPES[query.dtype]}", "mask": {mask}{extra}}}'
    if sinks is None:
        out = fagen_torch.attention(query, key, value, spec, seed=seed, offset=0, inputs=inputs, kv_lengths=kv_lengths)
    else:   # the sink's share of the denominator, exp(sink) / (exp(lse) + exp(sink)), taken off each row (in fp32)
        out, lse = fagen_torch.attention(query, key, value, spec, seed=seed, offset=0, inputs=inputs,
                                         kv_lengths=kv_lengths, return_lse=True)
        out = (out.float() * torch.sigmoid(lse - sinks.float()[None, :, None]).unsqueeze(-1)).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _sinks(value, query):
    """gpt-oss's sink logits (`s_aux`): a float tensor of one value per query head on the query's device, or None
    (then `s_aux`, where given, is a keyword argument fagen does not implement)."""
    if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == (query.shape[1],)
            and value.device == query.device):
        return value
    return None


#: What fagen_mask last left to the kernels: {"window": the pattern's window, None for plain causal}; empty where
#: it wrote the mask out. (A model that passes no window to its attention builds one mask type for every layer,
#: so the last one is the one; a module global, not per thread, so that activation checkpointing's recompute on
#: autograd's thread reads what the forward did.)
_left_to_kernels: dict = {}


def _window(module, sliding_window):
    """The layer's sliding window, or None. Most models pass it per layer (None on full-attention
    layers); a few keep it on the module; models with layer_types name the layer's kind there. The rest build one
    mask for every layer from the config, causal or sliding (PhiMoE's create_sliding_window_causal_mask where its
    config has a window): the pattern fagen_mask left to the kernels says which. A config's sliding_window alone
    does not: Moshi's and Kyutai's configs carry one (3000, 375) that their causal masks do not apply."""
    if sliding_window is not _NOT_GIVEN:
        return sliding_window
    window = getattr(module, "sliding_window", _NOT_GIVEN)
    if window is not _NOT_GIVEN:
        return window
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if layer_types is not None and layer is not None and 0 <= layer < len(layer_types):
        return window if layer_types[layer] == "sliding_attention" else None
    # (no mask function ran: a direct call with no mask, as before, the config's window)
    return _left_to_kernels.get("window", window)


def _softcap(value):
    """Gemma-2-style logit soft-capping, cap * tanh(score / cap), as a positive float, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
        return float(value)
    return None


def _unsupported(query, key, value, attention_mask, dropout, kwargs):
    """Why fagen cannot compute this call exactly, or None when it can."""
    if attention_mask is not None:
        return ("an explicit attention mask (a 4-D mask given to the model, a pattern fagen has no kernel for, or "
                "padding it does not take: while tracing, in a static cache other than one run of valid keys per row, "
                "on a pattern other than causal or the window)")
    changing = [name for name in _changing(kwargs) if not (name == "softcap" and _softcap(kwargs[name]) is not None)]
    if changing:
        return f"keyword arguments fagen does not implement: {', '.join(sorted(changing))}"
    if query.device.type not in DEVICE_TYPES:
        return f"tensors on {query.device.type} (fagen's kernels run on {', '.join(DEVICE_TYPES)})"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return (f"dtypes q {query.dtype}, k {key.dtype}, v {value.dtype} "
                f"(fagen needs one of {', '.join(str(d) for d in DTYPES)} for all three)")
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if head_dim not in HEAD_DIMS or key.shape[-1] != head_dim or value_dim not in HEAD_DIMS:
        return f"head dims q {head_dim}, k {key.shape[-1]}, v {value_dim} (fagen: q's and k's d from 1 to 256)"
    if value_dim != head_dim and (head_dim % 8 or value_dim % 8 or query.dtype == torch.float32):
        return (f"head dims q {head_dim}, v {value_dim} in {query.dtype} (fagen: a value head dim unlike the query's "
                "takes multiples of 8 in fp16 / bf16)")
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} KV heads (not a multiple)"
    if not (dropout == 0.0 or MIN_DROPOUT <= dropout < 1.0):
        return f"dropout {dropout} (fagen: 0 or a probability in [2**-16, 1))"
    return None


def _changing(kwargs) -> list:
    """The keyword arguments of a call that change the attention's maths (given, and not NEUTRAL_KWARGS)."""
    return [name for name, value in kwargs.items() if name not in NEUTRAL_KWARGS and value is not None
            and value is not False]


_eager_parameters: dict = {}


def _parameters(function) -> frozenset:
    names = _eager_parameters.get(function)
    if names is None:
        import inspect

        names = _eager_parameters[function] = frozenset(inspect.signature(function).parameters)
    return names


def _fallback(reason, module, query, key, value, attention_mask, dropout, scaling, is_causal, window, kwargs):
    """transformers' SDPA path, or the model's eager attention where SDPA would drop one of SDPA_DROPS; warned
    about once per reason.

    A None mask can mean more here than SDPA assumes: fagen_mask() also skips sliding-window masks
    and causal masks with Nq < Nk (bottom-right aligned), which SDPA's is_causal cannot express. Those
    get their mask written out (and every causal one for the eager function, which has no is_causal)."""
    seq_q, seq_k = query.shape[2], key.shape[2]
    dropped = [name for name in _changing(kwargs) if name not in SDPA_HONOURS]
    if dropped:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None or not all(name in SDPA_DROPS or name in _parameters(eager) for name in dropped):
            raise ValueError(f"fagen attention cannot run this call ({reason}), and transformers' SDPA would drop "
                             f"{', '.join(dropped)}; {type(module).__name__}'s module has no eager_attention_forward "
                             "taking it to fall back on: use attn_implementation=\"eager\"")
        _warn_once(f"{reason} (with {', '.join(dropped)}, which SDPA drops)", "the model's eager attention")
        if attention_mask is None and is_causal:
            attention_mask = bottom_right_mask(seq_q, seq_k, window, query.device)
        if attention_mask is not None and attention_mask.dtype == torch.bool:   # eager adds its mask to the scores
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _warn_once(reason)
    if attention_mask is None and is_causal and ((window is not None and window < seq_k)
                                                 or 1 < seq_q != seq_k):
        attention_mask = bottom_right_mask(seq_q, seq_k, window, query.device)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _warn(reason: str, instead: str = "transformers' SDPA") -> bool:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fagen attention: using {instead} instead: {reason}", stacklevel=4)
    return True


# torch.compile runs this while tracing (once per graph) and keeps it out of the graph, which a
# warnings.warn call would otherwise break.
_warn_once = fagen_torch.compile_constant(_warn)


def bottom_right_mask(seq_q: int, seq_k: int, window, device) -> torch.Tensor:
    """(1, 1, Nq, Nk) booleans, True where fagen's causal (window None) or sliding_window mask lets query i
    see key j: 0 <= i + (Nk - Nq) - j (< window)."""
    distance = (torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
                - torch.arange(seq_k, device=device)[None, :])
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    return visible[None, None]


# ---- the mask function -----------------------------------------------------------------------
def fagen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                   attention_mask=None, local_size=None, allow_is_causal_skip=True, config=None, **kwargs):
    """AttentionMaskInterface's contract (sdpa_mask's arguments): None when fagen's kernel mask is exact,
    else SDPA's boolean mask (B, 1, Nq, Nk).

    transformers passes allow_is_causal_skip=True only for its plain patterns (causal, sliding window,
    chunked) without overlays, packing or block ids; `_is_kernel_pattern` tells which one this is. Chunked
    attention and packed sequences return (B, N) int32 ids instead (chunks, sequences) for the documents mask_mod;
    a padded batch on one of those plain patterns the padding of its keys (int32: see "padded batches"), unless its
    device or dtype is one fagen's kernels do not take (then SDPA's mask, written out once here). The 2-D padding
    mask is read back to the host once per call (_key_padding). SDPA's own skips are turned off: one of them (an
    empty static cache's prefill) relies on is_causal aligning at the top left, and fagen aligns at the bottom
    right."""
    if not _takes_skipped_masks(config):   # (the model's own attention code adds the eager mask to its scores)
        return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                          local_size=local_size, config=config, **kwargs)
    _left_to_kernels.clear()
    bottom_right = _bottom_right(q_length, kv_length, q_offset, kv_offset)
    kernel_pattern = bottom_right and allow_is_causal_skip and _is_kernel_pattern(mask_function, local_size, config)
    # The padding mask is read back to the host once per call, where transformers' SDPA path reads it too: in full
    # where a padded batch may run on the kernels, else only whether any key is padding (for fagen's own mask, or the
    # chunks' ids), or not at all where the mask is written out whatever it holds (transformers' SDPA reads none then)
    padding = _UNKNOWN
    if bottom_right and attention_mask is None:
        padding = None
    elif kernel_pattern and _kernels_may_run(kwargs):
        padding = _key_padding(attention_mask, kv_offset, kv_length)
        if padding is not _UNKNOWN and _all_valid(padding[2], kv_length):
            padding = None
    elif kernel_pattern or (bottom_right and local_size is not None
                            and local_size == getattr(config, "attention_chunk_size", None)):
        padding = None if _no_padding(attention_mask, kv_offset, kv_length) else _UNKNOWN
    if bottom_right and padding is None:
        if kernel_pattern:
            _left_to_kernels["window"] = local_size
            return None
        chunks = _chunk_ids(mask_function, local_size, config, q_length, kv_length, q_offset, kv_offset, batch_size)
        if chunks is not None:
            _left_to_kernels["window"] = None
            return chunks if chunks.numel() else None
        packed = _packed_sequences(mask_function, kv_length)
        # (transformers clears allow_is_causal_skip for every packed mask, overlays or not: the pattern's structure
        # has to be transformers' own causal or sliding-window function, which a probe of a few points cannot tell
        # from one with an image block or another overlay OR-ed or AND-ed in)
        if packed is not None and _is_kernel_pattern(packed[0], local_size, config, exact=True):
            _left_to_kernels["window"] = local_size
            return packed[1]
    elif padding is not _UNKNOWN:
        # a padded batch (training, a prefill, a chunk or a step after a cache) on the layer's causal or window mask,
        # on a device and dtype the kernels take: the keys' padding, for the mask_mod
        valid, stats, host, _ = padding
        _left_to_kernels["window"] = local_size
        return _runs_tensor(stats) if _is_runs(host) else _keys_tensor(valid)
    # (allow_is_causal_skip=False: transformers' own, for a compileable cache's one-token steps (q_offset a tensor),
    # is what the row ends stand for; a model that asks for its masks written out in its own code reads them itself)
    written = not allow_is_causal_skip and (
        _forces_written_masks(config) or not (q_length == 1 and isinstance(q_offset, torch.Tensor)))
    # (a static cache's keys run past the queries: never bottom-right aligned; a bottom-right call's padding is above)
    ends = None if written or bottom_right else _cache_ends(mask_function, local_size, q_length, kv_length, q_offset,
                                                            kv_offset, attention_mask, batch_size, kwargs.get("device"))
    if ends is not None:
        _left_to_kernels["window"] = None
        return ends
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, config=config, **kwargs)


_model_checks: dict[str, bool] = {}


def _takes_skipped_masks(config) -> bool:
    """Whether the model of this config can be given no mask (or sequence ids) for fagen's kernels to apply: its
    attention goes through AttentionInterface, and its modules' is_causal is what transformers' SDPA path relies on.
    Not so for models whose attention is their own code (Bloom, XGLM, TrOCR, MVP, GPT-NeoX-Japanese: a skipped
    causal mask would leave them attending to the future) or that support neither SDPA nor the attention backend
    (BigBirdPegasus: its decoder's self-attention modules say is_causal=False). Those get every mask written out,
    and fagen's attention, where it is called at all, falls back with it."""
    return _config_module_takes_skipped_masks(type(config).__module__, type(config).__name__)


def _config_module_takes_skipped_masks(config_module: str, config_name: str) -> bool:
    # (read once per config class from the model's module, as transformers reads it in
    # PreTrainedModel._can_set_attn_implementation; a config whose modeling module cannot be found, remote code,
    # is taken as before: masks skipped)
    taken = _model_checks.get(config_module)
    if taken is None:
        taken = _model_checks[config_module] = _model_module_takes_skipped_masks(config_module)
    if not taken:
        _warn(f"{config_name}'s model cannot be left a mask for fagen's kernels to apply (its attention is its own "
              "code, or supports neither SDPA nor the attention backend): its masks are written out",
              "the model's own attention or the fallback")
    return taken


# (torch.compile runs it while tracing, once per graph: it reads source files and warns)
_config_module_takes_skipped_masks = fagen_torch.compile_constant(_config_module_takes_skipped_masks)


def _forces_written_masks(config) -> bool:
    """Whether the model's code asks transformers for masks written out (allow_is_causal_skip=False: Doge, indexed
    attention layers, ...), which it then reads itself. A config whose modeling module cannot be read: yes."""
    return _config_module_forces_written_masks(type(config).__module__)


def _config_module_forces_written_masks(config_module: str) -> bool:
    forced = _forced_checks.get(config_module)
    if forced is None:
        source = _modeling_source(_modeling_module(config_module))
        forced = _forced_checks[config_module] = source is None or asks_for_written_masks(source)
    return forced


_forced_checks: dict[str, bool] = {}


def asks_for_written_masks(source: str) -> bool:
    """Whether model code passes allow_is_causal_skip=False, as a keyword or in a dict of mask arguments."""
    import re

    return re.search(r"""allow_is_causal_skip["']?\s*[=:]\s*False""", source) is not None


# (torch.compile runs it while tracing, once per graph: it reads source files)
_config_module_forces_written_masks = fagen_torch.compile_constant(_config_module_forces_written_masks)


def _modeling_module(config_module: str):
    """The modeling module beside a configuration module, as loaded with the model; None where it is not loaded."""
    return sys.modules.get(config_module.replace(".configuration_", ".modeling_"))


def _modeling_source(module):
    """A modeling module's source; None where there is no module or its source cannot be read (remote code)."""
    import inspect

    try:
        return None if module is None else inspect.getsource(module)
    except (OSError, TypeError):
        return None


def _model_module_takes_skipped_masks(config_module: str) -> bool:
    import re

    from transformers import PreTrainedModel

    module = _modeling_module(config_module)
    code = _modeling_source(module)
    if code is None:
        return True
    if re.search(r"^class \w*Attention\w*\(nn\.Module\):", code, re.MULTILINE) and \
            "ALL_ATTENTION_FUNCTIONS.get_interface(" not in code:
        return False
    models = [value for value in vars(module).values()
              if isinstance(value, type) and issubclass(value, PreTrainedModel) and value.__module__ == module.__name__]
    return not models or any(getattr(model, "_supports_sdpa", False) or getattr(model, "_supports_attention_backend",
                                                                                  False) for model in models)


#: The mask_mod of packed sequences (fagen_mask's ids are its input `doc`).
DOCUMENT_MASK = "doc[b, i] == doc[b, j]"


def _is_documents(mask) -> bool:
    """fagen_mask's packed-sequence ids ((B, N) int32), as opposed to an SDPA mask (4-D, bool or float)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.int32


def documents_mask(documents: torch.Tensor, window, causal: bool) -> torch.Tensor:
    """SDPA's boolean (B, 1, N, N) mask for packed sequence ids (for calls that fall back to SDPA)."""
    same = documents[:, None, :, None] == documents[:, None, None, :]
    n = documents.shape[-1]
    return same & bottom_right_mask(n, n, window, documents.device) if causal else same


def _packed_sequences(mask_function, kv_length: int):
    """(the pattern, the (B, N) int32 sequence ids) when mask_function is exactly transformers'
    and_masks(pattern, packed_sequence_mask_function(ids)), else None. Read from the closures, in eager
    mode only (while tracing, the SDPA mask is built as before)."""
    if is_tracing() or getattr(mask_function, "__name__", None) != "and_mask" or not mask_function.__closure__:
        return None
    functions = _closure(mask_function).get("mask_functions")
    if not isinstance(functions, tuple) or len(functions) != 2:
        return None
    pattern, packed = functions
    if getattr(packed, "__qualname__", None) != "packed_sequence_mask_function.<locals>.inner_mask":
        return None
    if getattr(pattern, "__qualname__", None) == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        # (transformers >= 5.2x) the pattern evaluated at each token's position inside its sequence. Where the
        # AND above lets a pair through, both tokens are in one sequence, whose positions go up by exactly 1
        # (transformers starts a new sequence wherever they do not): the distance i - j is the same either way,
        # so the causal or window pattern underneath is what the kernels' bottom-right mask gives.
        pattern = _closure(pattern).get("mask_function")
        if not callable(pattern):
            return None
    ids = _closure(packed).get("packed_sequence_mask")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] != kv_length:
        return None
    return pattern, ids.to(torch.int32)


def _chunk_ids(mask_function, local_size, config, q_length, kv_length, q_offset, kv_offset, batch_size):
    """Llama 4's chunked attention, when mask_function is exactly transformers' chunked_causal_mask_function for
    the config's attention_chunk_size, over a whole sequence (no cache before it, no padding: checked by the
    caller): the (B, N) int32 ids of each position's chunk, position // chunk, which the documents mask_mod
    (causal, and within one chunk) turns into that mask. An empty tensor where one chunk covers every key (plain
    causal). None otherwise (a chunk after a cache, decoding: the mask is written out). Read from the closures, in
    eager mode only, as _packed_sequences."""
    chunk = getattr(config, "attention_chunk_size", None)
    if is_tracing() or chunk is None or local_size != chunk:
        return None
    fields = _causal_overlay(mask_function, "chunked_overlay")
    if fields is None or fields.get("chunk_size") != chunk or not isinstance(fields.get("left_padding"), torch.Tensor):
        return None
    left_padding = fields["left_padding"]
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor) or q_offset or kv_offset \
            or q_length != kv_length:
        return None
    # (transformers derives left_padding from the padding mask the caller found free of padding, so it is 0; one
    # chunk covering every key is then plain causal. The ids below still count each row's chunks from its
    # left_padding, as chunked_overlay does, which costs nothing: no read back to the host)
    if kv_length <= chunk:
        return torch.empty(0, dtype=torch.int32)
    positions = torch.arange(kv_length, device=left_padding.device)[None, :] - left_padding.reshape(-1, 1)
    return (positions // chunk).to(torch.int32).expand(batch_size, kv_length).contiguous()


def _cache_ends(mask_function, local_size, q_length, kv_length, q_offset, kv_offset, padding_mask, batch_size,
                device):
    """A static cache's causal mask (keys 0 .. max_cache_len - 1, the queries at q_offset .. q_offset + Nq - 1, the
    cache past the last query still empty) as the (B, 1, 1, 1) int32 end of each row's keys, q_offset + Nq: query i sees
    key j when j < end - Nq + i + 1 (causal, aligned at the top left of the cache). None where this is not that
    mask: another pattern (a window, chunks, overlays), keys from an offset, or padding among the filled keys.
    q_offset may be a tensor on the GPU (a compiled decoding step): nothing is read back then."""
    if mask_function is not causal_mask_function or local_size is not None:
        return None
    if isinstance(kv_offset, torch.Tensor) or kv_offset != 0 or q_length > kv_length:
        return None
    if padding_mask is not None:
        # (read back to the host once, q_offset with it: with every filled key valid, the row ends below; with each
        # row's valid keys one run, that run and the row's end, the static cache's padded batch)
        if isinstance(q_offset, torch.Tensor) and q_offset.numel() != 1:
            return None
        padding = _key_padding(padding_mask, 0, kv_length, q_offset + q_length)
        if padding is _UNKNOWN:
            return None
        _, stats, host, end = padding
        if end > kv_length:
            return None
        if not all(count == end for count in host[0]):   # padding among the filled keys
            return _runs_tensor(stats, end) if _is_runs(host) and _kernels_may_run({"device": padding_mask.device}) \
                else None
        device = padding_mask.device
    if isinstance(q_offset, torch.Tensor):
        if q_offset.numel() != 1:
            return None
        device = q_offset.device
        ends = (q_offset.reshape(1) + q_length).to(torch.int32)
    else:
        if q_offset + q_length > kv_length:
            return None
        ends = torch.tensor([q_offset + q_length], dtype=torch.int32, device=device)
    # (4-D, as transformers' prepared masks are: generate() makes a static cache's masks ahead and passes them to the
    # model as its attention_mask, which transformers hands on unchanged only when it is 4-D)
    return ends.expand(batch_size).reshape(batch_size, 1, 1, 1).contiguous()


def _is_cache_ends(mask) -> bool:
    """fagen_mask's static-cache row ends ((B, 1, 1, 1) int32: transformers' masks are bool or float), as opposed
    to sequence ids or an SDPA mask."""
    return (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1:] == (1, 1, 1)
            and mask.dtype == torch.int32)


def cache_mask(ends: torch.Tensor, seq_q: int, seq_k: int) -> torch.Tensor:
    """SDPA's boolean (B, 1, Nq, Nk) mask for static-cache row ends (for calls that fall back to SDPA)."""
    keys = torch.arange(seq_k, device=ends.device)
    last = ends[:, None] - seq_q + torch.arange(seq_q, device=ends.device)[None, :]   # each query's own position
    return (keys[None, None, :] <= last[:, :, None])[:, None]


#: The mask_mod of a static cache's rows (fagen_mask's row ends are its input `end`).
CACHE_MASK = "j <= i + end[b] - Nq"


# ---- padded batches --------------------------------------------------------------------------
# A batch whose 2-D attention_mask pads (left-padded generation, right-padded training batches) runs on fagen's
# kernels: fagen_mask hands the attention function the padding of the keys as one of three int32 tensors, 4-D as
# transformers' prepared masks are (generate() makes a static cache's masks ahead and passes them to the model as its
# attention_mask, which transformers hands on unchanged only when it is 4-D), told apart by their shapes from the
# static cache's row ends (B, 1, 1, 1) and from transformers' own masks (bool or float):
#   (B, 1, 2, 1)   "runs": each row's valid keys are one run [lo, hi) (left padding, right padding, both; a row
#                  wholly padded has lo = hi = 0): the mask_mod RUNS_MASK, ANDed with the layer's causal or window
#                  mask. Its input is read per batch row, so the tiles' tests are arithmetic: tiles wholly among
#                  padding are skipped, and no run-time summary is made.
#   (B, 1, 3, 1)   "static runs": the same in a static cache, with each row's end (q_offset + Nq) as CACHE_MASK's:
#                  STATIC_RUNS_MASK, with mask none.
#   (B, 1, 1, Nk)  "keys" (Nk >= 2): the keys' padding itself (1 valid, 0 padding), for any other pattern (the gap
#                  right-padded generation leaves between each prompt and the tokens after it): KEYS_MASK, whose
#                  input is read at key positions (a run-time summary per call, as the documents mask_mod's).
# Every row gets SDPA's answer, the padding rows too: a query that sees no key gives 0 (as SDPA does), a query past a
# right-padded row's end sees that row's keys.
RUNS_MASK = "rows[b, 0] <= j < rows[b, 1]"
STATIC_RUNS_MASK = "rows[b, 0] <= j < rows[b, 1] and j <= i + rows[b, 2] - Nq"
KEYS_MASK = "keys[b, j] != 0"


def _padded_kind(mask):
    """Which of fagen_mask's padded-batch tensors `mask` is ("runs", "static runs", "keys"), or None."""
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype == torch.int32 and mask.shape[1] == 1):
        return None
    if mask.shape[3] == 1 and mask.shape[2] in (2, 3):
        return "runs" if mask.shape[2] == 2 else "static runs"
    if mask.shape[2] == 1 and mask.shape[3] >= 2:
        return "keys"
    return None


def _padded_unsupported(kind, mask, query, key, is_causal, window):
    """Why a padded batch's tensor does not fit this call (None: it does)."""
    if mask.shape[0] != query.shape[0]:
        return f"a padding mask of {mask.shape[0]} rows for a batch of {query.shape[0]}"
    if kind == "keys" and mask.shape[3] != key.shape[2]:
        return f"a padding mask of {mask.shape[3]} keys for {key.shape[2]}"
    if kind == "static runs" and (not is_causal or window is not None):
        return "a static cache's mask on a layer that is not plain causal"
    return None


def padded_sdpa_mask(kind, mask, seq_q: int, seq_k: int, window, causal: bool) -> torch.Tensor:
    """SDPA's boolean (B, 1, Nq, Nk) mask for one of fagen_mask's padded-batch tensors, for a call that falls back:
    the mask transformers' sdpa_mask builds for the same padding and pattern. Built once per mask tensor and shape
    (every layer gets the same tensor from fagen_mask: the later ones take the first one's), and dropped with it."""
    key = (kind, mask._version, seq_q, seq_k, window, causal)
    compiling = torch.compiler.is_compiling()
    cached = None if compiling else getattr(mask, "_fagen_sdpa_mask", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = mask.view(mask.shape[0], -1)
    if kind == "keys":
        visible = (rows != 0)[:, None, None, :]
    else:
        keys = torch.arange(seq_k, device=mask.device)
        visible = ((keys >= rows[:, 0:1]) & (keys < rows[:, 1:2]))[:, None, None, :]
    if kind == "static runs":
        visible = visible & cache_mask(rows[:, 2], seq_q, seq_k)
    elif causal:
        visible = visible & bottom_right_mask(seq_q, seq_k, window, mask.device)
    else:
        visible = visible.expand(-1, -1, seq_q, -1)
    if not compiling:
        mask._fagen_sdpa_mask = (key, visible)
    return visible


_positions_cache: dict = {}


def _positions(length: int, device) -> torch.Tensor:
    """1 .. length as int64 on `device` (made once per length and device: a mask function runs once per forward)."""
    positions = _positions_cache.get((length, device))
    if positions is None:
        if len(_positions_cache) > 64:
            _positions_cache.clear()
        positions = _positions_cache[(length, device)] = torch.arange(1, length + 1, device=device)
    return positions


def _key_padding(padding_mask, kv_offset: int, kv_length: int, end=None):
    """The padding of keys kv_offset .. kv_offset + kv_length - 1 (keys past the 2-D mask's end are padding, as
    transformers' prepare_padding_mask pads it; with `end`, an int or a one-element integer tensor, so are the keys
    from `end` on: a static cache's, not yet filled), read back to the host once.

    None where there is no mask, _UNKNOWN while tracing (its contents are unknown then), else (valid, stats, host,
    end): valid the (B, Nk) booleans, stats (3, B) int64 on the device (each row's count of valid keys, its last valid
    key + 1, the sum of its valid keys' positions + 1: count, hi, total), host their values as three lists, and `end`
    as an int (a tensor is read in the same transfer).

    One transfer per mask function call, where transformers' SDPA path reads `padding_mask.all()` back at the same
    point (_ignore_causal_mask_sdpa): the choice between no mask (fagen's own kernel mask, the decode kernel for
    one-token steps) and a mask_mod cannot be made on the GPU. A row's valid keys are one run [hi - count, hi) exactly
    when total = count (2 hi - count + 1) / 2, the largest sum count distinct positions up to hi can have, so the same
    numbers say which of RUNS_MASK and KEYS_MASK applies."""
    if padding_mask is None:
        return None
    if is_tracing(padding_mask) or (isinstance(end, torch.Tensor) and is_tracing(end)):
        return _UNKNOWN
    valid = padding_mask[:, kv_offset:kv_offset + kv_length]
    if valid.shape[-1] < kv_length:
        valid = torch.nn.functional.pad(valid, (0, kv_length - valid.shape[-1]))
    positions = _positions(kv_length, valid.device)
    if end is not None:   # (position p is key p - 1: the keys before `end` are those with p <= end)
        valid = valid & (positions <= (end.reshape(1).to(valid.device) if isinstance(end, torch.Tensor) else end))
    weighted = valid * positions
    stats = torch.stack((valid.sum(-1), weighted.amax(-1), weighted.sum(-1)))
    read = stats.flatten()
    if isinstance(end, torch.Tensor):
        read = torch.cat((read, end.reshape(1).to(read.device, read.dtype)))
    values = read.tolist()
    batch = stats.shape[1]
    host = (values[:batch], values[batch:2 * batch], values[2 * batch:3 * batch])
    return valid, stats, host, (values[-1] if isinstance(end, torch.Tensor) else end)


_UNKNOWN = object()


def _all_valid(host, kv_length: int) -> bool:
    """Whether no key is padding, from _key_padding's host values."""
    return all(c == kv_length for c in host[0])


def _is_runs(host) -> bool:
    """Whether every row's valid keys are one run (or none), from _key_padding's host values."""
    count, hi, total = host
    return all(2 * t == c * (2 * h - c + 1) for c, h, t in zip(count, hi, total))


def _runs_tensor(stats, end=None) -> torch.Tensor:
    """(B, 1, 2, 1) int32 [lo, hi) per row from _key_padding's stats, or (B, 1, 3, 1) [lo, hi, end] with a static
    cache's row end (an int). Made on the GPU: nothing more is read back."""
    count, hi = stats[0], stats[1]
    columns = (hi - count, hi) if end is None else (hi - count, hi, torch.full_like(hi, end))
    rows = torch.stack(columns, dim=-1).to(torch.int32)
    return rows.reshape(rows.shape[0], 1, rows.shape[1], 1)


def _keys_tensor(valid) -> torch.Tensor:
    """(B, 1, 1, Nk) int32: the keys' padding itself, 1 for a valid key."""
    keys = valid.to(torch.int32).contiguous()
    return keys.reshape(keys.shape[0], 1, 1, keys.shape[1])


def _closure(function) -> dict:
    """A nested function's free variables by name (what transformers' mask-function factories captured)."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__ or ())))


def _bottom_right(q_length, kv_length, q_offset, kv_offset) -> bool:
    # A static cache's offsets are tensors (and its keys run past the last query): no skip there.
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        return False
    return q_length <= kv_length and q_offset + q_length == kv_offset + kv_length


def _no_padding(padding_mask, kv_offset, kv_length) -> bool:
    """Whether no key of kv_offset .. kv_offset + kv_length - 1 is padding (one value read back to the host)."""
    if padding_mask is None:
        return True
    if is_tracing(padding_mask):  # its contents are unknown while tracing
        return False
    end = kv_offset + kv_length
    return padding_mask.shape[-1] >= end and bool(padding_mask[:, kv_offset:end].all())


def _kernels_may_run(kwargs) -> bool:
    """Whether a mask function call's device and dtype (transformers passes the inputs' as keywords) are ones fagen's
    kernels take: a padded batch's mask is left to them only then, and is written out as SDPA's where they certainly
    fall back (so that the fallback takes the mask once per forward, as SDPA does, not once per layer)."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    if device is not None and torch.device(device).type not in DEVICE_TYPES:
        return False
    return dtype is None or dtype in DTYPES


def _is_kernel_pattern(mask_function, local_size, config, exact: bool = False) -> bool:
    """Whether mask_function is the plain causal pattern (local_size None) or the model's sliding window. With
    `exact`, a sliding window must be transformers' own sliding_window_causal_mask_function, read from its
    structure; without, transformers vouches for a plain pattern (allow_is_causal_skip) and a few probes confirm
    which one it is."""
    if local_size is None:
        return mask_function is causal_mask_function
    # Sliding windows and chunked attention both come with a local_size; only the model's sliding
    # window is fagen's mask. While tracing, the config has the last word; in eager mode a few probes
    # of the function confirm it.
    if local_size != getattr(config, "sliding_window", None) or local_size == getattr(config, "attention_chunk_size",
                                                                                      None):
        return False
    if exact:
        return _is_sliding_window_function(mask_function, local_size)
    return is_tracing() or _probe_sliding_window(mask_function, local_size)


def _is_sliding_window_function(mask_function, window: int) -> bool:
    """Whether mask_function is and_masks(sliding_window_overlay(window), causal_mask_function), which is what
    transformers' sliding_window_causal_mask_function(window) returns (4.5x to 5.2x)."""
    fields = _causal_overlay(mask_function, "sliding_window_overlay")
    return fields is not None and fields.get("sliding_window") == window


def _causal_overlay(mask_function, factory: str):
    """The captured variables of the overlay when mask_function is exactly and_masks(factory(...),
    causal_mask_function), the form of transformers' sliding-window and chunked mask functions; else None."""
    if getattr(mask_function, "__name__", None) != "and_mask" or not mask_function.__closure__:
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", None) != f"{factory}.<locals>.inner_mask":
        return None
    return _closure(overlay)


def _probe_sliding_window(mask_function, window: int) -> bool:
    """True when mask_function agrees with "0 <= q - kv < window" at the far ends of two windows (one
    starting at key 0, one at key 1: a chunk of `window` keys holds at most one of the two), just past
    one, and one step into the future."""
    queries = torch.tensor([window - 1, window, window, 0])
    keys = torch.tensor([0, 1, 0, 1])
    zero = torch.zeros((), dtype=torch.long)
    try:
        seen = mask_function(zero, zero, queries, keys)
        return seen.tolist() == [True, True, False, False]
    except Exception:  # a pattern that cannot be probed this way is not one we skip
        return False
