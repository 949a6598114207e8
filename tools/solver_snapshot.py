"""Dump the solver's answers over a broad grid of specs, one JSON line per case, so that a change to
fagen/solver.py can be checked byte for byte against the answers before it:

    python tools/solver_snapshot.py before.jsonl      # on the old solver
    python tools/solver_snapshot.py after.jsonl       # on the new one
    cmp before.jsonl after.jsonl

A case is (spec, target, policy). Each line holds `Solution.to_dict()` plus every ranked candidate of
every pass (to_dict keeps only eight), or the message of the error the solve raised. The grid covers
every example and benchmark spec on every target and policy, every head dim with every dtype, mask,
loop order and target, and a seeded sample of the remaining fields (budgets, dropout, passes,
deterministic, the paper policy).
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fagen.solver import solve  # noqa: E402
from fagen.spec import DTYPES, LOOP_ORDERS, MASKS, Spec, SpecError, load_specs  # noqa: E402
from fagen.target import TARGETS  # noqa: E402

HEAD_DIMS = range(32, 257, 8)
BUDGETS = (None, 4096, "16KiB", "48KiB", "64KiB", "96KB", "100KiB", "163KiB", "227KiB", 300_000)
POLICIES = (None, "auto", "paper")
PASS_SETS = (("forward", "backward"), ("forward",), ("backward",))


def _mask_fields(mask: str, rng: random.Random) -> dict:
    if mask == "sliding_window":
        return {"window": rng.choice((1, 128, 256, 4096))}
    if mask == "block_sparse":
        return {"block_size": rng.choice((16, 32, 64, 128, 256))}
    return {}


def cases():
    """(label, spec fields, arch of the target, policy) in a fixed order."""
    for path in sorted(itertools.chain((ROOT / "examples").glob("*.yaml"), (ROOT / "benchmarks").glob("*.yaml"))):
        for spec in load_specs(path):
            for arch, policy in itertools.product(TARGETS, POLICIES):
                yield path.name, spec.model_dump(exclude_none=True), arch, policy
    # Every head dim x dtype x mask x loop order on two targets, default budget and policy.
    rng = random.Random(0)
    for head_dim, dtype, mask, loop_order, arch in itertools.product(
            HEAD_DIMS, DTYPES, MASKS, LOOP_ORDERS, ("sm_80", "sm_90")):
        fields = {"head_dim": head_dim, "dtype": dtype, "mask": mask, "loop_order": loop_order, "arch": arch,
                  **_mask_fields(mask, rng)}
        yield "grid", fields, arch, None
    # Every head dim x dtype x loop order x target, twice, with the other fields drawn (seeded).
    for head_dim, dtype, loop_order, arch in itertools.product(HEAD_DIMS, DTYPES, LOOP_ORDERS, TARGETS):
        for _ in range(2):
            mask = rng.choice(MASKS)
            passes = rng.choice(PASS_SETS)
            fields = {"head_dim": head_dim, "dtype": dtype, "mask": mask, "loop_order": loop_order,
                      "arch": rng.choice(tuple(TARGETS)), "passes": passes, "sram_budget": rng.choice(BUDGETS),
                      "dropout": rng.choice((0.0, 0.0, 0.1, 0.5)), "tile_policy": rng.choice(("auto", "paper")),
                      **_mask_fields(mask, rng)}
            if "backward" in passes:
                fields["deterministic"] = rng.random() < 0.3
            fields = {k: v for k, v in fields.items() if v is not None}
            yield "sampled", fields, arch, rng.choice(POLICIES)
    # A policy the solver must refuse.
    yield "bad-policy", {"head_dim": 64}, "sm_90", "fastest"


def run(case) -> str:
    label, fields, arch, policy = case
    record = {"case": label, "fields": fields, "target": arch, "policy": policy}
    try:
        spec = Spec(**fields)
    except (SpecError, ValueError) as error:
        record["spec_error"] = str(error).splitlines()[0]
        return json.dumps(record, sort_keys=True)
    try:
        solution = solve(spec, TARGETS[arch], policy)
    except SpecError as error:  # InfeasibleSpec is a SpecError
        record["error"] = f"{type(error).__name__}: {error}"
    else:
        record["solution"] = solution.to_dict()
        record["all_candidates"] = {name: [plan.to_dict() for plan in plans]
                                    for name, plans in solution.candidates.items()}
    return json.dumps(record, sort_keys=True)


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else None
    all_cases = list(cases())
    with multiprocessing.Pool() as pool:
        lines = pool.map(run, all_cases, chunksize=16)
    text = "\n".join(lines) + "\n"
    if out:
        out.write_text(text)
        print(f"{len(lines)} cases -> {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
