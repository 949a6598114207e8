"""Interval arithmetic as a small straight-line program (the tile tests), printable as C++ and runnable in Python."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import sympy as sp

from fagen.expressions.names import ExpressionError
from fagen.expressions.cuda import _CPrinter, _float_literal


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


