"""Autotuning: time the solver's top candidates on this GPU and cache the winner per (GPU, spec).

The solver ranks feasible tile plans by a traffic model; the GPU has the last word. `autotune(spec)`
times the `top` ranked candidates of each pass (the other pass keeps the solver's choice), with the
same CUDA-event helper as `fagen bench` (`fagen.bench.timing.time_cuda`), rejects a candidate whose
output differs from the solver's choice, and stores the fastest through fagen/tuning.py, which holds
the file's format and the lookup the runtime does.
"""
from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from fagen import __version__
from fagen import solver as solver_stage
from fagen.spec import Spec
from fagen.tuning import PLAN_FIELDS, apply, lookup, spec_key, store

#: A candidate whose output differs from the solver's choice by more than this (relative Frobenius) is rejected.
AGREEMENT_TOLERANCE = 2e-2

#: measure(pass_name, solution) -> median ms of that pass with that solution's plan; raises if it cannot run.
Measure = Callable[[str, "solver_stage.Solution"], float]


# ---- choosing ----------------------------------------------------------------------------------
def _plan_record(plan: "solver_stage.Plan") -> dict:
    return {name: getattr(plan, name) for name in PLAN_FIELDS}


def select(solution: "solver_stage.Solution", measure: Measure, top: int = 4,
           passes: Optional[Sequence[str]] = None) -> dict:
    """Time the top candidates of each pass with `measure` and return {pass: winner record}.

    Pure given `measure` (tests give it fake timings). A candidate that raises is recorded with its
    error and never wins; ties go to the solver's ranking. A pass where nothing ran is left out."""
    from fagen.bench.report import reason

    out = {}
    for pass_name in passes or tuple(solution.plans):
        if pass_name not in solution.plans:
            continue
        timings = []
        for rank, plan in enumerate(solution.candidates[pass_name][:max(1, top)], 1):
            record = {"rank": rank, **_plan_record(plan), "smem_bytes": plan.smem_bytes}
            try:
                record["ms"] = float(measure(pass_name, solver_stage.with_plan(solution, pass_name, plan)))
            except Exception as err:  # did not compile, failed to launch, or disagreed with the solver's choice
                record["ms"], record["error"] = None, reason(err, 300)
            timings.append(record)
        ran = [t for t in timings if t["ms"] is not None]
        if not ran:
            continue
        best = min(ran, key=lambda t: (t["ms"], t["rank"]))
        solver_ms = timings[0]["ms"]
        out[pass_name] = {**{name: best[name] for name in PLAN_FIELDS}, "ms": best["ms"], "solver_ms": solver_ms,
                          "speedup_over_solver": (solver_ms / best["ms"]) if solver_ms and best["ms"] else None,
                          "timings": timings}
    return out


class Session:
    """What autotune needs from the GPU: the device's spec, target, the solver's (untuned) solution,
    the GPU's name, and a measure(pass_name, solution) -> ms. Tests substitute a fake one."""

    def __init__(self, spec: Spec, target: Any, solution: "solver_stage.Solution", gpu_name: str, measure: Measure,
                 prepare: Optional[Callable[[list], None]] = None):
        self.spec, self.target, self.solution, self.gpu_name = spec, target, solution, gpu_name
        self.measure = measure
        self.prepare = prepare or (lambda solutions: None)


