"""Stage 4: compilation.

Two routes, one source: `compile_cubin` runs nvcc to a .cubin and parses ptxas's resource report
(for `fagen build`, no GPU needed); `cached_cubin` compiles at run time with PyCUDA's compiler
driver, cached on disk (fagen/cache.py) keyed by the source, the headers, the arch and the options,
so a second process loads without recompiling; the launch stage loads the bytes itself.
This is the only module that imports pycuda's compiler, and only inside the function that needs it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fagen.cache import CACHE_ENV, DiskCache, cache_dir, digest  # noqa: F401 (cache_dir, CACHE_ENV: re-exported)
from fagen.target import arch_features

# -diag-suppress=177: nvcc's remark on a constant declared and never used. Every kernel includes the spec's whole
# constants block (templates/spec_constants.cu.j2) and reads only what it needs; the remark changes no machine code.
NVCC_OPTIONS = ("-O3", "-std=c++17", "--use_fast_math", "-diag-suppress=177")


def nvcc_arch(arch: str) -> str:
    """The architecture nvcc builds for (fagen/target.py ARCH_FEATURES): sm_90 targets compile as sm_90a, Hopper's
    arch-specific profile, so that the wgmma templates can use warpgroup MMA (the cubin runs on H100/H200 only,
    which is every sm_90 part); every other arch as named."""
    return arch_features(arch).nvcc_arch


class CompileError(RuntimeError):
    """nvcc rejected a source; str() is nvcc's own message."""


@dataclass
class CompileResult:
    cubin: bytes
    resources: dict[str, dict]
    command: list[str]
    seconds: float
    log: str = field(repr=False, default="")


def nvcc_path() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_ROOT") or "/usr/local/cuda"
    candidate = Path(cuda_home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def nvcc_available() -> bool:
    return nvcc_path() is not None


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES_FOR = re.compile(r"Function properties for (\S+)")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_report(log: str) -> dict[str, dict]:
    """ptxas -v output -> {kernel: {registers, smem_bytes (static), spill_stores, spill_loads, stack_bytes}}."""
    report: dict[str, dict] = {}
    current = properties_of = None
    for line in log.splitlines():
        if (m := _ENTRY.search(line)):
            current = m.group(1)
            report[current] = {"registers": 0, "smem_bytes": 0, "spill_stores": 0, "spill_loads": 0, "stack_bytes": 0}
        elif (m := _PROPERTIES_FOR.search(line)):
            properties_of = m.group(1)  # may name a non-entry (__noinline__) function: not a kernel's numbers
        elif current and properties_of == current and (m := _PROPS.search(line)):
            report[current].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current and (m := _USED.search(line)):
            report[current]["registers"] = int(m.group(1))
            report[current]["smem_bytes"] = int(m.group(2) or 0)
    return report


def compile_cubin(source: str, arch: str, include_dir: Path, out_path: Optional[Path] = None,
                  timeout: float = 600.0) -> CompileResult:
    nvcc = nvcc_path()
    if nvcc is None:
        raise CompileError("nvcc was not found on PATH (or under $CUDA_HOME/bin)")
    with tempfile.TemporaryDirectory(prefix="fagen-") as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cubin = Path(tmp) / "kernel.cubin"
        command = [nvcc, "-cubin", f"-arch={nvcc_arch(arch)}", *NVCC_OPTIONS, f"-I{include_dir}", "-Xptxas", "-v",
                   "-o", str(cubin), str(src)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CompileError(f"nvcc took longer than {timeout:.0f} s") from None
        seconds = time.perf_counter() - start
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            errors = [line for line in log.splitlines() if "error" in line.lower()]
            raise CompileError("\n".join(errors[:20]) or log.strip()[-2000:])
        data = cubin.read_bytes()
    if out_path is not None:
        Path(out_path).write_bytes(data)
    return CompileResult(data, parse_ptxas_report(log), command, seconds, log)


def header_digest(include_dir: Path) -> str:
    """The bytes of every header a template may include: a changed header is a changed kernel."""
    parts = []
    for header in sorted(Path(include_dir).glob("*.cuh")):
        parts += [header.name, header.read_bytes()]
    return digest(*parts)


def cubin_key(source: str, arch: str, include_dir: Path) -> str:
    """What a compiled module depends on: the source, the headers, the target and the options."""
    return digest("cubin-v1", source, header_digest(include_dir), nvcc_arch(arch), *NVCC_OPTIONS)


def _compile_at_run_time(source: str, arch: str, include_dir: Path) -> bytes:
    """PyCUDA's compiler driver where it is installed (the GPU extra), plain nvcc otherwise."""
    try:
        from pycuda.compiler import compile as pycuda_compile  # lazy: GPU machines only
    except ImportError:
        return compile_cubin(source, arch, include_dir).cubin
    try:
        return pycuda_compile(source, arch=nvcc_arch(arch), options=list(NVCC_OPTIONS), include_dirs=[str(include_dir)],
                              no_extern_c=True, cache_dir=False)
    except Exception as err:  # pycuda.driver.CompileError carries nvcc's stderr
        raise CompileError(getattr(err, "stderr", "") or str(err)) from None


def cached_cubin(source: str, arch: str, include_dir: Path, key: Optional[str] = None) -> bytes:
    """The cubin of `source`, from the disk cache or compiled once (across threads and processes)
    and stored. Needs no CUDA context, so it is safe in worker threads."""
    key = key or cubin_key(source, arch, include_dir)
    return DiskCache().get_or_build("cubin", key, lambda: _compile_at_run_time(source, arch, include_dir))
