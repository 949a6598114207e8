"""`python -m fagen.bench corners`: the corners of issue 13 — every head dim, dropout, and the masks
SDPA cannot take — timed against SDPA (flash and cuDNN backends) and FlexAttention, forward and
backward, in one process, on the same inputs.

A row is one spec at one shape. Before it is timed, fagen's o, dq, dk, dv are checked against a peer
that computes the same thing (SDPA-flash, else Flex); a relative error over TOLERANCE marks the row
FAIL, and a FAIL row makes the command exit 1. With dropout every implementation draws its own random
numbers, so fagen's outputs are checked for being finite and for repeating bit for bit under the same
seed (the GPU property tests compare its mask with the float64 reference's). Dropout rows run SDPA
with the same p; Flex has no dropout and sits those out. Flex gets the mask as a mask_mod with its
block mask built once, outside the timed region, as Flex users cache it.
"""
from __future__ import annotations

import json as json_module
import math
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from fagen.bench.peers import allow_flex_recompiles, sdpa_backward, time_sdpa_backward, time_sdpa_forward
from fagen.bench.report import environment, make_console, reason, strict_json
from fagen.bench.timing import DEVICE, make_inputs, relative_error, spec_flops, time_us_after_first_call
from fagen.spec import Spec

TOLERANCE = 2e-2
BLOCK_SPARSE_DENSITY = 0.5


class Corner(NamedTuple):
    spec: Spec
    batch: int
    heads: int
    seq_len: int


def _corner(batch: int, heads: int, seq_len: int, **spec: Any) -> Corner:
    return Corner(Spec(dtype="bf16", **spec), batch, heads, seq_len)


#: The issue's rows (N = 4096, 4 x 16) and shapes beyond them: an odd length, a small batch, a long sequence.
CORNERS: tuple[Corner, ...] = (
    *(_corner(4, 16, 4096, head_dim=d, mask="causal") for d in (32, 64, 96, 128, 160, 192, 256)),
    _corner(2, 16, 3000, head_dim=256, mask="causal"),
    _corner(8, 8, 1024, head_dim=192, mask="none"),
    _corner(1, 16, 16384, head_dim=256, mask="causal"),
    _corner(2, 16, 3000, head_dim=96, mask="none"),
    _corner(1, 16, 16384, head_dim=96, mask="causal"),
    *(_corner(4, 16, 4096, head_dim=d, mask="causal", dropout=0.1) for d in (64, 128)),
    _corner(2, 16, 3000, head_dim=128, mask="none", dropout=0.1),
    _corner(2, 16, 8192, head_dim=128, mask="sliding_window", window=1024),
    _corner(2, 16, 8192, head_dim=64, mask="block_sparse", block_size=128),
)


def corners_in(dtype: str) -> tuple[Corner, ...]:
    """The same rows in another dtype (issue 13 asks for fp16 and bf16; the rows are written in bf16)."""
    return tuple(Corner(Spec(**{**corner.spec.model_dump(), "dtype": dtype}), *corner[1:]) for corner in CORNERS)


