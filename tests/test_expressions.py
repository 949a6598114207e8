"""fagen/expressions/: parsing and validation, derived gradients, tile_class soundness, the CUDA
struct compiling, and the numpy evaluators against direct Python."""
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from fagen.expressions import MASK_KIND_TEXT, SCORE, ExpressionError, Modifiers, mask_kind, mask_kind_struct, modifiers, parse

TEMPLATES = Path(__file__).resolve().parents[1] / "templates"
EMPTY, PARTIAL, FULL = 0, 1, 2


# ---- parsing and validation -----------------------------------------------------------------
@pytest.mark.parametrize("mask, score, inputs, needle", [
    ("foo < i", None, {"doc": "int32"}, "unknown name 'foo' (allowed: b, h, i, j, Nq, Nk, doc)"),
    (None, "eval(score)", None, "function 'eval' is not supported (supported: tanh, exp"),
    ("i + j", None, None, "mask_mod must be a boolean expression (a comparison, and/or/not), got i + j"),
    (None, "score > 0", None, "score_mod must be a number expression"),
    ("score > 0", None, None, "'score' is only defined in score_mod"),
    ("doc[i] == doc[b, j]", None, {"doc": "int32"}, "tensor 'doc' is subscripted with both 1 and 2"),
    ("doc[b, i] == 0", "score + doc[i]", {"doc": "int32"}, "tensor 'doc' is subscripted with 1 indices here but 2"),
    ("j <= i", None, {"w": "scalar"}, "'w' is declared but neither"),
    ("j <= i", None, {"i": "scalar"}, "'i' clashes"),
    ("j <= i", None, {"tanh": "float32"}, "'tanh' clashes"),
    ("j <= i", None, {"2x": "scalar"}, "'2x' is not a valid name"),
    ("j <= i", None, {"w": "float64"}, "'w' has kind 'float64'"),
    (" & ".join(f"(t{k}[i] > 0)" for k in range(5)), None, {f"t{k}": "float32" for k in range(5)}, "5 tensor inputs"),
    ("j <= i", " + ".join(f"s{k}" for k in range(5)) + " + score", {f"s{k}": "scalar" for k in range(5)}, "5 scalar inputs"),
    ("i.real > j", None, None, "attribute access (i.real)"),
    ("(lambda: 1)() > j", None, None, "calling lambda (lambda: 1) is not supported"),
    ("'a' == j", None, None, "the constant 'a' is not supported"),
    ("[k for k in i] == j", None, None, "a comprehension"),
    ("max(i, j, key=1) > 0", None, None, "max() takes no keyword arguments"),
    ("max(*i) > 0", None, None, "max() takes no *arguments"),
    ("i ^ j == 0", None, None, "operator '^' is not supported"),
    ("i in j", None, None, "comparison 'In' is not supported"),
    ("doc[b, i] == doc", None, {"doc": "int32"}, "tensor input 'doc' must be subscripted"),
    ("w[i] > 0", None, {"w": "scalar"}, "scalar input 'w' cannot be subscripted"),
    (None, "score + bias[h]", None, "unknown input 'bias': declare it in the spec's inputs as a tensor, e.g. inputs: "
                                    "{bias: float32}"),
    ("doc[i / 2] > 0", None, {"doc": "int32"}, "the index i/2 of 'doc' is not an integer expression"),
    ("doc[b, i, j] > 0", None, {"doc": "int32"}, "tensor 'doc' takes 1 or 2 subscripts, got 3"),
    ("doc[0:i] > 0", None, {"doc": "int32"}, "slices are not supported"),
    ("(i < j) + 1 > 0", None, None, "expected a number, got the boolean"),
    ("i & j", None, None, "'&' needs booleans"),
    ("not i", None, None, "'not' needs booleans"),
    ("i < j <", None, None, "invalid syntax"),
    ("i // 0 == 1", None, None, "division by zero"),
    # powers of two render as shifts and masks, but only those of 32-bit ints
    ("(i - j) // 4294967296 == 0", None, None, "4294967296 does not fit in 32 bits"),
    ("(i - j) % 2147483648 == 0", None, None, "2147483648 does not fit in 32 bits"),
    (None, "tanh(score, 2)", None, "tanh() takes 1 argument(s), got 2"),
    (None, "floor(score)", None, "its derivative in score contains Derivative(floor(score), score)"),
    (None, "score % 2", None, "its derivative in score contains Derivative"),
])
def test_modifiers_rejects_with_a_message_naming_the_culprit(mask, score, inputs, needle):
    with pytest.raises(ExpressionError) as info:
        modifiers(mask, score, inputs)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_parse_builds_sympy_relations_and_python_semantics():
    i, j = sp.Symbol("i", integer=True), sp.Symbol("j", integer=True)
    assert parse("j <= i", field="mask_mod", inputs={}, boolean=True) == sp.Le(j, i)
    assert parse("0 <= i - j < 4", field="mask_mod", inputs={}, boolean=True) == sp.And(sp.Le(0, i - j), sp.Lt(i - j, 4))
    assert parse("i // 4 == j // 4", field="mask_mod", inputs={}, boolean=True) == sp.Eq(sp.floor(i / 4), sp.floor(j / 4))
    assert parse("(i - j) % 2 == 0", field="mask_mod", inputs={}, boolean=True) == sp.Eq(sp.Mod(i - j, 2), 0)
    assert parse("i - j < 256 or j < 4", field="mask_mod", inputs={}, boolean=True) == sp.Or(sp.Lt(i - j, 256), sp.Lt(j, 4))
    piecewise = parse("score if i > j else 0.5 * score", field="score_mod", inputs={}, boolean=False)
    assert isinstance(piecewise, sp.Piecewise)
    assert parse("True", field="mask_mod", inputs={}, boolean=True) == sp.true


def test_inactive_modifiers():
    mods = modifiers(None, None, None)
    assert not mods.active and mods.mask is None and mods.score is None and mods.score_grad is None
    struct = mods.cuda_struct()
    assert "HAS_MASK = false, HAS_SCORE = false, SCORE_GRAD_IS_ONE = true" in struct
    assert mods.mask_numpy(0, 0, np.arange(3)[:, None], np.arange(4), 3, 4).tolist() == [[True] * 4] * 3


def test_record_and_input_order():
    mods = modifiers("doc[b, i] == doc[b, j]", "score + slope[h] * (j - i) * alpha",
                     {"doc": "int32", "alpha": "scalar", "slope": "float32"})
    assert mods.tensors == (("doc", "int32", 2), ("slope", "float32", 1))
    assert mods.scalars == ("alpha",)
    record = mods.record()
    assert record["mask_mod"] == "doc[b, i] == doc[b, j]"
    assert record["score_grad"] == "1"
    # the derivative in each float input's read (doc is int32 and mask_mod's: none)
    assert record["input_grads"] == {"alpha": "(-i + j)*slope[h]", "slope[h]": "alpha*(-i + j)"}
    assert record["inputs"] == {"doc": "int32", "slope": "float32", "alpha": "scalar"}
    assert mods.input_shapes(2, 3, 5, 7) == {"doc": (2, 7), "slope": (3,)}
    assert modifiers(None, "score + bias[i - j + 1024]", {"bias": "float32"}).input_shapes(1, 1, 100, 2000) == {"bias": (1124,)}


