"""The float64 reference: Philox, dropout, masks, dense attention and its gradients, tiled emulations.

CPU only. Property tests draw a whole `Case` (shapes, mask, dropout, seeds, tiles); its repr is what
hypothesis prints for a failure, and every array is regenerated from `data_seed`, so a failure is
replayable from the printed line alone.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
from hypothesis import given, strategies as st

from fagen.reference import (
    attention_backward,
    attention_forward,
    dropout_bits,
    dropout_keep_mask,
    dropout_keep_scale,
    dropout_threshold,
    packed_backward,
    packed_forward,
    PHILOX_ROUNDS,
    philox4x32,
    tiled_backward,
    tiled_forward,
    visible_mask,
)
from fagen.sources import TEMPLATE_DIR
from fagen.spec import Spec

MASKS = ("none", "causal", "sliding_window", "padding", "block_sparse")


# ---- helpers ---------------------------------------------------------------------------------
def rel_err(out: np.ndarray, ref: np.ndarray, floor: float = 1.0) -> float:
    """‖out − ref‖ / max(‖ref‖, floor) over the finite entries, after checking the -inf entries coincide.

    Inputs are O(1), so the floor makes this an absolute error only where the result is small through
    cancellation (dq when Nk = 1 is zero in exact arithmetic: the softmax of one key is constant), which
    would otherwise turn float64 rounding noise into a relative error of 1.
    """
    assert not np.isnan(out).any(), "NaN in result"
    assert np.array_equal(np.isneginf(out), np.isneginf(ref)), "-inf entries differ"
    finite = np.isfinite(ref)
    return np.linalg.norm(out[finite] - ref[finite]) / max(np.linalg.norm(ref[finite]), floor)


def random_qkv(rng, B, H, Nq, Nk, d):
    return (rng.standard_normal((B, H, Nq, d)), rng.standard_normal((B, H, Nk, d)),
            rng.standard_normal((B, H, Nk, d)))


def spec_for(mask: str, *, d: int = 32, dropout: float = 0.0, window: Optional[int] = None,
             block_size: Optional[int] = None, loop_order: str = "fa2",
             softmax_scale: Optional[float] = None) -> Spec:
    return Spec(head_dim=d, dtype="fp32", mask=mask, dropout=dropout, loop_order=loop_order,
                softmax_scale=softmax_scale,
                window=window if mask == "sliding_window" else None,
                block_size=block_size if mask == "block_sparse" else None)


# ---- Philox ----------------------------------------------------------------------------------
# Random123's kat_vectors for philox4x32 (rounds, counter, key, expected): dropout's 7 rounds and the
# default 10 (the round function is the same; only the count differs).
PHILOX_KAT = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(rounds, counter, key, expected):
    out = philox4x32(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32), rounds)
    assert out.dtype == np.uint32
    assert out.tolist() == list(expected)


def test_dropout_draws_with_seven_rounds():
    """The kernels' round count (templates/shared_constants.cuh, written from fagen/dropout.py) is the reference's
    default."""
    assert PHILOX_ROUNDS == 7
    source = (TEMPLATE_DIR / "shared_constants.cuh").read_text()
    assert f"constexpr int PHILOX_ROUNDS = {PHILOX_ROUNDS};" in source
    counter, key = np.array(PHILOX_KAT[0][1], dtype=np.uint32), np.array(PHILOX_KAT[0][2], dtype=np.uint32)
    assert philox4x32(counter, key).tolist() == list(PHILOX_KAT[0][3])


def test_philox_vectorises_and_broadcasts_the_key():
    for rounds in (7, 10):
        cases = [case for case in PHILOX_KAT if case[0] == rounds]
        counters = np.array([c for _, c, _, _ in cases], dtype=np.uint32)
        keys = np.array([k for _, _, k, _ in cases], dtype=np.uint32)
        assert philox4x32(counters, keys, rounds).tolist() == [list(e) for _, _, _, e in cases]
    grid = np.random.default_rng(0).integers(0, 2**32, size=(3, 5, 4), dtype=np.uint64)
    key = np.array([7, 2**32 - 3], dtype=np.uint32)
    batched = philox4x32(grid, key)
    assert batched.shape == (3, 5, 4)
    for index in np.ndindex(3, 5):
        assert batched[index].tolist() == philox4x32(grid[index], key).tolist()


def test_philox_rejects_words_that_are_not_uint32():
    with pytest.raises(ValueError, match="uint32"):
        philox4x32(np.array([0, 0, 0, 2**32]), np.array([0, 0]))
    with pytest.raises(ValueError, match="shape"):
        philox4x32(np.array([0, 0, 0]), np.array([0, 0]))
    with pytest.raises(ValueError, match="integers"):
        philox4x32(np.zeros(4), np.array([0, 0]))


# ---- dropout ---------------------------------------------------------------------------------
def test_dropout_threshold():
    assert dropout_threshold(0.0) == 0
    assert dropout_threshold(0.5) == 2**15
    assert dropout_threshold(0.1) == int(0.1 * 2**16) == 6553
    assert dropout_threshold(2**-16) == 1
    for p in (0.1, 0.37, 0.9, 1 - 2**-20):  # p is applied as floor(p * 2**16) / 2**16
        assert 0 <= p - dropout_threshold(p) / 2**16 < 2**-16 < 1.6e-5
    for bad in (1.0, -0.01, 1.5):
        with pytest.raises(ValueError):
            dropout_threshold(bad)


def test_dropout_keep_scale_is_one_over_the_applied_keep_probability():
    for p in (0.1, 0.37, 0.9, 0.99):
        keep_probability = 1 - dropout_threshold(p) / 2**16
        assert keep_probability * dropout_keep_scale(p) == pytest.approx(1.0, rel=1e-15)
        assert abs(dropout_keep_scale(p) - 1 / (1 - p)) <= 2**-16 / (1 - p) ** 2 * 1.01
    assert dropout_keep_scale(0.0) == 1.0


def test_dropout_bits_follow_the_patch_layout():
    """Element (b, h, i, j): counter (col_patch, row_patch, b*H + h, offset), key (seed lo, seed hi),
    word 2 ((i >> 3) & 1) + ((j >> 3) & 1), half j & 1; rows i, i + 8 and columns j0, j0 + 1, j0 + 8, j0 + 9
    of an aligned 16 x 16 square share the call."""
    seed, offset, H, b, h, threshold = 0x0123456789ABCDEF, 2**32 + 5, 3, 1, 2, dropout_threshold(0.37)
    mask = dropout_keep_mask(seed, offset, 2, H, 48, 48, 0.37)
    for i0, j0 in ((0, 0), (5, 2), (23, 36), (16 + 7, 16 + 6)):   # (i & 8, j & 9) == 0: a patch's corner
        row_patch, col_patch = (i0 >> 4) * 8 + (i0 & 7), (j0 >> 4) * 4 + ((j0 >> 1) & 3)
        lanes = philox4x32(np.array([col_patch, row_patch, b * H + h, offset % 2**32], dtype=np.uint32),
                              np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32))
        for word, (di, dj) in enumerate(((0, 0), (0, 8), (8, 0), (8, 8))):
            for half in (0, 1):
                i, j = i0 + di, j0 + dj + half
                draw = (int(lanes[word]) >> (16 * half)) & 0xFFFF
                assert dropout_bits(seed, offset, H, b, h, i, j) == draw, (i, j)
                assert mask[b, h, i, j] == (draw >= threshold)


@pytest.mark.parametrize("B, H, Nq, Nk, first_batch", [(2, 3, 37, 45, 0), (1, 2, 1, 17, 3), (1, 1, 16, 16, 0),
                                                       (2, 1, 9, 1, 1)])
def test_dropout_keep_mask_is_dropout_bits_elementwise(B, H, Nq, Nk, first_batch):
    seed, offset, p = 0xFEDCBA987654321, 11, 0.3
    b, h, i, j = np.meshgrid(np.arange(B) + first_batch, np.arange(H), np.arange(Nq), np.arange(Nk), indexing="ij")
    draws = dropout_bits(seed, offset, H, b, h, i, j)
    assert draws.max() < 2**16
    assert np.array_equal(dropout_keep_mask(seed, offset, B, H, Nq, Nk, p, first_batch),
                          draws >= dropout_threshold(p))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keep_rate(p):
    keep = dropout_keep_mask(seed=1234, offset=7, B=2, H=4, Nq=128, Nk=130, p=p)
    assert keep.dtype == bool and keep.shape == (2, 4, 128, 130)
    n = keep.size
    p_applied = dropout_threshold(p) / 2**16
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p_applied)) < 6 * sigma
    # no structure by position in a patch (word, half) or by row: each part keeps ~1-p too
    for i8 in (0, 8):
        for j8 in (0, 8):
            for half in (0, 1):
                rows, cols = (np.arange(128) & 8) == i8, (np.arange(130) & 9) == (j8 | half)
                assert abs(keep[:, :, rows][..., cols].mean() - (1 - p_applied)) < 6 * 3 * sigma
    assert abs(keep[:, :, ::2].mean() - keep[:, :, 1::2].mean()) < 6 * 2 * sigma


def test_dropout_mask_is_all_kept_without_dropout():
    assert dropout_keep_mask(3, 4, 1, 2, 5, 6, 0.0).all()


@given(seed=st.integers(0, 2**64 - 1), offset=st.integers(0, 2**33), p=st.sampled_from([0.05, 0.5, 0.8]),
       B=st.integers(1, 3), H=st.integers(1, 3), Nq=st.integers(1, 40), Nk=st.integers(1, 40),
       tile_r=st.integers(1, 17), tile_c=st.integers(1, 17))
def test_dropout_mask_is_independent_of_slicing(seed, offset, p, B, H, Nq, Nk, tile_r, tile_c):
    full = dropout_keep_mask(seed, offset, B, H, Nq, Nk, p)
    # a prefix of the problem is a prefix of the mask (only H is part of the counter)
    assert np.array_equal(full[:1, :, : max(1, Nq // 2), : max(1, Nk // 3)],
                          dropout_keep_mask(seed, offset, 1, H, max(1, Nq // 2), max(1, Nk // 3), p))
    # tile by tile from absolute indices, as a kernel regenerates it, for any tile shape
    threshold = dropout_threshold(p)
    tiled = np.zeros_like(full)
    for b in range(B):
        for h in range(H):
            for r0 in range(0, Nq, tile_r):
                for c0 in range(0, Nk, tile_c):
                    rows = np.arange(r0, min(r0 + tile_r, Nq))[:, None]
                    cols = np.arange(c0, min(c0 + tile_c, Nk))[None, :]
                    tiled[b, h, rows, cols] = dropout_bits(seed, offset, H, b, h, rows, cols) >= threshold
    assert np.array_equal(tiled, full)
    # offset is taken mod 2**32
    assert np.array_equal(full, dropout_keep_mask(seed, offset + 2**32, B, H, Nq, Nk, p))


def test_dropout_mask_depends_on_every_key_and_counter_word():
    base = dropout_keep_mask(5, 9, 2, 2, 32, 32, 0.5)
    assert not np.array_equal(base, dropout_keep_mask(5 + 2**32, 9, 2, 2, 32, 32, 0.5))  # seed high word
    assert not np.array_equal(base, dropout_keep_mask(6, 9, 2, 2, 32, 32, 0.5))           # seed low word
    assert not np.array_equal(base, dropout_keep_mask(5, 10, 2, 2, 32, 32, 0.5))          # offset
    assert not np.array_equal(base[0, 0], base[0, 1]) and not np.array_equal(base[0, 0], base[1, 0])


# ---- masks -----------------------------------------------------------------------------------
def _mask(spec, B, H, Nq, Nk, **kw):
    return np.broadcast_to(visible_mask(spec, B, H, Nq, Nk, **kw), (B, H, Nq, Nk))


def test_causal_mask_is_bottom_right_aligned():
    spec = spec_for("causal")
    assert _mask(spec, 1, 1, 2, 4)[0, 0].astype(int).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert _mask(spec, 1, 1, 4, 2)[0, 0].astype(int).tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]
    assert _mask(spec, 1, 1, 3, 3)[0, 0].astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_sliding_window_mask():
    spec = spec_for("sliding_window", window=2)
    assert _mask(spec, 1, 1, 4, 4)[0, 0].astype(int).tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    assert _mask(spec, 1, 1, 2, 5)[0, 0].astype(int).tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    wide = spec_for("sliding_window", window=100)
    assert np.array_equal(_mask(wide, 1, 1, 3, 5), _mask(spec_for("causal"), 1, 1, 3, 5))


def test_padding_mask():
    spec = spec_for("padding")
    mask = _mask(spec, 2, 2, 2, 4, kv_lengths=np.array([1, 3]))
    assert mask[0, 1].astype(int).tolist() == [[1, 0, 0, 0]] * 2
    assert mask[1, 0].astype(int).tolist() == [[1, 1, 1, 0]] * 2
    assert not _mask(spec, 1, 1, 2, 4, kv_lengths=[0]).any()
    assert _mask(spec, 1, 1, 2, 4, kv_lengths=[9]).all()
    with pytest.raises(ValueError, match="kv_lengths"):
        visible_mask(spec, 2, 1, 2, 4)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        visible_mask(spec, 2, 1, 2, 4, kv_lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="integers"):
        visible_mask(spec, 2, 1, 2, 4, kv_lengths=[1.0, 2.0])
    # Out-of-range lengths are clamped to [0, Nk], as the kernels clamp them.
    assert not _mask(spec, 1, 1, 2, 4, kv_lengths=[-2]).any()
    clamped = _mask(spec, 3, 1, 2, 4, kv_lengths=np.array([-5, 2**31 - 1, 9], dtype=np.int32))
    assert np.array_equal(clamped, _mask(spec, 3, 1, 2, 4, kv_lengths=[0, 4, 4]))


def test_block_sparse_mask():
    spec = spec_for("block_sparse", block_size=16)
    layout = np.array([[1, 0, 1], [0, 1, 0]], dtype=bool)  # ceil(20/16) = 2 by ceil(40/16) = 3
    mask = _mask(spec, 1, 1, 20, 40, block_mask=layout)
    assert mask[0, 0, :16, :16].all() and not mask[0, 0, :16, 16:32].any() and mask[0, 0, :16, 32:].all()
    assert not mask[0, 0, 16:, :16].any() and mask[0, 0, 16:, 16:32].all() and not mask[0, 0, 16:, 32:].any()
    per_head = np.stack([layout, ~layout])[None].astype(np.int32)  # (1, 2, 2, 3), ints
    mask = _mask(spec, 3, 2, 20, 40, block_mask=per_head)
    assert np.array_equal(mask[2, 0], _mask(spec, 1, 1, 20, 40, block_mask=layout)[0, 0])
    assert np.array_equal(mask[1, 1], ~mask[1, 0])
    with pytest.raises(ValueError, match="block_mask"):
        visible_mask(spec, 1, 1, 20, 40)
    with pytest.raises(ValueError, match="shape"):
        visible_mask(spec, 1, 1, 20, 40, block_mask=np.ones((2, 2)))
    with pytest.raises(ValueError, match="shape"):
        visible_mask(spec, 1, 1, 20, 40, block_mask=np.ones((2, 1, 2, 3)))


def test_masks_of_another_kind_are_not_applied():
    q, k, v = random_qkv(np.random.default_rng(1), 1, 1, 5, 6, 32)
    for mask in ("none", "causal"):
        spec = spec_for(mask)
        plain = attention_forward(q, k, v, spec)
        other = attention_forward(q, k, v, spec, kv_lengths=np.array([0]), block_mask=np.zeros((1, 1)))
        assert np.array_equal(plain[0], other[0]) and np.array_equal(plain[1], other[1])


# ---- dense forward ---------------------------------------------------------------------------
def visible_by_definition(spec, b, h, i, j, Nq, Nk, kv_lengths=None, block_mask=None) -> bool:
    """The mask contract for one element, written out literally."""
    shift = Nk - Nq
    if spec.mask == "causal":
        return j <= i + shift
    if spec.mask == "sliding_window":
        return 0 <= i + shift - j < spec.window
    if spec.mask == "padding":
        return j < kv_lengths[b]
    if spec.mask == "block_sparse":
        layout = np.asarray(block_mask)
        if layout.ndim == 2:
            layout = layout[None, None]
        G = spec.block_size
        return bool(layout[b % layout.shape[0], h % layout.shape[1], i // G, j // G])
    return True


def naive_attention(q, k, v, spec, kv_lengths=None, block_mask=None, seed=0, offset=0):
    """Row by row with Python floats: the textbook softmax, independent of the vectorised code."""
    B, H, Nq, d = q.shape
    Nk = k.shape[2]
    o = np.zeros((B, H, Nq, d))
    lse = np.full((B, H, Nq), -np.inf)
    threshold = dropout_threshold(spec.dropout)
    for b in range(B):
        for h in range(H):
            keep = dropout_bits(seed, offset, H, b, h, np.arange(Nq)[:, None], np.arange(Nk)[None, :]) >= threshold
            for i in range(Nq):
                cols = [j for j in range(Nk)
                        if visible_by_definition(spec, b, h, i, j, Nq, Nk, kv_lengths, block_mask)]
                if not cols:
                    continue
                scores = [spec.scale * float(np.dot(q[b, h, i], k[b, h, j])) for j in cols]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for j, w in zip(cols, weights):
                    factor = keep[i, j] * 65536 / (65536 - threshold) if spec.dropout else 1.0  # 1 / the applied keep probability
                    o[b, h, i] += (w / total) * factor * v[b, h, j]
    return o, lse


# ---- the drawn case (shapes, mask, dropout, seeds, tiles), shared by the property tests -------
@dataclass(frozen=True)
class Case:
    B: int
    H: int
    Nq: int
    Nk: int
    d: int
    mask: str
    window: Optional[int]
    block_size: Optional[int]
    block_layout: Optional[str]    # "2d" or "4d"
    kv_lengths: Optional[tuple]
    dropout: float
    softmax_scale: Optional[float]
    seed: int
    offset: int
    data_seed: int
    loop_order: str
    block_r: int
    block_c: int

    def spec(self) -> Spec:
        return spec_for(self.mask, d=self.d, dropout=self.dropout, window=self.window,
                        block_size=self.block_size, loop_order=self.loop_order,
                        softmax_scale=self.softmax_scale)

    def arrays(self):
        """q, k, v, do and the mask keywords, all from data_seed."""
        rng = np.random.default_rng(self.data_seed)
        q, k, v = random_qkv(rng, self.B, self.H, self.Nq, self.Nk, self.d)
        do = rng.standard_normal(q.shape)
        kw = {"seed": self.seed, "offset": self.offset}
        if self.kv_lengths is not None:
            kw["kv_lengths"] = np.array(self.kv_lengths, dtype=np.int64)
        if self.block_size is not None:
            G = self.block_size
            blocks = (-(-self.Nq // G), -(-self.Nk // G))
            shape = blocks if self.block_layout == "2d" else (
                int(rng.choice([1, self.B])), int(rng.choice([1, self.H]))) + blocks
            kw["block_mask"] = rng.random(shape) < rng.choice([0.3, 0.7])
        return q, k, v, do, kw


@st.composite
def cases(draw, mask: str, dropout: bool, loop_order: Optional[str] = None, max_n: int = 150,
          max_bh: int = 2):
    """One drawn problem for a given mask kind and dropout on/off (pytest parametrizes those, so every
    combination gets its own example budget)."""
    size = st.one_of(st.sampled_from([1, 15, 16, 17, 32, 33, 64, 65]), st.integers(1, max_n))
    B, H = draw(st.integers(1, max_bh)), draw(st.integers(1, max_bh))
    Nq, Nk = min(draw(size), max_n), min(draw(size), max_n)
    window = draw(st.integers(1, Nk + 3)) if mask == "sliding_window" else None
    block_size = draw(st.sampled_from([16, 32, 64])) if mask == "block_sparse" else None
    block_layout = draw(st.sampled_from(["2d", "4d"])) if mask == "block_sparse" else None
    kv_lengths = (tuple(draw(st.lists(st.integers(0, Nk), min_size=B, max_size=B)))
                  if mask == "padding" else None)
    return Case(
        B=B, H=H, Nq=Nq, Nk=Nk, d=draw(st.sampled_from([32, 40, 64])), mask=mask, window=window,
        block_size=block_size, block_layout=block_layout, kv_lengths=kv_lengths,
        dropout=draw(st.sampled_from([0.1, 0.5, 0.9])) if dropout else 0.0,
        softmax_scale=draw(st.sampled_from([None, 0.05, 1.5])),
        seed=draw(st.integers(0, 2**64 - 1)), offset=draw(st.integers(0, 2**32 - 1)),
        data_seed=draw(st.integers(0, 2**32 - 1)), loop_order=loop_order or draw(st.sampled_from(["fa1", "fa2"])),
        block_r=draw(st.sampled_from([16, 32, 64])), block_c=draw(st.sampled_from([16, 32, 64])),
    )


@pytest.mark.parametrize("mask", MASKS)
@given(data=st.data())
def test_forward_matches_the_textbook_formula(mask, data):
    case = data.draw(cases(mask, dropout=data.draw(st.booleans(), label="dropout on"), max_n=24), label="case")
    q, k, v, _, kw = case.arrays()
    spec = case.spec()
    o, lse = attention_forward(q, k, v, spec, **kw)
    o_ref, lse_ref = naive_attention(q, k, v, spec, **kw)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and o.dtype == lse.dtype == np.float64
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(lse, lse_ref) < 1e-12


def test_forward_without_mask_or_dropout_is_softmax():
    q, k, v = random_qkv(np.random.default_rng(2), 2, 3, 7, 9, 32)
    spec = spec_for("none", softmax_scale=0.3)
    S = 0.3 * q @ k.transpose(0, 1, 3, 2)
    P = np.exp(S - S.max(-1, keepdims=True))
    o, lse = attention_forward(q, k, v, spec)
    np.testing.assert_allclose(o, (P / P.sum(-1, keepdims=True)) @ v, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, np.log(np.exp(S).sum(-1)), rtol=1e-13)


def test_forward_accepts_any_float_dtype():
    q, k, v = random_qkv(np.random.default_rng(3), 1, 2, 5, 6, 32)
    spec = spec_for("causal", dropout=0.25)
    for dtype in (np.float16, np.float32):
        low = [x.astype(dtype) for x in (q, k, v)]
        o, lse = attention_forward(*low, spec, seed=9)
        o64, lse64 = attention_forward(*[x.astype(np.float64) for x in low], spec, seed=9)
        assert o.dtype == np.float64 and np.array_equal(o, o64) and np.array_equal(lse, lse64)


def test_forward_checks_shapes():
    q, k, v = random_qkv(np.random.default_rng(4), 1, 1, 4, 4, 32)
    with pytest.raises(ValueError, match="head_dim"):
        attention_forward(q, k, v, spec_for("none", d=64))
    with pytest.raises(ValueError, match=r"\(B, H, N, d\)"):
        attention_forward(q[0], k[0], v[0], spec_for("none"))


def _fully_masked_cases():
    """(spec, Nq, Nk, mask keywords, rows that see nothing as an index into (B, H, Nq))."""
    layout = np.array([[1, 1], [0, 0]])  # second row block (rows 16..) sees nothing
    return [
        (spec_for("causal"), 6, 3, {}, (slice(None), slice(None), slice(0, 3))),
        (spec_for("sliding_window", window=2), 6, 2, {}, (slice(None), slice(None), slice(0, 4))),
        (spec_for("padding"), 4, 5, {"kv_lengths": np.array([3, 0])}, (1,)),
        (spec_for("block_sparse", block_size=16), 20, 20, {"block_mask": layout},
         (slice(None), slice(None), slice(16, 20))),
    ]


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("index", range(4))
def test_rows_without_visible_keys_give_zero_and_minus_inf(index, dropout):
    spec, Nq, Nk, kw, dead = _fully_masked_cases()[index]
    spec = spec.model_copy(update={"dropout": dropout})
    q, k, v = random_qkv(np.random.default_rng(5), 2, 2, Nq, Nk, 32)
    do = np.random.default_rng(6).standard_normal(q.shape)
    o, lse = attention_forward(q, k, v, spec, seed=11, **kw)
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    assert (o[dead] == 0).all() and np.isneginf(lse[dead]).all()
    assert np.isfinite(lse).sum() == lse.size - lse[dead].size
    dq, dk, dv = attention_backward(q, k, v, do, spec, seed=11, **kw)
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[dead] == 0).all()
    for loop_order in ("fa1", "fa2"):
        tiled = spec.model_copy(update={"loop_order": loop_order})
        o_t, lse_t = tiled_forward(q, k, v, tiled, 16, 16, seed=11, **kw)
        assert rel_err(o_t, o) < 1e-12 and rel_err(lse_t, lse) < 1e-12
        assert (o_t[dead] == 0).all()
    grads_t = tiled_backward(q, k, v, o, lse, do, spec, 16, 16, seed=11, **kw)
    for g_t, g in zip(grads_t, (dq, dk, dv)):
        assert rel_err(g_t, g) < 1e-12


# ---- backward vs finite differences ------------------------------------------------------------
FD_CASES = {
    "none": (spec_for("none", softmax_scale=0.4), (1, 2, 3, 4), {}),
    "causal_tall": (spec_for("causal"), (1, 1, 5, 3), {}),
    "causal_wide": (spec_for("causal"), (1, 1, 3, 5), {}),
    "sliding_window": (spec_for("sliding_window", window=2), (1, 1, 4, 6), {}),
    "padding": (spec_for("padding"), (2, 1, 3, 4), {"kv_lengths": np.array([2, 0])}),
    "block_sparse": (spec_for("block_sparse", block_size=16), (1, 1, 18, 20),
                     {"block_mask": np.array([[0, 1], [1, 0]])}),
}


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("name", sorted(FD_CASES))
def test_backward_matches_finite_differences(name, dropout):
    spec, (B, H, Nq, Nk), kw = FD_CASES[name]
    spec = spec.model_copy(update={"dropout": dropout})
    kw = {**kw, "seed": 2**40 + 17, "offset": 3}
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v = random_qkv(rng, B, H, Nq, Nk, 32)
    do = rng.standard_normal(q.shape)
    grads = attention_backward(q, k, v, do, spec, **kw)

    def loss(q_, k_, v_):
        return float((attention_forward(q_, k_, v_, spec, **kw)[0] * do).sum())

    eps = 1e-6
    inputs = [q, k, v]
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            plus = [x.copy() for x in inputs]
            minus = [x.copy() for x in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg="dq dk dv".split()[which])


# ---- tiled emulations ------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("loop_order", ["fa1", "fa2"])
@pytest.mark.parametrize("mask", MASKS)
@given(data=st.data())
def test_tiled_forward_equals_dense_forward(mask, loop_order, dropout, data):
    case = data.draw(cases(mask, dropout, loop_order), label="case")
    q, k, v, _, kw = case.arrays()
    spec = case.spec()
    o_ref, lse_ref = attention_forward(q, k, v, spec, **kw)
    stats: dict = {}
    o, lse = tiled_forward(q, k, v, spec, case.block_r, case.block_c, stats=stats, **kw)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(lse, lse_ref) < 1e-10
    tiles = case.B * case.H * -(-case.Nq // case.block_r) * -(-case.Nk // case.block_c)
    assert stats["blocks_total"] == tiles
    assert stats["blocks_skipped"] + stats["blocks_computed"] == tiles
    if case.mask == "none":
        assert stats["blocks_skipped"] == 0


@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("mask", MASKS)
@given(data=st.data())
def test_tiled_backward_equals_dense_backward(mask, dropout, data):
    case = data.draw(cases(mask, dropout), label="case")
    q, k, v, do, kw = case.arrays()
    spec = case.spec()
    o, lse = attention_forward(q, k, v, spec, **kw)
    ref = attention_backward(q, k, v, do, spec, **kw)
    stats: dict = {}
    grads = tiled_backward(q, k, v, o, lse, do, spec, case.block_r, case.block_c, stats=stats, **kw)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, ref):
        assert rel_err(g, g_ref) < 1e-10, name
    assert stats["blocks_total"] == case.B * case.H * -(-case.Nq // case.block_r) * -(-case.Nk // case.block_c)


@pytest.mark.parametrize("loop_order", ["fa1", "fa2"])
def test_tiled_forward_skips_invisible_blocks(loop_order):
    rng = np.random.default_rng(7)
    # causal, square: 4x4 tiles of 32, the 6 strictly above the diagonal are skipped
    q, k, v = random_qkv(rng, 2, 1, 128, 128, 32)
    stats: dict = {}
    tiled_forward(q, k, v, spec_for("causal", loop_order=loop_order), 32, 32, stats=stats)
    assert stats == {"blocks_total": 32, "blocks_skipped": 12, "blocks_computed": 20}
    # causal, Nq=64 < Nk=128 (shift 64): only rows 0..31 x keys 96..127 is invisible
    q, k, v = random_qkv(rng, 1, 1, 64, 128, 32)
    tiled_forward(q, k, v, spec_for("causal", loop_order=loop_order), 32, 32, stats=stats)
    assert stats["blocks_skipped"] == 1
    # block sparse, G = 32: tiles of 16 skip 4 per zero block, tiles of 64 only wholly zero 2x2 groups
    layout = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]])
    spec = spec_for("block_sparse", block_size=32, loop_order=loop_order)
    q, k, v = random_qkv(rng, 1, 1, 128, 128, 32)
    tiled_forward(q, k, v, spec, 16, 16, block_mask=layout, stats=stats)
    assert stats["blocks_skipped"] == 4 * int((layout == 0).sum())
    tiled_forward(q, k, v, spec, 64, 64, block_mask=layout, stats=stats)
    assert stats["blocks_skipped"] == 2
    tiled_backward(q, k, v, *attention_forward(q, k, v, spec, block_mask=layout),
                   rng.standard_normal(q.shape), spec, 64, 64, block_mask=layout, stats=stats)
    assert stats["blocks_skipped"] == 2


# ---- grouped KV heads (GQA / MQA) ----------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("mask", ["none", "causal", "sliding_window"])
def test_grouped_kv_heads_equal_repeated_heads(mask, kv_heads):
    """k, v with H_kv heads mean query head h reads K/V head h // (H / H_kv): the same as repeating
    each K/V head over its group, with dk, dv the group sums of the repeated heads' gradients."""
    spec = spec_for(mask, window=3).model_copy(update={"dropout": 0.2})
    rng = np.random.default_rng(kv_heads)
    B, H, Nq, Nk, group = 2, 4, 7, 9, 4 // kv_heads
    q = rng.standard_normal((B, H, Nq, 32))
    k, v = (rng.standard_normal((B, kv_heads, Nk, 32)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    k_rep, v_rep = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    kw = {"seed": 5, "offset": 1}
    o, lse = attention_forward(q, k, v, spec, **kw)
    o_rep, lse_rep = attention_forward(q, k_rep, v_rep, spec, **kw)
    np.testing.assert_array_equal(o, o_rep)
    np.testing.assert_array_equal(lse, lse_rep)
    dq, dk, dv = attention_backward(q, k, v, do, spec, **kw)
    dq_rep, dk_rep, dv_rep = attention_backward(q, k_rep, v_rep, do, spec, **kw)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_array_equal(dq, dq_rep)
    np.testing.assert_allclose(dk, dk_rep.reshape(B, kv_heads, group, Nk, 32).sum(axis=2), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, dv_rep.reshape(B, kv_heads, group, Nk, 32).sum(axis=2), rtol=1e-12, atol=1e-12)
    grads_t = tiled_backward(q, k, v, o, lse, do, spec, 4, 4, **kw)
    for g_t, g in zip(grads_t, (dq, dk, dv)):
        assert rel_err(g_t, g) < 1e-12
    o_t, _ = tiled_forward(q, k, v, spec, 4, 4, **kw)
    assert rel_err(o_t, o) < 1e-12


def test_grouped_kv_heads_gradient_matches_finite_differences():
    spec = spec_for("causal")
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 3, 4, 32))
    k, v = (rng.standard_normal((1, 1, 5, 32)) for _ in range(2))   # MQA: 3 query heads, 1 K/V head
    do = rng.standard_normal(q.shape)
    _, dk, dv = attention_backward(q, k, v, do, spec)
    eps = 1e-6
    for grad, which in ((dk, 1), (dv, 2)):
        for index in [(0, 0, 0, 0), (0, 0, 3, 7), (0, 0, 4, 31)]:
            plus, minus = [q, k.copy(), v.copy()], [q, k.copy(), v.copy()]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric = float(((attention_forward(*plus, spec)[0] - attention_forward(*minus, spec)[0]) * do).sum()) / (2 * eps)
            assert abs(grad[index] - numeric) < 1e-6 * max(1.0, abs(numeric))


