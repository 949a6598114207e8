"""sympy -> numpy: the float64 reference's evaluator."""
from __future__ import annotations

import functools

import numpy as np
import sympy as sp

from fagen.expressions.names import ExpressionError


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


