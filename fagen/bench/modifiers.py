"""`python -m fagen.bench modifiers`: the attention variants of examples/modifiers.yaml (mask_mod /
score_mod written as expressions) timed against FlexAttention running the same variant, written by
hand below as Python score_mod / mask_mod functions, in one process, forward and backward.

Every variant runs at each sequence length with q and k of the same length (B sequences, H heads,
no grouped KV heads), on random q, k, v, do and the run-time inputs the variant declares (ALiBi
slopes, a soft-cap, prefix lengths, document ids, a relative-bias table: `make_case`). Before any
timing fagen's o, dq, dk, dv are checked against Flex's (relative error, FAIL in the row's notes
over TOLERANCE). Flex's block mask is built once per case, as Flex users cache it: its creation is
timed apart (`flex_block_mask_us`), not inside the attention times.

Flex has no dropout: for a variant with dropout fagen is timed as specified (`fagen_*`) and also on
the same spec without dropout (`fagen_nodrop_*`); that one is checked against Flex and is what
`speedup_*` compares, and `speedup_*_with_dropout` is Flex (without dropout) over fagen with it.

`--first-call`: the latency of a first call, each in a fresh Python process with cold caches
(`_first_call_child`): fagen's compile (FAGEN_CACHE_DIR a new folder) plus one forward and one
backward; Flex's torch.compile, create_block_mask and first forward plus backward (Inductor's and
Triton's caches in a new folder, the FX graph and AOT autograd caches off). `import torch` and the
inputs are not counted.
"""
from __future__ import annotations

import json as json_module
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

from fagen.bench.report import environment, make_console, reason, strict_json
from fagen.bench.peers import allow_flex_recompiles
from fagen.bench.timing import DEVICE, DROPOUT_SEED, relative_error, time_us_after_first_call
from fagen.runtime.tensors import TORCH_DTYPES
from fagen.spec import Spec

TOLERANCE = 2e-2
SPEC_FILE = Path(__file__).resolve().parents[2] / "examples" / "modifiers.yaml"
FIRST_CALL_SEQ_LEN = 2048
#: how the first-call child reports: one stdout line, this marker and then JSON
FIRST_CALL_MARKER = "FAGEN_FIRST_CALL "


# ==== FlexAttention's version of each variant (by hand) ==========================================
class FlexMods(NamedTuple):
    """What flex_attention takes for a variant: score_mod (None: plain scores), mask_mod, and whether
    the mask reads the batch index (else the block mask is built once and broadcast over B)."""

    score_mod: Optional[Callable]
    mask_mod: Callable
    per_batch: bool = False


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _flex_alibi(inputs: dict) -> FlexMods:
    slope = inputs["slope"]

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slope[h] * (q_idx - kv_idx)

    return FlexMods(score_mod, _causal)


def _flex_softcap(inputs: dict) -> FlexMods:
    cap = inputs["cap"]

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * (score / cap).tanh()

    return FlexMods(score_mod, _causal)


def _flex_window_sinks(inputs: dict) -> FlexMods:
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < 256) | (kv_idx < 4))

    return FlexMods(None, mask_mod)


def _flex_prefix_lm(inputs: dict) -> FlexMods:
    prefix = inputs["prefix"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

    return FlexMods(None, mask_mod, per_batch=True)


def _flex_documents(inputs: dict) -> FlexMods:
    doc = inputs["doc"]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    return FlexMods(None, mask_mod, per_batch=True)


def _flex_relative_bias(inputs: dict) -> FlexMods:
    bias = inputs["bias"]
    last = bias.shape[1] - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        # i - j >= 0 where the causal mask lets a score through; clamped (as fagen's kernels clamp) elsewhere
        return score + bias[h, (q_idx - kv_idx).clamp(0, last)]

    return FlexMods(score_mod, _causal)


def _flex_dilated(inputs: dict) -> FlexMods:
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 4 == 0)

    return FlexMods(None, mask_mod)