def open_session(spec: Spec, seqlen: int, batch: int, heads: int, warmup: int, repeats: int) -> Session:
    """The GPU session: compile on the device, fresh random inputs, and a measure built on timing.time_cuda.

    Every candidate is checked before it is timed: its output (o, or dq, dk, dv) must agree with the
    solver's choice's on the same inputs, dropout included (the Philox stream is keyed by position,
    not by tiles). Timing runs with fagen.runtime.CHECK_LAUNCHES off; the checked run before it has
    it on, so that a bad launch raises there."""
    import torch

    from fagen import jit
    from fagen.bench import timing

    base_kernel = jit.compile(spec)           # the device's spec (arch) and target, as compile sees them
    spec, target = base_kernel.spec, base_kernel.target
    solution = solver_stage.solve(spec, target)   # untuned, whatever the cache holds
    inputs = timing.make_inputs(spec, batch, heads, seqlen, seed=7)
    q, k, v, do, args = inputs.q, inputs.k, inputs.v, inputs.do, inputs.runtime_args
    reference: dict = {}
    kernels = {_plans_key(jit.solution(base_kernel)): base_kernel}

    def kernel_for(candidate):
        key = _plans_key(candidate)
        if key not in kernels:
            kernels[key] = jit.kernel_for(spec, target, candidate)
        return kernels[key]

    def expected(pass_name: str):
        """The solver's choice's outputs on these inputs (o, lse for the backward's input too), once."""
        solver_kernel = kernel_for(solution)
        if "forward" not in reference:
            reference["forward"] = solver_kernel.forward(q, k, v, **args)
        if pass_name == "backward" and "backward" not in reference:
            reference["backward"] = solver_kernel.backward(q, k, v, *reference["forward"], do, **args)
        return reference[pass_name]

    def measure(pass_name: str, candidate) -> float:
        kernel = kernel_for(candidate)
        o, lse = expected("forward")
        if pass_name == "forward":
            out = kernel.forward(q, k, v, **args)
            errors = [timing.relative_error(out[0], o)]
            run = lambda: kernel.forward(q, k, v, out=out, **args)  # noqa: E731
        else:
            grads = kernel.backward(q, k, v, o, lse, do, **args)
            errors = [timing.relative_error(g, r) for g, r in zip(grads, expected("backward"))]
            run = lambda: kernel.backward(q, k, v, o, lse, do, **args)  # noqa: E731
        torch.cuda.synchronize()
        if max(errors) > AGREEMENT_TOLERANCE:
            raise RuntimeError(f"output differs from the solver's choice: relative error {max(errors):.3g}")
        with timing.unchecked_launches():
            ms = timing.time_cuda(run, warmup, repeats, timing.MAX_SECONDS_PER_MEASUREMENT)
            torch.cuda.synchronize()
        return ms

    def prepare(candidates: list) -> None:
        """nvcc for every candidate at once, in threads (PyCUDA's disk cache); loading stays serial."""
        from concurrent.futures import ThreadPoolExecutor

        from fagen.compiler import cached_cubin
        from fagen.render import render
        from fagen.sources import TEMPLATE_DIR

        base_plans = jit.solution(base_kernel).plans
        sources = [render(spec, c) for c in candidates if c.plans != base_plans]
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda text: _quietly(cached_cubin, text, target.arch, TEMPLATE_DIR),
                          [text for r in sources for text in r.pass_texts.values()]))

    return Session(spec, target, solution, target.name, measure, prepare)


def _plans_key(solution) -> tuple:
    return tuple(sorted(solution.plans.items(), key=lambda item: item[0]))


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:  # the candidate's own measure() reports the compile error
        pass


def autotune(spec: Spec, top: int = 4, seqlen: int = 4096, batch: Optional[int] = None, heads: Optional[int] = None,
             *, passes: Optional[Sequence[str]] = None, warmup: int = 5, repeats: int = 20,
             path: Optional[Path] = None, console=None) -> dict:
    """Time the solver's `top` candidates per pass at (batch, heads, seqlen) on this GPU, cache and
    return the entry. batch defaults to 16384 // seqlen tokens' worth, heads to 2048 // head_dim."""
    from fagen.bench.timing import refuse_timed_elsewhere

    refuse_timed_elsewhere(spec, "autotune")
    batch = batch or max(1, 16384 // seqlen)
    heads = heads or max(1, 2048 // spec.head_dim)
    session = open_session(spec, seqlen, batch, heads, warmup, repeats)
    wanted = [p for p in (passes or session.spec.passes) if p in session.solution.plans]
    candidates = [solver_stage.with_plan(session.solution, p, plan)
                  for p in wanted for plan in session.solution.candidates[p][:max(1, top)]]
    session.prepare(candidates)
    chosen = select(session.solution, session.measure, top=top, passes=wanted)
    entry = {"variant": spec.variant_name, "gpu": session.gpu_name, "arch": getattr(session.target, "arch", None),
             "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "fagen": __version__,
             "shape": {"batch": batch, "heads": heads, "seqlen": seqlen}, "warmup": warmup, "repeats": repeats,
             "top": top, "passes": chosen}
    if chosen:
        previous = lookup(session.spec, session.gpu_name, path) or {}
        kept = {p: w for p, w in (previous.get("passes") or {}).items() if p not in chosen}  # passes not re-tuned
        store(session.spec, session.gpu_name, {**entry, "passes": {**kept, **chosen}}, path)
    if console is not None:
        for pass_name, winner in chosen.items():
            from rich.markup import escape

            console.print(escape(f"  autotune {spec.variant_name} {pass_name}: " + ", ".join(
                f"Br={t['block_r']} Bc={t['block_c']} w={t['warps']}: "
                + (f"{t['ms']:.3f} ms" if t["ms"] is not None else f"failed ({t['error']})")
                for t in winner["timings"])))
    return entry


def compile_tuned(spec: Spec):
    """`fagen.jit.compile(spec)` with this GPU's cached autotune winner swapped in, if there is one.

    Idempotent with a fagen.compile that already consults the cache (apply() of the entry to an
    already tuned solution changes nothing), so it is safe before and after that change."""
    from fagen import jit

    kernel = jit.compile(spec)
    solution = jit.solution(kernel)
    tuned = apply(solution, lookup(kernel.spec, kernel.target.name))
    if tuned.plans == solution.plans:
        return kernel
    key = (spec_key(kernel.spec), kernel.target, _plans_key(tuned))
    if key not in _tuned_kernels:
        _tuned_kernels[key] = jit.kernel_for(kernel.spec, kernel.target, tuned)
    return _tuned_kernels[key]


_tuned_kernels: dict = {}
