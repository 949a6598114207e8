"""`python -m fagen.bench extras`: the numbers BENCHMARKS.md gives besides the timings (GPU): cold
compile and cache-load time, the GPU's bf16 GEMM rate, and ptxas's resources for a variant's kernels.
"""
from __future__ import annotations

import json as json_module
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fagen.bench.timing import DEVICE, time_cuda
from fagen.spec import Spec


_COMPILE_PROBE = r"""
import json, sys, time
from fagen import jit, runtime
from fagen.spec import spec_from_dict
spec = spec_from_dict(json.loads(sys.argv[1]))
runtime.ensure_context()  # CUDA context creation is not compile time
start = time.perf_counter()
kernel = jit.compile(spec)
seconds = time.perf_counter() - start
print("FAGEN_PROBE " + json.dumps({"seconds": seconds, "kernel": repr(kernel)}))
"""


def _probe_compile(spec: Spec, cache: str, timeout: float) -> dict:
    """jit.compile(spec) in a fresh Python process with FAGEN_CACHE_DIR=cache, timed inside it."""
    package_root = str(Path(__file__).resolve().parents[2])   # the folder holding the fagen package
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
    Both are timed inside the process around fagen.compile, after the CUDA context exists."""
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
    from fagen import build, jit
    from fagen.bench import autotune as autotuner
    from fagen.compiler import compile_cubin

    kernel = autotuner.compile_tuned(spec)
    rendered = build.prepare(kernel.spec, solution=jit.solution(kernel)).rendered
    compiled = compile_cubin(rendered.text, kernel.target.arch, rendered.include_dir)
    return {"variant": spec.variant_name, "arch": kernel.target.arch, "plans": kernel.record["plans"],
            "kernels": {p: {name: compiled.resources.get(name, {}) for name in names}
                        for p, names in rendered.kernels.items()}}