# ---- derived gradients ----------------------------------------------------------------------
def test_softcap_gradient_is_one_minus_tanh_squared():
    mods = modifiers(None, "cap * tanh(score / cap)", {"cap": "scalar"})
    cap = sp.Symbol("cap", real=True)
    assert sp.simplify(mods.score_grad - (1 - sp.tanh(SCORE / cap) ** 2)) == 0
    assert "SCORE_GRAD_IS_ONE = false" in mods.cuda_struct()


def test_alibi_gradient_is_exactly_one():
    mods = modifiers(None, "score + slope[h] * (j - i)", {"slope": "float32"})
    assert mods.score_grad == 1
    assert "SCORE_GRAD_IS_ONE = true" in mods.cuda_struct()


def test_piecewise_gradients_render():
    for text in ("max(score, 0)", "abs(score)", "where(score > 0, score, 0.1 * score)", "sigmoid(score)"):
        mods = modifiers(None, text, None)
        assert "score_grad" in mods.cuda_struct()


# ---- tile_class ------------------------------------------------------------------------------
MASKS = [
    "j <= i",
    "i - j < 8",
    "(i - j < 8) & (j <= i)",
    "(j < 4) | (j <= i)",
    "(i - j) % 3 == 0",
    "abs(i - j) <= 5",
    "(j <= i) & (i - j < 7)",
    "~(j > i)",
    "min(i, j) >= 3",
    "i // 4 == j // 4",
    "(i - j) ** 2 <= 25",
    "max(i, j) - min(i, j) != 2",
    "j * 2 <= i + 3",
    "(i + 5 >= i) & (j < Nk - 3)",
    "exp((j - i) * 0.25) > 0.5",
    "ceil(j / 3) <= i",
    "j <= i if i > 10 else j >= i",
    "j < Nk - 1 - i",
    "i + Nk - Nq != j",
    "not (0 <= i + Nk - Nq - j < 5)",
    "not ((j <= i) and (i - j < 3))",
    "(i + Nk - Nq) // 3 == j // 3",
    "i + Nk // 2 - Nq // 2 == j",
    "(i + Nk / 2 - Nq / 2) // 2 <= j",
    # fractions of integers: compared exactly (as i - j < 3), not in float32 against a float64 reference
    "(i - j) / 3 < 1",
    "j * 2 / 3 <= i - 1 / 3",
    "not ((i + 1) / 2 >= j)",
    *(text.format(window=5) for text in MASK_KIND_TEXT.values()),   # the mask kinds' own (fagen/render.py's Kind)
]


@pytest.mark.parametrize("text", MASKS)
@given(data=st.data())
def test_tile_class_is_sound(text, data):
    mods = modifiers(text, None, None)
    seq_q, seq_k = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 60))   # Nk - Nq of either sign
    i_lo = data.draw(st.integers(0, seq_q - 1))
    i_hi = data.draw(st.integers(i_lo, min(seq_q - 1, i_lo + 20)))
    j_lo = data.draw(st.integers(0, seq_k - 1))
    j_hi = data.draw(st.integers(j_lo, min(seq_k - 1, j_lo + 20)))
    i, j = np.arange(i_lo, i_hi + 1)[:, None], np.arange(j_lo, j_hi + 1)[None, :]
    visible = mods.mask_numpy(0, 0, i, j, seq_q, seq_k, {})
    tile = mods.tile_class_python(i_lo, i_hi, j_lo, j_hi, seq_q=seq_q, seq_k=seq_k)
    assert tile in (EMPTY, PARTIAL, FULL)
    # the halves the kernels ask (tile_maybe_visible, tile_all_visible) are the same decisions
    assert mods.tile_halves_python(i_lo, i_hi, j_lo, j_hi, seq_q=seq_q, seq_k=seq_k) == (tile != EMPTY, tile == FULL)
    if tile == EMPTY:
        assert not visible.any(), (text, i_lo, i_hi, j_lo, j_hi)
    if tile == FULL:
        assert visible.all(), (text, i_lo, i_hi, j_lo, j_hi)


@pytest.mark.parametrize("text, tile, expected", [
    ("j <= i", (32, 63, 0, 31), FULL),
    ("j <= i", (0, 31, 32, 63), EMPTY),
    ("j <= i", (0, 31, 0, 31), PARTIAL),
    ("(i - j < 8) & (j <= i)", (100, 131, 0, 31), EMPTY),
    ("(i - j < 8) & (j <= i)", (0, 31, 64, 95), EMPTY),
    ("i - j < 100", (0, 31, 0, 31), FULL),
    ("(j < 4) | (j <= i)", (0, 15, 0, 3), FULL),
    ("(j < 4) | (j <= i)", (0, 15, 32, 47), EMPTY),
    ("(j < 4) | (j <= i)", (64, 79, 16, 31), FULL),
    ("i + 5 >= i", (0, 15, 0, 15), FULL),
    ("abs(i - j) <= 5", (0, 15, 40, 55), EMPTY),
    ("i // 4 == j // 4", (4, 7, 4, 7), FULL),
    ("i // 4 == j // 4", (4, 7, 8, 11), EMPTY),
    ("(i - j) % 3 == 0", (3, 3, 0, 0), FULL),
    ("(i - j) % 3 == 0", (4, 4, 0, 0), EMPTY),
    ("doc[b, i] == doc[b, j]", (0, 15, 0, 15), FULL),   # one document (all zeros): decided from the summary
])
def test_tile_class_decides_the_clear_tiles(text, tile, expected):
    inputs = {"doc": "int32"} if "doc" in text else None
    mods = modifiers(text, None, inputs)
    values = {"doc": np.zeros((1, 128), dtype=np.int32)}
    assert mods.tile_class_python(*tile, seq_q=128, seq_k=128, values=values) == expected


def test_tile_class_reads_points_at_run_time():
    mods = modifiers("(i - j < w) & (j <= i) & (h < heads[0])", None, {"w": "scalar", "heads": "int32"})
    values = {"w": 8.0, "heads": np.array([2], dtype=np.int32)}
    assert mods.tile_class_python(100, 131, 0, 31, h=0, seq_q=200, seq_k=200, values=values) == EMPTY
    assert mods.tile_class_python(8, 8, 1, 8, h=1, seq_q=200, seq_k=200, values=values) == FULL
    assert mods.tile_class_python(8, 8, 1, 8, h=2, seq_q=200, seq_k=200, values=values) == EMPTY
    assert mods.tile_class_python(8, 8, 1, 8, h=0, seq_q=200, seq_k=200, values={**values, "w": 3.0}) == PARTIAL