#: variant name in examples/modifiers.yaml -> its FlexAttention functions, given the case's run-time inputs
FLEX_VARIANTS: dict[str, Callable[[dict], FlexMods]] = {
    "alibi_bf16_d128": _flex_alibi,
    "softcap_bf16_d128": _flex_softcap,
    "window_sinks_bf16_d64": _flex_window_sinks,
    "prefix_lm_bf16_d64": _flex_prefix_lm,
    "documents_bf16_d64": _flex_documents,
    "relative_bias_fp16_d64_dropout": _flex_relative_bias,
    "dilated_fp16_d64_sm80": _flex_dilated,
}


# ==== inputs ======================================================================================
def document_ids(batch: int, seq_len: int, seed: int = 0):
    """(batch, seq_len) int32 non-decreasing document ids: documents of lengths drawn uniformly from
    [1, seq_len / 4] (about seq_len / 8 on average), fixed seed; the last one cut at seq_len."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq_len:
            lengths.append(int(rng.integers(1, max(1, seq_len // 4) + 1)))
        rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq_len])
    return np.stack(rows).astype(np.int32)


@dataclass
class Case:
    """q, k, v, do (batch, heads, N, d) in the spec's dtype, and the run-time inputs the spec declares."""

    q: Any
    k: Any
    v: Any
    do: Any
    inputs: dict


