"""Launch geometry: each pass's plan as the runtime needs it (LaunchPlan), the grids of the main kernels and their
helpers, the backward's scratch and the decode pass's split count."""
from __future__ import annotations

import math
from dataclasses import dataclass

from fagen.runtime.tensors import ArgumentError
from fagen.spec import Spec

#: The small kernels around a pass's main one(s): launched without the plan's dynamic shared memory.
_HELPER_KERNELS = ("_delta", "_dq_convert", "_kv_group_sum", "_combine", "_summary")

#: The summary kernel's grid, and the least of the backward's _delta, which writes the summaries there
#: (templates/attention_common.cuh summarise_input loops over what it does not cover).
SUMMARY_GRID = (64, 1, 1)

#: The backward's row passes (_delta, _dq_convert, _kv_group_sum; attention_common.cuh for_row_chunks) loop over
#: rows, so their grid only has to fill the GPU: at least 8 rows per block of 256 threads, at most this many blocks.
ROW_PASS_BLOCKS = 4096


def row_pass_grid(rows: int) -> tuple:
    return (max(1, min(math.ceil(rows / 8), ROW_PASS_BLOCKS)), 1, 1)


#: The most blocks a grid's y (or z) dimension holds.
GRID_YZ_LIMIT = 65535


def problem_grid(blocks_x: int, problems: int, args) -> tuple:
    """The grid of `blocks_x` blocks for each of `problems` (sequence, head) pairs, and sets
    args["problems"]. The pairs go along y; beyond what y holds they fold over z, and the kernels
    return at once from the spare blocks of the last z slice (templates/attention_common.cuh
    grid_problem)."""
    slices = -(-problems // GRID_YZ_LIMIT)
    if slices > GRID_YZ_LIMIT:
        raise ArgumentError(f"{problems} (sequence, head) pairs in one call: at most {GRID_YZ_LIMIT ** 2} are supported")
    args["problems"] = problems
    return (blocks_x, -(-problems // slices), slices)


#: A grouped-KV backward folds where fagen/sources.py folds_kv_group built it so and the folded grid
#: still has FOLD_WAVES blocks per multiprocessor (docs/decisions/0008-grid-order-and-folding.md).
FOLD_WAVES = 3

#: The forward templates that read a paged K/V cache for packed query rows (fagen::PagedRows: each key row's page
#: looked up): Hopper's warpgroup-MMA ones. Not sm_80's mma.sync forward: at its register limit, the paged loads
#: beside the contiguous ones made ptxas spill (docs/decisions/0010-paged-loads.md).
PAGED_FORWARD_TEMPLATES = ("forward_wgmma.cu.j2", "forward_wgmma_ws.cu.j2")

#: The templates whose grids run in groups of problems (grouped_grid), and the group size: where later rows
#: see more keys (Spec.keys_grow_with_rows: causal, a mask_mod) the blocks are ordered heaviest first, so a
#: group puts every problem's heavy blocks ahead of the light ones (groups of 16); without a mask, 1: the grid's
#: own order (docs/decisions/0008-grid-order-and-folding.md).
GROUPED_TEMPLATES = ("forward_wgmma.cu.j2", "forward_wgmma_ws.cu.j2", "backward_wgmma.cu.j2", "backward_wgmma_ws.cu.j2",
                     "backward_wgmma_wide.cu.j2")


#: ... except where a mask_mod lets each row see only a band of keys plus fixed ones (Modifiers.sees_a_band: a
#: window with sinks). Then a problem's heavy blocks are few (the backward's key block of the sink keys, which
#: every row sees), and all problems' heavy blocks go first, in one group. Not for a triangle or a prefix, whose
#: many heavy blocks then stream more than L2 holds at once (0008-grid-order-and-folding.md).
ALL_PROBLEMS = 1 << 30


def block_group(spec: Spec) -> int:
    if not spec.keys_grow_with_rows:
        return 1
    return ALL_PROBLEMS if spec.modifiers.sees_a_band else 16


def grouped_grid(blocks: int, problems: int, group: int, args) -> tuple:
    """The grid of a GROUPED_TEMPLATES kernel: `blocks` blocks for each of `problems` (sequence, head)
    pairs, x = the problems of a group of `group`, y = the block, z = the group (templates/
    attention_common.cuh grouped_problem); sets args["problems"]. The hardware dispatches x fastest (in practice),
    so all of a group's first blocks start before its second ones. Groups grow past `group` where z
    would exceed what it holds; the spare blocks of the last group return at once."""
    if blocks > GRID_YZ_LIMIT:
        raise ArgumentError(f"{blocks} blocks of one (sequence, head) pair: at most {GRID_YZ_LIMIT} are supported "
                            f"(a sequence of up to {GRID_YZ_LIMIT} x the block size)")
    group = max(1, min(problems, max(group, -(-problems // GRID_YZ_LIMIT))))
    args["problems"] = problems
    return (group, blocks, -(-problems // group))



def backward_scratch(rows: int, head_dim: int, deterministic: bool) -> tuple[int, int]:
    """The backward's fp32 scratch, one allocation: D_i (`rows` values, (batch, heads, seq_q)), then, unless
    the plan is deterministic, dq_accum (rows x head_dim, which the _delta kernel clears) from a 256-byte
    boundary. Returns (elements, dq_accum's offset in elements; 0 when there is none)."""
    if deterministic:
        return rows, 0
    offset = -(-rows // 64) * 64
    return offset + rows * head_dim, offset



def decode_splits(base_blocks: int, key_tiles: int, sm_count: int, blocks_per_sm: int, limit: int = 256) -> int:
    """How many splits to cut each (batch, K/V head)'s keys into for the decode kernel: the count whose
    grid fills the GPU's resident-block slots most evenly (the last wave of blocks as full as the
    others); the smallest count within 3% of the best fill, as every split costs a partial O to write
    and merge. At most one split per tile of keys."""
    slots = sm_count * blocks_per_sm
    fills = {}
    for splits in range(1, max(1, min(limit, key_tiles, 4 * math.ceil(slots / base_blocks))) + 1):
        waves = base_blocks * splits / slots
        fills[splits] = waves / math.ceil(waves)   # 1.0: every wave full; fewer blocks than slots: the share busy
    best = max(fills.values())
    return min(splits for splits, fill in fills.items() if fill >= 0.97 * best)



@dataclass(frozen=True)
class LaunchPlan:
    """What launching one pass needs of the solver's plan (a plain record: no sympy to load it)."""

    symbols: tuple      # the main kernel first, then its helpers
    block_r: int
    block_c: int
    threads: int
    smem_bytes: int
    stages: int
    tensor_cores: bool
    head_dim: int       # the d the kernels compute with (the spec's, padded up to the template's multiple):
                        # the row length of their fp32 workspaces (dq_accum, the decode splits' O)
    template: str       # which template made the kernels (their grid layout: GROUPED_TEMPLATES)
    family: str         # the solver's family of that template (fagen/solver.py FAMILIES)
    folds_heads: bool   # a backward built to walk a K/V head's group of query heads (Kernel._folds)
    tensor_map_columns: int = 0   # the kernel takes TMA tensor maps in boxes of these columns (0: none; tensor_maps.py)

    @classmethod
    def from_plan(cls, plan: dict, symbols, head_dim: int, folds_heads: bool) -> "LaunchPlan":
        return cls(tuple(symbols), plan["block_r"], plan["block_c"], plan["threads"], plan["smem_bytes"],
                   plan["stages"], plan["tensor_cores"], plan.get("head_dim") or head_dim, plan["template"],
                   plan["family"], folds_heads, plan.get("tensor_map_columns", 0))