@pytest.mark.parametrize("text, exact, python", [
    ("(i - j) / 3 < 1", "i - j < 3", lambda i, j: (i - j) / 3 < 1),
    ("j * 2 / 3 <= i - 1 / 3", "2*j <= 3*i - 1", lambda i, j: j * 2 / 3 <= i - 1 / 3),
    ("doc[b, i] / 2 == j", "Eq(doc[b, i], 2*j)", None),
    ("i + Nk / 2 - Nq / 2 != j", "Ne(Nk - Nq + 2*i, 2*j)", None),
    ("x[i] / 2 < j", "x[i]/2 < j", None),          # a float input: left as written
    ("i * 0.5 < j", "0.5*i < j", lambda i, j: i * 0.5 < j),   # a float coefficient: left as written
    # a coefficient past MAX_EXACT_COEFFICIENT would overflow the kernels' int at long sequences: left as written
    ("i / 100000 < j - 1", "i/100000 < j - 1", lambda i, j: i / 100000 < j - 1),
])
def test_comparisons_of_integer_fractions_are_made_exact(text, exact, python):
    """A comparison of integers written with fractions is parsed as its integer form: the kernel and the float64
    reference then agree where a fraction meets its bound exactly (i = 5, j = 2 in the first: 5/3 - 2/3 is not 1
    in floating point), and both agree with the same comparison written in Python on ints."""
    expr = parse(text, field="mask_mod", inputs={"doc": "int32", "x": "float32"} if "[" in text else {}, boolean=True)
    assert str(expr) == exact
    if python is not None:
        grid = np.arange(40)
        wanted = np.array([[python(int(a), int(c)) for c in grid] for a in grid])
        np.testing.assert_array_equal(modifiers(text, None, None).mask_numpy(0, 0, grid[:, None], grid[None, :], 40, 40),
                                      wanted)


# ---- the mask kinds as expressions -----------------------------------------------------------
@given(seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), window=st.integers(1, 40))
def test_mask_kinds_are_the_bottom_right_aligned_masks(seq_q, seq_k, window):
    """causal and sliding_window as expressions: the masks PyTorch and FlashAttention mean for Nq != Nk,
    written here independently of the expression (key i + Nk - Nq is query i's own)."""
    i, j = np.arange(seq_q)[:, None], np.arange(seq_k)[None, :]
    for kind in ("causal", "sliding_window"):
        got = mask_kind(kind, window).mask_numpy(0, 0, i, j, seq_q, seq_k)
        np.testing.assert_array_equal(got, _bottom_right_mask(kind, seq_q, seq_k, window), err_msg=kind)


def _bottom_right_mask(kind: str, seq_q: int, seq_k: int, window: int) -> np.ndarray:
    """causal / sliding_window as PyTorch and FlashAttention mean them for Nq != Nk (key i + Nk - Nq is query
    i's own), written without the expressions."""
    distance = np.arange(seq_q)[:, None] + (seq_k - seq_q) - np.arange(seq_k)[None, :]
    return (distance >= 0) & ((distance < window) if kind == "sliding_window" else True)


@pytest.mark.parametrize("text, inputs, band", [
    ("j <= i and (i - j < 256 or j < 4)", None, True),     # a window with sinks
    ("abs(i - j) <= 100", None, True),
    ("j <= i", None, False),                               # a triangle
    ("j < 4 or (i - j) % 64 == 0", None, False),           # a lattice
    ("j < prefix[b] or j <= i", {"prefix": "int32"}, False),   # run-time values: not known
    (None, None, False),
])
def test_sees_a_band_tells_a_band_of_keys_from_a_triangle(text, inputs, band):
    mods = modifiers(text, "score" if text is None else None, inputs)
    assert mods.sees_a_band is band


@pytest.mark.parametrize("mask, score, inputs, light", [
    ("j <= i and (i - j < 256 or j < 4)", None, None, True),     # positions only
    ("j < prefix[b] or j <= i", None, {"prefix": "int32"}, True),   # a load read once per block
    ("(i - j) % 4 == 0 and j < limit[b, h]", None, {"limit": "int32"}, True),   # % by a power of two: a mask
    ("i // 8 == (j + Nk - Nq) // 64", None, None, True),         # // by powers of two: shifts
    ("(i - j) * 2 / 3 < 16", None, None, True),                  # parsed exactly: 2 (i - j) < 48
    ("i + s >= j", None, {"s": "scalar"}, False),                # scalars are float
    ("(i + s) % 8 < 4", None, {"s": "scalar"}, False),           # py_fmod
    ("floor((i - j) * t[b]) < 64 and j <= i", None, {"t": "float32"}, False),   # floorf (8 B spilled)
    ("-(i // 2) <= (j + 3) // 4 and i % 8 != 7", None, None, True),
    ("(i - j) % 13 < 5", None, None, False),                     # a true division (ptxas: 8 B spilled)
    ("i // 7 == j // 7", None, None, False),
    ("cos((i - j) * 0.1) > 0.2 and j <= i", None, None, False),  # float arithmetic (8 B spilled)
    ("abs(i - j) < 64", None, None, False),                      # functions: not counted
    ("doc[b, i] == doc[b, j]", None, {"doc": "int32"}, False),    # a load per query and per key (104 B spilled)
    ("j <= i + shift[b, i]", None, {"shift": "int32"}, False),
    ("j <= i", "score + slope[h]", {"slope": "float32"}, True),   # (a score_mod beside it: the solver's general reservation)
    (None, "score * 0.5", None, False),                          # no mask_mod
])
def test_light_mask_mod(mask, score, inputs, light):
    """What the solver reserves fewer registers for (fagen/solver.py modifier_reservation) where it is alone: a
    mask_mod of a few integer operations, its tensor reads all hoisted out of the per-score work."""
    mods = modifiers(mask, score, inputs)
    assert mods.light_mask_mod is light
    assert mods.mask_mod_alone is (mask is not None and score is None)


@pytest.mark.parametrize("mask, score, inputs, without_head", [
    ("doc[b, i] == doc[b, j]", None, {"doc": "int32"}, True),
    ("j < prefix[b] or j <= i", None, {"prefix": "int32"}, True),
    ("j <= i and (i - j < 256 or j < 4)", None, None, True),
    ("i - j < window[h]", None, {"window": "int32"}, False),        # h in an input's indices
    ("j <= i and t[h, i - j] > 0", None, {"t": "float32"}, False),
    ("h % 2 == 0 or j <= i", None, None, False),                    # h itself
    ("doc[b, i] == doc[b, j]", "score * 0.5", {"doc": "int32"}, False),   # a score_mod beside it
    (None, "score * 0.5", None, False),
])
def test_mask_alone_without_head(mask, score, inputs, without_head):
    """A mask_mod alone with no h anywhere in it, its inputs' indices included: the same mask in every query head,
    which lets a grouped-KV backward block walk a K/V head's group with one head's walk (Spec.kv_group_foldable)."""
    assert modifiers(mask, score, inputs).mask_alone_without_head is without_head


