"""fagen's torch custom ops without a GPU: schema, fake (meta) shapes, autograd and torch.compile.

The CUDA kernels cannot run here, so this module registers a float64 CPU implementation of the two
ops (the test's own reference) and checks everything torch does around them: that
torch.compile(fullgraph=True) traces fagen.attention with a spec string or a Spec object, that the
op's autograd rule calls the backward op with what the forward saved, and that fake tensors get
the shapes the CUDA kernels return.
"""
import json

import numpy as np

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
import fagen.torch as fagen_torch  # noqa: E402
from fagen.spec import spec_from_dict  # noqa: E402

_registered = []


def _mod_inputs(parsed, slots) -> dict:
    mods = parsed.modifiers
    slots = list(slots) + [None] * (4 - len(slots)) + [0.0] * (8 - max(len(slots), 4))
    inputs = {name: tensor.numpy() for (name, _, _), tensor in zip(mods.tensors, slots[:4])}
    inputs.update(zip(mods.scalars, slots[4:]))
    return inputs


#: (pass, seed, seed_tensor) of each call of the CPU ops below, and the forward's specs
SEEDS_SEEN = []
KEYS_SEEN = []


def _reference_forward(q, k, v, spec, kv_lengths=None, block_mask=None, seed=0, offset=0, seed_tensor=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1, *mod_slots):
    SEEDS_SEEN.append(("forward", seed, seed_tensor))
    parsed = spec_from_dict(json.loads(spec))
    assert q.shape[-1] == parsed.head_dim, "the op is called with tensors of the spec's head dim"
    KEYS_SEEN.append(parsed)
    if parsed.modifiers.active:   # fagen/reference.py evaluates the expressions (numpy, float64)
        from fagen import reference

        o, lse = reference.attention_forward(*(t.detach().double().numpy() for t in (q, k, v)), parsed,
                                             inputs=_mod_inputs(parsed, mod_slots))
        return torch.from_numpy(o).to(q.dtype), torch.from_numpy(lse).float()
    s = (q.double() @ k.double().transpose(-1, -2)) * parsed.scale
    if parsed.mask == "causal":
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    return (torch.softmax(s, -1) @ v.double()).to(q.dtype), torch.logsumexp(s, -1).float()


def _reference_backward(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0, offset=0,
                        seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1, max_seqlen_k=-1,
                        *mod_slots):
    SEEDS_SEEN.append(("backward", seed, seed_tensor))
    parsed = spec_from_dict(json.loads(spec))
    if parsed.modifiers.active:
        from fagen import reference

        if grad_lse is not None and bool(grad_lse.any()):
            raise NotImplementedError("this test's reference backward with a mask_mod / score_mod has no lse gradient")

        grads = reference.attention_backward(*(t.detach().double().numpy() for t in (q, k, v, grad_o)), parsed,
                                             inputs=_mod_inputs(parsed, mod_slots))
        return tuple(torch.from_numpy(g).to(q.dtype) for g in grads)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse_out = _reference_forward(*leaves, spec)
        if grad_lse is None:
            return torch.autograd.grad(out, leaves, grad_o)
        return torch.autograd.grad((out, lse_out), leaves, (grad_o, grad_lse))


def _reference_backward_input_grads(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths=None, block_mask=None, seed=0,
                                    offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=-1,
                                    max_seqlen_k=-1, *mod_slots):
    """The input-gradient op in float64: dq, dk, dv and one gradient per mod_tensor slot (empty where the slot
    has no derivative), from fagen/reference.py's score_input_grads."""
    from fagen import reference

    SEEDS_SEEN.append(("backward_input_grads", seed, seed_tensor))
    parsed = spec_from_dict(json.loads(spec))
    dq, dk, dv = _reference_backward(q, k, v, o, lse, grad_o, grad_lse, spec, kv_lengths, block_mask, seed, offset, seed_tensor,
                                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *mod_slots)
    SEEDS_SEEN.pop()
    grads = reference.score_input_grads(*(t.detach().double().numpy() for t in (q, k, v, grad_o)), parsed,
                                        inputs=_mod_inputs(parsed, mod_slots))
    slots = [grads.get(name) for name, _, _ in parsed.modifiers.tensors]
    slots += [None] * (4 - len(slots))
    return (dq, dk, dv, *(q.new_empty(0, dtype=torch.float32) if g is None else torch.from_numpy(g).float()
                          for g in slots))


