"""Why bench-model's host-time table moves between runs (issue 10, point 4): the table's paired rounds in a
fresh process, then again after a training step of the bench's model has run in the same process, then with
Python's garbage collector off for the timing, printing each round's µs so that drift inside a run shows.

    python dev/gpu/overhead_drift.py [--rounds 5] [--wide-too]
"""
from __future__ import annotations

import argparse
import gc

import fagen.torch as fagen_torch
from fagen.bench import model as bench_model


def table(title: str, rounds: int) -> None:
    collections = []
    gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
    rows = bench_model.measure_overhead(compiled=True, calls=2000, rounds=rounds)
    gc.callbacks.pop()
    print(f"== {title}: gc collections during the table by generation "
          f"{[collections.count(g) for g in range(3)]}")
    for row in rows:
        print(f"  {row.mode:17s} compiled={row.compiled!s:5s} fagen {row.us.get('fagen', 0):7.1f} sdpa "
              f"{row.us.get('sdpa', 0):7.1f} ratio {row.ratio:.2f} rounds " + " ".join(f"{r:.2f}" for r in row.round_ratios))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wide-too", action="store_true", help="also the table with fagen.torch.PLAIN_OPS off")
    args = parser.parse_args()
    from fagen.integrations import transformers as fagen_hf

    fagen_hf.register()
    table("fresh process", args.rounds)
    if args.wide_too:   # the same table with every call through the wide ops, for the plain ops' share
        fagen_torch.PLAIN_OPS = False
        table("fresh process, wide ops (PLAIN_OPS = False)", args.rounds)
        fagen_torch.PLAIN_OPS = True
    shape = bench_model.model_shapes((128,), (4096,), 16384, 2048, (1,))[0]
    row = bench_model.measure_model(shape, hidden=2048, layers=4, vocab=32000, warmup=1, steps=3)
    print(f"== one model row: fagen/flash {row.speedup('flash'):.2f}")
    table("after the model row", args.rounds)
    gc.collect()
    gc.disable()
    table("after the model row, gc disabled", args.rounds)
    gc.enable()


if __name__ == "__main__":
    main()
