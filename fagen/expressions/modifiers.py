"""The result (Modifiers: what render, the reference and the runtime read), building one, and the mask kinds that are expressions."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import sympy as sp

from fagen.expressions.names import B, ExpressionError, H, I, J, MAX_SCALARS, MAX_TENSORS, NK, NQ, SCORE, SUMMARY_GRAIN
from fagen.expressions.parse import _check_input_names, _parse
from fagen.expressions.cuda import _CPrinter, _check_renderable, _power_of_two
from fagen.expressions.evaluate import _np_eval
from fagen.expressions.bounds import _Bounder, _Program


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