def _reference_fp8_forward(q, k, v, spec, q_descale=None, k_descale=None, v_descale=None, kv_lengths=None,
                           block_mask=None, seed=0, offset=0, seed_tensor=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=-1, max_seqlen_k=-1, *mod_slots):
    """The fp8 op in float64 on the values the e4m3 tensors stand for (each times its descale: one element or one
    per (batch, kv_head), the query heads of a group sharing theirs); o in bf16."""
    def descaled(t, descale):
        if descale is None:
            return t.double()
        if descale.numel() == 1:
            return t.double() * descale.item()
        return t.double() * descale.double().repeat_interleave(t.shape[1] // descale.shape[1], dim=1)[:, :, None, None]
    groups = q.shape[1] // k.shape[1]
    as_double = (descaled(q, q_descale), *(descaled(t, d).repeat_interleave(groups, dim=1)
                                           for t, d in ((k, k_descale), (v, v_descale))))
    parsed = spec_from_dict(json.loads(spec))
    fields = {**parsed.to_dict(), "dtype": "fp32"}
    o, lse = _reference_forward(*as_double, json.dumps(fields))
    return o.to(torch.bfloat16), lse


#: the plain ops' calls (fagen::attention_forward_plain, attention_backward_plain), by name
PLAIN_OPS_SEEN = []


def _recorded(name, reference):
    def run(*args):
        PLAIN_OPS_SEEN.append(name)
        return reference(*args)
    return run


@pytest.fixture(scope="module", autouse=True)
def cpu_reference_ops():
    if not _registered:
        fagen_torch._library.impl("attention_forward", _reference_forward, "CPU")
        fagen_torch._library.impl("attention_backward", _reference_backward, "CPU")
        fagen_torch._library.impl("attention_backward_input_grads", _reference_backward_input_grads, "CPU")
        fagen_torch._library.impl("attention_forward_plain", _recorded("forward_plain", _reference_forward), "CPU")
        fagen_torch._library.impl("attention_backward_plain", _recorded("backward_plain", _reference_backward), "CPU")
        fagen_torch._library.impl("attention_forward_fp8", _reference_fp8_forward, "CPU")
        _registered.append(True)


SPEC = fagen.Spec(head_dim=32, dtype="fp32", mask="causal")


def _inputs(n=19, m=23):
    return [torch.randn(2, 3, length, 32, requires_grad=True) for length in (n, m, m)]


def _grads(fn, q, k, v):
    loss = fn(q, k, v).square().sum()
    return [loss.detach(), *torch.autograd.grad(loss, (q, k, v))]


def test_spec_key_is_the_canonical_json_and_cached_per_object():
    key = fagen_torch.spec_key(SPEC)
    assert key == SPEC.canonical_json() and fagen_torch.spec_key(SPEC) is key
    assert fagen_torch.spec_key(key) is key
    assert json.loads(fagen_torch.spec_key({"head_dim": 32, "dtype": "fp32"}))["head_dim"] == 32


@pytest.mark.parametrize("how", ["string", "spec"])
def test_compile_fullgraph_matches_the_uncompiled_op(how):
    torch._dynamo.reset()
    spec = SPEC.canonical_json() if how == "string" else SPEC
    def fn(q, k, v):
        return fagen.attention(q, k, v, spec)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    expected = _grads(lambda *t: _reference_forward(*t, SPEC.canonical_json())[0], q, k, v)
    for got, want in zip(_grads(compiled, q, k, v), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_importing_fagen_torch_does_not_import_dynamo():
    """torch._dynamo costs about a second to import; fagen marks its compile-time constants without it, so a
    process that never compiles never pays for it (torch.compile still sees the marks: the compile tests here)."""
    import subprocess
    import sys

    code = "import sys, torch, fagen, fagen.torch; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
    assert fagen_torch._constant_spec_key._dynamo_marked_constant is True


def test_a_dict_spec_is_keyed_by_its_content_without_growing_the_cache():
    fields = {"head_dim": 32, "dtype": "fp32", "mask": "causal"}
    key = fagen_torch.spec_key(dict(fields))
    assert key == SPEC.canonical_json()
    before = len(fagen_torch._spec_keys), len(fagen_torch._dict_keys)
    for _ in range(50):
        assert fagen_torch.spec_key(dict(fields)) == key
    assert (len(fagen_torch._spec_keys), len(fagen_torch._dict_keys)) == before


def test_compiled_function_follows_a_new_spec_object():
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, s: fagen.attention(q, k, v, s), backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    plain = fagen.Spec(head_dim=32, dtype="fp32", mask="none")
    for spec in (SPEC, plain):
        want = _reference_forward(q, k, v, spec.canonical_json())[0]
        torch.testing.assert_close(compiled(q, k, v, spec), want)


@pytest.mark.parametrize("op", ["attention_forward", "attention_forward_plain"])
def test_the_op_alone_is_differentiable_lse_included(op):
    """The op's autograd rule hands the backward op the gradients of both outputs: o's alone, lse's alone (dO is
    then zeros) and both, against autograd through the reference's own o and lse."""
    forward = getattr(torch.ops.fagen, op)
    q, k, v = _inputs()
    weights = torch.randn(2, 3, 19)

    def losses(o, lse):
        return {"o": o.square().sum(), "lse": (lse * weights).sum(), "both": o.square().sum() + (lse * weights).sum()}

    o, lse = forward(q, k, v, SPEC.canonical_json())
    assert o.requires_grad and lse.requires_grad
    for name in ("o", "lse", "both"):
        o, lse = forward(q, k, v, SPEC.canonical_json())
        got = torch.autograd.grad(losses(o, lse)[name], (q, k, v))
        # (lse alone does not depend on v: its gradient is None there, 0 from the op)
        want = torch.autograd.grad(losses(*_reference_forward(q, k, v, SPEC.canonical_json()))[name], (q, k, v),
                                   allow_unused=True)
        for g, w, t in zip(got, want, (q, k, v)):
            torch.testing.assert_close(g, torch.zeros_like(t) if w is None else w)


@pytest.mark.parametrize("plain", [False, True], ids=["ops", "plain ops"])
def test_fake_tensors_get_the_kernels_shapes(plain):
    from torch._subclasses.fake_tensor import FakeTensorMode

    forward, backward = ((torch.ops.fagen.attention_forward_plain, torch.ops.fagen.attention_backward_plain) if plain
                         else (torch.ops.fagen.attention_forward, torch.ops.fagen.attention_backward))
    with FakeTensorMode():
        q = torch.empty(2, 4, 7, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 4, 9, 64, dtype=torch.bfloat16, device="cuda")
        o, lse = forward(q, k, k, '{"head_dim": 64}')
        dq, dk, dv = backward(q, k, k, o, lse, o, None, '{"head_dim": 64}')
    assert o.shape == q.shape and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("plain_ops", [True, False], ids=["plain ops on", "off"])
@pytest.mark.parametrize("compiled", [False, True], ids=["ops", "compiled"])
def test_calls_without_run_time_arguments_take_the_plain_ops(compiled, plain_ops, monkeypatch):
    """With PLAIN_OPS, a call with no run-time argument goes through fagen::attention_forward_plain and its backward
    through attention_backward_plain (torch.compile's generated code passes every argument of an op's schema, the
    defaults as keywords: host time per call); one with a run-time argument, or any call without PLAIN_OPS,
    through the full ops. Both against the reference."""
    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    monkeypatch.setattr(fagen_torch, "PLAIN_OPS", plain_ops)
    torch._dynamo.reset()
    key = SPEC.canonical_json()
    lengths = torch.tensor([23, 11], dtype=torch.int32)
    calls = {"plain": lambda q, k, v: fagen.attention(q, k, v, key),
             "kv_lengths": lambda q, k, v: fagen.attention(q, k, v, key, kv_lengths=lengths)}
    for name, fn in calls.items():
        if compiled:
            fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        q, k, v = _inputs()
        PLAIN_OPS_SEEN.clear()
        got = _grads(fn, q, k, v)
        assert PLAIN_OPS_SEEN == (["forward_plain", "backward_plain"] if name == "plain" and plain_ops else []), name
        if name == "plain":
            for g, w in zip(got, _grads(lambda *t: _reference_forward(*t, key)[0], q, k, v)):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["attention_forward", "attention_forward_plain"])
def test_opcheck_of_the_forward_ops(op):
    """torch.library.opcheck on the CPU reference kernels: schema, autograd registration, fake kernel."""
    q, k, v = _inputs()
    torch.library.opcheck(getattr(torch.ops.fagen, op).default, (q, k, v, SPEC.canonical_json()),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_fake_outputs_keep_the_layout_of_heads_interleaved_inputs():
    """(batch, seq, heads, d) activations viewed as (batch, heads, seq, d), as transformers passes
    them: o and the gradients keep that layout (so the transpose back is free), as the kernels do."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 7, 4, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        o, lse = torch.ops.fagen.attention_forward(q, q, q, '{"head_dim": 64}')
        dq, _, _ = torch.ops.fagen.attention_backward(q, q, q, o, lse, o, lse, '{"head_dim": 64}')
    assert o.stride() == q.stride() == dq.stride() and o.transpose(1, 2).is_contiguous()
    assert lse.is_contiguous()


def test_bad_spec_string_is_a_one_line_error():
    with pytest.raises(fagen.SpecError, match="not JSON of spec fields"):
        fagen_torch.kernel_for("{head_dim: 64", 0)
    with pytest.raises(fagen.SpecError, match="head_dim"):
        fagen_torch.kernel_for('{"head_dim": 300}', 0)


def test_cpu_tensors_and_bad_seeds_are_rejected_before_any_launch():
    from fagen.runtime import ArgumentError

    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs())
    with pytest.raises(ArgumentError, match="need CUDA tensors"):
        fagen.attention(q, k, v, SPEC)
    with pytest.raises(ArgumentError, match="seed"):
        fagen.attention(q, k, v, SPEC, seed=2**63)


@pytest.mark.parametrize("compiled", [False, True], ids=["op", "compiled"])
def test_a_seed_tensor_reaches_the_forward_and_the_backward(compiled, monkeypatch):
    """seed= a one-element int64 tensor (fagen.torch.dropout_seed): the ops take it as seed_tensor, under
    autograd and torch.compile(fullgraph), and the backward gets the forward's tensor."""
    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    spec = fagen.Spec(head_dim=32, dtype="fp32", mask="causal", dropout=0.1)
    torch.manual_seed(3)
    seed = fagen_torch.dropout_seed("cpu")
    torch.manual_seed(3)
    assert torch.equal(fagen_torch.dropout_seed("cpu"), seed) and seed.dtype == torch.int64 and seed.shape == (1,)

    def fn(q, k, v, seed):
        return fagen.attention(q, k, v, spec, seed=seed)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    SEEDS_SEEN.clear()
    o = fn(q, k, v, seed)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    # (the CPU backward above recomputes the forward through _reference_forward: a third entry, no seed)
    assert [entry[0] for entry in SEEDS_SEEN[:2]] == ["forward", "backward"]
    for _, int_seed, seed_tensor in SEEDS_SEEN[:2]:
        assert int_seed == 0 and seed_tensor is not None and torch.equal(seed_tensor, seed)


MOD_SPEC = fagen.Spec(head_dim=32, dtype="fp32", mask="causal", score_mod="cap * tanh(score / cap) - slope[h] * (i - j)",
                      inputs={"slope": "float32", "cap": "scalar"})


@pytest.mark.parametrize("compiled", [False, True], ids=["op", "compiled"])
def test_modifier_inputs_travel_through_the_ops_autograd_and_compile(compiled, monkeypatch):
    """fagen.attention(..., inputs=) on the op path: the inputs dict becomes the ops' tensor and scalar
    lists in the spec's declaration order, autograd and torch.compile(fullgraph) carry them, and the
    result is the float64 reference's for those inputs."""
    from fagen import reference

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    slope = torch.tensor([0.5, 0.25, 0.125])
    inputs = {"cap": 2.0, "slope": slope}

    def fn(q, k, v):
        return fagen.attention(q, k, v, MOD_SPEC, inputs=inputs)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    o = fn(q, k, v)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    values = {"cap": 2.0, "slope": slope.numpy()}
    as64 = lambda t: t.detach().double().numpy()  # noqa: E731
    want_o, _ = reference.attention_forward(as64(q), as64(k), as64(v), MOD_SPEC, inputs=values)
    want = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), MOD_SPEC, inputs=values)
    for got, ref in zip((o, *grads), (want_o, *want)):
        np.testing.assert_allclose(as64(got), ref, rtol=1e-5, atol=1e-5)