@pytest.mark.parametrize("mask, inputs, reads_keys", [
    ("doc[b, i] == doc[b, j]", {"doc": "int32"}, True),
    ("j <= i and t[h, i - j] > 0", {"t": "float32"}, True),       # a table at the distance: per key as well
    ("j <= i + shift[b, i]", {"shift": "int32"}, False),          # per query row only
    ("j < prefix[b] or j <= i", {"prefix": "int32"}, False),       # hoisted
    ("(i - j) % 13 < 5", None, False),
    (None, None, False),
])
def test_mask_reads_keys(mask, inputs, reads_keys):
    """A mask_mod that reads an input at a key position, which forward_wgmma tests ahead of the tile's scores: the
    generated struct says so (MASK_READS_KEYS), and the solver reserves key_mask_mod_registers for it alone."""
    mods = modifiers(mask, None if mask else "score * 0.5", inputs)
    assert mods.mask_reads_keys is reads_keys
    assert f"MASK_READS_KEYS = {'true' if reads_keys else 'false'};" in mods.cuda_struct()


def test_mask_kind_structs_compute_in_int_from_one_member():
    """The kinds' structs read Nk - Nq once (a member, not both lengths per test), compare with their window
    as a constant and compute in int, as the hand-written tests did (each of those kept a kernel at the
    register edge spill-free; tests/test_compiler.py checks the kernels)."""
    for kind in MASK_KIND_TEXT:
        text = mask_kind_struct(kind, 128)
        assert "int c0;   // Nk - Nq, once" in text and "c0 = " in text
        tiles = text[text.index("bool tile_maybe_visible("):]
        assert "long long" not in tiles and "seq_q" not in tiles and "seq_k" not in tiles
        assert ("< 128" in tiles) == (kind == "sliding_window")
    assert mask_kind("none") is None and mask_kind("padding") is None and mask_kind("block_sparse") is None


def test_no_mask_tile_class_is_full():
    mods = modifiers(None, "score * 2", None)
    assert mods.tile_class_python(0, 5, 0, 5) == FULL
    assert "return fagen::TILE_FULL;" in mods.cuda_struct()


# ---- the CUDA struct compiles -----------------------------------------------------------------
COMPILE_SETS = [
    ("j <= i", "score + slope[h] * (j - i)", {"slope": "float32"}),
    ("(i - j < w) & (j <= i)", "cap * tanh(score / cap)", {"w": "scalar", "cap": "scalar"}),
    ("doc[b, i] == doc[b, j]", None, {"doc": "int32"}),
    (None, "score + bias[i - j + 1024]", {"bias": "float32"}),
    ("(i - j) % 3 == 0", "max(score, 0) + abs(score) * sigmoid(score)", None),
    ("(i // 4 == j // 4) | (min(i, j) >= 3) & (exp(0.1 * i) > sqrt(j + 1.0))",
     "where(i > j, score ** 2, log(1 + abs(score))) + 2 ** (i - j) + i ** 3 % 5", None),
    ("ceil(j / 3) <= i // 2 and (j <= i if i > 10 else j >= i)", "score / (1 + (i - j) ** 2)", None),
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_struct_compiles(tmp_path):
    parts = ['#include "attention_common.cuh"', "using namespace fagen;"]
    calls = []
    for k, (mask, score, inputs) in enumerate(COMPILE_SETS):
        parts.append(f"namespace mods{k} {{\n{modifiers(mask, score, inputs).cuda_struct('SpecMods')}}}")
        calls.append(f"""  {{
    mods{k}::SpecMods mods(args, blockIdx.x, blockIdx.y, 64, 80);
    out[{k}] = (mods.visible(threadIdx.x, threadIdx.y) ? 1.f : 0.f) + mods.tile_class(0, 15, 16, 31)
             + mods.score(out[{k}], threadIdx.x, threadIdx.y, (float)threadIdx.x, (float)threadIdx.y)
             + mods.score_grad(out[{k}], threadIdx.x, threadIdx.y, (float)threadIdx.x, (float)threadIdx.y)
             + (mods{k}::SpecMods::HAS_MASK + mods{k}::SpecMods::HAS_SCORE + mods{k}::SpecMods::SCORE_GRAD_IS_ONE);
  }}""")
    parts.append("__global__ void exercise(AttentionArgs args, float* out) {\n" + "\n".join(calls) + "\n}")
    source = tmp_path / "mods.cu"
    source.write_text("\n".join(parts) + "\n")
    result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_80", "-I", str(TEMPLATES), "-c", str(source),
                             "-o", str(tmp_path / "mods.o")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


# ---- numpy evaluators ----------------------------------------------------------------------
def _grid(batch=2, heads=3, seq_q=7, seq_k=9):
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(heads)[None, :, None, None]
    i = np.arange(seq_q)[None, None, :, None]
    j = np.arange(seq_k)[None, None, None, :]
    return b, h, i, j, seq_q, seq_k


def _direct(function, batch=2, heads=3, seq_q=7, seq_k=9):
    return np.array([[[[function(b, h, i, j) for j in range(seq_k)] for i in range(seq_q)]
                      for h in range(heads)] for b in range(batch)])


def test_mask_numpy_matches_python():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 3, size=(2, 9)).astype(np.int32)
    cases = [
        ("j <= i", lambda b, h, i, j: j <= i),
        ("(j < prefix) | (j <= i)", lambda b, h, i, j: j < 2.5 or j <= i),
        ("(i - j) % 2 == 0", lambda b, h, i, j: (i - j) % 2 == 0),
        ("i - j < 3 or j < 1", lambda b, h, i, j: i - j < 3 or j < 1),
        ("doc[b, i] == doc[b, j]", lambda b, h, i, j: doc[b, min(i, 8)] == doc[b, j]),
        ("(i - 7) // 3 == (j - 7) // 3", lambda b, h, i, j: (i - 7) // 3 == (j - 7) // 3),
        ("Nk - j <= Nq - i + h", lambda b, h, i, j: 9 - j <= 7 - i + h),
        ("True", lambda b, h, i, j: True),
    ]
    for text, direct in cases:
        inputs = {name: kind for name, kind in (("prefix", "scalar"), ("doc", "int32")) if name in text}
        mods = modifiers(text, None, inputs)
        got = mods.mask_numpy(*_grid(), {"prefix": 2.5, "doc": doc})
        assert got.dtype == bool and got.shape == (2, 3, 7, 9)
        np.testing.assert_array_equal(got, _direct(direct), err_msg=text)


def test_score_numpy_matches_python():
    rng = np.random.default_rng(1)
    slope = rng.standard_normal(3)
    bias = rng.standard_normal(20)
    score = rng.standard_normal((2, 3, 7, 9)) * 4
    cases = [
        ("score + slope[h] * (j - i)", lambda s, b, h, i, j: s + slope[h] * (j - i), lambda s, b, h, i, j: 1.0),
        ("cap * tanh(score / cap)", lambda s, b, h, i, j: 3.0 * math.tanh(s / 3.0),
         lambda s, b, h, i, j: 1 - math.tanh(s / 3.0) ** 2),
        ("score + bias[i - j + 10]", lambda s, b, h, i, j: s + bias[min(max(i - j + 10, 0), 19)], lambda *a: 1.0),
        ("max(score, 0) + 0.5 * (i % 3)", lambda s, b, h, i, j: max(s, 0) + 0.5 * (i % 3),
         lambda s, b, h, i, j: 1.0 if s > 0 else 0.0),
        ("where(i >= j, score, sigmoid(score))", lambda s, b, h, i, j: s if i >= j else 1 / (1 + math.exp(-s)),
         lambda s, b, h, i, j: 1.0 if i >= j else math.exp(-s) / (1 + math.exp(-s)) ** 2),
        ("score / (1 + (i - j) ** 2)", lambda s, b, h, i, j: s / (1 + (i - j) ** 2),
         lambda s, b, h, i, j: 1 / (1 + (i - j) ** 2)),
    ]
    for text, direct, derivative in cases:
        inputs = {name: kind for name, kind in (("slope", "float32"), ("cap", "scalar"), ("bias", "float32"))
                  if name in text}
        mods = modifiers(None, text, inputs)
        values = {"slope": slope, "cap": 3.0, "bias": bias}
        b, h, i, j, seq_q, seq_k = _grid()
        got = mods.score_numpy(score, b, h, i, j, seq_q, seq_k, values)
        grad = mods.score_grad_numpy(score, b, h, i, j, seq_q, seq_k, values)
        want = _direct(lambda bb, hh, ii, jj: direct(score[bb, hh, ii, jj], bb, hh, ii, jj))
        want_grad = _direct(lambda bb, hh, ii, jj: derivative(score[bb, hh, ii, jj], bb, hh, ii, jj))
        assert got.dtype == np.float64 and got.shape == score.shape and grad.shape == score.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=text)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12, err_msg=text)


