"""Autotuning results: the data the runtime reads. Which tile plan won on this GPU for this spec.

`fagen bench --autotune` (fagen/bench/autotune.py) measures candidates and stores the winner per (GPU, spec) in
`$FAGEN_CACHE_DIR/autotune.json`:

    {"version": 1,
     "entries": {"<GPU name>": {"<spec key>": {"variant": ..., "date": ..., "shape": {...},
                                               "passes": {"forward": {"family", "block_r", "block_c",
                                                                      "warps", "stages", "ms",
                                                                      "solver_ms", "timings": [...]}}}}}}

The spec key is `spec.canonical_json()` with the `name` left out (a name changes no kernel) and the
arch the device's, as `fagen.compile` sets it. `lookup(spec, gpu_name)` reads an entry and
`apply(solution, entry)` swaps its plans in (`solver.with_plan`), ignoring a plan that is no longer a
feasible candidate (templates and footprints change; a stale entry must never break a compile).

This module measures nothing and imports neither the benchmark nor the runtime: the runtime reads it
on a cache miss, the autotuner writes it.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from fagen import solver as solver_stage
from fagen.cache import AUTOTUNE_FILE as CACHE_FILE
from fagen.cache import cache_dir, trusted_file
from fagen.spec import Spec

CACHE_VERSION = 1
PLAN_FIELDS = ("family", "block_r", "block_c", "warps", "stages")


# ---- the cache file ---------------------------------------------------------------------------
def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def spec_key(spec: Spec) -> str:
    """The cache key of a spec: every field that shapes a kernel (all but `name`), canonically ordered."""
    data = spec.to_dict()
    data.pop("name", None)
    return json.dumps(data, sort_keys=True)


def load_cache(path: Optional[Path] = None) -> dict:
    """The whole cache file; an absent, unreadable or foreign file reads as empty (it is only a cache)."""
    path = Path(path) if path is not None else cache_path()
    distrust = trusted_file(path)
    if distrust:   # another user could have written it: its plans would be theirs to choose (docs/cache.md)
        warnings.warn(f"fagen: ignoring {path}: {distrust}", stacklevel=2)
        return {"version": CACHE_VERSION, "entries": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": CACHE_VERSION, "entries": {}}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {"version": CACHE_VERSION, "entries": {}}
    return data


def store(spec: Spec, gpu_name: str, entry: dict, path: Optional[Path] = None) -> Path:
    """Add or replace one (GPU, spec) entry; the file is replaced atomically (write, then rename). A cache
    that cannot be written costs the tuning result, with a warning, never the run."""
    path = Path(path) if path is not None else cache_path()
    data = load_cache(path)
    data["entries"].setdefault(gpu_name, {})[spec_key(spec)] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)   # as fagen/cache.py makes its folders
        fd, tmp = tempfile.mkstemp(prefix=".autotune-", suffix=".json", dir=str(path.parent))
    except OSError as err:
        warnings.warn(f"fagen: cannot store the autotune result in {path} ({err.strerror or err})", stacklevel=2)
        return path
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def lookup(spec: Spec, gpu_name: str, path: Optional[Path] = None) -> Optional[dict]:
    """The cached entry for (GPU, spec), or None."""
    entry = load_cache(path)["entries"].get(gpu_name, {}).get(spec_key(spec))
    return entry if isinstance(entry, dict) else None


def _matches(plan: "solver_stage.Plan", chosen: dict) -> bool:
    return all(chosen.get(name) is None or getattr(plan, name) == chosen[name] for name in PLAN_FIELDS) and \
        all(chosen.get(name) is not None for name in ("block_r", "block_c", "warps"))


def apply(solution: "solver_stage.Solution", entry: Optional[dict]) -> "solver_stage.Solution":
    """`solution` with each pass's plan replaced by the entry's winner where that is still a feasible
    candidate (same family, Br, Bc, warps, stages); passes the entry lacks or cannot match are kept."""
    if not entry:
        return solution
    for pass_name, chosen in (entry.get("passes") or {}).items():
        if pass_name not in solution.plans or not isinstance(chosen, dict):
            continue
        plan = next((c for c in solution.candidates.get(pass_name, ()) if _matches(c, chosen)), None)
        if plan is not None and plan != solution.plans[pass_name]:
            solution = solver_stage.with_plan(solution, pass_name, plan)
    return solution