def test_inputs_that_require_grad_but_get_a_zero_gradient_are_accepted(monkeypatch):
    """Only inputs score_mod depends on are refused: a float tensor mask_mod alone reads (its gradient is 0
    everywhere it is defined) passes."""
    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    spec = fagen.Spec(head_dim=32, dtype="fp32", mask_mod="gate[j] > 0", inputs={"gate": "float32"})
    gate = torch.ones(23, requires_grad=True)
    q, k, v = _inputs()
    assert fagen.attention(q, k, v, spec, inputs={"gate": gate}).shape == q.shape


@pytest.mark.parametrize("compiled", [False, True], ids=["op", "compiled"])
def test_score_mod_input_gradients_through_the_ops_autograd_and_compile(compiled, monkeypatch):
    """A score_mod tensor input that requires grad (ALiBi's slopes) gets its gradient through the op's autograd
    rule and torch.compile(fullgraph): the rule calls the input-gradient op only then, and the gradient is
    the float64 reference's (score_input_grads), in the input's dtype; q, k, v's are unchanged."""
    from fagen import reference

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    slope = torch.tensor([0.5, 0.25, 0.125], requires_grad=True)

    def fn(q, k, v, slope):
        return fagen.attention(q, k, v, MOD_SPEC, inputs={"cap": 2.0, "slope": slope})

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    SEEDS_SEEN.clear()
    o = fn(q, k, v, slope)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, slope), do)
    assert [call[0] for call in SEEDS_SEEN] == ["forward", "backward_input_grads"]
    values = {"cap": 2.0, "slope": slope.detach().numpy()}
    as64 = lambda t: t.detach().double().numpy()  # noqa: E731
    want = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), MOD_SPEC, inputs=values)
    want_slope = reference.score_input_grads(as64(q), as64(k), as64(v), as64(do), MOD_SPEC, inputs=values)["slope"]
    assert np.abs(want_slope).max() > 1e-3, "a gradient that is ~0 would not test anything"
    for got, ref in zip(grads, (*want, want_slope)):
        np.testing.assert_allclose(as64(got), ref, rtol=1e-5, atol=1e-5)
    assert grads[3].dtype == slope.dtype and grads[3].shape == slope.shape
    # detached: the plain backward op, no input gradient
    SEEDS_SEEN.clear()
    o = fn(q, k, v, slope.detach())
    torch.autograd.grad(o, (q,), do)
    assert [call[0] for call in SEEDS_SEEN] == ["forward", "backward"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("score, inputs, name", [
    ("cap * tanh(score / cap) - slope[h] * (i - j)", {"slope": "float32", "cap": "scalar"}, "cap"),
    ("score + floor(bias[h])", {"bias": "float32"}, "bias"),
])
def test_modifier_inputs_that_would_get_no_gradient_are_refused(compiled, score, inputs, name, monkeypatch):
    """A score_mod input that requires grad but cannot get one -- a scalar (the ops take floats), a read under
    floor whose derivative fagen cannot render -- is an error that says what to do, not a parameter that
    silently stops learning; detached, or under no_grad, the same tensor is accepted."""
    from fagen.runtime import ArgumentError

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    spec = fagen.Spec(head_dim=32, dtype="fp32", mask="causal", score_mod=score, inputs=inputs)
    values = {"slope": torch.tensor([0.5, 0.25, 0.125]), "cap": torch.tensor(2.0),
              "bias": torch.tensor([0.5, -1.5, 2.0])}
    values = {key: values[key] for key in inputs}
    values[name] = values[name].clone().requires_grad_(True)

    def fn(q, k, v, value):
        return fagen.attention(q, k, v, spec, inputs={**values, name: value})

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs()
    with pytest.raises(Exception) as info:
        fn(q, k, v, values[name])
    assert f"'{name}' requires grad" in str(info.value) and f"{name}.detach()" in str(info.value)
    if not compiled:
        assert isinstance(info.value, ArgumentError)
    # as data: the tensor detached (a scalar input as a number, which torch.compile keeps a constant)
    data = values[name].detach() if inputs[name] != "scalar" else float(values[name])
    assert fn(q, k, v, data).shape == q.shape
    if not compiled:
        with torch.no_grad():
            assert fn(q, k, v, values[name]).shape == q.shape


@pytest.mark.parametrize("compiled", [False, True], ids=["op", "compiled"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_head_dims_that_are_not_multiples_of_8_run_padded(compiled, layout, monkeypatch):
    """d = 59 (bf16): the op runs the spec at d = 64 with d = 59's softmax scale on q, k, v padded with zero
    columns; o comes back with 59 columns and the gradients reach the caller's tensors, equal to the float64
    reference at d = 59."""
    from fagen import reference

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    spec = fagen.Spec(head_dim=59, dtype="bf16", mask="causal")

    def fn(q, k, v):
        return fagen.attention(q, k, v, spec)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    leaves = [torch.randn(2, 3, n, 59) if layout == "bhnd" else torch.randn(2, n, 3, 59) for n in (19, 23, 23)]
    leaves = [t.requires_grad_() for t in leaves]
    q, k, v = leaves if layout == "bhnd" else [t.transpose(1, 2) for t in leaves]
    KEYS_SEEN.clear()
    o = fn(q, k, v)
    assert o.shape == q.shape
    assert KEYS_SEEN[-1].head_dim == 64 and KEYS_SEEN[-1].scale == pytest.approx(59 ** -0.5)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    as64 = lambda t: t.detach().double().numpy()  # noqa: E731
    want_o, _ = reference.attention_forward(as64(q), as64(k), as64(v), spec)
    want = reference.attention_backward(as64(q), as64(k), as64(v), as64(do), spec)
    np.testing.assert_allclose(as64(o), want_o, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(as64(got if layout == "bhnd" else got.transpose(1, 2)), ref, rtol=1e-5, atol=1e-5)


def test_padding_only_where_rows_are_not_whole_16_byte_copies():
    """Padded: fp16 / bf16 specs the solver puts on tensor cores. Not padded: multiples of 8, fp32, and specs
    on the CUDA-core templates (fa1, paper tiles, a shared-memory budget, deterministic), which take any d and
    where the padded spec may not even fit the budget; nor a spec with a decode pass (its calls stream K/V)."""
    from fagen.runtime import ArgumentError

    for fields, padded in ((dict(head_dim=3, dtype="fp16"), 8), (dict(head_dim=111, dtype="bf16"), 112),
                           (dict(head_dim=64, dtype="bf16"), 0), (dict(head_dim=59, dtype="fp32"), 0),
                           (dict(head_dim=59, dtype="bf16", loop_order="fa1"), 0),
                           (dict(head_dim=107, dtype="fp16", sram_budget=16384), 0),
                           (dict(head_dim=59, dtype="bf16", tile_policy="paper"), 0),
                           (dict(head_dim=59, dtype="bf16", deterministic=True), 0),
                           (dict(head_dim=59, dtype="bf16", passes=["forward", "decode"]), 0)):
        key = fagen.Spec(**fields).canonical_json()
        new_key, dim, _ = fagen_torch.padded_spec_key(key)
        assert dim == padded and (new_key == key) == (padded == 0), fields
    q, k, v = (torch.randn(2, 3, 19, 61) for _ in range(3))   # d = 61 tensors against a d = 59 spec
    with pytest.raises(ArgumentError, match="last dims 61, 61, 61; the spec's head_dim is 59"):
        fagen.attention(q, k, v, fagen.Spec(head_dim=59, dtype="bf16"))


def test_modifier_inputs_are_checked_against_the_spec():
    from fagen.runtime import ArgumentError

    with pytest.raises(ArgumentError, match="declares"):
        fagen_torch._mod_slots(MOD_SPEC.canonical_json(), {"cap": 1.0})
    slots = fagen_torch._mod_slots(MOD_SPEC.canonical_json(), {"cap": 3, "slope": [1.0, 2.0, 3.0]})
    assert len(slots) == 8 and slots[0].shape == (3,) and slots[1:4] == [None] * 3 and slots[4:] == [3.0, 0, 0, 0]
    assert fagen_torch._mod_slots(SPEC.canonical_json(), None) == []


@pytest.mark.parametrize("compiled", [False, True], ids=["ops", "compiled"])
def test_a_call_without_the_inputs_its_spec_declares_is_refused(compiled, monkeypatch):
    """Through the ops, a missing scalar input cannot be told from 0.0 (the dispatcher drops it like a default), so a
    call that gives none of the declared inputs is refused by fagen.attention, not run with the cap at 0."""
    from fagen.runtime import ArgumentError

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    scalar_only = fagen.Spec(head_dim=32, dtype="fp32", mask="causal", score_mod="cap * tanh(score / cap)",
                             inputs={"cap": "scalar"}).canonical_json()

    def fn(q, k, v):
        return fagen.attention(q, k, v, scalar_only)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    # (under torch.compile dynamo reports the error it saw while tracing, with its message)
    with pytest.raises(Exception) as info:
        fn(*_inputs())
    assert "inputs: the spec declares ['cap'], got none" in str(info.value)
    assert compiled or isinstance(info.value, ArgumentError)


def test_flex_style_callables_with_torch_functions_become_spec_text():
    """A FlexAttention score_mod / mask_mod (torch functions, Flex's parameter names) traces into a spec."""
    def softcap(score, b, h, q_idx, kv_idx, cap):
        return cap * torch.tanh(score / cap)

    def local(b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx < 8, kv_idx <= q_idx, kv_idx < 4)

    spec = fagen.Spec(head_dim=64, score_mod=softcap, mask_mod=local, inputs={"cap": "scalar"})
    assert spec.score_mod == "(cap * tanh((score / cap)))"
    assert spec.modifiers.mask_numpy(0, 0, np.array([[9], [20]]), np.array([[2, 12, 19, 21]]), 30, 30).tolist() == [
        [True, False, False, False], [True, False, True, False]]
    with pytest.raises(fagen.SpecError, match="torch.erf has no fagen counterpart"):
        fagen.spec.spec_from_dict({"head_dim": 64, "score_mod": lambda score: torch.erf(score)})


class _StandInKernel:
    """A stand-in runtime.Kernel for the eager autograd.Function: forward_keyed is its forward with no fast-path
    key (None), so the node's backward takes Kernel.backward, as a call without a remembered launch does."""

    def forward_keyed(self, q, k, v, **kwargs):
        return (*self.forward(q, k, v, **kwargs), None)


def test_the_eager_path_routes_score_mod_input_gradients():
    """The eager autograd.Function takes score_mod's tensor inputs that require grad as arguments, asks the
    kernel's backward for input gradients only then, and hands each back in the input's dtype."""
    seen = []

    class Kernel(_StandInKernel):
        def forward(self, q, k, v, **kwargs):
            return q.clone(), q.new_zeros(q.shape[:3])

        def backward(self, q, k, v, o, lse, do, input_grads=False, **kwargs):
            seen.append(input_grads)
            grads = (do.clone(), torch.zeros_like(k), torch.zeros_like(v))
            if not input_grads:
                return grads
            return (*grads, {"slope": torch.arange(3, dtype=torch.float32) + 1})

    q, k, v = _inputs()
    slope = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    kwargs = {"seed": 0, "offset": 0, "inputs": {"slope": slope}}
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, Kernel(), kwargs, ("slope",), slope)
    o.sum().backward()
    assert seen == [True]
    assert slope.grad.dtype == torch.float64 and slope.grad.tolist() == [1.0, 2.0, 3.0]
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, Kernel(), {"seed": 0, "offset": 0})
    o.sum().backward()
    assert seen == [True, False]


def test_the_eager_path_saves_a_seed_tensor_for_the_backward():
    """The eager autograd.Function (what CUDA calls take outside torch.compile) hands the backward the
    forward's seed tensor, and changing that tensor in place in between is torch's in-place error, not
    a backward that regenerates another mask. A stand-in kernel records what each pass received."""
    seen = []

    class Kernel(_StandInKernel):
        def forward(self, q, k, v, **kwargs):
            seen.append(("forward", kwargs["seed"]))
            return q.clone(), q.new_zeros(q.shape[:3])

        def backward(self, q, k, v, o, lse, do, **kwargs):
            seen.append(("backward", kwargs["seed"]))
            return do.clone(), torch.zeros_like(k), torch.zeros_like(v)

    q, k, v = _inputs()
    seed = torch.tensor([5], dtype=torch.int64)
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, Kernel(), {"seed": seed, "offset": 0})
    o.sum().backward()
    assert [name for name, _ in seen] == ["forward", "backward"] and seen[1][1] is not None
    assert torch.equal(seen[1][1], seed)
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, Kernel(), {"seed": seed, "offset": 0})
    seed.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, Kernel(), {"seed": 3, "offset": 0})   # an int seed: as it was
    o.sum().backward()
    assert seen[-1] == ("backward", 3)


