"""The `fagen` command. Thin: each subcommand loads the spec file and calls one stage.

    fagen build  SPEC.yaml...  .cu + .json (+ .cubin where nvcc is on PATH) per variant; --standalone adds headers
    fagen solve  SPEC.yaml     the tile plan, why it ranks first, the paper's constraint and the ranked candidates
    fagen render SPEC.yaml     the CUDA source on stdout
    fagen schema               the spec's JSON Schema, for editors
    fagen doctor               what is installed (nvcc, GPU and driver, PyCUDA, torch, ...) and the cache folder
    fagen cache list|clear|verify   the kernel cache (docs/cache.md)
    fagen plot   REPORT.json OUT.png   redraw a `fagen bench --json` report as a PNG
    fagen check  SPEC.yaml     the hypothesis property suite on the GPU
    fagen bench  SPEC.yaml     timings against PyTorch SDPA on the GPU
    fagen bench-model          a small transformers model's training step and the per-call overhead, vs SDPA

Exit status: 0 success; 1 a variant failed to compile (or a check failed, or `cache verify` found bad
entries); 2 a bad, infeasible or unreadable spec, a bad command line, a missing extra, or no GPU for
`check`/`bench`/`bench-model`. A bad spec is one line on stderr (`fagen: error: ...`), never a traceback.
The stages are imported inside the commands, so `fagen schema` and `fagen --help` do not pay for sympy
and Jinja.
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
    """Bytes as KiB with at most two decimals: 73 KiB, 199.05 KiB."""
    if not isinstance(nbytes, (int, float)) or isinstance(nbytes, bool):
        return "-"
    return f"{nbytes / 1024:.2f}".rstrip("0").rstrip(".") + " KiB"


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
@click.argument("spec_files", metavar="SPEC.yaml...", nargs=-1, required=True, type=SPEC_FILE)
@click.option("--out", "out_dir", default="build", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for <name>.cu, <name>.json and <name>.cubin.")
@click.option("--arch", type=ARCH, help="Build for this arch instead of the spec's.")
@click.option("--no-compile", is_flag=True, help="Write .cu and .json only; do not run nvcc.")
@click.option("--standalone", is_flag=True,
              help="Also write the headers the .cu files include beside them, so that each compiles alone "
                   "(the command line is in its .json under compile_alone).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Variants compiled at once (default: CPU count).")
def build(spec_files: tuple[Path, ...], out_dir: Path, arch: Optional[str], no_compile: bool, standalone: bool,
          jobs: Optional[int]) -> None:
    """Write each variant's source and report, and compile it to a cubin where nvcc is on PATH.

    Several spec files build into one folder and one table; two variants of the same name (whose files
    would overwrite each other) are an error naming both files."""
    from fagen import build as builder
    from fagen import compiler as nvcc

    files = list({Path(f).resolve(): f for f in reversed(spec_files)}.values())[::-1]   # a file named twice is built once
    loaded = [(spec_file, load_specs(spec_file)) for spec_file in files]   # every file read before any work
    prepared, source_of = [], {}
    for spec_file, specs in loaded:
        for item in _each(spec_file, specs, lambda spec: builder.prepare(spec, arch)):
            if item.name in source_of:
                other = source_of[item.name]
                where = (f"{spec_file}: two variants are named {item.name}" + (f" for --arch {arch}" if arch else "")
                         if other == spec_file else f"{other} and {spec_file} both define variant {item.name}")
                fail(f"{where}; their files in {out_dir} would overwrite each other: give one another name")
            source_of[item.name] = spec_file
            prepared.append(item)
    compile_ = not no_compile
    if compile_ and not nvcc.nvcc_available():
        click.echo("fagen: note: nvcc is not on PATH: writing .cu and .json only, no .cubin", err=True)
        compile_ = False

    results = _build_with_progress(builder, prepared, out_dir, compile_, jobs, standalone)
    _print_build_table(results)
    failed = [r for r in results if not r.ok]
    for result in failed:
        click.echo(f"fagen: error: {result.name}: nvcc failed:\n{result.error}", err=True)
    if failed:
        click.echo(f"fagen: {len(failed)} of {len(results)} variants failed to compile", err=True)
        raise click.exceptions.Exit(1)


def _build_with_progress(builder, prepared: list, out_dir: Path, compile_: bool, jobs: Optional[int],
                         standalone: bool) -> list:
    """build_all under a progress bar (on a terminal only) naming the variants being compiled, with an ETA."""
    import threading

    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    verb = "compiling" if compile_ else "writing"
    running: dict[str, None] = {}
    guard = threading.Lock()
    console = _console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(verb, total=len(prepared))

        def describe() -> str:
            names = list(running)
            if not names:
                return verb
            shown = ", ".join(names[:2]) + (f" (+{len(names) - 2})" if len(names) > 2 else "")
            return f"{verb} {_markup_escape(shown)}"

        def started(item) -> None:
            with guard:
                running[item.name] = None
                bar.update(task, description=describe())

        def finished(result) -> None:
            with guard:
                running.pop(result.name, None)
                bar.update(task, advance=1, description=describe())

        return builder.build_all(prepared, out_dir, compile=compile_, jobs=jobs, progress=finished, started=started,
                                 standalone=standalone)


def _markup_escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _print_build_table(results: list) -> None:
    from rich.table import Table
    from rich.text import Text

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
            spilled = sum(k.get("spill_stores", 0) + k.get("spill_loads", 0) for k in kernels)
            spills = Text(f"{spilled} B" if kernels else "-", style="bold yellow" if spilled else "")
            if not result.ok:
                where = Text("FAILED (nvcc)", style="bold red")
            else:
                where = Text(str(result.files["cubin"] if result.compiled else result.files["cu"]))
            table.add_row(Text(result.name if n == 0 else "", style="red" if not result.ok else ""), pass_name,
                          str(fields.get("block_r")), str(fields.get("block_c")), str(fields.get("warps")),
                          _kib(fields.get("smem_bytes")), registers, spills, where if n == 0 else "")
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
        data = []
        for spec, solution in zip(specs, solutions):
            item = solution.to_dict()
            for pass_name, plan in item.get("passes", {}).items():
                plan["why_first"] = why_first(spec, solution, pass_name)
            data.append(item)
        click.echo(json.dumps(data, indent=2, default=_jsonable))
        return
    console = _console()
    for spec, solution in zip(specs, solutions):
        _print_solution(console, spec, solution.to_dict(), solution, top)


def _deciding_field(top: Any, other: Any, head_dim: int) -> Optional[str]:
    """The first rank_key field in which `top` ranks ahead of `other` (None: equal on all of them)."""
    for (name, a), (_, b) in zip(top.rank_fields(head_dim), other.rank_fields(head_dim)):
        if a != b:
            return name
    return None


def why_first(spec: Spec, solution: Any, pass_name: str) -> str:
    """Why the solver's first plan for a pass is first, in one sentence: the least HBM traffic, or the rule
    ranked ahead of traffic that put it there (head-dim padding, family preference, a tile timed faster)."""
    ranked = list(solution.candidates.get(pass_name, ()))
    top = solution.plans.get(pass_name)
    if top is None or not ranked:
        return ""
    if top != ranked[0]:
        return "chosen by autotuning: timed fastest on this GPU (fagen bench --autotune)"
    if len(ranked) == 1:
        return "the only feasible plan"
    least = min(plan.hbm_bytes for plan in ranked)
    rival = ranked[1] if top.hbm_bytes == least else next(p for p in ranked if p.hbm_bytes == least)
    rank = ranked.index(rival) + 1
    reason = _reason(_deciding_field(top, rival, spec.compute_dim), top, rival, spec)
    if top.hbm_bytes == least:
        if rival.hbm_bytes > least:
            return f"the least HBM traffic ({top.hbm_bytes:,} bytes at N = 4096)"
        return f"the least HBM traffic ({top.hbm_bytes:,} bytes at N = 4096), tied with rank {rank}; it goes first because {reason}"
    return (f"rank {rank} moves fewer HBM bytes ({least:,} against {top.hbm_bytes:,} at N = 4096), but a rule ranked "
            f"ahead of traffic puts this plan first: {reason}")


def _reason(field: Optional[str], top: Any, other: Any, spec: Spec) -> str:
    if field == "padding":
        weighed = [float(plan.rank_key(spec.compute_dim)[0]) for plan in (top, other)]
        return (f"{top.family} computes d = {spec.head_dim} at {top.head_dim}, weighed as {weighed[0]:g}, against "
                f"{other.family} at {other.head_dim}, weighed as {weighed[1]:g} (head-dim padding ranks first; a Hopper "
                "warpgroup-MMA family's counts for 3/4 of it: solver.PREFERRED_PADDING)")
    if field == "preference":
        return (f"its family {top.family} is preferred to {other.family} (solver.Family.preference: the newer "
                "instruction family, timed faster, first)")
    if field == "timed":
        return (f"Br = {top.block_r}, Bc = {top.block_c} with {top.warps} warps at d = {top.head_dim} is in "
                f"{top.family}'s timed_first list: timed faster on the GPU than the cost model's first choice "
                "(solver.Family.timed_first)")
    if field == "hbm":
        return f"it moves fewer HBM bytes ({top.hbm_bytes:,} against {other.hbm_bytes:,})"
    if field == "resident":
        return f"it keeps more warps resident per multiprocessor ({top.resident_warps} against {other.resident_warps})"
    if field == "reads":
        return f"it reads less shared memory per (row, key) ({top.smem_reads} against {other.smem_reads} bytes)"
    if field == "tile":
        return f"its tile is bigger ({top.block_r} x {top.block_c} against {other.block_r} x {other.block_c})"
    if field == "warps":
        return f"it uses fewer warps ({top.warps} against {other.warps})"
    return "it is equal on every ranking criterion and was found first"


def _paper_lines(spec: Spec, data: dict, solution: Any) -> list[str]:
    """The FlashAttention-1 constraint as a reference point: evaluated on the paper's closed-form tiles, not on
    the chosen plans, whose footprint is each template's own (the smem column) within the budget."""
    constraint = data.get("constraint") or {}
    if not constraint:
        return []
    lhs, rhs = constraint.get("lhs"), constraint.get("rhs")
    paper = data.get("paper") or getattr(solution, "paper", None) or {}
    block_r, block_c = paper.get("block_r", constraint.get("block_r")), paper.get("block_c", constraint.get("block_c"))
    if constraint.get("holds"):
        verdict = "holds"
    elif isinstance(lhs, (int, float)) and isinstance(rhs, (int, float)) and rhs:
        verdict = f"over M by {100 * (lhs - rhs) / rhs:.1f}% (the closed form is a sizing rule, not a guarantee)"
    else:
        verdict = "over M"
    budget = _kib(getattr(solution, "budget_bytes", None))
    if data.get("policy") == "paper":
        how = ("tile_policy paper: the plan takes these tiles as they are, checked against the template's own "
               "shared-memory footprint")
    else:
        how = (f"a reference point, not the plan's footprint: fagen checks each template's own shared memory (the "
               f"smem column) against the {budget} budget")
    return [f"paper constraint  FlashAttention-1's {constraint.get('expression')}, M = {rhs} elements of {spec.dtype}",
            f"                  at its closed-form tiles Br = {block_r}, Bc = {block_c}: {lhs} {'<=' if constraint.get('holds') else '>'} {rhs}, {verdict}",
            f"                  ({how})"]


