"""`fagen bench`: time generated kernels against PyTorch SDPA (flash and cuDNN backends) on one GPU.

One process, the same inputs for every implementation, CUDA events around each call, warm-up runs
first, the median of the timed runs (design.md, "Measuring speed"). Before a configuration is timed,
fagen's output is compared with SDPA's on the same inputs: a benchmark of a wrong kernel is worthless.

The module has three layers, so that everything but the timing runs (and is tested) without a GPU:

    timing      time_cuda, make_inputs, run_bench, measure_compile_times, measure_gemm_tflops (GPU)
    records     attention_flops, Row, BenchReport (plain data; JSON round trip)
    writers     print_table, write_csv, write_json, plot, markdown (fake numbers in tests/test_bench.py)

`python -m fagen.bench --help` has three helpers around the same records: `extras` (compile and
cache-load time, the bf16 GEMM rate and the ptxas report, for BENCHMARKS.md), `plot` (redraw a PNG from
a saved JSON) and `markdown` (the tables of BENCHMARKS.md from a saved JSON).
"""
from __future__ import annotations

import contextlib
import csv as csv_module
import datetime as _dt
import json as json_module
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rich.markup import escape

from fagen import __version__
from fagen.spec import Spec

IMPLS = ("fagen", "flash", "cudnn")
IMPL_LABELS = {"fagen": "fagen", "flash": "SDPA flash", "cudnn": "SDPA cuDNN"}
#: The issue's targets, fagen / SDPA-flash, per pass (the table colours ratios against them).
TARGET_RATIO = {"forward": 1.0, "backward": 0.9}
#: ||fagen - SDPA||_F / ||SDPA||_F above which a row is marked FAIL (forward output; gradients below).
FORWARD_TOLERANCE = 2e-2
BACKWARD_TOLERANCE = 5e-2
#: SDPA is compared with (timed) only for masks it expresses itself: none (plain) and causal (is_causal).
SDPA_MASKS = ("none", "causal")
#: One measurement is cut to fewer timed runs (at least MIN_REPEATS) when it would take longer than this.
MAX_SECONDS_PER_MEASUREMENT = 5.0
MIN_REPEATS = 5
DROPOUT_SEED = 1234
#: Where inputs are made. Always "cuda" in use; a CPU smoke test of the bench's logic may point it elsewhere.
DEVICE = "cuda"


# ==== FLOPs ====================================================================================
def visible_pairs(seq_q: int, seq_k: int, mask: str = "none", window: Optional[int] = None) -> float:
    """(query, key) pairs one (batch, head) computes, by the FlashAttention convention.

    none, padding and block_sparse: Nq*Nk (the bench runs the last two fully populated: every key
    valid, every block on). causal: half of that, the convention. sliding_window: the pairs actually
    inside the window (each query sees itself and the window-1 keys before it), counted exactly."""
    if mask == "causal":
        return seq_q * seq_k / 2
    if mask == "sliding_window":
        if not window:
            raise ValueError("sliding_window needs a window to count its FLOPs")
        shift = seq_k - seq_q  # bottom-right aligned, as fagen's reference: query i sees keys <= i + shift
        return float(sum(max(0, min(i + shift + 1, seq_k) - max(0, i + shift - window + 1)) for i in range(seq_q)))
    return float(seq_q * seq_k)


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, *, mask: str = "none",
                    window: Optional[int] = None, pass_name: str = "forward") -> float:
    """fwd = 4*B*H*Nq*Nk*d (two matmuls, 2 FLOPs per multiply-add), halved for causal; bwd = 2.5 x fwd."""
    forward = 4.0 * batch * heads * head_dim * visible_pairs(seq_q, seq_k, mask, window)
    if pass_name == "forward":
        return forward
    if pass_name == "backward":
        return 2.5 * forward
    raise ValueError(f"unknown pass {pass_name!r}: forward or backward")


def spec_flops(spec: Spec, batch: int, heads: int, seq_len: int, pass_name: str) -> float:
    return attention_flops(batch, heads, seq_len, seq_len, spec.head_dim, mask=spec.mask, window=spec.window,
                           pass_name=pass_name)


