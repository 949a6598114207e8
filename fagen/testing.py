"""Property testing for users' variants (and fagen's own GPU tests): hypothesis strategies for a spec's
shapes, inputs and run-time arguments, and `assert_matches_reference`, which runs a compiled kernel
on fresh random inputs with NaN-poisoned outputs and compares it with the float64 reference.

    from hypothesis import given
    from fagen.testing import cases, assert_matches_reference

    @given(case=cases(my_spec))
    def test_my_variant(case):
        assert_matches_reference(my_spec, case, backward=True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from hypothesis import strategies as st

from fagen import reference
from fagen.runtime.tensors import TORCH_DTYPES   # the spec dtypes' torch names (the runtime's, which takes them)
from fagen.spec import Spec

#: ||out - ref||_F / ||ref||_F allowed per dtype (docs/design.md, "Checking a kernel"); fp32 runs on CUDA cores, no tf32.
# fp8_e4m3: e4m3's relative half-ulp (3 mantissa bits), the most that rounding P~ to e4m3 for O += P~ V moves each
# weight; that rounding alone, emulated in float64 on random inputs, gives 1.3-2.6% (docs/decisions/0013-fp8-forward.md).
TOLERANCES = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 1e-2, "fp8_e4m3": 2.0**-4}
HEAD_DIMS = (32, 64, 96, 128, 256)


@dataclass(frozen=True)
class Case:
    """One drawn test case; everything needed to replay it is in its repr."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    layout: str                       # "bhnd" (contiguous) or "bnhd" (strided, transposed view)
    data_seed: int                    # seeds the inputs (numpy generator)
    seed: int                         # dropout seed
    offset: int                       # dropout offset
    kv_lengths: Optional[tuple] = None
    block_mask: Optional[tuple] = field(default=None, repr=True)
    kv_heads: Optional[int] = None    # heads of k and v (grouped KV heads); None: as many as q
    # layout packed: each sequence's query and key count (batch = len), and rows after the last sequence
    # that belong to none (they must come back as o = 0, lse = -inf, zero gradients)
    q_lengths: Optional[tuple] = None
    k_lengths: Optional[tuple] = None
    spare_rows: int = 0
    # mask_mod / score_mod inputs: the seed their tensors are drawn from, and each scalar's value
    inputs_seed: Optional[int] = None
    scalars: Optional[tuple] = None
    input_shapes: Optional[tuple] = None   # ((name, kind, shape), ...): tensors' shapes for this case

    @property
    def packed(self) -> bool:
        return self.q_lengths is not None

    def cu_seqlens(self) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k) as int32 arrays."""
        return tuple(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
                     for lengths in (self.q_lengths, self.k_lengths))

    def runtime_args(self) -> dict:
        args = {"seed": self.seed, "offset": self.offset}
        if self.packed:
            args["cu_seqlens_q"], args["cu_seqlens_k"] = self.cu_seqlens()
        if self.kv_lengths is not None:
            args["kv_lengths"] = np.array(self.kv_lengths, dtype=np.int32)
        if self.block_mask is not None:
            args["block_mask"] = np.array(self.block_mask, dtype=np.uint8)
        if self.inputs_seed is not None:
            args["inputs"] = self.inputs()
        return args

    def inputs(self) -> dict:
        """The mask_mod / score_mod inputs: float32 tensors uniform in [-2, 2]; int32 tensors small
        non-decreasing integers along their last dimension (document ids, segment numbers); scalars
        as drawn."""
        rng = np.random.default_rng(self.inputs_seed)
        values = {}
        for name, kind, shape in self.input_shapes or ():
            if kind == "float32":
                values[name] = rng.uniform(-2.0, 2.0, shape).astype(np.float32)
            else:
                values[name] = np.sort(rng.integers(0, 4, shape), axis=-1).astype(np.int32)
        values.update(dict(self.scalars or ()))
        return values


@st.composite
def cases(draw, spec: Spec, max_seq: int = 300, max_batch: int = 2, max_heads: int = 4) -> Case:
    """Shapes (including 1 and non-multiples of any tile), layouts and run-time arguments for `spec`."""
    seq = st.one_of(st.sampled_from([1, 2, 17, 63, 64, 65, 128, 129]), st.integers(1, max_seq))
    batch, heads = draw(st.integers(1, max_batch)), draw(st.integers(1, max_heads))
    kv_heads = draw(st.sampled_from([n for n in range(1, heads + 1) if heads % n == 0]))  # GQA, MQA, MHA
    seq_q, seq_k = draw(seq), draw(seq)
    if draw(st.booleans()):
        seq_k = seq_q
    kv_lengths = block_mask = q_lengths = k_lengths = None
    spare_rows = 0
    if spec.layout == "packed":   # lengths 0 and 1 included; seq_q / seq_k are the longest
        lengths = st.one_of(st.sampled_from([0, 1, 17, 64, 65]), st.integers(0, max_seq))
        q_lengths = tuple(draw(st.lists(lengths, min_size=batch, max_size=batch + 2)))
        batch = len(q_lengths)
        k_lengths = q_lengths if draw(st.booleans()) else tuple(draw(st.lists(lengths, min_size=batch,
                                                                              max_size=batch)))
        seq_q, seq_k = max(max(q_lengths), 1), max(max(k_lengths), 1)
        spare_rows = draw(st.sampled_from([0, 0, 3]))
    if spec.mask == "padding":
        kv_lengths = tuple(draw(st.lists(st.integers(0, seq_k), min_size=batch, max_size=batch)))
    if spec.mask == "block_sparse":
        blocks = (math.ceil(seq_q / spec.block_size), math.ceil(seq_k / spec.block_size))
        per_head = draw(st.booleans())
        shape = (batch, heads, *blocks) if per_head else blocks
        flat = draw(st.lists(st.booleans(), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        block_mask = tuple(np.array(flat, dtype=np.uint8).reshape(shape).tolist())
    mods, inputs = spec.modifiers, {}
    if mods.tensors or mods.scalars:
        seed = draw(st.integers(0, 2**31 - 1))
        values = [draw(st.sampled_from([1.0, 2.5, 8.0, 30.0])) for _ in mods.scalars]
        inputs = input_fields(spec, batch, heads, seq_q, seq_k, seed, values)
    return Case(batch, heads, seq_q, seq_k, draw(st.sampled_from(["bhnd", "bnhd"])),
                draw(st.integers(0, 2**31 - 1)), draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)),
                kv_lengths, block_mask, kv_heads, q_lengths, k_lengths, spare_rows, **inputs)


def input_fields(spec: Spec, batch: int, heads: int, seq_q: int, seq_k: int, seed: int, scalars) -> dict:
    """A Case's fields for the spec's mask_mod / score_mod inputs (none without them): the seed their
    tensors are drawn from, the scalars' values (in declaration order) and the tensors' shapes, which
    cover every index the expressions form at these sizes."""
    mods = spec.modifiers
    if not (mods.tensors or mods.scalars):
        return {}
    shapes = mods.input_shapes(batch, heads, seq_q, seq_k)
    return {"inputs_seed": seed, "scalars": tuple(zip(mods.scalars, scalars)),
            "input_shapes": tuple((name, kind, tuple(shapes[name])) for name, kind, _ in mods.tensors)}




def make_inputs(spec: Spec, case: Case, names=("q", "k", "v"), device: str = "cuda"):
    """Fresh random torch tensors (never zeros) in the spec's dtype and the case's layout."""
    import torch

    rng = np.random.default_rng(case.data_seed)
    dtype = getattr(torch, TORCH_DTYPES[spec.dtype])
    tensors = []
    if case.packed:   # (total rows, heads, d); "bnhd": a strided view of a (heads, total, d) tensor
        for name in names:
            queries = name in ("q", "do", "o")
            rows = sum(case.q_lengths if queries else case.k_lengths) + case.spare_rows
            heads = case.heads if queries else (case.kv_heads or case.heads)
            data = rng.standard_normal((heads, rows, spec.tensor_dim(name))).astype(np.float32)
            tensor = torch.from_numpy(data).to(device=device, dtype=dtype).permute(1, 0, 2)
            tensors.append(tensor.contiguous() if case.layout == "bhnd" else tensor)
        return tensors
    for name in names:
        rows, heads = (case.seq_q, case.heads) if name in ("q", "do", "o") else (case.seq_k, case.kv_heads or case.heads)
        data = rng.standard_normal((case.batch, rows, heads, spec.tensor_dim(name))).astype(np.float32)
        tensor = torch.from_numpy(data).to(device=device, dtype=dtype)      # (b, n, h, d) in memory
        tensor = tensor.permute(0, 2, 1, 3)                                    # strided (b, h, n, d) view
        tensors.append(tensor.contiguous() if case.layout == "bhnd" else tensor)
    return tensors


#: Gradient errors are relative to max(||ref||, this fraction of the cancelling terms' size): where the
#: exact dq or dk is a cancellation to ~0 (Nk = 1: softmax is constant), ||ref|| measures rounding only.
CANCELLATION_FLOOR = 1 / 8


def relative_error(out: np.ndarray, ref: np.ndarray, floor: float = 0.0) -> float:
    """||out - ref||_F / max(||ref||_F, floor), NaN or inf anywhere -> inf (never passes)."""
    if not np.all(np.isfinite(out)):
        return math.inf
    denominator = max(np.linalg.norm(ref), floor)
    diff = np.linalg.norm(out - ref)
    return float(diff / denominator) if denominator > 0 else float(diff)


def _lse_error(out: np.ndarray, ref: np.ndarray) -> float:
    """LSE: -inf exactly where the reference is -inf (rows with no visible key), else relative error."""
    if np.isnan(out).any() or not np.array_equal(np.isneginf(out), np.isneginf(ref)):
        return math.inf
    finite = np.isfinite(ref)
    return relative_error(out[finite], ref[finite]) if finite.any() else 0.0


def _to_numpy(tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy().astype(np.float64)


def _output_like(spec: Spec, q, shape: tuple):
    """o poisoned with NaN: q's dtype, or bf16 for an fp8 forward."""
    import torch

    return torch.full(shape, float("nan"), dtype=getattr(torch, TORCH_DTYPES[spec.output_dtype]), device=q.device)


