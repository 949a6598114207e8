"""Are the cubins byte for byte the same as at git revision REV?

    python -m dev.cubin_identity REV                     # every generated/*.cu
    python -m dev.cubin_identity REV SPECS.yaml ...      # ... and these specs, each rendered by each tree's fagen

Compiles each source of REV with REV's headers and of this tree with this tree's, for sm_90 (and sm_80 where the
source does not need warpgroup MMA; a spec for its own arch), and compares the cubins. nvcc keeps no line numbers in
them, so a change to comments alone leaves them identical, and so does moving code into a shared piece that compiles
to the same instructions: what shows that such a template change needs no GPU run. Spec files reach the templates
that no example uses. No GPU needed."""
import hashlib
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fagen.compiler import compile_cubin

ROOT = Path(__file__).resolve().parent.parent

# Run by each tree's Python: every pass's source of every spec, by (spec index, pass).
_RENDER = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from fagen.render import render
from fagen.solver import solve
from fagen.spec import Spec
from fagen.target import target_for
sources = {}
for n, fields in enumerate(json.loads(sys.argv[2])):
    spec = Spec(**fields)
    solution = solve(spec, target_for(spec.arch))
    for name, text in render(spec, solution).pass_texts.items():
        sources[f"{n} {spec.variant_name} {name} ({solution.plans[name].template})"] = [spec.arch, text]
print(json.dumps(sources))
'''


def _cubin_digest(source: str, arch: str, include_dir: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        compile_cubin(source, arch, include_dir, out_path=path)
        return hashlib.sha256(path.read_bytes()).hexdigest()


def _rendered(tree: Path, specs: list) -> dict:
    done = subprocess.run([sys.executable, "-c", _RENDER, str(tree), json.dumps(specs)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def main(rev: str, spec_files: list) -> int:
    from fagen.spec import load_specs

    specs = [json.loads(spec.canonical_json()) for path in spec_files for spec in load_specs(path)]
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "templates", "generated", "fagen"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", old], input=archive, check=True)
        jobs = []   # (name, arch, REV's source, this tree's source)
        for new in sorted((ROOT / "generated").glob("*.cu")):
            before = Path(old) / "generated" / new.name
            if not before.exists():
                continue
            text = new.read_text()
            for arch in ["sm_90"] + ([] if "warpgroup_mma.cuh" in text else ["sm_80"]):
                jobs.append((new.name, arch, before.read_text(), text))
        if specs:
            before, after = _rendered(Path(old), specs), _rendered(ROOT, specs)
            jobs += [(name, arch, before[name][1], text) for name, (arch, text) in after.items() if name in before]

        def compare(job):
            name, arch, before, after = job
            same = (_cubin_digest(before, arch, Path(old) / "templates")
                    == _cubin_digest(after, arch, ROOT / "templates"))
            return name, arch, same

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(compare, jobs))
    for name, arch, same in results:
        if not same:
            print(f"differs: {name} ({arch})")
    print(f"{sum(same for *_, same in results)} of {len(results)} cubins identical to {rev}'s")
    return 0 if all(same for *_, same in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD", sys.argv[2:]))