def shape_for(spec: Spec, seq_len: int, tokens: int, model_dim: int) -> tuple[int, int]:
    """(batch, heads): batch x N = tokens and heads x d = model_dim held fixed, each at least 1."""
    return max(1, tokens // seq_len), max(1, model_dim // spec.head_dim)


# ==== records ==================================================================================
@dataclass
class Row:
    """One (spec, N, pass): the median milliseconds of each implementation (None: n/a) and why not."""

    spec: str
    dtype: str
    head_dim: int
    mask: str
    dropout: float
    seq_len: int
    batch: int
    heads: int
    pass_name: str
    flops: float
    ms: dict = field(default_factory=dict)        # impl -> median ms, or None
    notes: dict = field(default_factory=dict)     # impl -> why it is n/a
    rel_error: Optional[float] = None             # fagen vs SDPA: o (forward) or worst of dq, dk, dv (backward)
    check: str = "not checked"                    # "ok", "FAIL", or "not checked: <why>"
    plan: str = ""                                # the tile plan fagen ran: "Br=128 Bc=64 warps=4 (...)"

    def tflops(self, impl: str) -> Optional[float]:
        ms = self.ms.get(impl)
        if ms is None or not ms > 0:
            return None
        return self.flops / (ms * 1e-3) / 1e12

    def ratio(self, other: str, impl: str = "fagen") -> Optional[float]:
        """Speed of `impl` over `other` (>1: impl is faster): the ratio of their TFLOP/s."""
        mine, theirs = self.tflops(impl), self.tflops(other)
        if mine is None or theirs is None:
            return None
        return mine / theirs

    def to_dict(self) -> dict:
        out = {"spec": self.spec, "dtype": self.dtype, "head_dim": self.head_dim, "mask": self.mask,
               "dropout": self.dropout, "seq_len": self.seq_len, "batch": self.batch, "heads": self.heads,
               "pass": self.pass_name, "flops": self.flops}
        for impl in IMPLS:
            out[f"{impl}_ms"] = self.ms.get(impl)
        for impl in IMPLS:
            out[f"{impl}_tflops"] = self.tflops(impl)
        for other in IMPLS[1:]:
            out[f"fagen_over_{other}"] = self.ratio(other)
        out.update(rel_error=self.rel_error, check=self.check, plan=self.plan)
        for impl in IMPLS:
            out[f"{impl}_note"] = self.notes.get(impl, "")
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        return cls(spec=data["spec"], dtype=data["dtype"], head_dim=int(data["head_dim"]), mask=data["mask"],
                   dropout=float(data["dropout"]), seq_len=int(data["seq_len"]), batch=int(data["batch"]),
                   heads=int(data["heads"]), pass_name=data["pass"], flops=float(data["flops"]),
                   ms={impl: _float_or_none(data.get(f"{impl}_ms")) for impl in IMPLS},
                   notes={impl: data[f"{impl}_note"] for impl in IMPLS if data.get(f"{impl}_note")},
                   rel_error=_float_or_none(data.get("rel_error")), check=data.get("check", "not checked"),
                   plan=data.get("plan", ""))


def _float_or_none(value: Any) -> Optional[float]:
    if value is None or value == "":
        return None
    return float(value)


@dataclass
class BenchReport:
    meta: dict
    rows: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "rows": [row.to_dict() for row in self.rows]}

    @classmethod
    def from_dict(cls, data: dict) -> "BenchReport":
        return cls(dict(data.get("meta", {})), [Row.from_dict(row) for row in data.get("rows", [])])

    @classmethod
    def load(cls, path) -> "BenchReport":
        return cls.from_dict(json_module.loads(Path(path).read_text()))

    @property
    def failures(self) -> list:
        return [row for row in self.rows if row.check == "FAIL"]


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """This process's command line, as typed (`fagen bench ...`, not the script's full path)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    head = os.path.basename(argv[0])
    parts = Path(argv[0]).parts
    if len(parts) >= 2 and parts[-2] == "fagen" and head.endswith(".py"):  # python -m fagen.cli / fagen.bench
        module = "fagen" if head == "__main__.py" else f"fagen.{head[:-3]}"
        head = f"{os.path.basename(sys.executable)} -m {module}"
    elif head in ("-c", "-m") or head.endswith(".py"):
        head = f"{os.path.basename(sys.executable)} {argv[0]}"
    return " ".join([head, *(shlex.quote(arg) for arg in argv[1:])])


def environment(torch: Any = None) -> dict:
    """Date, GPU, software versions and the command line: recorded with every set of numbers."""
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(), "fagen": __version__, "python": platform.python_version()}
    if torch is not None:
        meta["torch"] = torch.__version__
        meta["cuda"] = getattr(torch.version, "cuda", None)
        with contextlib.suppress(Exception):
            meta["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            meta["gpu"] = torch.cuda.get_device_name()
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            meta["sm_count"] = props.multi_processor_count
            meta["capability"] = f"sm_{props.major}{props.minor}"
    return meta


# ==== timing (GPU) =============================================================================
def time_cuda(fn: Callable[[], Any], warmup: int = 10, repeats: int = 50,
              max_seconds: Optional[float] = None) -> float:
    """Median milliseconds of `repeats` calls of fn, each between two CUDA events, after `warmup` calls.

    The events are recorded on PyTorch's current stream, the legacy default stream unless the caller
    changed it; fagen launches through PyCUDA on that same stream, so both are timed alike. Calls are
    queued back to back and synchronised once at the end. With max_seconds, a slow fn gets fewer
    timed runs (never fewer than MIN_REPEATS, nor more than asked) so that one measurement stays
    near that long; the first warm-up call is the estimate."""
    import torch

    if max_seconds is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end), 1e-3)
        budget = max_seconds * 1e3
        repeats = max(min(repeats, MIN_REPEATS), min(repeats, int(budget / estimate)))
        warmup = max(0, min(warmup - 1, int(budget / 4 / estimate)))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))


@contextlib.contextmanager
def unchecked_launches():
    """fagen.runtime.CHECK_LAUNCHES off (no synchronise after each launch) inside; restored after."""
    from fagen import runtime

    saved = runtime.CHECK_LAUNCHES
    runtime.CHECK_LAUNCHES = False
    try:
        yield
    finally:
        runtime.CHECK_LAUNCHES = saved


def reason(err: BaseException, limit: int = 160) -> str:
    """An exception as one short line, for the 'n/a' notes."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class Inputs:
    """q, k, v and the output gradient do, (batch, heads, N, d) contiguous, and fagen's run-time args."""

    q: Any
    k: Any
    v: Any
    do: Any
    runtime_args: dict