def fp8_descales(case: Case, sequences: int, kv_heads: int, device) -> dict:
    """An fp8 case's q_descale, k_descale, v_descale as float32 tensors on `device`, drawn from its data seed: each
    one number for the tensor or one per (sequence, K/V head) (FlashAttention-3's two forms; the seed picks which,
    so that the suite meets every mix), with values in [1/2, 2]."""
    import torch

    rng = np.random.default_rng(case.data_seed + 7)
    shapes = {name: (sequences, kv_heads) if per_head else (1,)
              for name, per_head in zip(("q_descale", "k_descale", "v_descale"), rng.integers(0, 2, 3))}
    return {name: torch.from_numpy(rng.uniform(0.5, 2.0, shape).astype(np.float32)).to(device)
            for name, shape in shapes.items()}


def _dequantized(arrays: tuple, descales: dict, heads: int, row_sequence=None) -> tuple:
    """q, k, v as numpy arrays times their descale factors (the values an fp8 call stands for): padded (batch,
    heads, rows, d), or packed (rows, heads, d) with each row's sequence in `row_sequence` (q's, k's)."""
    out = []
    for array, name, rows in zip(arrays, ("q_descale", "k_descale", "v_descale"),
                                 row_sequence or (None, None, None)):
        factors = descales[name].cpu().numpy().astype(np.float64)
        if factors.size == 1:
            out.append(array * float(factors.reshape(-1)[0]))
            continue
        group = heads // factors.shape[1] if name == "q_descale" else 1
        per_head = np.repeat(factors, group, axis=1)                 # (sequences, heads of this tensor)
        if rows is None:
            out.append(array * per_head[:, :, None, None])
        else:   # rows outside every sequence keep factor 1
            padded = np.concatenate([per_head, np.ones((1, per_head.shape[1]))])
            out.append(array * padded[np.minimum(rows, per_head.shape[0])][:, :, None])
    return tuple(out)


