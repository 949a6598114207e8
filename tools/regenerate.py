#!/usr/bin/env python3
"""Re-render `generated/<variant>.cu` for every variant of `examples/*.yaml`, and templates/shared_constants.cuh.

    python tools/regenerate.py           # rewrite what changed, delete what no example produces
    python tools/regenerate.py --check   # write nothing; exit 1 if generated/ is out of date

Each file is `fagen.render.render(spec, fagen.solver.solve(spec)).text`, the same bytes `fagen build`
writes, and is written only when its bytes change (unchanged files keep their mtimes).
tests/test_render.py fails whenever these files differ from a fresh render.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without `pip install -e .`

from fagen.build import write_if_changed  # noqa: E402
from fagen.render import SHARED_HEADER, render, shared_constants_header  # noqa: E402
from fagen.solver import solve  # noqa: E402
from fagen.spec import load_specs  # noqa: E402

EXAMPLES = ROOT / "examples"
GENERATED = ROOT / "generated"


def expected_sources() -> dict[str, bytes]:
    """file name -> bytes, for every variant of every example, in file order."""
    sources: dict[str, bytes] = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for spec in load_specs(path):
            rendered = render(spec, solve(spec))
            if rendered.filename in sources:
                raise SystemExit(f"{path}: variant {spec.variant_name} is also defined by another example")
            sources[rendered.filename] = rendered.text.encode()
    return sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is out of date")
    args = parser.parse_args(argv)

    sources = expected_sources()
    stale = sorted(p for p in GENERATED.glob("*.cu") if p.name not in sources) if GENERATED.is_dir() else []
    changed = []
    header, header_data = ROOT / "templates" / SHARED_HEADER, shared_constants_header().encode()
    if args.check:
        if not header.is_file() or header.read_bytes() != header_data:
            changed.append(header)
    elif write_if_changed(header, header_data):
        changed.append(header)
    for name, data in sources.items():
        path = GENERATED / name
        if args.check:
            if not path.is_file() or path.read_bytes() != data:
                changed.append(path)
        elif write_if_changed(path, data):
            changed.append(path)
    for path in stale:
        if not args.check:
            path.unlink()
    for path in changed:
        print(f"{'out of date' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{'not produced by any example' if args.check else 'removed'}: {path.relative_to(ROOT)}")
    if not changed and not stale:
        print(f"generated/ is up to date ({len(sources)} files)")
    return 1 if args.check and (changed or stale) else 0


if __name__ == "__main__":
    sys.exit(main())