def make_inputs(spec: Spec, batch: int, heads: int, seq_len: int, seed: int = 0) -> Inputs:
    """Fresh torch.randn inputs on the GPU (never zeros: zeros make every kernel look fast).

    padding gets every key valid and block_sparse every block on, so that their FLOPs are the dense
    count; dropout gets a fixed seed and offset."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[spec.dtype]
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (batch, heads, seq_len, spec.head_dim)
    q, k, v, do = (torch.randn(shape, dtype=dtype, device=DEVICE, generator=generator) for _ in range(4))
    args: dict = {"seed": DROPOUT_SEED, "offset": 0} if spec.dropout else {}
    if spec.mask == "padding":
        args["kv_lengths"] = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    if spec.mask == "block_sparse":
        blocks = math.ceil(seq_len / spec.block_size)
        args["block_mask"] = torch.ones((blocks, blocks), dtype=torch.uint8, device=DEVICE)
    return Inputs(q, k, v, do, args)


def relative_error(out: Any, ref: Any) -> float:
    """||out - ref||_F / ||ref||_F in float32 on the GPU; NaN or inf anywhere -> inf."""
    import torch

    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    denominator = float(torch.linalg.vector_norm(ref))
    difference = float(torch.linalg.vector_norm(out - ref))
    return difference / denominator if denominator > 0 else difference


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def _sdpa_kwargs(spec: Spec, dropout: bool = True) -> dict:
    return {"is_causal": spec.mask == "causal", "dropout_p": spec.dropout if dropout else 0.0, "scale": spec.scale}


def sdpa_forward(backend: str, spec: Spec, inputs: Inputs, *, dropout: bool = True, attn_mask=None):
    """SDPA's output on the same inputs with one backend forced (raises where it cannot run)."""
    import torch
    from torch.nn.attention import sdpa_kernel

    kwargs = _sdpa_kwargs(spec, dropout)
    if attn_mask is not None:
        kwargs["is_causal"] = False
    with torch.no_grad(), sdpa_kernel(_backend(backend)):
        return torch.nn.functional.scaled_dot_product_attention(inputs.q, inputs.k, inputs.v, attn_mask=attn_mask,
                                                                **kwargs)


