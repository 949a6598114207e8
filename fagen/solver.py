"""Stage 2: the tile solver (sympy).

Symbols Br, Bc (query rows and key columns of a tile), d (head dim) and W (warps per block).
Every template family declares its own footprint as sympy expressions over those symbols: the shared
memory it allocates and the registers one thread needs. The solver substitutes the spec, enumerates
the tile sizes the family can realise, keeps the ones that satisfy every constraint (footprint <=
budget, registers <= the target's ceiling, the family's multiples, block-sparse granularity) and ranks
them by the HBM traffic the loop order implies, ties broken by resident warps per multiprocessor.

The FlashAttention-1 paper's constraint Br*d + 2*Bc*d + 2*Br*Bc <= M (M in elements of the dtype)
is always evaluated and reported, and `tile_policy: paper` uses its closed form verbatim.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
from dataclasses import asdict, dataclass, field
from typing import Callable, NamedTuple, Optional

import sympy as sp

from fagen.spec import Spec, SpecError
from fagen.target import Target, target_for

Br, Bc, d, W, E = sp.symbols("Br Bc d W E", positive=True, integer=True)
Dv = sp.Symbol("Dv", positive=True, integer=True)   # V's tile width: d, or a narrower value_head_dim (value_tile_dim)
M = sp.Symbol("M", positive=True, integer=True)

#: The paper's SRAM constraint: Q_i, K_j, V_j and S, P of one (i, j) step fit in M elements.
PAPER_CONSTRAINT = sp.Le(Br * d + 2 * Bc * d + 2 * Br * Bc, M)

#: Sequence length at which traffic is compared (the ranking does not change with N for N >> tiles).
RANKING_SEQ_LEN = 4096

TILE_CHOICES = (16, 32, 64, 128)
REGISTER_OVERHEAD = 40  # indices, pointers, loop state: measured against ptxas on the SIMT templates
# Packed batches: each sequence's offsets and lengths come from cu_seqlens into registers, where a padded
# batch re-reads them from the argument bank. Calibrated against ptxas on sm_80: the d=128 mma.sync
# forward at Br=128, Bc=64 went from 255 registers without spills to 192 B of spills when packed.
PACKED_REGISTERS = 24
# mask_mod / score_mod: the inputs' pointers and sizes, the expression's temporaries. Calibrated against
# ptxas on forward_fa2_mma at d = 128 (ALiBi and soft-capping spilled 92-108 B at 255 registers without
# it). A score_mod whose derivative is not 1 also keeps it per score in the backward; nothing is reserved
# for that: at the plans the backward families have, it costs 4-32 B of spills (tests/test_compiler.py
# KNOWN_SPILLS), cheaper than the smaller tiles a reservation forces.
MODIFIER_REGISTERS = 24

# Head-dim padding weighed against the family: a warpgroup-MMA family (sm_90 only) computing d padded to its
# multiple of 32 (up to 128) ranks as if its head dim were this much smaller, so that it beats mma.sync at the next multiple
# of 16 up to a third more columns (docs/decisions/0009-head-dim-padding.md).
PREFERRED_PADDING = Fraction(4, 3)

# 1 below d = 128, 0 from there: for a reservation that must not take away a family's one plan at d = 128
_BELOW_128 = sp.Piecewise((0, sp.Ge(d, 128)), (1, True))


class InfeasibleSpec(SpecError):
    """No tile plan satisfies the constraints; the message names the constraint and a budget that works."""


@dataclass(frozen=True)
class Family:
    """A template family and the footprint it declares."""

    name: str
    template: str
    passes: tuple[str, ...]
    smem_bytes: sp.Expr              # over Br, Bc, d, W, E (element bytes) and Dv (V's tile width)
    registers: sp.Expr               # per thread
    warps: tuple[int, ...]
    stages: int = 1
    tensor_cores: bool = False
    m_tiles: tuple[int, ...] = ()    # Br == 16 * W * m for m in these (MMA row slabs per warp); (): free
    smem_reads: sp.Expr = sp.Integer(0)  # shared-memory bytes read per (query row, key) pair
    dropout_registers: object = 0    # the Philox state when dropout is on (int or sympy; calibrated against ptxas)
    packed_registers: object = PACKED_REGISTERS  # layout packed: the sequence's offsets and lengths (see above; int or sympy)
    modifier_registers: object = MODIFIER_REGISTERS  # mask_mod / score_mod (see above; int or sympy)
    # a mask_mod alone of a few integer operations (Modifiers.light_mask_mod); None: as modifier_registers
    light_mask_mod_registers: object = None
    # a mask_mod alone that reads its inputs at key positions (Modifiers.mask_reads_keys: doc[b, j]); None: as
    # modifier_registers
    key_mask_mod_registers: object = None
    min_block_c: int = 1             # smaller Bc pays two barriers per few keys
    max_block_c: int = 1 << 20       # a family may cap Bc where its register estimate stops holding
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp32")
    loop_orders: tuple[str, ...] = ("fa1", "fa2")
    any_tile: bool = True            # handles any Br, Bc (needed by the paper policy)
    head_dim_multiple: int = 8
    keys_per_warp: int = 0           # Bc == keys_per_warp * W (each warp owns its keys); 0: free
    deterministic: bool = True       # can honour `deterministic: true` (no floating-point atomics)
    rules: tuple = ()                # extra (description, predicate(Br, Bc, d, W)) tile rules of the template
    options: tuple = ()              # (name, value) pairs the template reads: variants of one template
    tag: str = ""                    # kernel-name suffix that tells such variants apart
    needs: tuple[str, ...] = ()      # the ArchFeatures (fagen/target.py) the template uses; (): every target
    preference: int = 1              # within a tier, lower ranks first: a newer instruction family beats an older one
    occupancy_first: bool = False    # rank resident warps ahead of shared-memory reads and tile size
    # (head dim, Br, Bc, W) of plans timed faster than the cost model's first choice: ranked ahead of it. The head
    # dim is the one the plan computes at, so specs padded up to it (d = 33-63 on forward_wgmma) take it as well
    timed_first: tuple = ()
    # (Br, Bc, description, predicate(spec)): tiles offered beyond TILE_CHOICES' powers of two, only as the plans
    # timed_first lists (at their head dim and warps) and to the specs the predicate holds for
    extra_tiles: tuple = ()
    tile_walk: bool = False          # the template keeps TileWalk's bits in static shared memory (walk_bytes)
    walk_warps: int = 0              # the warps that walk the tiles (TileWalk's THREADS / 32); 0: every warp
    # static shared memory besides TileWalk's: row pointers the template keeps there through its main loop
    # (block_values_in_shared, templates/attention_common.cuh), 8 bytes each
    shared_pointer_bytes: int = 0
    weighed_padding_up_to: int = 128  # the largest padded d at which PREFERRED_PADDING weighs this family (rank_key)
    spec_rules: tuple = ()           # (description, predicate(spec)): specs the template is not offered for
    tensor_maps: bool = False        # the kernel takes q's, k's and v's TMA tensor maps (Plan.tensor_map_columns)


# Footprints, byte for byte what the templates carve out of dynamic shared memory. K (and in the
# backward V) rows are padded by one 4-byte bank word, hence the 4*Bc terms.
_forward_tiles = E * (Br * d + 2 * Bc * d) + 4 * Bc + 4 * Br * Bc   # Q_i, K_j, V_j, then S/P in fp32
# O_i accumulators, about twice over once ptxas unrolls the P V loop (d=256, Br=128: 255 and spills)
_forward_registers = 2 * sp.ceiling(Br * d / (32 * W)) + REGISTER_OVERHEAD

# A latent_kv spec's v is k's first columns: decode_latent_mma alone reads it so.
_NOT_LATENT = ("not latent_kv (decode_latent_mma reads a latent cache)", lambda spec: not spec.latent_kv)

# The CUDA-core templates take any head dim. Their fp32 tiles follow the 2-byte Q/K/V tiles in shared
# memory, so with an odd d an odd Br or Bc would leave them off 4-byte alignment.
_EVEN_TILES_FOR_ODD_DIMS = ("Br and Bc even when d is odd (the fp32 tiles stay 4-byte aligned)",
                            lambda r, c, hd, w: hd % 2 == 0 or (r % 2 == 0 and c % 2 == 0))

# The tensor-core backward families' dQ = dS K_j product: Br/16 row slabs x d/8 dim tiles over W warps.
_DQ_TILES_OVER_WARPS = ("the dQ tiles (Br/16 x d/8) split over W warps in pairs of 8-dim tiles",
                        lambda r, c, hd, w: (r // 16) % w == 0 if r // 16 >= w
                        else w % (r // 16) == 0 and (hd // 8) % (2 * w // (r // 16)) == 0)

FAMILIES: tuple[Family, ...] = (
    # Hopper warpgroup MMA (wgmma, sm_90a): one 64-row slab of Q per warpgroup; Q_i and two cp.async
    # stages of K_j, V_j in swizzled shared memory (+1 KB to align the swizzle atoms), read by
    # the tensor cores through descriptors; S/P and O in registers.
    Family("forward_wgmma", "forward_wgmma.cu.j2", ("forward",),
           smem_bytes=E * (Br * d + 2 * Bc * (d + Dv)) + 1024,
           # O and S accumulators of the warp's 16 rows over 32 lanes, P~ packed in pairs, plus 32 of loop state
           # (0001-forward-wgmma-plans.md in docs/decisions: the reservations and tiles below are measured there)
           registers=Br * Dv / (32 * W) + 3 * Br * Bc / (64 * W) + 32,
           # the tensor cores read K_j, V_j once per warpgroup and Q_g once per K/V block
           smem_reads=2 * (d + Dv) * (W / 4) / Br + 2 * d / Bc,
           # Bc >= 64: at Bc = 32 the per-block barrier and softmax bookkeeping dominate
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, m_tiles=(1,), dropout_registers=8, min_block_c=64, max_block_c=128,
           packed_registers=4,
           modifier_registers=12,
           light_mask_mod_registers=0,   # prefix-LM, window + sinks, dilated: three resident blocks at d = 64
           key_mask_mod_registers=8,     # documents: tested ahead of the tile (MASK_AHEAD) at three blocks
           dtypes=("fp16", "bf16"), loop_orders=("fa2",), any_tile=False, head_dim_multiple=32, needs=("warpgroup_mma",),
           # warpgroups of other blocks fill the tensor cores while one runs its softmax: a second resident block
           # before a larger Bc
           preference=0, occupancy_first=True,
           # V_j's tiles and O's accumulators as wide as a value_head_dim narrower than head_dim (value_tile_dim;
           # docs/decisions/0012-value-head-dim.md)
           options=(("narrow_values", True),),
           # timed first: d = 64 on one warpgroup per 64-row block, d = 192 at 112 keys a block, and d = 128's 64 x 64
           # for the specs forward_wgmma_ws leaves here
           timed_first=((64, 64, 128, 4), (192, 128, 112, 8), (128, 64, 64, 4)),
           extra_tiles=((128, 112, "Bc = 112 only at d = 192 (and what pads to it), without a mask_mod read through "
                                   "run-time summaries (spills)", lambda spec: not spec.modifiers.summaries),)),
    # The same template in fp8 (e4m3, FP8 wgmma's k-steps of 32): Q_i and two cp.async stages of K_j and of V_j as
    # they are in memory, plus two of V_j^T, which every thread writes from V_j's stage during S_j's softmax (FP8
    # wgmma reads B K-major only), so Bc is whole 64-byte panels of V^T's rows. The plan space is forward_wgmma's.
    Family("forward_wgmma_fp8", "forward_wgmma.cu.j2", ("forward",),
           smem_bytes=E * (Br * d + 2 * Bc * (d + Dv) + 2 * Bc * Dv) + 1024,
           registers=Br * Dv / (32 * W) + 3 * Br * Bc / (64 * W) + 32,
           smem_reads=2 * (d + Dv) * (W / 4) / Br + 2 * d / Bc,
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, m_tiles=(1,), dropout_registers=8, min_block_c=64,
           max_block_c=128, packed_registers=4, modifier_registers=12, light_mask_mod_registers=0,
           key_mask_mod_registers=8, dtypes=("fp8_e4m3",), loop_orders=("fa2",), any_tile=False, head_dim_multiple=64,
           needs=("warpgroup_mma", "fp8_mma"), preference=0, occupancy_first=True,
           # d = 128 on one warpgroup per 64-row block, two blocks per SM (docs/decisions/0013-fp8-forward.md)
           timed_first=((128, 64, 128, 4),),
           rules=(("Bc a multiple of 64 (V^T's rows whole 64-byte panels)", lambda r, c, hd, w: c % 64 == 0),)),
    # Hopper warpgroup MMA, warp-specialized: warpgroup 0 loads (cp.async into two stages of K_j and of V_j,
    # handed over by mbarriers), warpgroups 1 and 2 compute 64 rows each as forward_wgmma's do, taking turns
    # at the tensor cores. One block per multiprocessor; the producer gives its registers to the consumers
    # (setmaxnreg: 56 and 224 per thread). Ranked ahead of forward_wgmma (preference -1) at d = 128 only, where
    # it was timed faster (docs/decisions/0002-forward-wgmma-ws.md).
    Family("forward_wgmma_ws", "forward_wgmma_ws.cu.j2", ("forward",),
           smem_bytes=E * (Br * d + 2 * 2 * Bc * d) + 1024 + 72 + 12,   # + the mbarriers, the walk's hand-over words
           registers=sp.Integer(168),   # every thread of the block at launch: 64 K registers over 384 threads
           smem_reads=2 * 2 * d * ((W - 4) / 4) / Br + 2 * d / Bc,
           warps=(12,), stages=2, tensor_cores=True, tile_walk=True, min_block_c=64, max_block_c=128,
           dropout_registers=0, packed_registers=0, modifier_registers=0,
           dtypes=("fp16", "bf16"), loop_orders=("fa2",), any_tile=False, head_dim_multiple=32,
           needs=("warpgroup_mma", "setmaxnreg", "tma"), tensor_maps=True,
           preference=-1, occupancy_first=True, tag="_ws",
           walk_warps=4,   # the producer warpgroup walks alone (templates/forward_wgmma_ws.cu.j2)
           rules=(("Br = 64 rows per consumer warpgroup", lambda r, c, hd, w: r == 64 * (w // 4 - 1)),
                  # O and S accumulators, P~ in pairs, 32 of state: the consumers' 224 registers
                  ("the consumers' registers: Br d / 32 (W - 4) + 3 Br Bc / 64 (W - 4) + 32 <= 224",
                   lambda r, c, hd, w: r * hd / (32 * (w - 4)) + 3 * r * c / (64 * (w - 4)) + 32 <= 224),
                  ("d = 128 (timed faster there only)", lambda r, c, hd, w: hd == 128)),
           # a mask_mod reading inputs at key positions leaves a row block few visible key blocks, and one 128-row
           # block per SM leaves each block's start and end exposed (0002-forward-wgmma-ws.md)
           spec_rules=(("not a mask_mod that reads inputs at key positions (documents: forward_wgmma's 64 x 64 at two "
                        "blocks, timed faster)", lambda spec: not spec.modifiers.mask_reads_keys),)),
    # The same template in fp8 (e4m3): the producer warpgroup also writes V_j^T from V_j's stage once it landed
    # (FP8 wgmma reads B K-major only), into STAGES V^T buffers of their own; the consumers compute as the 16-bit
    # ones do, on FP8 wgmma's k-steps of 32.
    Family("forward_wgmma_ws_fp8", "forward_wgmma_ws.cu.j2", ("forward",),
           smem_bytes=E * (Br * d + 3 * 2 * Bc * d) + 1024 + 72 + 16 + 16,   # + the walk's words padded, V landed
           registers=sp.Integer(168),
           smem_reads=2 * 2 * d * ((W - 4) / 4) / Br + 2 * d / Bc,
           warps=(12,), stages=2, tensor_cores=True, tile_walk=True, min_block_c=64, max_block_c=128,
           dropout_registers=0, packed_registers=0, modifier_registers=0,
           dtypes=("fp8_e4m3",), loop_orders=("fa2",), any_tile=False, head_dim_multiple=64,
           needs=("warpgroup_mma", "fp8_mma", "setmaxnreg", "tma"), tensor_maps=True,
           preference=-1, occupancy_first=True, tag="_ws", walk_warps=4,
           rules=(("Br = 64 rows per consumer warpgroup", lambda r, c, hd, w: r == 64 * (w // 4 - 1)),
                  ("the consumers' registers: Br d / 32 (W - 4) + 3 Br Bc / 64 (W - 4) + 32 <= 224",
                   lambda r, c, hd, w: r * hd / (32 * (w - 4)) + 3 * r * c / (64 * (w - 4)) + 32 <= 224),
                  ("Bc a multiple of 64 (V^T's rows whole 64-byte panels)", lambda r, c, hd, w: c % 64 == 0),
                  ("d = 128", lambda r, c, hd, w: hd == 128)),
           spec_rules=(("not a mask_mod that reads inputs at key positions (documents: forward_wgmma's 64 x 64 at two "
                        "blocks, timed faster)", lambda spec: not spec.modifiers.mask_reads_keys),)),
    # Tensor cores (mma.sync m16n8k16): one 16-row slab of Q per warp held in registers, S/P and O in
    # registers; shared memory holds Q_i and two cp.async stages of K_j, V_j, rows padded by 16 bytes.
    Family("forward_fa2_mma", "forward_fa2_mma.cu.j2", ("forward",),
           shared_pointer_bytes=32,   # the rows of K, V, O and LSE (block_values_in_shared)
           smem_bytes=E * (Br * (d + 8) + 2 * 2 * Bc * (d + 8)),
           # Q fragments (bf16 pairs), O and S accumulators of the warp's Br/W rows, spread over 32 lanes, + 16 for
           # a second 16-row slab per warp (docs/decisions/0003-mma-sync-register-estimates.md)
           registers=Br * d / (64 * W) + Br * d / (32 * W) + Br * Bc / (32 * W) + REGISTER_OVERHEAD + 16 * (Br / (16 * W) - 1),
           # every warp reads all of K_j and V_j from shared memory: bytes per (query row, key) pair
           smem_reads=2 * 2 * d * W / Br,
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, m_tiles=(1, 2), dropout_registers=56, min_block_c=32, max_block_c=128,
           dtypes=("fp16", "bf16"), loop_orders=("fa2",), any_tile=False, head_dim_multiple=16,
           options=(("q_in_registers", "true"),)),
    # The same template with Q_w re-read from shared memory at every k-step: frees the Q registers so
    # that large head dims can still run two 16-row slabs per warp (each K/V fragment feeds two MMAs).
    Family("forward_fa2_mma_qsmem", "forward_fa2_mma.cu.j2", ("forward",),
           shared_pointer_bytes=32,   # the rows of K, V, O and LSE (block_values_in_shared)
           smem_bytes=E * (Br * (d + 8) + 2 * 2 * Bc * (d + 8)),
           registers=Br * d / (32 * W) + Br * Bc / (32 * W) + REGISTER_OVERHEAD,
           smem_reads=2 * 2 * d * W / Br + 2 * d / Bc,
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, m_tiles=(1, 2), dropout_registers=56, min_block_c=32, max_block_c=128,
           dtypes=("fp16", "bf16"), loop_orders=("fa2",), any_tile=False, head_dim_multiple=16,
           options=(("q_in_registers", "false"),), tag="_qs"),
    # Hopper warpgroup MMA, K_j/V_j outer: 64 keys per warpgroup (16 per warp, the layout of
    # backward_fa2_mma); K_j, V_j, two cp.async stages of Q_i, dO_i and the dS^T tile in swizzled
    # shared memory (+1 KB to align), LSE_i and D_i in fp32; dQ through fp32 atomics (from a per-warp tile in
    # shared memory).
    Family("backward_wgmma", "backward_wgmma.cu.j2", ("backward",),
           # + each warp's dQ_i staging: 16 rows x (64 dims, or d where dQ splits by rows) in fp32, 32 bytes of padding per row
           smem_bytes=E * (2 * Bc * d + 2 * 2 * Br * d + Bc * Br) + 2 * 2 * 4 * Br + 1024
           + 16 * W * (4 * sp.Piecewise((d, sp.Eq(Br, 16 * W)), (64, True)) + 32),
           # dK, dV (16 x d each over 32 lanes) + S^T, dP^T (16 x Br each) + the warpgroup's dQ tile (64 x d by rows,
           # 64 x 64 by dims, over 128 lanes) + 24: ptxas on sm_90a gives 247-248 at d + Br = 192 (d = 128, Br = 64, 8 warps)
           registers=d + Br + sp.Piecewise((32, Br < 16 * W), (Br * d / (32 * W), True)) + 24,
           smem_reads=E * (W / 4 * (2 * 64 * d + 4 * Br * d) + Br * Bc + Bc * d) / (Br * Bc),
           # dropout: the keep decisions as a bit mask, Philox in a rolled loop
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, dropout_registers=4,
           # none at d = 128, where the template has one plan: the fallback a reservation led to was slower than
           # this plan's spills (docs/decisions/0004-backward-wgmma-registers.md)
           packed_registers=4 * _BELOW_128, modifier_registers=4 * _BELOW_128,
           dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=32, keys_per_warp=16, deterministic=False,
           needs=("warpgroup_mma",), preference=0,
           rules=(("dQ splits over warpgroups: Br = 64 per warpgroup, or Br = 64 and d = 64 per warpgroup (the "
                   "last one 32: d = 96 over two)", lambda r, c, hd, w: r == 16 * w or (r == 64 and 16 * w - 32 <= hd <= 16 * w)),)),
    # backward_wgmma warp-specialized (FlashAttention-3's split of roles): warpgroup 0 loads (K_j, V_j once, Q_i,
    # dO_i, LSE_i, D_i into two stages handed over by mbarriers), warpgroups 1 and 2 compute 64 keys each with
    # backward_wgmma's row-block loop; two dS^T tiles (one per stage), so that the consumers meet once a step
    # (before dQ) and the block never. One block per multiprocessor; the producer gives its registers to the
    # consumers (setmaxnreg: 40 and 232 per thread). Ranked ahead of backward_wgmma (preference -1): faster on
    # every shape timed (docs/decisions/0005-backward-wgmma-ws.md).
    Family("backward_wgmma_ws", "backward_wgmma_ws.cu.j2", ("backward",),
           # backward_wgmma's footprint over the 8 consumer warps, a second dS^T, 5 mbarriers, 3 hand-over words
           smem_bytes=E * (2 * Bc * d + 2 * 2 * Br * d + 2 * Bc * Br) + 2 * 2 * 4 * Br + 1024
           + 16 * (W - 4) * (4 * sp.Piecewise((d, sp.Eq(Br, 16 * (W - 4))), (64, True)) + 32) + 40 + 12,
           registers=sp.Integer(168),   # every thread of the block at launch: 64 K registers over 384 threads
           smem_reads=E * ((W - 4) / 4 * (2 * 64 * d + 4 * Br * d) + Br * Bc + Bc * d) / (Br * Bc),
           warps=(12,), stages=2, tensor_cores=True, tile_walk=True, dropout_registers=0, packed_registers=0,
           modifier_registers=0, dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=32, deterministic=False,
           needs=("warpgroup_mma", "setmaxnreg", "tma"), tensor_maps=True, preference=-1, occupancy_first=True,
           tag="_ws",
           # a mask_mod's elements tested ahead of the score products (templates/backward_wgmma_rows.cu.j2): beside
           # S^T and dP^T its loads spilled the consumers' 232 registers
           options=(("mask_bits_ahead", True),),
           walk_warps=4,   # the producer warpgroup walks alone (templates/backward_wgmma_key_block.cu.j2)
           # where ptxas spilled, in the consumers' 232 registers or the producer's 40 (0005-backward-wgmma-ws.md)
           spec_rules=(("a score_mod only where sympy's d score_mod / d score is 1 (an additive bias: ALiBi, a bias "
                        "table; soft-capping's tanh spilled 224-1028 B at d = 64, 128)",
                        lambda spec: not spec.score_mod or spec.modifiers.score_grad == 1),
                       ("no score_mod with dropout (ALiBi spilled 140-284 B, a bias table 64-164 B)",
                        lambda spec: not (spec.score_mod and spec.dropout)),
                       ("a mask_mod whose tiles are decided by run-time summaries (document ids) only at d = 64 or 128 "
                        "on padded batches (spill-free there since the summaries' bounds count in int; d = 40: 44 B, "
                        "d = 96: 28-32 B, packed d = 64: 4-180 B)",
                        lambda spec: not spec.modifiers.summaries or (spec.layout == "padded" and spec.compute_dim in (64, 128))),
                       ("no mask_mod with dropout above d = 96 (12 B at d = 128)",
                        lambda spec: not (spec.mask_mod and spec.dropout and spec.compute_dim > 96)),
                       ("no block-sparse mask (the producer's walk spilled 4-40 B, with dropout 24 B more)",
                        lambda spec: spec.mask != "block_sparse"),
                       ("no dropout on a head dim padded up (d = 99-127 with dropout, packed or padding: 4 B)",
                        lambda spec: not (spec.dropout and spec.compute_dim % 32))),
           rules=(("64 keys per consumer warpgroup", lambda r, c, hd, w: c == 64 * (w // 4 - 1)),
                  ("dQ splits over the consumers: Br = 64 per consumer, or Br = 64 and d = 64 per consumer (the "
                   "last one 32: d = 96 over two)", lambda r, c, hd, w: r == 16 * (w - 4) or
                   (r == 64 and 16 * (w - 4) - 32 <= hd <= 16 * (w - 4))),
                  # (d = 32 not timed; above 128 the consumers cannot hold dK, dV of 64 keys)
                  ("head dims 64 to 128 (where it was timed)", lambda r, c, hd, w: 64 <= hd <= 128))),
    # Hopper warpgroup MMA for head dims whose dK, dV do not fit one warpgroup's registers (d > 128): the 64 keys
    # of a block shared by the warpgroups, which split S^T, dP^T by queries and dK, dV, dQ by dims (whole swizzle
    # panels each: d a multiple of 64); P_drop^T and dS^T through shared memory (Bc x Br each, swizzled) as the A
    # operand of dV, dK; dQ's atomics from the registers. K_j, V_j, two stages of Q_i, dO_i as in backward_wgmma.
    Family("backward_wgmma_wide", "backward_wgmma_wide.cu.j2", ("backward",),
           smem_bytes=E * (2 * Bc * d + 2 * 2 * Br * d + 2 * Bc * Br) + 2 * 2 * 4 * Br + 1024,
           # dK, dV (64 keys x d/G each over a warpgroup's 128 lanes, G = W/4 warpgroups) + the larger of S^T,
           # dP^T (64 keys x Br/G each) and the dQ tile (Br x d/G), which do not live at once, + 40 of state
           registers=Bc * (d + Dv) / (32 * W) + sp.Max(2 * Bc * Br / (32 * W), Br * d / (32 * W)) + 40,
           # S^T, dP^T: K_j, V_j per warpgroup and Q, dO once; dV, dK: P^T, dS^T per warpgroup and Q, dO once;
           # dQ: dS per warpgroup and K_j once
           smem_reads=E * (W / 4 * (2 * Bc * d + 2 * Bc * Br + Br * Bc) + 2 * Br * d + 2 * Br * d + Bc * d) / (Br * Bc),
           warps=(8,), min_block_c=64, max_block_c=64, stages=2, tensor_cores=True, tile_walk=True,
           dropout_registers=4, packed_registers=4, modifier_registers=4,
           dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=64, deterministic=False,
           needs=("warpgroup_mma",), preference=0, weighed_padding_up_to=256,
           # dV's accumulators as wide as a narrower value_head_dim, each warpgroup's share on a panel (value_tile_dim)
           options=(("narrow_values", "per_warpgroup"),),
           # at d = 97-128 also for block-sparse masks of 64-key blocks, which backward_wgmma's 128 keys there do not
           # divide (docs/decisions/0006-backward-wgmma-wide-block-sparse.md)
           # (The user's d, where the tile rule it replaced read the padded one: no d <= 128 reaches 192 or 256 here.)
           spec_rules=(("head dims above 128, or above 96 with a block-sparse mask of 64-key blocks (where "
                        "backward_wgmma holds dK, dV in one warpgroup and its key blocks divide the mask's)",
                        lambda spec: spec.compute_dim > 128 or (spec.mask == "block_sparse" and spec.compute_dim > 96
                                                             and spec.block_size < 128)),),
           rules=(("Br = 64: 32 queries of S^T per warpgroup", lambda r, c, hd, w: r == 64),)),
    # Tensor cores, K_j/V_j outer: 16 keys per warp, S^T, dP^T, dS^T and the warp's dK, dV accumulators
    # in registers; Q_i, dO_i, LSE_i, D_i in two cp.async stages, dS^T through shared memory for dQ
    # (fp32 atomics, hence no deterministic mode).
    Family("backward_fa2_mma", "backward_fa2_mma.cu.j2", ("backward",),
           shared_pointer_bytes=56,   # the rows of Q, dO, LSE, D, dQ, dK, dV (block_values_in_shared)
           smem_bytes=2 * 2 * 4 * Br + E * (2 * Bc * (d + 8) + 2 * 2 * Br * (d + 8) + Bc * (Br + 8)),
           # dK, dV (16 x d each) + S^T, dP^T (16 x Br each) over 32 lanes; the dQ tile reuses S^T's registers;
           # the overhead and the dropout term calibrated against ptxas (docs/decisions/0003-mma-sync-register-estimates.md)
           registers=d + sp.Max(Br, Br * d / (32 * W)) + 60,
           # per step: every warp reads K_w, V_w once and Q_i, dO_i twice; the dQ product reads dS and K_j
           smem_reads=E * (W * (32 * d + 4 * Br * d) + Br * Bc * sp.Max(1, 16 * W / Br) + Bc * d * sp.Min(W, Br / 16))
           / (Br * Bc),
           warps=(4, 8), stages=2, tensor_cores=True, tile_walk=True, dropout_registers=Br / 2,
           dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=16, keys_per_warp=16, deterministic=False,
           rules=(_DQ_TILES_OVER_WARPS,)),
    # The same loop order for head dims whose dK, dV do not fit one warp's registers (d >= 160): the W / (Bc/16)
    # warps of a 16-key slab split the queries of S^T; dK, dV are split by dims over the warps of 16 or 32
    # keys (the template's KV_M); P_drop^T and dS^T go through shared memory (Bc x Br each) from one layout
    # to the other. A fallback: ranked after the families that keep S^T in the registers that use it.
    Family("backward_fa2_mma_wide", "backward_fa2_mma_wide.cu.j2", ("backward",),
           shared_pointer_bytes=56,   # the rows of Q, dO, LSE, D, dQ, dK, dV (block_values_in_shared)
           smem_bytes=2 * 2 * 4 * Br + E * (2 * Bc * (d + 8) + 2 * 2 * Br * (d + 8) + 2 * Bc * (Br + 8)),
           # dK, dV (16 keys x d/SPLIT each) + S^T, dP^T (16 keys x Br/SPLIT each) over 32 lanes, SPLIT = 16W/Bc,
           # + a 16 x 64 dQ chunk (32, where the dims split that way) + loop state and addresses
           registers=(d + Br) * Bc / (16 * W) + 76,
           # S^T, dP^T: K_w, V_w and the warp's Q, dO rows; dK, dV: P^T, dS^T and the warp's Q, dO dims; dQ: dS, K_j
           smem_reads=E * (d * (32 * W + 2 * Br * Bc / 16) + 32 * W * Br + 2 * Br * d * Bc / 16
                           + Br * Bc * sp.Max(1, 16 * W / Br) + Bc * d * sp.Min(W, Br / 16)) / (Br * Bc),
           # The template takes other Bc and W (its static_asserts check the layouts); the solver offers the
           # shape the GPU tests have run: 8 warps over 64 keys (two warps per 16-key slab), d > 128
           warps=(8,), min_block_c=64, max_block_c=64, stages=2, tensor_cores=True, tile_walk=True,
           dropout_registers=Br * Bc / (32 * W),
           dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=32, deterministic=False, preference=2,
           rules=(("head dims above 128 (at 128 and below the families above hold dK, dV in one warp)",
                   lambda r, c, hd, w: hd > 128),
                  ("the two warps of a 16-key slab take half the queries each, in pairs of 8-wide tiles: Br a "
                   "multiple of 32", lambda r, c, hd, w: r % 32 == 0),
                  _DQ_TILES_OVER_WARPS)),
    # Split-KV decoding from a latent cache (MLA: v is k's first Dv columns): 16 query rows per block (a K/V head's
    # group in chunks of 16), Q and STAGES cp.async stages of K_j in shared memory, P~ shared between the warps:
    # warp w scores keys [w Bc/W, (w+1) Bc/W) and accumulates O's columns [w Dv/W, (w+1) Dv/W).
    Family("decode_latent_mma", "decode_latent_mma.cu.j2", ("decode",),
           smem_bytes=E * (Br * (d + 8) + 2 * Bc * (d + 8) + Br * (Bc + 8)) + 4 * W * Br,
           # O's columns of the warp (Dv / 2W), S of its keys (Bc / 2W), a Q and a P fragment
           registers=Dv / (2 * W) + Bc / W + 16 + REGISTER_OVERHEAD,
           warps=(4, 8), stages=2, tensor_cores=True, dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=32,
           loop_orders=("fa2",), preference=0, occupancy_first=True, options=(("narrow_values", True),),
           rules=(("Br = 16: one MMA row slab", lambda r, c, hd, w: r == 16),
                  ("Bc = 32 or 64, 8 or 16 keys per warp (a 64-row page holds whole tiles)",
                   lambda r, c, hd, w: c in (32, 64) and c // w in (8, 16))),
           # two resident blocks of 32 keys and 4 warps beat one of 64 keys and 8 (0014-latent-decode.md)
           timed_first=((576, 16, 32, 4),),
           spec_rules=(("latent_kv specs (v is k's first columns)", lambda spec: spec.latent_kv),)),
    # Split-KV decoding on tensor cores: the block's 16 rows (every query of a K/V head group, padded) as
    # register A fragments, Bc / W keys per warp with the warp's own softmax; Q, two cp.async stages of
    # K_j, V_j (rows padded by 16 bytes); the warps' (m, l, O) merge over the K/V tiles at the end.
    Family("decode_splitkv_mma", "decode_splitkv_mma.cu.j2", ("decode",),
           smem_bytes=E * (Br * (d + 8) + 2 * 2 * Bc * (d + 8)),
           # Q fragments (d/4), O accumulators (d/2), S of the warp's keys (Bc / 2W)
           registers=d / 4 + d / 2 + Bc / (2 * W) + REGISTER_OVERHEAD,
           warps=(4, 8), stages=2, tensor_cores=True, dtypes=("fp16", "bf16"), any_tile=False, head_dim_multiple=16,
           # a decode block streams K/V: more resident warps hide more of the memory latency
           preference=0, occupancy_first=True,
           rules=(("Br = 16: one MMA row slab", lambda r, c, hd, w: r == 16),
                  ("Bc / W in (16, 32, 64) keys per warp", lambda r, c, hd, w: c in (16 * w, 32 * w, 64 * w))),
           spec_rules=(_NOT_LATENT,)),
    # Split-KV decoding (Nq small): Br = the rows of the largest instance (group x Nq <= 16), one key per
    # thread (Bc = 32 W); two cp.async stages of K_j, V_j with rows padded by 16 bytes, Q in fp32; the
    # warps' (m, l, O) merge over the K/V tiles once the loop is done. Per thread: S and O of every row.
    Family("decode_splitkv", "decode_splitkv.cu.j2", ("decode",),
           smem_bytes=sp.Max(2 * 2 * Bc * (E * d + 16), 4 * W * Br * (d + 2)) + 4 * Br * d,
           registers=Br * sp.ceiling(d / 32) + 3 * Br + REGISTER_OVERHEAD,
           warps=(2, 4), stages=2, keys_per_warp=32, any_tile=False, head_dim_multiple=8,
           rules=(("Br = 16: the largest instance holds 16 rows", lambda r, c, hd, w: r == 16),),
           spec_rules=(_NOT_LATENT,)),
    # FlashAttention-2 order: O accumulates in registers; m, l and the rescale factor per row.
    Family("forward_fa2_simt", "forward_fa2_simt.cu.j2", ("forward",),
           smem_bytes=_forward_tiles + 3 * 4 * Br, registers=_forward_registers,
           warps=(4, 8), loop_orders=("fa2",), head_dim_multiple=1, rules=(_EVEN_TILES_FOR_ODD_DIMS,)),
    # FlashAttention-1 Algorithm 1: O/l/m live in HBM between (i, j) steps; m~, l~ and two weights per row.
    Family("forward_fa1_simt", "forward_fa1_simt.cu.j2", ("forward",),
           smem_bytes=_forward_tiles + 4 * 4 * Br, registers=_forward_registers,
           warps=(4, 8), loop_orders=("fa1",), head_dim_multiple=1, rules=(_EVEN_TILES_FOR_ODD_DIMS,)),
    # FlashAttention-1 Algorithm 4: Q_i, dO_i, K_j, V_j in the dtype, P and dS as fp32 tiles, LSE and D
    # per row; dK_j, dV_j accumulate in registers (and dQ_i in the deterministic second pass).
    Family("backward_simt", "backward_simt.cu.j2", ("backward",),
           smem_bytes=E * (2 * Br * d + 2 * Bc * d) + 8 * Bc + 8 * Br * Bc + 2 * 4 * Br,
           # ~5 registers per dK/dV accumulator pair (docs/decisions/0003-mma-sync-register-estimates.md)
           registers=sp.Max(5 * sp.ceiling(Bc * d / (32 * W)) + 16, sp.ceiling(Br * d / (32 * W)) + REGISTER_OVERHEAD),
           warps=(4, 8), head_dim_multiple=1, rules=(_EVEN_TILES_FOR_ODD_DIMS,)),
)


@dataclass(frozen=True)
class Plan:
    family: str
    template: str
    block_r: int
    block_c: int
    warps: int
    stages: int
    threads: int
    smem_bytes: int
    registers_estimate: int
    hbm_bytes: int
    resident_warps: int
    smem_reads: int = 0
    tensor_cores: bool = False
    head_dim: int = 0                # the d the template computes with: the spec's, padded up to the family's multiple
    # where the kernel takes TMA tensor maps (Family.tensor_maps), their boxes' columns: one panel of the tiles'
    # Swizzle (128 bytes, or 64 where d's rows are an odd number of 64 bytes); 0: no tensor maps
    tensor_map_columns: int = 0

    def rank_fields(self, data_dim: int = 0) -> tuple[tuple[str, object], ...]:
        """(name, value) pairs, lower is better, compared in order: head-dim padding, the family's preference, timed
        first, HBM traffic, then shared-memory reads per row, occupancy and bigger tiles (for tensor-core plans bigger
        tiles before occupancy: fewer barriers per key; occupancy_first families occupancy first), fewer warps. `data_dim`: the spec's
        head dim (0: not known, taken as even)."""
        family = family_named(self.family)
        # first the head-dim padding, weighed by the family (PREFERRED_PADDING): d = 72 computes as 96 on wgmma.
        # Not for an odd d (its rows load element by element), nor above 128 but for the wide backward (its
        # weighed_padding_up_to: d = 129-160 run as 192, d = 193-224 as 256): 0009-head-dim-padding.md.
        weighed = ("warpgroup_mma" in family.needs and family.tensor_cores and data_dim % 2 == 0
                   and self.head_dim <= family.weighed_padding_up_to)
        head_dim = Fraction(self.head_dim) / (PREFERRED_PADDING if weighed else 1)
        # a plan timed faster than the cost model's choice (Family.timed_first) goes ahead of the cost model
        untimed = (self.head_dim, self.block_r, self.block_c, self.warps) not in family.timed_first
        padding, preference, timed, hbm = ("padding", head_dim), ("preference", family.preference), ("timed", untimed), \
            ("hbm", self.hbm_bytes)
        resident, reads = ("resident", -self.resident_warps), ("reads", self.smem_reads)
        tile, warps = ("tile", -self.block_r * self.block_c), ("warps", self.warps)
        if family.occupancy_first:
            return padding, preference, timed, hbm, resident, reads, tile, warps
        if self.tensor_cores:  # timed on H100: a bigger tile beats a third resident block
            return padding, preference, timed, hbm, reads, tile, resident, warps
        return padding, timed, hbm, reads, resident, tile, warps

    def rank_key(self, data_dim: int = 0) -> tuple:
        """rank_fields' values: what the solver sorts plans by."""
        return tuple(value for _, value in self.rank_fields(data_dim))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Solution:
    spec: Spec
    policy: str
    target: Target
    budget_bytes: int
    plans: dict[str, Plan]
    candidates: dict[str, tuple[Plan, ...]]
    paper: dict = field(default_factory=dict)

    @property
    def primary(self) -> Plan:
        return self.plans[_primary_pass(self.plans)]

    def to_dict(self) -> dict:
        primary = self.primary
        return {
            "name": self.spec.variant_name,
            "policy": self.policy,
            "arch": self.target.arch,
            "budget_bytes": self.budget_bytes,
            "template": primary.template,
            "block_r": primary.block_r,
            "block_c": primary.block_c,
            "warps": primary.warps,
            "stages": primary.stages,
            "smem_bytes": primary.smem_bytes,
            "constraint": self.paper,
            "candidates": [c.to_dict() for c in self.candidates[_primary_pass(self.plans)][:8]],
            "passes": {name: {**plan.to_dict(), "candidates": [c.to_dict() for c in self.candidates[name][:8]]}
                       for name, plan in self.plans.items()},
        }