def test_modifiers_is_frozen():
    mods = modifiers("j <= i", None, None)
    assert isinstance(mods, Modifiers)
    with pytest.raises(Exception):
        mods.mask = None


# ---- the C++ agrees with numpy (the struct built for the host with g++, no GPU needed) -------------
HOST_SHIM = """\
#include <math.h>
#include <stdio.h>
#include <algorithm>
#define __device__
#define __forceinline__ inline
using std::min; using std::max;
static inline float rsqrtf(float x) { return 1.f / sqrtf(x); }
static inline float atomicAdd(float* address, float value) { const float old = *address; *address += value; return old; }
static inline float __shfl_xor_sync(unsigned, float, int) { return 0.f; }   // one host "lane": no other lane adds
namespace fagen {
struct AttentionArgs { const void* mod_tensor[4]; long long mod_size[4][2]; long long mod_stride[4][2]; double mod_scalar[4];
                       void* mod_summary[4]; float* mod_grad[4]; };
enum TileClass { TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };
struct Index { long long x; };
static const Index blockIdx{0}, threadIdx{0}, blockDim{1}, gridDim{1};   // one host "thread" does every entry
template <int LANES, typename T, typename Op> T lanes_combine(T x, Op) { return x; }   // one lane: nothing to combine
}
using fagen::threadIdx;   // (CUDA's is global)
"""


def _summarise_input_source() -> str:
    """templates/shared_constants.cuh's SUMMARY_GRAIN and attention_common.cuh's summarise_input, for the host
    build."""
    shared = (TEMPLATES / "shared_constants.cuh").read_text()
    grain = next(line for line in shared.splitlines() if line.startswith("constexpr int SUMMARY_GRAIN"))
    text = (TEMPLATES / "attention_common.cuh").read_text()
    start = text.index("// (SUMMARY_GRAIN: the tiles' own grain")
    end = text.index("\n}\n", text.index("__device__ void summarise_input")) + 3
    return "namespace fagen {\n" + grain + "\n" + text[start:end] + "}\n"

HOST_SETS = COMPILE_SETS + [
    ("(i - 7) // 3 == (j - 7) // -2", "score * ((i - j) % -3) + (j - i) % 4", None),
    ("doc[b, i - 1] == doc[b, j + 1]", "score - doc[b, j] * 0.5", {"doc": "int32"}),
    # powers of two become a mask and shifts (negative operands included: Python's rounding toward -inf)
    ("(i - 9) // 4 == (j - 5) // 2 or (i - j) % 8 == 1", "score * ceil((j - 7) / 4) + (i - 11) % 2 + (j - 6) // 1", None),
    # sums of lengths hoisted into int members (Nk - Nq), and ones that must not be (a scalar's, a rational one)
    ("(i + Nk - Nq) // 3 == j // 3 and not (0 <= i + Nk - Nq - j < 5)", None, None),
    ("i + s + Nk - Nq == j or i + Nk // 2 - Nq // 2 != j + 1", None, {"s": "scalar"}),
    ("ceil((i + Nk - Nq) / 3) >= j and (i + Nk / 2 - Nq / 2) // 2 <= j", None, None),
    ("(i - j) / 3 < 1 and j * 2 / 3 <= i - 1 / 3 or doc[b, i] / 2 == j", None, {"doc": "int32"}),
]