class _RecordingKernel(_StandInKernel):
    """A stand-in kernel whose forward copies q and whose backward records the keywords it was given."""

    def __init__(self):
        self.seen = []

    def forward(self, q, k, v, **kwargs):
        return q.clone(), q.new_zeros(q.shape[:3])

    def backward(self, q, k, v, o, lse, do, **kwargs):
        self.seen.append(kwargs)
        return do.clone(), torch.zeros_like(k), torch.zeros_like(v)


@pytest.mark.parametrize("place", ["kv_lengths", "block_mask", "cu_seqlens_q", "cu_seqlens_k", "inputs"])
def test_the_eager_path_saves_every_run_time_tensor_for_the_backward(place):
    """kv_lengths, block_mask, cu_seqlens and mask_mod / score_mod inputs are saved like the seed tensor: the
    backward gets the forward's tensors (unpacked by autograd, not just the kwargs dict's references), and one
    changed in place in between -- a packing buffer refilled for the next micro-batch before this one's backward
    -- is torch's in-place error, not a backward of other offsets. (The ops save them in _setup_context.)"""
    kernel = _RecordingKernel()

    def runtime_kwargs():
        tensor = torch.tensor([0, 5, 19], dtype=torch.int32)
        kwargs = {"seed": 0, "offset": 0, "kv_lengths": None, "block_mask": None}
        if place == "inputs":
            kwargs["inputs"] = {"documents": tensor, "window": 3.0}
        else:
            kwargs[place] = tensor
        return kwargs, tensor

    q, k, v = _inputs()
    kwargs, tensor = runtime_kwargs()
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, kernel, kwargs)
    o.sum().backward()
    got = kernel.seen[-1]["inputs"] if place == "inputs" else kernel.seen[-1]
    assert torch.equal(got["documents" if place == "inputs" else place], tensor)
    if place == "inputs":
        assert got["window"] == 3.0
    kwargs, tensor = runtime_kwargs()
    o, _ = fagen_torch._EagerAttention.apply(q, k, v, kernel, kwargs)
    tensor[1] = 7
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.sum().backward()