_kernels_under_test: dict = {}


def kernel_under_test(spec):
    """The kernel a GPU test of `spec` runs: `fagen.compile`'s, whose plans are this GPU's, except for a spec that
    names an older arch than this GPU's (sm_80 on an H100 / H200): its own arch's plans (sm_80's mma.sync tiles)
    compiled for this GPU, so that the GPU tests run them somewhere. (`fagen.compile` replaces a spec's arch by
    the device's, as a user moving a spec to a newer GPU wants.)"""
    from fagen.jit import compile as compile_spec, kernel_for
    from fagen.runtime import _default_device, device_target
    from fagen.spec import ARCHS

    target = device_target(_default_device())
    if spec.arch == target.arch or target.arch not in ARCHS or ARCHS.index(spec.arch) > ARCHS.index(target.arch):
        return compile_spec(spec)
    key = (spec.canonical_json(), target.arch)
    kernel = _kernels_under_test.get(key)
    if kernel is None:
        from fagen.solver import solve
        from fagen.target import target_for

        solution = solve(spec, target_for(spec.arch))
        kernel = _kernels_under_test[key] = kernel_for(spec.model_copy(update={"arch": target.arch}), target, solution)
    return kernel


def assert_matches_reference(spec_or_kernel, case: Case, backward: bool = False) -> dict:
    """Run forward (and backward) on fresh inputs with NaN-poisoned outputs; compare with reference.

    Returns {name: relative error}; raises AssertionError naming the worst output and the case."""
    import torch

    from fagen.runtime import Kernel

    kernel = spec_or_kernel if isinstance(spec_or_kernel, Kernel) else kernel_under_test(spec_or_kernel)
    spec = kernel.spec
    if case.packed:
        return _assert_packed_matches_reference(kernel, case, backward)
    if spec.latent_kv:   # v is k's first value_dim columns, which the kernel reads from k itself
        q, k = make_inputs(spec, case, names=("q", "k"))
        v = k[..., :spec.value_dim]
    else:
        q, k, v = make_inputs(spec, case)
    runtime = case.runtime_args()
    descales = fp8_descales(case, case.batch, k.shape[1], q.device) if spec.fp8 else {}
    o = _output_like(spec, q, (*q.shape[:-1], spec.value_dim))   # o has v's head dim
    lse = torch.full((case.batch, case.heads, case.seq_q), float("nan"), device=q.device)
    kernel.forward(q, k, None if spec.latent_kv else v, out=(o, lse), **runtime, **descales)
    ref_args = {"kv_lengths": runtime.get("kv_lengths"), "block_mask": runtime.get("block_mask"),
                "inputs": runtime.get("inputs"), "seed": case.seed, "offset": case.offset}
    qn, kn, vn = (_to_numpy(t) for t in (q, k, v))
    if descales:
        qn, kn, vn = _dequantized((qn, kn, vn), descales, case.heads)
    ref_o, ref_lse = reference.attention_forward(qn, kn, vn, spec, **ref_args)
    errors = {"o": relative_error(_to_numpy(o), ref_o), "lse": _lse_error(_to_numpy(lse), ref_lse)}
    if backward:
        (do,) = make_inputs(spec, Case(**{**case.__dict__, "data_seed": case.data_seed + 1}), names=("do",))
        grads = tuple(torch.full_like(t.contiguous(), float("nan")) for t in (q, k, v))
        kernel.backward(q, k, v, o, lse, do, out=grads, **runtime)
        # D = rowsum(dO * o) from the o the kernel was given, as the kernel computes it.
        magnitudes = {}
        ref_grads = reference.attention_backward(qn, kn, vn, _to_numpy(do), spec, **ref_args, o=_to_numpy(o),
                                                 magnitudes=magnitudes)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            floor = CANCELLATION_FLOOR * magnitudes.get(name, 0.0)
            errors[name] = relative_error(_to_numpy(got), ref, floor)
        if spec.modifiers.kernel_input_grads and not spec.modifiers.input_grads_not_derived:
            errors.update(_input_grad_errors(kernel, (q, k, v, o, lse, do), runtime, ref_args, ref_grads, magnitudes))
    return _check_errors(spec, case, errors)


