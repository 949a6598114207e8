"""Device probe for the runtime (issue 10): host overhead per call against SDPA, load times of a
cached spec (warm process, new process), cold compile of d=128, and fwd+bwd through autograd on
real shapes. Prints a short table; `--json F` writes the numbers.

    python dev/gpu/runtime_probe.py --json $OUT/runtime_probe.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen
import fagen.torch as fagen_torch
from fagen import jit


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def overhead_rows() -> list[dict]:
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="causal")
    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    fagen.attention(q, k, v, spec)

    def fwd_fagen():
        with torch.no_grad():
            fagen.attention(q, k, v, spec)

    def fwd_sdpa():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both_fagen():
        fagen.attention(q, k, v, spec).backward(grad)

    def both_sdpa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    rows = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for label, fast in (("fagen (eager fast path)", True), ("fagen (custom ops)", False)):
            fagen_torch.EAGER_FAST_PATH = fast
            rows.append({"what": label, "forward_us": per_call_us(fwd_fagen), "fwd_bwd_us": per_call_us(both_fagen, 500)})
        fagen_torch.EAGER_FAST_PATH = True
        rows.append({"what": "SDPA-flash", "forward_us": per_call_us(fwd_sdpa), "fwd_bwd_us": per_call_us(both_sdpa, 500)})
    kernel = fagen.compile(spec)
    rows.append({"what": "Kernel.forward direct", "forward_us": per_call_us(lambda: kernel.forward(q.detach(), k.detach(), v.detach())),
                 "fwd_bwd_us": None})
    return rows


_NEW_PROCESS = r"""
import json, sys, time
import torch
torch.zeros(1, device="cuda")   # CUDA context: paid by any GPU program, not part of a load
start = time.perf_counter()
import fagen
from fagen import jit, runtime
imported = time.perf_counter()
stages = {}
if sys.argv[2] == "cold":   # where a cold compile's time goes (these imports are part of it anyway)
    from fagen import compiler, solver
    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                stages[name] = stages.get(name, 0) + time.perf_counter() - t
        return wrapper
    solver.solve = timed("solve_s", solver.solve)
    compiler._compile_at_run_time = timed("nvcc_s_summed_over_passes", compiler._compile_at_run_time)
kernel = jit.compile(fagen.Spec(**json.loads(sys.argv[1])), device=0)
done = time.perf_counter()
import importlib.util, os, pydantic
print("PROBE", json.dumps({"seconds": done - start, "import_ms": (imported - start) * 1e3, "stages": stages,
                           "sympy": "sympy" in sys.modules, "dont_write_bytecode": sys.flags.dont_write_bytecode,
                           "pydantic_bytecode": os.path.exists(importlib.util.cache_from_source(pydantic.__file__))}))
"""


def load_rows() -> dict:
    fields = {"head_dim": 128, "dtype": "bf16", "mask": "causal"}
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FAGEN_CACHE_DIR=cache)
        def probe(kind="warm"):
            done = subprocess.run([sys.executable, "-c", _NEW_PROCESS, json.dumps(fields), kind], env=env,
                                  capture_output=True, text=True, timeout=300)
            line = next(l for l in done.stdout.splitlines() if l.startswith("PROBE"))
            return json.loads(line[6:])
        cold = probe("cold")
        out["cold_compile_d128_fwd_bwd_s"] = cold["seconds"]
        out["cold_compile_stages"] = cold["stages"]
        new = [probe() for _ in range(3)]
        out["new_process_load_ms"] = min(p["seconds"] for p in new) * 1e3
        out["new_process_import_fagen_ms"] = min(p["import_ms"] for p in new)
        out["new_process_imported_sympy"] = any(p["sympy"] for p in new)
        out["new_process_had_bytecode"] = new[-1]["pydantic_bytecode"]
        out["new_process_dont_write_bytecode"] = new[-1]["dont_write_bytecode"]
        # As `pip install` leaves an environment: bytecode compiled for fagen and the packages it imports
        # (the device machine's wheels are installed with --no-compile, and PYTHONDONTWRITEBYTECODE may be
        # set, which makes every new process compile pydantic's and fagen's sources again).
        import compileall, pydantic
        for package in (Path(fagen.__file__).parent, Path(pydantic.__file__).parent.parent):
            compileall.compile_dir(str(package), quiet=2, workers=0)
        compiled = [probe() for _ in range(3)]
        out["new_process_load_ms_bytecode"] = min(p["seconds"] for p in compiled) * 1e3
        out["new_process_import_fagen_ms_bytecode"] = min(p["import_ms"] for p in compiled)
        saved = os.environ.get("FAGEN_CACHE_DIR")
        os.environ["FAGEN_CACHE_DIR"] = cache
        try:
            spec = fagen.Spec(**fields)
            # The first load of this process also pays its first CUDA driver use (context, first module load):
            # reported on its own. A warm process is one that has used fagen before: the later loads, each
            # from the disk cache again (the in-memory kernel cache emptied in between).
            loads = []
            for _ in range(4):
                jit._kernels.clear()
                start = time.perf_counter()
                jit.compile(spec)
                loads.append((time.perf_counter() - start) * 1e3)
            out["first_load_in_process_ms"] = loads[0]
            out["warm_process_load_ms"] = min(loads[1:])
            start = time.perf_counter()
            jit.compile(spec)
            out["in_memory_compile_call_us"] = (time.perf_counter() - start) * 1e6
        finally:
            if saved is None:
                os.environ.pop("FAGEN_CACHE_DIR")
            else:
                os.environ["FAGEN_CACHE_DIR"] = saved
    return out


def real_shape_rows() -> list[dict]:
    rows = []
    for d, n, batch in ((64, 4096, 4), (128, 4096, 4), (128, 1024, 16)):
        heads = 2048 // d
        for causal in (False, True):
            spec = fagen.Spec(head_dim=d, dtype="bf16", mask="causal" if causal else "none")
            q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn_like(q)
            import triton.testing as tt
            def f_fagen():
                fagen.attention(q, k, v, spec).backward(grad)
            def f_sdpa():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)
            f_fagen()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms_sdpa = tt.do_bench(f_sdpa, warmup=25, rep=100, return_mode="median")
            ms_fagen = tt.do_bench(f_fagen, warmup=25, rep=100, return_mode="median")
            rows.append({"shape": f"B{batch} H{heads} N{n} d{d}{' causal' if causal else ''}", "fagen_ms": ms_fagen,
                         "sdpa_flash_ms": ms_sdpa, "speedup": ms_sdpa / ms_fagen})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="+", choices=("overhead", "load", "autograd"),
                        default=("overhead", "load", "autograd"), help="which parts to run (default: all)")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["overhead"] = overhead_rows() if "overhead" in args.only else []
    result["load"] = load_rows() if "load" in args.only else {}
    result["fwd_bwd_autograd"] = real_shape_rows() if "autograd" in args.only else []
    for row in result["overhead"]:
        print(f"{row['what']:28s} forward {row['forward_us']:8.1f} us   fwd+bwd "
              f"{row['fwd_bwd_us'] if row['fwd_bwd_us'] is None else round(row['fwd_bwd_us'], 1)} us")
    print(json.dumps(result["load"]))
    for row in result["fwd_bwd_autograd"]:
        print(f"{row['shape']:28s} fagen {row['fagen_ms']:.3f} ms  SDPA-flash {row['sdpa_flash_ms']:.3f} ms  x{row['speedup']:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