def sdpa_backward(backend: str, spec: Spec, inputs: Inputs, *, dropout: bool = True):
    """(o, grads-thunk, leaves): SDPA's forward run once under autograd; the thunk runs only its backward."""
    import torch
    from torch.nn.attention import sdpa_kernel

    leaves = tuple(t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    with sdpa_kernel(_backend(backend)):
        o = torch.nn.functional.scaled_dot_product_attention(*leaves, **_sdpa_kwargs(spec, dropout))
    do = inputs.do

    def grads():
        return torch.autograd.grad(o, leaves, do, retain_graph=True)

    return o, grads


def _time_sdpa_forward(backend: str, spec: Spec, inputs: Inputs, warmup: int, repeats: int) -> float:
    import torch
    from torch.nn.attention import sdpa_kernel

    kwargs = _sdpa_kwargs(spec)
    q, k, v = inputs.q, inputs.k, inputs.v
    with torch.no_grad(), sdpa_kernel(_backend(backend)):
        return time_cuda(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs),
                         warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)


def _time_sdpa_backward(backend: str, spec: Spec, inputs: Inputs, warmup: int, repeats: int) -> float:
    # The forward runs once, outside the timed region; only autograd's backward of it is timed.
    _, grads = sdpa_backward(backend, spec, inputs)
    return time_cuda(grads, warmup, repeats, MAX_SECONDS_PER_MEASUREMENT)


def _reference_output(spec: Spec, inputs: Inputs) -> tuple[Any, str]:
    """SDPA's o on the same inputs, for checking fagen's (no dropout); (None, why) where there is none.

    none/causal: the flash backend (cuDNN where flash cannot run); padding and block_sparse run fully
    populated, so they are plain attention too; sliding_window: the memory-efficient backend with
    the window as a boolean mask."""
    attempts: list[tuple[str, Any]] = [("flash", None), ("cudnn", None)]
    if spec.mask == "sliding_window":
        import torch

        n = inputs.q.shape[2]
        rows = torch.arange(n, device=DEVICE)[:, None]
        cols = torch.arange(n, device=DEVICE)[None, :]
        distance = rows - cols
        attempts = [("efficient", (distance >= 0) & (distance < spec.window))]
    errors = []
    for backend, attn_mask in attempts:
        try:
            return sdpa_forward(backend, spec, inputs, dropout=False, attn_mask=attn_mask), backend
        except Exception as err:  # backend unavailable for this dtype / head dim / GPU
            errors.append(f"{backend}: {reason(err, 80)}")
    return None, "; ".join(errors)


def _plan_text(kernel: Any) -> str:
    return ", ".join(f"{p[:3]} Br={x.block_r} Bc={x.block_c} w={x.warps}" for p, x in kernel.solution.plans.items())


def _bench_config(kernel: Any, spec: Spec, seq_len: int, batch: int, heads: int, passes: Sequence[str],
                  warmup: int, repeats: int) -> list[Row]:
    """Every row for one (spec, N): correctness first (checked launches), then the timings."""
    import torch

    inputs = make_inputs(spec, batch, heads, seq_len, seed=seq_len)
    args = inputs.runtime_args
    q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
    rows = {p: Row(spec.variant_name, spec.dtype, spec.head_dim, spec.mask, spec.dropout, seq_len, batch, heads, p,
                   spec_flops(spec, batch, heads, seq_len, p), ms={i: None for i in IMPLS}, plan=_plan_text(kernel))
            for p in passes}
    sdpa_ok = spec.mask in SDPA_MASKS

    # ---- correctness: fagen vs SDPA on these very inputs (checked launches) ----
    o = lse = None
    try:
        o, lse = kernel.forward(q, k, v, **args)
        torch.cuda.synchronize()
    except Exception as err:
        for row in rows.values():
            row.notes["fagen"], row.check = f"forward failed: {reason(err)}", "FAIL"
    if o is not None:
        if spec.dropout:
            why = "not checked: dropout (SDPA draws other random numbers)"
            for row in rows.values():
                row.check = why
        else:
            ref, used = _reference_output(spec, inputs)
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
        elif "backward" in rows and not spec.dropout:
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
                row.notes[backend] = f"SDPA has no {spec.mask} mask"
                continue
            try:
                timer = _time_sdpa_forward if pass_name == "forward" else _time_sdpa_backward
                row.ms[backend] = timer(backend, spec, inputs, warmup, repeats)
            except Exception as err:  # e.g. "No available kernel" for this dtype/head dim/GPU/dropout
                row.ms[backend] = None
                row.notes[backend] = reason(err)
    return list(rows.values())


