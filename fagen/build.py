"""Stage 4's orchestrator: spec -> plan (solve) -> source (render) -> cubins -> record, for both uses.

- **At run time** (`fagen.compile`, fagen/jit.py): `artifact(spec, target)` is the record and one cubin per pass,
  from the disk plan cache (fagen/cache.py) or solved, rendered and compiled there, under a lock, so that one
  process builds and the others load. The runtime (fagen/runtime/) loads that artifact and launches; it never
  solves, renders or compiles.
- **Ahead of time** (`fagen build`): `build_all` writes `<name>.cu`, `<name>.json` and, with nvcc, `<name>.cubin`.

Both start from `prepare` (solve, then render). Files are written only when their bytes change (FlashInfer's
habit), so a rebuild leaves untouched files with their old mtimes and make-like tools stay quiet.
nvcc is skipped when the `.json` beside the `.cubin` records a compile of the very same inputs
(source, headers, arch, compiler): the cache is keyed on what went in, never on timestamps.

A `.cu` includes fagen's headers (`attention_common.cuh`, ...). The `.json` says under "compile_alone"
which ones, the folder they are in and the nvcc command line that compiles the `.cu` by itself;
`standalone=True` (`fagen build --standalone`) copies those headers beside it, so that the command
needs no include path: `nvcc -cubin -arch=sm_90a ... X.cu` in the output folder.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Union

from fagen.artifact import INPUT_GRAD_BACKWARD, RECORD_FORMAT, RECORD_KEYS, Artifact
from fagen.cache import AUTOTUNE_FILE, DiskCache, digest
from fagen.sources import fingerprint, folds_kv_group
from fagen.spec import Spec
from fagen.target import Target, target_for

if TYPE_CHECKING:
    from fagen import render as rendering
    from fagen import solver

PathLike = Union[str, Path]


def _nvcc():
    """The compile stage (`fagen/compiler.py`), imported on first use: solving and rendering never need it,
    and looking it up at call time lets tests stub `compile_cubin`."""
    return import_module("fagen.compiler")


@dataclass
class Prepared:
    """A variant solved and rendered: everything about it that needs no compiler."""

    spec: Spec
    solution: "solver.Solution"
    rendered: "rendering.Rendered"

    @property
    def name(self) -> str:
        return self.spec.variant_name


@dataclass
class BuildResult:
    spec: Spec
    solution: "solver.Solution"
    rendered: "rendering.Rendered"
    files: dict[str, Path]                      # "cu", "json" and, once compiled, "cubin"
    written: list[Path] = field(default_factory=list)   # the files whose bytes changed
    compiled: bool = False                      # a cubin matching this source exists
    cached: bool = False                        # ... and nvcc was skipped because it already did
    compile_record: Optional[dict] = None       # what .json says under "compile"
    error: Optional[str] = None                 # nvcc's message when the compile failed
    skipped_reason: Optional[str] = None        # why nothing was compiled (no nvcc, --no-compile)
    seconds: float = 0.0
    headers: list[Path] = field(default_factory=list)   # standalone: the headers beside the .cu

    @property
    def name(self) -> str:
        return self.spec.variant_name

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def resources(self) -> dict:
        """kernel name -> {registers, smem_bytes, spill_stores, spill_loads, stack_bytes}, as ptxas reported."""
        return (self.compile_record or {}).get("resources", {})


def solve(spec: Spec, target: Target, policy: Optional[str] = None) -> "solver.Solution":
    """The solver's plan, with this GPU's autotune winner swapped in under the "auto" policy."""
    from fagen import solver, tuning

    solution = solver.solve(spec, target, policy)
    if (policy or spec.tile_policy) == "auto":  # the per-(GPU, spec) winner of `fagen bench --autotune`
        solution = tuning.apply(solution, tuning.lookup(spec, target.name))
    return solution


def prepare(spec: Spec, arch: Optional[str] = None, *, solution: Optional["solver.Solution"] = None) -> Prepared:
    """Solve (or take `solution`) and render one variant. Raises SpecError (InfeasibleSpec included) before any
    compile."""
    if arch is not None and arch != spec.arch:
        spec = spec.model_copy(update={"arch": arch})
    from fagen import render as rendering   # (solving and rendering import sympy and Jinja: never on a cache hit)
    from fagen import solver

    if solution is None:
        solution = solver.solve(spec, target_for(spec.arch))
    return Prepared(spec, solution, rendering.render(spec, solution))


# ---- run-time artifacts: a record and a cubin per pass -----------------------------------------
def compile_prepared(item: Prepared, arch: Optional[str] = None) -> Artifact:
    """Compile each pass for `arch` (default: the spec's) as its own unit, in parallel (a cold forward + backward
    costs the slower nvcc run, not their sum), and the backward WITH_INPUT_GRADS where score_mod has float tensor
    inputs."""
    compiler = _nvcc()
    spec, rendered = item.spec, item.rendered
    texts = dict(rendered.pass_texts)
    if "backward" in texts and spec.modifiers.kernel_input_grads:
        from fagen.render import render_input_grad_backward

        texts[INPUT_GRAD_BACKWARD] = render_input_grad_backward(spec, item.solution)
    arch = arch or spec.arch
    keys = {p: compiler.cubin_key(text, arch, rendered.include_dir) for p, text in texts.items()}
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        futures = {p: pool.submit(compiler.cached_cubin, text, arch, rendered.include_dir, keys[p])
                   for p, text in texts.items()}
        cubins = {p: future.result() for p, future in futures.items()}
    record = {"format": RECORD_FORMAT, "spec": spec.canonical_json(), "policy": item.solution.policy,
              "plans": {p: plan.to_dict() for p, plan in item.solution.plans.items()},
              "kernels": {p: list(names) for p, names in rendered.kernels.items()},
              "cubin_keys": keys,
              "folds_heads": {p: folds_kv_group(spec, plan) for p, plan in item.solution.plans.items()}}
    return Artifact(record, cubins)


def template_cubin(name: str, arch: str) -> bytes:
    """A template that is plain CUDA (no spec in it: templates/pad_rows.cu) compiled for `arch`, cached on disk."""
    from fagen.sources import TEMPLATE_DIR

    compiler = _nvcc()
    return compiler.cached_cubin((TEMPLATE_DIR / name).read_text(), arch, TEMPLATE_DIR)


def _plan_key(spec: Spec, target: Target, policy: Optional[str]) -> str:
    try:  # a new autotune result changes the plan: key on the autotune file's state, not its contents
        stat = os.stat(DiskCache().root / AUTOTUNE_FILE)
        tuned = f"{stat.st_mtime_ns}:{stat.st_size}"
    except OSError:
        tuned = "none"
    return digest("plan-v1", spec.canonical_json(), policy or "", json.dumps(asdict(target), sort_keys=True),
                  fingerprint(), tuned)


def _cached(cache: DiskCache, key: str) -> Optional[Artifact]:
    raw = cache.get("plan", key)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        if record.get("format") != RECORD_FORMAT or not all(name in record for name in RECORD_KEYS):
            raise ValueError(f"format {record.get('format')}, this fagen writes {RECORD_FORMAT}")
    except ValueError as err:  # checksummed, so only a format change gets here: rebuild
        import warnings

        warnings.warn(f"fagen: cached plan {cache.path('plan', key)} is unreadable ({err}); rebuilding it")
        return None
    cubins = {p: cache.get("cubin", key) for p, key in record["cubin_keys"].items()}
    return None if None in cubins.values() else Artifact(record, cubins)


def artifact(spec: Spec, target: Target, policy: Optional[str] = None) -> Artifact:
    """The cached artifact of a spec on `target`, or solved, rendered, compiled and stored under a lock, so that one
    process builds it and the others wait and load."""
    cache = DiskCache()
    key = _plan_key(spec, target, policy)
    found = _cached(cache, key)
    if found is None:
        with cache.lock("plan", key):
            found = _cached(cache, key)
            if found is None:
                found = compile_prepared(prepare(spec, solution=solve(spec, target, policy)), target.arch)
                cache.put("plan", key, json.dumps(found.record, sort_keys=True).encode())
    return found


def build_variant(spec: Spec, out_dir: PathLike, *, arch: Optional[str] = None, compile: bool = True,
                  standalone: bool = False) -> BuildResult:
    """Build one variant into out_dir. A compile failure raises `fagen.compiler.CompileError`.
    `standalone`: also copy the headers the `.cu` includes beside it."""
    item = prepare(spec, arch)
    out = Path(out_dir)
    headers = write_headers(out, [item]) if standalone else None
    result = _build(item, out, compile, headers)
    if result.error is not None:
        raise _nvcc().CompileError(result.error)
    return result


def build_all(specs: Iterable[Union[Spec, Prepared]], out_dir: PathLike, arch: Optional[str] = None, compile: bool = True,
              jobs: Optional[int] = None,
              progress: Optional[Callable[[BuildResult], None]] = None,
              started: Optional[Callable[[Prepared], None]] = None,
              standalone: bool = False) -> list[BuildResult]:
    """Build every variant, compiling in parallel; results in the order of `specs`.

    Every variant is solved and rendered first, so a bad or infeasible spec raises SpecError
    before nvcc has run at all (items already `prepare`d are taken as they are). A variant that
    fails to compile does not stop the others: its result carries nvcc's message in `error`.
    `started` is called as a variant begins, `progress` once per finished variant, both from the
    thread that builds it. `standalone`: the headers the sources include are written beside them.
    """
    prepared = [item if isinstance(item, Prepared) else prepare(item, arch) for item in specs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    headers = write_headers(out, prepared) if standalone else None
    # Threads suffice: the work is nvcc in subprocesses; the GIL is released while they run.
    workers = max(1, min(jobs or os.cpu_count() or 1, len(prepared) or 1))

    def one(item: Prepared) -> BuildResult:
        if started is not None:
            started(item)
        result = _build(item, out, compile, headers)
        if progress is not None:
            progress(result)
        return result

    if workers == 1:
        return [one(item) for item in prepared]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fagen-build") as pool:
        return list(pool.map(one, prepared))


# ---- one variant ---------------------------------------------------------------------------
def _build(item: Prepared, out_dir: Path, compile: bool, headers: Optional[dict] = None) -> BuildResult:
    """One variant into out_dir; `headers` (write_headers' result): the headers were written beside it."""
    start = time.perf_counter()
    spec, solution, rendered = item.spec, item.solution, item.rendered
    out_dir.mkdir(parents=True, exist_ok=True)
    name = spec.variant_name
    cu_path, json_path, cubin_path = (out_dir / f"{name}{ext}" for ext in (".cu", ".json", ".cubin"))
    result = BuildResult(spec, solution, rendered, files={"cu": cu_path, "json": json_path})
    if headers is not None:
        result.headers = [out_dir / name for name in needed_headers(rendered)]
        result.written += [path for path in result.headers if path in headers["written"]]

    source = rendered.text.encode()
    if write_if_changed(cu_path, source):
        result.written.append(cu_path)

    nvcc = _nvcc() if compile else None
    inputs = inputs_key(rendered, spec.arch)
    if not compile:
        result.skipped_reason = "--no-compile"
    elif not nvcc.nvcc_available():
        result.skipped_reason = "nvcc is not on PATH"
    key = inputs_key(rendered, spec.arch, compiler=_nvcc_version()) if result.skipped_reason is None else None

    record = _previous_compile(json_path, cubin_path, inputs, key)
    if record is not None:
        result.compiled, result.cached, result.compile_record = True, True, record
    elif key is not None:
        try:
            compiled = nvcc.compile_cubin(rendered.text, spec.arch, rendered.include_dir)
        except nvcc.CompileError as err:
            result.error = str(err).strip() or "nvcc failed without a message"
        else:
            if write_if_changed(cubin_path, compiled.cubin):
                result.written.append(cubin_path)
            result.compiled = True
            result.compile_record = {
                "arch": spec.arch,
                "cubin": cubin_path.name,
                "cubin_sha256": hashlib.sha256(compiled.cubin).hexdigest(),
                "inputs_key": inputs,
                "key": key,
                "command": [str(part) for part in compiled.command],
                "seconds": round(float(compiled.seconds), 3),
                "resources": compiled.resources,
            }
    if result.compiled:
        result.files["cubin"] = cubin_path
    elif cubin_path.exists():
        cubin_path.unlink()  # it was built from other inputs: a stale cubin beside a new .cu would be a lie

    report = describe(spec, solution, rendered, result.compile_record, standalone=headers is not None)
    if write_if_changed(json_path, (json.dumps(report, indent=2, sort_keys=False, default=_jsonable) + "\n").encode()):
        result.written.append(json_path)
    result.seconds = time.perf_counter() - start
    return result


def describe(spec: Spec, solution: "solver.Solution", rendered: "rendering.Rendered",
             compile_record: Optional[dict] = None, standalone: bool = False) -> dict:
    """The `<name>.json` beside each kernel: what was asked, what the solver chose and why, how to compile
    the `.cu` alone, what ptxas said."""
    solved = solution.to_dict()
    report = {
        "name": spec.variant_name,
        "template": solved.get("template", getattr(solution.primary, "template", None)),
        "spec": spec.to_dict(),
        "solution": solved,
        "paper_constraint": solved.get("constraint"),
        "source": {
            "file": rendered.filename,
            "templates": list(getattr(rendered, "templates", [])),
            "sha256": hashlib.sha256(rendered.text.encode()).hexdigest(),
            "kernels": rendered.kernels,
        },
    }
    if spec.modifiers.active:   # the expressions as parsed, and the backward's derivative sympy derived
        report["modifiers"] = spec.modifiers.record()
    if spec.kind_mask is not None:   # the mask kind as the expression its tests are generated from
        report["mask_expression"] = spec.kind_mask.mask_text
    report["compile_alone"] = compile_alone(spec, rendered, standalone)
    if compile_record is not None:
        report["compile"] = compile_record
    return report


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def needed_headers(rendered: "rendering.Rendered") -> list[str]:
    """The headers of the include folder that the source includes, directly or through each other, in order."""
    include_dir = Path(rendered.include_dir)
    found: list[str] = []
    pending = _QUOTED_INCLUDE.findall(rendered.text)
    while pending:
        name = pending.pop(0)
        path = include_dir / name
        if name in found or not path.is_file():
            continue
        found.append(name)
        pending += _QUOTED_INCLUDE.findall(path.read_text())
    return found


def nvcc_command(name: str, arch: str, include_dir: Optional[PathLike] = None) -> list[str]:
    """The nvcc command line that compiles `<name>.cu` to `<name>.cubin` in its folder, as fagen does
    (fagen/compiler.py compile_cubin): the arch nvcc builds for and fagen's options; `-I` unless the
    headers are beside the source (nvcc looks for quoted includes in the source's folder first)."""
    nvcc = _nvcc()
    include = [f"-I{include_dir}"] if include_dir is not None else []
    return ["nvcc", "-cubin", f"-arch={nvcc.nvcc_arch(arch)}", *nvcc.NVCC_OPTIONS, *include,
            "-o", f"{name}.cubin", f"{name}.cu"]


def compile_alone(spec: Spec, rendered: "rendering.Rendered", standalone: bool = False) -> dict:
    """What the `.cu` needs to compile by itself: the headers it includes, where they are (".": beside it,
    written by --standalone), and the nvcc command line to run in the output folder."""
    include_dir = None if standalone else Path(rendered.include_dir).resolve()
    command = nvcc_command(spec.variant_name, spec.arch, include_dir)
    return {"headers": needed_headers(rendered), "include_dir": "." if include_dir is None else str(include_dir),
            "command": command, "command_line": shlex.join(command)}


def write_headers(out_dir: PathLike, items: Iterable[Prepared]) -> dict:
    """Copy the headers the items' sources include into out_dir (only where their bytes differ):
    {"paths": every header's path there, "written": those whose bytes changed}."""
    out = Path(out_dir)
    names: dict[str, Path] = {}
    for item in items:
        for name in needed_headers(item.rendered):
            names.setdefault(name, Path(item.rendered.include_dir) / name)
    paths, written = [], []
    for name, source in names.items():
        target = out / name
        if write_if_changed(target, source.read_bytes()):
            written.append(target)
        paths.append(target)
    return {"paths": paths, "written": written}


# ---- files and the compile cache -----------------------------------------------------------
def write_if_changed(path: PathLike, data: bytes) -> bool:
    """Write `data` unless the file already holds exactly these bytes; True when it wrote.

    The bytes land in a temporary file that is renamed over the target, so a reader (or a
    parallel build) never sees half a file.
    """
    path = Path(path)
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def inputs_key(rendered: "rendering.Rendered", arch: str, compiler: str = "") -> str:
    """sha256 over what a cubin depends on: the source, the headers it may include, arch (and nvcc)."""
    digest = hashlib.sha256()
    digest.update(rendered.text.encode() + b"\0" + arch.encode() + b"\0" + compiler.encode() + b"\0")
    include_dir = Path(rendered.include_dir)
    headers = sorted(p for p in include_dir.rglob("*") if p.is_file() and p.suffix in (".cuh", ".h", ".hpp"))
    for header in headers:
        digest.update(str(header.relative_to(include_dir)).encode() + b"\0" + header.read_bytes() + b"\0")
    return digest.hexdigest()


def _previous_compile(json_path: Path, cubin_path: Path, inputs: str, key: Optional[str]) -> Optional[dict]:
    """The "compile" record of an earlier build of the same inputs, if its cubin is still intact.

    With a compiler at hand (`key`), the compiler's version must match too; without one (no nvcc,
    --no-compile) a cubin built from the same inputs is kept rather than thrown away.
    """
    try:
        record = json.loads(json_path.read_text()).get("compile")
        if not isinstance(record, dict) or record.get("inputs_key") != inputs:
            return None
        if key is not None and record.get("key") != key:
            return None
        if hashlib.sha256(cubin_path.read_bytes()).hexdigest() != record.get("cubin_sha256"):
            return None
        return record
    except (OSError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def _nvcc_version() -> str:
    try:
        nvcc = getattr(_nvcc(), "nvcc_path", lambda: "nvcc")() or "nvcc"
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _jsonable(value):
    """sympy numbers and numpy scalars that slip into a solution dict."""
    for cast in (int, float):
        try:
            number = cast(value)
            if number == value:
                return number
        except (TypeError, ValueError):
            pass
    return str(value)