def test_the_eager_backward_takes_the_run_time_tensors_autograd_unpacks():
    """Under saved-tensor hooks (offloading: torch.autograd.graph.save_on_cpu) autograd hands the backward what the
    hooks unpack, not the forward's objects: the backward must take those, every run-time tensor at once, each in
    its own place. Host values are copied on the way in (a list changed later cannot reach the backward)."""
    kernel = _RecordingKernel()
    given = {"seed": torch.tensor([5]), "kv_lengths": torch.tensor([1, 2], dtype=torch.int32),
             "block_mask": torch.tensor([1, 0, 1], dtype=torch.uint8), "cu_seqlens_q": torch.tensor([0, 3, 9]),
             "cu_seqlens_k": torch.tensor([0, 4, 11]), "documents": torch.tensor([7, 7, 8, 8])}
    kwargs = {name: given[name] for name in ("seed", "kv_lengths", "block_mask", "cu_seqlens_q", "cu_seqlens_k")}
    kwargs.update(offset=0, inputs={"documents": given["documents"], "window": 3.0})
    originals = {}   # id of an unpacked copy -> the tensor it copies

    def unpack(tensor):
        copy = tensor.clone()
        originals[id(copy)] = tensor
        return copy

    q, k, v = _inputs()
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpack):
        o, _ = fagen_torch._EagerAttention.apply(q, k, v, kernel, kwargs)
    o.sum().backward()
    got = {**kernel.seen[-1], **kernel.seen[-1]["inputs"]}
    for name, tensor in given.items():
        assert originals.get(id(got[name])) is tensor, name   # the unpacked copy of this very tensor
    assert got["window"] == 3.0 and got["offset"] == 0
    assert kwargs["inputs"]["documents"] is given["documents"]   # the caller's dict is left as it was
    lengths = [0, 2, 5]
    held = fagen_torch._as_tensor_or_none(lengths, "cu_seqlens_q")
    lengths[1] = 4
    assert held.tolist() == [0, 2, 5]