def _host_inputs(mods, rng):
    """Random values for the inputs and the C++ that puts them in an AttentionArgs (and runs the summaries)."""
    values, tensors = {}, []
    for k, (name, dtype, ndim) in enumerate(mods.tensors):
        shape = (2, 9)[-ndim:] if ndim == 2 else (7,)
        array = rng.integers(-2, 3, size=shape).astype(np.int32) if dtype == "int32" else \
            rng.standard_normal(shape).astype(np.float32)
        values[name] = array
        ctype = "int" if dtype == "int32" else "float"
        init = ", ".join(repr(float(x)) if dtype == "float32" else str(int(x)) for x in array.ravel())
        strides = [s // array.itemsize for s in array.strides] + [0]
        sizes = list(array.shape) + [1]
        tensors.append(f"  static const {ctype} t{k}[] = {{{init}}}; args.mod_tensor[{k}] = t{k};\n"
                       f"  args.mod_size[{k}][0] = {sizes[0]}; args.mod_size[{k}][1] = {sizes[1]};\n"
                       f"  args.mod_stride[{k}][0] = {strides[0]}; args.mod_stride[{k}][1] = {strides[1]};\n")
    for k, name in enumerate(mods.scalars):
        values[name] = float(k + 3)
        tensors.append(f"  args.mod_scalar[{k}] = {values[name]!r};\n")
    for k, dim in mods.summaries:   # the summary kernel's work, done on the host before the struct reads it
        name, dtype, _ = mods.tensors[k]
        ctype = "int" if dtype == "int32" else "float"
        shape = values[name].shape + (1,) * (2 - values[name].ndim)
        entries = shape[1 - dim] * -(-shape[dim] // 16)
        tensors.append(f"  static {ctype} u{k}[{2 * entries}]; args.mod_summary[{k}] = u{k};\n"
                       f"  fagen::summarise_input<{ctype}, 1>(args, {k}, {dim});\n")   # one host lane
    return values, tensors


def _run_on_host(tmp_path, mods, main: str, scale: float = 1.0, struct: str = ""):
    """The spec's struct (for softmax scale `scale`; or `struct`, C++ given as it is) and `main` compiled with g++
    and run: its output lines."""
    source = tmp_path / "host.cpp"
    source.write_text(HOST_SHIM + _summarise_input_source() + (struct or mods.cuda_struct("SpecMods", scale)) + main)
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp_path / "host"), str(source)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    return iter(subprocess.run([str(tmp_path / "host")], capture_output=True, text=True, check=True).stdout.split("\n"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("mask, score, inputs", HOST_SETS)
def test_cuda_struct_agrees_with_numpy_on_the_host(tmp_path, mask, score, inputs):
    mods = modifiers(mask, score, inputs)
    rng = np.random.default_rng(2)
    seq_q, seq_k, b, h = 13, 11, 1, 2
    values, tensors = _host_inputs(mods, rng)
    scores = [-3.0, -0.5, 0.0, 0.25, 2.0]
    tiles = [(0, 3, 0, 3), (4, 7, 0, 3), (0, 3, 8, 10), (8, 12, 0, 10), (2, 2, 5, 5)]
    main = ("int main() {\n  fagen::AttentionArgs args{};\n" + "".join(tensors)
            + f"  SpecMods mods(args, {b}, {h}, {seq_q}, {seq_k});\n"
            + f"  for (int i = 0; i < {seq_q}; ++i) for (int j = 0; j < {seq_k}; ++j) {{\n"
            + '    printf("%d\\n", (int)mods.visible(i, j));\n'
            + "".join(f'    printf("%.9g %.9g %.9g\\n", mods.score({s!r}f, i, j, i, j), mods.score_grad({s!r}f, i, j, i, j), '
                      f'mods.raw_score({s!r}f, i, j, i, j));\n' for s in scores)
            + "  }\n"
            + "".join(f'  printf("%d %d %d\\n", mods.tile_class({a}, {c}, {d}, {e}), (int)mods.tile_maybe_visible({a}, {c}, {d}, {e}), '
                      f'(int)mods.tile_all_visible({a}, {c}, {d}, {e}));\n' for a, c, d, e in tiles)
            + "}\n")
    tau = 0.3   # raw_score(s) = score_mod(tau s) / tau: what the kernels apply to q.k
    lines = _run_on_host(tmp_path, mods, main, scale=tau)
    i, j = np.arange(seq_q)[:, None], np.arange(seq_k)[None, :]
    visible = mods.mask_numpy(b, h, i, j, seq_q, seq_k, values)
    s = np.array(scores)
    for ii in range(seq_q):
        for jj in range(seq_k):
            assert int(next(lines)) == visible[ii, jj], (ii, jj)
            want = mods.score_numpy(s, b, h, ii, jj, seq_q, seq_k, values)
            want_grad = mods.score_grad_numpy(s, b, h, ii, jj, seq_q, seq_k, values)
            want_raw = mods.score_numpy(tau * s, b, h, ii, jj, seq_q, seq_k, values) / tau
            for k in range(len(scores)):
                got, got_grad, got_raw = map(float, next(lines).split())
                np.testing.assert_allclose(got_raw, want_raw[k], rtol=2e-5, atol=2e-5, err_msg=f"raw {ii} {jj} {scores[k]}")
                np.testing.assert_allclose(got, want[k], rtol=2e-5, atol=2e-5, err_msg=f"score {ii} {jj} {scores[k]}")
                np.testing.assert_allclose(got_grad, want_grad[k], rtol=2e-5, atol=2e-5,
                                           err_msg=f"grad {ii} {jj} {scores[k]}")
    for tile in tiles:
        tile_class, maybe, full = map(int, next(lines).split())
        assert tile_class == mods.tile_class_python(*tile, b=b, h=h, seq_q=seq_q, seq_k=seq_k, values=values), tile
        # the halves the kernels call: the same decisions, and sound against the mask itself
        assert (maybe, full) == (tile_class != 0, tile_class == 2), tile
        inside = visible[tile[0]:tile[1] + 1, tile[2]:tile[3] + 1]
        assert (maybe or not inside.any()) and (not full or inside.all()), tile


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("kind", sorted(MASK_KIND_TEXT))
def test_mask_kind_struct_agrees_with_the_masks_on_the_host(tmp_path, kind):
    """The mask kinds' structs as printed (int, hoisted Nk - Nq, mask only), run on the host: visible() is the
    bottom-right-aligned mask and the two tile tests decide every tile exactly, at Nq < Nk, Nq = Nk, Nq > Nk."""
    window, size = 5, 4
    for seq_q, seq_k in ((9, 14), (12, 12), (14, 9)):
        tiles = [(a, min(a + size, seq_q) - 1, c, min(c + size, seq_k) - 1)
                 for a in range(0, seq_q, size) for c in range(0, seq_k, size)]
        main = ("int main() {\n  fagen::AttentionArgs args{};\n"
                + f"  KindMask mask(args, 0, 0, {seq_q}, {seq_k});\n"
                + f"  for (int i = 0; i < {seq_q}; ++i) for (int j = 0; j < {seq_k}; ++j) printf(\"%d\\n\", (int)mask.visible(i, j));\n"
                + "".join(f'  printf("%d %d\\n", (int)mask.tile_maybe_visible({a}, {b}, {c}, {d}), '
                          f'(int)mask.tile_all_visible({a}, {b}, {c}, {d}));\n' for a, b, c, d in tiles)
                + "}\n")
        lines = _run_on_host(tmp_path, None, main, struct=mask_kind_struct(kind, window))
        expected = _bottom_right_mask(kind, seq_q, seq_k, window)
        got = np.array([int(next(lines)) for _ in range(seq_q * seq_k)]).reshape(seq_q, seq_k)
        np.testing.assert_array_equal(got, expected, err_msg=f"{kind} {seq_q} x {seq_k}")
        for a, b, c, d in tiles:
            inside = expected[a:b + 1, c:d + 1]
            assert tuple(map(int, next(lines).split())) == (inside.any(), inside.all()), (kind, seq_q, seq_k, a, c)


@pytest.mark.parametrize("score, inputs, derived, left_out", [
    ("score + floor(bias[h])", {"bias": "float32"}, {}, ["bias[h]"]),
    ("score * floor(s)", {"s": "scalar"}, {}, ["s"]),
    ("score + bias[h] % 2 + w[h]", {"bias": "float32", "w": "float32"}, {"w[h]": "1"}, ["bias[h]"]),
    ("max(score, w[h])", {"w": "float32"}, {"w[h]": "Heaviside(-score + w[h])"}, []),
])
def test_input_reads_without_a_printable_derivative_are_left_out_not_errors(score, inputs, derived, left_out):
    """floor, ceil and % of an input have no derivative sympy can print: the spec stays valid (as it was
    before input gradients were derived), the record says which reads were left out, and the reference
    refuses to give a partial gradient."""
    from fagen.reference import score_input_grads
    from fagen.spec import Spec

    spec = Spec(head_dim=8, dtype="fp32", score_mod=score, inputs=inputs)
    record = spec.modifiers.record()
    assert record["input_grads"] == derived
    assert sorted(record.get("input_grads_not_derived", {})) == left_out
    assert "INPUT_GRADS" in spec.modifiers.cuda_struct()
    if left_out:
        rng = np.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((1, 1, 3, 8)) for _ in range(4))
        values = {name: 1.5 if kind == "scalar" else np.ones(4) for name, kind in inputs.items()}
        with pytest.raises(ValueError, match="no derivative of score_mod in"):
            score_input_grads(q, k, v, do, spec, inputs=values)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
@pytest.mark.parametrize("score, inputs", [
    ("score - slope[h] * (i - j)", {"slope": "float32"}),
    ("cap * tanh(score / cap)", {"cap": "scalar"}),
    # a table read off both of its ends (clamped), two reads of one tensor, a scalar and a product with score
    ("score * (1 + t[i]) - t[j] + alpha * score + bias[h, i - j + 3]", {"t": "float32", "alpha": "scalar",
                                                                       "bias": "float32"}),
    ("score + w[doc[b, j]] * (j - i)", {"doc": "int32", "w": "float32"}),
    ("score + w[h] * tanh(score) + g[b, h]", {"w": "float32", "g": "float32"}),
])
def test_input_grads_accumulate_on_the_host_as_numpy_scatters_them(tmp_path, score, inputs):
    """The generated add_input_grads / flush_input_grads, run on the host over every (i, j) with a score and a
    dS' per element, leave in each tensor input's gradient buffer what numpy gets by evaluating each read's
    derivative and scattering dS' * it to the (clamped) element the read loads -- what
    reference.score_input_grads does. Scalar inputs get none (kernel_input_grads leaves them out)."""
    mods = modifiers(None, score, inputs)
    reads = mods.kernel_input_grads
    assert all(name not in mods.scalars for name, _, _ in reads)
    assert len(reads) == len([r for r in mods.input_grads if r[0] not in mods.scalars])
    rng = np.random.default_rng(5)
    seq_q, seq_k, b, h = 9, 12, 1, 1
    values, setup = _host_inputs(mods, rng)
    score_of = rng.uniform(-2.5, 2.5, size=(seq_q, seq_k)).astype(np.float32)
    ds_of = rng.uniform(-1.0, 1.0, size=(seq_q, seq_k)).astype(np.float32)
    grads = [(k, name) for k, (name, _, _) in enumerate(mods.tensors) if name in {r[0] for r in reads}]
    buffers = "".join(f"  static float g{k}[{values[name].size}] = {{}}; args.mod_grad[{k}] = g{k};\n"
                      for k, name in grads)
    table = lambda name, a: "{" + ", ".join(repr(float(x)) for x in a.ravel()) + "}"  # noqa: E731
    main = ("int main() {\n  fagen::AttentionArgs args{};\n" + "".join(setup) + buffers
            + f"  static const float scores[] = {table('s', score_of)}, ds[] = {table('d', ds_of)};\n"
            + f"  SpecMods mods(args, {b}, {h}, {seq_q}, {seq_k});\n"
            + f"  float sums[SpecMods::INPUT_GRAD_SUMS] = {{}};\n"
            + f"  for (int i = 0; i < {seq_q}; ++i) for (int j = 0; j < {seq_k}; ++j)\n"
            + f"    mods.add_input_grads(ds[i * {seq_k} + j], scores[i * {seq_k} + j], i, j, sums);\n"
            + "  mods.flush_input_grads(sums);\n"
            + "".join(f'  for (int n = 0; n < {values[name].size}; ++n) printf("%.9g\\n", g{k}[n]);\n'
                      for k, name in grads)
            + "}\n")
    lines = _run_on_host(tmp_path, mods, main)
    i, j = np.arange(seq_q)[:, None], np.arange(seq_k)[None, :]
    want = {name: np.zeros(values[name].shape) for _, name in grads}
    for name, read, derivative in reads:
        slope = np.broadcast_to(mods.float_numpy(derivative, score_of.astype(np.float64), b, h, i, j, seq_q, seq_k,
                                                 values), score_of.shape)
        where = tuple(np.clip(np.broadcast_to(np.asarray(mods.index_numpy(x, b, h, i, j, seq_q, seq_k, values)),
                                              score_of.shape), 0, size - 1)
                      for x, size in zip(read.indices, values[name].shape))
        np.add.at(want[name], where, ds_of * slope)
    for _, name in grads:
        got = np.array([float(next(lines)) for _ in range(values[name].size)]).reshape(values[name].shape)
        np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    if not grads:
        assert "INPUT_GRADS = 0" in mods.cuda_struct()


# ---- run-time summaries (tile decisions that depend on an input's values) -------------------------
def test_document_mask_is_summarised_along_the_position_dimension():
    mods = modifiers("doc[b, i] == doc[b, j]", None, {"doc": "int32"})
    assert mods.summaries == ((0, 1),)
    assert "summarise_input<int>(args, 0, 1)" in mods.summary_kernel("k_summary")
    assert modifiers("j <= i", None, None).summaries == ()
    assert modifiers(None, "score + bias[h, i - j]", {"bias": "float32"}).summaries == (), "score_mod: no tiles"
    # a tensor indexed by a position in both dimensions cannot be summarised: undecided, still sound
    both = modifiers("keep[i, j] > 0", None, {"keep": "int32"})
    assert both.summaries == ()


@given(data=st.data())
def test_summarised_tile_class_is_sound_and_skips_other_documents(data):
    mods = modifiers("j <= i and doc[b, i] == doc[b, j]", None, {"doc": "int32"})
    n = data.draw(st.integers(1, 70))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    ids = np.repeat(np.arange(len(lengths)), lengths)[:n]
    doc = np.stack([np.pad(ids, (0, n - ids.size), mode="edge"), np.sort(np.arange(n) % 3)]).astype(np.int32)
    b = data.draw(st.integers(0, 1))
    i_lo, j_lo = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n - 1))
    i_hi, j_hi = data.draw(st.integers(i_lo, n - 1)), data.draw(st.integers(j_lo, n - 1))
    got = mods.tile_class_python(i_lo, i_hi, j_lo, j_hi, b=b, seq_q=n, seq_k=n, values={"doc": doc})
    i, j = np.arange(i_lo, i_hi + 1)[:, None], np.arange(j_lo, j_hi + 1)[None, :]
    visible = mods.mask_numpy(b, 0, i, j, n, n, {"doc": doc})
    if got == EMPTY:
        assert not visible.any()
    if got == FULL:
        assert visible.all()


