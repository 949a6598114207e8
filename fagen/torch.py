"""PyTorch adapter: `fagen.attention(q, k, v, spec, **runtime_args)` with autograd, as custom ops.

Ops are registered through `torch.library`, with fake (meta) implementations:

    fagen::attention_forward(q, k, v, spec, kv_lengths?, block_mask?, seed, offset, seed_tensor?, cu_seqlens_q?,
                             cu_seqlens_k?, max_seqlen_q, max_seqlen_k, mod_tensor0-3?, mod_scalar0-3) -> (o, lse)
    fagen::attention_backward(q, k, v, o, lse, grad_o, grad_lse?, spec, (the same run-time arguments)) -> (dq, dk, dv)
    fagen::attention_backward_input_grads(the same) -> (dq, dk, dv, the gradients of score_mod's tensor inputs)

and, for dtype fp8_e4m3 specs (a forward only: o in bf16),

    fagen::attention_forward_fp8(q, k, v, spec, q_descale?, k_descale?, v_descale?, (the run-time arguments))

A call with no run-time argument takes two ops of their own, with the same kernels and only the arguments before the
run-time ones (torch.compile's generated code passes every argument of a schema, which costs host time per call):

    fagen::attention_forward_plain(q, k, v, spec) -> (o, lse)
    fagen::attention_backward_plain(q, k, v, o, lse, grad_o, grad_lse?, spec) -> (dq, dk, dv)

A forward op's autograd is its own Autograd kernel (`_autograd_kernel`): with grad, a node whose backward calls one
of the backward ops; without, on plain CUDA tensors, the CUDA kernel called directly (no second dispatch).

(seed_tensor: a dropout seed on the GPU that replaces `seed`; cu_seqlens and max_seqlen: specs with
layout packed, a max_seqlen of -1 means "not given"; mod_*: a spec's mask_mod / score_mod inputs.)

`spec` is a string (JSON of spec fields) so that the ops have a schema torch.compile understands;
a string is resolved to a compiled kernel once per process and device. So `torch.compile(model,
fullgraph=True)` traces through fagen attention, and CUDA graphs (`torch.cuda.graph`, mode
"reduce-overhead") capture its launches: they go to PyTorch's current stream, allocate through
PyTorch and never synchronise.

The forward saves q, k, v, o and the LSE (no N x N tensor); the backward regenerates P and the
dropout mask from them (FlashAttention-1 Algorithm 4). The LSE is differentiable too: a loss that reads it
(partial attentions merged by their LSE, a sink logit added to the softmax's denominator) gets its gradient,
d_lse_i * P_ij added to each score's (Kernel.backward's `d_lse`).

In eager mode, `fagen.attention` skips the dispatcher round trip and calls the same kernels through
an `autograd.Function` (fewer microseconds per call; the maths and the kernels are the same).
"""
from __future__ import annotations

import json
import math
from typing import Optional

try:
    import torch
except ModuleNotFoundError as err:   # the extra is not installed: say which one, not just the module
    raise ModuleNotFoundError("fagen.attention and fagen's torch ops need PyTorch: pip install 'fagen[torch]'",
                              name=err.name) from None

from fagen import jit, pad_rows, runtime
from fagen.runtime.device import empty_in_layout
from fagen.spec import Spec, SpecError, spec_from_dict

SEED_LIMIT = 2**63   # the ops' int arguments are int64


# ---- spec strings -> kernels -----------------------------------------------------------------
_spec_keys: dict[int, tuple[Spec, str]] = {}
_dict_keys: dict[str, str] = {}
_kernels: dict[tuple[str, int], "runtime.Kernel"] = {}