def run_bench(specs: Sequence[Spec], *, seqlens: Sequence[int] = (1024, 4096, 16384), tokens: int = 16384,
              model_dim: int = 2048, passes: Optional[Sequence[str]] = None, warmup: int = 10, repeats: int = 50,
              autotune: bool = False, csv=None, json=None, plot=None, console=None,
              exit_on_failure: bool = True) -> BenchReport:
    """Time every spec at every N (batch = tokens // N, heads = model_dim // d) against SDPA flash and cuDNN.

    Prints a table, writes CSV/JSON (after each spec, so that a run cut short keeps what it measured)
    and a PNG plot. A kernel that fails its check against SDPA is timed and reported but makes the
    run end with status 1 (click's Exit) after everything is written, unless exit_on_failure=False."""
    import torch

    from fagen import autotune as tuning
    from fagen import runtime

    if not torch.cuda.is_available():
        raise RuntimeError("fagen bench needs a CUDA GPU visible to PyTorch")
    console = console or _console()
    torch.cuda.init()
    runtime.ensure_context()
    meta = environment(torch)
    meta.update(seqlens=list(seqlens), tokens=tokens, model_dim=model_dim, warmup=warmup, repeats=repeats,
                autotune=autotune, timing=(f"CUDA events around each call, {warmup} warm-up calls, median of "
                                           f"{repeats} timed calls (fewer, at least {MIN_REPEATS}, where one "
                                           f"measurement would exceed {MAX_SECONDS_PER_MEASUREMENT:g} s); "
                                           f"backward: the backward alone, its forward run outside the events"))
    report = BenchReport(meta)
    console.print(escape(f"fagen bench on {meta.get('gpu')}  torch {meta.get('torch')}  cuDNN {meta.get('cudnn')}  "
                         f"{meta['date']}"), style="bold")
    with contextlib.suppress(Exception):  # nvcc in parallel threads; a failure resurfaces, per spec, below
        runtime.precompile(specs)
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
                entry = tuning.autotune(spec, seqlen=tune_len, batch=batch, heads=heads, passes=wanted,
                                        console=console)
                console.print(escape(f"  autotuned {spec.variant_name}: " + ", ".join(
                    f"{p} Br={e['block_r']} Bc={e['block_c']} warps={e['warps']} ({e['ms']:.3f} ms)"
                    for p, e in entry.get("passes", {}).items())))
            except Exception as err:  # benchmark the solver's plans (or an older cached winner) instead
                console.print(escape(f"{spec.variant_name}: autotune failed: {reason(err, 400)}"), style="yellow")
        try:
            kernel = tuning.compile_tuned(spec)
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
            rows = _bench_config(kernel, kernel.spec, seq_len, batch, heads, wanted, warmup, repeats)
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


# ==== compile time, GEMM rate, ptxas (GPU; for BENCHMARKS.md) ===================================
_COMPILE_PROBE = r"""
import json, sys, time
from fagen import runtime
from fagen.spec import spec_from_dict
spec = spec_from_dict(json.loads(sys.argv[1]))
runtime.ensure_context()  # CUDA context creation is not compile time
start = time.perf_counter()
kernel = runtime.compile(spec)
seconds = time.perf_counter() - start
print("FAGEN_PROBE " + json.dumps({"seconds": seconds, "kernel": repr(kernel)}))
"""


def _probe_compile(spec: Spec, cache: str, timeout: float) -> dict:
    """runtime.compile(spec) in a fresh Python process with FAGEN_CACHE_DIR=cache, timed inside it."""
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "FAGEN_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, json_module.dumps(spec.to_dict())], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FAGEN_PROBE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compile probe failed (status {proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    result = json_module.loads(lines[-1].removeprefix("FAGEN_PROBE "))
    result["process_seconds"] = wall  # interpreter, torch and pycuda start-up included
    return result


def measure_compile_times(spec: Spec, timeout: float = 900.0) -> dict:
    """Cold compile and warm cache-load seconds of one spec, each `fagen.compile(spec)` in a fresh process.

    cold: FAGEN_CACHE_DIR is a new empty folder, so the spec is solved, rendered and compiled by nvcc
    (through PyCUDA) before the module is loaded. warm: a second fresh process with the same folder,
    which only solves, renders and loads the cached module: what every later user process pays.
    Both are timed inside the process around runtime.compile, after the CUDA context exists."""
    with tempfile.TemporaryDirectory(prefix="fagen-cold-cache-") as cache:
        cold = _probe_compile(spec, cache, timeout)
        warm = _probe_compile(spec, cache, timeout)
    return {"variant": spec.variant_name, "cold_s": cold["seconds"], "warm_s": warm["seconds"],
            "cold_process_s": cold["process_seconds"], "warm_process_s": warm["process_seconds"],
            "kernel": warm.get("kernel")}