def _primary_pass(plans: dict) -> str:
    """The pass a report leads with: the forward, else the backward, else the decode pass (a latent_kv spec's)."""
    return next(p for p in ("forward", "backward", "decode") if p in plans)


# ---- the families' expressions, compiled once ------------------------------------------------
# sympy derives each footprint once; a solve then weighs ~100-200 candidate tiles. Substituting into the
# expressions for each one made a solve cost ~0.3-0.8 s, so each family's expressions are turned into one
# plain Python function (sympy.lambdify) the first time the family is used, and candidates are evaluated
# with Python numbers.
#
# The functions compute in floats where sympy computed exact rationals. Every expression here is a
# rational function of tile sizes and warps with small integer coefficients, so its exact value is
# either an integer or at least 1/denominator away from one (denominators are products of Br, Bc, W
# and small powers of two: below 1e9 for tiles up to 1024), while float round-off at these magnitudes
# is ~1e-12. Snapping values within _ROUND_OFF of an integer to it therefore gives sympy's exact
# ceiling and int(); tests/test_solver.py checks them against sympy's substitution.
_ROUND_OFF = 1e-10


def _exact_ceiling(value) -> int:
    nearest = round(value)
    return nearest if abs(value - nearest) < _ROUND_OFF else math.ceil(value)


