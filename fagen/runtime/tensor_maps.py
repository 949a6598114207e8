"""TMA tensor maps: the second parameter of the kernels that load through the Tensor Memory Accelerator
(LaunchPlan.tensor_map_columns; templates/warpgroup_mma.cuh TensorMaps).

Each of q, k and v (and a backward's dO) is mapped as the kernel sees it, (column, row, head, batch entry) innermost first, with a box of
one swizzle panel (the plan's columns) by the kernel's tile rows, the 128- or 64-byte swizzle of its tiles and
zeros out of bounds. A packed batch arrives as a (1, heads, total, d) view, so one map covers every sequence. The
geometry is worked out once per call signature (the fast path keeps it), and each geometry is encoded once
(cuTensorMapEncodeTiled, on the host). A call then only writes its pointers into the maps' address field, which
`address_field` finds by encoding probe addresses and checks against fresh encodes; where that check fails (a
driver that stores the address some other way) every call encodes its maps in full, as before. Where the driver
refuses a map (a pointer or stride off 16 bytes, a paged cache) `enabled` is 0 and the kernel copies through
cp.async instead.
"""
from __future__ import annotations

import ctypes
import functools
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from fagen import cuda_driver as driver

MAP_BYTES = 128                       # a CUtensorMap
MAPPED = ("q", "k", "v", "d_o")       # TensorMaps' maps, in order (a forward leaves d_o's unset)
PARAMETER_BYTES = len(MAPPED) * MAP_BYTES + 64   # then `enabled` (padded to the maps' 64-byte alignment)
ENABLED_OFFSET = len(MAPPED) * MAP_BYTES
#: CU_TENSOR_MAP_DATA_TYPE_* (cuda.h) of the dtypes the kernels load
DATA_TYPES = {"fp8_e4m3": 0, "fp16": 6, "bf16": 9}
#: CU_TENSOR_MAP_SWIZZLE_* by the panel's bytes: the tiles' Swizzle (its 16-byte chunks XOR-ed by the row's phase)
SWIZZLES = {64: 2, 128: 3}
_LIMIT = 1 << 40                      # strides below 2^40 bytes; dims at most 2^32


@dataclass(frozen=True)
class MapGeometry:
    """One tensor's map but its pointer: dims and box innermost first, strides in bytes of rows, heads, entries."""

    data_type: int
    dims: tuple
    strides: tuple
    box: tuple
    swizzle: int


