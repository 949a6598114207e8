"""fagen: a kernel-generation DSL for FlashAttention.

    spec (YAML / Python) -> solve (sympy) -> render (Jinja) -> compile (nvcc / PyCUDA) -> launch

`import fagen` is cheap and CPU-only: the spec is imported eagerly, everything that needs a GPU
(pycuda, torch) only when first used through `fagen.compile(...)` or `fagen.attention(...)`.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from fagen.spec import Spec, SpecError, load_specs

__version__ = "0.1.0"
__all__ = ["Spec", "SpecError", "load_specs", "compile", "attention", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import fagen` never imports pycuda or torch. Kept in the module's namespace once found:
    # this hook runs on every lookup that misses it, and torch.compile's guards look `fagen.attention` up
    # at every call of a compiled function (an import_module per call, about 3 us).
    if name == "compile":
        value = import_module(f"{__name__}.jit").compile
    elif name == "attention":
        value = import_module(f"{__name__}.torch").attention
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
