"""The names an expression may use: the index symbols, the functions, the limits, ExpressionError."""
from __future__ import annotations

import math
from typing import Callable, Union

import sympy as sp

from fagen.spec import FLT_MAX


#: Positions per entry of a run-time summary (templates/attention_common.cuh has the same constant).
SUMMARY_GRAIN = 64



class ExpressionError(ValueError):
    """A mask_mod / score_mod / inputs that cannot be built; the message is one line naming the culprit."""


# ---- the names an expression may use -------------------------------------------------------
B, H, I, J = sp.symbols("b h i j", integer=True)
NQ, NK = sp.symbols("Nq Nk", integer=True)
SCORE = sp.Symbol("score", real=True)
POSITION_SYMBOLS = {"b": B, "h": H, "i": I, "j": J, "Nq": NQ, "Nk": NK}

INPUT_KINDS = ("scalar", "float32", "int32")
MAX_TENSORS = 4
MAX_SCALARS = 4

# Bounds on what one expression may be, so that nothing a user writes can hang the parser or sympy: a
# chain of + - * (a long sum) counts as one level of nesting, however many terms it has.
MAX_EXPRESSION_CHARS = 2000
MAX_EXPRESSION_NODES = 1000
MAX_EXPRESSION_DEPTH = 40
MAX_EXPONENT = 128                        # |a constant exponent|: beyond it any |base| > 1.01 overflows float32
FLT_TRUE_MIN = 1.401298464324817e-45      # the smallest float32 above 0: a constant below it would be 0
_LOG10_FLT_MAX, _LOG10_FLT_TRUE_MIN = math.log10(FLT_MAX), math.log10(FLT_TRUE_MIN)


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


# name -> (number of arguments, builder); min/max take two or more
FUNCTIONS: dict[str, tuple[Union[int, str], Callable]] = {
    "tanh": (1, sp.tanh), "exp": (1, sp.exp), "log": (1, sp.log), "sqrt": (1, sp.sqrt),
    "abs": (1, sp.Abs), "min": ("2+", sp.Min), "max": ("2+", sp.Max), "floor": (1, sp.floor),
    "ceil": (1, sp.ceiling), "sigmoid": (1, _sigmoid), "sin": (1, sp.sin), "cos": (1, sp.cos),
    "where": (3, None),   # where(c, x, y): built by the parser (c is a boolean)
}

RESERVED = set(POSITION_SYMBOLS) | {"score"} | set(FUNCTIONS)


def _is_boolean(expr) -> bool:
    # (sympy's Symbol is a Boolean too, so that it can stand in logic: a boolean is a non-Expr Boolean)
    return isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Expr)


