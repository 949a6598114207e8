"""Stage 1b: a spec's attention modifiers (mask_mod, score_mod) as sympy, CUDA and numpy.

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
from __future__ import annotations

import ast
import functools
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import sympy as sp

from fagen.spec import FLT_MAX, INT32_MAX

#: Positions per entry of a run-time summary (templates/attention_common.cuh has the same constant).
SUMMARY_GRAIN = 64

__all__ = ["ExpressionError", "Modifiers", "modifiers", "parse", "trace", "to_text", "as_text", "Traced", "INPUT_KINDS", "FUNCTIONS"]


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


# ---- parsing: ast -> sympy -------------------------------------------------------------------
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
           ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@"}
_CHAINED = (ast.Add, ast.Sub, ast.Mult)   # left-deep chains the parser walks as lists (_Parser.chain)
_COMPARE = {ast.Lt: sp.Lt, ast.LtE: sp.Le, ast.Gt: sp.Gt, ast.GtE: sp.Ge, ast.Eq: sp.Eq, ast.NotEq: sp.Ne}


class _Parser:
    """One expression's walk. Records which inputs it used and how many subscripts each tensor took."""

    def __init__(self, field_name: str, inputs: dict):
        self.field = field_name
        self.inputs = inputs
        self.used: list[str] = []
        self.ndims: dict[str, int] = {}
        self.names = dict(POSITION_SYMBOLS)
        if field_name == "score_mod":
            self.names["score"] = SCORE
        for name, kind in inputs.items():
            if kind == "scalar":
                self.names[name] = sp.Symbol(name, real=True)

    def fail(self, message: str):
        raise ExpressionError(f"{self.field}: {message}")

    def number(self, node) -> sp.Expr:
        value = self.visit(node)
        if _is_boolean(value):
            self.fail(f"expected a number, got the boolean {value}")
        return value

    def boolean(self, node, what: str):
        value = self.visit(node)
        if not _is_boolean(value):
            self.fail(f"{what} needs booleans (comparisons, and/or/not), got {value}")
        return value

    def visit(self, node):
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is None:
            self.fail(f"{_describe(node)} is not supported")
        return self.bounded(method(node), node)

    def bounded(self, value, node):
        """A constant the parser folded (sympy folds as it builds) must be one the kernels can hold
        (_constant_problem); refused here, before a later fold builds on it (exp(exp(100)))."""
        if not _is_boolean(value) and getattr(value, "is_number", False):
            problem = _constant_problem(value, _source(node))
            if problem:
                self.fail(problem)
        return value

    def visit_Expression(self, node):
        return self.visit(node.body)

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            return sp.true if value else sp.false
        if isinstance(value, int):
            return sp.Integer(value)
        if isinstance(value, float):
            if not math.isfinite(value):
                self.fail(f"the constant {value!r} is not finite")
            return sp.Float(value)
        self.fail(f"the constant {value!r} is not supported (numbers, True and False only)")

    def visit_Name(self, node):
        name = node.id
        if name in self.names:
            if name in self.inputs and name not in self.used:
                self.used.append(name)
            return self.names[name]
        if name == "score":
            self.fail("'score' is only defined in score_mod (a mask cannot depend on the score)")
        if name in self.inputs:
            self.fail(f"tensor input '{name}' must be subscripted, e.g. {name}[i]")
        if name in FUNCTIONS:
            self.fail(f"function '{name}' must be called")
        allowed = ", ".join([*POSITION_SYMBOLS, *(["score"] if self.field == "score_mod" else []), *self.inputs])
        self.fail(f"unknown name '{name}' (allowed: {allowed})")

    def visit_UnaryOp(self, node):
        if isinstance(node.op, (ast.Not, ast.Invert)):
            return sp.Not(self.boolean(node.operand, "'not'" if isinstance(node.op, ast.Not) else "'~'"))
        operand = self.number(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand

    def visit_BoolOp(self, node):
        word = "and" if isinstance(node.op, ast.And) else "or"
        values = [self.boolean(value, f"'{word}'") for value in node.values]
        return sp.And(*values) if word == "and" else sp.Or(*values)

    def visit_BinOp(self, node):
        symbol = _BINOPS.get(type(node.op), type(node.op).__name__)
        if symbol in ("&", "|"):
            left, right = self.boolean(node.left, f"'{symbol}'"), self.boolean(node.right, f"'{symbol}'")
            return sp.And(left, right) if symbol == "&" else sp.Or(left, right)
        if symbol not in ("+", "-", "*", "/", "//", "%", "**"):
            self.fail(f"operator '{symbol}' is not supported")
        if symbol in ("+", "-", "*") and isinstance(node.left, ast.BinOp) and type(node.left.op) in _CHAINED:
            return self.chain(node)
        left, right = self.number(node.left), self.number(node.right)
        return self.bounded(self.apply(symbol, left, right, node), node)

    def chain(self, node):
        """a + b - c + ... (and a * b * ...) walked as the list it is, not as recursion as deep as it is
        long: a sum of hundreds of terms is a legitimate expression."""
        links = []
        while isinstance(node, ast.BinOp) and type(node.op) in _CHAINED:
            links.append(node)
            node = node.left
        value = self.number(node)
        for link in reversed(links):
            value = self.bounded(self.apply(_BINOPS[type(link.op)], value, self.number(link.right), link), link)
        return value

    def apply(self, symbol, left, right, node):
        if symbol in ("/", "//", "%") and right == 0:
            self.fail(f"division by zero in {_source(node)}")
        if symbol == "**":
            self.check_power(left, right, node)
        if symbol == "+":
            return left + right
        if symbol == "-":
            return left - right
        if symbol == "*":
            return left * right
        if symbol == "/":
            return left / right
        if symbol == "//":
            return sp.floor(left / right)
        if symbol == "%":
            return sp.Mod(left, right)
        return left ** right

    def check_power(self, base, exponent, node):
        """Refused before sympy computes it: 2**10**10 would be an exact integer of three billion digits."""
        if not exponent.is_number:
            return
        if not exponent.is_real or abs(exponent) > MAX_EXPONENT:
            self.fail(f"the exponent in {_source(node)} is too large: a constant exponent is at most "
                      f"{MAX_EXPONENT} in magnitude")
        if base.is_number and base.is_real and not base.is_zero:
            scale = float(exponent) * math.log10(abs(float(base)))
            if scale > _LOG10_FLT_MAX:
                self.fail(f"{_source(node)} overflows float32 (about 1e{scale:.0f}; |x| <= {FLT_MAX:g})")
            if scale < _LOG10_FLT_TRUE_MIN:
                self.fail(f"{_source(node)} rounds to 0 in float32 (about 1e{scale:.0f})")

    def visit_Compare(self, node):
        terms = [self.number(node.left)] + [None] * len(node.comparators)
        relations = []
        for k, (op, right) in enumerate(zip(node.ops, node.comparators)):
            if type(op) not in _COMPARE:
                self.fail(f"comparison '{type(op).__name__}' is not supported (use < <= > >= == !=)")
            terms[k + 1] = self.number(right)
            relations.append(_COMPARE[type(op)](terms[k], terms[k + 1]))
        return sp.And(*relations)

    def visit_IfExp(self, node):
        return self.choose(self.boolean(node.test, "the condition of 'if'"), node.body, node.orelse)

    def choose(self, condition, yes_node, no_node):
        yes, no = self.visit(yes_node), self.visit(no_node)
        if _is_boolean(yes) != _is_boolean(no):
            self.fail(f"both branches must be numbers or both booleans, got {yes} and {no}")
        if _is_boolean(yes):   # a boolean choice is plain logic: no Piecewise of booleans downstream
            return sp.Or(sp.And(condition, yes), sp.And(sp.Not(condition), no))
        return sp.Piecewise((yes, condition), (no, True))

    def visit_Subscript(self, node):
        if not isinstance(node.value, ast.Name):
            self.fail(f"only declared tensor inputs can be subscripted, not {ast.unparse(node.value)}")
        name = node.value.id
        kind = self.inputs.get(name)
        if kind == "scalar":
            self.fail(f"scalar input '{name}' cannot be subscripted (only float32 / int32 tensor inputs can)")
        if kind is None:
            self.fail(f"unknown input '{name}': declare it in the spec's inputs as a tensor, e.g. inputs: "
                      f"{{{name}: float32}} (or int32)")
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(part, (ast.Slice, ast.Starred)) for part in parts):
            self.fail(f"slices are not supported in {ast.unparse(node)}: index with one position per dimension")
        if len(parts) not in (1, 2):
            self.fail(f"tensor '{name}' takes 1 or 2 subscripts, got {len(parts)}")
        previous = self.ndims.setdefault(name, len(parts))
        if previous != len(parts):
            self.fail(f"tensor '{name}' is subscripted with both {previous} and {len(parts)} indices")
        indices = [self.number(part) for part in parts]
        for index in indices:
            if not index.is_integer:
                self.fail(f"the index {index} of '{name}' is not an integer expression (use // or floor)")
        if name not in self.used:
            self.used.append(name)
        base = sp.IndexedBase(name, integer=True) if kind == "int32" else sp.IndexedBase(name, real=True)
        return base[tuple(indices)]

    def visit_Call(self, node):
        if not isinstance(node.func, ast.Name):
            self.fail(f"calling {_describe(node.func)} is not supported (supported: {', '.join(FUNCTIONS)})")
        name = node.func.id
        if name not in FUNCTIONS:
            self.fail(f"function '{name}' is not supported (supported: {', '.join(FUNCTIONS)})")
        if node.keywords:
            self.fail(f"{name}() takes no keyword arguments")
        if any(isinstance(arg, ast.Starred) for arg in node.args):
            self.fail(f"{name}() takes no *arguments")
        arity, build = FUNCTIONS[name]
        count = len(node.args)
        if (arity == "2+" and count < 2) or (arity != "2+" and count != arity):
            self.fail(f"{name}() takes {'2 or more' if arity == '2+' else arity} argument(s), got {count}")
        if name == "where":
            return self.choose(self.boolean(node.args[0], "where()'s condition"), node.args[1], node.args[2])
        return build(*[self.number(arg) for arg in node.args])


# ---- Python callables and sympy expressions (the API's other ways in) ------------------------------
#: Parameter names a traced callable may use besides the inputs' names: FlexAttention's spellings of
#: the query and key position are accepted too, so a Flex mask_mod / score_mod ports as it is.
_ALIASES = {"q_idx": "i", "kv_idx": "j", "batch": "b", "head": "h"}
#: torch functions a traced value may pass through (by __torch_function__), and what they become.
_TORCH_FUNCTIONS = {"tanh": sp.tanh, "exp": sp.exp, "log": sp.log, "sqrt": sp.sqrt, "abs": sp.Abs,
                    "sigmoid": _sigmoid, "sin": sp.sin, "cos": sp.cos, "floor": sp.floor, "ceil": sp.ceiling,
                    "minimum": sp.Min, "maximum": sp.Max}


