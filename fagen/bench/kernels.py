"""`fagen bench`: time generated kernels against PyTorch SDPA (flash and cuDNN backends) on one GPU.

Before a configuration is timed, fagen's output is compared with SDPA's on the same inputs: a
benchmark of a wrong kernel is worthless. How a call is timed: fagen/bench/timing.py; the peers:
fagen/bench/peers.py; the records and writers: fagen/bench/report.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

from rich.markup import escape

from fagen.bench.peers import SDPA_MASKS, reference_output, sdpa_backward, time_sdpa_backward, time_sdpa_forward
from fagen.bench.report import IMPLS, BenchReport, Row, make_console, plot_report, print_table, reason, \
    write_csv, write_json, environment
from fagen.bench.timing import MAX_SECONDS_PER_MEASUREMENT, MIN_REPEATS, make_inputs, relative_error, shape_for, \
    spec_flops, time_cuda, unchecked_launches
from fagen.spec import Spec

#: ||fagen - SDPA||_F / ||SDPA||_F above which a row is marked FAIL (forward output; gradients below).
FORWARD_TOLERANCE = 2e-2
BACKWARD_TOLERANCE = 5e-2


def _plan_text(kernel: Any) -> str:
    return ", ".join(f"{p[:3]} Br={x['block_r']} Bc={x['block_c']} w={x['warps']}" for p, x in kernel.record["plans"].items())


def _bench_config(kernel: Any, spec: Spec, seq_len: int, batch: int, heads: int, passes: Sequence[str],
                  warmup: int, repeats: int, kv_group: int = 1) -> list[Row]:
    """Every row for one (spec, N): correctness first (checked launches), then the timings."""
    import torch

    inputs = make_inputs(spec, batch, heads, seq_len, seed=seq_len, kv_heads=heads // kv_group)
    args = inputs.runtime_args
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
    rows = {p: Row(spec.variant_name, spec.dtype, spec.head_dim, spec.mask, spec.dropout, seq_len, batch, heads, p,
                   spec_flops(spec, batch, heads, seq_len, p), ms={i: None for i in IMPLS}, plan=_plan_text(kernel),
                   kv_heads=heads // kv_group)
            for p in passes}
    # SDPA knows the mask kinds, not a spec's mask_mod / score_mod (fagen.bench.modifiers: against Flex)
    sdpa_ok = spec.mask in SDPA_MASKS and not spec.modifiers.active

    # ---- correctness: fagen vs SDPA on these very inputs (checked launches) ----
    o = lse = None
    try:
        o, lse = kernel.forward(q, k, v, **args)
        torch.cuda.synchronize()
    except Exception as err:
        for row in rows.values():
            row.notes["fagen"], row.check = f"forward failed: {reason(err)}", "FAIL"
    if o is not None:
        if spec.modifiers.active:
            why = "not checked: mask_mod / score_mod (python -m fagen.bench modifiers checks them against Flex)"
            for row in rows.values():
                row.check = why
        elif spec.dropout:
            why = "not checked: dropout (SDPA draws other random numbers)"
            for row in rows.values():
                row.check = why
        else:
            ref, used = reference_output(spec, inputs)
            if ref is None:
                for row in rows.values():
                    row.check = f"not checked: no SDPA backend ran ({used})"
            elif "forward" in rows:
                error = relative_error(o, ref)
                rows["forward"].rel_error = error
                rows["forward"].check = "ok" if error <= FORWARD_TOLERANCE else "FAIL"
            del ref
        if "backward" in rows and not spec.dropout and sdpa_ok:
            row = rows["backward"]
            try:
                grads = kernel.backward(q, k, v, o, lse, do, **args)
                torch.cuda.synchronize()
            except Exception as err:  # fagen's own failure: the row is wrong, not unchecked
                row.notes["fagen"], row.check = f"backward failed: {reason(err)}", "FAIL"
            else:
                expected, tried = None, []
                for backend in ("flash", "cudnn"):
                    try:
                        expected = sdpa_backward(backend, spec, inputs, dropout=False)[1]()
                        break
                    except Exception as err:  # this backend cannot run here
                        tried.append(f"{backend}: {reason(err, 80)}")
                if expected is None:
                    row.check = f"not checked: no SDPA backend ran ({'; '.join(tried)})"
                else:
                    row.rel_error = max(relative_error(g, r) for g, r in zip(grads, expected))
                    row.check = "ok" if row.rel_error <= BACKWARD_TOLERANCE else "FAIL"
                del grads, expected
        elif "backward" in rows and not spec.dropout and not spec.modifiers.active:
            rows["backward"].check = f"not checked: SDPA has no {spec.mask} mask to compare with"

    # ---- timings ----
    for pass_name, row in rows.items():
        if o is not None:
            try:
                with unchecked_launches():
                    if pass_name == "forward":
                        row.ms["fagen"] = time_cuda(lambda: kernel.forward(q, k, v, **args), warmup, repeats,
                                                    MAX_SECONDS_PER_MEASUREMENT)
                    else:
                        row.ms["fagen"] = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do, **args), warmup,
                                                    repeats, MAX_SECONDS_PER_MEASUREMENT)
                torch.cuda.synchronize()  # a launch failure surfaces here, inside the try
            except Exception as err:
                row.ms["fagen"] = None
                row.notes["fagen"] = reason(err)
        for backend in IMPLS[1:]:
            if not sdpa_ok:
                row.notes[backend] = ("SDPA has no mask_mod / score_mod" if spec.modifiers.active
                                      else f"SDPA has no {spec.mask} mask")
                continue
            try:
                timer = time_sdpa_forward if pass_name == "forward" else time_sdpa_backward
                row.ms[backend] = timer(backend, spec, inputs, warmup, repeats)
            except Exception as err:  # e.g. "No available kernel" for this dtype/head dim/GPU/dropout
                row.ms[backend] = None
                row.notes[backend] = reason(err)
    return list(rows.values())


def run_bench(specs: Sequence[Spec], *, seqlens: Sequence[int] = (1024, 4096, 16384), tokens: int = 16384,
              model_dim: int = 2048, passes: Optional[Sequence[str]] = None, warmup: int = 10, repeats: int = 50,
              autotune: bool = False, csv=None, json=None, plot=None, console=None,
              exit_on_failure: bool = True, kv_group: int = 1) -> BenchReport:
    """Time every spec at every N (batch = tokens // N, heads = model_dim // d) against SDPA flash and cuDNN.

    kv_group > 1: k and v have heads // kv_group heads (grouped KV heads; SDPA runs with enable_gqa).

    Prints a table, writes CSV/JSON (after each spec, so that a run cut short keeps what it measured)
    and a PNG plot. A kernel that fails its check against SDPA is timed and reported but makes the
    run end with status 1 (click's Exit) after everything is written, unless exit_on_failure=False."""
    import torch

    from fagen.bench import autotune as autotuner
    from fagen import jit, runtime

    if not torch.cuda.is_available():
        raise RuntimeError("fagen bench needs a CUDA GPU visible to PyTorch")
    console = console or make_console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    meta.update(seqlens=list(seqlens), tokens=tokens, model_dim=model_dim, kv_group=kv_group, warmup=warmup, repeats=repeats,
                autotune=autotune, timing=(f"CUDA events around each call, {warmup} warm-up calls, median of "
                                           f"{repeats} timed calls (fewer, at least {MIN_REPEATS}, where one "
                                           f"measurement would exceed {MAX_SECONDS_PER_MEASUREMENT:g} s); "
                                           f"backward: the backward alone, its forward run outside the events"))
    report = BenchReport(meta)
    console.print(escape(f"fagen bench on {meta.get('gpu')}  torch {meta.get('torch')}  cuDNN {meta.get('cudnn')}  "
                         f"{meta['date']}"), style="bold")
    with contextlib.suppress(Exception):  # nvcc in parallel threads; a failure resurfaces, per spec, below
        jit.precompile(specs)
    for spec in specs:
        wanted = [p for p in (passes or spec.passes) if p in spec.passes]
        if not wanted:
            console.print(escape(f"{spec.variant_name}: skipped: it has none of the passes {list(passes or [])}"),
                          style="yellow")
            continue
        if autotune:
            tune_len = min(4096, max(seqlens))
            batch, heads = shape_for(spec, tune_len, tokens, model_dim)
            try:
                entry = autotuner.autotune(spec, seqlen=tune_len, batch=batch, heads=heads, passes=wanted,
                                        console=console)
                console.print(escape(f"  autotuned {spec.variant_name}: " + ", ".join(
                    f"{p} Br={e['block_r']} Bc={e['block_c']} warps={e['warps']} ({e['ms']:.3f} ms)"
                    for p, e in entry.get("passes", {}).items())))
            except Exception as err:  # benchmark the solver's plans (or an older cached winner) instead
                console.print(escape(f"{spec.variant_name}: autotune failed: {reason(err, 400)}"), style="yellow")
        try:
            kernel = autotuner.compile_tuned(spec)
        except Exception as err:
            console.print(escape(f"{spec.variant_name}: cannot compile: {reason(err, 400)}"), style="red")
            for seq_len in seqlens:
                batch, heads = shape_for(spec, seq_len, tokens, model_dim)
                for p in wanted:
                    report.rows.append(Row(spec.variant_name, spec.dtype, spec.head_dim, spec.mask, spec.dropout,
                                           seq_len, batch, heads, p, spec_flops(spec, batch, heads, seq_len, p),
                                           ms={i: None for i in IMPLS}, notes={"fagen": reason(err)}, check="FAIL"))
            continue
        for seq_len in seqlens:
            batch, heads = shape_for(spec, seq_len, tokens, model_dim)
            if heads % kv_group:
                raise ValueError(f"kv_group {kv_group} does not divide the {heads} heads of {spec.variant_name} "
                                 f"(heads = model_dim // head_dim)")
            rows = _bench_config(kernel, kernel.spec, seq_len, batch, heads, wanted, warmup, repeats, kv_group)
            for row in rows:
                row.spec = spec.variant_name  # the name in the spec file, not the device-arch copy's
                console.print(escape(_progress_line(row)))
            report.rows.extend(rows)
            torch.cuda.empty_cache()
        _write_files(report, csv, json)
    print_table(report, console)
    _write_files(report, csv, json)
    if plot:
        plot_report(report, plot, console=console)
    if report.failures and exit_on_failure:
        import click

        names = sorted({f"{r.spec} N={r.seq_len} {r.pass_name}" for r in report.failures})
        click.echo(f"fagen: error: {len(names)} configuration(s) failed the check against SDPA: "
                   f"{'; '.join(names[:6])}{' ...' if len(names) > 6 else ''}", err=True)
        raise click.exceptions.Exit(1)
    return report


def _write_files(report: BenchReport, csv, json) -> None:
    if csv:
        write_csv(report, csv)
    if json:
        write_json(report, json)


def _progress_line(row: Row) -> str:
    parts = []
    for impl in IMPLS:
        tf = row.tflops(impl)
        parts.append(f"{impl} {tf:.1f}" if tf is not None else f"{impl} n/a")
    ratio = row.ratio("flash")
    return (f"  {row.spec} N={row.seq_len} {row.pass_name}: {', '.join(parts)} TFLOP/s"
            f"{f', fagen/flash {ratio:.2f}' if ratio is not None else ''}; check {row.check}"
            f"{f' ({row.rel_error:.2e})' if row.rel_error is not None else ''}")