def _input_grad_errors(kernel, tensors: tuple, runtime: dict, ref_args: dict, ref_grads: tuple,
                       grad_magnitudes: dict) -> dict:
    """score_mod's input gradients (`backward(..., input_grads=True)`) against reference.score_input_grads, each
    relative to max(||ref||, CANCELLATION_FLOOR x the size of its cancelling terms); the dq, dk, dv of that
    call against the plain call's, which asking for input gradients must not change."""
    q, k, v, o, lse, do = tensors
    *grads, input_grads = kernel.backward(q, k, v, o, lse, do, input_grads=True, **runtime)
    magnitudes = {}
    ref = reference.score_input_grads(*(_to_numpy(t) for t in (q, k, v, do)), kernel.spec, **ref_args, o=_to_numpy(o),
                                      magnitudes=magnitudes)
    errors = {}
    for name, got in input_grads.items():
        errors[f"d{name}"] = relative_error(_to_numpy(got), ref[name], CANCELLATION_FLOOR * magnitudes[name])
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[f"{name} (with input grads)"] = relative_error(_to_numpy(got), want,
                                                              CANCELLATION_FLOOR * grad_magnitudes.get(name, 0.0))
    assert set(input_grads) == {name for name, _, _ in kernel.spec.modifiers.kernel_input_grads}
    return errors