def test_grouped_kv_heads_must_divide_the_query_heads():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 3, 4, 32))
    k = v = rng.standard_normal((1, 2, 4, 32))
    with pytest.raises(ValueError, match="heads do not divide"):
        attention_forward(q, k, v, spec_for("none"))


# ---- packed variable-length batches ------------------------------------------------------------
def test_packed_batch_is_each_sequence_as_its_own_batch_entry():
    """Sequence b of a packed batch is what a padded batch entry b of its own lengths gives: its own
    bottom-right alignment, and dropout indexed by (b, h, i, j) with positions inside the sequence."""
    spec = Spec(head_dim=8, mask="causal", dropout=0.25, layout="packed")
    rng = np.random.default_rng(5)
    q_lengths, k_lengths = [3, 0, 5, 2], [4, 2, 5, 0]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (q_lengths, k_lengths))
    H, H_kv = 4, 2
    q = rng.standard_normal((cu_q[-1] + 2, H, 8))   # two spare rows after the last sequence
    k, v = (rng.standard_normal((cu_k[-1], H_kv, 8)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    o, lse = packed_forward(q, k, v, cu_q, cu_k, spec, seed=9, offset=4)
    dq, dk, dv = packed_backward(q, k, v, do, cu_q, cu_k, spec, seed=9, offset=4)
    padded = Spec(head_dim=8, mask="causal", dropout=0.25)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if q_lengths[b] == 0:
            continue
        if k_lengths[b] == 0:   # queries without keys: o = 0, lse = -inf, no gradient
            assert not o[rows].any() and np.isneginf(lse[:, rows]).all() and not dq[rows].any()
            continue
        entry = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys], do[rows])]
        o_b, lse_b = attention_forward(*entry[:3], padded, seed=9, offset=4, first_batch=b)
        grads_b = attention_backward(*entry, padded, seed=9, offset=4, first_batch=b)
        np.testing.assert_allclose(o[rows], o_b[0].transpose(1, 0, 2), atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], lse_b[0], atol=1e-12)
        for got, want, span in zip((dq, dk, dv), grads_b, (rows, keys, keys)):
            np.testing.assert_allclose(got[span], want[0].transpose(1, 0, 2), atol=1e-12)
    assert not o[-2:].any() and np.isneginf(lse[:, -2:]).all() and not dq[-2:].any()
    # the dropout stream really is indexed by the sequence: sequence 2 as batch entry 0 differs
    entry = [x[None].transpose(0, 2, 1, 3) for x in (q[3:8], k[6:11], v[6:11])]
    assert not np.allclose(attention_forward(*entry, padded, seed=9, offset=4)[0][0].transpose(1, 0, 2), o[3:8])


