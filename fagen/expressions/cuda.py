"""sympy -> C++: the printer of the kernels' expressions."""
from __future__ import annotations

import math
from typing import Optional

import sympy as sp

from fagen.spec import FLT_MAX
from fagen.expressions.names import ExpressionError, FLT_TRUE_MIN, I, J, SCORE, _is_boolean


# ---- sympy -> C++ ---------------------------------------------------------------------------
_C_FLOAT_FUNCTIONS = {sp.exp: "expf", sp.log: "logf", sp.tanh: "tanhf", sp.sin: "sinf", sp.cos: "cosf",
                      sp.tan: "tanf", sp.sinh: "sinhf", sp.cosh: "coshf"}


def _power_of_two(value) -> bool:
    """Is value an integer constant 2^k that fits the kernels' 32-bit ints (0 <= k <= 30)? Division and remainder
    by one become a shift and a mask; larger ones go the general way, which reports that they do not fit."""
    return value.is_Integer and 0 < value < 2**31 and (int(value) & (int(value) - 1)) == 0


def _float_literal(value) -> str:
    text = repr(float(value))
    if not math.isfinite(float(value)):
        raise ExpressionError(f"the constant {value} is not finite")
    if abs(float(value)) > FLT_MAX:   # a float literal beyond it is inf on the GPU
        raise ExpressionError(f"the constant {float(value):g} does not fit in a float (|x| <= {FLT_MAX:g})")
    if 0 < abs(float(value)) < FLT_TRUE_MIN:   # and one below it is 0
        raise ExpressionError(f"the constant {float(value):g} rounds to 0 in float32")
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