def map_geometry(dtype: str, element_bytes: int, shape: Sequence[int], strides: Sequence[int], box_columns: int,
                 box_rows: int) -> Optional[MapGeometry]:
    """The map of a (batch entry, head, row, column) tensor of `shape` and `strides` (elements) in boxes of
    box_columns x box_rows, or None where TMA cannot read it as such: a dtype it is not given, columns not
    contiguous, a stride that is not a whole number of 16 bytes, dims past the driver's limits. A dim of one
    element takes a stride the driver accepts (it is never stepped)."""
    data_type = DATA_TYPES.get(dtype)
    swizzle = SWIZZLES.get(box_columns * element_bytes)
    if data_type is None or swizzle is None or len(shape) != 4 or strides[3] != 1 or min(shape) < 1:
        return None
    dims = (shape[3], shape[2], shape[1], shape[0])
    steps = []
    extent = shape[3] * element_bytes
    for size, stride in zip(dims[1:], (strides[2], strides[1], strides[0])):
        step = stride * element_bytes if size > 1 else -(-extent // 16) * 16
        if step <= 0 or step % 16 or step >= _LIMIT:
            return None
        steps.append(step)
        extent = max(extent, step * size)
    if max(dims) > 1 << 32:
        return None
    return MapGeometry(data_type, dims, tuple(steps), (box_columns, min(box_rows, 256), 1, 1), swizzle)


@dataclass(frozen=True)
class AddressField:
    """Where an encoded map holds its global address: the 64-bit `word` of the 128 bytes, with the address's bit 4
    (pointers are 16-byte aligned) at bit `shift`, so that the map of pointer p is `template` (the map of `probe`)
    with that word (`base` in the template) XOR-ed by ((p ^ probe) >> 4) << shift."""

    template: bytes
    probe: int
    word: int
    shift: int
    base: int

    def patched(self, pointer: int) -> int:
        """The address word of the map at `pointer`."""
        return self.base ^ ((((pointer ^ self.probe) >> 4) << self.shift) & _WORD)


_WORD = (1 << 64) - 1
_PROBE = 1 << 40                       # a 16-byte-aligned address to encode at (encoding reads no memory)
_CHECKS = 8                            # fresh encodes a found field must reproduce, at random addresses


def _encoded(geometry: MapGeometry, pointer: int) -> Optional[bytes]:
    """The 128 bytes of `geometry`'s map at `pointer`, or None where the driver refuses it."""
    raw = ctypes.create_string_buffer(MAP_BYTES + 64)
    address = (ctypes.addressof(raw) + 63) & ~63
    u64, u32 = ctypes.c_uint64, ctypes.c_uint
    code = driver.encode_tensor_map(address, geometry.data_type, pointer, (u64 * 4)(*geometry.dims),
                                    (u64 * 3)(*geometry.strides), (u32 * 4)(*geometry.box), (u32 * 4)(1, 1, 1, 1),
                                    geometry.swizzle)
    return None if code else ctypes.string_at(address, MAP_BYTES)


@functools.lru_cache(maxsize=1024)
def address_field(geometry: MapGeometry) -> Optional[AddressField]:
    """`geometry`'s AddressField, found from the encodes at _PROBE and at _PROBE with bit 4 flipped (exactly one bit
    must differ), then checked: the patched map must equal a fresh encode, byte for byte, at _CHECKS random
    addresses up to 2^49. None where the driver refuses the geometry or any check fails."""
    template, flipped = _encoded(geometry, _PROBE), _encoded(geometry, _PROBE ^ 16)
    if template is None or flipped is None:
        return None
    diff = int.from_bytes(bytes(a ^ b for a, b in zip(template, flipped)), "little")
    if diff == 0 or diff & (diff - 1):
        return None
    bit = diff.bit_length() - 1
    word = bit // 64
    field = AddressField(template, _PROBE, word, bit % 64, int.from_bytes(template[8 * word:8 * word + 8], "little"))
    draw = random.Random(hash(geometry))
    for _ in range(_CHECKS):
        pointer = draw.randrange(1 << 20, 1 << 49) & ~15
        patched = field.patched(pointer).to_bytes(8, "little")
        if _encoded(geometry, pointer) != template[:8 * word] + patched + template[8 * word + 8:]:
            return None
    return field


class TensorMapParameter:
    """The kernel's TensorMaps parameter in a 64-byte-aligned host buffer (cuLaunchKernel copies it at the launch),
    for the first of MAPPED (q, k, v; a backward's dO too) of given geometries: `encode` writes the maps of one
    call's pointers, `address` is what the launch passes. Without geometries (or where one is None) the maps stay
    unset and `enabled` 0. Where every geometry's AddressField is known (`patching`), the maps are their templates
    and a call writes only their address words; otherwise each call encodes them in full."""

    __slots__ = ("_raw", "address", "_maps", "_enabled", "_fields", "_patches")

    def __init__(self, geometries: Sequence[Optional[MapGeometry]]):
        self._raw = ctypes.create_string_buffer(PARAMETER_BYTES + 64)
        self.address = (ctypes.addressof(self._raw) + 63) & ~63
        self._maps = None
        self._fields = None      # the geometries' AddressFields, looked up at the first encode
        self._patches = None     # per map: (its address word, the field's base, probe, shift), where all are known
        if geometries and all(g is not None for g in geometries):
            u64, u32 = ctypes.c_uint64, ctypes.c_uint
            self._maps = [(self.address + n * MAP_BYTES, g.data_type, (u64 * 4)(*g.dims), (u64 * 3)(*g.strides),
                           (u32 * 4)(*g.box), (u32 * 4)(1, 1, 1, 1), g.swizzle, g) for n, g in enumerate(geometries)]
        self._enabled = ctypes.c_int.from_address(self.address + ENABLED_OFFSET)

    @property
    def enabled(self) -> bool:
        return bool(self._enabled.value)

    @property
    def patching(self) -> bool:
        return self._patches is not None

    def encode(self, pointers: Sequence[int]) -> bool:
        """The maps at `pointers` (one per geometry); whether the kernel takes them (False: its cp.async loads)."""
        patches = self._patches
        if patches is None:
            patches = self._templates(pointers)
            if patches is None:
                return self._encode_in_full(pointers)
        stray = 0
        for (word, base, probe, shift), pointer in zip(patches, pointers):   # (AddressField.patched, inlined)
            word.value = base ^ ((((pointer ^ probe) >> 4) << shift) & _WORD)
            stray |= pointer
        ok = not stray & 15   # (a pointer off 16 bytes: the words are wrong, and the kernel is told not to read them)
        self._enabled.value = ok
        return ok

    def _templates(self, pointers: Sequence[int]) -> Optional[list]:
        """At the first encode of aligned pointers: the geometries' AddressFields; where all are known, their
        templates written into the maps and the patches that rewrite their address words (else None)."""
        if self._fields is not None or self._maps is None or any(pointer % 16 for pointer in pointers):
            return None
        self._fields = [address_field(m[-1]) for m in self._maps]
        if any(f is None for f in self._fields):
            return None
        for m, f in zip(self._maps, self._fields):
            ctypes.memmove(m[0], f.template, MAP_BYTES)
        self._patches = [(ctypes.c_uint64.from_address(m[0] + 8 * f.word), f.base, f.probe, f.shift)
                         for m, f in zip(self._maps, self._fields)]
        return self._patches

    def _encode_in_full(self, pointers: Sequence[int]) -> bool:
        ok = self._maps is not None and all(pointer % 16 == 0 for pointer in pointers)
        if ok:
            for (address, data_type, dims, strides, box, steps, swizzle, _), pointer in zip(self._maps, pointers):
                if driver.encode_tensor_map(address, data_type, pointer, dims, strides, box, steps, swizzle):
                    ok = False
                    break
        self._enabled.value = int(ok)
        return ok


def kernel_geometries(dtype: str, element_bytes: int, tensors: dict, columns: int, block_r: int,
                      block_c: int) -> list:
    """q's (boxes of block_r rows), k's and v's (block_c), and where `tensors` has one dO's (block_r) geometries from
    the call's DeviceTensors, in MAPPED's order."""
    rows = {"q": block_r, "k": block_c, "v": block_c, "d_o": block_r}
    return [map_geometry(dtype, element_bytes, tensors[name].shape, tensors[name].strides, columns, rows[name])
            for name in MAPPED if name in tensors]