def test_packed_offsets_are_checked():
    spec = Spec(head_dim=8, layout="packed")
    q = np.ones((4, 1, 8))
    with pytest.raises(ValueError, match="non-decreasing"):
        packed_forward(q, q, q, [0, 3, 2], [0, 2, 4], spec)
    with pytest.raises(ValueError, match="<= 4"):
        packed_forward(q, q, q, [0, 5], [0, 4], spec)
    with pytest.raises(ValueError, match="same number"):
        packed_forward(q, q, q, [0, 2, 4], [0, 4], spec)


# ---- mask_mod / score_mod ------------------------------------------------------------------------
def _numeric_gradients(spec, q, k, v, do, inputs, step=1e-6):
    """d sum(o * do) / d(q, k, v) by central differences of attention_forward."""
    from fagen.reference import attention_forward

    grads = []
    for which in range(3):
        tensors = [q.copy(), k.copy(), v.copy()]
        grad = np.zeros_like(tensors[which])
        for index in np.ndindex(grad.shape):
            values = []
            for sign in (1, -1):
                moved = [t.copy() for t in tensors]
                moved[which][index] += sign * step
                values.append((attention_forward(*moved, spec, inputs=inputs)[0] * do).sum())
            grad[index] = (values[0] - values[1]) / (2 * step)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("fields, inputs", [
    ({"mask": "causal", "score_mod": "cap * tanh(score / cap)"}, {"cap": 0.7}),
    ({"score_mod": "score - slope[h] * abs(i - j)"}, {"slope": np.array([0.5, 0.125])}),
    ({"mask_mod": "j <= i + Nk - Nq or j < 2", "score_mod": "score * score / 4 + bias[h, i - j + 5]"},
     {"bias": np.linspace(-1, 1, 24).reshape(2, 12)}),
], ids=["softcap", "alibi", "square-bias"])
def test_score_mod_backward_matches_numeric_gradients(fields, inputs):
    """The reference's backward (dS times sympy's d score_mod / d score) is the gradient of its forward."""
    from fagen.reference import attention_backward

    spec = Spec(head_dim=3, dtype="fp32", inputs={name: "scalar" if np.ndim(value) == 0 else "float32"
                                                   for name, value in inputs.items()}, **fields)
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 3))
    do = rng.standard_normal((1, 2, 4, 3))
    exact = attention_backward(q, k, v, do, spec, inputs=inputs)
    for name, got, want in zip(("dq", "dk", "dv"), exact, _numeric_gradients(spec, q, k, v, do, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=name)


def _numeric_input_gradients(spec, q, k, v, do, inputs, names=None, step=1e-6, **runtime):
    """d sum(o * do) / d(each input in names, default all) by central differences of attention_forward."""
    from fagen.reference import attention_forward

    def loss(values):
        return (attention_forward(q, k, v, spec, inputs=values, **runtime)[0] * do).sum()

    grads = {}
    for name in names or inputs:
        value = np.asarray(inputs[name], dtype=np.float64)
        grad = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            moved = [value.copy(), value.copy()]
            moved[0][index] += step
            moved[1][index] -= step
            grad[index] = (loss({**inputs, name: moved[0]}) - loss({**inputs, name: moved[1]})) / (2 * step)
        grads[name] = grad
    return grads


@pytest.mark.parametrize("fields, inputs", [
    ({"mask": "causal", "score_mod": "cap * tanh(score / cap)"}, {"cap": 0.7}),
    ({"mask": "causal", "score_mod": "score - slope[h] * (i - j)"}, {"slope": np.array([0.5, 0.125])}),
    # a relative-position table read at i - j + 2: clamped into the table where that falls off either end
    ({"score_mod": "score + bias[h, i - j + 2]", "dropout": 0.3}, {"bias": np.linspace(-1, 1, 10).reshape(2, 5)}),
    # two reads of one tensor, one of them multiplied with the score; a scalar and a tensor together
    ({"mask_mod": "j <= i + 1", "score_mod": "score * (1 + t[i]) - t[j] + alpha * score"},
     {"t": np.array([0.3, -0.2, 0.5, 0.1, -0.4]), "alpha": 0.25}),
], ids=["softcap", "alibi", "bias-table-dropout", "two-reads"])
def test_score_input_gradients_match_numeric_gradients(fields, inputs):
    """score_input_grads (dS' times sympy's derivative in each read, scattered to the element read) is the
    gradient of the forward in each float input; int32 inputs and mask_mod get none."""
    from fagen.reference import score_input_grads

    spec = Spec(head_dim=3, dtype="fp32", inputs={name: "scalar" if np.ndim(value) == 0 else "float32"
                                                   for name, value in inputs.items()}, **fields)
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((1, 2, 4, 3)), rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 3))
    do = rng.standard_normal((1, 2, 4, 3))
    runtime = {"seed": 5, "offset": 2}
    sizes = {}
    exact = score_input_grads(q, k, v, do, spec, inputs=inputs, **runtime, magnitudes=sizes)
    assert set(exact) == set(inputs) == set(sizes)
    for name in inputs:   # the cancelling terms' size bounds the gradient (triangle inequality)
        assert np.linalg.norm(exact[name]) <= sizes[name] * (1 + 1e-12) and sizes[name] > 0, name
    numeric = _numeric_input_gradients(spec, q, k, v, do, inputs, **runtime)
    for name in inputs:
        assert np.shape(exact[name]) == np.shape(inputs[name])
        assert np.abs(numeric[name]).max() > 1e-3, f"{name}: the check would pass on zeros"
        np.testing.assert_allclose(exact[name], numeric[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_packed_score_input_gradients_add_up_each_sequences():
    """packed_score_input_grads of equal-length sequences packed back to back is score_input_grads of the dense
    batch (sequence b reads the inputs at b, as batch entry b does); empty sequences add nothing."""
    from fagen.reference import packed_score_input_grads, score_input_grads

    spec = Spec(head_dim=4, dtype="fp32", mask="causal", score_mod="score - slope[h] * (i - j) + w[b, h] * tanh(score)",
                inputs={"slope": "float32", "w": "float32"})
    rng = np.random.default_rng(8)
    B, H, N = 3, 2, 5
    q, k, v, do = (rng.standard_normal((B, H, N, 4)) for _ in range(4))
    inputs = {"slope": np.array([0.5, -0.25]), "w": rng.standard_normal((B, H))}
    dense = score_input_grads(q, k, v, do, spec, inputs=inputs)
    packed = lambda x: x.transpose(0, 2, 1, 3).reshape(B * N, H, 4)  # noqa: E731
    cu = np.arange(B + 1, dtype=np.int32) * N
    sizes = {}
    got = packed_score_input_grads(*(packed(x) for x in (q, k, v, do)), cu, cu, spec, inputs=inputs, magnitudes=sizes)
    assert set(got) == set(dense) == set(sizes) == {"slope", "w"}
    for name in dense:
        assert np.abs(dense[name]).max() > 1e-3
        np.testing.assert_allclose(got[name], dense[name], rtol=1e-10, atol=1e-12)
        assert sizes[name] >= np.linalg.norm(got[name])
    empty = packed_score_input_grads(*(packed(x) for x in (q, k, v, do)), np.zeros(B + 1, dtype=np.int32), cu, spec,
                                     inputs=inputs)
    assert all(not np.any(empty[name]) for name in empty) and empty["w"].shape == (B, H)


def test_score_input_gradients_leave_out_int_inputs_and_masks():
    """An int32 input (document ids, read by mask_mod and as an index) gets no gradient; the float table it
    indexes does, every entry from the reads that land on it."""
    from fagen.reference import score_input_grads

    spec = Spec(head_dim=3, dtype="fp32", mask_mod="doc[b, i] >= doc[b, j]", score_mod="score + w[doc[b, j]]",
                inputs={"doc": "int32", "w": "float32"})
    assert [name for name, _, _ in spec.modifiers.input_grads] == ["w"]
    assert spec.modifiers.record()["input_grads"] == {"w[doc[b, j]]": "1"}
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 1, 5, 3)) for _ in range(4))
    inputs = {"doc": np.array([[0, 0, 1, 1, 1]]), "w": np.array([0.5, -1.0])}
    grads = score_input_grads(q, k, v, do, spec, inputs=inputs)
    assert set(grads) == {"w"}
    numeric = _numeric_input_gradients(spec, q, k, v, do, inputs, names=["w"])["w"]
    assert np.abs(numeric).max() > 1e-3
    np.testing.assert_allclose(grads["w"], numeric, rtol=1e-5, atol=1e-7)
    # without a score_mod there is nothing to differentiate
    masked = Spec(head_dim=3, dtype="fp32", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
    assert masked.modifiers.input_grads == () and score_input_grads(q, k, v, do, masked, inputs=inputs) == {}


def test_mask_mod_is_anded_with_the_mask_and_indexed_per_batch_entry():
    from fagen.reference import visible_mask

    spec = Spec(head_dim=8, mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
    doc = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    got = visible_mask(spec, 2, 1, 5, 5, inputs={"doc": doc})
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    want = np.stack([(j <= i) & (doc[b][:, None] == doc[b][None, :]) for b in range(2)])[:, None]
    assert np.array_equal(np.broadcast_to(got, want.shape), want)
    # a packed batch's sequence b is a batch of one at first_batch = b: it reads doc[b]
    assert np.array_equal(np.broadcast_to(visible_mask(spec, 1, 1, 5, 5, inputs={"doc": doc}, first_batch=1),
                                          (1, 1, 5, 5)), want[1:2])


# ---- a value head dim unlike the query's (MLA) ---------------------------------------------------
@pytest.mark.parametrize("d, dv", [(16, 8), (8, 24)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_value_head_dim_forward_is_the_formula(d, dv, mask):
    """softmax(tau Q K^T) V with V (and so O) of dv columns, tau = 1/sqrt(d) from q's head dim."""
    spec = Spec(head_dim=d, value_head_dim=dv, dtype="bf16", mask=mask)
    rng = np.random.default_rng(d * 100 + dv)
    q, k = rng.standard_normal((2, 3, 5, d)), rng.standard_normal((2, 3, 7, d))
    v = rng.standard_normal((2, 3, 7, dv))
    o, lse = attention_forward(q, k, v, spec)
    scores = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(d)
    if mask == "causal":
        scores = np.where(np.arange(5)[:, None] + 2 >= np.arange(7)[None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    assert o.shape == (2, 3, 5, dv)
    np.testing.assert_allclose(o, weights @ v, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="value_dim = "):
        attention_forward(q, k, k, spec)   # v of q's head dim


def test_value_head_dim_backward_matches_finite_differences():
    """dq, dk of q's head dim and dv of v's, grouped KV heads and dropout included."""
    spec = Spec(head_dim=8, value_head_dim=16, dtype="bf16", mask="causal", dropout=0.25)
    kw = {"seed": 5, "offset": 1}
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((1, 4, 3, 8)), rng.standard_normal((1, 2, 4, 8))
    v = rng.standard_normal((1, 2, 4, 16))
    do = rng.standard_normal((1, 4, 3, 16))
    grads = attention_backward(q, k, v, do, spec, **kw)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def loss(q_, k_, v_):
        return float((attention_forward(q_, k_, v_, spec, **kw)[0] * do).sum())

    eps, inputs = 1e-6, [q, k, v]
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            plus, minus = [x.copy() for x in inputs], [x.copy() for x in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric[index] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg="dq dk dv".split()[which])