class _CPrinter:
    """Prints one sympy tree as a C++ expression: ints where sympy says integer, float elsewhere.

    `names` maps a symbol to its C spelling (scalar members are `s_<name>`, tensors load through
    `load_<name>(...)`, which clamps)."""

    def __init__(self, field_name: str, names: dict, float_names: Optional[dict] = None):
        self.field = field_name
        self.names = names
        # symbols that also arrive as floats (the score functions' fi, fj): an integer sum of them in a float
        # context adds those floats (exact below 2^24) instead of converting the int sum, which costs an
        # int-to-float conversion per score on the pipe the softmax's exponentials use
        self.float_names = float_names or {}

    def fail(self, expr):
        head = type(expr).__name__
        raise ExpressionError(f"{self.field}: {head} cannot be rendered as CUDA ({expr})")

    def is_int(self, expr) -> bool:
        return bool(expr.is_integer)

    def f(self, expr) -> str:       # as float
        if expr.is_Integer:
            text = _float_literal(expr)
            return f"({text})" if text.startswith("-") else text
        if expr in self.float_names:
            return self.float_names[expr]
        if self.float_names and self.is_int(expr) and expr.has(*self.float_names):
            if isinstance(expr, sp.Add):
                return "(" + " + ".join(self.f(term) for term in expr.args) + ")"
            coefficient, rest = expr.as_coeff_Mul()
            if isinstance(expr, sp.Mul) and coefficient.is_Integer and rest in self.float_names:
                return f"(-{self.float_names[rest]})" if coefficient == -1 else f"({self.f(coefficient)} * {self.float_names[rest]})"
        code = self.emit(expr)
        return f"(float)({code})" if self.is_int(expr) and not expr.is_Number else code

    def i(self, expr) -> str:       # as int (callers only ask for integer expressions)
        return self.emit(expr)

    def emit(self, expr) -> str:
        if expr in self.names:   # symbols, and loads hoisted into members (Modifiers._hoisted_loads)
            return self.names[expr]
        if _is_boolean(expr):
            return self.boolean(expr)
        if expr.is_Integer:
            value = int(expr)
            if abs(value) >= 2**31:
                raise ExpressionError(f"{self.field}: the integer {value} does not fit in 32 bits")
            return f"({value})" if value < 0 else str(value)
        if expr.is_Number or isinstance(expr, sp.NumberSymbol):
            text = _float_literal(expr)
            return f"({text})" if text.startswith("-") else text
        if expr.is_Symbol:
            if expr not in self.names:
                self.fail(expr)
            return self.names[expr]
        if isinstance(expr, sp.Indexed):
            name = expr.base.label.name
            return f"load_{name}({', '.join(self.i(index) for index in expr.indices)})"
        integer = self.is_int(expr)
        if isinstance(expr, sp.Add):
            parts = [self.i(term) if integer else self.f(term) for term in expr.args]
            return "(" + " + ".join(parts) + ")"
        if isinstance(expr, sp.Mul):
            coefficient, rest = expr.as_coeff_Mul()
            if coefficient == -1:
                return f"(-{self.i(rest) if integer else self.f(rest)})"
            if integer and all(a.is_integer for a in expr.args):
                return "(" + " * ".join(self.i(a) for a in expr.args) + ")"
            # factors that move with neither the position nor the score first: C multiplies left to right, so
            # their product is loop-invariant and the compiler hoists it (ALiBi: one multiply-add per score)
            ordered = sorted(expr.args, key=lambda a: a.has(I, J, SCORE))
            return "(" + " * ".join(self.f(a) for a in ordered) + ")"
        if isinstance(expr, sp.Pow):
            return self.power(expr)
        if isinstance(expr, (sp.floor, sp.ceiling)):
            return self.rounding(expr)
        if isinstance(expr, sp.Mod):
            a, m = expr.args
            if a.is_integer and m.is_integer:
                if _power_of_two(m):   # Python's a % 2^k is a's low k bits, negative a included (two's complement)
                    return f"({self.i(a)} & {int(m) - 1})"
                return f"py_mod({self.i(a)}, {self.i(m)})"
            return f"py_fmod({self.f(a)}, {self.f(m)})"
        if isinstance(expr, sp.Abs):
            (a,) = expr.args
            return f"abs({self.i(a)})" if integer else f"fabsf({self.f(a)})"
        if isinstance(expr, (sp.Min, sp.Max)):
            fn = ("min" if isinstance(expr, sp.Min) else "max") if integer else \
                ("fminf" if isinstance(expr, sp.Min) else "fmaxf")
            codes = [self.i(a) if integer else self.f(a) for a in expr.args]
            code = codes[0]
            for other in codes[1:]:
                code = f"{fn}({code}, {other})"
            return code
        if expr.func in _C_FLOAT_FUNCTIONS:
            return f"{_C_FLOAT_FUNCTIONS[expr.func]}({self.f(expr.args[0])})"
        if isinstance(expr, sp.sign):
            a = expr.args[0]
            code = self.i(a) if a.is_integer else self.f(a)
            zero = "0" if a.is_integer else "0.f"
            return f"(float)(({code} > {zero}) - ({code} < {zero}))"
        if isinstance(expr, sp.Heaviside):
            a = expr.args[0]
            at_zero = _float_literal(expr.args[1]) if len(expr.args) > 1 else "0.5f"
            return f"heaviside({self.f(a)}, {at_zero})"
        if isinstance(expr, sp.Piecewise):
            return self.piecewise(expr)
        self.fail(expr)

    def power(self, expr) -> str:
        base, exponent = expr.args
        if exponent.is_Integer and exponent >= 0 and base.is_integer:
            return f"ipow({self.i(base)}, {int(exponent)})"
        if exponent == sp.Rational(1, 2):
            return f"sqrtf({self.f(base)})"
        if exponent == -sp.Rational(1, 2):
            return f"rsqrtf({self.f(base)})"
        if exponent == -1:
            return f"(1.0f / {self.f(base)})"
        if exponent == 2:
            code = self.f(base)
            return f"({code} * {code})"
        if exponent == -2:
            code = self.f(base)
            return f"(1.0f / ({code} * {code}))"
        return f"powf({self.f(base)}, {self.f(exponent)})"

    def rounding(self, expr) -> str:
        (a,) = expr.args
        is_floor = isinstance(expr, sp.floor)
        if a.is_integer:
            return self.i(a)
        numerator, denominator = sp.fraction(sp.together(a))
        if numerator.is_integer and denominator.is_integer and denominator != 1:
            # exact integer division with Python's rounding; ceil(n / d) = -floor(-n / d)
            if _power_of_two(denominator):   # Python's n // 2^k is an arithmetic shift, negative n included
                shift = int(denominator).bit_length() - 1
                return f"({self.i(numerator)} >> {shift})" if is_floor else f"(-((-{self.i(numerator)}) >> {shift}))"
            if is_floor:
                return f"floor_div({self.i(numerator)}, {self.i(denominator)})"
            return f"(-floor_div({self.i(-numerator)}, {self.i(denominator)}))"
        return f"(int)({'floorf' if is_floor else 'ceilf'}({self.f(a)}))"

    def piecewise(self, expr) -> str:
        integer = self.is_int(expr)
        code = None
        for value, condition in reversed(expr.args):
            value_code = self.i(value) if integer else self.f(value)
            if code is None:
                if condition != sp.true:   # no branch matched: sympy's value is nan; 0 is ours
                    code = f"({self.boolean(condition)} ? {value_code} : {'0' if integer else '0.f'})"
                else:
                    code = value_code
            else:
                code = f"({self.boolean(condition)} ? {value_code} : {code})"
        return code

    def boolean(self, expr) -> str:
        if expr == sp.true:
            return "true"
        if expr == sp.false:
            return "false"
        if isinstance(expr, sp.And):
            return "(" + " && ".join(self.boolean(a) for a in expr.args) + ")"
        if isinstance(expr, sp.Or):
            return "(" + " || ".join(self.boolean(a) for a in expr.args) + ")"
        if isinstance(expr, sp.Not):
            return f"!{self.boolean(expr.args[0])}"
        if isinstance(expr, sp.Rel) and expr.rel_op in ("<", "<=", ">", ">=", "==", "!="):
            lhs, rhs = expr.args
            if _is_boolean(lhs) or _is_boolean(rhs):
                self.fail(expr)
            if lhs.is_integer and rhs.is_integer:
                return f"({self.i(lhs)} {expr.rel_op} {self.i(rhs)})"
            return f"({self.f(lhs)} {expr.rel_op} {self.f(rhs)})"
        self.fail(expr)


def _check_renderable(expr, field_name: str) -> None:
    bad = expr.atoms(sp.Derivative, sp.DiracDelta, sp.Subs, sp.Integral)
    if bad:
        first = sorted(bad, key=str)[0]
        raise ExpressionError(f"{field_name}: {type(first).__name__} cannot be rendered as CUDA ({first})")