class Traced:
    """A sympy expression standing in for an index, the score or an input while a Python callable runs:
    operators build the expression (== and != too, which sympy itself would answer with a bool), torch
    functions that have a fagen counterpart go through __torch_function__, and anything that needs a
    concrete value (if / and / or / bool()) is an error that says what to write instead."""

    __slots__ = ("expr", "field")

    def __init__(self, expr, field: str):
        self.expr, self.field = expr, field

    def _wrap(self, expr):
        return Traced(expr, self.field)

    @staticmethod
    def _value(other):
        if isinstance(other, Traced):
            return other.expr
        if isinstance(other, bool):
            return sp.true if other else sp.false
        if isinstance(other, (int, float)):
            return sp.sympify(other)
        raise TypeError(f"a traced expression cannot combine with {type(other).__name__}")

    def __add__(self, o): return self._wrap(self.expr + self._value(o))      # noqa: E704
    def __radd__(self, o): return self._wrap(self._value(o) + self.expr)     # noqa: E704
    def __sub__(self, o): return self._wrap(self.expr - self._value(o))      # noqa: E704
    def __rsub__(self, o): return self._wrap(self._value(o) - self.expr)     # noqa: E704
    def __mul__(self, o): return self._wrap(self.expr * self._value(o))      # noqa: E704
    def __rmul__(self, o): return self._wrap(self._value(o) * self.expr)     # noqa: E704
    def __truediv__(self, o): return self._wrap(self.expr / self._value(o))  # noqa: E704
    def __rtruediv__(self, o): return self._wrap(self._value(o) / self.expr)  # noqa: E704
    def __floordiv__(self, o): return self._wrap(sp.floor(self.expr / self._value(o)))   # noqa: E704
    def __rfloordiv__(self, o): return self._wrap(sp.floor(self._value(o) / self.expr))  # noqa: E704
    def __mod__(self, o): return self._wrap(sp.Mod(self.expr, self._value(o)))   # noqa: E704
    def __rmod__(self, o): return self._wrap(sp.Mod(self._value(o), self.expr))  # noqa: E704
    def __pow__(self, o): return self._wrap(self.expr ** self._value(o))     # noqa: E704
    def __rpow__(self, o): return self._wrap(self._value(o) ** self.expr)    # noqa: E704
    def __neg__(self): return self._wrap(-self.expr)                         # noqa: E704
    def __pos__(self): return self                                           # noqa: E704
    def __abs__(self): return self._wrap(sp.Abs(self.expr))                  # noqa: E704
    def __lt__(self, o): return self._wrap(sp.Lt(self.expr, self._value(o)))  # noqa: E704
    def __le__(self, o): return self._wrap(sp.Le(self.expr, self._value(o)))  # noqa: E704
    def __gt__(self, o): return self._wrap(sp.Gt(self.expr, self._value(o)))  # noqa: E704
    def __ge__(self, o): return self._wrap(sp.Ge(self.expr, self._value(o)))  # noqa: E704
    def __eq__(self, o): return self._wrap(sp.Eq(self.expr, self._value(o)))  # noqa: E704
    def __ne__(self, o): return self._wrap(sp.Ne(self.expr, self._value(o)))  # noqa: E704
    def __and__(self, o): return self._wrap(sp.And(self.expr, self._value(o)))   # noqa: E704
    def __rand__(self, o): return self._wrap(sp.And(self._value(o), self.expr))  # noqa: E704
    def __or__(self, o): return self._wrap(sp.Or(self.expr, self._value(o)))     # noqa: E704
    def __ror__(self, o): return self._wrap(sp.Or(self._value(o), self.expr))    # noqa: E704
    def __invert__(self): return self._wrap(sp.Not(self.expr))                   # noqa: E704
    __hash__ = object.__hash__

    def __bool__(self):
        raise ExpressionError(f"{self.field}: a traced value has no truth value: Python's if / and / or / not "
                              "need one; write & | ~ for logic and where(cond, a, b) (torch.where) for choices")

    def __float__(self):
        raise ExpressionError(f"{self.field}: a traced value has no number: use torch functions (torch.tanh, ...) "
                              "or operators, not math.*")

    __int__ = __index__ = __float__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        field = next((a.field for a in args if isinstance(a, Traced)), "expression")
        if kwargs:
            raise ExpressionError(f"{field}: torch.{name}() with keyword arguments cannot be traced")
        values = [cls._value(a) for a in args]
        if name == "where" and len(values) == 3:
            return Traced(sp.Piecewise((values[1], values[0]), (values[2], True)), field)
        if name == "clamp" and len(values) == 3:
            return Traced(sp.Min(sp.Max(values[0], values[1]), values[2]), field)
        build = _TORCH_FUNCTIONS.get(name)
        if build is None:
            raise ExpressionError(f"{field}: torch.{name} has no fagen counterpart (traced: operators and "
                                  f"torch.{', torch.'.join([*_TORCH_FUNCTIONS, 'where', 'clamp'])})")
        return Traced(build(*values), field)


class _TracedTensor:
    """A tensor input while a callable runs: subscripting it gives a traced load."""

    def __init__(self, name: str, kind: str, field: str):
        self.name, self.kind, self.field = name, kind, field

    def __getitem__(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        base = sp.IndexedBase(self.name, integer=True) if self.kind == "int32" else sp.IndexedBase(self.name, real=True)
        return Traced(base[tuple(Traced._value(part) for part in parts)], self.field)


def trace(function: Callable, field: str, inputs: Optional[dict] = None) -> sp.Basic:
    """Run a Python callable on traced values and return the sympy expression it builds. Its parameters
    are taken by name: b, h, i (or q_idx), j (or kv_idx), Nq, Nk, score (score_mod only) and the
    declared inputs."""
    import inspect

    inputs = dict(inputs or {})
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        raise ExpressionError(f"{field}: cannot read the parameters of {function!r}") from None
    arguments = []
    for name in parameters:
        canonical = _ALIASES.get(name, name)
        if canonical in POSITION_SYMBOLS:
            arguments.append(Traced(POSITION_SYMBOLS[canonical], field))
        elif canonical == "score" and field == "score_mod":
            arguments.append(Traced(SCORE, field))
        elif name in inputs and inputs[name] == "scalar":
            arguments.append(Traced(sp.Symbol(name, real=True), field))
        elif name in inputs:
            arguments.append(_TracedTensor(name, inputs[name], field))
        else:
            allowed = [*POSITION_SYMBOLS, *_ALIASES, *(["score"] if field == "score_mod" else []), *inputs]
            raise ExpressionError(f"{field}: parameter '{name}' of {getattr(function, '__name__', 'the callable')} "
                                  f"is not a name fagen knows (allowed: {', '.join(allowed)})")
    result = function(*arguments)
    if isinstance(result, bool):
        return sp.true if result else sp.false
    if isinstance(result, (int, float)):
        return sp.sympify(result)
    if not isinstance(result, Traced):
        raise ExpressionError(f"{field}: the callable returned {type(result).__name__}, not an expression of "
                              "its arguments")
    return result.expr


def to_text(expr: sp.Basic, field: str) -> str:
    """A sympy expression written in fagen's expression syntax (what `parse` reads back)."""
    def text(e) -> str:
        if e is sp.true or e is sp.false:
            return "True" if e is sp.true else "False"
        if e.is_Integer:
            return str(int(e))
        if e.is_Rational:
            return f"({e.p} / {e.q})"
        if e.is_Number or isinstance(e, sp.NumberSymbol):
            return repr(float(e))
        if e.is_Symbol:
            return e.name
        if isinstance(e, sp.Indexed):
            return f"{e.base.label.name}[{', '.join(text(i) for i in e.indices)}]"
        if isinstance(e, sp.Add):   # a - b rather than a + (-1 * b)
            terms = sorted(e.args, key=lambda a: a.could_extract_minus_sign())
            out = text(terms[0])
            for term in terms[1:]:
                out += f" - {text(-term)}" if term.could_extract_minus_sign() else f" + {text(term)}"
            return f"({out})"
        if isinstance(e, sp.Mul):
            if e.could_extract_minus_sign():
                return f"(-{text(-e)})"
            numerator, denominator = sp.fraction(e)
            if denominator != 1:
                return f"({text(numerator)} / {text(denominator)})"
            return "(" + " * ".join(text(a) for a in e.args) + ")"
        if isinstance(e, sp.Pow):
            if e.exp.is_negative:
                return f"(1 / {text(e.base ** -e.exp)})"
            return f"({text(e.base)} ** {text(e.exp)})"
        if isinstance(e, sp.Mod):
            return f"({text(e.args[0])} % {text(e.args[1])})"
        if isinstance(e, sp.Abs):
            return f"abs({text(e.args[0])})"
        if isinstance(e, (sp.Min, sp.Max)):
            return f"{'min' if isinstance(e, sp.Min) else 'max'}({', '.join(text(a) for a in e.args)})"
        if isinstance(e, sp.ceiling):
            return f"ceil({text(e.args[0])})"
        named = {sp.floor: "floor", sp.tanh: "tanh", sp.exp: "exp", sp.log: "log", sp.sin: "sin", sp.cos: "cos"}
        if e.func in named and len(e.args) == 1:
            return f"{named[e.func]}({text(e.args[0])})"
        operators = {sp.Lt: "<", sp.Le: "<=", sp.Gt: ">", sp.Ge: ">=", sp.Eq: "==", sp.Ne: "!="}
        if e.func in operators:
            return f"({text(e.lhs)} {operators[e.func]} {text(e.rhs)})"
        if isinstance(e, (sp.And, sp.Or)):
            return "(" + (" and " if isinstance(e, sp.And) else " or ").join(text(a) for a in e.args) + ")"
        if isinstance(e, sp.Not):
            return f"(not {text(e.args[0])})"
        if isinstance(e, sp.Piecewise):
            (value, condition), rest = e.args[0], e.args[1:]
            if condition is sp.true or not rest:
                return text(value)
            return f"({text(value)} if {text(condition)} else {text(sp.Piecewise(*rest))})"
        raise ExpressionError(f"{field}: {type(e).__name__} ({e}) cannot be written as a fagen expression")

    return text(sp.sympify(expr))


def as_text(value, field: str, inputs: Optional[dict] = None) -> str:
    """The spec's text of a mask_mod / score_mod given as a string, a sympy expression or a Python callable."""
    if isinstance(value, str):
        return value
    if isinstance(value, sp.Basic):
        return to_text(value, field)
    if callable(value):
        return to_text(trace(value, field, inputs), field)
    raise ExpressionError(f"{field}: expected an expression string, a sympy expression or a callable, "
                          f"got {type(value).__name__}")


def _describe(node) -> str:
    try:
        text = ast.unparse(node)
    except Exception:   # pragma: no cover - every node we see comes from ast.parse
        text = ""
    kind = {"Attribute": "attribute access", "Lambda": "lambda", "ListComp": "a comprehension",
            "GeneratorExp": "a generator", "SetComp": "a comprehension", "DictComp": "a comprehension",
            "List": "a list", "Tuple": "a tuple", "Dict": "a dict", "Set": "a set", "Starred": "starred",
            "NamedExpr": "':='", "JoinedStr": "an f-string", "Await": "await", "Yield": "yield",
            "Slice": "a slice"}.get(type(node).__name__, type(node).__name__)
    return f"{kind} ({text})" if text else kind


def _source(node, limit: int = 60) -> str:
    return _cut(ast.unparse(node), limit)


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _digits(value) -> str:
    if int(value).bit_length() > 10_000:   # str() of an int past Python's 4,300-digit limit raises
        return f"an integer of {int(value).bit_length()} bits"
    text = str(value)
    return text if len(text) <= 24 else f"{text[:6]}...({len(text)} digits)"


def _shape(tree) -> tuple[int, int]:
    """(nodes, depth) of a parsed expression, walked without recursion; a link of a + - * chain (see
    _Parser.chain) adds no depth."""
    nodes, depth, stack = 0, 0, [(tree, 1)]
    while stack:
        node, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if nodes > MAX_EXPRESSION_NODES:
            break
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.expr_context, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)):
                continue
            chained = (isinstance(node, ast.BinOp) and child is node.left and isinstance(child, ast.BinOp)
                       and type(child.op) in _CHAINED and type(node.op) in _CHAINED)
            stack.append((child, level if chained else level + 1))
    return nodes, depth


def _check_input_names(inputs: dict) -> None:
    for name, kind in inputs.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or keyword.iskeyword(name):
            raise ExpressionError(f"inputs: {name!r} is not a valid name (an ASCII identifier: letters, digits, _)")
        if name in RESERVED or name in ("True", "False", "None"):
            raise ExpressionError(f"inputs: '{name}' clashes with a built-in name (reserved: {', '.join(sorted(RESERVED))})")
        if kind not in INPUT_KINDS:
            raise ExpressionError(f"inputs: '{name}' has kind {kind!r}; expected one of {', '.join(INPUT_KINDS)}")


