"""The `fagen` command. Thin: each subcommand loads the spec file and calls one stage.

    fagen build  SPEC.yaml   .cu + .json (+ .cubin where nvcc is on PATH) per variant
    fagen solve  SPEC.yaml   the tile plan, the paper's constraint and the ranked candidates
    fagen render SPEC.yaml   the CUDA source on stdout
    fagen schema             the spec's JSON Schema, for editors
    fagen check  SPEC.yaml   the hypothesis property suite on the GPU
    fagen bench  SPEC.yaml   timings against PyTorch SDPA on the GPU
    fagen bench-model        a small transformers model's training step and the per-call overhead, vs SDPA

Exit status: 0 success; 1 a variant failed to compile (or a check failed); 2 a bad, infeasible or
unreadable spec, a bad command line, or no GPU for `check`/`bench`/`bench-model`. A bad spec is one line on
stderr (`fagen: error: ...`), never a traceback. The stages are imported inside the commands, so
`fagen schema` and `fagen --help` do not pay for sympy and Jinja.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

import click

from fagen import __version__
from fagen.spec import ARCHS, PASSES, TILE_POLICIES, Spec, SpecError, json_schema, load_specs

ARCH = click.Choice(ARCHS)
SPEC_FILE = click.Path(dir_okay=False, path_type=Path)  # existence is load_specs' to report, in one line


# ---- errors ---------------------------------------------------------------------------------
def fail(message: str, status: int = 2) -> NoReturn:
    """`fagen: error: <message>` on one line of stderr, then exit."""
    click.echo(f"fagen: error: {' '.join(str(message).split())}", err=True)
    raise click.exceptions.Exit(status)


class _Cli(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SpecError as err:  # InfeasibleSpec is one too
            fail(str(err), 2)
        except OSError as err:  # e.g. the output folder cannot be written
            where = f"{err.filename}: " if getattr(err, "filename", None) else ""
            fail(f"{where}{err.strerror or err}", 1)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="fagen")
def cli() -> None:
    """fagen: FlashAttention kernels generated from a spec (spec -> sympy tile solver -> Jinja CUDA -> nvcc)."""


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point (`fagen`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="fagen")


# ---- helpers --------------------------------------------------------------------------------
def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = 200  # piped or captured: there is no screen to fit, so don't wrap names at 80 columns
    return console


def _with_arch(spec: Spec, arch: Optional[str]) -> Spec:
    return spec if arch is None or arch == spec.arch else spec.model_copy(update={"arch": arch})


def _each(spec_file: Path, specs: list[Spec], step: Callable[[Spec], Any]) -> list[Any]:
    """step(spec) for every variant; a SpecError (e.g. infeasible) gets the file and variant prepended."""
    out = []
    for spec in specs:
        try:
            out.append(step(spec))
        except SpecError as err:
            message = str(err)
            if not message.startswith(str(spec_file)):
                named = len(specs) == 1 or message.startswith(spec.variant_name)
                message = f"{spec_file}: {message}" if named else f"{spec_file}: variant {spec.variant_name}: {message}"
            raise SpecError(message) from None
    return out


def _kib(nbytes: Any) -> str:
    if not isinstance(nbytes, (int, float)):
        return "-"
    return f"{nbytes / 1024:g} KiB"


def _jsonable(value: Any) -> Any:
    from fagen.build import _jsonable as convert

    return convert(value)


def _plan_fields(plan: Any) -> dict:
    """A Plan object or its dict, as a dict."""
    if isinstance(plan, dict):
        return plan
    to_dict = getattr(plan, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {k: getattr(plan, k, None) for k in
            ("template", "block_r", "block_c", "warps", "stages", "smem_bytes", "registers_estimate")}


# ---- build ----------------------------------------------------------------------------------
@cli.command()
@click.argument("spec_file", metavar="SPEC.yaml", type=SPEC_FILE)
@click.option("--out", "out_dir", default="build", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for <name>.cu, <name>.json and <name>.cubin.")
@click.option("--arch", type=ARCH, help="Build for this arch instead of the spec's.")
@click.option("--no-compile", is_flag=True, help="Write .cu and .json only; do not run nvcc.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Variants compiled at once (default: CPU count).")
def build(spec_file: Path, out_dir: Path, arch: Optional[str], no_compile: bool, jobs: Optional[int]) -> None:
    """Write each variant's source and report, and compile it to a cubin where nvcc is on PATH."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fagen import build as builder
    from fagen import compiler as nvcc

    specs = load_specs(spec_file)
    prepared = _each(spec_file, specs, lambda spec: builder.prepare(spec, arch))
    compile_ = not no_compile
    if compile_ and not nvcc.nvcc_available():
        click.echo("fagen: note: nvcc is not on PATH: writing .cu and .json only, no .cubin", err=True)
        compile_ = False

    progress_console = _console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=progress_console, transient=True, disable=not progress_console.is_terminal) as bar:
        task = bar.add_task("compiling" if compile_ else "writing", total=len(prepared))
        results = builder.build_all(prepared, out_dir, compile=compile_, jobs=jobs,
                                    progress=lambda result: bar.advance(task))

    _print_build_table(results)
    failed = [r for r in results if not r.ok]
    for result in failed:
        click.echo(f"fagen: error: {result.name}: nvcc failed:\n{result.error}", err=True)
    if failed:
        click.echo(f"fagen: {len(failed)} of {len(results)} variants failed to compile", err=True)
        raise click.exceptions.Exit(1)


