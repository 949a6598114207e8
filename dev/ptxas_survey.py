"""ptxas's registers and spills for the default plans over a grid of head dims and masks, on this machine's nvcc
(no GPU needed): `python -m dev.ptxas_survey sm_80 --head-dims 32,64,128 --masks none,causal [--dropout 0.1]`.
Prints the main kernels (not the row passes), spilling ones marked; what docs/benchmarks-journal.md's sm_80 spill survey ran."""
import argparse
import itertools
from concurrent.futures import ThreadPoolExecutor

from fagen.build import prepare
from fagen.compiler import compile_cubin
from fagen.runtime.grids import _HELPER_KERNELS
from fagen.spec import Spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch")
    parser.add_argument("--head-dims", default="16,32,48,64,80,96,112,128,160,192,256")
    parser.add_argument("--masks", default="none,causal")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--layout", default="padded", choices=("padded", "packed"))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    specs = [Spec(head_dim=d, mask=mask, dtype=dtype, dropout=args.dropout, layout=args.layout)
             for d, mask, dtype in itertools.product([int(x) for x in args.head_dims.split(",")],
                                                     args.masks.split(","), args.dtypes.split(","))]

    def compiled(spec):
        prepared = prepare(spec, args.arch)
        return spec, compile_cubin(prepared.rendered.text, args.arch, prepared.rendered.include_dir)

    total = spilling = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for spec, result in pool.map(compiled, specs):
            for kernel, res in result.resources.items():
                if kernel.endswith(_HELPER_KERNELS):
                    continue
                stores, loads = res["spill_stores"], res["spill_loads"]
                total += stores
                spilling += bool(stores or loads)
                print(f"{args.arch} {spec.canonical_name}: {kernel} {res['registers']} registers, spills {stores} / {loads} B"
                      + ("  SPILL" if stores or loads else ""), flush=True)
    print(f"{spilling} kernels spill, {total} B of spill stores in all")


if __name__ == "__main__":
    main()