def _print_solution(console, spec: Spec, data: dict, solution: Any, top: int) -> None:
    from rich.table import Table

    dims = f"d={spec.head_dim}" + (f" / dv={spec.value_head_dim}" if spec.value_head_dim else "")
    console.print(f"[bold]{data.get('name', spec.variant_name)}[/bold]  template {data.get('template')}, "
                  f"{spec.dtype}, {dims}, mask {spec.mask}, loop order {spec.loop_order}, {spec.arch}")
    plans = Table("pass", "template", "Br", "Bc", "warps", "stages", "smem", "registers (est.)", box=None,
                  pad_edge=False)
    passes = data.get("passes") or {spec.passes[0]: data}
    for pass_name, plan in passes.items():
        plans.add_row(pass_name, str(plan.get("template")), str(plan.get("block_r")), str(plan.get("block_c")),
                      str(plan.get("warps")), str(plan.get("stages")), _kib(plan.get("smem_bytes")),
                      str(plan.get("registers_estimate", "-")))
    console.print(plans)
    for pass_name in passes:
        reason = why_first(spec, solution, pass_name)
        if reason:
            console.print(f"first {pass_name} plan: {_markup_escape(reason)}")
    for line in _paper_lines(spec, data, solution):
        console.print(_markup_escape(line))
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