def _print_build_table(results: list) -> None:
    from rich.table import Table

    table = Table(title="fagen build", title_justify="left")
    table.add_column("variant", no_wrap=True)
    for header in ("pass", "Br", "Bc", "warps", "smem", "registers", "spills"):
        table.add_column(header)
    table.add_column("file", overflow="fold")
    for result in results:
        plans = getattr(result.solution, "plans", None) or {result.spec.passes[0]: result.solution.primary}
        resources = result.resources
        for n, (pass_name, plan) in enumerate(plans.items()):
            fields = _plan_fields(plan)
            kernels = [resources[k] for k in result.rendered.kernels.get(pass_name, []) if k in resources]
            registers = str(max(k.get("registers", 0) for k in kernels)) if kernels else "-"
            spills = (f"{sum(k.get('spill_stores', 0) + k.get('spill_loads', 0) for k in kernels)} B"
                      if kernels else "-")
            if not result.ok:
                where = "FAILED (nvcc)"
            else:
                where = str(result.files["cubin"] if result.compiled else result.files["cu"])
            table.add_row(result.name if n == 0 else "", pass_name, str(fields.get("block_r")),
                          str(fields.get("block_c")), str(fields.get("warps")), _kib(fields.get("smem_bytes")),
                          registers, spills, where if n == 0 else "")
    _console().print(table)


# ---- solve ----------------------------------------------------------------------------------
@cli.command()
@click.argument("spec_file", metavar="SPEC.yaml", type=SPEC_FILE)
@click.option("--json", "as_json", is_flag=True, help="A JSON array, one object per variant.")
@click.option("--policy", type=click.Choice(TILE_POLICIES), help="Override the spec's tile_policy.")
@click.option("--arch", type=ARCH, help="Solve for this arch instead of the spec's.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=0), help="Candidates listed per variant.")
def solve(spec_file: Path, as_json: bool, policy: Optional[str], arch: Optional[str], top: int) -> None:
    """Choose the tiles: the plan, the paper's SRAM constraint and the ranked candidates."""
    from fagen import solver
    from fagen.target import target_for

    specs = [_with_arch(spec, arch) for spec in load_specs(spec_file)]
    solutions = _each(spec_file, specs, lambda spec: solver.solve(spec, target_for(spec.arch), policy=policy))
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in solutions], indent=2, default=_jsonable))
        return
    console = _console()
    for spec, solution in zip(specs, solutions):
        _print_solution(console, spec, solution.to_dict(), solution, top)


