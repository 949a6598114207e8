"""Stage 1b: a spec's attention modifiers (mask_mod, score_mod) as sympy, CUDA and numpy.

The package, by job: `names` (the symbols, functions and limits an expression may use), `parse` (text -> sympy),
`trace` (Python callables and sympy -> text), `cuda` (sympy -> C++), `evaluate` (sympy -> numpy, for the
reference), `bounds` (the tile tests as interval arithmetic), `modifiers` (the result, `Modifiers`, and the mask
kinds that are expressions).

A spec may carry two user-written expressions (FlexAttention's idea, written as text so that a spec
stays plain data):

    mask_mod   a boolean of b, h, i, j, Nq, Nk and declared inputs   ("doc[b, i] == doc[b, j]")
    score_mod  a number of score (= tau * q.k) and the same names    ("cap * tanh(score / cap)")

The text is parsed once, here, and every later stage consumes the result:

    text --ast--> sympy --+--> C++ struct SpecMods   (render: visible, the tile tests, score, score_grad)
                          +--> numpy evaluators      (reference: the float64 ground truth)
                          +--> interval IR           (the tile tests, evaluable in Python for the tests)

The mask kinds causal and sliding_window are such expressions too (MASK_KIND_TEXT, at the end): printed the
same way, as struct KindMask, with only the mask.

* Parsing walks Python's `ast` by hand: user text is never `eval`ed, and every construct that is not
  on the list below fails with a one-line ExpressionError that names it.
* sympy is the single source of truth: the backward's d(score_mod)/d(score) is `sympy.diff`, and the
  C++ and numpy code are both printed from the same expression trees, so kernel and reference agree.
* The tile tests (may a Br x Bc tile hold a visible pair? is every pair visible? tile_class: both as
  empty / partial / full) are interval arithmetic decided at generation time and emitted as straight-line
  code. The code is first built as a small
  SSA list (`_Program`) that prints as C++ and also runs in Python, so the tests check the very logic
  the kernel runs against brute force.

Semantics follow Python: `/` is true division, `//` floors, `%` takes the divisor's sign. Integer
subexpressions (sympy's `is_integer`) are computed in int, everything else in float; tensor indices
are clamped into the tensor, so no expression can read out of bounds.
"""
from fagen.expressions.names import (B, FLT_TRUE_MIN, FUNCTIONS, H, I, INPUT_KINDS, J, MAX_EXPONENT,
                                     MAX_EXPRESSION_CHARS, MAX_EXPRESSION_DEPTH, MAX_EXPRESSION_NODES, MAX_SCALARS,
                                     MAX_TENSORS, NK, NQ, POSITION_SYMBOLS, RESERVED, SCORE, SUMMARY_GRAIN,
                                     ExpressionError)
from fagen.expressions.parse import MAX_EXACT_COEFFICIENT, parse
from fagen.expressions.trace import Traced, as_text, to_text, trace
from fagen.expressions.modifiers import (MASK_KIND_TEXT, SIMPLIFY_MAX_OPS, SIMPLIFY_MAX_PIECES, Modifiers, mask_kind,
                                         mask_kind_struct, modifiers)

__all__ = ["ExpressionError", "Modifiers", "modifiers", "parse", "trace", "to_text", "as_text", "Traced", "INPUT_KINDS",
           "FUNCTIONS"]
