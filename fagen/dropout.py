"""Dropout's constants, shared by the renderer (which writes them into the kernels) and the float64 reference
(which reproduces the kernels' mask): the Philox rounds, the 16-bit keep threshold and the kept weights' scale.
"""

# Rounds of dropout's Philox calls (templates/attention_common.cuh: PHILOX_ROUNDS). Random123 reports 7 as
# the fewest that pass BigCrush and uses 10 as a safety margin; FlashAttention-2 draws dropout with 7.
# Dropout kernels spend most of their time in Philox, so fagen draws with 7 too (a 30% cheaper call).
PHILOX_ROUNDS = 7


def dropout_threshold(p: float) -> int:
    """The 16-bit threshold for drop probability p: floor(p * 2**16); an element is kept iff its draw is >= it.

    So the drop probability applied is floor(p * 2**16) / 2**16, within 2**-16 (< 1.6e-5) of p.
    """
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    return int(p * 2**16)


def dropout_keep_scale(p: float) -> float:
    """The factor kept weights take: 1 / the keep probability applied, 2**16 / (2**16 - dropout_threshold(p)),
    so that E[Z * scale] = 1 exactly (1 / (1 - p) would be off by up to 2**-16 / (1 - p))."""
    return 2**16 / (2**16 - dropout_threshold(p))
