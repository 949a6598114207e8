"""Stage 3: rendering (Jinja).

One Environment with StrictUndefined: a template that names a value the context lacks is an error,
never an empty string. Templates only fill values; every number and every decision (literals, the
dropout threshold, which template) is made here in Python from the (spec, solution) pair, so the
kernel name and the bytes of the source are pure functions of them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import jinja2

from fagen.expressions import mask_kind_struct
from fagen.dropout import dropout_keep_scale, dropout_threshold
from fagen.solver import Plan, Solution, family_named
from fagen.solver import value_tile_dim as solver_value_tile_dim
from fagen.sources import TEMPLATE_DIR, folds_kv_group
from fagen.spec import Spec

COMMON_HEADER = "attention_common.cuh"

ELEMENT_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float", "fp8_e4m3": "__nv_fp8_e4m3"}
PTX_TYPES = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "fp8_e4m3": "e4m3"}  # the type suffix of mma/wgmma instructions
MASK_KINDS = {"none": "MASK_NONE", "causal": "MASK_CAUSAL", "sliding_window": "MASK_SLIDING_WINDOW",
              "padding": "MASK_PADDING", "block_sparse": "MASK_BLOCK_SPARSE"}
PASS_PREFIX = {"forward": "fwd", "backward": "bwd", "decode": "dec"}
#: The header of the constants Python and CUDA share, generated from their Python copies (shared_constants_header).
SHARED_HEADER = "shared_constants.cuh"

_environment = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


@dataclass(frozen=True)
class Rendered:
    text: str
    filename: str
    kernels: dict[str, list[str]]     # pass -> kernel symbols, the main one first
    templates: list[str]
    include_dir: Path
    pass_texts: dict[str, str]        # pass -> header + that pass alone: compiled in parallel at run time


def float_literal(value: float) -> str:
    """A C++ float literal that round-trips the value's float32 rounding and always parses."""
    return f"{value:.9e}f"


def kernel_name(spec: Spec, pass_name: str, plan: Plan) -> str:
    tag = family_named(plan.family).tag
    return f"fagen_{PASS_PREFIX[pass_name]}_{spec.canonical_name}_br{plan.block_r}_bc{plan.block_c}_w{plan.warps}{tag}"


def has_summary_kernel(spec: Spec, pass_name: str) -> bool:
    """Whether the pass has a _summary kernel for the mask_mod inputs' per-tile bounds: the forward's, where its
    mask_mod reads run-time inputs; the backward's _delta kernel writes them itself (summary_calls)."""
    return pass_name == "forward" and bool(spec.modifiers.summaries)


def kernel_symbols(spec: Spec, pass_name: str, plan: Plan) -> list[str]:
    main = kernel_name(spec, pass_name, plan)
    if has_summary_kernel(spec, pass_name):
        return _kernel_symbols(spec, pass_name, plan, main) + [f"{main}_summary"]
    return _kernel_symbols(spec, pass_name, plan, main)


def _kernel_symbols(spec: Spec, pass_name: str, plan: Plan, main: str) -> list[str]:
    if pass_name == "backward" and not family_named(plan.family).deterministic:  # dQ by atomics only
        return [main, f"{main}_delta", f"{main}_dq_convert", f"{main}_kv_group_sum"]
    if pass_name == "backward":
        return [main, f"{main}_delta", f"{main}_dq", f"{main}_dq_convert", f"{main}_kv_group_sum"]
    if pass_name == "decode" and plan.tensor_cores:   # one kernel for up to 16 rows, then the merge of the splits
        return [main, f"{main}_combine"]
    if pass_name == "decode":   # one instance per row count, then the merge of the splits
        return [f"{main}_r{rows}" for rows in decode_rows(plan)] + [f"{main}_combine"]
    return [main]


