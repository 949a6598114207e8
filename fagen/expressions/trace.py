"""Python callables and sympy expressions (the API's other ways in), written back as text."""
from __future__ import annotations

from typing import Callable, Optional

import sympy as sp

from fagen.expressions.names import ExpressionError, POSITION_SYMBOLS, SCORE, _sigmoid


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


