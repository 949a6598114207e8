"""The float64 numpy reference every GPU kernel is checked against.

Four layers, each a plain transcription of the maths the CUDA templates implement:

1. `philox4x32`: the counter-based generator (Salmon et al. 2011, Random123), vectorised; dropout uses
   7 rounds (`PHILOX_ROUNDS`), as FlashAttention-2 does, the count Random123 reports as passing BigCrush.
2. Dropout: the keep decision of element (b, h, i, j) is a pure function of (seed, offset, b, h, i, j),
   so it does not depend on tiling or loop order and the backward regenerates it bit for bit.
3. Masks (`visible_mask`) and dense attention (`attention_forward`, `attention_backward`).
4. `tiled_forward` / `tiled_backward`: FlashAttention-1 Algorithm 1 (`fa1`), FlashAttention-2's
   forward (`fa2`) and Algorithm 4 (backward) executed block by block, so a test can show that the
   recurrences the templates use give the dense answer.

Layout everywhere: (batch B, heads H, sequence N, head_dim d); k and v may have H_kv heads for any
H_kv dividing H (grouped KV heads: query head h reads K/V head h // (H / H_kv)), and then dk, dv
are summed over each group. Inputs of any float dtype are
converted to float64; every result is float64. Rows with no visible key give o = 0, lse = -inf and
zero gradient, never NaN.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, NamedTuple, Optional

import numpy as np

# the kernels' dropout constants, defined once for the renderer and the reference (re-exported: reference's API)
from fagen.dropout import PHILOX_ROUNDS, dropout_keep_scale, dropout_threshold

if TYPE_CHECKING:  # the spec is only read (mask, window, block_size, dropout, scale, loop_order)
    from fagen.spec import Spec

__all__ = [
    "philox4x32",
    "dropout_keep_scale",
    "dropout_threshold",
    "dropout_bits",
    "dropout_keep_mask",
    "visible_mask",
    "attention_forward",
    "attention_backward",
    "packed_forward",
    "packed_backward",
    "tiled_forward",
    "tiled_backward",
]

# ---- 1. Philox4x32-7 -------------------------------------------------------------------------
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
_U32 = np.uint64(0xFFFFFFFF)


def _as_uint32_words(values, width: int, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim == 0 or array.shape[-1] != width:
        raise ValueError(f"philox4x32: {what} must have shape (..., {width}), got {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"philox4x32: {what} must hold integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() > 0xFFFFFFFF):
        raise ValueError(f"philox4x32: every {what} word must be a uint32 (0 .. 2**32-1)")
    return array.astype(np.uint64)


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS) -> np.ndarray:
    """Philox4x32 with `rounds` rounds: counter (..., 4) and key (..., 2) or (2,) uint32 -> (..., 4) uint32.

    One round: (hi0, lo0) = mulhi/lo(M0 * c0), (hi1, lo1) = mulhi/lo(M1 * c2),
    c <- (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0); the key is bumped by (W0, W1) between rounds.
    Products are formed exactly in uint64 (both factors < 2**32).
    """
    ctr = _as_uint32_words(counter, 4, "counter")
    k = _as_uint32_words(key, 2, "key")
    c0, c1, c2, c3 = (ctr[..., n] for n in range(4))
    k0, k1 = k[..., 0], k[..., 1]
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    shift = np.uint64(32)
    for round_index in range(rounds):
        if round_index:
            k0 = (k0 + w0) & _U32
            k1 = (k1 + w1) & _U32
        product0 = m0 * c0
        product1 = m1 * c2
        hi0, lo0 = product0 >> shift, product0 & _U32
        hi1, lo1 = product1 >> shift, product1 & _U32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1).astype(np.uint32)


# ---- 2. Dropout (the threshold and keep scale: fagen.dropout) ---------------------------------
def _philox_key(seed) -> np.ndarray:
    seed = operator.index(seed)  # any Python/numpy integer; a float seed is a bug
    return np.array([seed % 2**32, (seed >> 32) % 2**32], dtype=np.uint64)


# The random stream is laid out in patches that match the tensor-core accumulator layouts: rows {i, i + 8}
# of an aligned 16-row slab x columns {j0, j0 + 1, j0 + 8, j0 + 9} (j0 & 9 == 0) share one Philox call,
# whose word ((i >> 3) & 1) * 2 + ((j >> 3) & 1) holds columns (j & ~1, j | 1) of row i as 16-bit halves.
# A kernel thread then makes one call for 8 elements of the forward's fragments (the wgmma and wide backwards
# too, shuffling decisions between lanes; the mma.sync backward one for 4).
def _dropout_counter(offset: int, num_heads: int, b, h, i, j) -> list:
    """The four counter words of the patch of element (b, h, i, j) (int64 arrays, taken mod 2**32)."""
    row_patch = (i >> 4) * 8 + (i & 7)
    col_patch = (j >> 4) * 4 + ((j >> 1) & 3)
    bh = b * operator.index(num_heads) + h
    return [col_patch % 2**32, row_patch % 2**32, bh % 2**32,
            np.full(np.shape(bh), operator.index(offset) % 2**32, dtype=np.int64)]


def dropout_bits(seed: int, offset: int, num_heads: int, b, h, i, j) -> np.ndarray:
    """The 16-bit random draw of element (b, h, i, j) (integer arrays, broadcast together), as uint32.

    counter = (col_patch, row_patch, b * num_heads + h, offset mod 2**32) with
    row_patch = (i >> 4) * 8 + (i & 7) and col_patch = (j >> 4) * 4 + ((j >> 1) & 3),
    key = (seed mod 2**32, seed >> 32 mod 2**32); the draw is half j & 1 (0: the low 16 bits) of word
    ((i >> 3) & 1) * 2 + ((j >> 3) & 1) of philox4x32(counter, key). Element-wise on purpose (it
    recomputes each Philox call up to eight times): this is the definition the kernels follow and the
    tiled emulation calls it per block.
    """
    b, h, i, j = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (b, h, i, j)))
    if b.size and min(b.min(), h.min(), i.min(), j.min()) < 0:
        raise ValueError("dropout_bits: b, h, i and j are non-negative indices")
    lanes = philox4x32(np.stack(_dropout_counter(offset, num_heads, b, h, i, j), axis=-1), _philox_key(seed))
    word = ((i >> 3) & 1) * 2 + ((j >> 3) & 1)
    picked = np.take_along_axis(lanes, word[..., None], axis=-1)[..., 0]
    return (picked >> (16 * (j & 1)).astype(np.uint32)) & np.uint32(0xFFFF)


def dropout_keep_mask(seed: int, offset: int, B: int, H: int, Nq: int, Nk: int, p: float,
                      first_batch: int = 0) -> np.ndarray:
    """bool (B, H, Nq, Nk): True where element (first_batch + b, h, i, j) is kept (draw >= dropout_threshold(p)).

    Same bits as `dropout_bits`, computed with one Philox call per patch (8 elements) over the shape
    padded to multiples of 16.
    """
    threshold = dropout_threshold(p)
    if not threshold:
        return np.ones((B, H, Nq, Nk), dtype=bool)
    slabs, squares = -(-Nq // 16), -(-Nk // 16)
    # one call per (b, h, 16-row slab, row i & 7, 16-column square, column pair (j >> 1) & 3)
    b, h, s, r, q, c = np.meshgrid(np.arange(B) + first_batch, np.arange(H), np.arange(slabs), np.arange(8),
                                   np.arange(squares), np.arange(4), indexing="ij")
    lanes = philox4x32(np.stack(_dropout_counter(offset, H, b, h, 16 * s + r, 16 * q + 2 * c), axis=-1),
                          _philox_key(seed))
    # axes (B, H, slab, i & 7, square, pair, word = (i & 8, j & 8), half j & 1), put back in the order of
    # i = 16 slab + (i & 8) + (i & 7) and j = 16 square + (j & 8) + 2 pair + (j & 1)
    halves = np.stack([lanes & 0xFFFF, lanes >> 16], axis=-1).reshape(B, H, slabs, 8, squares, 4, 2, 2, 2)
    draws = halves.transpose(0, 1, 2, 6, 3, 4, 7, 5, 8).reshape(B, H, 16 * slabs, 16 * squares)
    return draws[:, :, :Nq, :Nk] >= np.uint32(threshold)


def _dropout_scale(spec: "Spec", seed: int, offset: int, B: int, H: int, Nq: int, Nk: int, first_batch: int = 0):
    """Z * dropout_keep_scale(p) as float64 (B, H, Nq, Nk), or None when the spec has no dropout."""
    if not spec.dropout:
        return None
    keep = dropout_keep_mask(seed, offset, B, H, Nq, Nk, spec.dropout, first_batch)
    return keep * dropout_keep_scale(spec.dropout)


def _dropout_scale_block(spec: "Spec", seed: int, offset: int, H: int, b: int, h: int,
                         rows: np.ndarray, cols: np.ndarray):
    """Z * dropout_keep_scale(p) of one tile, regenerated from absolute indices as a kernel does; None without dropout."""
    if not spec.dropout:
        return None
    draws = dropout_bits(seed, offset, H, b, h, rows[:, None], cols[None, :])
    return (draws >= np.uint32(dropout_threshold(spec.dropout))) * dropout_keep_scale(spec.dropout)


# ---- 3. Masks --------------------------------------------------------------------------------
def visible_mask(spec: "Spec", B: int, H: int, Nq: int, Nk: int,
                 kv_lengths=None, block_mask=None, inputs: Optional[dict] = None, first_batch: int = 0) -> np.ndarray:
    """bool array broadcastable to (B, H, Nq, Nk): True where query i may attend to key j.

    Keys are aligned bottom-right (shift = Nk - Nq, as PyTorch and FlashAttention do for Nq != Nk):
      none            everything visible
      causal          j <= i + shift
      sliding_window  0 <= i + shift - j < spec.window
      padding         j < clamp(kv_lengths[b], 0, Nk); kv_lengths: integers of shape (B,), required.
                      A length below 0 or above Nk is clamped, as the kernels clamp it where they read it
      block_sparse    block_mask[..., i // G, j // G] != 0 with G = spec.block_size; block_mask of shape
                      (ceil(Nq/G), ceil(Nk/G)) or (B or 1, H or 1, ceil(Nq/G), ceil(Nk/G)), required
    Only the spec's own mask is applied: kv_lengths is ignored unless spec.mask == "padding", and
    block_mask unless spec.mask == "block_sparse". A spec's mask_mod is ANDed in, evaluated (by
    fagen/expressions/, from the same sympy expression the kernels are rendered from) at
    (first_batch + b, h, i, j) with `inputs` (name -> array or number), positions not shifted.
    """
    visible = _mask_kind(spec, B, H, Nq, Nk, kv_lengths, block_mask)
    mods = spec.modifiers
    if mods.mask is None:
        return visible
    b, h, i, j = _index_grids(B, H, Nq, Nk, first_batch)
    return visible & mods.mask_numpy(b, h, i, j, Nq, Nk, _input_values(inputs))


def _index_grids(B: int, H: int, Nq: int, Nk: int, first_batch: int = 0):
    """(b, h, i, j) index arrays broadcasting to (B, H, Nq, Nk)."""
    return (np.arange(B)[:, None, None, None] + first_batch, np.arange(H)[None, :, None, None],
            np.arange(Nq)[None, None, :, None], np.arange(Nk)[None, None, None, :])


def _input_values(inputs: Optional[dict]) -> dict:
    """A mask_mod / score_mod's run-time inputs as numpy arrays (tensors) or floats (scalars)."""
    values = {}
    for name, value in (inputs or {}).items():
        if hasattr(value, "detach"):        # a torch tensor
            value = value.detach().cpu().numpy()
        elif hasattr(value, "get"):         # a PyCUDA array
            value = value.get()
        values[name] = float(value) if np.ndim(value) == 0 else np.asarray(value)
    return values


