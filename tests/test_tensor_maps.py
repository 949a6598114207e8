"""fagen/runtime/tensor_maps.py on the CPU: each map's geometry (the kernel's view, innermost first), what the TMA
cannot read, the parameter's layout against the CUDA struct, and the address patching a call does instead of a full
encode, against a stand-in for cuTensorMapEncodeTiled (tests/test_tensor_maps_gpu.py runs the real driver's)."""
import ctypes

import pytest

from fagen.runtime import tensor_maps
from fagen.runtime.tensor_maps import TensorMapParameter, address_field, map_geometry


def test_tensor_map_geometry_is_the_kernels_view_innermost_first():
    shape, strides = (2, 16, 1000, 128), (16 * 1000 * 128, 1000 * 128, 128, 1)
    g = map_geometry("bf16", 2, shape, strides, 64, 128)
    assert g.dims == (128, 1000, 16, 2) and g.strides == (256, 256_000, 4_096_000)
    assert g.box == (64, 128, 1, 1) and g.swizzle == 3 and g.data_type == 9
    # (B, N, H, d) seen as (B, H, N, d): the strides follow the view, not the memory order
    t = map_geometry("fp16", 2, (2, 8, 777, 128), (777 * 8 * 128, 128, 8 * 128, 1), 64, 64)
    assert t.strides == (2048, 256, 777 * 8 * 256) and t.data_type == 6
    # fp8: a 128-byte panel of 128 columns; a 64-byte panel (d = 32 bf16) swizzles 64 bytes
    assert map_geometry("fp8_e4m3", 1, shape, strides, 128, 128).swizzle == 3
    assert map_geometry("bf16", 2, (1, 2, 10, 32), (640, 320, 32, 1), 32, 64).swizzle == 2


def test_tensor_map_geometry_gives_a_one_element_dim_a_stride_the_driver_takes():
    # a packed batch's (1, heads, total, d) view: its batch stride may be anything, even 0
    g = map_geometry("bf16", 2, (1, 8, 301, 128), (0, 128, 8 * 128, 1), 64, 128)
    assert g.dims[3] == 1 and g.strides[2] > 0 and g.strides[2] % 16 == 0


@pytest.mark.parametrize("shape, strides, why", [
    ((1, 2, 10, 60), (1200, 600, 60, 1), "rows of 120 bytes"),
    ((1, 2, 10, 64), (1280, 640, 1, 10), "columns not contiguous"),
    ((2, 2, 10, 64), (0, 640, 64, 1), "a broadcast batch (stride 0)"),
])
def test_tensor_map_geometry_refuses_what_the_tma_cannot_read(shape, strides, why):
    assert map_geometry("bf16", 2, shape, strides, 64, 128) is None, why
    assert map_geometry("fp32", 4, (1, 2, 10, 64), (1280, 640, 64, 1), 32, 128) is None   # a dtype not loaded


def test_a_tensor_map_parameter_without_maps_stays_disabled_without_the_driver():
    g = map_geometry("bf16", 2, (1, 2, 64, 64), (8192, 4096, 64, 1), 64, 64)
    for geometries in ((), (g, None, g)):
        parameter = TensorMapParameter(geometries)
        assert parameter.address % 64 == 0
        assert parameter.encode([256, 512, 768]) is False and not parameter.enabled
    # a pointer off 16 bytes is refused before the driver is asked
    assert TensorMapParameter((g, g, g)).encode([256, 520, 768]) is False


def test_the_tensor_map_parameter_is_the_kernels_struct():
    import re

    from fagen.runtime.tensor_maps import MAPPED, PARAMETER_BYTES
    from fagen.sources import TEMPLATE_DIR

    header = (TEMPLATE_DIR / "warpgroup_mma.cuh").read_text()
    assert int(re.search(r"sizeof\(TensorMaps\) == (\d+)", header).group(1)) == PARAMETER_BYTES
    fields = re.search(r"struct TensorMaps \{\s*TensorMap ([^;]+);", header).group(1)
    assert tuple(name.strip() for name in fields.split(",")) == MAPPED