def test_the_cuda_kernel_of_the_forward_op_restores_what_the_dispatcher_dropped(monkeypatch):
    """The dispatcher drops trailing arguments equal to their defaults before it calls the op's CUDA kernel in
    Python. A call with none left goes straight to Kernel.forward; but a spec that declares inputs gets them back
    (a scalar input of 0.0 is dropped like a default), else Kernel.forward would report the input missing."""
    seen = []

    class Kernel:
        def __init__(self, spec):
            self.modifiers = spec.modifiers

        def forward(self, q, k, v, **kwargs):
            seen.append(kwargs)
            return q.clone(), q.new_zeros(q.shape[:3])

    specs = {key: spec_from_dict(json.loads(key)) for key in (
        '{"head_dim": 8, "dtype": "fp32", "mask": "causal"}',
        '{"head_dim": 8, "dtype": "fp32", "score_mod": "cap * tanh(score / cap)", "inputs": {"cap": "scalar"}}')}
    monkeypatch.setattr(fagen_torch, "kernel_for", lambda key, device: Kernel(specs[key]))
    q, k, v = _inputs()
    plain, softcap = specs
    fagen_torch._forward_cuda(q, k, v, plain)
    assert seen.pop() == {}
    fagen_torch._forward_cuda(q, k, v, softcap)   # cap = 0.0 given, dropped by the dispatcher
    assert seen.pop()["inputs"] == {"cap": 0.0}
    fagen_torch._forward_cuda(q, k, v, plain, None, None, 0, 3)   # a run-time argument: the full keywords
    assert seen.pop()["offset"] == 3