def _check_errors(spec: Spec, case: Case, errors: dict) -> dict:
    tolerance = TOLERANCES[spec.dtype]
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (
        f"{spec.variant_name}: {worst} relative error {errors[worst]:.3g} > {tolerance:g} "
        f"(all: { {k: float(f'{v:.3g}') for k, v in errors.items()} }) for {case!r}")
    return errors


def _assert_packed_matches_reference(kernel, case: Case, backward: bool) -> dict:
    """`assert_matches_reference` for layout packed: (total, heads, d) tensors and cu_seqlens."""
    import torch

    spec = kernel.spec
    q, k, v = make_inputs(spec, case)
    runtime = case.runtime_args()
    descales = fp8_descales(case, len(case.q_lengths), k.shape[1], q.device) if spec.fp8 else {}
    o = _output_like(spec, q, (*q.shape[:-1], spec.value_dim))   # o has v's head dim
    lse = torch.full((case.heads, q.shape[0]), float("nan"), device=q.device)
    kernel.forward(q, k, v, out=(o, lse), **runtime, **descales)
    cu_q, cu_k = runtime.pop("cu_seqlens_q"), runtime.pop("cu_seqlens_k")
    qn, kn, vn = (_to_numpy(t) for t in (q, k, v))
    if descales:   # each row takes its sequence's factors
        rows_q, rows_k = (np.searchsorted(cu[1:], np.arange(t.shape[0]), side="right") for cu, t in ((cu_q, q), (cu_k, k)))
        qn, kn, vn = _dequantized((qn, kn, vn), descales, case.heads, (rows_q, rows_k, rows_k))
    ref_args = {"kv_lengths": runtime.get("kv_lengths"), "block_mask": runtime.get("block_mask"),
                "inputs": runtime.get("inputs"), "seed": case.seed, "offset": case.offset}
    # Rows outside every sequence are the caller's: with out= given, the kernels leave them as they were.
    covered = int(cu_q[-1])
    ref_o, ref_lse = reference.packed_forward(qn, kn, vn, cu_q, cu_k, spec, **ref_args)
    errors = {"o": relative_error(_to_numpy(o)[:covered], ref_o[:covered]),
              "lse": _lse_error(_to_numpy(lse)[:, :covered], ref_lse[:, :covered])}
    # Without out=: fresh outputs, where rows outside every sequence must read o = 0 and lse = -inf.
    o_new, lse_new = kernel.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **runtime, **descales)
    errors["o (new)"] = relative_error(_to_numpy(o_new), ref_o)
    errors["lse (new)"] = _lse_error(_to_numpy(lse_new), ref_lse)
    if backward:
        (do,) = make_inputs(spec, Case(**{**case.__dict__, "data_seed": case.data_seed + 1}), names=("do",))
        grads = tuple(torch.full_like(t.contiguous(), float("nan")) for t in (q, k, v))
        kernel.backward(q, k, v, o_new, lse_new, do, out=grads, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **runtime)
        magnitudes = {}
        ref_grads = reference.packed_backward(qn, kn, vn, _to_numpy(do), cu_q, cu_k, spec, **ref_args,
                                              o=_to_numpy(o_new), magnitudes=magnitudes)
        covers = {"dq": covered, "dk": int(cu_k[-1]), "dv": int(cu_k[-1])}
        for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
            floor = CANCELLATION_FLOOR * magnitudes.get(name, 0.0)
            errors[name] = relative_error(_to_numpy(got)[:covers[name]], ref[:covers[name]], floor)
        fresh = kernel.backward(q, k, v, o_new, lse_new, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **runtime)
        for name, got, ref in zip(("dq", "dk", "dv"), fresh, ref_grads):
            errors[f"{name} (new)"] = relative_error(_to_numpy(got), ref,
                                                     CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
        if spec.modifiers.kernel_input_grads and not spec.modifiers.input_grads_not_derived:
            *_, input_grads = kernel.backward(q, k, v, o_new, lse_new, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              input_grads=True, **runtime)
            sizes = {}
            ref = reference.packed_score_input_grads(qn, kn, vn, _to_numpy(do), cu_q, cu_k, spec, **ref_args,
                                                     o=_to_numpy(o_new), magnitudes=sizes)
            assert set(input_grads) == {name for name, _, _ in spec.modifiers.kernel_input_grads}
            for name, got in input_grads.items():
                errors[f"d{name}"] = relative_error(_to_numpy(got), ref[name], CANCELLATION_FLOOR * sizes[name])
    return _check_errors(spec, case, errors)


def check_specs(specs, examples: int = 50, backward: Optional[bool] = None, print_table: bool = True) -> bool:
    """`fagen check`: the hypothesis property suite for each variant on this GPU; a table of
    variant, cases run, pass/fail and worst relative error. A failure shows hypothesis's shrunk case
    (shapes, seeds), which `assert_matches_reference(spec, case)` replays. True when all pass."""
    from hypothesis import HealthCheck, given, settings
    from rich.console import Console
    from rich.table import Table

    from fagen.jit import precompile

    precompile(specs)
    rows, failures = [], []
    for spec in specs:
        with_backward = ("backward" in spec.passes) if backward is None else backward
        stats = {"cases": 0, "worst": 0.0}

        @settings(max_examples=examples, deadline=None, derandomize=False, database=None,
                  suppress_health_check=list(HealthCheck), print_blob=True)
        @given(case=cases(spec, max_seq=256))
        def run(case):
            stats["cases"] += 1
            errors = assert_matches_reference(spec, case, backward=with_backward)
            stats["worst"] = max(stats["worst"], max(errors.values()))

        try:
            run()
            rows.append((spec.variant_name, stats["cases"], "pass", stats["worst"]))
        except AssertionError as failure:
            rows.append((spec.variant_name, stats["cases"], "FAIL", math.inf))
            failures.append((spec.variant_name, str(failure)))
    if print_table:
        console = Console()
        table = Table(title=f"fagen check ({examples} examples per variant)")
        for column in ("variant", "cases", "result", "worst rel. error"):
            table.add_column(column)
        for name, count, result, worst in rows:
            table.add_row(name, str(count), result, "-" if math.isinf(worst) else f"{worst:.2e}")
        console.print(table)
        for name, message in failures:
            console.print(f"[red]{name}[/red]: shrunk failing case: {message}")
    return not failures