def make_case(spec: Spec, batch: int, heads: int, seq_len: int, seed: int = 0) -> Case:
    import torch

    dtype = getattr(torch, TORCH_DTYPES[spec.dtype])
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v, do = (torch.randn(batch, heads, seq_len, spec.head_dim if name in "qk" else spec.value_dim, dtype=dtype,
                               device=DEVICE, generator=generator) for name in "qkvd")
    inputs: dict = {}
    for name, _kind in dict(spec.inputs or ()).items():
        if name == "slope":     # ALiBi's geometric slopes
            inputs[name] = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32,
                                        device=DEVICE)
        elif name == "cap":
            inputs[name] = 30.0
        elif name == "prefix":
            inputs[name] = torch.full((batch,), seq_len // 4, dtype=torch.int32, device=DEVICE)
        elif name == "doc":
            inputs[name] = torch.from_numpy(document_ids(batch, seq_len, seed)).to(DEVICE)
        elif name == "bias":    # indexed by i - j
            inputs[name] = 0.2 * torch.randn(heads, seq_len, dtype=torch.float32, device=DEVICE, generator=generator)
        else:
            raise ValueError(f"{spec.variant_name}: no inputs maker for {name!r} (fagen/bench/modifiers.py)")
    return Case(q, k, v, do, inputs)


def _fagen_args(spec: Spec, case: Case) -> dict:
    args: dict = {"inputs": case.inputs or None}
    if spec.dropout:
        args.update(seed=DROPOUT_SEED, offset=0)
    return args


def _block_mask(create_block_mask, mods: FlexMods, batch: int, seq_len: int):
    return create_block_mask(mods.mask_mod, batch if mods.per_batch else None, None, seq_len, seq_len, device=DEVICE)


def _no_dropout(spec: Spec) -> Spec:
    return spec.model_copy(update={"dropout": 0.0, "name": spec.variant_name + "_nodrop"})


#: a variant timed at another head dim than its spec file's (`--head-dim`): its name, this, the head dim
AT_HEAD_DIM = "_at_d"


def flex_mods(spec: Spec, inputs: dict) -> FlexMods:
    """FLEX_VARIANTS' functions of a variant, or of the variant it was made from at another head dim."""
    name = spec.variant_name
    made_from = re.fullmatch(rf"(.+){AT_HEAD_DIM}\d+", name)
    return FLEX_VARIANTS[name if name in FLEX_VARIANTS or not made_from else made_from.group(1)](inputs)


def _load(spec_file, variants: Optional[Sequence[str]] = None, head_dim: Optional[int] = None) -> list[Spec]:
    """The variants of the file (those named), at `head_dim` in place of each spec's where given."""
    from fagen.spec import load_specs

    specs = load_specs(spec_file)
    if variants:
        known = {s.variant_name: s for s in specs}
        missing = [name for name in variants if name not in known]
        if missing:
            raise SystemExit(f"no variant named {', '.join(missing)}; the file has: {', '.join(known)}")
        specs = [known[name] for name in variants]
    missing = [s.variant_name for s in specs if s.variant_name not in FLEX_VARIANTS]
    if missing:
        raise SystemExit(f"no FlexAttention version of {', '.join(missing)}: add it to FLEX_VARIANTS "
                         f"in fagen/bench/modifiers.py")
    if head_dim is not None:
        specs = [s.model_copy(update={"head_dim": head_dim, "name": f"{s.variant_name}{AT_HEAD_DIM}{head_dim}"})
                 for s in specs]
    return specs


def _fmt(value: Optional[float], spec: str, unit: str) -> str:
    return "n/a" if value is None else format(value, spec) + unit


# ==== the timed run ===============================================================================
def run_modifiers(seq_lens: Sequence[int] = (2048, 8192), batch: int = 4, heads: int = 16,
                  spec_file=SPEC_FILE, variants: Optional[Sequence[str]] = None, first_call: bool = False,
                  warmup: int = 10, repeats: int = 30, json: Optional[str] = None,
                  head_dim: Optional[int] = None) -> dict:
    import torch
    from rich.markup import escape
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fagen import jit, runtime

    if first_call and head_dim is not None:
        raise SystemExit("--first-call times the spec file's variants as they are: leave out --head-dim")
    specs = _load(spec_file, variants, head_dim)
    console = make_console()
    torch.cuda.init()
    runtime.ensure_context()
    allow_flex_recompiles(torch)
    meta = {**environment(torch), "batch": batch, "heads": heads, "seq_lens": list(seq_lens), "head_dim": head_dim,
            "spec_file": str(spec_file), "tolerance": TOLERANCE}
    console.print(escape(f"fagen bench modifiers on {meta.get('gpu')}, torch {meta.get('torch')}, {meta['date']}: "
                         f"{len(specs)} variants of {spec_file}, B={batch} H={heads}, N in {list(seq_lens)}"))
    flex = torch.compile(flex_attention, dynamic=False)

    def timed(fn, warm: int = warmup, reps: int = repeats) -> float:
        return time_us_after_first_call(fn, warm, reps)

    rows = []
    for spec in specs:
        # (label, spec, kernel or the reason it failed, checked against Flex?)
        fagen_runs: list[tuple[str, Spec, Any, bool]] = []
        labelled = [("fagen", spec)] + ([("fagen_nodrop", _no_dropout(spec))] if spec.dropout else [])
        for label, variant_spec in labelled:
            try:
                kernel: Any = jit.compile(variant_spec)
            except Exception as err:
                kernel = err
            fagen_runs.append((label, variant_spec, kernel, not variant_spec.dropout))
        for seq_len in seq_lens:
            case = make_case(spec, batch, heads, seq_len, seed=seq_len)
            row: dict = {"variant": spec.variant_name, "seq_len": seq_len, "batch": batch, "heads": heads,
                         "head_dim": spec.head_dim, "dtype": spec.dtype, "dropout": spec.dropout, "us": {},
                         "flex_block_mask_us": None, "errors": {}, "notes": {}}
            if spec.dropout:
                row["notes"]["dropout"] = (f"Flex has no dropout: flex_* run without it; fagen_* with dropout "
                                           f"{spec.dropout}, fagen_nodrop_* without (checked, and compared in speedup_*)")

            # Flex first: its o and gradients are what fagen is checked against
            expected, flex_state = None, None
            try:
                mods = flex_mods(spec, case.inputs)
                row["flex_block_mask_us"] = timed(lambda: _block_mask(create_block_mask, mods, batch, seq_len), 2, 10)
                block_mask = _block_mask(create_block_mask, mods, batch, seq_len)
                leaves = tuple(t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
                out = flex(*leaves, score_mod=mods.score_mod, block_mask=block_mask)
                flex_grads = torch.autograd.grad(out, leaves, case.do, retain_graph=True)
                torch.cuda.synchronize()
                expected = (out.detach(), *flex_grads)
                flex_state = (mods, block_mask, leaves, out)
            except Exception as err:
                row["notes"]["flex"] = reason(err, 200)

            for label, variant_spec, kernel, checked in fagen_runs:
                if isinstance(kernel, Exception):
                    row["notes"][label] = f"compile: {reason(kernel, 200)}"
                    continue
                args = _fagen_args(variant_spec, case)
                try:
                    o, lse = kernel.forward(case.q, case.k, case.v, **args)
                    grads = kernel.backward(case.q, case.k, case.v, o, lse, case.do, **args)
                    torch.cuda.synchronize()
                    if checked and expected is not None:
                        row["errors"][f"{label}_forward"] = relative_error(o, expected[0])
                        row["errors"][f"{label}_backward"] = max(relative_error(mine, theirs)
                                                                 for mine, theirs in zip(grads, expected[1:]))
                        worst = max(row["errors"][f"{label}_forward"], row["errors"][f"{label}_backward"])
                        if worst > TOLERANCE:
                            row["notes"][f"{label}_check"] = f"FAIL: relative error {worst:.2e} vs Flex"
                    row["us"][f"{label}_forward"] = timed(
                        lambda: kernel.forward(case.q, case.k, case.v, **args))
                    row["us"][f"{label}_backward"] = timed(
                        lambda: kernel.backward(case.q, case.k, case.v, o, lse, case.do, **args))
                    del o, lse, grads
                except Exception as err:
                    row["notes"][label] = reason(err, 200)

            if flex_state is not None:
                mods, block_mask, leaves, out = flex_state
                try:
                    def flex_forward():
                        with torch.no_grad():
                            return flex(case.q, case.k, case.v, score_mod=mods.score_mod, block_mask=block_mask)

                    row["us"]["flex_forward"] = timed(flex_forward)
                    row["us"]["flex_backward"] = timed(
                        lambda: torch.autograd.grad(out, leaves, case.do, retain_graph=True))
                except Exception as err:
                    row["notes"]["flex_timing"] = reason(err, 200)
                del flex_state, mods, block_mask, leaves, out
            del expected

            like = "fagen_nodrop" if spec.dropout else "fagen"
            for pass_name in ("forward", "backward"):
                theirs = row["us"].get(f"flex_{pass_name}")
                mine = row["us"].get(f"{like}_{pass_name}")
                row[f"speedup_{pass_name}"] = theirs / mine if theirs and mine else None
                if spec.dropout:
                    mine = row["us"].get(f"fagen_{pass_name}")
                    row[f"speedup_{pass_name}_with_dropout"] = theirs / mine if theirs and mine else None
            rows.append(row)
            times = ", ".join(f"{n} {t:.0f} us" for n, t in row["us"].items())
            errors = ", ".join(f"{n} {e:.1e}" for n, e in row["errors"].items())
            line = (f"{spec.variant_name} N={seq_len} B={batch} H={heads} d={spec.head_dim}: {times}; Flex block "
                    f"mask {_fmt(row['flex_block_mask_us'], '.0f', ' us')}; fagen vs Flex fwd "
                    f"{_fmt(row['speedup_forward'], '.2f', 'x')} bwd {_fmt(row['speedup_backward'], '.2f', 'x')}")
            if spec.dropout:
                line += (f" (fagen with dropout: fwd {_fmt(row['speedup_forward_with_dropout'], '.2f', 'x')} bwd "
                         f"{_fmt(row['speedup_backward_with_dropout'], '.2f', 'x')})")
            line += f"; errors vs Flex: {errors or 'n/a'}"
            failed = any(n.endswith("_check") for n in row["notes"])
            other = {n: t for n, t in row["notes"].items() if n != "dropout"}
            console.print(("[bold red]" if failed else "") + escape(line + (f"; notes: {other}" if other else ""))
                          + ("[/]" if failed else ""))
            del case
            torch.cuda.empty_cache()

    result: dict = {"meta": meta, "rows": rows}
    if first_call:
        result["first_call"] = []
        for spec in specs:
            entry: dict = {"variant": spec.variant_name, "seq_len": FIRST_CALL_SEQ_LEN, "batch": batch, "heads": heads,
                           "notes": {}}
            for which in ("fagen", "flex"):
                try:
                    entry[f"{which}_s"] = first_call_seconds(which, spec.variant_name, FIRST_CALL_SEQ_LEN, batch,
                                                             heads, spec_file)
                except Exception as err:
                    entry[f"{which}_s"] = None
                    entry["notes"][which] = reason(err, 300)
            if spec.dropout:
                entry["notes"]["dropout"] = f"fagen with dropout {spec.dropout}, Flex without"
            result["first_call"].append(entry)
            console.print(escape(f"first call {spec.variant_name} N={FIRST_CALL_SEQ_LEN}: fagen (cold compile + fwd "
                                 f"+ bwd) {_fmt(entry['fagen_s'], '.2f', ' s')}, Flex (torch.compile + block mask "
                                 f"+ fwd + bwd) {_fmt(entry['flex_s'], '.2f', ' s')}"
                                 + (f"; notes: {entry['notes']}" if entry["notes"] else "")))
    if json:
        Path(json).parent.mkdir(parents=True, exist_ok=True)
        Path(json).write_text(json_module.dumps(strict_json(result), indent=2, default=str) + "\n")
    return result


# ==== first-call latency (a fresh process each) ===================================================
def first_call_seconds(which: str, variant: str, seq_len: int, batch: int, heads: int, spec_file=SPEC_FILE,
                       timeout: float = 1800.0) -> float:
    """Seconds of a first fagen or Flex call (see `_first_call_child`) in a fresh Python process with
    cold caches: its own new FAGEN_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR."""
    package_root = str(Path(__file__).resolve().parents[2])   # the folder holding the fagen package
    code = (f"from fagen.bench.modifiers import _first_call_child; "
            f"_first_call_child({which!r}, {variant!r}, {seq_len}, {batch}, {heads}, {str(spec_file)!r})")
    with tempfile.TemporaryDirectory(prefix=f"fagen-first-call-{which}-") as cache:
        env = {**os.environ, "FAGEN_CACHE_DIR": os.path.join(cache, "fagen"),
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
               "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
               "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(FIRST_CALL_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"first-call child failed (status {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-2000:]}")
    return float(json_module.loads(lines[-1][len(FIRST_CALL_MARKER):])["seconds"])


def _first_call_child(which: str, variant: str, seq_len: int = FIRST_CALL_SEQ_LEN, batch: int = 4,
                      heads: int = 16, spec_file=SPEC_FILE) -> None:
    """In a fresh process: the first call of fagen ("fagen": fagen.compile + one forward + one
    backward) or of Flex ("flex": torch.compile + create_block_mask + one forward + one backward),
    synchronised; the seconds printed as `FAGEN_FIRST_CALL {"seconds": ...}`. The imports, the CUDA
    context and the inputs come before the clock starts."""
    import torch

    spec = _load(spec_file, [variant])[0]
    torch.cuda.init()
    case = make_case(spec, batch, heads, seq_len, seed=seq_len)
    torch.cuda.synchronize()
    if which == "fagen":
        from fagen import jit, runtime

        runtime.ensure_context()
        args = _fagen_args(spec, case)
        start = time.perf_counter()
        kernel = jit.compile(spec)
        o, lse = kernel.forward(case.q, case.k, case.v, **args)
        kernel.backward(case.q, case.k, case.v, o, lse, case.do, **args)
        torch.cuda.synchronize()
    elif which == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mods = flex_mods(spec, case.inputs)
        leaves = tuple(t.detach().clone().requires_grad_(True) for t in (case.q, case.k, case.v))
        torch.cuda.synchronize()
        start = time.perf_counter()
        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = _block_mask(create_block_mask, mods, batch, seq_len)
        out = flex(*leaves, score_mod=mods.score_mod, block_mask=block_mask)
        torch.autograd.grad(out, leaves, case.do)
        torch.cuda.synchronize()
    else:
        raise ValueError(f"unknown first-call target {which!r}: fagen or flex")
    seconds = time.perf_counter() - start
    print(FIRST_CALL_MARKER + json_module.dumps({"which": which, "variant": variant, "seconds": seconds}), flush=True)
