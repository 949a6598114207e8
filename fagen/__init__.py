"""fagen: a kernel-generation DSL for FlashAttention.

    spec (YAML / Python) -> solve (sympy) -> render (Jinja) -> compile (nvcc / PyCUDA) -> launch

`import fagen` is cheap and CPU-only: the spec is imported eagerly, everything that needs a GPU
(pycuda, torch) only when first used through `fagen.compile(...)` or `fagen.attention(...)`.
"""
from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any

from fagen.spec import Spec, SpecError, load_specs

__version__ = "0.1.0"
__all__ = ["Spec", "SpecError", "load_specs", "compile", "attention", "__version__"]


class _CallableCompileStage(types.ModuleType):
    """The compile stage module `fagen.compile`, which is also the user's `fagen.compile(spec)`.

    `fagen/compile.py` (nvcc, PyCUDA) and the public function `fagen.compile(spec)` share a name,
    and importing a submodule rebinds the package attribute to the module. Rather than let the
    function disappear whenever some module imports the stage, the module itself answers calls.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from fagen.runtime import compile as compile_spec

        return compile_spec(*args, **kwargs)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "compile" and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.compile":
            value.__class__ = _CallableCompileStage
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    # Lazy, so that `import fagen` never imports pycuda or torch.
    if name == "compile":
        return import_module(f"{__name__}.compile")  # bound (and made callable) by _Package.__setattr__
    if name == "attention":
        return import_module(f"{__name__}.torch").attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