def _exact_int(value) -> int:
    nearest = round(value)
    return nearest if abs(value - nearest) < _ROUND_OFF else int(value)


class _CompiledFamily(NamedTuple):   # a NamedTuple, not a dataclass: cheaper to define at import
    family: Family
    # (Br, Bc, d, W, E, Dv) -> [shared-memory bytes, registers, dropout registers, shared-memory reads, modifier
    # registers, packed registers, light mask_mod registers, key-reading mask_mod registers]
    footprint: Callable
    smem_text: str        # the expressions as the infeasibility messages print them
    registers_text: str


_COMPILED: dict[int, _CompiledFamily] = {}   # by id(family): hashing a Family would hash all its expressions


def _compiled(family: Family) -> _CompiledFamily:
    entry = _COMPILED.get(id(family))
    if entry is None or entry.family is not family:
        # sympy's ceiling made opaque, so that lambdify calls _exact_ceiling instead of math.ceil on a float
        ceiling_of = sp.Function("exact_ceiling")
        light = family.modifier_registers if family.light_mask_mod_registers is None else family.light_mask_mod_registers
        keys = family.modifier_registers if family.key_mask_mod_registers is None else family.key_mask_mod_registers
        expressions = [sp.sympify(e).replace(sp.ceiling, ceiling_of) for e in
                       (family.smem_bytes, family.registers, family.dropout_registers, family.smem_reads,
                        family.modifier_registers, family.packed_registers, light, keys)]
        footprint = sp.lambdify((Br, Bc, d, W, E, Dv), expressions,
                                modules=[{"exact_ceiling": _exact_ceiling}, "math"])
        entry = _CompiledFamily(family, footprint, str(family.smem_bytes), str(family.registers))
        _COMPILED[id(family)] = entry
    return entry


