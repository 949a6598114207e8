"""The pipeline's layering: no stage imports a later one (issue 57).

spec <- plan <- codegen <- build; the runtime depends only on the spec layer (it loads what the build made); the
float64 reference (the test oracle) depends on the spec layer and only the API and the tools import it; the API
(fagen, fagen.jit, fagen.torch and its pad_rows, fagen.testing, fagen.distributed, the integrations) imports any stage; the tools (the CLI,
the benchmarks, the autotuner) import anything, and nothing imports them. Every fagen module's imports are read
from its source (top-level and inside functions alike).

KNOWN lists today's exceptions: the test fails on any other, and on a listed one that is gone (take it off the
list, so that it only ever shrinks)."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fagen"

LAYERS = {
    "spec": {"fagen.spec", "fagen.expressions", "fagen.target", "fagen.dropout", "fagen.cache", "fagen.artifact", "fagen.__version__"},
    "plan": {"fagen.solver", "fagen.tuning"},
    "codegen": {"fagen.render", "fagen.sources"},
    "build": {"fagen.build", "fagen.compiler"},
    "runtime": {"fagen.runtime", "fagen.cuda_driver"},
    "oracle": {"fagen.reference"},
    "api": {"fagen", "fagen.jit", "fagen.torch", "fagen.pad_rows", "fagen.testing", "fagen.distributed", "fagen.integrations",
            "fagen.integrations.transformers"},
    "tools": {"fagen.cli", "fagen.bench"},
}
ORDER = ("spec", "plan", "codegen", "build")

#: (importer, imported) pairs that break the rules today, each with what removes it.
KNOWN: set = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set:
    """The fagen modules a source file imports: `from fagen import x` is module fagen.x where x is one, the
    package fagen otherwise (fagen.__version__ stands for itself)."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "fagen"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "fagen":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules or full == "fagen.__version__":
                    found.add(full)
                else:
                    found.add(node.module)
    return found


def _layer(module: str) -> str:
    for name, members in LAYERS.items():
        if module in members or any(module.startswith(m + ".") for m in members if m != "fagen"):
            return name
    raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add it to LAYERS")


def _group(module: str) -> str:
    """What a KNOWN pair names: the module, or its package for the benchmarks' modules."""
    return "fagen.bench" if module.startswith("fagen.bench") else module


def _allowed(importer: str, imported: str) -> bool:
    a, b = _layer(importer), _layer(imported)
    if a == b == "tools":   # the CLI runs the other tools; the benchmarks and the autotuner stay apart
        return importer == "fagen.cli" or _group(importer) == _group(imported)
    if a == b:
        return True
    if b == "tools":
        return False
    if b == "oracle":
        return a in ("api", "tools")
    if a == "runtime":
        return b == "spec"
    if a == "oracle":
        return b == "spec"
    if a in ("api", "tools"):
        return True
    if b in ("runtime", "api"):
        return False
    return ORDER.index(b) <= ORDER.index(a)


def _violations() -> set:
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for imported in _imports(path):
            if imported != importer and not _allowed(importer, imported):
                found.add((_group(importer), _group(imported)))
    return found


def test_every_module_is_in_a_layer():
    for path in PACKAGE.rglob("*.py"):
        _layer(_module_name(path))


def test_no_stage_imports_a_later_one():
    found = _violations()
    new, gone = found - KNOWN, KNOWN - found
    assert not new, f"imports against the layering (LAYERS in tests/test_layering.py): {sorted(new)}"
    assert not gone, f"no longer there, take them off KNOWN: {sorted(gone)}"


@pytest.mark.parametrize("importer,imported,allowed", [
    ("fagen.render", "fagen.reference", False),     # the renderer must not read the test oracle
    ("fagen.render", "fagen.dropout", True),
    ("fagen.target", "fagen.cuda_driver", False),   # the arch facts never touch the driver
    ("fagen.solver", "fagen.render", False),
    ("fagen.build", "fagen.render", True),
    ("fagen.runtime", "fagen.spec", True),
    ("fagen.torch", "fagen.runtime", True),
    ("fagen.spec", "fagen.cli", False),
    ("fagen.testing", "fagen.reference", True),
    ("fagen.cli", "fagen.bench.report", True),
])
def test_the_rules_themselves(importer, imported, allowed):
    assert _allowed(importer, imported) is allowed