def spec_key(spec) -> str:
    """The string a spec travels as through the ops: its canonical JSON (computed once per object)."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, runtime.Kernel):
        spec = spec.spec
    if not isinstance(spec, Spec):   # a dict of fields: by its content (a fresh Spec per call would fill the id cache)
        text = json.dumps(spec, sort_keys=True, default=repr)
        key = _dict_keys.get(text)
        if key is None:
            key = _dict_keys[text] = spec_from_dict(spec).canonical_json()
        return key
    entry = _spec_keys.get(id(spec))
    if entry is None or entry[0] is not spec:
        entry = _spec_keys[id(spec)] = (spec, spec.canonical_json())
    return entry[1]


def compile_constant(fn):
    """`torch.compiler.assume_constant_result(fn)` without its cost: that function imports torch._dynamo
    (about a second, more than all the rest of importing fagen) only to set the mark below, which dynamo
    reads when it traces a call of fn. A process that never compiles never needs dynamo. (transformers
    marks its compile-time constants the same way.)"""
    fn._dynamo_marked_constant = True
    return fn


# Under torch.compile a Spec object is a constant of the traced code: dynamo cannot trace pydantic's
# serialiser, so the key is computed outside the trace and folded in as a constant. Registering Spec
# (frozen: hashable, compared by value) as a pytree constant lets dynamo treat the object itself as one.
_constant_spec_key = compile_constant(spec_key)


def _key_of(spec) -> str:
    """The key of a spec as attention() takes it, a constant of the traced code under torch.compile."""
    return spec if isinstance(spec, str) else _constant_spec_key(spec)


try:
    torch.utils._pytree.register_constant(Spec)
except (AttributeError, ValueError):   # older torch, or registered already (a module reload)
    pass


# Head dims that are not multiples of 8 (fp16 / bf16): the rows of q, k, v are then not whole 16-byte copies,
# which the kernels load 4 bytes or 2 bytes at a time (1.3-6x slower than the next multiple of 16, docs/benchmarks-journal.md
# "Head dims that are not multiples of 16"). Through torch, the tensors are padded with zero columns to the next
# multiple of 8 instead (one copy of q, k, v per call, as FlashAttention-2's own interface does), computed
# under the same spec at that head dim with the spec's softmax scale, and o is returned as the view of its
# first d columns; autograd takes the gradients back through the padding. Zero columns add nothing to any
# product, and dropout and the expressions do not depend on d, so the result is the unpadded spec's.
_padded_keys: dict[str, tuple[str, int, int]] = {}


def padded_spec_key(key: str) -> tuple[str, int, int]:
    """(the spec key to compute with, its head dim, the spec's head dim) for a spec key; (key, 0, 0) where no
    padding is needed."""
    entry = _padded_keys.get(key)
    if entry is None:
        try:
            spec = spec_from_dict(json.loads(key), where="fagen.attention spec")
        except ValueError:   # not JSON, or not a spec: kernel_for reports it
            return key, 0, 0
        # only where the solver puts the spec on tensor cores (fp16 / bf16, the fa2 loop order, the auto tile
        # policy, no shared-memory budget, not deterministic: the CUDA-core templates take any d as it is and
        # gain nothing), and not for a spec with a decode pass, whose small calls stream K/V once: a padded
        # copy of the cache would triple what they read
        on_tensor_cores = (spec.dtype in ("fp16", "bf16") and spec.loop_order == "fa2" and spec.tile_policy == "auto"
                           and not spec.sram_budget and not spec.deterministic)
        if spec.head_dim % 8 == 0 or not on_tensor_cores or "decode" in spec.passes:
            entry = (key, 0, 0)
        else:
            padded = spec_from_dict({**spec.to_dict(), "head_dim": -(-spec.head_dim // 8) * 8,
                                     "softmax_scale": spec.scale}, where="fagen.attention spec")
            entry = (padded.canonical_json(), padded.head_dim, spec.head_dim)
        _padded_keys[key] = entry
    return entry


_constant_padded_spec_key = compile_constant(padded_spec_key)


def kernel_for(key: str, device: int) -> "runtime.Kernel":
    kernel = _kernels.get((key, device))
    if kernel is None:
        try:
            fields = json.loads(key)
        except ValueError as err:
            raise SpecError(f"fagen.attention: spec string is not JSON of spec fields ({err}): {key[:200]!r}") from None
        kernel = _kernels[(key, device)] = jit.compile(spec_from_dict(fields, where="fagen.attention spec"),
                                                           device=device)
    return kernel


def _grad(tensor):
    # Gradients arriving through views (e.g. a transpose) keep a contiguous last dim; that is all the
    # kernels need, so no copy unless that dim is strided.
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _grads_of_outputs(o, grad_o, grad_lse):
    """(dO, d_lse) as the backward kernels take them from autograd's (grad_o, grad_lse), either of which is None
    where that output did not reach the loss: dO zeros where only lse did; d_lse dense fp32 (an expanded
    gradient, e.g. of lse.sum(), is materialized) or None."""
    grad_o = torch.zeros_like(o) if grad_o is None else _grad(grad_o)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    return grad_o, grad_lse


# ---- the ops ---------------------------------------------------------------------------------
_library = torch.library.Library("fagen", "DEF")
MOD_SLOTS = 4   # AttentionArgs holds up to 4 tensor and 4 scalar inputs
_RUNTIME_SCHEMA = ("Tensor? kv_lengths=None, Tensor? block_mask=None, int seed=0, int offset=0, "
                   # a dropout seed on the GPU (one int64), read by the kernels when they run: replaces `seed`
                   "Tensor? seed_tensor=None, "
                   "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, int max_seqlen_q=-1, int max_seqlen_k=-1, "
                   # mask_mod / score_mod inputs in the spec's declaration order (no list arguments: torch's
                   # autograd rules for lists in custom ops are brittle); MOD_SLOTS of each
                   + ", ".join(f"Tensor? mod_tensor{n}=None" for n in range(MOD_SLOTS)) + ", "
                   + ", ".join(f"float mod_scalar{n}=0.0" for n in range(MOD_SLOTS)))
_library.define(f"attention_forward(Tensor q, Tensor k, Tensor v, str spec, {_RUNTIME_SCHEMA}) -> (Tensor, Tensor)")
_library.define(f"attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor grad_o, Tensor? grad_lse, "
                f"str spec, {_RUNTIME_SCHEMA}) -> (Tensor, Tensor, Tensor)")
# the same, with the gradients of score_mod's tensor inputs: one per mod_tensor slot (float32, the input's
# shape; an empty tensor for a slot without a derivative): taken when one of those inputs requires grad
_library.define(f"attention_backward_input_grads(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor grad_o, "
                f"Tensor? grad_lse, str spec, {_RUNTIME_SCHEMA}) -> (Tensor, Tensor, Tensor, "
                + ", ".join("Tensor" for _ in range(MOD_SLOTS)) + ")")
# The same two passes for a call with no run-time argument (the common one: a model's causal attention), as
# their own ops: torch.compile's generated code calls an op with every argument of its schema, the defaults as
# keywords, and the dispatcher parses each one on every call (`python dev/plain_ops_cost.py`: 9 µs of a compiled
# forward's host time on the dev machine's CPU, 43 -> 34 µs, and 14-25 µs of a compiled forward + backward)
_library.define("attention_forward_plain(Tensor q, Tensor k, Tensor v, str spec) -> (Tensor, Tensor)")
# An fp8 (e4m3) forward: q, k, v's descale factors (float32, one element or (batch, kv_heads); None: 1) before the
# run-time arguments; o is bf16. No backward (refused by its Autograd kernel when an input requires grad).
_library.define(f"attention_forward_fp8(Tensor q, Tensor k, Tensor v, str spec, Tensor? q_descale=None, "
                f"Tensor? k_descale=None, Tensor? v_descale=None, {_RUNTIME_SCHEMA}) -> (Tensor, Tensor)")
_library.define("attention_backward_plain(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor grad_o, "
                "Tensor? grad_lse, str spec) -> (Tensor, Tensor, Tensor)")


def _runtime_kwargs(kernel, kv_lengths, block_mask, seed, offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, mods=()):
    """The ops' run-time arguments as Kernel.forward / backward keywords (packed ones only when given);
    `mods`: the ops' mod_tensor0.. and mod_scalar0.. arguments."""
    kwargs = {"kv_lengths": kv_lengths, "block_mask": block_mask, "seed": seed, "offset": offset}
    modifiers = kernel.modifiers
    if modifiers.tensors or modifiers.scalars:   # the slots in the spec's declaration order -> the inputs dict
        mods = tuple(mods) + (None,) * (MOD_SLOTS - len(mods)) + (0.0,) * (2 * MOD_SLOTS - max(len(mods), MOD_SLOTS))
        kwargs["inputs"] = {**{name: tensor for (name, _, _), tensor in zip(modifiers.tensors, mods[:MOD_SLOTS])},
                            **dict(zip(modifiers.scalars, mods[MOD_SLOTS:]))}
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        kwargs.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=None if max_seqlen_q < 0 else max_seqlen_q,
                      max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k)
    return kwargs