@functools.lru_cache(maxsize=None)
def _paper_compiled() -> tuple:
    """(the paper constraint's left side as a function of (Br, Bc, d), the constraint as text)."""
    return sp.lambdify((Br, Bc, d), PAPER_CONSTRAINT.lhs, modules="math"), str(PAPER_CONSTRAINT)


# ---- the paper ------------------------------------------------------------------------------
def paper_tiles(head_dim: int, m_elements: int) -> tuple[int, int]:
    """FlashAttention-1's closed form: Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d)."""
    block_c = math.ceil(m_elements / (4 * head_dim))
    return min(block_c, head_dim), block_c


def paper_report(head_dim: int, m_elements: int, block_r: int, block_c: int) -> dict:
    lhs_of, text = _paper_compiled()
    lhs = _exact_int(lhs_of(block_r, block_c, head_dim))
    return {"expression": text, "lhs": lhs, "rhs": m_elements, "holds": lhs <= m_elements,
            "block_r": block_r, "block_c": block_c}


# ---- traffic models -------------------------------------------------------------------------
def hbm_bytes(spec: Spec, pass_name: str, block_r: int, block_c: int, n: int = RANKING_SEQ_LEN) -> int:
    """Bytes the loop order moves through HBM for one (batch, head) at Nq = Nk = n."""
    e, hd = spec.element_bytes, spec.compute_dim
    row_blocks, col_blocks = math.ceil(n / block_r), math.ceil(n / block_c)
    if pass_name == "decode":
        # K and V (a latent cache: K alone) read once per K/V head group, Q read and O, LSE written once (the
        # split partials are small).
        return (1 if spec.latent_kv else 2) * e * n * hd + e * n * hd * 2 + 4 * n
    if pass_name == "forward" and spec.loop_order == "fa2":
        # Q read and O, LSE written once; K and V read once per Q row block.
        return e * n * hd * 2 + 4 * n + row_blocks * 2 * e * n * hd
    if pass_name == "forward":
        # K, V read once; per column block, Q read and O (fp32), l, m read and written.
        return 2 * e * n * hd + col_blocks * (e * n * hd + 2 * 4 * n * hd + 4 * 4 * n) + e * n * hd + 4 * n
    # Algorithm 4: K, V read, dK, dV written once; per column block Q, dO, LSE, D read, dQ (fp32) read+written.
    return 4 * e * n * hd + col_blocks * (2 * e * n * hd + 2 * 4 * n + 2 * 4 * n * hd)