def _mask_kind(spec: "Spec", B: int, H: int, Nq: int, Nk: int, kv_lengths, block_mask) -> np.ndarray:
    for name, value in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk)):
        if operator.index(value) < 1:
            raise ValueError(f"visible_mask: {name} must be at least 1, got {value}")
    rows = np.arange(Nq)[:, None]
    cols = np.arange(Nk)[None, :]
    if spec.mask == "none":
        return np.ones((1, 1, Nq, Nk), dtype=bool)
    if spec.kind_mask is not None:   # causal, sliding_window: the expression the kernels are rendered from
        return spec.kind_mask.mask_numpy(0, 0, rows, cols, Nq, Nk)[None, None]
    if spec.mask == "padding":
        lengths = _check_kv_lengths(kv_lengths, B, Nk)
        return (cols[None, None] < lengths[:, None, None, None])
    if spec.mask == "block_sparse":
        G = spec.block_size
        layout = _check_block_mask(block_mask, B, H, -(-Nq // G), -(-Nk // G), G)
        return layout[:, :, np.arange(Nq)[:, None] // G, np.arange(Nk)[None, :] // G]
    raise ValueError(f"visible_mask: unknown mask {spec.mask!r}")


def _check_kv_lengths(kv_lengths, B: int, Nk: int) -> np.ndarray:
    if kv_lengths is None:
        raise ValueError("mask padding needs kv_lengths, an integer array of shape (B,) "
                         "giving each batch's number of valid keys")
    lengths = np.asarray(kv_lengths)
    if lengths.shape != (B,):
        raise ValueError(f"kv_lengths must have shape (B,) = ({B},), got {lengths.shape}")
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"kv_lengths must hold integers, got dtype {lengths.dtype}")
    # The kernels take lengths from device memory unchecked and clamp them to [0, Nk]
    # (templates/attention_common.cuh, visible_keys); the reference means the same thing by them.
    return np.clip(lengths.astype(np.int64), 0, Nk)


def _check_block_mask(block_mask, B: int, H: int, blocks_q: int, blocks_k: int, G: int) -> np.ndarray:
    wanted = (f"({blocks_q}, {blocks_k}) or (B or 1, H or 1, {blocks_q}, {blocks_k}) "
              f"= ceil(Nq/{G}), ceil(Nk/{G}) blocks")
    if block_mask is None:
        raise ValueError(f"mask block_sparse needs block_mask, a bool array of shape {wanted}")
    layout = np.asarray(block_mask)
    if layout.ndim == 2:
        layout = layout[None, None]
    if (layout.ndim != 4 or layout.shape[2:] != (blocks_q, blocks_k)
            or layout.shape[0] not in (1, B) or layout.shape[1] not in (1, H)):
        raise ValueError(f"block_mask must have shape {wanted}, got {np.shape(block_mask)}")
    return layout != 0


# ---- dense attention -------------------------------------------------------------------------
def _prepare(q, k, v, spec: "Spec"):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be (B, H, N, d) arrays, got shapes {q.shape}, {k.shape}, {v.shape}")
    B, H, Nq, d = q.shape
    if k.shape[0] != B or H % max(k.shape[1], 1) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q, k, v disagree on B, k's heads do not divide q's, or k, v disagree on (H_kv, Nk): "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if not (d == k.shape[3] == spec.head_dim and v.shape[3] == spec.value_dim):
        raise ValueError(f"head_dim of q, k, v ({d}, {k.shape[3]}, {v.shape[3]}) must equal spec.head_dim = "
                         f"{spec.head_dim} (q, k) and spec.value_dim = {spec.value_dim} (v)")
    if Nq < 1 or k.shape[2] < 1:
        raise ValueError(f"sequence lengths must be at least 1, got Nq={Nq}, Nk={k.shape[2]}")
    group = H // k.shape[1]
    # Grouped KV heads (GQA / MQA): query head h attends with K/V head h // group.
    return q, np.repeat(k, group, axis=1), np.repeat(v, group, axis=1), group


def _sum_groups(grad: np.ndarray, group: int) -> np.ndarray:
    """dK or dV per query head (B, H, Nk, d) -> per K/V head (B, H // group, Nk, d): each K/V head's
    gradient is the sum over the query heads that read it."""
    B, H, Nk, d = grad.shape
    return grad.reshape(B, H // group, group, Nk, d).sum(axis=2)


def _finite_or_zero(x: np.ndarray) -> np.ndarray:
    """FlashAttention's safe max: a row maximum (or lse) still at -inf is used as 0 when exponentiating,
    so exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN."""
    return np.where(np.isneginf(x), 0.0, x)


def _softmax_stats(q, k, spec: "Spec", visible, inputs: Optional[dict] = None, first_batch: int = 0):
    """S (score_mod applied, masked with -inf), lse (natural log, -inf for a row with no visible key),
    P = exp(S - lse) and d(score_mod)/d(score) at each element (None without a score_mod)."""
    S = spec.scale * np.einsum("bhid,bhjd->bhij", q, k)
    mods, score_grad = spec.modifiers, None
    if mods.score is not None:
        B, H, Nq, Nk = S.shape
        b, h, i, j = _index_grids(B, H, Nq, Nk, first_batch)
        values = _input_values(inputs)
        with np.errstate(all="ignore"):   # masked elements may overflow; they are dropped below
            score_grad = np.broadcast_to(mods.score_grad_numpy(S, b, h, i, j, Nq, Nk, values), S.shape)
            S = np.broadcast_to(mods.score_numpy(S, b, h, i, j, Nq, Nk, values), S.shape)
    S = np.where(visible, S, -np.inf)
    m = S.max(axis=-1)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.exp(S - _finite_or_zero(m)[..., None]).sum(axis=-1))
    lse = np.where(np.isneginf(m), -np.inf, lse)
    P = np.exp(S - _finite_or_zero(lse)[..., None])
    return S, lse, P, score_grad


def attention_forward(q, k, v, spec: "Spec", *, kv_lengths=None, block_mask=None, inputs: Optional[dict] = None,
                      seed: int = 0, offset: int = 0, first_batch: int = 0):
    """(o, lse): o = dropout(softmax(spec.scale * q k^T, masked)) v, lse = logsumexp of the visible scores.

    o is (B, H, Nq, d), lse is (B, H, Nq), both float64. Dropout (only when spec.dropout > 0) is keyed by
    (seed, offset) as `dropout_keep_mask` describes; kept weights are scaled by dropout_keep_scale(p). A row with no
    visible key gives o = 0 and lse = -inf. `first_batch`: the batch index of q[0] in the dropout
    stream and in mask_mod / score_mod (a packed batch's sequence b is computed as a batch of one at
    first_batch = b). `inputs`: the run-time inputs a spec's mask_mod / score_mod declare.
    """
    q, k, v, _ = _prepare(q, k, v, spec)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    visible = visible_mask(spec, B, H, Nq, Nk, kv_lengths, block_mask, inputs, first_batch)
    _, lse, P, _ = _softmax_stats(q, k, spec, visible, inputs, first_batch)
    scale = _dropout_scale(spec, seed, offset, B, H, Nq, Nk, first_batch)
    P_drop = P if scale is None else P * scale
    return np.einsum("bhij,bhjd->bhid", P_drop, v), lse


class _BackwardTerms(NamedTuple):
    do: np.ndarray
    visible: np.ndarray      # (B or 1, H or 1, Nq, Nk) bool
    P: np.ndarray            # softmax of the (modified, masked) scores
    P_drop: np.ndarray       # P with dropout's keep mask and scale
    dP: np.ndarray           # dO V^T (times the keep mask and scale)
    D: np.ndarray            # rowsum(dO * O)
    dS: np.ndarray           # P * (dP - D): the gradient of what the softmax sees (score_mod's output)
    score_grad: Optional[np.ndarray]   # d score_mod / d score at each element (None without a score_mod)


def _backward_terms(q, k, v, do, spec: "Spec", kv_lengths, block_mask, inputs, seed, offset, o,
                    first_batch) -> _BackwardTerms:
    """The backward's element-wise terms up to dS, for q, k, v as `_prepare` returns them."""
    do = np.asarray(do, dtype=np.float64)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if do.shape != (B, H, Nq, v.shape[3]):
        raise ValueError(f"do must have the shape of o, {(B, H, Nq, v.shape[3])}, got {do.shape}")
    visible = visible_mask(spec, B, H, Nq, Nk, kv_lengths, block_mask, inputs, first_batch)
    _, _, P, score_grad = _softmax_stats(q, k, spec, visible, inputs, first_batch)
    scale = _dropout_scale(spec, seed, offset, B, H, Nq, Nk, first_batch)
    P_drop = P if scale is None else P * scale
    o = np.einsum("bhij,bhjd->bhid", P_drop, v) if o is None else np.asarray(o, dtype=np.float64)
    dP = np.einsum("bhid,bhjd->bhij", do, v)
    if scale is not None:
        dP = dP * scale
    D = (do * o).sum(axis=-1)
    return _BackwardTerms(do, visible, P, P_drop, dP, D, P * (dP - D[..., None]), score_grad)


def score_input_grads(q, k, v, do, spec: "Spec", *, kv_lengths=None, block_mask=None, inputs: Optional[dict] = None,
                      seed: int = 0, offset: int = 0, o=None, first_batch: int = 0,
                      magnitudes: Optional[dict] = None) -> dict:
    """{input name: gradient of sum(o * do)} for each float input score_mod reads with a nonzero derivative
    (`Modifiers.input_grads`): float64 arrays of the tensor's shape, floats for scalars; same arguments as
    `attention_backward` (`magnitudes`: receives, per input, the same sum with |P * dP| + |P * D| and the
    derivative's absolute value: the size of the terms that cancel, a scale for judging a kernel's error where
    the exact gradient is ~0). Each read `name[indices]` adds dS' * d score_mod / d read over the visible elements
    to the element it loads (indices clamped into the tensor, as the kernels' loads are); dS' is the gradient
    of score_mod's output, P * (dP - D). The backward kernels compute the tensor inputs' (`Kernel.backward(...,
    input_grads=True)`) and are held to this. Dense (B, H, N, d) batches."""
    mods = spec.modifiers
    if mods.input_grads_not_derived:
        _, read, why = mods.input_grads_not_derived[0]
        raise ValueError(f"score_input_grads: no derivative of score_mod in {read} ({why})")
    q, k, v, _ = _prepare(q, k, v, spec)
    terms = _backward_terms(q, k, v, do, spec, kv_lengths, block_mask, inputs, seed, offset, o, first_batch)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    b, h, i, j = _index_grids(B, H, Nq, Nk, first_batch)
    values = _input_values(inputs)
    raw = spec.scale * np.einsum("bhid,bhjd->bhij", q, k)
    grads, sizes = {}, {}
    cancelling = np.abs(terms.P * terms.dP) + np.abs(terms.P * terms.D[..., None])
    for name, read, derivative in mods.input_grads:
        with np.errstate(all="ignore"):   # masked elements may overflow; they are dropped below
            slope = mods.float_numpy(derivative, raw, b, h, i, j, Nq, Nk, values)
        contribution = np.where(terms.visible, terms.dS * slope, 0.0)
        term_size = np.where(terms.visible, cancelling * np.abs(slope), 0.0)
        if name in mods.scalars:
            grads[name] = grads.get(name, 0.0) + float(contribution.sum())
            sizes[name] = sizes.get(name, 0.0) + float(term_size.sum())
            continue
        table = np.asarray(values[name])
        grad = grads.setdefault(name, np.zeros(table.shape, dtype=np.float64))
        total = sizes.setdefault(name, np.zeros(table.shape, dtype=np.float64))
        shape = contribution.shape
        where = tuple(np.clip(np.broadcast_to(np.asarray(mods.index_numpy(index, b, h, i, j, Nq, Nk, values)), shape),
                              0, size - 1) for index, size in zip(read.indices, table.shape))
        np.add.at(grad, where, contribution)
        np.add.at(total, where, np.broadcast_to(term_size, shape))
    if magnitudes is not None:
        magnitudes.update({name: float(np.linalg.norm(total)) for name, total in sizes.items()})
    return grads


def attention_backward(q, k, v, do, spec: "Spec", *, kv_lengths=None, block_mask=None,
                       inputs: Optional[dict] = None, seed: int = 0, offset: int = 0, o=None,
                       magnitudes: Optional[dict] = None, first_batch: int = 0):
    """(dq, dk, dv): the exact gradients of sum(o * do) for `attention_forward` with the same arguments.

    FlashAttention-1 Algorithm 4's maths on whole matrices: dV = P_drop^T dO, dP = (dO V^T) * Z/(1-p),
    D = rowsum(dO * O), dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q. Rows with no visible key
    have P = 0 and so contribute nothing.

    `o`: take D = rowsum(dO * o) from this forward output (as a kernel's backward does from the o it
    is given) instead of the exact one. `magnitudes`: a dict that receives, for dq and dk, the norm of
    the gradient computed with |P * dP| + |P * D| in place of P * (dP - D): the size of the terms that
    cancel, a scale for judging errors where the exact gradient is ~0 (e.g. Nk = 1, softmax constant).
    """
    q, k, v, group = _prepare(q, k, v, spec)
    terms = _backward_terms(q, k, v, do, spec, kv_lengths, block_mask, inputs, seed, offset, o, first_batch)
    P, dP, D, visible, score_grad = terms.P, terms.dP, terms.D, terms.visible, terms.score_grad
    dv = np.einsum("bhij,bhid->bhjd", terms.P_drop, terms.do)
    dS = terms.dS
    if score_grad is not None:   # the chain rule through score_mod: dS (of the raw score) = dS' * mod'(S)
        dS = dS * np.where(visible, score_grad, 0.0)
    dq = spec.scale * np.einsum("bhij,bhjd->bhid", dS, k)
    dk = spec.scale * np.einsum("bhij,bhid->bhjd", dS, q)
    if magnitudes is not None:
        dS_abs = np.abs(P * dP) + np.abs(P * D[..., None])
        if score_grad is not None:
            dS_abs = dS_abs * np.abs(np.where(visible, score_grad, 0.0))
        magnitudes["dq"] = float(np.linalg.norm(spec.scale * np.einsum("bhij,bhjd->bhid", dS_abs, np.abs(k))))
        magnitudes["dk"] = float(np.linalg.norm(_sum_groups(spec.scale * np.einsum("bhij,bhid->bhjd", dS_abs,
                                                                                     np.abs(q)), group)))
    return dq, _sum_groups(dk, group), _sum_groups(dv, group)


# ---- packed variable-length batches ----------------------------------------------------------
def _packed_sequences(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """[(b, query rows, key rows)] from FlashAttention-2's varlen offsets (B + 1 non-decreasing integers)."""
    bounds = []
    for name, offsets, total in (("cu_seqlens_q", cu_seqlens_q, total_q), ("cu_seqlens_k", cu_seqlens_k, total_k)):
        array = np.asarray(offsets, dtype=np.int64)
        if array.ndim != 1 or array.size < 2 or array[0] < 0 or (np.diff(array) < 0).any() or array[-1] > total:
            raise ValueError(f"{name} must hold B + 1 non-decreasing offsets from >= 0 to <= {total}, got {offsets!r}")
        bounds.append(array)
    if bounds[0].size != bounds[1].size:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    return [(b, slice(bounds[0][b], bounds[0][b + 1]), slice(bounds[1][b], bounds[1][b + 1]))
            for b in range(bounds[0].size - 1)]


def _sequence_runtime(kv_lengths, block_mask, spec: "Spec", b: int, nq: int, nk: int) -> dict:
    """Sequence b's kv_lengths / block_mask, as a batch of one: the block mask is laid out over the
    longest sequence's blocks, so each sequence takes its own top-left corner of it."""
    out = {}
    if kv_lengths is not None:
        out["kv_lengths"] = np.asarray(kv_lengths)[b:b + 1]
    if block_mask is not None:
        layout = np.asarray(block_mask)
        layout = layout[None, None] if layout.ndim == 2 else layout[b:b + 1] if layout.shape[0] > 1 else layout
        out["block_mask"] = layout[..., :-(-nq // spec.block_size), :-(-nk // spec.block_size)]
    return out


def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, spec: "Spec", *, kv_lengths=None, block_mask=None,
                   inputs: Optional[dict] = None, seed: int = 0, offset: int = 0):
    """(o, lse) of a packed batch (spec layout packed): q (total_q, H, d), k and v (total_k, H_kv, d);
    sequence b is query rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b + 1],
    computed as `attention_forward` computes a batch of one (its own bottom-right alignment, masks and
    dropout indices (b, h, i, j) with positions i, j within the sequence). o is (total_q, H, d), lse
    (H, total_q); rows outside every sequence, and sequences without keys, give o = 0 and lse = -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    total_q, H, d = q.shape
    o = np.zeros((total_q, H, v.shape[2]))
    lse = np.full((H, total_q), -np.inf)
    for b, rows, keys in _packed_sequences(cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0]):
        nq, nk = rows.stop - rows.start, keys.stop - keys.start
        if nq == 0 or nk == 0:
            continue
        as_batch = (x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys]))
        o_b, lse_b = attention_forward(*as_batch, spec, seed=seed, offset=offset, first_batch=b, inputs=inputs,
                                       **_sequence_runtime(kv_lengths, block_mask, spec, b, nq, nk))
        o[rows] = o_b[0].transpose(1, 0, 2)
        lse[:, rows] = lse_b[0]
    return o, lse


def packed_backward(q, k, v, do, cu_seqlens_q, cu_seqlens_k, spec: "Spec", *, kv_lengths=None, block_mask=None,
                    inputs: Optional[dict] = None, seed: int = 0, offset: int = 0, o=None,
                    magnitudes: Optional[dict] = None):
    """(dq, dk, dv) of `packed_forward`, in its layout: `attention_backward` per sequence, zero for rows
    outside every sequence. `o` and `magnitudes` as in `attention_backward` (magnitudes: over all sequences)."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    totals = {"dq": 0.0, "dk": 0.0}
    for b, rows, keys in _packed_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]):
        nq, nk = rows.stop - rows.start, keys.stop - keys.start
        if nq == 0 or nk == 0:
            continue
        as_batch = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], do[rows])]
        o_b = None if o is None else np.asarray(o, dtype=np.float64)[rows][None].transpose(0, 2, 1, 3)
        sizes = {}
        grads = attention_backward(*as_batch, spec, seed=seed, offset=offset, first_batch=b, o=o_b, magnitudes=sizes,
                                   inputs=inputs,
                                   **_sequence_runtime(kv_lengths, block_mask, spec, b, nq, nk))
        for name in totals:
            totals[name] += sizes[name] ** 2
        for out, grad, span in zip((dq, dk, dv), grads, (rows, keys, keys)):
            out[span] = grad[0].transpose(1, 0, 2)
    if magnitudes is not None:
        magnitudes.update({name: float(np.sqrt(total)) for name, total in totals.items()})
    return dq, dk, dv