def _parse(text: str, field_name: str, inputs: dict, boolean: bool):
    if not isinstance(text, str) or not text.strip():
        raise ExpressionError(f"{field_name} must be a non-empty expression string, got {text!r}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"{field_name}: the expression is {len(text):,} characters long; at most "
                              f"{MAX_EXPRESSION_CHARS:,}")
    # ASCII without backslashes: the text is also a comment in the generated CUDA, where a trailing
    # backslash would splice the next line into it
    bad = next((c for c in text if not (" " <= c <= "~" or c in "\t\n\r") or c == "\\"), None)
    if bad is not None:
        raise ExpressionError(f"{field_name}: the character {bad!r} is not allowed (an expression is ASCII "
                              "text without backslashes)")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise ExpressionError(f"{field_name}: invalid syntax in {_cut(text.strip())!r}: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise ExpressionError(f"{field_name}: the expression is nested too deeply") from None
    nodes, depth = _shape(tree)
    if nodes > MAX_EXPRESSION_NODES:
        raise ExpressionError(f"{field_name}: the expression has more than {MAX_EXPRESSION_NODES} terms and "
                              "operators; at most that many")
    if depth > MAX_EXPRESSION_DEPTH:
        raise ExpressionError(f"{field_name}: the expression is nested {depth} levels deep; at most "
                              f"{MAX_EXPRESSION_DEPTH}")
    parser = _Parser(field_name, inputs)
    try:
        expr = parser.visit(tree)
    except RecursionError:
        raise ExpressionError(f"{field_name}: the expression is nested too deeply") from None
    if boolean and not _is_boolean(expr):
        raise ExpressionError(f"{field_name} must be a boolean expression (a comparison, and/or/not), got {expr}")
    if not boolean and _is_boolean(expr):
        raise ExpressionError(f"{field_name} must be a number expression, got the boolean {expr}")
    if expr.has(sp.zoo, sp.nan, sp.oo, -sp.oo):
        raise ExpressionError(f"{field_name}: the expression is not finite ({_cut(str(expr))})")
    _check_constants(expr, field_name)
    return _integer_relations(expr), parser


def _constant_problem(value, written: str) -> Optional[str]:
    """Why a constant cannot be a kernel's (beyond int32, not real, beyond float32, or rounding to 0 in it), or
    None. `written`: how the message shows it."""
    if value.is_zero:
        return None
    if value.is_Integer:
        if abs(value) <= INT32_MAX:
            return None
        shown = written if written == _digits(value) else f"{written} = {_digits(value)}"
        return (f"the constant {shown} does not fit in 32 bits (int32: |x| < 2**31); write a float (e.g. 1e12) "
                "where a float is meant")
    number = sp.N(value, 20)
    if not number.is_real:
        return f"{written} is not a real number"
    shown = written if value.is_Float else f"{written} (~{sp.Float(number, 4)})"
    if abs(number) > FLT_MAX:
        return f"the constant {shown} overflows float32 (|x| <= {FLT_MAX:g})"
    if abs(number) < FLT_TRUE_MIN:
        return f"the constant {shown} rounds to 0 in float32"
    return None


def _check_constants(expr, field_name: str) -> None:
    """The constants of the whole expression as sympy folded it: score * exp(80) * exp(80) is
    score * exp(160), one factor no subexpression the parser saw had (float32 overflows at e^88.7)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if getattr(node, "is_number", False) and not _is_boolean(node):
            written = _digits(node) if node.is_Integer else f"{float(node):g}" if node.is_Float else _cut(str(node))
            problem = _constant_problem(node, written)
            if problem:
                raise ExpressionError(f"{field_name}: {problem}")
            continue
        stack.extend(node.args)


#: The largest coefficient a comparison may get when its fractions are cleared (_integer_relations).
MAX_EXACT_COEFFICIENT = 1024


def _integer_relations(expr):
    """Each comparison of integers written with fractions, (i - j) / 3 < 1, as its exact integer form, i - j < 3:
    both sides times the denominators' least common multiple (positive, so the relation keeps its direction).
    Otherwise the kernel would compare float32 values and the reference float64 ones, which disagree where a
    fraction meets its bound exactly (5/3 - 2/3 < 1), and a tile's bounds, rounded, could call such a tile empty.
    Only where the difference of the sides is a polynomial with rational coefficients in integer variables
    (positions, lengths, int32 inputs); anything else is left as written."""
    def exact(relation):
        difference = sp.expand(relation.lhs - relation.rhs)
        if difference.is_Number or difference.has(SCORE):
            return relation
        try:
            poly = sp.Poly(difference)
        except sp.PolynomialError:
            return relation
        if not all(gen.is_integer for gen in poly.gens) or not all(c.is_Rational for c in poly.coeffs()):
            return relation
        multiple = functools.reduce(sp.ilcm, [c.q for c in poly.coeffs()], 1)
        if multiple == 1:
            return relation
        # the kernels compute an integer form in int: positions (up to 2^20 and more) times a coefficient must
        # stay below 2^31, so a large one (i / 100000 < j) stays a float comparison, as written
        scaled = [abs(c * multiple) for monomial, c in zip(poly.monoms(), poly.coeffs()) if any(monomial)]
        if max(scaled) > MAX_EXACT_COEFFICIENT or abs(poly.coeff_monomial(1) * multiple) >= 2 ** 30:
            return relation
        return relation.func(sp.expand(relation.lhs * multiple), sp.expand(relation.rhs * multiple))
    return expr.replace(lambda node: isinstance(node, sp.Rel) and node.rel_op in ("<", "<=", ">", ">=", "==", "!="),
                        exact)


def parse(text: str, *, field: str, inputs: dict, boolean: bool) -> sp.Basic:
    """One expression as sympy: a Boolean when `boolean`, else an Expr. Raises ExpressionError."""
    _check_input_names(inputs)
    return _parse(text, field, inputs, boolean)[0]


# ---- sympy -> C++ ---------------------------------------------------------------------------
_C_FLOAT_FUNCTIONS = {sp.exp: "expf", sp.log: "logf", sp.tanh: "tanhf", sp.sin: "sinf", sp.cos: "cosf",
                      sp.tan: "tanf", sp.sinh: "sinhf", sp.cosh: "coshf"}


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


# ---- sympy -> numpy --------------------------------------------------------------------------
_NP_FUNCTIONS = {sp.exp: np.exp, sp.log: np.log, sp.tanh: np.tanh, sp.sin: np.sin, sp.cos: np.cos,
                 sp.tan: np.tan, sp.sinh: np.sinh, sp.cosh: np.cosh, sp.Abs: np.abs, sp.sign: np.sign}


def _gather(array, indices):
    """A tensor load with every index clamped into the tensor, as the kernels do."""
    array = np.asarray(array)
    if array.ndim != len(indices):
        raise ValueError(f"a tensor input of {array.ndim} dims is indexed with {len(indices)} subscripts")
    clamped = tuple(np.clip(np.asarray(index, dtype=np.int64), 0, size - 1) for index, size in zip(indices, array.shape))
    return array[np.broadcast_arrays(*clamped)] if len(clamped) > 1 else array[clamped[0]]


def _np_eval(expr, env: dict, values: dict):
    """Evaluates a sympy tree with numpy on broadcasting arrays; `env` maps symbols to values."""
    ev = functools.partial(_np_eval, env=env, values=values)
    if expr == sp.true:
        return np.bool_(True)
    if expr == sp.false:
        return np.bool_(False)
    if expr.is_Integer:
        return np.int64(int(expr))
    if expr.is_Number or isinstance(expr, sp.NumberSymbol):
        return np.float64(float(expr))
    if expr.is_Symbol:
        if expr in env:
            return env[expr]
        if expr.name in values:
            return np.float64(values[expr.name])
        raise ExpressionError(f"no value given for the input '{expr.name}'")
    if isinstance(expr, sp.Indexed):
        name = expr.base.label.name
        if name not in values:
            raise ExpressionError(f"no value given for the input '{name}'")
        return _gather(values[name], [ev(index) for index in expr.indices])
    if isinstance(expr, sp.Add):
        return functools.reduce(np.add, [ev(a) for a in expr.args])
    if isinstance(expr, sp.Mul):
        return functools.reduce(np.multiply, [ev(a) for a in expr.args])
    if isinstance(expr, sp.Pow):
        base, exponent = expr.args
        if exponent.is_Integer and exponent >= 0 and base.is_integer:
            return np.power(ev(base), int(exponent))
        return np.power(np.asarray(ev(base), dtype=np.float64), np.asarray(ev(exponent), dtype=np.float64))
    if isinstance(expr, (sp.floor, sp.ceiling)):
        (a,) = expr.args
        if a.is_integer:
            return ev(a)
        numerator, denominator = sp.fraction(sp.together(a))
        if numerator.is_integer and denominator.is_integer and denominator != 1:
            n, d = ev(numerator), ev(denominator)
            return np.floor_divide(n, d) if isinstance(expr, sp.floor) else -np.floor_divide(-n, d)
        return (np.floor if isinstance(expr, sp.floor) else np.ceil)(ev(a))
    if isinstance(expr, sp.Mod):
        return np.mod(ev(expr.args[0]), ev(expr.args[1]))
    if isinstance(expr, sp.Min):
        return functools.reduce(np.minimum, [ev(a) for a in expr.args])
    if isinstance(expr, sp.Max):
        return functools.reduce(np.maximum, [ev(a) for a in expr.args])
    if expr.func in _NP_FUNCTIONS:
        return _NP_FUNCTIONS[expr.func](ev(expr.args[0]))
    if isinstance(expr, sp.Heaviside):
        at_zero = float(expr.args[1]) if len(expr.args) > 1 else 0.5
        return np.heaviside(np.asarray(ev(expr.args[0]), dtype=np.float64), at_zero)
    if isinstance(expr, sp.Piecewise):
        result = None
        for value, condition in reversed(expr.args):
            v = ev(value)
            if result is None:
                result = v if condition == sp.true else np.where(ev(condition), v, 0)
            else:
                result = np.where(ev(condition), v, result)
        return result
    if isinstance(expr, sp.And):
        return functools.reduce(np.logical_and, [ev(a) for a in expr.args])
    if isinstance(expr, sp.Or):
        return functools.reduce(np.logical_or, [ev(a) for a in expr.args])
    if isinstance(expr, sp.Not):
        return np.logical_not(ev(expr.args[0]))
    if isinstance(expr, sp.Rel):
        op = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
              "==": np.equal, "!=": np.not_equal}[expr.rel_op]
        return op(ev(expr.args[0]), ev(expr.args[1]))
    raise ExpressionError(f"{type(expr).__name__} cannot be evaluated with numpy ({expr})")


# ---- interval arithmetic as a tiny straight-line program ------------------------------------
# A value in a _Program is a temp name (str) or a Python constant (int / float / bool). Ops:
#   param name          a parameter of tile_class (i_lo, ...), or a point value given by the caller
#   point expr ctype    a sympy expression not involving the ranged symbols, printed / numpy-evaluated
#   add sub mul div neg min max      arithmetic in the op's ctype
#   floor_div a d, mod a d           Python integer semantics, d a positive constant
#   floor ceil a        float -> long long
#   fn name a           a float function (expf, tanhf, logf, sqrtf, ...)
#   tofloat a, finite a, lt le gt ge eq ne a b, and or, not a, select c a b
_PY_FLOAT_FN = {"expf": np.exp, "tanhf": np.tanh, "logf": np.log, "sqrtf": np.sqrt, "sinf": np.sin, "cosf": np.cos}
_C_OPS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||"}


class _Program:
    def __init__(self):
        self.ops: list[tuple] = []    # (name, ctype, op, args)
        self.memo: dict = {}

    def emit(self, ctype: str, op: str, *args):
        key = (ctype, op, args)
        if key in self.memo:
            return self.memo[key]
        if op == "and" and False in args or op == "or" and True in args:
            value = op == "or"                      # short-circuit on a constant
        elif op in ("and", "or") and any(not isinstance(a, str) for a in args):
            strings = [a for a in args if isinstance(a, str)]      # the other operand is neutral
            value = strings[0] if strings else self._apply(ctype, op, args)
        elif op == "select" and not isinstance(args[0], str):
            value = args[1] if args[0] else args[2]
        elif op not in ("param", "point", "fn", "summary") and all(not isinstance(a, str) for a in args):
            value = self._apply(ctype, op, args)    # fold constants
        else:
            value = f"t{len(self.ops)}"
            self.ops.append((value, ctype, op, args))
        self.memo[key] = value
        return value

    def negated(self, value):
        """z where value is the program's -z, else None."""
        if isinstance(value, str):
            for name, _, op, args in self.ops:
                if name == value:
                    return args[0] if op == "neg" else None
        return None

    # -- C ------------------------------------------------------------------------------------
    def c_code(self, result, printer: _CPrinter, indent: str = "    ", integer_type: str = "long long",
               result_type: str = "int") -> list[str]:
        """The program as C++ statements. A value used once is written into its user's expression, so that
        && || ?: evaluate it only when they need it (a tile test that computed both sides of an && ran a
        register over a 64-register budget, 2026-11-25); a value used more than once, or one that reads a
        run-time summary (whose loads should be in flight together), gets a const of its own.
        Integers are computed in `integer_type`: long long, so that no bound built from int positions and
        lengths overflows (products, powers), or int where the caller knows its sums stay in range (the mask
        kinds: what the kernels compute their positions in). Hoisted sums (Modifiers._hoisted_sums) are int
        members either way, as the per-element test always was."""
        live = self._live(result)
        uses: dict = {}
        for name, _, op, args in self.ops:
            if name in live and op not in ("param", "point"):
                for arg in self._operands(op, args):
                    uses[arg] = uses.get(arg, 0) + 1
        if isinstance(result, str):
            uses[result] = uses.get(result, 0) + 1
        inlined: dict = {}
        loads: set = set()   # values that read a run-time summary: kept eager, so that their loads issue together
        write = lambda code: re.sub(r"\bt\d+\b", lambda m: inlined.get(m.group(0), m.group(0)), code)  # noqa: E731
        lines = []
        for name, ctype, op, args in self.ops:
            if name not in live:
                continue
            code = self._c_op(ctype, op, args, printer)
            if integer_type != "long long":
                code = re.sub(r"(?<![\w.])(\d+)LL\b", r"\1", code.replace("(long long)", f"({integer_type})"))
                ctype = integer_type if ctype == "long long" else ctype
            code = write(code)
            if op == "summary" or any(arg in loads for arg in self._operands(op, args)):
                loads.add(name)
            if op == "param":   # (the tile's bounds arrive as int: widened where the program computes in long long)
                inlined[name] = code if ctype == "int" else f"(({ctype}){code})"
            elif uses.get(name, 0) == 1 and name not in loads:
                inlined[name] = f"({code})"
            else:
                lines.append(f"{indent}const {ctype} {name} = {code};")
        lines.append(f"{indent}return {write(self._c_value(result, result_type))};")
        return lines

    @staticmethod
    def _operands(op, args) -> tuple:
        """The arguments of an op that are program values (fn's first is a function name, summary's first
        two a tensor and a bound's side)."""
        return tuple(a for a in (args[1:] if op == "fn" else args[2:] if op == "summary" else args) if isinstance(a, str))

    def _live(self, result) -> set:
        live = {result} if isinstance(result, str) else set()
        for name, _, op, args in reversed(self.ops):
            if name not in live or op in ("param", "point"):   # their args are names / sympy, not temps
                continue
            live.update(self._operands(op, args))
        return live

    @staticmethod
    def _c_value(value, ctype) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "true" if value else "false"
        if ctype == "float" or isinstance(value, float):
            text = _float_literal(value)
        else:
            text = f"{value}LL" if ctype == "long long" else str(value)
        return f"({text})" if text.startswith("-") else text

    def _c_op(self, ctype, op, args, printer) -> str:
        if op == "param":
            return args[0]
        if op == "point":
            expr = args[0]
            return f"(long long)({printer.i(expr)})" if ctype == "long long" else printer.f(expr)
        if op == "fn":
            return f"{args[0]}({self._c_value(args[1], 'float')})"
        if op == "summary":   # (tensor name, "lo" | "hi", other index, first, last)
            return (f"summary_{args[1]}_{args[0]}({self._c_value(args[2], 'long long')}, "
                    f"{self._c_value(args[3], 'long long')}, {self._c_value(args[4], 'long long')})")
        if op in ("floor", "ceil", "finite"):
            a = self._c_value(args[0], "float")
            return f"isfinite({a})" if op == "finite" else f"(long long)({op}f({a}))"
        if op == "select":
            return f"{self._c_value(args[0], 'bool')} ? {self._c_value(args[1], ctype)} : {self._c_value(args[2], ctype)}"
        # comparisons and logic take their operands' type, not the bool they produce
        operand_type = "long long" if ctype == "bool" else ctype
        v = [self._c_value(a, operand_type) for a in args]
        if op in _C_OPS:
            return f"{v[0]} {_C_OPS[op]} {v[1]}"
        if op == "neg":
            return f"-{v[0]}"
        if op in ("min", "max"):
            return f"{'f' + op if ctype == 'float' else op}({v[0]}, {v[1]})"
        if op == "floor_div":
            return f"floor_div({v[0]}, {v[1]})"
        if op == "mod":
            return f"py_mod({v[0]}, {v[1]})"
        if op == "tofloat":
            return f"(float)({v[0]})"
        if op == "not":
            return f"!{v[0]}"
        raise AssertionError(op)

    # -- Python -------------------------------------------------------------------------------
    def run(self, result, env: dict, point: Callable, summary: Optional[Callable] = None):
        """Runs the program on concrete values: `env` holds the params, `point(expr)` a point value,
        `summary(name, which, other, first, last)` a run-time summary's bound."""
        values = dict(env)
        get = lambda a: values[a] if isinstance(a, str) else a   # noqa: E731
        with np.errstate(all="ignore"):
            for name, ctype, op, args in self.ops:
                if op == "param":
                    values[name] = env[args[0]]
                elif op == "point":
                    value = point(args[0])
                    values[name] = int(value) if ctype == "long long" else np.float32(value)
                elif op == "fn":
                    values[name] = np.float32(_PY_FLOAT_FN[args[0]](np.float32(get(args[1]))))
                elif op == "summary":
                    if summary is None:
                        raise ExpressionError(f"a bound of '{args[0]}' depends on its run-time values")
                    value = summary(args[0], args[1], int(get(args[2])), int(get(args[3])), int(get(args[4])))
                    values[name] = int(value) if ctype == "long long" else np.float32(value)
                else:
                    values[name] = self._apply(ctype, op, tuple(get(a) for a in args))
        return get(result)

    @staticmethod
    def _apply(ctype, op, args):
        if ctype == "float":
            args = tuple(np.float32(a) if not isinstance(a, (bool, np.bool_)) else a for a in args)
        a = args[0]
        if op == "add":
            r = a + args[1]
        elif op == "sub":
            r = a - args[1]
        elif op == "mul":
            r = a * args[1]
        elif op == "div":
            r = a / args[1]
        elif op == "neg":
            r = -a
        elif op == "min":
            r = min(a, args[1]) if ctype != "float" else np.fmin(a, args[1])
        elif op == "max":
            r = max(a, args[1]) if ctype != "float" else np.fmax(a, args[1])
        elif op == "floor_div":
            r = a // args[1]
        elif op == "mod":
            r = a % args[1]
        elif op in ("floor", "ceil"):
            x = float(a)
            r = (math.floor(x) if op == "floor" else math.ceil(x)) if math.isfinite(x) else 0
        elif op == "tofloat":
            r = np.float32(a)
        elif op == "finite":
            r = bool(np.isfinite(a))
        elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
            r = {"lt": a < args[1], "le": a <= args[1], "gt": a > args[1], "ge": a >= args[1],
                 "eq": a == args[1], "ne": a != args[1]}[op]
            r = bool(r)
        elif op == "and":
            r = bool(a) and bool(args[1])
        elif op == "or":
            r = bool(a) or bool(args[1])
        elif op == "not":
            r = not bool(a)
        elif op == "select":
            r = args[1] if a else args[2]
        else:
            raise AssertionError(op)
        if ctype == "float":
            return np.float32(r)
        if ctype in ("long long", "int"):
            return int(r)
        return bool(r)


@dataclass
class _Interval:
    """Bounds of one expression: lo / hi are program values, None where statically unbounded.
    `ok` is a program bool (or True): false at run time when a float bound may be NaN or infinite,
    or a function left its domain; a relation is only decided when its operands are ok."""
    lo: object
    hi: object
    integer: bool
    ok: object = True

    @property
    def bounded(self) -> bool:
        return self.lo is not None and self.hi is not None


class _Bounder:
    """Builds interval code for sympy trees. `ranged` maps symbols to (lo, hi) program values;
    every other symbol (and any tensor load not indexed by a ranged symbol) is a point."""

    def __init__(self, program: _Program, ranged: dict, tensors: tuple = ()):
        self.p = program
        self.ranged = ranged
        self.tensors = {name: (dtype, ndim) for name, dtype, ndim in tensors}
        self.summaries: dict[str, int] = {}   # tensor -> the dimension a run-time summary bounds it along

    # -- helpers ------------------------------------------------------------------------------
    def ctype(self, integer: bool) -> str:
        return "long long" if integer else "float"

    def both_ok(self, *oks):
        result = True
        for ok in oks:
            if ok is True:
                continue
            result = ok if result is True else self.p.emit("bool", "and", result, ok)
        return result

    def unbounded(self, integer: bool) -> _Interval:
        return _Interval(None, None, integer)

    def as_float(self, iv: _Interval) -> _Interval:
        if not iv.integer:
            return iv
        if not iv.bounded:
            return _Interval(None, None, False)
        conv = lambda v: self.p.emit("float", "tofloat", v) if isinstance(v, str) else float(v)   # noqa: E731
        return _Interval(conv(iv.lo), conv(iv.hi), False, iv.ok)

    def finished_float(self, lo, hi, ok) -> _Interval:
        """A float result: ok also requires both bounds finite (no NaN / inf can hide in between)."""
        finite = self.p.emit("bool", "and", self.p.emit("bool", "finite", lo), self.p.emit("bool", "finite", hi))
        return _Interval(lo, hi, False, self.both_ok(ok, finite))

    def result(self, lo, hi, integer, ok) -> _Interval:
        return _Interval(lo, hi, True, ok) if integer else self.finished_float(lo, hi, ok)

    # -- the tree -----------------------------------------------------------------------------
    def bound(self, expr) -> _Interval:
        integer = bool(expr.is_integer)
        if expr.is_Number or isinstance(expr, sp.NumberSymbol):
            value = int(expr) if expr.is_Integer else float(expr)
            return _Interval(value, value, expr.is_Integer)
        if expr in self.ranged:
            lo, hi = self.ranged[expr]
            return _Interval(lo, hi, True)
        if not any(expr.has(s) for s in self.ranged):
            value = self.p.emit(self.ctype(integer), "point", expr)
            if integer:
                return _Interval(value, value, True)
            return self.finished_float(value, value, True)
        handler = {sp.Add: self.add, sp.Mul: self.mul, sp.Pow: self.power, sp.floor: self.rounding,
                   sp.ceiling: self.rounding, sp.Mod: self.mod, sp.Min: self.min_max, sp.Max: self.min_max,
                   sp.Abs: self.abs, sp.Piecewise: self.piecewise}.get(expr.func)
        if handler is None and expr.func in (sp.exp, sp.tanh, sp.log):
            handler = self.monotone
        if handler is None and expr.func in (sp.sin, sp.cos):
            handler = self.periodic
        if handler is None and isinstance(expr, sp.Indexed):
            return self.summarised(expr, integer)
        if handler is None:   # a node we do not bound
            return self.unbounded(integer)
        return handler(expr, integer)

    def summarised(self, expr, integer):
        """A tensor load whose one ranged index spans [lo, hi] over the tile: bounded by the min and max
        of the tensor over those positions, read from a summary that a small kernel computes before the
        attention kernel (per SUMMARY_GRAIN positions along that dimension; see Modifiers.summaries).
        One summarised dimension per tensor; any other use is unbounded."""
        name = expr.base.label.name
        if name not in self.tensors:
            return self.unbounded(integer)
        ranged = [d for d, index in enumerate(expr.indices) if any(index.has(s) for s in self.ranged)]
        if len(ranged) != 1 or self.summaries.get(name, ranged[0]) != ranged[0]:
            return self.unbounded(integer)
        dim = ranged[0]
        span = self.bound(expr.indices[dim])
        if not span.bounded or not span.integer or span.ok is not True:
            return self.unbounded(integer)
        other = 0
        if len(expr.indices) == 2:
            other = self.p.emit("long long", "point", expr.indices[1 - dim])
        self.summaries[name] = dim
        ctype = self.ctype(integer)
        lo = self.p.emit(ctype, "summary", name, "lo", other, span.lo, span.hi)
        hi = self.p.emit(ctype, "summary", name, "hi", other, span.lo, span.hi)
        return _Interval(lo, hi, True) if integer else self.finished_float(lo, hi, True)

    def add(self, expr, integer):
        ivs = [self.bound(a) for a in expr.args]
        if not integer:
            ivs = [self.as_float(iv) for iv in ivs]
        ctype = self.ctype(integer)
        def plus(x, y):   # x + (-z) and (-z) + x as x - z: what ptxas was seen to keep a register fewer for
            if self.p.negated(y) is not None:
                return self.p.emit(ctype, "sub", x, self.p.negated(y))
            if self.p.negated(x) is not None:
                return self.p.emit(ctype, "sub", y, self.p.negated(x))
            return self.p.emit(ctype, "add", x, y)
        total = lambda values: None if any(v is None for v in values) else functools.reduce(plus, values)  # noqa: E731
        lo, hi = total([iv.lo for iv in ivs]), total([iv.hi for iv in ivs])
        if not integer and (lo is None or hi is None):
            return self.unbounded(False)
        return self.result(lo, hi, integer, self.both_ok(*[iv.ok for iv in ivs]))

    def scale(self, iv: _Interval, c, integer) -> _Interval:
        """c * [lo, hi] for a constant c: the sign of c decides which end is which."""
        ctype = self.ctype(integer)
        if not integer:
            iv = self.as_float(iv)
            c = float(c)
        mul = lambda v: None if v is None else (  # noqa: E731
            self.p.emit(ctype, "neg", v) if c == -1 else self.p.emit(ctype, "mul", c, v))
        lo, hi = (mul(iv.lo), mul(iv.hi)) if c >= 0 else (mul(iv.hi), mul(iv.lo))
        if c == 0:
            lo = hi = 0 if integer else 0.0
        if not integer and (lo is None or hi is None):
            return self.unbounded(False)
        return self.result(lo, hi, integer, iv.ok)

    def product(self, a: _Interval, b: _Interval, integer) -> _Interval:
        if not integer:
            a, b = self.as_float(a), self.as_float(b)
        if not (a.bounded and b.bounded):
            return self.unbounded(integer)
        ctype = self.ctype(integer)
        corners = [self.p.emit(ctype, "mul", x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        lo, hi = corners[0], corners[0]
        for corner in corners[1:]:
            lo, hi = self.p.emit(ctype, "min", lo, corner), self.p.emit(ctype, "max", hi, corner)
        return self.result(lo, hi, integer, self.both_ok(a.ok, b.ok))

    def mul(self, expr, integer):
        coefficient, rest = expr.as_coeff_Mul()
        if coefficient != 1:
            return self.scale(self.bound(rest), coefficient, integer and coefficient.is_Integer)
        factors = list(expr.args)
        iv = self.bound(factors[0])
        for factor in factors[1:]:
            iv = self.product(iv, self.bound(factor), integer)
        return iv

    def power(self, expr, integer):
        base, exponent = expr.args
        if exponent.is_Integer and exponent > 0:
            iv = self.bound(base)
            if not base.is_integer or not integer:
                iv = self.as_float(iv)
            if not iv.bounded:
                return self.unbounded(integer)
            n, ctype = int(exponent), self.ctype(iv.integer)
            pw = lambda v: functools.reduce(lambda acc, _: self.p.emit(ctype, "mul", acc, v), range(n - 1), v)  # noqa: E731
            a, b = pw(iv.lo), pw(iv.hi)
            if n % 2:
                return self.result(a, b, iv.integer, iv.ok)
            # even powers fall to 0 inside an interval that straddles it
            zero = 0 if iv.integer else 0.0
            nonneg = self.p.emit("bool", "ge", iv.lo, zero)
            nonpos = self.p.emit("bool", "le", iv.hi, zero)
            lo = self.p.emit(ctype, "select", nonneg, a, self.p.emit(ctype, "select", nonpos, b, zero))
            straddles = self.p.emit(ctype, "max", a, b)
            hi = self.p.emit(ctype, "select", nonneg, b, self.p.emit(ctype, "select", nonpos, a, straddles))
            return self.result(lo, hi, iv.integer, iv.ok)
        if exponent == sp.Rational(1, 2):
            return self.monotone(expr, integer, function="sqrtf", argument=base)
        if exponent == -1:
            iv = self.as_float(self.bound(base))
            if not iv.bounded:
                return self.unbounded(False)
            # 1/x is decreasing on each side of 0; an interval holding 0 is left undecided
            positive = self.p.emit("bool", "gt", iv.lo, 0.0)
            negative = self.p.emit("bool", "lt", iv.hi, 0.0)
            lo = self.p.emit("float", "div", 1.0, iv.hi)
            hi = self.p.emit("float", "div", 1.0, iv.lo)
            return self.finished_float(lo, hi, self.both_ok(iv.ok, self.p.emit("bool", "or", positive, negative)))
        return self.unbounded(integer)

    def rounding(self, expr, integer):
        (a,) = expr.args
        is_floor = isinstance(expr, sp.floor)
        if a.is_integer:
            return self.bound(a)
        numerator, denominator = sp.fraction(sp.together(a))
        if numerator.is_integer and denominator.is_Integer and denominator > 0:
            # floor(n / d) and ceil(n / d) are monotone in n for a positive constant d
            iv, d = self.bound(numerator), int(denominator)
            if is_floor:
                div = lambda v: None if v is None else self.p.emit("long long", "floor_div", v, d)  # noqa: E731
                return _Interval(div(iv.lo), div(iv.hi), True, iv.ok)
            neg_div = lambda v: None if v is None else self.p.emit(  # noqa: E731
                "long long", "neg", self.p.emit("long long", "floor_div", self.p.emit("long long", "neg", v), d))
            return _Interval(neg_div(iv.lo), neg_div(iv.hi), True, iv.ok)
        iv = self.as_float(self.bound(a))
        if not iv.bounded:
            return self.unbounded(True)
        op = "floor" if is_floor else "ceil"
        return _Interval(self.p.emit("long long", op, iv.lo), self.p.emit("long long", op, iv.hi), True, iv.ok)

    def mod(self, expr, integer):
        a, m = expr.args
        if not (integer and a.is_integer and m.is_Integer and m > 0):
            return self.unbounded(integer)
        m = int(m)
        iv = self.bound(a)
        if not iv.bounded:
            return _Interval(0, m - 1, True)   # whatever the argument, the remainder is in [0, m)
        # exact when lo and hi share a period ([lo, hi] does not wrap); otherwise every remainder
        # (and the argument's bounds are trustworthy: a bad argument still leaves the remainder in [0, m))
        same = self.p.emit("bool", "eq", self.p.emit("long long", "floor_div", iv.lo, m),
                           self.p.emit("long long", "floor_div", iv.hi, m))
        exact = self.p.emit("bool", "and", same, iv.ok)
        lo = self.p.emit("long long", "select", exact, self.p.emit("long long", "mod", iv.lo, m), 0)
        hi = self.p.emit("long long", "select", exact, self.p.emit("long long", "mod", iv.hi, m), m - 1)
        return _Interval(lo, hi, True)

    def min_max(self, expr, integer):
        ivs = [self.bound(a) for a in expr.args]
        if not integer:
            ivs = [self.as_float(iv) for iv in ivs]
            if not all(iv.bounded for iv in ivs):
                return self.unbounded(False)
        op, ctype = ("min" if isinstance(expr, sp.Min) else "max"), self.ctype(integer)

        def fold(values, drop_unknown):
            known = [v for v in values if v is not None]
            if not drop_unknown and len(known) < len(values):
                return None
            if not known:
                return None
            return functools.reduce(lambda x, y: self.p.emit(ctype, op, x, y), known)
        # min: the lowest lo needs every lo, while any known hi caps the result (max: mirrored)
        lo = fold([iv.lo for iv in ivs], drop_unknown=(op == "max"))
        hi = fold([iv.hi for iv in ivs], drop_unknown=(op == "min"))
        return self.result(lo, hi, integer, self.both_ok(*[iv.ok for iv in ivs]))

    def abs(self, expr, integer):
        iv = self.bound(expr.args[0])
        if not integer:
            iv = self.as_float(iv)
        if not iv.bounded:
            return _Interval(0, None, True) if integer else self.unbounded(False)
        ctype = self.ctype(integer)
        zero = 0 if integer else 0.0
        neg_lo, neg_hi = self.p.emit(ctype, "neg", iv.lo), self.p.emit(ctype, "neg", iv.hi)
        nonneg = self.p.emit("bool", "ge", iv.lo, zero)
        nonpos = self.p.emit("bool", "le", iv.hi, zero)
        lo = self.p.emit(ctype, "select", nonneg, iv.lo, self.p.emit(ctype, "select", nonpos, neg_hi, zero))
        hi = self.p.emit(ctype, "select", nonneg, iv.hi,
                         self.p.emit(ctype, "select", nonpos, neg_lo, self.p.emit(ctype, "max", neg_lo, iv.hi)))
        return self.result(lo, hi, integer, iv.ok)

    def monotone(self, expr, integer, function=None, argument=None):
        function = function or {sp.exp: "expf", sp.tanh: "tanhf", sp.log: "logf"}[expr.func]
        iv = self.as_float(self.bound(argument if argument is not None else expr.args[0]))
        if not iv.bounded:
            return self.unbounded(False)
        ok = iv.ok
        if function in ("logf", "sqrtf"):   # outside the domain the kernel would see NaN: undecided
            ok = self.both_ok(ok, self.p.emit("bool", "ge", iv.lo, 0.0))
        lo, hi = self.p.emit("float", "fn", function, iv.lo), self.p.emit("float", "fn", function, iv.hi)
        return self.finished_float(lo, hi, ok)

    def periodic(self, expr, integer):
        iv = self.as_float(self.bound(expr.args[0]))
        if not iv.bounded:   # the argument could be NaN, and sin(NaN) is not in [-1, 1]
            return self.unbounded(False)
        return _Interval(-1.0, 1.0, False, iv.ok)

    def piecewise(self, expr, integer):
        # the union of every branch's bounds, whatever the conditions: sound, if loose
        ivs = [self.bound(value) for value, _ in expr.args]
        if not integer:
            ivs = [self.as_float(iv) for iv in ivs]
        if not all(iv.bounded for iv in ivs):
            return self.unbounded(integer)
        ctype = self.ctype(integer)
        lo = functools.reduce(lambda x, y: self.p.emit(ctype, "min", x, y), [iv.lo for iv in ivs])
        hi = functools.reduce(lambda x, y: self.p.emit(ctype, "max", x, y), [iv.hi for iv in ivs])
        return self.result(lo, hi, integer, self.both_ok(*[iv.ok for iv in ivs]))

    # -- booleans: two decisions, "true at every point of the tile" (full) and "maybe true at one" ------
    # Kept apart rather than as one tri-state, so that a kernel asking one question computes only its
    # half (a select chain of both is not pruned: the compiler cannot know that they exclude each other),
    # and each half written as the kernels ask it (is any pair maybe visible? is every pair visible?).
    def decide(self, expr):
        """(full, maybe): program bools (or Python ones); full only if expr is true at every point of the
        ranges, maybe false only if it is true at none."""
        if expr == sp.true:
            return True, True
        if expr == sp.false:
            return False, False
        if isinstance(expr, (sp.And, sp.Or)):
            parts = [self.decide(a) for a in expr.args]
            op = "and" if isinstance(expr, sp.And) else "or"
            join = lambda values: functools.reduce(lambda x, y: self.p.emit("bool", op, x, y), values)  # noqa: E731
            return join([full for full, _ in parts]), join([maybe for _, maybe in parts])
        if isinstance(expr, sp.Not):
            full, maybe = self.decide(expr.args[0])
            return self.p.emit("bool", "not", maybe), self.p.emit("bool", "not", full)
        if isinstance(expr, sp.Rel) and expr.rel_op in ("<", "<=", ">", ">=", "==", "!="):
            return self.relation(expr)
        return False, True

    def relation(self, expr):
        lhs, rhs = expr.args
        op = expr.rel_op
        if lhs.is_integer and rhs.is_integer and _negative_terms(lhs - rhs) > _negative_terms(rhs - lhs):
            # B op' A instead (the same relation): the difference with fewer negated terms, so that a tile's
            # bounds read a hoisted member as it is, not its negation too (j <= c0 + i as c0 + i - j >= 0)
            lhs, rhs, op = rhs, lhs, {"<": ">", "<=": ">=", ">": "<", ">=": "<="}.get(op, op)
        if lhs.is_integer and rhs.is_integer:
            # A op B as D op 0 with D = A - B expanded, so that i + 5 >= i is decided; the unexpanded
            # difference is bounded too (expansion can loosen (i - j)**2) and the two intersected. D's
            # number term c stays on the right, D - c op -c, so that the kernel compares with a constant
            # rather than keeping a member plus c in a register of its own (i - j < 256, not i - j - 256 < 0)
            constant = sp.expand(lhs - rhs).as_coeff_Add()[0]
            constant = int(constant) if constant.is_Integer else 0
            a = self.difference(lhs - constant, rhs)
            b = _Interval(-constant, -constant, True)
        else:
            a, b = self.as_float(self.bound(lhs)), self.as_float(self.bound(rhs))
        ok = self.both_ok(a.ok, b.ok)

        def cmp(op, x, y, unknown=False):   # a statically unknown bound decides nothing
            if x is None or y is None:
                return unknown
            return self.p.emit("bool", op, x, y)

        if op in ("<", "<=", ">", ">="):
            strict = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge"}[op]
            # A < B everywhere when A's highest bound is below B's lowest; somewhere maybe when A's lowest is below B's highest
            if op in ("<", "<="):
                full, maybe = cmp(strict, a.hi, b.lo), cmp(strict, a.lo, b.hi, True)
            else:
                full, maybe = cmp(strict, a.lo, b.hi), cmp(strict, a.hi, b.lo, True)
        else:
            point = self.p.emit("bool", "and", self.p.emit("bool", "and", cmp("eq", a.lo, a.hi), cmp("eq", b.lo, b.hi)),
                                cmp("eq", a.lo, b.lo))
            apart = self.p.emit("bool", "or", cmp("lt", a.hi, b.lo), cmp("gt", a.lo, b.hi))
            full, maybe = (point, self.p.emit("bool", "not", apart)) if op == "==" else (apart, self.p.emit("bool", "not", point))
        decided_full = self.p.emit("bool", "and", ok, full) if ok is not True else full
        # (with a bound that may be NaN or infinite, any pair may be visible)
        maybe = self.p.emit("bool", "or", self.p.emit("bool", "not", ok), maybe) if ok is not True else maybe
        return decided_full, maybe

    def difference(self, lhs, rhs) -> _Interval:
        expanded, plain = sp.expand(lhs - rhs), lhs - rhs
        a = self.bound(expanded)
        if plain == expanded:
            return a
        b = self.bound(plain)
        if not (a.integer and b.integer):   # (a rational coefficient can make sympy's bounds float)
            a, b = self.as_float(a), self.as_float(b)
        ctype = self.ctype(a.integer)
        pick = lambda x, y, op: x if y is None else y if x is None else self.p.emit(ctype, op, x, y)  # noqa: E731
        return _Interval(pick(a.lo, b.lo, "max"), pick(a.hi, b.hi, "min"), a.integer, self.both_ok(a.ok, b.ok))


def _negative_terms(difference) -> int:
    """How many terms of the expanded difference, numbers aside, have a negative coefficient."""
    terms = sp.Add.make_args(sp.expand(difference))
    return sum(1 for term in terms if not term.is_Number and term.could_extract_minus_sign())


def _power_of_two(value) -> bool:
    """Is value an integer constant 2^k that fits the kernels' 32-bit ints (0 <= k <= 30)? Division and remainder
    by one become a shift and a mask; larger ones go the general way, which reports that they do not fit."""
    return value.is_Integer and 0 < value < 2**31 and (int(value) & (int(value) - 1)) == 0


# ---- the result -----------------------------------------------------------------------------
_C_HELPERS = """\
  // Python's // and % (floor toward -inf; the remainder takes the divisor's sign); 0 for a zero divisor
  template <typename T> static __device__ __forceinline__ T floor_div(T a, T d) {
    if (d == 0) return 0;
    T q = a / d;
    return (q * d != a && ((a < 0) != (d < 0))) ? q - 1 : q;
  }
  template <typename T> static __device__ __forceinline__ T py_mod(T a, T d) {
    if (d == 0) return 0;
    T r = a % d;
    return (r != 0 && ((r < 0) != (d < 0))) ? r + d : r;
  }
  static __device__ __forceinline__ float py_fmod(float a, float d) {
    float r = fmodf(a, d);
    return (r != 0.f && ((r < 0.f) != (d < 0.f))) ? r + d : r;
  }
  static __device__ __forceinline__ int ipow(int a, int n) {
    int r = 1;
    for (int k = 0; k < n; ++k) r *= a;
    return r;
  }
  static __device__ __forceinline__ float heaviside(float x, float at_zero) {
    return x > 0.f ? 1.f : (x < 0.f ? 0.f : at_zero);
  }
"""


@dataclass(frozen=True)
class Modifiers:
    """A spec's mask_mod / score_mod, parsed and checked. Inactive (all None) without them."""

    mask: Optional[sp.Basic] = None
    score: Optional[sp.Expr] = None
    score_grad: Optional[sp.Expr] = None
    tensors: tuple = ()      # (name, 'float32' | 'int32', ndim), in declaration order
    scalars: tuple = ()      # scalar names, in declaration order
    mask_text: Optional[str] = field(default=None, compare=False)
    score_text: Optional[str] = field(default=None, compare=False)

    @property
    def active(self) -> bool:
        return self.mask is not None or self.score is not None

    def record(self) -> dict:
        """What the build record stores: the expressions as written and sympy's derivatives (in score, and
        in each read of a float input: `input_grads`)."""
        inputs = {name: dtype for name, dtype, _ in self.tensors}
        inputs.update({name: "scalar" for name in self.scalars})
        return {"mask_mod": self.mask_text, "score_mod": self.score_text,
                "score_grad": None if self.score_grad is None else str(self.score_grad),
                "input_grads": {str(read): str(derivative) for _, read, derivative in self.input_grads},
                **({"input_grads_not_derived": {str(read): why for _, read, why in self.input_grads_not_derived}}
                   if self.input_grads_not_derived else {}),
                "inputs": inputs}

    @functools.cached_property
    def input_grads(self) -> tuple:
        """score_mod's derivative in each of its reads of a float input: ((name, read, derivative), ...), where
        read is a scalar's symbol or one float32 tensor load `name[indices]`, in a fixed order, zero derivatives
        left out. Each read is differentiated as an independent variable (so bias[i] + bias[j] gives 1 for each,
        not sympy's KroneckerDelta of the indices); a read's gradient goes to the element it loads (its indices
        clamped into the tensor, as the load is), where reads of one element add up. The float64 reference
        uses these (`reference.score_input_grads`), the backward kernels those of tensor inputs (`kernel_input_grads`). A read
        whose derivative sympy cannot give in a printable form (under floor, ceil or %) is left out and listed
        in `input_grads_not_derived`; it never makes the spec invalid."""
        return self._input_grads[0]

    @property
    def input_grads_not_derived(self) -> tuple:
        """((name, read, why), ...): the float input reads `input_grads` leaves out."""
        return self._input_grads[1]

    @functools.cached_property
    def _input_grads(self) -> tuple:
        if self.score is None:
            return (), ()
        floats = {name for name, dtype, _ in self.tensors if dtype == "float32"}
        reads = [sp.Symbol(name, real=True) for name in self.scalars]
        reads = [read for read in reads if read in self.score.free_symbols]
        reads += sorted((load for load in self.score.atoms(sp.Indexed) if load.base.label.name in floats), key=str)
        fresh = {read: sp.Dummy(f"read{n}", real=True) for n, read in enumerate(reads)}
        standing_in = self.score.xreplace(fresh)
        printer = _CPrinter("score_mod", self._c_names())
        derived, left_out = [], []
        for read in reads:
            derivative = sp.diff(standing_in, fresh[read])
            if derivative == 0:
                continue
            derivative = derivative.xreplace({dummy: read for read, dummy in fresh.items()})
            name = read.name if isinstance(read, sp.Symbol) else read.base.label.name
            try:
                _check_renderable(derivative, f"d score_mod / d {read}")
                printer.f(derivative)
            except ExpressionError as err:
                left_out.append((name, read, str(err)))
                continue
            derived.append((name, read, derivative))
        return tuple(derived), tuple(left_out)

    # -- C++ ----------------------------------------------------------------------------------
    def _c_names(self) -> dict:
        names = {B: "(int)b", H: "(int)h", I: "i", J: "j", NQ: "seq_q", NK: "seq_k", SCORE: "score"}
        names.update({sp.Symbol(name, real=True): f"s_{name}" for name in self.scalars})
        names.update({load: f"p{n}" for n, load in enumerate(self._hoisted_loads)})
        names.update({symbol: f"c{n}" for n, symbol in enumerate(self._hoisted_sums.values())})
        return names

    @staticmethod
    def _fixed_part(add) -> Optional[sp.Expr]:
        """The terms of a sum over positions that depend on no position and no load, when there are two or
        more of them and they sum to an integer (Nk - Nq in i + Nk - Nq - j), else None. Only integers: a
        member of unknown type would let sympy decide c0 + i == j to be false, and a rational one (Nk / 2 -
        Nq / 2) would turn an exact floor division into float32."""
        fixed = [t for t in add.args if not t.is_Number and not t.has(I, J, SCORE) and not t.atoms(sp.Indexed)]
        if len(fixed) < 2 or not any(t.has(I, J) for t in add.args):
            return None
        part = sp.Add(*fixed)
        return part if part.is_integer else None

    @functools.cached_property
    def _hoisted_sums(self) -> dict:
        """mask_mod's sums of fixed terms (_fixed_part) -> a symbol c<n>: an int member (the kernels' positions
        and lengths are ints) the constructor computes once per block, so that a per-element test and a tile's bounds add one value, not each length
        (the compiler does not always regroup i + Nk - Nq; the kept lengths cost registers, and at the
        register edge a spill: the causal forward at d = 256 on mma.sync, 2026-11-25)."""
        sums: dict = {}
        for node in (sp.preorder_traversal(self.mask) if self.mask is not None else ()):
            part = self._fixed_part(node) if isinstance(node, sp.Add) else None
            if part is not None and part not in sums:
                sums[part] = sp.Symbol(f"c{len(sums)}", integer=True)
        return sums

    @functools.cached_property
    def _printed_mask(self):
        """The mask_mod as the kernel computes it: with each hoisted sum read from its member."""
        if self.mask is None or not self._hoisted_sums:
            return self.mask

        def hoisted(add):
            part = self._fixed_part(add)
            return add - part + self._hoisted_sums[part] if part in self._hoisted_sums else add
        return self.mask.replace(lambda node: isinstance(node, sp.Add), hoisted)

    @functools.cached_property
    def light_mask_mod(self) -> bool:
        """A mask_mod that the kernels test in a few integer registers: positions, lengths and int32 loads hoisted
        out of the per-score work (prefix[b]), combined by +, -, integer products, comparisons, and / or / not, and
        // or % by powers of two (what _CPrinter prints as shifts and masks). Not: a load per position (doc[b, j]:
        a value per key column held per thread), anything in float (scalars, float32 inputs, floorf, py_fmod),
        another division: with those, the d = 64 forward spilled 8-104 B at three blocks per SM. For a mask_mod
        alone the solver reserves a family's `light_mask_mod_registers` instead of `modifier_registers`."""
        return self.mask is not None and self._light(self.mask)

    @property
    def mask_mod_alone(self) -> bool:
        """A mask_mod and no score_mod (the solver reserves fewer registers for some: fagen/solver.py
        modifier_reservation)."""
        return self.mask is not None and self.score is None

    @property
    def mask_alone_without_head(self) -> bool:
        """A mask_mod, no score_mod, and h nowhere in it (not in an input's indices either: doc[b, i] == doc[b, j],
        j < prefix[b]): every query head of a sequence sees the same mask, so a grouped-KV backward block may walk a
        K/V head's whole group with one head's walk (Spec.kv_group_foldable)."""
        return self.mask_mod_alone and H not in self.mask.free_symbols

    @functools.cached_property
    def mask_reads_keys(self) -> bool:
        """Does the mask_mod read an input at a key position (doc[b, j], t[h, i - j])? Tested per score, a thread
        reads one value per key column it holds (32 on a 128-key tile), so the wgmma forwards test such a mask_mod
        ahead of the tile's scores: forward_wgmma where that gives it a third resident block (the solver's
        key_mask_mod_registers), forward_wgmma_ws always (MASK_READS_KEYS in the generated struct; the solver gives
        such specs forward_wgmma's 64 x 64 at d = 128 instead, so only a forced plan runs it there)."""
        return self.mask is not None and any(J in load.free_symbols for load in self.mask.atoms(sp.Indexed))

    def _light(self, expr) -> bool:
        """Is every node of `expr` one of light_mask_mod's integer operations?"""
        if isinstance(expr, (sp.Symbol, sp.Indexed)):
            return expr.is_integer is True and (isinstance(expr, sp.Symbol) or expr in self._hoisted_loads)
        if isinstance(expr, sp.Integer) or expr in (sp.true, sp.false):
            return True
        if isinstance(expr, sp.Mod):
            value, divisor = expr.args
            return _power_of_two(divisor) and self._light(value)
        if isinstance(expr, (sp.floor, sp.ceiling)):
            numerator, denominator = sp.fraction(sp.together(expr.args[0]))
            return _power_of_two(denominator) and self._light(numerator)
        if isinstance(expr, (sp.Add, sp.Mul, sp.Rel, sp.And, sp.Or, sp.Not)):
            return all(self._light(arg) for arg in expr.args)
        return False   # rationals, floats, functions, piecewise: more temporaries than the reservation covers

    @functools.cached_property
    def _hoisted_loads(self) -> tuple:
        """Tensor loads whose indices depend on neither position nor score (ALiBi's slope[h], prefix[b]):
        read once per block in the constructor instead of per element (the compiler cannot hoist a
        global load out of the kernel's loops by itself: it cannot prove that no store aliases it)."""
        loads = set()
        for expr in (self.mask, self.score, self.score_grad):
            if expr is not None:
                loads |= {load for load in expr.atoms(sp.Indexed)
                          if not load.has(I, J, SCORE) and not any(index.atoms(sp.Indexed) for index in load.indices)}
        return tuple(sorted(loads, key=str))

    @functools.cached_property
    def _tile_program(self):
        program = _Program()
        ranged = {I: (program.emit("long long", "param", "i_lo"), program.emit("long long", "param", "i_hi")),
                  J: (program.emit("long long", "param", "j_lo"), program.emit("long long", "param", "j_hi"))}
        bounder = _Bounder(program, ranged, self.tensors)
        full, maybe = (True, True) if self.mask is None else bounder.decide(self._printed_mask)
        result = program.emit("int", "select", full, 2, program.emit("int", "select", maybe, 1, 0))
        return program, result, dict(bounder.summaries), full, maybe

    @property
    def summaries(self) -> tuple:
        """(tensor index, dimension) of each input whose run-time values decide tiles (e.g. document ids
        doc[b, i]): a summary kernel writes its min and max per SUMMARY_GRAIN positions along that
        dimension into args.mod_summary[index] before the attention kernels run."""
        used = self._tile_program[2]
        return tuple((k, used[name]) for k, (name, _, _) in enumerate(self.tensors) if name in used)

    def summary_calls(self) -> str:
        """The C++ statements that write `summaries` (one summarise_input each), or "" when there is none: the
        forward's summary kernel is made of them, and the backward's _delta kernel runs them before its rows."""
        calls = []
        for k, dim in self.summaries:
            ctype = "int" if self.tensors[k][1] == "int32" else "float"
            calls.append(f"  fagen::summarise_input<{ctype}>(args, {k}, {dim});")
        return "\n".join(calls)

    def summary_kernel(self, symbol: str) -> str:
        """The summary kernel for `summaries`, or "" when there is none."""
        if not self.summaries:
            return ""
        return "\n".join([f'extern "C" __global__ void __launch_bounds__(256) {symbol}(const fagen::AttentionArgs args) {{',
                          self.summary_calls(), "}", ""])

    def raw_score(self, scale: float) -> Optional[sp.Expr]:
        """score_mod(tau s) / tau: the score_mod on the kernels' raw product s = q.k and in its units, which is
        what their exponent takes. With tau folded in by sympy, a score costs no multiply by tau and back:
        score + g(i, j) becomes s + g / tau (ALiBi: one multiply-add), cap tanh(score / cap) becomes
        (cap / tau) tanh((tau / cap) s)."""
        if self.score is None:
            return None
        tau = sp.Float(scale)
        rest = self.score - SCORE
        if not rest.has(SCORE):
            return SCORE + rest / tau
        return self.score.subs(SCORE, tau * SCORE) / tau

    def cuda_struct(self, name: str = "SpecMods", scale: float = 1.0, integer_type: str = "long long",
                    mask_only: bool = False) -> str:
        """The C++ struct of these modifiers for a spec of softmax scale `scale` (tau, in raw_score).
        The tile tests compute their integer bounds in `integer_type` (_Program.c_code). `mask_only`: only what a
        mask kind's struct is asked for (visible, the tile tests), without the helpers or the score functions."""
        printer = _CPrinter("mask_mod", self._c_names())
        has_grad_one = self.score_grad is None or self.score_grad == 1
        lines = [f"struct {name} {{",
                 f"  static constexpr bool HAS_MASK = {'true' if self.mask is not None else 'false'}, "
                 f"HAS_SCORE = {'true' if self.score is not None else 'false'}, "
                 f"SCORE_GRAD_IS_ONE = {'true' if has_grad_one else 'false'}, "
                 f"MASK_READS_KEYS = {'true' if self.mask_reads_keys else 'false'};",
                 "  long long b, h;", "  int seq_q, seq_k;"]
        for tname, dtype, ndim in self.tensors:
            ctype = "int" if dtype == "int32" else "float"
            lines.append(f"  const {ctype}* t_{tname}; int t_{tname}_size[{ndim}]; long long t_{tname}_stride[{ndim}];")
        for sname in self.scalars:
            lines.append(f"  float s_{sname};")
        for tname, _, _ in self.tensors:
            if tname in self._tile_program[2]:
                lines.append(f"  const void* summary_{tname};")
        for n, load in enumerate(self._hoisted_loads):
            lines.append(f"  {'int' if load.is_integer else 'float'} p{n};   // {load}, read once")
        for n, part in enumerate(self._hoisted_sums):
            lines.append(f"  int c{n};   // {part}, once")
        grad_members, grad_constructor = self._input_grad_members()
        lines += grad_members
        lines += ["",
                  f"  __device__ {name}(const fagen::AttentionArgs& args, long long b_, long long h_, int seq_q_, int seq_k_)",
                  "      : b(b_), h(h_), seq_q(seq_q_), seq_k(seq_k_) {"]
        for k, (tname, dtype, ndim) in enumerate(self.tensors):
            ctype = "int" if dtype == "int32" else "float"
            lines.append(f"    t_{tname} = static_cast<const {ctype}*>(args.mod_tensor[{k}]);")
            for d in range(ndim):
                lines.append(f"    t_{tname}_size[{d}] = (int)args.mod_size[{k}][{d}]; "
                             f"t_{tname}_stride[{d}] = args.mod_stride[{k}][{d}];")
        for k, sname in enumerate(self.scalars):
            lines.append(f"    s_{sname} = (float)args.mod_scalar[{k}];")
        for k, (tname, _, _) in enumerate(self.tensors):
            if tname in self._tile_program[2]:
                lines.append(f"    summary_{tname} = args.mod_summary[{k}];")
        if self._hoisted_loads:
            plain = {k: v for k, v in self._c_names().items() if not isinstance(k, sp.Indexed)}
            loader = _CPrinter("inputs", plain)
            for n, load in enumerate(self._hoisted_loads):
                lines.append(f"    p{n} = {loader.emit(load)};")
        if self._hoisted_sums:
            plain = {k: v for k, v in self._c_names().items() if not isinstance(k, sp.Indexed)}
            summer = _CPrinter("mask_mod", plain)
            for n, part in enumerate(self._hoisted_sums):
                lines.append(f"    c{n} = {summer.i(part)};")
        lines += grad_constructor
        if not self.tensors and not self.scalars:
            lines.append("    (void)args;")
        lines += ["  }"] if mask_only else ["  }", "", _C_HELPERS.rstrip("\n")]
        for tname, dtype, ndim in self.tensors:
            ctype = "int" if dtype == "int32" else "float"
            params = ", ".join(f"int x{d}" for d in range(ndim))
            clamp = " ".join(f"x{d} = min(max(x{d}, 0), t_{tname}_size[{d}] - 1);" for d in range(ndim))
            offset = " + ".join(f"(long long)x{d} * t_{tname}_stride[{d}]" for d in range(ndim))
            lines += [f"  // {tname}[...] with every index clamped into the tensor: never an out-of-bounds read",
                      f"  __device__ __forceinline__ {ctype} load_{tname}({params}) const {{",
                      f"    {clamp}",
                      f"    return t_{tname}[{offset}];", "  }"]
        visible = "true" if self.mask is None else printer.boolean(self._printed_mask)
        lines += ["", "  // the mask" if mask_only else "  // the mask_mod", "  __device__ __forceinline__ bool visible(int i, int j) const {",
                  f"    return {visible};", "  }"]
        program, result, used, full, maybe = self._tile_program
        for k, (tname, dtype, ndim) in enumerate(self.tensors):
            if tname not in used:
                continue
            ctype, dim = ("int" if dtype == "int32" else "float"), used[tname]
            lines += [f"  // {tname}'s min and max per fagen::SUMMARY_GRAIN positions along dimension {dim} (run-time",
                      "  // summary): the bounds of a load over a tile's positions, for the tile tests",
                      "  // (indices clamped into the tensor in long long, then counted in int: the warp-specialized backward's",
                      "  // producer walks with these at 40 registers, and spilled 72 B with the whole walk in long long)",
                      f"  __device__ __forceinline__ {ctype} summary_bound_{tname}(long long other_index, long long first_index, "
                      "long long last_index, int which) const {",
                      f"    const {ctype}* summary = static_cast<const {ctype}*>(summary_{tname});",
                      f"    const int size = t_{tname}_size[{dim}], blocks = (size + fagen::SUMMARY_GRAIN - 1) / fagen::SUMMARY_GRAIN;",
                      f"    const int other = (int)min(max(other_index, 0LL), "
                      f"(long long){f't_{tname}_size[{1 - dim}]' if ndim == 2 else '1'} - 1);",
                      "    const int first = (int)min(max(first_index, 0LL), (long long)size - 1) / fagen::SUMMARY_GRAIN;",
                      "    const int last = (int)min(max(last_index, 0LL), (long long)size - 1) / fagen::SUMMARY_GRAIN;",
                      f"    const {ctype}* entries = summary + 2 * ((long long)other * blocks);",
                      f"    {ctype} bound = entries[2 * first + which];",
                      "    for (int block = first + 1; block <= last; ++block) {",
                      f"      const {ctype} value = entries[2 * block + which];",
                      "      bound = which ? max(bound, value) : min(bound, value);",
                      "    }",
                      "    return bound;",
                      "  }",
                      f"  __device__ __forceinline__ {ctype} summary_lo_{tname}(long long o, long long f, long long l) const "
                      f"{{ return summary_bound_{tname}(o, f, l, 0); }}",
                      f"  __device__ __forceinline__ {ctype} summary_hi_{tname}(long long o, long long f, long long l) const "
                      f"{{ return summary_bound_{tname}(o, f, l, 1); }}"]
        lines += ["  // rows [i_lo, i_hi] x keys [j_lo, j_hi] by interval arithmetic: 0 (fagen::TILE_EMPTY) when",
                  "  // no pair is visible, 2 (fagen::TILE_FULL) when all are, 1 (fagen::TILE_PARTIAL) undecided;",
                  "  // tile_maybe_visible (not TILE_EMPTY) and tile_all_visible (TILE_FULL) are its halves apart, each",
                  "  // computing only what it needs"]
        for function, ctype, value in (("tile_class", "int", result), ("tile_maybe_visible", "bool", maybe),
                                       ("tile_all_visible", "bool", full)):
            lines.append(f"  __device__ __forceinline__ {ctype} {function}(int i_lo, int i_hi, int j_lo, int j_hi) const {{")
            if not isinstance(value, str):
                constant = ({0: "fagen::TILE_EMPTY", 1: "fagen::TILE_PARTIAL", 2: "fagen::TILE_FULL"}[int(value)]
                            if ctype == "int" else "true" if value else "false")
                lines += ["    (void)i_lo; (void)i_hi; (void)j_lo; (void)j_hi;", f"    return {constant};"]
            else:
                lines += program.c_code(value, printer, integer_type=integer_type, result_type=ctype)
            lines.append("  }")
        if mask_only:
            return "\n".join([*lines, "};"]) + "\n"
        # the score functions take the positions as ints and as floats (fi, fj: what a float expression of them
        # reads; the kernels make them by adding constants, not by a conversion per score)
        score_printer = _CPrinter("score_mod", self._c_names(), {I: "fi", J: "fj"})
        score = "score" if self.score is None else score_printer.f(self.score)
        try:
            raw = "score" if self.score is None else score_printer.f(self.raw_score(scale))
        except ExpressionError as err:
            raise ExpressionError(f"score_mod: at softmax scale {scale:g} the kernels apply it as score_mod(scale * s) / "
                                  f"scale, and {str(err).split(': ', 1)[-1]}") from None
        grad = "1.f" if self.score_grad is None else score_printer.f(self.score_grad)
        for comment, function, code in (
                ("the score_mod, in natural units (score = tau * q.k)", "score", score),
                (f"the same on the raw product (score = q.k) and in its units: score_mod(tau score) / tau, tau = {scale!r}",
                 "raw_score", raw),
                ("d score_mod / d score (sympy's derivative): the factor the backward multiplies dS by", "score_grad", grad)):
            lines += [f"  // {comment}",
                      f"  __device__ __forceinline__ float {function}(float score, int i, int j, float fi, float fj) const {{",
                      "    (void)i; (void)j; (void)fi; (void)fj;",
                      f"    return {code};", "  }"]
        lines += self._input_grad_lines()
        lines.append("};")
        return "\n".join(lines) + "\n"

    @property
    def kernel_input_grads(self) -> tuple:
        """The `input_grads` the backward kernels accumulate: reads of float tensor inputs, ((name, read,
        derivative), ...). A scalar input is data (the torch ops take scalars as Python floats)."""
        return tuple(entry for entry in self.input_grads if entry[0] not in self.scalars)

    def _input_grad_members(self) -> tuple[list, list]:
        """(member declarations, constructor lines) for `kernel_input_grads`: a gradient pointer per tensor
        input read (args.mod_grad[its slot])."""
        reads = self.kernel_input_grads
        if not reads:
            return [], []
        slot = {name: k for k, (name, _, _) in enumerate(self.tensors)}
        names = list(dict.fromkeys(name for name, _, _ in reads))
        members = [f"  float* grad_{name};   // dL / d {name}: contiguous, {name}'s shape" for name in names]
        constructor = [f"    grad_{name} = args.mod_grad[{slot[name]}];" for name in names]
        return members, constructor

    def _input_grad_lines(self) -> list:
        """C++ for `kernel_input_grads`: add_input_grads(ds, score, i, j, sums) adds dS' * d score_mod / d read
        for one element (dS' = the gradient of score_mod's output; score in natural units); a read whose
        element moves with the position (bias[h, i - j]) gets an atomic add per element, the others (slope[h]:
        one element per block's (b, h)) a thread-local sum that flush_input_grads adds once per warp at the
        end of the block. Indices are clamped into the tensor, as its loads are."""
        reads = self.kernel_input_grads
        if not reads:
            return ["  // no float tensor input with a derivative: no input gradients",
                    "  static constexpr int INPUT_GRADS = 0, INPUT_GRAD_SUMS = 1;",
                    "  static constexpr bool INPUT_GRADS_READ_SCORE = false;",
                    "  __device__ __forceinline__ void add_input_grads(float, float, int, int, float*) const {}",
                    "  __device__ __forceinline__ void flush_input_grads(const float*) const {}"]
        printer = _CPrinter("score_mod", self._c_names())
        sizes = {name: ndim for name, _, ndim in self.tensors}
        add, flush, summed = [], [], 0
        for name, read, derivative in reads:
            clamped = [f"min(max((int)({printer.i(index)}), 0), t_{name}_size[{d}] - 1)" for d, index in enumerate(read.indices)]
            offset = clamped[0] if sizes[name] == 1 else f"(long long){clamped[0]} * t_{name}_size[1] + {clamped[1]}"
            add.append(f"    // d score_mod / d {read} = {derivative}")
            if read.has(I, J):
                add.append(f"    atomicAdd(grad_{name} + {offset}, ds * ({printer.f(derivative)}));")
            else:
                add.append(f"    sums[{summed}] += ds * ({printer.f(derivative)});")
                flush += ["    {",
                          f"      float total = sums[{summed}];",
                          "      for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) total += __shfl_xor_sync(0xffffffffu, total, lane_mask);",
                          f"      if ((threadIdx.x & 31) == 0 && total != 0.f) atomicAdd(grad_{name} + {offset}, total);",
                          "    }"]
                summed += 1
        reads_score = any(derivative.has(SCORE) for _, _, derivative in reads)
        return ["  // gradients of score_mod's float tensor inputs (Modifiers.kernel_input_grads): what the backward built",
                "  // WITH_INPUT_GRADS adds into args.mod_grad; fagen.reference.score_input_grads is the same in float64",
                f"  static constexpr int INPUT_GRADS = {len(reads)}, INPUT_GRAD_SUMS = {max(summed, 1)};",
                f"  static constexpr bool INPUT_GRADS_READ_SCORE = {'true' if reads_score else 'false'};",
                "  __device__ __forceinline__ void add_input_grads(float ds, float score, int i, int j, float* sums) const {",
                "    (void)score; (void)i; (void)j; (void)sums;", *add, "  }",
                "  // once per block, by every lane of each warp: the summed reads' warp totals, one atomic add each",
                "  __device__ __forceinline__ void flush_input_grads(const float* sums) const {",
                "    (void)sums;", *flush, "  }"]

    # -- tile classification in Python (the same program the kernel runs) -------------------------
    def tile_class_python(self, i_lo: int, i_hi: int, j_lo: int, j_hi: int, *, b: int = 0, h: int = 0,
                          seq_q: int = 1, seq_k: int = 1, values: Optional[dict] = None) -> int:
        """tile_class evaluated in Python on concrete bounds (for tests): 0 empty, 1 partial, 2 full."""
        return int(self._run_tile_program("class", i_lo, i_hi, j_lo, j_hi, b, h, seq_q, seq_k, values))

    def tile_halves_python(self, i_lo: int, i_hi: int, j_lo: int, j_hi: int, *, b: int = 0, h: int = 0,
                           seq_q: int = 1, seq_k: int = 1, values: Optional[dict] = None) -> tuple[bool, bool]:
        """(tile_maybe_visible, tile_all_visible) evaluated in Python, as tile_class_python."""
        return tuple(bool(self._run_tile_program(half, i_lo, i_hi, j_lo, j_hi, b, h, seq_q, seq_k, values))
                     for half in ("maybe", "full"))

    def _run_tile_program(self, which, i_lo, i_hi, j_lo, j_hi, b, h, seq_q, seq_k, values):
        program, result, used, full, maybe = self._tile_program
        result = {"class": result, "maybe": maybe, "full": full}[which]
        env_symbols = {B: np.int64(b), H: np.int64(h), NQ: np.int64(seq_q), NK: np.int64(seq_k)}
        env_symbols.update({symbol: _np_eval(part, env_symbols, values or {}) for part, symbol in self._hoisted_sums.items()})
        point = lambda expr: _np_eval(expr, env_symbols, values or {})   # noqa: E731

        def summary(name, which, other, first, last):   # what summarise_input + summary_bound_* compute
            array = np.asarray((values or {})[name])
            array = array.reshape(1, -1) if array.ndim == 1 else np.moveaxis(array, used[name], 1)
            size = array.shape[1]
            other = min(max(other, 0), array.shape[0] - 1)
            first = min(max(first, 0), size - 1) // SUMMARY_GRAIN * SUMMARY_GRAIN
            last = min(max(last, 0), size - 1) // SUMMARY_GRAIN * SUMMARY_GRAIN + SUMMARY_GRAIN
            span = array[other, first:last]
            if np.isnan(span).any():   # summarise_input widens an entry holding a NaN to (-inf, inf)
                return np.inf if which == "hi" else -np.inf
            return span.max() if which == "hi" else span.min()

        return program.run(result, {"i_lo": i_lo, "i_hi": i_hi, "j_lo": j_lo, "j_hi": j_hi}, point, summary)

    @functools.cached_property
    def sees_a_band(self) -> bool:
        """Whether the mask_mod lets a row see keys in at most 8 tiles of 128 keys wherever the row is, tested
        on the last rows of a 65536-long sequence: a band of keys around the row plus fixed ones (a window with
        sinks), not a prefix or a triangle. False where the decision reads run-time input values (document ids,
        prefix lengths), which are unknown here. Computed once (the tile program runs up to 512 times)."""
        if self.mask is None:
            return False
        length, tile, limit = 1 << 16, 128, 8
        rows = (length - tile, length - 1)
        seen = 0
        try:
            for first in range(0, length, tile):
                if self._run_tile_program("maybe", *rows, first, first + tile - 1, 0, 0, length, length, None):
                    seen += 1
                    if seen > limit:
                        return False
        except (ExpressionError, KeyError):
            return False
        return True

    # -- shapes -------------------------------------------------------------------------------
    def input_shapes(self, batch: int, heads: int, seq_q: int, seq_k: int) -> dict:
        """The smallest shape of each tensor input covering every index the expressions can form for
        b < batch, h < heads, i < seq_q, j < seq_k (larger tensors are fine: indices are clamped)."""
        loads = set()
        for expr in (self.mask, self.score, self.score_grad):
            if expr is not None:
                loads |= expr.atoms(sp.Indexed)
        shapes = {}
        for tname, _, ndim in self.tensors:
            sizes = [1] * ndim
            for load in loads:
                if load.base.label.name != tname:
                    continue
                for d, index in enumerate(load.indices):
                    program = _Program()
                    ranged = {B: (0, batch - 1), H: (0, heads - 1), I: (0, seq_q - 1), J: (0, seq_k - 1)}
                    iv = _Bounder(program, ranged).bound(index)
                    if iv.hi is None:
                        raise ExpressionError(f"inputs: cannot bound the index {index} of '{tname}' "
                                              f"(it depends on run-time values)")
                    point = lambda expr: _np_eval(expr, {NQ: np.int64(seq_q), NK: np.int64(seq_k)}, {})  # noqa: E731
                    try:
                        hi = program.run(iv.hi, {}, point)
                    except ExpressionError:   # an index built from an input's values
                        raise ExpressionError(f"inputs: cannot bound the index {index} of '{tname}' "
                                              f"(it depends on run-time values)") from None
                    sizes[d] = max(sizes[d], int(hi) + 1)
            shapes[tname] = tuple(sizes)
        return shapes

    # -- numpy --------------------------------------------------------------------------------
    @staticmethod
    def _env(b, h, i, j, seq_q, seq_k, score=None):
        env = {B: np.asarray(b), H: np.asarray(h), I: np.asarray(i), J: np.asarray(j),
               NQ: np.int64(seq_q), NK: np.int64(seq_k)}
        if score is not None:
            env[SCORE] = np.asarray(score, dtype=np.float64)
        return env

    def mask_numpy(self, b, h, i, j, seq_q, seq_k, values: Optional[dict] = None) -> np.ndarray:
        shape = np.broadcast_shapes(*(np.shape(x) for x in (b, h, i, j)))
        if self.mask is None:
            return np.ones(shape, dtype=bool)
        with np.errstate(all="ignore"):
            result = _np_eval(self.mask, self._env(b, h, i, j, seq_q, seq_k), values or {})
        return np.broadcast_to(np.asarray(result, dtype=bool), shape).copy()

    def _float(self, expr, score, b, h, i, j, seq_q, seq_k, values, default):
        shape = np.broadcast_shapes(*(np.shape(x) for x in (score, b, h, i, j)))
        if expr is None:
            return np.broadcast_to(np.asarray(default(np.asarray(score, dtype=np.float64))), shape).copy()
        with np.errstate(all="ignore"):
            result = _np_eval(expr, self._env(b, h, i, j, seq_q, seq_k, score), values or {})
        return np.broadcast_to(np.asarray(result, dtype=np.float64), shape).copy()

    def score_numpy(self, score, b, h, i, j, seq_q, seq_k, values: Optional[dict] = None) -> np.ndarray:
        return self._float(self.score, score, b, h, i, j, seq_q, seq_k, values, lambda s: s)

    def score_grad_numpy(self, score, b, h, i, j, seq_q, seq_k, values: Optional[dict] = None) -> np.ndarray:
        return self._float(self.score_grad, score, b, h, i, j, seq_q, seq_k, values, np.ones_like)

    def float_numpy(self, expr, score, b, h, i, j, seq_q, seq_k, values: Optional[dict] = None) -> np.ndarray:
        """Any expression of score and the indices (e.g. an `input_grads` derivative), broadcast to the grids."""
        return self._float(expr, score, b, h, i, j, seq_q, seq_k, values, np.ones_like)

    def index_numpy(self, expr, b, h, i, j, seq_q, seq_k, values: Optional[dict] = None) -> np.ndarray:
        """An integer index expression (a tensor read's subscript) on the index grids."""
        with np.errstate(all="ignore"):
            return np.asarray(_np_eval(expr, self._env(b, h, i, j, seq_q, seq_k), values or {}), dtype=np.int64)


# ---- building one ---------------------------------------------------------------------------
SIMPLIFY_MAX_OPS = 30       # tanh nested 5 deep (29 operations): 0.6 s in simplify
SIMPLIFY_MAX_PIECES = 3     # 3 Piecewise terms: 0.03 s; 6: 76 s


def _derivative(score: sp.Expr) -> sp.Expr:
    """d score_mod / d score, simplified where that stays printable (simplify may pick forms we cannot)."""
    raw = sp.diff(score, SCORE)
    bad = raw.atoms(sp.Derivative, sp.DiracDelta, sp.Subs, sp.Integral)
    if bad:
        raise ExpressionError(f"score_mod: its derivative in score contains {sorted(map(str, bad))[0]}, "
                              f"which cannot be rendered (floor, ceil and % of score have no usable derivative)")
    candidates = [raw]
    # simplify's time grows exponentially with the pieces it must reconcile (6 conditional terms: 76 s): it is
    # tried only on a derivative small enough to take well under a second, else the raw one is used
    if sp.count_ops(raw) <= SIMPLIFY_MAX_OPS and len(raw.atoms(sp.Piecewise)) <= SIMPLIFY_MAX_PIECES:
        try:
            candidates.insert(0, sp.simplify(raw))
        except Exception:   # simplify is a heuristic; the raw derivative is always an answer
            pass
    error = None
    for candidate in candidates:
        try:
            _check_renderable(candidate, "score_mod")
            _probe_print(candidate)
            return candidate
        except ExpressionError as err:
            error = err
    raise ExpressionError(f"score_mod: its derivative in score cannot be rendered ({str(error).split(': ', 1)[-1]})")


def _probe_print(expr) -> None:
    names = {s: s.name for s in expr.free_symbols}
    _CPrinter("score_mod", names).emit(expr)


def modifiers(mask_mod: Optional[str], score_mod: Optional[str], inputs: Optional[dict]) -> Modifiers:
    """Parses and checks a spec's mask_mod, score_mod and inputs. Raises ExpressionError."""
    try:
        return _modifiers(mask_mod, score_mod, inputs)
    except RecursionError:   # sympy recurses deeper than the text nests: sigmoid is four levels of exp, +, /
        raise ExpressionError("mask_mod / score_mod: the expression is nested too deeply for sympy to derive and "
                              "print it; write it with fewer nested calls") from None


def _modifiers(mask_mod: Optional[str], score_mod: Optional[str], inputs: Optional[dict]) -> Modifiers:
    inputs = dict(inputs or {})
    _check_input_names(inputs)
    tensor_names = [name for name, kind in inputs.items() if kind != "scalar"]
    scalar_names = [name for name, kind in inputs.items() if kind == "scalar"]
    if len(tensor_names) > MAX_TENSORS:
        raise ExpressionError(f"inputs: {len(tensor_names)} tensor inputs ({', '.join(tensor_names)}); at most {MAX_TENSORS}")
    if len(scalar_names) > MAX_SCALARS:
        raise ExpressionError(f"inputs: {len(scalar_names)} scalar inputs ({', '.join(scalar_names)}); at most {MAX_SCALARS}")

    used: set = set()
    ndims: dict = {}
    mask = score = grad = None
    for text, field_name, boolean in ((mask_mod, "mask_mod", True), (score_mod, "score_mod", False)):
        if text is None:
            continue
        expr, parser = _parse(text, field_name, inputs, boolean)
        used.update(parser.used)
        for name, ndim in parser.ndims.items():
            if ndims.setdefault(name, ndim) != ndim:
                raise ExpressionError(f"{field_name}: tensor '{name}' is subscripted with {ndim} indices here "
                                      f"but {ndims[name]} in mask_mod")
        if boolean:
            mask = expr
        else:
            score = expr
    unused = [name for name in inputs if name not in used]
    if unused:
        raise ExpressionError(f"inputs: '{unused[0]}' is declared but neither mask_mod nor score_mod uses it")
    if score is not None:
        grad = _derivative(score)

    result = Modifiers(
        mask=mask, score=score, score_grad=grad,
        tensors=tuple((name, inputs[name], ndims[name]) for name in tensor_names),
        scalars=tuple(scalar_names),
        mask_text=None if mask_mod is None else " ".join(mask_mod.split()),
        score_text=None if score_mod is None else " ".join(score_mod.split()))
    result.cuda_struct()   # every expression must print: fail here, not at render time
    return result


# ---- the mask kinds that are expressions ------------------------------------------------------
#: The spec's mask kinds that are arithmetic in the positions, written as a mask_mod would write them
#: (queries and keys aligned bottom-right: key i + Nk - Nq is query i's own). Every template gets them
#: as its Visibility's Kind, a struct printed by `Modifiers.cuda_struct` like a mask_mod's, so a kind's
#: per-element test and its tile classes (empty / full / partial, by the interval arithmetic above) are
#: derived from the expression, and the float64 reference evaluates the same one. The other kinds are
#: data, not formulas: padding is each batch entry's key count (the sequence end every test already
#: has) and block_sparse a per-block layout, walked block by block (templates/attention_common.cuh).
MASK_KIND_TEXT = {
    "causal": "j <= i + Nk - Nq",
    "sliding_window": "0 <= i + Nk - Nq - j < {window}",
}


@functools.lru_cache(maxsize=None)
def mask_kind(kind: str, window: int = 0) -> Optional[Modifiers]:
    """The mask kind `kind` (with its window) as Modifiers carrying only a mask, or None for the kinds
    that are not expressions (none, padding, block_sparse)."""
    text = MASK_KIND_TEXT.get(kind)
    if text is None:
        return None
    return modifiers(text.format(window=int(window)), None, None)


def mask_kind_struct(kind: str, window: int = 0, name: str = "KindMask") -> str:
    """mask_kind's C++ struct, its tile classes computed in int: a kind's bounds are sums of four
    positions and lengths, each an int in the kernels (the hand-written tests it replaced were int too)."""
    return mask_kind(kind, window).cuda_struct(name, integer_type="int", mask_only=True)
