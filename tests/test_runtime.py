"""CPU tests of fagen/runtime.py's host-side decisions (the GPU paths: tests/test_runtime_gpu.py,
tests/test_torch_gpu.py, tests/test_decode_gpu.py)."""
import math

import pytest

from fagen.runtime import decode_splits


@pytest.mark.parametrize("base", [1, 8, 32, 64, 256, 1024])
@pytest.mark.parametrize("sm_count, per_sm", [(132, 3), (108, 2), (132, 1)])
def test_decode_splits_fill_the_resident_slots_evenly(base, sm_count, per_sm):
    slots = sm_count * per_sm
    splits = decode_splits(base, key_tiles=512, sm_count=sm_count, blocks_per_sm=per_sm)
    waves = base * splits / slots
    fill = waves / math.ceil(waves)
    # no count up to the search bound fills the slots more than 3% better
    bound = min(256, 512, 4 * math.ceil(slots / base))
    best = max((base * s / slots) / math.ceil(base * s / slots) for s in range(1, bound + 1))
    assert 1 <= splits <= bound and fill >= 0.97 * best


def test_decode_splits_prefer_fewer_splits_and_respect_the_key_tiles():
    assert decode_splits(8, key_tiles=128, sm_count=132, blocks_per_sm=3) == 49   # one wave, not two
    assert decode_splits(256, key_tiles=128, sm_count=132, blocks_per_sm=3) == 3  # 1.94 waves, not 1.29
    assert decode_splits(8, key_tiles=2, sm_count=132, blocks_per_sm=3) == 2      # a split needs a tile of keys
    assert decode_splits(10_000, key_tiles=64, sm_count=132, blocks_per_sm=3) >= 1