def test_summarised_tiles_of_distinct_documents_are_empty():
    mods = modifiers("doc[b, i] == doc[b, j]", None, {"doc": "int32"})
    doc = np.repeat(np.arange(4), 64)[None].astype(np.int32)   # four documents of 64 tokens
    assert mods.tile_class_python(128, 191, 0, 63, values={"doc": doc}, seq_q=256, seq_k=256) == EMPTY
    assert mods.tile_class_python(64, 127, 64, 127, values={"doc": doc}, seq_q=256, seq_k=256) == FULL
    assert mods.tile_class_python(32, 95, 0, 63, values={"doc": doc}, seq_q=256, seq_k=256) == PARTIAL


# ---- Python callables and sympy expressions -----------------------------------------------------
def test_callables_trace_to_text_that_means_the_same():
    from fagen.expressions import as_text

    def window_sinks(q_idx, kv_idx):            # FlexAttention's parameter names are accepted
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < 6) | (kv_idx < 2))

    def bias(score, h, i, j, table, scale):
        return score * scale + table[h, i - j] - (i // 3) % 2

    cases = [("mask_mod", window_sinks, "(j <= i) and (i - j < 6 or j < 2)", {}),
             ("score_mod", bias, "score * scale + table[h, i - j] - (i // 3) % 2", {"table": "float32", "scale": "scalar"})]
    rng = np.random.default_rng(0)
    values = {"table": rng.standard_normal((2, 40)).astype(np.float32), "scale": 0.7}
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    for field, function, written, inputs in cases:
        text = as_text(function, field, inputs)
        traced = modifiers(*((text, None) if field == "mask_mod" else (None, text)), inputs or None)
        direct = modifiers(*((written, None) if field == "mask_mod" else (None, written)), inputs or None)
        if field == "mask_mod":
            assert np.array_equal(traced.mask_numpy(0, 1, i, j, 9, 9, values), direct.mask_numpy(0, 1, i, j, 9, 9, values))
        else:
            score = rng.standard_normal((9, 9))
            np.testing.assert_allclose(traced.score_numpy(score, 0, 1, i, j, 9, 9, values),
                                       direct.score_numpy(score, 0, 1, i, j, 9, 9, values))


def test_sympy_expressions_are_written_back_as_text():
    from fagen.expressions import I, J, as_text

    text = as_text(sp.Eq(sp.Mod(I - J, 4), 0) & (J <= I), "mask_mod")
    assert modifiers(text, None, None).mask == modifiers("(i - j) % 4 == 0 and j <= i", None, None).mask


@pytest.mark.parametrize("function, needle", [
    (lambda i, j: i > j and j > 0, "no truth value"),
    (lambda i, j, k: j <= i, "parameter 'k'"),
    (lambda i, j: "x", "returned str"),
    (lambda i, j: math.floor(i) > j, "has no number"),
])
def test_callables_that_cannot_be_traced_say_why(function, needle):
    from fagen.expressions import as_text

    with pytest.raises(ExpressionError, match=needle):
        as_text(function, "mask_mod", {})


# ---- the mask kinds as expressions: the derived tile decisions are exact ---------------------------
@pytest.mark.parametrize("kind, text", [
    ("causal", MASK_KIND_TEXT["causal"]),
    ("sliding_window", MASK_KIND_TEXT["sliding_window"].format(window=37)),
    ("padding", "j < length[b]"),
])
@given(data=st.data())
def test_mask_kinds_written_as_mask_mods_are_decided_exactly(kind, text, data):
    """causal and sliding_window are rendered from these expressions (MASK_KIND_TEXT), and padding (a key count
    in the kernels) written as a mask_mod: interval arithmetic decides every tile of them exactly, EMPTY exactly
    when no pair is visible, FULL exactly when all are (affine bounds are tight), as the hand-written tests
    the kinds had before did: an empty tile is never loaded, a full one never tested per element."""
    mods = modifiers(text, None, {"length": "int32"} if "length" in text else None)
    seq_q, seq_k = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 300))
    values = {"length": np.array([data.draw(st.integers(0, seq_k))], dtype=np.int32)}
    i_lo, j_lo = data.draw(st.integers(0, seq_q - 1)), data.draw(st.integers(0, seq_k - 1))
    i_hi, j_hi = data.draw(st.integers(i_lo, seq_q - 1)), data.draw(st.integers(j_lo, seq_k - 1))
    got = mods.tile_class_python(i_lo, i_hi, j_lo, j_hi, seq_q=seq_q, seq_k=seq_k, values=values)
    visible = mods.mask_numpy(0, 0, np.arange(i_lo, i_hi + 1)[:, None], np.arange(j_lo, j_hi + 1)[None, :],
                              seq_q, seq_k, values)
    assert got == (FULL if visible.all() else EMPTY if not visible.any() else PARTIAL)


