"""`fagen.compile(spec)`: a variant built for the GPU in this process, at run time, and loaded.

The two stages, joined: fagen/build.py makes the artifact (from the disk plan cache, or solved, rendered and
compiled into it), fagen/runtime/ loads it into a `Kernel` and launches. The target is read off the device, and
its arch replaces the spec's. Kernels are kept in memory for the process, artifacts on disk (FAGEN_CACHE_DIR,
default ~/.cache/fagen) across processes: a spec built before, by any process, loads from its JSON record and
cubins without importing sympy or Jinja.
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from fagen import build
from fagen.runtime import Kernel, _default_device, device_target
from fagen.spec import ARCHS, Spec, spec_from_dict
from fagen.target import Target

_kernels: dict[tuple, Kernel] = {}
_lock = threading.RLock()


def device_spec(spec, device: int) -> tuple[Spec, Target]:
    """`spec` (a Spec or a dict) for the GPU `device`: its arch the device's; and that device's target."""
    spec = spec if isinstance(spec, Spec) else spec_from_dict(spec)
    target = device_target(device)
    if target.arch in ARCHS and spec.arch != target.arch:
        spec = spec.model_copy(update={"arch": target.arch})
    return spec, target


def compile(spec, *, policy: Optional[str] = None, device: Optional[int] = None) -> Kernel:
    """The Kernel of `spec` (a Spec or a dict) on the GPU `device` (default: the current one)."""
    device_index = _default_device() if device is None else device
    spec, target = device_spec(spec, device_index)
    key = (spec.canonical_json(), policy, device_index)
    kernel = _kernels.get(key)
    if kernel is None:
        with _lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _kernels[key] = Kernel(spec, target, build.artifact(spec, target, policy), device=device_index)
    return kernel


def kernel_for(spec: Spec, target: Target, solution, *, device: Optional[int] = None) -> Kernel:
    """A Kernel of a plan chosen by the caller (the autotuner's candidates, tests of a given family): rendered and
    compiled (cubins cached on disk), not kept in memory."""
    return Kernel(spec, target, build.compile_prepared(build.prepare(spec, solution=solution), target.arch), device=device)


def solution(kernel: Kernel):
    """The solver's Solution with `kernel`'s plans (its record's) in it, imports sympy: for the tools that need
    more than Kernel.plans (candidates, rendering the source again)."""
    from fagen.solver import Plan

    solved = build.solve(kernel.spec, kernel.target, kernel.record["policy"])
    return dataclasses.replace(solved, plans={p: Plan(**plan) for p, plan in kernel.record["plans"].items()})


def precompile(specs, jobs: int = 8) -> None:
    """Build many specs' artifacts into the disk cache in parallel (nvcc in threads; no context needed), so that
    later `compile(spec)` calls only load."""
    device = _default_device()

    def one(spec):
        build.artifact(*device_spec(spec, device), None)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, specs))