def measure_gemm_tflops(n: int = 8192, warmup: int = 5, repeats: int = 20) -> float:
    """The GPU's dense bf16 rate as PyTorch (cuBLAS) reaches it: an n^3 matmul on random data, median of events."""
    import torch

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn((n, n), dtype=torch.bfloat16, device=DEVICE, generator=generator)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=DEVICE, generator=generator)
    c = torch.empty((n, n), dtype=torch.bfloat16, device=DEVICE)
    ms = time_cuda(lambda: torch.matmul(a, b, out=c), warmup, repeats)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def ptxas_report(spec: Spec) -> dict:
    """ptxas's resources for the kernels fagen runs for `spec` on this GPU (the device's plan, autotuned
    where the cache says so): {pass: {kernel: {registers, spill_stores, spill_loads, ...}}, plans}."""
    from fagen import autotune as tuning
    from fagen.compiler import compile_cubin

    kernel = tuning.compile_tuned(spec)
    compiled = compile_cubin(kernel.rendered.text, kernel.target.arch, kernel.rendered.include_dir)
    return {"variant": spec.variant_name, "arch": kernel.target.arch,
            "plans": {p: plan.to_dict() for p, plan in kernel.solution.plans.items()},
            "kernels": {p: {name: compiled.resources.get(name, {}) for name in names}
                        for p, names in kernel.rendered.kernels.items()}}


# ==== writers (CPU) ============================================================================
def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = 220  # piped or captured: no screen to fit
    return console


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(report: BenchReport, console=None) -> None:
    """The rich table: per row TFLOP/s, ratios (green where the issue's target is met) and ms of each."""
    from rich.table import Table

    console = console or _console()
    meta = report.meta
    table = Table(title=escape(f"fagen bench: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
                               f"{meta.get('date', '')}"),
                  title_justify="left")
    for header in ("spec", "N", "batch", "heads", "pass", "fagen TFLOP/s", "flash TFLOP/s", "cudnn TFLOP/s",
                   "fagen/flash", "fagen/cudnn", "fagen ms", "flash ms", "cudnn ms", "check"):
        table.add_column(header, no_wrap=header == "spec", justify="left" if header in ("spec", "pass", "check")
                         else "right")
    notes: dict[str, list[str]] = {}
    for row in report.rows:
        ratio = row.ratio("flash")
        target = TARGET_RATIO.get(row.pass_name, 1.0)
        flash_ratio = _fmt(ratio, ".2f")
        if ratio is not None:
            flash_ratio = f"[{'green' if ratio >= target else 'red'}]{flash_ratio}[/]"
        check = row.check if len(row.check) <= 48 else row.check[:45] + "..."  # in full in the CSV/JSON
        check = escape(check if row.rel_error is None else f"{check} {row.rel_error:.1e}")
        if row.check == "FAIL":
            check = f"[bold red]{check}[/]"
        table.add_row(escape(row.spec), str(row.seq_len), str(row.batch), str(row.heads), row.pass_name,
                      *(_fmt(row.tflops(i), ".1f") for i in IMPLS), flash_ratio, _fmt(row.ratio("cudnn"), ".2f"),
                      *(_fmt(row.ms.get(i), ".3f") for i in IMPLS), check)
        for impl, note in row.notes.items():
            notes.setdefault(f"{impl} n/a: {note}", []).append(f"{row.spec} N={row.seq_len} {row.pass_name}")
    console.print(table)
    for note, where in notes.items():
        console.print(f"  {escape(note)}  [dim]({len(where)} row{'s' if len(where) > 1 else ''}, "
                      f"e.g. {escape(where[0])})[/dim]")


def _meta_columns(report: BenchReport) -> dict:
    meta = report.meta
    return {"date": meta.get("date", ""), "gpu": meta.get("gpu", ""), "torch": meta.get("torch", ""),
            "command": meta.get("command", "")}


def write_csv(report: BenchReport, path) -> Path:
    """One line per row with every number, then the date, GPU, torch version and command line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**row.to_dict(), **_meta_columns(report)} for row in report.rows]
    header = list(rows[0]) if rows else list(Row("", "", 0, "", 0, 0, 0, 0, "", 0).to_dict()) + list(
        _meta_columns(report))
    with path.open("w", newline="") as handle:
        writer = csv_module.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def write_json(report: BenchReport, path) -> Path:
    """{"meta": {date, gpu, torch, command, settings...}, "rows": [every number of every row]}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_module.dumps(_strict_json(report.to_dict()), indent=2, default=str) + "\n")
    return path