# ---- fuzzing the parser: an expression builds, or fails with one ExpressionError line, within seconds ------
_NUMBERS = st.sampled_from(["0", "1", "2", "3", "7", "0.5", "1e-30", "1e30", "1e39", "2147483647", "2147483648", "10",
                            "100", "1e-46", "0.0", "-1"])
_POSITIONS = st.sampled_from(["i", "j", "b", "h", "Nq", "Nk", "doc[b, i]", "doc[b, j]", "(i - j)"])


def _numeric(atoms, depth: int):
    """Well-typed number expressions (with the odd constant that must be refused: 1e39, 2**31, 1e-46)."""
    if depth == 0:
        return atoms | _NUMBERS
    inner = st.deferred(lambda: _numeric(atoms, depth - 1))
    condition = st.deferred(lambda: _boolean(atoms, depth - 1))
    return st.one_of(
        atoms, _NUMBERS,
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "**"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["tanh", "exp", "log", "sqrt", "abs", "floor", "ceil", "sigmoid", "sin", "cos"]),
                  inner).map(lambda t: f"{t[0]}({t[1]})"),
        st.tuples(st.sampled_from(["min", "max"]), inner, inner).map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(condition, inner, inner).map(lambda t: f"where({t[0]}, {t[1]}, {t[2]})"),
        st.tuples(inner, condition, inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
        inner.map(lambda t: f"-{t}"))


def _boolean(atoms, depth: int):
    inner = st.deferred(lambda: _boolean(atoms, depth - 1)) if depth else st.sampled_from(["True", "i < j"])
    number = _numeric(atoms, max(depth - 1, 0))
    return st.one_of(
        st.tuples(number, st.sampled_from(["<", "<=", ">", ">=", "==", "!="]), number).map(" ".join),
        st.tuples(inner, st.sampled_from(["and", "or", "&", "|"]), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda t: f"not ({t})"))


_GARBAGE = st.lists(st.sampled_from(list("ij+-*/()[],.<>=!#\\ 0123456789e") + ["\u00e9", "\x00", "**", "if", "score",
                                                                                "lambda", "else", "doc", "zz"]),
                    max_size=30).map("".join)
_MASK_ATOMS = _POSITIONS
_SCORE_ATOMS = _POSITIONS | st.sampled_from(["score", "score", "cap", "bias[h]", "bias[i - j]"])


@settings(max_examples=150)
@given(mask=st.none() | _boolean(_MASK_ATOMS, 3) | _GARBAGE, score=st.none() | _numeric(_SCORE_ATOMS, 3) | _GARBAGE)
def test_fuzzed_expressions_build_or_raise_one_expression_error(mask, score):
    import time

    text = f"{mask} {score}"
    inputs = {name: kind for name, kind in (("doc", "int32"), ("bias", "float32"), ("cap", "scalar"))
              if name in text}
    start = time.perf_counter()
    try:
        result = modifiers(mask, score, inputs)
    except ExpressionError as err:
        assert "\n" not in str(err)
    else:
        assert result.cuda_struct("SpecMods", 0.125)   # it prints, at a scale other than 1 too
    assert time.perf_counter() - start < 5, (mask, score)