def _print_solution(console, spec: Spec, data: dict, solution: Any, top: int) -> None:
    from rich.table import Table

    console.print(f"[bold]{data.get('name', spec.variant_name)}[/bold]  template {data.get('template')}, "
                  f"{spec.dtype}, d={spec.head_dim}, mask {spec.mask}, loop order {spec.loop_order}, {spec.arch}")
    plans = Table("pass", "template", "Br", "Bc", "warps", "stages", "smem", "registers (est.)", box=None,
                  pad_edge=False)
    passes = data.get("passes") or {spec.passes[0]: data}
    for pass_name, plan in passes.items():
        plans.add_row(pass_name, str(plan.get("template")), str(plan.get("block_r")), str(plan.get("block_c")),
                      str(plan.get("warps")), str(plan.get("stages")), _kib(plan.get("smem_bytes")),
                      str(plan.get("registers_estimate", "-")))
    console.print(plans)
    constraint = data.get("constraint") or {}
    verdict = "holds" if constraint.get("holds") else "does NOT hold"
    console.print(f"paper constraint  {constraint.get('expression')}:  "
                  f"{constraint.get('lhs')} <= {constraint.get('rhs')}  {verdict}")
    paper = data.get("paper") or getattr(solution, "paper", None)
    if paper:
        paper = _plan_fields(paper)
        console.print(f"paper closed form Br = {paper.get('block_r')}, Bc = {paper.get('block_c')}  "
                      f"({'satisfies' if paper.get('holds') else 'violates'} the constraint)")
    candidates = data.get("candidates") or []
    if top and candidates:
        table = Table("rank", "Br", "Bc", "warps", "stages", "smem", "HBM bytes", box=None, pad_edge=False,
                      title=f"top {min(top, len(candidates))} of {len(candidates)} feasible candidates",
                      title_justify="left")
        for rank, cand in enumerate(candidates[:top], 1):
            hbm = cand.get("hbm_bytes")
            table.add_row(str(rank), str(cand.get("block_r")), str(cand.get("block_c")), str(cand.get("warps")),
                          str(cand.get("stages")), _kib(cand.get("smem_bytes")),
                          f"{hbm:,}" if isinstance(hbm, int) else str(hbm))
        console.print(table)
    console.print()


# ---- render ---------------------------------------------------------------------------------
@cli.command()
@click.argument("spec_file", metavar="SPEC.yaml", type=SPEC_FILE)
@click.option("--variant", "variants", multiple=True, metavar="NAME", help="Only this variant (repeatable).")
@click.option("--arch", type=ARCH, help="Render for this arch instead of the spec's.")
def render(spec_file: Path, variants: tuple[str, ...], arch: Optional[str]) -> None:
    """Print the CUDA source; each variant's begins with a comment naming its template and spec."""
    from fagen.build import prepare

    specs = load_specs(spec_file)
    if variants:
        known = {s.variant_name: s for s in specs} | {_with_arch(s, arch).variant_name: s for s in specs}
        missing = [name for name in variants if name not in known]
        if missing:
            fail(f"{spec_file}: no variant named {missing[0]!r}; the file has: "
                 f"{', '.join(_with_arch(s, arch).variant_name for s in specs)}")
        specs = list({id(known[name]): known[name] for name in variants}.values())
    for item in _each(spec_file, specs, lambda spec: prepare(spec, arch)):
        click.echo(item.rendered.text, nl=not item.rendered.text.endswith("\n"))


# ---- schema ---------------------------------------------------------------------------------
@cli.command()
def schema() -> None:
    """Print the spec's JSON Schema (point your editor's YAML plugin at it)."""
    click.echo(json.dumps(json_schema(), indent=2))


# ---- check and bench: GPU only, implemented in fagen.testing and fagen.bench ----------------------
def _gpu_entry(command: str, module: str, function: str) -> Callable:
    """The function behind a GPU command, or exit 2 with one line saying what is missing."""
    reason = _no_gpu_reason()
    if reason:
        fail(f"{command} needs a CUDA GPU: {reason}", 2)
    try:
        from importlib import import_module

        return getattr(import_module(module), function)
    except (ImportError, AttributeError) as err:
        fail(f"{command} is unavailable: cannot load {module}.{function} ({err})", 2)


def _no_gpu_reason() -> Optional[str]:
    try:
        import pycuda.driver as cuda
    except ImportError as err:
        return f"PyCUDA is not installed ({err}); install with pip install -e \".[gpu]\""
    try:
        cuda.init()
        if cuda.Device.count() < 1:
            return "no CUDA device found"
    except Exception as err:  # pycuda raises its own LogicError/RuntimeError without a driver
        return f"no usable CUDA device ({' '.join(str(err).split())})"
    return None


@cli.command()
@click.argument("spec_file", metavar="SPEC.yaml", type=SPEC_FILE)
@click.option("--examples", "-n", default=100, show_default=True, type=click.IntRange(min=1),
              help="Hypothesis examples per variant.")
def check(spec_file: Path, examples: int) -> None:
    """Property-test each variant on the GPU against the float64 reference (table: cases, pass/fail, worst error)."""
    specs = load_specs(spec_file)
    check_specs = _gpu_entry("fagen check", "fagen.testing", "check_specs")
    passed = check_specs(specs, examples=examples)
    raise click.exceptions.Exit(0 if passed else 1)


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers") from None
    if not numbers or min(numbers) < 1:
        raise click.BadParameter(f"{value!r}: give positive integers, e.g. 1024,4096,16384")
    return numbers