# ---- the solve ------------------------------------------------------------------------------
def family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def value_tile_dim(family: Family, spec: Spec, head_dim: int) -> int:
    """The columns of V's tiles (and O's or dV's accumulators) in `family` computing at `head_dim`: head_dim, or, where
    the family takes V narrower (its option narrow_values), a narrower value_head_dim padded to whole 32-column panels;
    "per_warpgroup" (backward_wgmma_wide, whose warpgroups split dV's dims): to a panel of dO_i per warpgroup."""
    option = dict(family.options).get("narrow_values")
    if spec.value_head_dim is None or spec.value_dim >= head_dim or not option:
        return head_dim
    unit = 32
    if option == "per_warpgroup":
        groups = max(family.warps) // 4
        unit = groups * (64 if (head_dim // groups) % 64 == 0 else 32)   # (its Layout's panel columns)
    return min(head_dim, -(-spec.value_dim // unit) * unit)


def padded_head_dim(family: Family, head_dim: int) -> int:
    """The head dim `family` computes `head_dim` with: itself where it is a multiple of the family's,
    else, for the tensor-core templates, the next multiple (zero columns in shared memory, never
    stored; rows that are not whole 16-byte copies load element by element); 0: not supported."""
    multiple = family.head_dim_multiple
    if head_dim % multiple == 0:
        return head_dim
    padded = -(-head_dim // multiple) * multiple
    return padded if family.tensor_cores and padded <= 256 else 0


def padded_head_dims(family: Family, head_dim: int) -> list[int]:
    """The head dims `family` may compute `head_dim` with, least padding first: `padded_head_dim`'s, then,
    for the tensor-core templates, each further multiple up to 256. The solver tries the larger ones only
    where no family of the tier fits a tile plan at less padding (on sm_80, d = 200 fits the wide
    backward's shared memory and dQ split only as 256): more padded columns, still far ahead of the CUDA cores."""
    first = padded_head_dim(family, head_dim)
    if not first or not family.tensor_cores or first > 256:   # (above 256: a latent cache's d, computed as it is)
        return [first] if first else []
    return list(range(first, 257, family.head_dim_multiple))


def walk_bytes(family: Family, spec: Spec, warps: int) -> int:
    """Static shared memory of the template's TileWalk (templates/attention_common.cuh), on top of the
    dynamic footprint: two words per walking warp with a mask_mod (a tile's bits), else its one placeholder word."""
    if not family.tile_walk:
        return 0
    return 2 * 4 * (family.walk_warps or warps) if spec.mask_mod else 4


def static_bytes(family: Family, spec: Spec, warps: int) -> int:
    """The template's static shared memory, on top of the dynamic footprint: TileWalk's and the row pointers',
    which ptxas lays out in 16-byte units (what it reports: 56 B of pointers and a 4-byte word take 64)."""
    total = walk_bytes(family, spec, warps) + family.shared_pointer_bytes
    return -(-total // 16) * 16 if family.shared_pointer_bytes else total


def families_for(spec: Spec, pass_name: str, policy: str = "auto") -> list[Family]:
    """Families that implement this pass for this spec, fastest first. The paper's tiles are arbitrary
    integers, so that policy needs a family that takes any tile."""
    return [f for f in FAMILIES
            if pass_name in f.passes and spec.dtype in f.dtypes and spec.loop_order in f.loop_orders
            and padded_head_dim(f, spec.compute_dim) and (policy == "auto" or f.any_tile)
            and (f.tensor_cores or spec.value_head_dim is None)   # the CUDA-core templates take one head dim
            and (f.deterministic or not spec.deterministic)]


def modifier_reservation(modifiers, general, light, keys):
    """The registers a family reserves for a spec's mask_mod / score_mod: `light` for a mask_mod alone of a few
    integer operations, `keys` for a mask_mod alone that reads its inputs at key positions, `general` otherwise."""
    if not modifiers.active:
        return 0
    if modifiers.mask_mod_alone:
        if modifiers.light_mask_mod:
            return light
        if modifiers.mask_reads_keys:
            return keys
    return general


def evaluate(family: Family, spec: Spec, target: Target, pass_name: str,
             block_r: int, block_c: int, warps: int, head_dim: Optional[int] = None) -> tuple[Plan, list[str]]:
    """The plan for these tiles and the list of constraints it breaks (empty: feasible); computed at
    `head_dim` (one of `padded_head_dims`), by default the least padded."""
    compiled = _compiled(family)
    head_dim = head_dim or padded_head_dim(family, spec.compute_dim) or spec.compute_dim
    smem, registers, dropout_regs, reads, modifier_regs, packed_regs, light_regs, key_regs = compiled.footprint(
        block_r, block_c, head_dim, warps, spec.element_bytes, value_tile_dim(family, spec, head_dim))
    smem = _exact_int(smem)
    modifiers = spec.modifiers
    regs = _exact_ceiling(registers + (dropout_regs if spec.dropout > 0 else 0)
                          + (packed_regs if spec.layout == "packed" else 0)
                          + modifier_reservation(modifiers, modifier_regs, light_regs, key_regs))
    threads = 32 * warps
    broken = []
    if regs > target.registers_per_thread:
        broken.append(f"registers {compiled.registers_text} = {regs} <= {target.registers_per_thread}")
    missing = [need for need in family.needs if not getattr(target.features, need)]
    if missing:
        broken.append(f"a target with {', '.join(missing)} (is {target.arch})")
    if family.m_tiles and block_r not in [16 * warps * m for m in family.m_tiles]:
        broken.append(f"Br = 16*W*m, m in {family.m_tiles}")
    if family.keys_per_warp and block_c != family.keys_per_warp * warps:
        broken.append(f"Bc = {family.keys_per_warp}*W")
    broken.extend(description for description, holds in family.spec_rules if not holds(spec))
    broken.extend(description for r, c, description, holds in family.extra_tiles if (r, c) == (block_r, block_c)
                  and not ((head_dim, r, c, warps) in family.timed_first and holds(spec)))
    for description, holds in family.rules:
        if (block_r % 16 == 0 or family.any_tile) and not holds(block_r, block_c, head_dim, warps):
            broken.append(description)
    if not family.min_block_c <= block_c <= family.max_block_c:
        broken.append(f"{family.min_block_c} <= Bc <= {family.max_block_c}")
    if not family.any_tile and (block_r % 16 or block_c % 16):
        broken.append("Br, Bc multiples of 16 (tensor-core tiles)")
    if spec.mask == "block_sparse" and (spec.block_size % block_r or spec.block_size % block_c):
        broken.append(f"Br and Bc divide block_size {spec.block_size}")
    static_smem = static_bytes(family, spec, warps)
    if smem + static_smem > target.smem_per_block:
        broken.append(f"shared memory {smem} + {static_smem} static <= {target.smem_per_block}")
    blocks_by_smem = target.smem_per_sm // max(smem + static_smem, 1)
    blocks_by_regs = target.registers_per_sm // max(regs * threads, 1)
    blocks = min(blocks_by_smem, blocks_by_regs, target.max_threads_per_sm // threads)
    plan = Plan(family.name, family.template, block_r, block_c, warps, family.stages, threads, smem, regs,
                hbm_bytes(spec, pass_name, block_r, block_c), blocks * warps,
                _exact_ceiling(reads), family.tensor_cores, head_dim,
                tensor_map_panel_columns(head_dim, spec.element_bytes) if family.tensor_maps else 0)
    return plan, broken


def tensor_map_panel_columns(head_dim: int, element_bytes: int) -> int:
    """The columns of one swizzle panel of a tile with head_dim columns (templates/warpgroup_mma.cuh Swizzle's
    PANEL_COLUMNS, which the templates check against it): the TMA box a tensor map copies."""
    return (128 if head_dim * element_bytes % 128 == 0 else 64) // element_bytes


def family_tiles(family: Family) -> list[tuple[int, int]]:
    """The (Br, Bc) a family is tried at: every pair of TILE_CHOICES, and its extra_tiles."""
    return [(r, c) for r in TILE_CHOICES for c in TILE_CHOICES] + [tile[:2] for tile in family.extra_tiles]


def family_plans(family: Family, spec: Spec, target: Target, pass_name: str, tiles=None,
                 head_dim: Optional[int] = None):
    """(plan, broken constraints) for each warp count of the family and each (Br, Bc) in `tiles`
    (default: family_tiles), before any shared-memory budget is applied."""
    tiles = tiles or family_tiles(family)
    for warps in family.warps:
        for block_r, block_c in tiles:
            yield evaluate(family, spec, target, pass_name, block_r, block_c, warps, head_dim)


def _budget(spec: Spec, target: Target) -> int:
    return min(spec.sram_budget, target.smem_per_block) if spec.sram_budget else target.smem_per_block


def solve(spec: Spec, target: Optional[Target] = None, policy: Optional[str] = None) -> Solution:
    target = target or target_for(spec.arch)
    policy = policy or spec.tile_policy
    if policy not in ("paper", "auto"):
        raise SpecError(f"policy {policy!r} is not allowed: paper or auto")
    budget = _budget(spec, target)
    m_elements = (spec.sram_budget or target.smem_per_block) // spec.element_bytes
    paper_r, paper_c = paper_tiles(spec.compute_dim, m_elements)
    plans, candidates = {}, {}
    tiles = [(paper_r, paper_c)] if policy == "paper" else None
    limit = target.smem_per_block if policy == "paper" else budget   # the paper's tiles must still fit the hardware
    for pass_name in spec.passes:
        ranked = []
        failures = []
        families = families_for(spec, pass_name, policy)
        # tensor-core families compete with each other; CUDA-core ones are the fallback. Each family first at
        # its least padded head dim; the next multiples only where no family of the tier fits there
        for tier in dict.fromkeys(f.tensor_cores for f in families):
            members = [f for f in families if f.tensor_cores == tier]
            dims = {f.name: padded_head_dims(f, spec.compute_dim) for f in members}
            for step in range(max(len(d) for d in dims.values())):
                for family in (f for f in members if step < len(dims[f.name])):
                    for plan, broken in family_plans(family, spec, target, pass_name, tiles, dims[family.name][step]):
                        if plan.smem_bytes > limit:
                            broken.append(f"shared memory {_compiled(family).smem_text} = {plan.smem_bytes} <= {limit}")
                        if broken:
                            failures.append((plan, broken))
                        else:
                            ranked.append(plan)
                if ranked:
                    break
            if ranked:
                break
        if not ranked:
            raise InfeasibleSpec(_infeasible_message(spec, target, pass_name, policy, budget, failures))
        ranked.sort(key=lambda plan: plan.rank_key(spec.compute_dim))
        plans[pass_name] = ranked[0]
        candidates[pass_name] = tuple(ranked)
    paper = paper_report(spec.compute_dim, m_elements, paper_r, paper_c)
    return Solution(spec, policy, target, budget, plans, candidates, paper)


def _infeasible_message(spec, target, pass_name, policy, budget, failures) -> str:
    if not failures:
        return f"{spec.variant_name}: no template implements the {pass_name} pass for this spec"
    smem_only = [f for f in failures if all(b.startswith("shared memory") for b in f[1])]
    smallest = min(smem_only or failures, key=lambda f: f[0].smem_bytes)
    non_smem = [] if smem_only else [b for b in smallest[1] if not b.startswith("shared memory")]
    if policy == "paper":
        plan = smallest[0]
        return (f"{spec.variant_name}: the paper's tiles Br={plan.block_r}, Bc={plan.block_c} break "
                f"{'; '.join(smallest[1])} in {plan.family}; use a smaller sram_budget or tile_policy: auto")
    if non_smem:
        return f"{spec.variant_name}: {pass_name}: no tile plan satisfies {non_smem[0]}"
    # The budget must also hold every other pass's smallest feasible plan.
    own = smallest[0].smem_bytes
    need = max([own] + [_smallest_smem(spec, target, other) for other in spec.passes])
    return (f"{spec.variant_name}: sram_budget {budget} bytes is too small for the {pass_name} pass: "
            f"{smallest[0].family} needs shared memory {own} bytes at its smallest tiles "
            f"(Br={smallest[0].block_r}, Bc={smallest[0].block_c}); the smallest budget that works"
            f"{' for every pass' if len(spec.passes) > 1 else ''} is {need} bytes"
            + ("" if need <= target.smem_per_block else f", above the {target.arch} limit {target.smem_per_block}"))


def _smallest_smem(spec: Spec, target: Target, pass_name: str) -> int:
    """Shared memory of the pass's smallest plan that breaks nothing but the budget."""
    sizes = [plan.smem_bytes for family in families_for(spec, pass_name)
             for plan, broken in family_plans(family, spec, target, pass_name) if not broken]
    return min(sizes, default=0)


def with_plan(solution: Solution, pass_name: str, plan: Plan) -> Solution:
    """The same solution with one pass's plan replaced by a ranked candidate (autotuning's choice)."""
    if plan not in solution.candidates[pass_name]:
        raise ValueError(f"{plan} is not a feasible candidate for the {pass_name} pass")
    return Solution(solution.spec, solution.policy, solution.target, solution.budget_bytes,
                    {**solution.plans, pass_name: plan}, solution.candidates, solution.paper)