GEOMETRY = map_geometry("bf16", 2, (2, 4, 300, 128), (4 * 300 * 128, 300 * 128, 128, 1), 64, 128)


class StandIn:
    """cuTensorMapEncodeTiled's stand-in: 128 bytes of the geometry with the pointer in word 1, either as bits
    (`linear`: (p >> 4) << 3 under three constant bits, as a driver that stores the address's bits would) or added to a
    constant (the carries break the XOR model: address_field must find that out). Counts its calls."""

    def __init__(self, linear=True, refuse=False):
        self.linear, self.refuse, self.calls = linear, refuse, 0

    def __call__(self, address, data_type, pointer, dims, strides, box, steps, swizzle):
        self.calls += 1
        if self.refuse:
            return 1
        shape = (data_type, tuple(dims), tuple(strides), tuple(box), swizzle)
        words = [hash((shape, n)) & (2**64 - 1) for n in range(16)]
        words[1] = ((pointer >> 4) << 3 | 5) if self.linear else (pointer + 0x123457) & (2**64 - 1)
        ctypes.memmove(address, b"".join(w.to_bytes(8, "little") for w in words), 128)
        return 0


@pytest.fixture
def stand_in(monkeypatch):
    def install(**kw):
        encoder = StandIn(**kw)
        monkeypatch.setattr(tensor_maps.driver, "encode_tensor_map", encoder)
        address_field.cache_clear()
        return encoder
    yield install
    address_field.cache_clear()


def _maps(parameter, count):
    return ctypes.string_at(parameter.address, 128 * count)


def _fresh(pointers):
    """The maps full encodes write at `pointers`."""
    return b"".join(tensor_maps._encoded(GEOMETRY, pointer) for pointer in pointers)


POINTERS = [[0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F00_2000_0010],
            [0x7E12_3456_7890, 0x10, 0x1_0000_0000],
            [0x7F00_0000_0000, 0x7F00_0000_0000, 0x7F00_0000_0000]]


def test_a_call_writes_only_the_address_word_and_gets_the_full_encodes_maps(stand_in):
    encoder = stand_in()
    field = address_field(GEOMETRY)
    assert (field.word, field.shift) == (1, 3)     # the address's bit 4 at word 1's bit 3
    parameter = TensorMapParameter([GEOMETRY] * 3)
    calls = encoder.calls
    assert parameter.encode(POINTERS[0]) and parameter.patching and parameter.enabled
    assert encoder.calls == calls and _maps(parameter, 3) == _fresh(POINTERS[0]), "the templates, patched"
    calls = encoder.calls
    for pointers in POINTERS[1:] + POINTERS[:1]:
        assert parameter.encode(pointers) and parameter.enabled
        assert _maps(parameter, 3) == _fresh(pointers), pointers
    assert encoder.calls == calls + 3 * len(POINTERS), "only _fresh's encodes: the patched calls encode nothing"
    # a pointer off 16 bytes is still refused, and the next aligned call takes the maps again
    assert not parameter.encode([0x7F00_0000_0008, 0x10, 0x20]) and not parameter.enabled
    assert parameter.encode(POINTERS[1]) and _maps(parameter, 3) == _fresh(POINTERS[1])


def test_a_driver_whose_address_is_not_bits_gets_a_full_encode_every_call(stand_in):
    encoder = stand_in(linear=False)
    assert address_field(GEOMETRY) is None
    parameter = TensorMapParameter([GEOMETRY] * 3)
    for pointers in POINTERS:
        before = encoder.calls
        assert parameter.encode(pointers) and not parameter.patching
        assert encoder.calls == before + 3
        assert _maps(parameter, 3) == _fresh(pointers)


def test_a_geometry_the_driver_refuses_stays_disabled(stand_in):
    stand_in(refuse=True)
    assert address_field(GEOMETRY) is None
    parameter = TensorMapParameter([GEOMETRY] * 3)
    assert not parameter.encode(POINTERS[0]) and not parameter.enabled and not parameter.patching