def _flex_mask(spec: Spec, seq_len: int, block_table):
    """Flex's mask_mod for the spec's mask (q and k of one length, so no bottom-right shift)."""
    if spec.mask == "causal":
        return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx
    if spec.mask == "sliding_window":
        window = spec.window
        return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    if spec.mask == "block_sparse":
        size = spec.block_size
        return lambda b, h, q_idx, kv_idx: block_table[q_idx // size, kv_idx // size] > 0
    return None


def run_corners(corners: Sequence[Corner] = CORNERS, warmup: int = 5, repeats: int = 20,
                json: Optional[str] = None) -> dict:
    import torch
    from rich.markup import escape
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen import jit, runtime

    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    allow_flex_recompiles(torch)
    flex = torch.compile(flex_attention, dynamic=False)
    meta = environment(torch)
    console.print(escape(f"fagen bench corners on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}"))

    def timed(fn) -> float:
        return time_us_after_first_call(fn, warmup, repeats)

    rows = []
    for spec, batch, heads, seq_len in corners:
        row: dict = {"variant": spec.variant_name, "head_dim": spec.head_dim, "mask": spec.mask,
                     "dropout": spec.dropout, "batch": batch, "heads": heads, "seq_len": seq_len, "us": {},
                     "tflops": {}, "notes": {}, "plans": {}}
        inputs = make_inputs(spec, batch, heads, seq_len, seed=seq_len)
        args = dict(inputs.runtime_args)
        block_table = None
        if spec.mask == "block_sparse":
            blocks = math.ceil(seq_len / spec.block_size)
            generator = torch.Generator(device=DEVICE).manual_seed(seq_len)
            block_table = (torch.rand((blocks, blocks), device=DEVICE, generator=generator)
                           < BLOCK_SPARSE_DENSITY).to(torch.uint8)
            block_table.fill_diagonal_(1)   # no query row without keys (implementations differ on those rows)
            args["block_mask"] = block_table
            row["block_density"] = float(block_table.float().mean())
        q, k, v, do = inputs.q, inputs.k, inputs.v, inputs.do
        mask_mod = _flex_mask(spec, seq_len, block_table)
        expected = None

        # ---- peers: SDPA (the masks it has), Flex (no dropout) ----
        if spec.mask in ("none", "causal"):
            for backend in ("flash", "cudnn"):
                try:
                    row["us"][f"{backend}_forward"] = 1e3 * time_sdpa_forward(backend, spec, inputs, warmup, repeats)
                    row["us"][f"{backend}_backward"] = 1e3 * time_sdpa_backward(backend, spec, inputs, warmup, repeats)
                    if expected is None and not spec.dropout:
                        out, grads = sdpa_backward(backend, spec, inputs)
                        expected = (out.detach(), *grads())
                except Exception as err:
                    row["notes"][backend] = reason(err, 160)
        if not spec.dropout:
            try:
                block_mask = (create_block_mask(mask_mod, None, None, seq_len, seq_len, device=DEVICE,
                                                BLOCK_SIZE=spec.block_size or 128) if mask_mod else None)
                leaves = tuple(t.detach().clone().requires_grad_(True) for t in (q, k, v))
                out = flex(*leaves, block_mask=block_mask, scale=spec.scale)
                if expected is None:
                    expected = (out.detach(), *torch.autograd.grad(out, leaves, do, retain_graph=True))

                def flex_forward():
                    with torch.no_grad():
                        return flex(q, k, v, block_mask=block_mask, scale=spec.scale)

                row["us"]["flex_forward"] = timed(flex_forward)
                row["us"]["flex_backward"] = timed(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
                del out, leaves
            except Exception as err:
                row["notes"]["flex"] = reason(err, 160)

        # ---- fagen: checked, then timed ----
        try:
            kernel = jit.compile(spec)
            row["plans"] = {p: f"{x['family']} Br={x['block_r']} Bc={x['block_c']} w={x['warps']}"
                            for p, x in kernel.record["plans"].items()}
            o, lse = kernel.forward(q, k, v, **args)
            grads = kernel.backward(q, k, v, o, lse, do, **args)
            torch.cuda.synchronize()
            if expected is not None:
                errors = [relative_error(mine, theirs) for mine, theirs in zip((o, *grads), expected)]
                row["error"] = max(errors)
                row["check"] = "ok" if row["error"] <= TOLERANCE else "FAIL"
            elif spec.dropout:
                again = kernel.forward(q, k, v, **args)[0], *kernel.backward(q, k, v, o, lse, do, **args)
                finite = all(bool(torch.isfinite(t).all()) for t in (o, *grads))
                # dq adds with atomics: the same up to their order; o, dk, dv bit for bit
                repeats = (torch.equal(o, again[0]) and torch.equal(grads[1], again[2]) and torch.equal(grads[2], again[3])
                           and relative_error(again[1], grads[0]) <= 1e-3)
                row["check"] = ("ok (finite, repeats under the same seed; no peer draws fagen's mask)" if finite and repeats
                                else f"FAIL (finite {finite}, repeats {repeats})")
                del again
            else:
                row["check"] = f"not checked: no peer ran ({row['notes']})"
            row["us"]["fagen_forward"] = timed(lambda: kernel.forward(q, k, v, **args))
            row["us"]["fagen_backward"] = timed(lambda: kernel.backward(q, k, v, o, lse, do, **args))
            del o, lse, grads
        except Exception as err:
            row["notes"]["fagen"] = reason(err, 300)
            row["check"] = "FAIL"

        for pass_name in ("forward", "backward"):
            flops = spec_flops(spec, batch, heads, seq_len, pass_name)
            if spec.mask == "block_sparse":
                flops *= row["block_density"]
            mine = row["us"].get(f"fagen_{pass_name}")
            for peer in ("flash", "cudnn", "flex"):
                theirs = row["us"].get(f"{peer}_{pass_name}")
                row[f"vs_{peer}_{pass_name}"] = theirs / mine if theirs and mine else None
            for impl in ("fagen", "flash", "cudnn", "flex"):
                t = row["us"].get(f"{impl}_{pass_name}")
                row["tflops"][f"{impl}_{pass_name}"] = flops / (t * 1e-6) / 1e12 if t else None
        rows.append(row)
        ratios = " ".join(f"{peer} {row[f'vs_{peer}_forward'] or float('nan'):.2f}/"
                          f"{row[f'vs_{peer}_backward'] or float('nan'):.2f}x" for peer in ("flash", "cudnn", "flex"))
        times = ", ".join(f"{n} {t:.0f}" for n, t in row["us"].items())
        console.print(escape(f"{spec.variant_name} {batch}x{heads} N={seq_len}: fagen vs (fwd/bwd) {ratios}; "
                             f"check {row.get('check')} err {row.get('error', float('nan')):.1e}; us: {times}; "
                             f"plans {row['plans']}" + (f"; notes {row['notes']}" if row["notes"] else "")))
        del inputs, q, k, v, do, expected
        torch.cuda.empty_cache()

    failed = [row["variant"] for row in rows if str(row.get("check", "")).startswith("FAIL")]
    if failed:
        console.print(escape(f"FAIL: {', '.join(failed)}"))
    result = {"meta": meta, "rows": rows, "failed": failed}
    if json:
        Path(json).parent.mkdir(parents=True, exist_ok=True)
        Path(json).write_text(json_module.dumps(strict_json(result), indent=2, default=str) + "\n")
    return result