def _strict_json(value: Any) -> Any:
    """inf and NaN (a kernel that wrote NaN has relative error inf) as the strings "inf"/"nan": strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _groups(report: BenchReport) -> list[tuple[str, str, list]]:
    """(spec, pass, rows sorted by N) in the order they first appear."""
    order: dict[tuple[str, str], list] = {}
    for row in report.rows:
        order.setdefault((row.spec, row.pass_name), []).append(row)
    return [(spec, p, sorted(rows, key=lambda r: r.seq_len)) for (spec, p), rows in order.items()]


def plot_report(report: BenchReport, path, console=None) -> Optional[Path]:
    """PNG: one subplot per (spec, pass), TFLOP/s against N (log2 axis), one line per implementation.
    Without matplotlib, says so and returns None (`python -m fagen.bench plot` redraws from the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        (console or _console(stderr=True)).print(escape(f"fagen bench: no plot ({err}); redraw it from the JSON "
                                                        f"with `python -m fagen.bench plot`"), style="yellow")
        return None
    groups = _groups(report)
    if not groups:
        raise ValueError("nothing to plot: the report has no rows")
    passes = [p for p in ("forward", "backward") if any(g[1] == p for g in groups)]
    specs = list(dict.fromkeys(g[0] for g in groups))
    ncols = len(passes)
    nrows = len(specs)
    figure, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    styles = {"fagen": dict(color="tab:red", marker="o", linewidth=2.2), "flash": dict(color="tab:blue", marker="s"),
              "cudnn": dict(color="tab:green", marker="^")}
    by_key = {(spec, p): rows for spec, p, rows in groups}
    for r, spec in enumerate(specs):
        for c, pass_name in enumerate(passes):
            ax = axes[r][c]
            rows = by_key.get((spec, pass_name))
            if not rows:
                ax.set_axis_off()
                continue
            drawn = 0
            for impl in IMPLS:
                points = [(row.seq_len, row.tflops(impl)) for row in rows if row.tflops(impl) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, label=IMPL_LABELS[impl], **styles[impl])
                    drawn += 1
            ax.set_xscale("log", base=2)
            ax.set_xticks([row.seq_len for row in rows])
            ax.set_xticklabels([f"{row.seq_len // 1024}k" if row.seq_len % 1024 == 0 else str(row.seq_len)
                                for row in rows])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{spec} ({pass_name})", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            if drawn:
                ax.legend(fontsize=7, loc="lower right")
            else:
                ax.text(0.5, 0.5, "no timings (see the table's notes)", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
    meta = report.meta
    figure.suptitle(f"fagen vs PyTorch SDPA: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
                    f"{meta.get('date', '')}", fontsize=10)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def markdown(report: BenchReport, pass_name: str, dropout: Optional[bool] = None) -> str:
    """A Markdown table of one pass for BENCHMARKS.md (dropout=False: without dropout, True: only dropout)."""
    lines = ["| variant | N | batch x heads | fagen TFLOP/s | SDPA flash | SDPA cuDNN | fagen/flash | fagen/cuDNN "
             "| fagen ms | check (rel. err.) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in report.rows:
        if row.pass_name != pass_name or (dropout is not None and bool(row.dropout) != dropout):
            continue
        ratio = row.ratio("flash")
        target = TARGET_RATIO.get(pass_name, 1.0)
        flash_ratio = _fmt(ratio, ".2f") + ("" if ratio is None else (" ✓" if ratio >= target else " ✗"))
        check = row.check if row.rel_error is None else f"{row.check} ({row.rel_error:.1e})"
        lines.append(f"| {row.spec} | {row.seq_len} | {row.batch} x {row.heads} | {_fmt(row.tflops('fagen'), '.1f')} "
                     f"| {_fmt(row.tflops('flash'), '.1f')} | {_fmt(row.tflops('cudnn'), '.1f')} | {flash_ratio} "
                     f"| {_fmt(row.ratio('cudnn'), '.2f')} | {_fmt(row.ms.get('fagen'), '.3f')} | {check} |")
    return "\n".join(lines) + "\n"


def efficiency(report: BenchReport, gemm_tflops: float, head_dim: int = 128, pass_name: str = "forward") -> list[dict]:
    """fagen's TFLOP/s at head_dim as a fraction of the measured GEMM rate, per row."""
    out = []
    for row in report.rows:
        tf = row.tflops("fagen")
        if row.head_dim == head_dim and row.pass_name == pass_name and tf is not None:
            out.append({"spec": row.spec, "seq_len": row.seq_len, "tflops": tf, "fraction_of_gemm": tf / gemm_tflops})
    return out


# ==== python -m fagen.bench ====================================================================
def _pick_variant(specs: list[Spec], name: Optional[str]) -> Spec:
    if name:
        for spec in specs:
            if spec.variant_name == name:
                return spec
        raise SystemExit(f"no variant named {name!r}; the file has: {', '.join(s.variant_name for s in specs)}")
    for spec in specs:  # the issue's: the d = 128 forward, bf16, no dropout, not causal
        if spec.head_dim == 128 and spec.dtype == "bf16" and not spec.dropout and spec.mask == "none":
            return spec
    return specs[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fagen.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    extras = sub.add_parser("extras", help="GPU: cold compile / cache-load time, bf16 GEMM rate, ptxas report")
    extras.add_argument("spec_file")
    extras.add_argument("--variant", help="default: the first bf16, d=128, mask none, no-dropout variant")
    extras.add_argument("--json", dest="json_path", help="write the results here too")
    extras.add_argument("--skip-compile-times", action="store_true")
    redraw = sub.add_parser("plot", help="redraw the PNG from a `fagen bench --json` file")
    redraw.add_argument("report")
    redraw.add_argument("png")
    tables = sub.add_parser("markdown", help="BENCHMARKS.md's tables from a `fagen bench --json` file")
    tables.add_argument("report")
    tables.add_argument("--extras", help="JSON from `python -m fagen.bench extras` (efficiency section)")
    args = parser.parse_args(argv)

    if args.command == "plot":
        plot_report(BenchReport.load(args.report), args.png)
        return 0
    if args.command == "markdown":
        report = BenchReport.load(args.report)
        meta = report.meta
        print(f"Measured {meta.get('date')} on {meta.get('gpu')}, torch {meta.get('torch')} (CUDA {meta.get('cuda')}, "
              f"cuDNN {meta.get('cudnn')}), fagen {meta.get('fagen')}:\n\n    {meta.get('command')}\n")
        for title, pass_name, dropout in (("Forward", "forward", False), ("Backward", "backward", False),
                                          ("Dropout, forward", "forward", True),
                                          ("Dropout, backward", "backward", True)):
            body = markdown(report, pass_name, dropout)
            if body.count("\n") > 2:
                print(f"### {title}\n\n{body}")
        if args.extras:
            data = json_module.loads(Path(args.extras).read_text())
            if data.get("gemm_tflops"):
                for item in efficiency(report, data["gemm_tflops"]):
                    print(f"- {item['spec']} N={item['seq_len']}: {item['tflops']:.1f} TFLOP/s = "
                          f"{100 * item['fraction_of_gemm']:.1f}% of the measured bf16 GEMM rate "
                          f"({data['gemm_tflops']:.0f} TFLOP/s)")
        return 0
    # extras (GPU)
    from fagen.spec import load_specs

    spec = _pick_variant(load_specs(args.spec_file), args.variant)
    import torch

    torch.cuda.init()
    result: dict = {"variant": spec.variant_name, **environment(torch)}
    if not args.skip_compile_times:
        result["compile"] = measure_compile_times(spec)
        print(f"compile {spec.variant_name}: cold {result['compile']['cold_s']:.2f} s, "
              f"warm (cache load) {result['compile']['warm_s']:.3f} s", flush=True)
    from fagen import runtime

    runtime.ensure_context()
    result["gemm_tflops"] = measure_gemm_tflops()
    print(f"bf16 GEMM 8192^3: {result['gemm_tflops']:.1f} TFLOP/s", flush=True)
    try:
        result["ptxas"] = ptxas_report(spec)
        for pass_name, kernels in result["ptxas"]["kernels"].items():
            for name, res in kernels.items():
                print(f"ptxas {pass_name} {name}: {res.get('registers')} registers, "
                      f"{res.get('spill_stores')} B spill stores, {res.get('spill_loads')} B spill loads, "
                      f"{res.get('stack_bytes')} B stack", flush=True)
    except Exception as err:  # no nvcc on PATH, say
        result["ptxas"] = {"error": reason(err, 400)}
        print(f"ptxas report unavailable: {result['ptxas']['error']}")
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json_module.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
