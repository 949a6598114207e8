"""Are the examples' cubins byte for byte the same as at git revision REV? `python -m dev.cubin_identity REV`.

Compiles every `generated/*.cu` of REV with REV's headers and of this tree with this tree's, for sm_90 (and sm_80
where the source does not need warpgroup MMA), and compares the cubins. nvcc keeps no line numbers in them, so a
change to comments alone leaves them identical: what shows that a comment-only template change needs no GPU run.
No GPU needed."""
import hashlib
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fagen.compiler import compile_cubin

ROOT = Path(__file__).resolve().parent.parent


def _cubin_digest(source: str, arch: str, include_dir: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        compile_cubin(source, arch, include_dir, out_path=path)
        return hashlib.sha256(path.read_bytes()).hexdigest()


def main(rev: str) -> int:
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "templates", "generated"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", old], input=archive, check=True)
        jobs = []
        for new in sorted((ROOT / "generated").glob("*.cu")):
            before = Path(old) / "generated" / new.name
            if not before.exists():
                continue
            text = new.read_text()
            for arch in ["sm_90"] + ([] if "warpgroup_mma.cuh" in text else ["sm_80"]):
                jobs.append((new.name, arch, before.read_text(), text))

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
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