def warpgroup_mma_function(name: str, n: int, ptx_type: str, a_in_registers: bool, tnsp_a: int, tnsp_b: int) -> str:
    """C++ for one wgmma.mma_async m64n{n}k16 wrapper (k32 for e4m3: 32 bytes of k either way) with fp32
    accumulators `float (&d)[n/8][4]` (the mma.sync tile layout). A is a shared-memory descriptor, or four registers
    in the mma.sync A-fragment layout; B is a descriptor; tnsp_a / tnsp_b read an MN-major tile transposed (16-bit
    types only: FP8 wgmma reads both operands K-major). The operand list has one entry per accumulator, which is why
    this is generated rather than written out per shape."""
    accumulators = n // 2
    a_count = 4 if a_in_registers else 1
    outputs = ", ".join(f"%{i}" for i in range(accumulators))
    eight_bit = ptx_type == "e4m3"
    k = 32 if eight_bit else 16
    transposes = ([] if eight_bit else ([tnsp_b] if a_in_registers else [tnsp_a, tnsp_b]))
    assert not (eight_bit and (tnsp_a or tnsp_b)), "FP8 wgmma reads K-major operands only"
    immediates = ", ".join(["p", "1", "1"] + [str(t) for t in transposes])
    if a_in_registers:
        a_operand = "{" + ", ".join(f"%{accumulators + i}" for i in range(4)) + "}"
        a_param, a_constraint = "const unsigned (&a)[4]", '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])'
    else:
        a_operand = f"%{accumulators}"
        a_param, a_constraint = "unsigned long long a", '"l"(a)'
    b_operand, scale_operand = accumulators + a_count, accumulators + a_count + 1
    constraints = ", ".join(f'"+f"(d[{t}][{e}])' for t in range(n // 8) for e in range(4))
    return (
        f"__device__ __forceinline__ void {name}(float (&d)[{n // 8}][4], {a_param}, unsigned long long b, int accumulate) {{\n"
        f"  asm volatile(\n"
        f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{scale_operand}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx_type}.{ptx_type} "\n'
        f'      "{{{outputs}}}, {a_operand}, %{b_operand}, {immediates};\\n}}\\n"\n'
        f"      : {constraints}\n"
        f'      : {a_constraint}, "l"(b), "r"(accumulate));\n'
        f"}}\n")


def value_tile_dim(spec: Spec, plan: Plan) -> int:
    """The columns of V's tiles and O's accumulators in this plan (solver.value_tile_dim)."""
    return solver_value_tile_dim(family_named(plan.family), spec, plan.head_dim or spec.compute_dim)


#: The forwards' products (forward_wgmma_products.cu.j2, shared by both warpgroup-MMA forwards).
_FORWARD_PRODUCTS = (
    ("s_product", lambda spec, plan: plan.block_c, False, 0, 0),     # S = Q K^T
    # O += P~ V: V read transposed, or in fp8 from V^T written K-major (templates/forward_wgmma.cu.j2)
    ("o_product", value_tile_dim, True, 0, lambda spec: int(not spec.fp8)),
)

def _key_block_backward_products(computing_warps):
    """The products of the backwards whose warpgroups hold 64 keys' dK, dV each (backward_wgmma_rows.cu.j2)."""
    return (
        ("scores_product", lambda spec, plan: plan.block_r, False, 0, 0),     # S^T = K Q^T, dP^T = V dO^T
        ("key_grad_product", lambda spec, plan: plan.head_dim, True, 0, 1),   # dV += P^T dO, dK += dS^T Q
        # dQ = dS K: each warpgroup takes 64 query rows (Br = 64 per warpgroup) or 64 dims (the last one's end at d)
        ("dq_product", lambda spec, plan: plan.head_dim if plan.block_r == 16 * computing_warps(plan) else 64,
         False, 1, 1),
    )


#: The wgmma shapes each warpgroup-MMA template issues: (function, N of (spec, plan), A in registers,
#: A transposed, B transposed).
WARPGROUP_PRODUCTS = {
    "forward_wgmma.cu.j2": _FORWARD_PRODUCTS,
    "forward_wgmma_ws.cu.j2": _FORWARD_PRODUCTS,   # the warp-specialized forward's consumers
    "backward_wgmma.cu.j2": _key_block_backward_products(computing_warps=lambda plan: plan.warps),
    # the warp-specialized one: warpgroup 0 loads, the others compute as backward_wgmma's
    "backward_wgmma_ws.cu.j2": _key_block_backward_products(computing_warps=lambda plan: plan.warps - 4),
    # d > 128: the warpgroups split S^T by queries and dK, dV, dQ by dims; P_drop^T, dS^T from shared memory
    "backward_wgmma_wide.cu.j2": (
        ("scores_product", lambda spec, plan: plan.block_r // (plan.warps // 4), False, 0, 0),    # S^T, dP^T
        ("key_grad_product", lambda spec, plan: plan.head_dim // (plan.warps // 4), False, 0, 1),  # dK
        ("value_grad_product", lambda spec, plan: value_tile_dim(spec, plan) // (plan.warps // 4), False, 0, 1),  # dV
        ("dq_product", lambda spec, plan: plan.head_dim // (plan.warps // 4), False, 1, 1),        # dQ
    ),
}


def decode_rows(plan: Plan) -> list[int]:
    """The row counts the decode template is instantiated for: powers of two up to Br."""
    return [1 << n for n in range(plan.block_r.bit_length()) if 1 << n <= plan.block_r]


def template_context(spec: Spec, pass_name: str, plan: Plan, input_grads: bool = False) -> dict:
    """The Jinja context of one pass's template; `input_grads`: the backward build that also adds score_mod's
    input gradients (`render_input_grad_backward`)."""
    threads = plan.threads
    name = kernel_name(spec, pass_name, plan)
    pad_elements = 4 // spec.element_bytes  # one 4-byte bank word
    options = dict(family_named(plan.family).options)
    return {
        **options,
        # the family's option to test a mask_mod ahead of the backward's score products
        # (templates/backward_wgmma_rows.cu.j2): taken where the spec has one
        "mask_bits_ahead": bool(options.get("mask_bits_ahead")) and spec.mask_mod is not None,
        "kernel_name": name,
        "template_name": plan.template,
        "elem_type": ELEMENT_TYPES[spec.dtype],
        "out_type": ELEMENT_TYPES[spec.output_dtype],   # o's: q's, or bf16 from an fp8 forward
        "fp8": "true" if spec.fp8 else "false",
        "head_dim": plan.head_dim or spec.compute_dim,   # padded up to the template's multiple
        "data_dim": spec.head_dim,
        "value_dim": spec.value_dim,
        "value_tile_dim": value_tile_dim(spec, plan),
        "block_r": plan.block_r,
        "block_c": plan.block_c,
        "threads": threads,
        "stages": plan.stages,
        "tensor_map_columns": plan.tensor_map_columns,   # the TMA boxes' columns the host encodes (0: no maps)
        # the blocks per multiprocessor the solver ranked this plan by (its register estimate), for
        # templates that hold ptxas to it with __launch_bounds__
        "resident_blocks": max(1, plan.resident_warps // plan.warps),
        "k_pitch": spec.head_dim + pad_elements,
        "o_per_thread": math.ceil(plan.block_r * spec.head_dim / threads),
        "kv_per_thread": math.ceil(plan.block_c * spec.head_dim / threads),
        "scale": float_literal(spec.scale),
        "scale_log2": float_literal(spec.scale * math.log2(math.e)),
        "mask_kind": MASK_KINDS[spec.mask],
        "grain": spec.block_size or 1,
        "has_dropout": "true" if spec.dropout > 0 else "false",
        "dropout_threshold": f"{dropout_threshold(spec.dropout)}u",
        "keep_scale": float_literal(dropout_keep_scale(spec.dropout)),
        "deterministic": "true" if spec.deterministic else "false",
        "packed": "true" if spec.layout == "packed" else "false",
        # a backward block walks each query head of a K/V head's group (where the runtime sets args.fold_heads)
        "folds_kv_group": "true" if folds_kv_group(spec, plan) else "false",
        "input_grads": "true" if input_grads else "false",
        "rows_last_first": "true" if spec.keys_grow_with_rows else "false",
        # the statements the backward's _delta kernel runs first: the mask_mod inputs' summaries (no _summary kernel)
        "summary_calls": spec.modifiers.summary_calls() if pass_name == "backward" else "",
        "mods_type": f"{mods_namespace(spec)}::SpecMods" if spec.modifiers.active else "fagen::NoMods",
        # causal / sliding_window as their expression (fagen/expressions/modifiers.py MASK_KIND_TEXT), or no mask kind test
        "kind_type": f"{mods_namespace(spec)}::KindMask" if spec.kind_mask else "fagen::NoMods",
        "m_tiles": max(1, plan.block_r // (16 * plan.warps)),
        "decode_entry_points": "".join(
            f'extern "C" __global__ void __launch_bounds__({threads}) {name}_r{rows}'
            f"(const fagen::AttentionArgs args) {{\n  extern __shared__ float4 shared_raw[];\n"
            f"  {name}_rows<{rows}>(args, shared_raw);\n}}\n"
            for rows in decode_rows(plan)) if pass_name == "decode" else "",
        "warpgroup_mma_functions": "".join(
            warpgroup_mma_function(name, n_of(spec, plan), PTX_TYPES[spec.dtype], a_regs, tnsp_a,
                                   tnsp_b(spec) if callable(tnsp_b) else tnsp_b)
            for name, n_of, a_regs, tnsp_a, tnsp_b in WARPGROUP_PRODUCTS.get(plan.template, ())),
    }


def mods_namespace(spec: Spec) -> str:
    return f"fagen_mods_{spec.canonical_name}"


def mods_source(spec: Spec) -> str:
    """The spec's mask kind when it is an expression (causal, sliding_window) and its mask_mod / score_mod,
    as C++ structs (fagen/expressions/), once per file, or nothing."""
    mods, kind = spec.modifiers, spec.kind_mask
    if not mods.active and kind is None:
        return ""
    lines = [f"// {key}: {value}" for key, value in mods.record().items() if value] if mods.active else []
    if kind is not None:
        lines.append(f"// mask {spec.mask}: {kind.mask_text}")
    lines.append(f"namespace {mods_namespace(spec)} {{")
    if kind is not None:
        lines.append(mask_kind_struct(spec.mask, spec.window or 0, "KindMask"))
    if mods.active:
        lines.append(mods.cuda_struct("SpecMods", spec.scale))
    return "\n".join([*lines, f"}}  // namespace {mods_namespace(spec)}", ""])


def _header(spec: Spec, solution: Solution, passes, note: str = "") -> str:
    templates = [solution.plans[p].template for p in passes]
    plan_lines = [f"//   {p}: {solution.plans[p].template} Br={solution.plans[p].block_r} "
                  f"Bc={solution.plans[p].block_c} warps={solution.plans[p].warps} "
                  f"smem={solution.plans[p].smem_bytes} B" for p in passes]
    return "\n".join([
        f"// Generated by fagen from templates/{', templates/'.join(templates)} -- do not edit.{note}",
        f"// spec {spec.variant_name}: {spec.canonical_json()}",
        f"// plan ({solution.policy} policy, {solution.target.arch}, budget {solution.budget_bytes} B):",
        *plan_lines,
        f'#include "{COMMON_HEADER}"',
        "",
    ]) + mods_source(spec)


def _pass_body(spec: Spec, solution: Solution, pass_name: str, input_grads: bool = False) -> str:
    plan = solution.plans[pass_name]
    return (_environment.get_template(plan.template).render(template_context(spec, pass_name, plan, input_grads))
            + (spec.modifiers.summary_kernel(f"{kernel_name(spec, pass_name, plan)}_summary")
               if has_summary_kernel(spec, pass_name) else ""))


def render_input_grad_backward(spec: Spec, solution: Solution) -> str:
    """The backward pass built WITH_INPUT_GRADS: the same kernels (same symbols) that also add the gradients of
    score_mod's float tensor inputs (Modifiers.kernel_input_grads) into args.mod_grad. A module of its own,
    compiled beside the usual one (fagen/build.py compile_prepared), so that the usual one carries none of it."""
    return (_header(spec, solution, ["backward"], " (the build WITH_INPUT_GRADS)")
            + _pass_body(spec, solution, "backward", input_grads=True))


def render(spec: Spec, solution: Solution) -> Rendered:
    templates = [solution.plans[p].template for p in spec.passes]
    header = _header(spec, solution, spec.passes)
    bodies = {p: _pass_body(spec, solution, p) for p in spec.passes}
    return Rendered(
        text=header + "\n".join(bodies.values()),
        filename=f"{spec.variant_name}.cu",
        kernels={p: kernel_symbols(spec, p, solution.plans[p]) for p in spec.passes},
        templates=templates,
        include_dir=TEMPLATE_DIR,
        pass_texts={p: header + body for p, body in bodies.items()},
    )


def shared_constants_header() -> str:
    """templates/shared_constants.cuh: the constants the kernels and Python share, written from their one copy in
    Python (tools/regenerate.py writes it; tests/test_render.py fails when it is stale)."""
    from fagen.dropout import PHILOX_ROUNDS
    from fagen.expressions.names import SUMMARY_GRAIN

    kinds = ", ".join(f"{name} = {value}" for value, name in enumerate(MASK_KINDS.values()))
    return "\n".join([
        "// Generated by fagen/render.py shared_constants_header -- do not edit; tools/regenerate.py rewrites it.",
        "// The constants Python and the kernels share, each from its one copy in Python.",
        "#pragma once",
        "",
        "namespace fagen {",
        f"constexpr int PHILOX_ROUNDS = {PHILOX_ROUNDS};   // dropout's Philox rounds: fagen/dropout.py",
        f"constexpr int SUMMARY_GRAIN = {SUMMARY_GRAIN};   // positions per input summary entry: fagen/expressions/names.py",
        f"enum MaskKind {{ {kinds} }};   // Spec.mask: fagen/render.py MASK_KINDS",
        "}  // namespace fagen",
        "",
    ])