def test_fp8_attention_refuses_what_it_cannot_run_before_touching_a_gpu(monkeypatch):
    """fp8 has no backward: refused by name, eagerly and through the op (its Autograd kernel), before any device is
    needed; so are descales for a 16-bit q and descales that are not positive numbers or tensors."""
    from fagen.runtime import ArgumentError

    spec = {"head_dim": 128, "dtype": "fp8_e4m3"}
    q8 = torch.randn(1, 2, 16, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ArgumentError, match="no backward yet"):
        fagen.attention(q8.clone().requires_grad_(), q8, q8, spec)
    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    with pytest.raises(ArgumentError, match="no backward yet"):
        torch.ops.fagen.attention_forward_fp8(q8.clone().requires_grad_(), q8, q8, json.dumps(spec))
    with pytest.raises(ArgumentError, match="q_descale: expected a positive finite number, got -0.5"):
        fagen.attention(q8, q8, q8, spec, q_descale=-0.5)
    with pytest.raises(ArgumentError, match="v_descale: expected a number or a float32 CUDA tensor"):
        fagen.attention(q8, q8, q8, spec, v_descale="2")
    with pytest.raises(ArgumentError, match="are for dtype fp8_e4m3 specs"):
        fagen.attention(q8.bfloat16(), q8.bfloat16(), q8.bfloat16(), {"head_dim": 128, "dtype": "bf16"}, k_descale=2.0)


