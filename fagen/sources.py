"""Where fagen's kernel sources live, which of them fold grouped KV heads, and the fingerprint of everything that
shapes a kernel.

The run-time plan cache (fagen/build.py artifact) stores a solved, rendered and compiled spec under a key
that includes this fingerprint: change a template, the solver or the renderer and every cached plan
is solved again, without anyone having to clear a cache by hand.
"""
from __future__ import annotations

import functools
from pathlib import Path

from fagen import __version__
from fagen.cache import digest

PACKAGE_TEMPLATES = Path(__file__).resolve().parent / "templates"   # an installed wheel
SOURCE_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"  # a source checkout
TEMPLATE_DIR = PACKAGE_TEMPLATES if PACKAGE_TEMPLATES.is_dir() else SOURCE_TEMPLATES

#: The backward templates that can fold grouped KV heads: a block walks each query head of its K/V head's group,
#: summing dK, dV in registers (no per-query-head workspace, no _kv_group_sum pass; their FOLDS_HEADS). Read by the
#: renderer (which builds the walk in) and the runtime (which decides, per call, whether to launch it so).
FOLDING_TEMPLATES = ("backward_wgmma_ws.cu.j2",)


def folds_kv_group(spec, plan) -> bool:
    """Whether the kernel of `plan` (a backward's solver Plan or runtime LaunchPlan: its template) is built to walk
    a K/V head's group of query heads (FOLDS_HEADS): a folding template and a spec whose attention depends on the
    query head through its rows alone (Spec.kv_group_foldable). With a mask_mod on 128-row blocks (d <= 64) the
    consumers' head loop costs a few spilled bytes (ptxas, sm_90a, d = 64: documents 8 B, dilated 4 B, prefix-LM and
    window + sinks none), and the folded backward is still 10-26% faster at 32/8 and 16/4 heads, the same kernel
    unfolded (MHA, or grids too small to fold) 0-1.5% slower (docs/benchmarks-journal.md "Grouped KV heads folded with a mask_mod
    at d = 64")."""
    return plan.template in FOLDING_TEMPLATES and spec.kv_group_foldable


#: The Python stages whose code decides what a cached plan holds (tiles, sources, launch geometry); a folder stands
#: for its .py files (expressions/: the mask_mod / score_mod code, and what decides folds_kv_group).
_PLAN_MODULES = ("spec.py", "target.py", "solver.py", "render.py", "reference.py", "dropout.py", "tuning.py",
                 "sources.py", "expressions/")


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """A digest of the templates and the plan-making modules (read once per process, ~1 ms)."""
    here = Path(__file__).resolve().parent
    parts: list = [__version__]
    for path in sorted(TEMPLATE_DIR.iterdir()):
        if path.is_file():
            parts += [path.name, path.read_bytes()]
    for name in _PLAN_MODULES:
        paths = sorted((here / name).glob("*.py")) if name.endswith("/") else [here / name]
        for path in paths:
            parts += [str(path.relative_to(here)), path.read_bytes()]
    return digest(*parts)