@cli.command()
@click.argument("spec_file", metavar="SPEC.yaml", type=SPEC_FILE)
@click.option("--seqlens", default="1024,4096,16384", show_default=True, callback=_int_list,
              help="Sequence lengths N (comma-separated).")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(min=1),
              help="batch x N held fixed.")
@click.option("--model-dim", default=2048, show_default=True, type=click.IntRange(min=1),
              help="heads x head_dim held fixed.")
@click.option("--pass", "passes", multiple=True, type=click.Choice(PASSES),
              help="Passes to time (repeatable; default: the spec's).")
@click.option("--warmup", default=10, show_default=True, type=click.IntRange(min=0))
@click.option("--repeats", default=50, show_default=True, type=click.IntRange(min=1), help="Median of this many.")
@click.option("--kv-group", default=1, show_default=True, type=click.IntRange(min=1),
              help="Query heads per KV head: k and v get heads / this many heads (GQA; SDPA with enable_gqa).")
@click.option("--autotune", is_flag=True, help="Time the solver's top candidates and cache the winner.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the table as CSV.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the table as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw TFLOP/s against N as a PNG.")
def bench(spec_file: Path, seqlens: tuple[int, ...], tokens: int, model_dim: int, passes: tuple[str, ...],
          warmup: int, repeats: int, kv_group: int, autotune: bool, csv_path: Optional[Path],
          json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    """Time fagen against PyTorch SDPA (flash and cuDNN backends) on the same inputs."""
    specs = load_specs(spec_file)
    run_bench = _gpu_entry("fagen bench", "fagen.bench.kernels", "run_bench")
    run_bench(specs, seqlens=seqlens, tokens=tokens, model_dim=model_dim, passes=passes or None,
              warmup=warmup, repeats=repeats, autotune=autotune, csv=csv_path, json=json_path, plot=plot_path,
              kv_group=kv_group)


@cli.command("bench-model")
@click.option("--head-dims", default="64,128", show_default=True, callback=_int_list, help="Head dims d (comma-separated).")
@click.option("--seqlens", default="1024,2048,4096,8192", show_default=True, callback=_int_list,
              help="Sequence lengths N (comma-separated).")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(min=1), help="batch x N held fixed.")
@click.option("--hidden", default=2048, show_default=True, type=click.IntRange(min=1),
              help="Model width (heads = hidden / d).")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--kv-groups", default="1,4", show_default=True, callback=_int_list,
              help="Query heads per KV head (1: no grouping; comma-separated).")
@click.option("--vocab", default=32000, show_default=True, type=click.IntRange(min=2))
@click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0), help="Untimed training steps.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1),
              help="Timed training steps (median).")
@click.option("--overhead/--no-overhead", default=True, show_default=True, help="Also the per-call host overhead table.")
@click.option("--compile/--no-compile", "compiled", default=True, show_default=True,
              help="Overhead table: also through torch.compile.")
@click.option("--packed-doc-len", default=0, show_default=True, type=click.IntRange(min=0),
              help="Pack each row with sequences of about this many tokens (position_ids restarting at 0) and time "
                   "fagen against SDPA with transformers' packed mask and FlexAttention; 0: one sequence per row.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results as JSON.")
def bench_model(head_dims: tuple[int, ...], seqlens: tuple[int, ...], tokens: int, hidden: int, layers: int,
                kv_groups: tuple[int, ...], vocab: int, warmup: int, steps: int, overhead: bool, compiled: bool,
                packed_doc_len: int, json_path: Optional[Path]) -> None:
    """Training steps of a small Llama (transformers) with fagen against SDPA, and the per-call host overhead."""
    run = _gpu_entry("fagen bench-model", "fagen.bench.model", "run_model_bench")
    from importlib.util import find_spec

    if find_spec("transformers") is None:
        fail("fagen bench-model needs transformers: pip install -e \".[hf]\"", 2)
    run(head_dims=head_dims, seqlens=seqlens, tokens=tokens, hidden=hidden, layers=layers, kv_groups=kv_groups,
        vocab=vocab, warmup=warmup, steps=steps, overhead=overhead, compiled=compiled, packed_doc_len=packed_doc_len,
        json=json_path)


if __name__ == "__main__":
    main(sys.argv[1:])