def _fp8_inputs(kv_heads=2):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 19, 64, generator=g).to(torch.float8_e4m3fn)
    k, v = (torch.randn(2, kv_heads, 23, 64, generator=g).to(torch.float8_e4m3fn) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("compiled", [False, True], ids=["op", "compiled"])
def test_fp8_attention_runs_through_its_op_and_torch_compile(compiled, monkeypatch):
    """Off the eager path (EAGER_FAST_PATH off, or under torch.compile fullgraph), an fp8 call goes through
    fagen::attention_forward_fp8 with its descales (numbers become one-element float32 tensors; (batch, kv_heads)
    tensors pass as they are) and gives bf16 o of the descaled values' attention."""
    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", False)
    torch._dynamo.reset()
    key = fagen.Spec(head_dim=64, dtype="fp8_e4m3", mask="causal").canonical_json()
    q, k, v = _fp8_inputs()
    per_head = torch.tensor([[0.5, 1.5], [2.0, 0.25]])
    def fn(q, k, v):
        return fagen.attention(q, k, v, key, q_descale=0.5, k_descale=per_head, v_descale=3.0, return_lse=True)
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    o, lse = fn(q, k, v)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and lse.shape == q.shape[:3]
    heads = per_head.repeat_interleave(2, dim=1)[:, :, None, None]
    s = (q.double() * 0.5) @ (k.double().repeat_interleave(2, dim=1) * heads.double()).transpose(-1, -2) * 64 ** -0.5
    s = s.masked_fill(~torch.ones(19, 23, dtype=torch.bool).tril(4), float("-inf"))
    want = torch.softmax(s, -1) @ (v.double().repeat_interleave(2, dim=1) * 3.0)
    torch.testing.assert_close(o.double(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    unscaled = fagen.attention(q, k, v, key)
    assert not torch.allclose(unscaled.double(), want, rtol=1e-2, atol=1e-2)


def test_fp8_fake_outputs_and_opcheck():
    """The fp8 op's fake kernel: bf16 o laid out as q, float32 LSE (packed too); opcheck on the CPU reference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    key = fagen.Spec(head_dim=64, dtype="fp8_e4m3").canonical_json()
    with FakeTensorMode():
        q = torch.empty(2, 7, 4, 64, dtype=torch.float8_e4m3fn, device="cuda").transpose(1, 2)
        o, lse = torch.ops.fagen.attention_forward_fp8(q, q, q, key)
        packed = torch.empty(11, 4, 64, dtype=torch.float8_e4m3fn, device="cuda")
        cu = torch.empty(3, dtype=torch.int32, device="cuda")
        o_packed, lse_packed = torch.ops.fagen.attention_forward_fp8(packed, packed, packed, key, None, None, None,
                                                                     None, None, 0, 0, None, cu, cu, 7, 7)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape and o.stride() == q.stride()
    assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    assert o_packed.shape == packed.shape and o_packed.dtype == torch.bfloat16 and lse_packed.shape == (4, 11)
    q, k, v = _fp8_inputs()
    torch.library.opcheck(torch.ops.fagen.attention_forward_fp8.default,
                          (q, k, v, key, torch.tensor([0.5]), torch.ones(2, 2), None),
                          test_utils=("test_faketensor",))   # (test_schema multiplies e4m3 tensors: no CPU kernel)