# ---- doctor ---------------------------------------------------------------------------------
EXTRA_HINTS = {"pycuda": "pip install 'fagen[gpu]'", "torch": "pip install 'fagen[torch]'",
               "transformers": "pip install 'fagen[transformers]'", "matplotlib": "pip install 'fagen[bench]'"}


def _module_version(name: str) -> Optional[str]:
    """The installed version of a distribution / module, or None when it cannot be imported (not imported here)."""
    from importlib import metadata
    from importlib.util import find_spec

    try:
        if find_spec(name) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "installed"


def _nvcc_status() -> tuple[bool, str]:
    import re
    import subprocess

    from fagen import compiler

    path = compiler.nvcc_path()
    if path is None:
        return False, "not on PATH or under $CUDA_HOME/bin"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return False, f"{path} does not run ({err})"
    release = re.search(r"release ([\d.]+)", out)
    return True, f"{path}" + (f" (CUDA {release.group(1)})" if release else "")


def _gpu_status() -> tuple[bool, str]:
    """The first GPU and the driver, through libcuda directly (no PyCUDA or torch needed)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, "no NVIDIA driver (libcuda.so.1 cannot be loaded)"
    try:
        if lib.cuInit(0) != 0:
            return False, "the driver is installed but cuInit failed (no usable GPU?)"
        version, count, device, major, minor = (ctypes.c_int() for _ in range(5))
        lib.cuDriverGetVersion(ctypes.byref(version))
        lib.cuDeviceGetCount(ctypes.byref(count))
        if count.value < 1:
            return False, "the driver sees no GPU"
        lib.cuDeviceGet(ctypes.byref(device), 0)
        name = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(name, 256, device)
        lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)
    except (AttributeError, OSError) as err:
        return False, f"the driver does not answer ({err})"
    driver = ""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
        import re

        found = re.search(r"Kernel Module\s+([\d.]+)", first)
        driver = f"driver {found.group(1)}, " if found else ""
    except (OSError, IndexError):
        pass
    more = f" (+{count.value - 1} more)" if count.value > 1 else ""
    return True, (f"{name.value.decode(errors='replace')}{more}, sm_{major.value}{minor.value}; {driver}CUDA "
                  f"{version.value // 1000}.{version.value % 1000 // 10}")


def _cache_status() -> tuple[str, str]:
    """("ok" | "problem", what): the cache folder, whether it is trusted and writable."""
    import os
    import tempfile

    from fagen.cache import DiskCache, cache_location

    root = cache_location()
    problem = DiskCache(root).problem()
    if problem:
        from fagen.cache import fix_hint

        return "problem", f"{root}: not used: {problem}; {fix_hint(root, problem)}"
    if not root.exists():
        parent = next((p for p in root.parents if p.exists()), None)
        if parent is not None and os.access(parent, os.W_OK | os.X_OK):
            return "ok", f"{root} (made on first use)"
        return "problem", f"{root} cannot be made ({parent} is not writable); set FAGEN_CACHE_DIR to a folder you own"
    try:
        fd, probe = tempfile.mkstemp(dir=root, prefix=".doctor-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return "problem", f"{root} is not writable ({err.strerror or err}): kernels are built in memory, each time"
    return "ok", f"{root} (writable, private to you)"


@cli.command()
def doctor() -> None:
    """Check what fagen can use here: nvcc, the GPU and driver, PyCUDA, torch, transformers, matplotlib, the cache.

    Exits 0 whatever is missing: each row says what needs it and what to do."""
    import platform

    from rich.table import Table
    from rich.text import Text

    rows: list[tuple[str, str, str, str]] = [("fagen", "ok", f"{__version__}, Python {platform.python_version()}",
                                              "solve, render, schema, build --no-compile: nothing else needed")]
    found, detail = _nvcc_status()
    rows.append(("nvcc", "ok" if found else "missing", detail,
                 "fagen build's .cubin and compiling at run time" +
                 ("" if found else "; install the CUDA toolkit (12.x or later) and put its bin/ on PATH")))
    found, detail = _gpu_status()
    rows.append(("GPU and driver", "ok" if found else "missing", detail,
                 "fagen.compile, fagen.attention, check, bench" + ("" if found else "; needs an NVIDIA GPU, sm_80 or later")))
    for module, label, needed in (("pycuda", "PyCUDA", "fagen.compile, check, bench"),
                                  ("torch", "torch", "fagen.attention and the torch ops, check, bench"),
                                  ("transformers", "transformers", "the transformers integration, bench-model"),
                                  ("matplotlib", "matplotlib", "fagen plot, bench --plot")):
        version = _module_version(module)
        rows.append((label, "ok" if version else "missing", version or "not installed",
                     needed + ("" if version else f"; {EXTRA_HINTS[module]}")))
    state, detail = _cache_status()
    rows.append(("cache", state, detail, "loading compiled kernels instead of compiling them again (docs/cache.md)"))

    table = Table(title="fagen doctor", title_justify="left")
    for header in ("check", "status", "found", "needed for / what to do"):
        table.add_column(header, overflow="fold")
    styles = {"ok": "green", "missing": "yellow", "problem": "bold red"}
    for name, state, detail, needed in rows:
        table.add_row(name, Text(state, style=styles[state]), Text(detail), Text(needed))
    console = _console()
    console.print(table)
    missing = [name for name, state, _, _ in rows if state != "ok"]
    console.print(Text("everything fagen can use is here" if not missing else
                       f"not available: {', '.join(missing)} (only the features named beside them need them)"))


# ---- cache ----------------------------------------------------------------------------------
CACHE_KINDS = click.Choice(("cubin", "plan", "autotune"))


@cli.group("cache")
def cache_group() -> None:
    """The kernel cache ($FAGEN_CACHE_DIR, default ~/.cache/fagen; docs/cache.md)."""


def _cache():
    from fagen.cache import DiskCache

    return DiskCache()


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _age(mtime: float) -> str:
    import time

    seconds = max(0.0, time.time() - mtime)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit}"
    return f"{seconds:.0f} s"


def _note_untrusted(cache) -> None:
    problem = cache.problem()
    if problem:
        from fagen.cache import fix_hint

        click.echo(f"fagen: note: {cache.root} is not used by fagen: {problem}; {fix_hint(cache.root, problem)}",
                   err=True)


@cache_group.command("list")
@click.option("--kind", type=CACHE_KINDS, help="Only entries of this kind.")
def cache_list(kind: Optional[str]) -> None:
    """Every entry: kind, key, size and age, then the totals."""
    from rich.table import Table

    cache = _cache()
    _note_untrusted(cache)
    entries = sorted(cache.entries(kind), key=lambda e: (e.kind, -e.mtime))
    console = _console()
    if not entries:
        console.print(_markup_escape(f"{cache.root}: no entries" + (f" of kind {kind}" if kind else "")))
        return
    table = Table(title=_markup_escape(f"fagen cache: {cache.root}"), title_justify="left")
    for header in ("kind", "key", "size", "age"):
        table.add_column(header, justify="right" if header in ("size", "age") else "left")
    for entry in entries:
        table.add_row(entry.kind, entry.key, _size(entry.size), _age(entry.mtime))
    console.print(table)
    totals: dict[str, list[int]] = {}
    for entry in entries:
        count_size = totals.setdefault(entry.kind, [0, 0])
        count_size[0] += 1
        count_size[1] += entry.size
    per_kind = "; ".join(f"{name} {n}, {_size(size)}" for name, (n, size) in totals.items())
    console.print(f"{_count(len(entries), 'entry', 'entries')}, {_size(sum(e.size for e in entries))} ({per_kind})")


@cache_group.command("clear")
@click.option("--kind", type=CACHE_KINDS, help="Only entries of this kind (default: all).")
def cache_clear(kind: Optional[str]) -> None:
    """Remove the entries (all, or of one kind). Files fagen did not write are left alone."""
    cache = _cache()
    removed, size, errors = cache.clear(kind)
    click.echo(f"removed {_count(removed, 'entry', 'entries')} ({_size(size)}) from {cache.root}")
    if errors:
        fail(f"{len(errors)} could not be removed: {errors[0]}", 1)


@cache_group.command("verify")
def cache_verify() -> None:
    """Check every entry's checksum, owner and mode; remove the bad ones. Exit 1 if any were bad.

    A folder another user could write is reported (and exits 1) but left as it is, entries and all:
    fagen does not use it, and it may be shared on purpose."""
    from fagen.cache import fix_hint

    cache = _cache()
    refused = cache.untrusted_folders()
    for folder, reason in refused:
        click.echo(f"bad folder: {folder}: {reason} (not used, left as it is; {fix_hint(folder, reason)})")
    refused_folders = {folder for folder, _ in refused}
    bad = stale = good = skipped = 0
    entries = list(cache.entries())
    for entry in entries:
        if refused_folders & {cache.root, entry.path.parent, entry.path.parent.parent}:
            skipped += 1
            continue
        problem, fault = cache.check(entry)
        if problem is None:
            good += 1
            continue
        error = cache.remove(entry)
        outcome = f"could not remove it: {error}" if error else "removed"
        click.echo(f"{'bad' if fault else 'stale'}: {entry.path}: {problem} ({outcome})")
        if fault or error:
            bad += 1
        else:
            stale += 1
    checked = len(entries) - skipped
    click.echo(f"checked {_count(checked, 'entry', 'entries')} in {cache.root}: {good} good"
               + (f", {stale} stale (an older fagen's, removed)" if stale else "")
               + (f", {bad} bad" if bad else "")
               + (f"; {_count(skipped, 'entry', 'entries')} in refused folders not checked" if skipped else "")
               + (f"; {_count(len(refused), 'folder', 'folders')} refused" if refused else ""))
    if bad or refused:
        raise click.exceptions.Exit(1)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


# ---- plot -----------------------------------------------------------------------------------
@cli.command()
@click.argument("report_file", metavar="REPORT.json", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("png", metavar="OUT.png", type=click.Path(dir_okay=False, path_type=Path))
def plot(report_file: Path, png: Path) -> None:
    """Draw a `fagen bench --json` report as a PNG: TFLOP/s against N, one panel per spec and pass."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("fagen plot needs matplotlib: pip install 'fagen[bench]'", 2)
    from fagen.bench.report import BenchReport, plot_report

    try:
        report = BenchReport.load(report_file)
    except OSError as err:
        fail(f"{report_file}: cannot read it ({err.strerror or err})", 2)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        fail(f"{report_file}: not a `fagen bench --json` report ({type(err).__name__}: {err})", 2)
    try:
        written = plot_report(report, png, console=_console(stderr=True))
    except ValueError as err:
        fail(f"{report_file}: {err}", 2)
    if written is None:
        fail("fagen plot needs matplotlib: pip install 'fagen[bench]'", 2)
    click.echo(f"wrote {png}")


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
        return f"PyCUDA is not installed ({err}); install with pip install 'fagen[gpu]'"
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
    from fagen.bench.timing import timed_elsewhere   # (no torch: the timing helpers import it lazily)

    reasons = [reason for reason in map(timed_elsewhere, specs) if reason]
    if reasons:   # fp8 (SDPA takes no e4m3 inputs) and latent caches have benches of their own
        fail("fagen bench: " + "; ".join(reasons), 2)
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
        fail("fagen bench-model needs transformers: pip install 'fagen[transformers]'", 2)
    run(head_dims=head_dims, seqlens=seqlens, tokens=tokens, hidden=hidden, layers=layers, kv_groups=kv_groups,
        vocab=vocab, warmup=warmup, steps=steps, overhead=overhead, compiled=compiled, packed_doc_len=packed_doc_len,
        json=json_path)


if __name__ == "__main__":
    main(sys.argv[1:])