def packed_score_input_grads(q, k, v, do, cu_seqlens_q, cu_seqlens_k, spec: "Spec", *, kv_lengths=None,
                             block_mask=None, inputs: Optional[dict] = None, seed: int = 0, offset: int = 0, o=None,
                             magnitudes: Optional[dict] = None) -> dict:
    """`score_input_grads` of `packed_forward`: per sequence (b its index, as the kernels' Mods see it), added up,
    since every sequence's reads land in the same inputs. An input with a derivative gets an entry even when no
    sequence has queries and keys (zeros). `magnitudes`: per input, the sum over sequences of score_input_grads'
    magnitudes (a bound on the size of the terms that cancel)."""
    mods = spec.modifiers
    if mods.input_grads_not_derived:
        _, read, why = mods.input_grads_not_derived[0]
        raise ValueError(f"score_input_grads: no derivative of score_mod in {read} ({why})")
    values = dict(inputs or {})
    grads = {name: 0.0 if name in mods.scalars else np.zeros(np.shape(values[name]))
             for name in dict.fromkeys(name for name, _, _ in mods.input_grads)}
    sizes = dict.fromkeys(grads, 0.0)
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    for b, rows, keys in _packed_sequences(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]):
        nq, nk = rows.stop - rows.start, keys.stop - keys.start
        if nq == 0 or nk == 0:
            continue
        as_batch = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], do[rows])]
        o_b = None if o is None else np.asarray(o, dtype=np.float64)[rows][None].transpose(0, 2, 1, 3)
        part_sizes = {}
        part = score_input_grads(*as_batch, spec, seed=seed, offset=offset, first_batch=b, o=o_b, inputs=inputs,
                                 magnitudes=part_sizes, **_sequence_runtime(kv_lengths, block_mask, spec, b, nq, nk))
        for name, grad in part.items():
            grads[name] = grads[name] + grad
            sizes[name] += part_sizes[name]
    if magnitudes is not None:
        magnitudes.update(sizes)
    return grads


