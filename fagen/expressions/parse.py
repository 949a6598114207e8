"""Parsing: a mask_mod / score_mod text through Python's ast (never eval) to sympy, with its bounds."""
from __future__ import annotations

import ast
import functools
import keyword
import math
import re
from typing import Optional

import sympy as sp

from fagen.spec import FLT_MAX, INT32_MAX
from fagen.expressions.names import ExpressionError, FLT_TRUE_MIN, FUNCTIONS, INPUT_KINDS, MAX_EXPONENT, MAX_EXPRESSION_CHARS, MAX_EXPRESSION_DEPTH, MAX_EXPRESSION_NODES, POSITION_SYMBOLS, RESERVED, SCORE, _LOG10_FLT_MAX, _LOG10_FLT_TRUE_MIN, _is_boolean


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