def _forward_cuda(q, k, v, spec, kv_lengths=None, block_mask=None, seed=0, offset=0, seed_tensor=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    # The dispatcher drops trailing arguments equal to their defaults before it calls Python, so the schema's
    # defaults are repeated here; a call with none of them (the common one) goes straight to the kernel. Not for
    # a spec that declares inputs: scalar inputs equal to 0.0 are dropped too, and _runtime_kwargs restores them.
    kernel = kernel_for(spec, q.get_device())
    if kv_lengths is None and block_mask is None and seed == 0 and offset == 0 and seed_tensor is None \
            and cu_seqlens_q is None and cu_seqlens_k is None and not mods \
            and not (kernel.modifiers.tensors or kernel.modifiers.scalars):
        return kernel.forward(q, k, v)
    seed = seed if seed_tensor is None else seed_tensor
    return kernel.forward(q, k, v, **_runtime_kwargs(kernel, kv_lengths, block_mask, seed, offset, cu_seqlens_q,
                                                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, mods))


def _backward_cuda(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0, offset=0,
                   seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    kernel = kernel_for(spec, q.get_device())
    seed = seed if seed_tensor is None else seed_tensor
    return kernel.backward(q, k, v, o, lse, grad_o, d_lse=grad_lse,
                           **_runtime_kwargs(kernel, kv_lengths, block_mask, seed, offset, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, mods))


def _backward_input_grads_cuda(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0,
                               offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1,
                               max_seqlen_k=-1, *mods):
    kernel = kernel_for(spec, q.get_device())
    seed = seed if seed_tensor is None else seed_tensor
    dq, dk, dv, grads = kernel.backward(q, k, v, o, lse, grad_o, input_grads=True, d_lse=grad_lse,
                                        **_runtime_kwargs(kernel, kv_lengths, block_mask, seed, offset, cu_seqlens_q,
                                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, mods))
    slots = [grads.get(name) for name, _, _ in kernel.modifiers.tensors]
    slots += [None] * (MOD_SLOTS - len(slots))
    return (dq, dk, dv, *(q.new_empty(0, dtype=torch.float32) if g is None else g for g in slots))


def _fp8_forward_cuda(q, k, v, spec, q_descale=None, k_descale=None, v_descale=None, kv_lengths=None,
                      block_mask=None, seed=0, offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    kernel = kernel_for(spec, q.get_device())
    seed = seed if seed_tensor is None else seed_tensor
    return kernel.forward(q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                          **_runtime_kwargs(kernel, kv_lengths, block_mask, seed, offset, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, mods))


def _plain_forward_cuda(q, k, v, spec):
    return kernel_for(spec, q.get_device()).forward(q, k, v)


def _plain_backward_cuda(q, k, v, o, lse, grad_o, grad_lse, spec):
    return kernel_for(spec, q.get_device()).backward(q, k, v, o, lse, grad_o, d_lse=grad_lse)


_library.impl("attention_forward", _forward_cuda, "CUDA")
_library.impl("attention_backward", _backward_cuda, "CUDA")
_library.impl("attention_backward_input_grads", _backward_input_grads_cuda, "CUDA")
_library.impl("attention_forward_plain", _plain_forward_cuda, "CUDA")
_library.impl("attention_forward_fp8", _fp8_forward_cuda, "CUDA")
_library.impl("attention_backward_plain", _plain_backward_cuda, "CUDA")


@torch.library.register_fake("fagen::attention_forward")
def _forward_fake(q, k, v, spec, kv_lengths=None, block_mask=None, seed=0, offset=0, seed_tensor=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    # Allocated as the kernels' path allocates them (fagen/runtime/device.py `_allocate`): o keeps q's layout;
    # packed: o (total_q, heads, d_v) contiguous, lse (heads, total_q). o has v's head dim (a value_head_dim).
    o_shape = (*q.shape[:-1], v.shape[-1])
    if cu_seqlens_q is not None:
        return q.new_empty(o_shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    o = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else empty_in_layout(q, o_shape)
    return o, q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("fagen::attention_backward")
def _backward_fake(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0, offset=0,
                   seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    if cu_seqlens_q is not None:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


torch.library.register_fake("fagen::attention_forward_plain")(_forward_fake)
torch.library.register_fake("fagen::attention_backward_plain")(_backward_fake)


@torch.library.register_fake("fagen::attention_forward_fp8")
def _fp8_forward_fake(q, k, v, spec, q_descale=None, k_descale=None, v_descale=None, kv_lengths=None,
                      block_mask=None, seed=0, offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      max_seqlen_q=-1, max_seqlen_k=-1, *mods):
    # o in bf16, laid out as q (the kernels' path: fagen/runtime/device.py `_allocate`)
    o = empty_in_layout(q, (*q.shape[:-1], v.shape[-1]), torch.bfloat16)
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:3]
    return o, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("fagen::attention_backward_input_grads")
def _backward_input_grads_fake(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0,
                               offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1,
                               max_seqlen_k=-1, *mods):
    dq, dk, dv = _backward_fake(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths, block_mask, seed, offset, seed_tensor,
                                cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *mods)
    derived = _input_names(spec)[3]
    tensor_names = _input_names(spec)[0]
    slots = [mods[n] if n < len(tensor_names) and tensor_names[n] in derived and n < len(mods) else None
             for n in range(MOD_SLOTS)]
    return (dq, dk, dv, *(q.new_empty(0, dtype=torch.float32) if t is None
                          else q.new_empty(t.shape, dtype=torch.float32) for t in slots))


def _setup_context(ctx, inputs, output):
    q, k, v, spec, kv_lengths, block_mask, seed, offset, seed_tensor, cu_seqlens_q, cu_seqlens_k, max_q, max_k, *mods = inputs
    o, lse = output
    mod_tensors = list(mods[:MOD_SLOTS])
    ctx.save_for_backward(q, k, v, o, lse, kv_lengths, block_mask, seed_tensor, cu_seqlens_q, cu_seqlens_k, *mod_tensors)
    ctx.spec, ctx.seed, ctx.offset, ctx.max_seqlens = spec, seed, offset, (max_q, max_k)
    ctx.mod_scalars, ctx.input_count = list(mods[MOD_SLOTS:]), len(inputs)
    ctx.set_materialize_grads(False)   # (an output that did not reach the loss: None, not a zero tensor)


def _backward_rule(ctx, grad_o, grad_lse):
    q, k, v, o, lse, kv_lengths, block_mask, seed_tensor, cu_seqlens_q, cu_seqlens_k, *mod_tensors = ctx.saved_tensors
    if grad_o is None and grad_lse is None:
        return (None,) * ctx.input_count
    grad_o, grad_lse = _grads_of_outputs(o, grad_o, grad_lse)
    arguments = (q, k, v, o, lse, grad_o, grad_lse, ctx.spec, kv_lengths, block_mask, ctx.seed, ctx.offset, seed_tensor,
                 cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, *mod_tensors, *ctx.mod_scalars)
    # mod_tensor n is the op's input MOD_TENSOR_INPUT + n; only score_mod's inputs with a derivative can want one
    needs = ctx.needs_input_grad
    wanted = [n for n in range(MOD_SLOTS) if MOD_TENSOR_INPUT + n < len(needs) and needs[MOD_TENSOR_INPUT + n]]
    if not wanted:
        dq, dk, dv = torch.ops.fagen.attention_backward(*arguments)
        return (dq, dk, dv) + (None,) * (ctx.input_count - 3)
    dq, dk, dv, *mod_grads = torch.ops.fagen.attention_backward_input_grads(*arguments)
    grads = [None] * (ctx.input_count - 3)
    for n in wanted:
        grads[MOD_TENSOR_INPUT + n - 3] = mod_grads[n].to(mod_tensors[n].dtype)
    return (dq, dk, dv, *grads)


MOD_TENSOR_INPUT = 13   # attention_forward's argument index of mod_tensor0 (after q, k, v, spec and 9 run-time ones)
# attention_forward's run-time arguments' defaults, in schema order (the dispatcher drops trailing ones)
_FORWARD_DEFAULTS = (None, None, 0, 0, None, None, None, -1, -1) + (None,) * MOD_SLOTS + (0.0,) * MOD_SLOTS


_CUDA_KEY = torch._C.DispatchKey.CUDA


def _below_autograd(op, keyset, inputs):
    """A forward op's outputs from the kernels below autograd (a dispatch mode, fake tensors, CUDA)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *inputs)


class _ForwardOp(torch.autograd.Function):
    """attention_forward's autograd node: the op below autograd, then _setup_context / _backward_rule.
    (What torch.library.register_autograd builds from the same two functions, less its per-call work.)"""

    @staticmethod
    def forward(ctx, *inputs_then_keyset):
        *inputs, keyset = inputs_then_keyset
        output = _below_autograd(torch.ops.fagen.attention_forward.default, keyset, inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        return (*_backward_rule(ctx, grad_o, grad_lse), None)


class _PlainForwardOp(torch.autograd.Function):
    """attention_forward_plain's autograd node: its backward is attention_backward_plain."""

    @staticmethod
    def forward(ctx, q, k, v, spec, keyset):
        o, lse = _below_autograd(torch.ops.fagen.attention_forward_plain.default, keyset, (q, k, v, spec))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.spec = spec
        ctx.set_materialize_grads(False)   # (an output that did not reach the loss: None, not a zero tensor)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        if grad_o is None and grad_lse is None:
            return (None,) * 5
        q, k, v, o, lse = ctx.saved_tensors
        grad_o, grad_lse = _grads_of_outputs(o, grad_o, grad_lse)
        return (*torch.ops.fagen.attention_backward_plain(q, k, v, o, lse, grad_o, grad_lse, ctx.spec), None, None)


def _autograd_kernel(op, node, cuda):
    """A forward op's Autograd kernel (issue 10: host time): with an input requiring grad, `node(keyset, inputs)`,
    the op's autograd node. With none -- a compiled graph's forward, inference -- and nothing between autograd
    and the CUDA kernel (plain CUDA tensors: no dispatch mode, fake or functional tensor), it calls `cuda`, the
    op's CUDA kernel, itself instead of redispatching, which would box the arguments and cross into Python a
    second time."""
    def kernel(keyset, *inputs):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*inputs):
            return node(keyset, inputs)
        if (keyset & torch._C._after_ADInplaceOrView_keyset).highestPriorityTypeId() == _CUDA_KEY:
            return cuda(*inputs)
        return _below_autograd(op, keyset, inputs)
    return kernel


_library.impl("attention_forward", _autograd_kernel(
    torch.ops.fagen.attention_forward.default,
    lambda keyset, inputs: _ForwardOp.apply(*inputs, *_FORWARD_DEFAULTS[len(inputs) - 4:], keyset),
    _forward_cuda), "Autograd", with_keyset=True)
_library.impl("attention_forward_plain", _autograd_kernel(
    torch.ops.fagen.attention_forward_plain.default, lambda keyset, inputs: _PlainForwardOp.apply(*inputs, keyset),
    _plain_forward_cuda), "Autograd", with_keyset=True)


def _no_fp8_backward(keyset, inputs):
    raise runtime.ArgumentError("fp8 attention has no backward yet: q, k, v and the inputs must not require grad")


_library.impl("attention_forward_fp8", _autograd_kernel(
    torch.ops.fagen.attention_forward_fp8.default, _no_fp8_backward, _fp8_forward_cuda), "Autograd",
    with_keyset=True)


def _mod_slots(key: str, inputs: Optional[dict]) -> list:
    """A mask_mod / score_mod's inputs dict as the ops' mod_tensor0.., mod_scalar0.. arguments, in the
    spec's declaration order (the ops' schema has no dict type)."""
    tensor_names, scalar_names, _, _ = _input_names(key)
    names = list(tensor_names + scalar_names)
    if not inputs:
        # (the op cannot tell a missing scalar from 0.0, which the dispatcher drops like a default)
        if names:
            raise runtime.ArgumentError(f"inputs: the spec declares {names}, got none")
        return []
    if set(inputs) != set(names):
        raise runtime.ArgumentError(f"inputs: the spec declares {names}, got {sorted(inputs)}")
    tensors = [_as_tensor_or_none(inputs[name], f"inputs {name}") for name in tensor_names]
    scalars = [float(inputs[name]) for name in scalar_names]
    return tensors + [None] * (MOD_SLOTS - len(tensors)) + scalars + [0.0] * (MOD_SLOTS - len(scalars))


_declared: dict = {}


def _declared_inputs(key: str) -> tuple[tuple, tuple, tuple, tuple]:
    """(tensor input names, scalar input names, the float inputs score_mod depends on, those of them the
    kernels give gradients) of the spec with this key, the first two in declaration order. An input is in
    the third and not the fourth where it is a scalar (the ops take scalars as floats) or one of its reads
    has no derivative sympy can render (Modifiers.input_grads_not_derived)."""
    names = _declared.get(key)
    if names is None:
        mods = spec_from_dict(json.loads(key), where="fagen.attention spec").modifiers
        differentiable = tuple(dict.fromkeys(name for name, _, _ in mods.input_grads + mods.input_grads_not_derived))
        blocked = {name for name, _, _ in mods.input_grads_not_derived}
        derived = tuple(name for name in dict.fromkeys(name for name, _, _ in mods.kernel_input_grads)
                        if name not in blocked)
        names = _declared[key] = (tuple(name for name, _, _ in mods.tensors), tuple(mods.scalars), differentiable,
                                  derived)
    return names


# (a constant of the traced code under torch.compile, like the spec key: dynamo cannot trace the parser)
_input_names = compile_constant(_declared_inputs)


# ---- eager fast path -------------------------------------------------------------------------
_RUNTIME_TENSOR_ARGUMENTS = ("seed", "kv_lengths", "block_mask", "cu_seqlens_q", "cu_seqlens_k")


def _runtime_tensor_places(kwargs: dict) -> tuple:
    """Where the torch tensors among a call's run-time keywords sit: a keyword's name, or ("inputs", name) for a
    mask_mod / score_mod input."""
    places = tuple(name for name in _RUNTIME_TENSOR_ARGUMENTS if isinstance(kwargs.get(name), torch.Tensor))
    inputs = kwargs.get("inputs")
    if inputs:
        places += tuple(("inputs", name) for name, value in inputs.items() if isinstance(value, torch.Tensor))
    return places


def _place_value(kwargs: dict, place):
    return kwargs["inputs"][place[1]] if isinstance(place, tuple) else kwargs[place]


def _with_places(kwargs: dict, places: tuple, tensors: list) -> dict:
    """`kwargs` with the tensors at `places` replaced by `tensors` (as autograd unpacked them: checked against
    in-place changes since the forward)."""
    if not places:
        return kwargs
    kwargs = dict(kwargs)
    for place, tensor in zip(places, tensors):
        if isinstance(place, tuple):
            kwargs["inputs"] = {**kwargs["inputs"], place[1]: tensor}
        else:
            kwargs[place] = tensor
    return kwargs


class _EagerAttention(torch.autograd.Function):
    """The same kernels as the ops, without the dispatcher round trip (eager calls only)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, runtime_kwargs, grad_input_names=(), *grad_inputs):
        # grad_inputs: score_mod's tensor inputs that require grad (also in runtime_kwargs["inputs"]), passed
        # as arguments so that autograd routes their gradients
        o, lse, ctx.forward_key = kernel.forward_keyed(q, k, v, **runtime_kwargs)
        ctx.kernel, ctx.runtime_kwargs, ctx.grad_input_names = kernel, runtime_kwargs, grad_input_names
        ctx.grad_input_dtypes = [t.dtype for t in grad_inputs]
        # the run-time tensors (a seed, kv_lengths, block_mask, cu_seqlens, mask_mod / score_mod inputs) are saved
        # like q, k, v, so that changing one in place before the backward is torch's "modified by an inplace
        # operation" error, not a backward of other offsets or another mask (the ops save them too)
        places = ctx.runtime_tensors = _runtime_tensor_places(runtime_kwargs)
        ctx.save_for_backward(q, k, v, o, lse, *(_place_value(runtime_kwargs, place) for place in places))
        if places:   # (held once, by autograd: saved-tensor hooks, e.g. offloading, then see them all)
            ctx.runtime_kwargs = _with_places(runtime_kwargs, places, [None] * len(places))
        # an output that did not reach the loss (lse, as a rule) gets None, not a zero tensor made (and filled on
        # the GPU) at every backward
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        if grad_o is None and grad_lse is None:
            return (None,) * (6 + len(ctx.grad_input_dtypes))
        q, k, v, o, lse, *runtime_tensors = ctx.saved_tensors
        kwargs = _with_places(ctx.runtime_kwargs, ctx.runtime_tensors, runtime_tensors)
        grad_o, d_lse = _grads_of_outputs(o, grad_o, grad_lse)
        if not ctx.grad_input_names:
            if ctx.forward_key is not None:   # (the cheap route on autograd's thread: see Kernel.backward_after)
                dq, dk, dv = ctx.kernel.backward_after(ctx.forward_key, q, k, v, o, lse, grad_o, d_lse=d_lse, **kwargs)
            else:
                dq, dk, dv = ctx.kernel.backward(q, k, v, o, lse, grad_o, d_lse=d_lse, **kwargs)
            return dq, dk, dv, None, None, None
        dq, dk, dv, grads = ctx.kernel.backward(q, k, v, o, lse, grad_o, input_grads=True, d_lse=d_lse, **kwargs)
        return (dq, dk, dv, None, None, None,
                *(grads[name].to(dtype) for name, dtype in zip(ctx.grad_input_names, ctx.grad_input_dtypes)))


class _PaddedRows(torch.autograd.Function):
    """q, k, v with zero columns up to the plan's width (fagen/pad_rows.py); their gradients are the first
    `head_dim` columns of the padded tensors' (views: nothing is copied)."""

    @staticmethod
    def forward(ctx, head_dim, plan, *tensors):
        ctx.head_dim = head_dim
        return tuple(plan.run(tensors))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(None if g is None else g[..., :ctx.head_dim] for g in grads))


class _FirstColumns(torch.autograd.Function):
    """The first `head_dim` columns of the padded output (a view); the backward pads dO with the same kernel,
    where slicing's own backward would fill a zero tensor and copy dO in element by element."""

    @staticmethod
    def forward(ctx, o, head_dim):
        ctx.padded_dim = o.shape[-1]
        return o[..., :head_dim]

    @staticmethod
    @torch.autograd.function.once_differentiable   # the padding kernel records no graph of its own
    def backward(ctx, grad):
        plan = pad_rows.plan_for((grad,), ctx.padded_dim)
        if plan is None:
            grad = grad.contiguous()   # e.g. the expanded (stride 0) gradient of a sum
            plan = pad_rows.plan_for((grad,), ctx.padded_dim)
        if plan is None:   # the kernel unavailable (warned): what slicing's own backward does
            return torch.nn.functional.pad(grad, (0, ctx.padded_dim - grad.shape[-1])), None
        return plan.run((grad,))[0], None


#: Eager calls take the autograd.Function above; False routes them through the ops as well.
EAGER_FAST_PATH = True
#: Calls through the ops with no run-time argument take the plain ops (attention_forward_plain): about 9 µs less
#: host time per compiled forward and 14-25 µs per compiled forward + backward on the dev machine's CPU, because
#: inductor passes the wide op's defaults as keywords. False sends every call through the wide ops (the tests run
#: both routes).
PLAIN_OPS = True


def _as_tensor_or_none(value, name: str):
    """A run-time argument as a torch tensor. Host values (lists, numpy arrays) are copied, so that the caller
    changing them before the backward cannot change what the backward reads (tensors are saved for it); a GPU
    array of another library is viewed in place, as a torch tensor is taken."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value) if hasattr(value, "__cuda_array_interface__") else torch.tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise runtime.ArgumentError(f"{name}: expected a tensor or a list of integers ({err})") from None


def _inputs_wanting_grads(key: str, inputs: dict) -> tuple:
    """The names of score_mod's tensor inputs that require grad (in declaration order), which the backward then
    computes gradients for. An input score_mod depends on that would get none -- a scalar given as a tensor
    that requires grad (the ops take scalars as floats), or a read sympy could not differentiate -- is an
    error rather than a learned parameter that silently stops learning. (An input only mask_mod reads, or
    whose derivative is 0, has a zero gradient: nothing is lost there.)"""
    tensor_names, _, differentiable, derived = _input_names(key)
    wanted = []
    for name in differentiable:
        value = inputs.get(name)
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        if name not in derived:
            why = ("it is a scalar input (data: declare it a float32 tensor of one element to learn it)"
                   if name not in tensor_names else "a read of it has no derivative fagen can render (under floor, "
                   "ceil or %); see the build record's input_grads_not_derived")
            raise runtime.ArgumentError(f"inputs: '{name}' requires grad, but {why}; pass {name}.detach() to use it "
                                        "as data")
        wanted.append(name)
    return tuple(name for name in tensor_names if name in wanted)


_DESCALES = ("q_descale", "k_descale", "v_descale")


def _descale_tensor(value, name: str, q):
    """An fp8 call's descale as the op takes it: None, a tensor (checked by the kernel), or a positive number as a
    float32 tensor of one element on q's device."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise runtime.ArgumentError(f"{name}: expected a positive finite number, got {value}")
        return torch.full((1,), float(value), dtype=torch.float32, device=q.device)
    raise runtime.ArgumentError(f"{name}: expected a number or a float32 CUDA tensor of one element or of shape "
                                f"(batch, kv_heads), got {type(value).__name__}")


def dropout_seed(device=None) -> torch.Tensor:
    """A fresh dropout seed drawn on the GPU by torch's CUDA generator, for `attention(..., seed=)`.

    The kernels read it when they run, so a CUDA graph (torch.cuda.graph, torch.compile's
    "reduce-overhead") that captured this draw makes a new one, and so a new mask, at every replay,
    where an int seed would be replayed as captured. torch.manual_seed reproduces the draws, and
    activation checkpointing, which restores the CUDA generator before recomputing, the masks."""
    return torch.randint(SEED_LIMIT - 1, (1,), dtype=torch.int64, device=device if device is not None else "cuda")


def attention(q, k, v, spec, *, kv_lengths=None, block_mask=None, seed=0, offset: int = 0,
              return_lse: bool = False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              inputs: Optional[dict] = None, q_descale=None, k_descale=None, v_descale=None):
    """Attention of q, k, v (batch, heads, seq, head_dim) under `spec`, differentiable in q, k and v.

    dtype fp8_e4m3 specs: q, k, v are torch.float8_e4m3fn, `q_descale`, `k_descale`, `v_descale` (a number, or a
    float32 CUDA tensor of one element or of shape (batch, kv_heads)) give their true values as e4m3 times
    descale, and o is bf16. The forward only (no gradient), eagerly or through torch.compile (the op
    fagen::attention_forward_fp8).

    `spec`: a fagen.Spec, a dict or JSON string of spec fields, or a compiled Kernel. Under
    torch.compile pass a JSON string (or a Spec made outside the compiled function).

    `inputs`: the run-time inputs a spec's mask_mod / score_mod declare, name -> tensor or number. A float
    tensor that score_mod reads and that requires grad gets its gradient (ALiBi slopes, a bias table: the
    backward adds dS' * d score_mod / d input, sympy's derivative, with float atomics); a scalar input is
    data (a tensor for it that requires grad is refused, as no gradient would reach it).

    A fp16 / bf16 head dim that is not a multiple of 8 is computed on copies of q, k, v padded with zero
    columns to the next multiple, and o is returned as a view of its first head_dim columns, where the spec
    runs on tensor cores and has no decode pass (see `padded_spec_key`); a compiled Kernel runs as it is.

    `seed` (dropout): an int in [0, 2**63), or a CUDA int64 tensor of one element that the kernels
    read when they run (`dropout_seed()` draws one; what CUDA graphs need). The backward regenerates
    the mask from the same tensor, so it must still hold the same value then.

    Specs with layout packed: q (total_q, heads, d), k and v (total_k, kv_heads, d), with
    cu_seqlens_q / cu_seqlens_k (int32, batch + 1 offsets) and, when those are CUDA tensors,
    max_seqlen_q / max_seqlen_k (the longest sequence). CUDA offsets are what CUDA graphs and
    torch.compile need; host ones (lists, CPU tensors) are checked and copied over each call."""
    if v is None:
        raise runtime.ArgumentError("v: fagen.attention takes q, k and v; a latent_kv spec's cache (v = k's first "
                                    "columns) is read by fagen.compile(spec).forward(q, k, None, ...)")
    grad_inputs = _inputs_wanting_grads(_key_of(spec), inputs) if inputs and torch.is_grad_enabled() else ()
    # a head dim that is not a multiple of 8 (what q's shape says; the spec decides, see padded_spec_key);
    # a compiled Kernel given as the spec is run as it is
    if q.shape[-1] % 8 and not isinstance(spec, runtime.Kernel):
        padded_key, padded_dim, head_dim = _constant_padded_spec_key(_key_of(spec))
    else:
        padded_dim = 0
    if padded_dim:   # zero columns up to the next multiple of 8
        if not q.shape[-1] == k.shape[-1] == v.shape[-1] == head_dim:
            raise runtime.ArgumentError(f"q, k, v: last dims {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}; the spec's "
                                        f"head_dim is {head_dim}")
        # eager: q, k, v padded by one launch of fagen's own kernel (templates/pad_rows.cu) and dO by another in
        # the backward; traced (torch.compile): F.pad, which the compiler fuses itself
        plan = (pad_rows.plan_for((q, k, v), padded_dim) if EAGER_FAST_PATH and not torch.compiler.is_compiling()
                and type(q) is type(k) is type(v) is torch.Tensor else None)
        differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if plan is None:
            q, k, v = (torch.nn.functional.pad(t, (0, padded_dim - head_dim)) for t in (q, k, v))
        elif differentiable:
            q, k, v = _PaddedRows.apply(head_dim, plan, q, k, v)
        else:   # nothing to differentiate: no autograd nodes (host time counts at launch-bound shapes)
            q, k, v = plan.run((q, k, v))
        out = attention(q, k, v, padded_key, kv_lengths=kv_lengths, block_mask=block_mask, seed=seed, offset=offset,
                        return_lse=return_lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, inputs=inputs)
        o = out[0] if return_lse else out
        o = _FirstColumns.apply(o, head_dim) if plan is not None and differentiable else o[..., :head_dim]
        return (o, out[1]) if return_lse else o
    descales = {name: value for name, value in zip(_DESCALES, (q_descale, k_descale, v_descale)) if value is not None}
    if descales and q.dtype != torch.float8_e4m3fn:
        raise runtime.ArgumentError(f"q_descale, k_descale, v_descale are for dtype fp8_e4m3 specs (q, k, v of "
                                    f"torch.float8_e4m3fn), not q of {q.dtype}")
    fp8 = len(descales) > 0 or q.dtype == torch.float8_e4m3fn   # (len: dynamo cannot take bool of a dict)
    if fp8:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or grad_inputs):
            raise runtime.ArgumentError("fp8 attention has no backward yet: q, k, v and the inputs must not require "
                                        "grad")
    seed_tensor = None
    if isinstance(seed, torch.Tensor):   # drawn on the GPU: see the docstring
        seed_tensor, seed = seed, 0
    elif not 0 <= seed < SEED_LIMIT:
        raise runtime.ArgumentError(f"seed must be in [0, 2**63) when called through torch, got {seed}")
    kv_lengths = _as_tensor_or_none(kv_lengths, "kv_lengths")
    block_mask = _as_tensor_or_none(block_mask, "block_mask")
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    if packed:
        cu_seqlens_q = _as_tensor_or_none(cu_seqlens_q, "cu_seqlens_q")
        cu_seqlens_k = _as_tensor_or_none(cu_seqlens_k, "cu_seqlens_k")
    if EAGER_FAST_PATH and type(q) is torch.Tensor and not torch.compiler.is_compiling():
        if not q.is_cuda:
            raise runtime.ArgumentError(f"q: tensor is on {q.device}; fagen kernels need CUDA tensors")
        kernel = spec if isinstance(spec, runtime.Kernel) else kernel_for(spec_key(spec), q.get_device())
        kwargs = {"kv_lengths": kv_lengths, "block_mask": block_mask, "offset": offset,
                  "seed": seed if seed_tensor is None else seed_tensor}
        if inputs:
            kwargs["inputs"] = dict(inputs)   # the backward sees this call's inputs even if the caller's dict changes
        kwargs.update(descales)   # (an fp8 forward's: checked above to need no autograd node)
        if packed:
            kwargs.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or grad_inputs):
            o, lse = _EagerAttention.apply(q, k, v, kernel, kwargs, grad_inputs,
                                           *(kwargs["inputs"][name] for name in grad_inputs))
        else:   # nothing to differentiate: no autograd node
            o, lse = kernel.forward(q, k, v, **kwargs)
    else:
        key = _key_of(spec)
        mod_slots = _mod_slots(key, inputs)   # ([] where the spec declares no inputs)
        if fp8:   # (its own op: the descales come before the run-time arguments; no backward)
            o, lse = torch.ops.fagen.attention_forward_fp8(
                q, k, v, key, *(_descale_tensor(descales.get(name), name, q) for name in _DESCALES),
                kv_lengths, block_mask, seed, offset, seed_tensor, cu_seqlens_q, cu_seqlens_k,
                -1 if max_seqlen_q is None else max_seqlen_q, -1 if max_seqlen_k is None else max_seqlen_k, *mod_slots)
        elif (PLAIN_OPS and kv_lengths is None and block_mask is None and seed == 0 and seed_tensor is None and offset == 0
                and not packed and not mod_slots):
            o, lse = torch.ops.fagen.attention_forward_plain(q, k, v, key)
        else:
            o, lse = torch.ops.fagen.attention_forward(q, k, v, key, kv_lengths, block_mask, seed, offset, seed_tensor,
                                                       cu_seqlens_q, cu_seqlens_k,
                                                       -1 if max_seqlen_q is None else max_seqlen_q,
                                                       -1 if max_seqlen_k is None else max_seqlen_k, *mod_slots)
    return (o, lse) if return_lse else o