# ---- 4. tiled emulations ---------------------------------------------------------------------
def _check_tiles(block_r, block_c) -> tuple[int, int]:
    block_r, block_c = operator.index(block_r), operator.index(block_c)
    if block_r < 1 or block_c < 1:
        raise ValueError(f"tile sizes must be positive, got block_r={block_r}, block_c={block_c}")
    return block_r, block_c


def _tiles(n: int, size: int):
    """(start, stop) of each tile; the last one may be partial."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _record(stats: Optional[dict], total: int, skipped: int) -> None:
    if stats is not None:
        stats["blocks_total"] = total
        stats["blocks_skipped"] = skipped
        stats["blocks_computed"] = total - skipped


def tiled_forward(q, k, v, spec: "Spec", block_r: int, block_c: int, *, kv_lengths=None, block_mask=None,
                  seed: int = 0, offset: int = 0, stats: Optional[dict] = None):
    """(o, lse) computed tile by tile in spec.loop_order, equal to `attention_forward` up to rounding.

    fa1: FlashAttention-1 Algorithm 1 (K/V column block outer, O, l, m read and written in "HBM" for every
    tile). fa2: Q row block outer, O kept un-normalised and divided by l once. One (b, h) at a time, as a
    kernel's grid would. A tile (i, j) with no visible element is skipped without touching K_j, V_j; pass
    a dict as `stats` to get blocks_total / blocks_skipped / blocks_computed, counted over (b, h, i, j).
    """
    q, k, v, _ = _prepare(q, k, v, spec)
    block_r, block_c = _check_tiles(block_r, block_c)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if spec.modifiers.active:
        raise ValueError("the tiled emulations model the mask kinds, not mask_mod / score_mod: use attention_forward")
    visible = np.broadcast_to(visible_mask(spec, B, H, Nq, Nk, kv_lengths, block_mask), (B, H, Nq, Nk))
    run = _forward_fa1 if spec.loop_order == "fa1" else _forward_fa2
    o, lse, total, skipped = run(q, k, v, spec, visible, block_r, block_c, seed, offset)
    _record(stats, total, skipped)
    return o, lse


def _tile_scores(spec, Q_i, K_j, visible_ij):
    S = spec.scale * (Q_i @ K_j.T)
    return np.where(visible_ij, S, -np.inf)


def _forward_fa1(q, k, v, spec, visible, block_r, block_c, seed, offset):
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    O = np.zeros((B, H, Nq, v.shape[3]))       # "HBM": normalised O, rewritten after every tile
    l = np.zeros((B, H, Nq))
    m = np.full((B, H, Nq), -np.inf)
    total = skipped = 0
    for b in range(B):
        for h in range(H):
            for c0, c1 in _tiles(Nk, block_c):
                K_j, V_j = k[b, h, c0:c1], v[b, h, c0:c1]
                for r0, r1 in _tiles(Nq, block_r):
                    total += 1
                    visible_ij = visible[b, h, r0:r1, c0:c1]
                    if not visible_ij.any():
                        skipped += 1
                        continue
                    Q_i, O_i = q[b, h, r0:r1], O[b, h, r0:r1]
                    l_i, m_i = l[b, h, r0:r1], m[b, h, r0:r1]
                    S = _tile_scores(spec, Q_i, K_j, visible_ij)
                    m_tile = S.max(axis=1)
                    P_tile = np.exp(S - _finite_or_zero(m_tile)[:, None])
                    l_tile = P_tile.sum(axis=1)
                    m_new = np.maximum(m_i, m_tile)
                    alpha = np.exp(m_i - _finite_or_zero(m_new))       # rescales the old statistics
                    beta = np.exp(m_tile - _finite_or_zero(m_new))     # rescales this tile's
                    l_new = alpha * l_i + beta * l_tile
                    drop = _dropout_scale_block(spec, seed, offset, H, b, h,
                                                np.arange(r0, r1), np.arange(c0, c1))
                    PV = (P_tile if drop is None else P_tile * drop) @ V_j
                    unnormalised = (l_i * alpha)[:, None] * O_i + beta[:, None] * PV
                    O[b, h, r0:r1] = unnormalised / np.where(l_new > 0, l_new, 1.0)[:, None]
                    l[b, h, r0:r1] = l_new
                    m[b, h, r0:r1] = m_new
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(l), -np.inf)
    return O, lse, total, skipped


def _forward_fa2(q, k, v, spec, visible, block_r, block_c, seed, offset):
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    O = np.zeros((B, H, Nq, v.shape[3]))
    lse = np.full((B, H, Nq), -np.inf)
    total = skipped = 0
    for b in range(B):
        for h in range(H):
            for r0, r1 in _tiles(Nq, block_r):
                Q_i = q[b, h, r0:r1]
                acc = np.zeros((r1 - r0, v.shape[3]))   # on chip, un-normalised
                l_i = np.zeros(r1 - r0)
                m_i = np.full(r1 - r0, -np.inf)
                for c0, c1 in _tiles(Nk, block_c):
                    total += 1
                    visible_ij = visible[b, h, r0:r1, c0:c1]
                    if not visible_ij.any():
                        skipped += 1
                        continue
                    K_j, V_j = k[b, h, c0:c1], v[b, h, c0:c1]
                    S = _tile_scores(spec, Q_i, K_j, visible_ij)
                    m_new = np.maximum(m_i, S.max(axis=1))
                    m_safe = _finite_or_zero(m_new)
                    P_tile = np.exp(S - m_safe[:, None])
                    alpha = np.exp(m_i - m_safe)
                    l_i = alpha * l_i + P_tile.sum(axis=1)
                    drop = _dropout_scale_block(spec, seed, offset, H, b, h,
                                                np.arange(r0, r1), np.arange(c0, c1))
                    acc = alpha[:, None] * acc + (P_tile if drop is None else P_tile * drop) @ V_j
                    m_i = m_new
                seen = l_i > 0
                O[b, h, r0:r1] = acc / np.where(seen, l_i, 1.0)[:, None]
                with np.errstate(divide="ignore"):
                    lse[b, h, r0:r1] = np.where(seen, m_i + np.log(l_i), -np.inf)
    return O, lse, total, skipped


def tiled_backward(q, k, v, o, lse, do, spec: "Spec", block_r: int, block_c: int, *, kv_lengths=None,
                   block_mask=None, seed: int = 0, offset: int = 0, stats: Optional[dict] = None):
    """(dq, dk, dv) by FlashAttention-1 Algorithm 4, tile by tile (whatever spec.loop_order says).

    K/V column block j outer, Q row block i inner; P is recomputed from the saved lse, the dropout mask
    is regenerated from (seed, offset) and the element indices, D_i = rowsum(dO_i * O_i), dK_j and dV_j
    accumulate on chip, dQ accumulates in "HBM" across column blocks. Tiles with no visible element are
    skipped; `stats` as in `tiled_forward`.
    """
    q, k, v, group = _prepare(q, k, v, spec)
    block_r, block_c = _check_tiles(block_r, block_c)
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    o, lse, do = (np.asarray(x, dtype=np.float64) for x in (o, lse, do))
    if o.shape != (B, H, Nq, v.shape[3]) or do.shape != o.shape or lse.shape != (B, H, Nq):
        raise ValueError(f"o and do must be {(B, H, Nq, v.shape[3])} and lse {(B, H, Nq)}, "
                         f"got {o.shape}, {do.shape}, {lse.shape}")
    if spec.modifiers.active:
        raise ValueError("the tiled emulations model the mask kinds, not mask_mod / score_mod: use attention_forward")
    visible = np.broadcast_to(visible_mask(spec, B, H, Nq, Nk, kv_lengths, block_mask), (B, H, Nq, Nk))
    dq = np.zeros_like(q)                  # "HBM", accumulated across column blocks
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    total = skipped = 0
    for b in range(B):
        for h in range(H):
            for c0, c1 in _tiles(Nk, block_c):
                K_j, V_j = k[b, h, c0:c1], v[b, h, c0:c1]
                dK_j = np.zeros_like(K_j)
                dV_j = np.zeros_like(V_j)
                for r0, r1 in _tiles(Nq, block_r):
                    total += 1
                    visible_ij = visible[b, h, r0:r1, c0:c1]
                    if not visible_ij.any():
                        skipped += 1
                        continue
                    Q_i, O_i, dO_i = q[b, h, r0:r1], o[b, h, r0:r1], do[b, h, r0:r1]
                    S = _tile_scores(spec, Q_i, K_j, visible_ij)
                    P = np.exp(S - _finite_or_zero(lse[b, h, r0:r1])[:, None])
                    drop = _dropout_scale_block(spec, seed, offset, H, b, h,
                                                np.arange(r0, r1), np.arange(c0, c1))
                    dV_j += (P if drop is None else P * drop).T @ dO_i
                    dP = dO_i @ V_j.T
                    if drop is not None:
                        dP = dP * drop
                    D_i = (dO_i * O_i).sum(axis=1)
                    dS = P * (dP - D_i[:, None])
                    dq[b, h, r0:r1] += spec.scale * (dS @ K_j)
                    dK_j += spec.scale * (dS.T @ Q_i)
                dk[b, h, c0:c1] = dK_j
                dv[b, h, c0:c1] = dV_j
    _record(stats, total, skipped)
    return dq, _sum_groups(dk, group), _sum_groups(dv, group)
