"""Stage 5: launching. `fagen.compile(spec)` -> a `Kernel` you call on tensors.

Takes PyTorch CUDA tensors or any object exposing `__cuda_array_interface__`, layout
(batch, heads, seq, head_dim) with any strides whose last dimension is contiguous. Every argument is
checked before anything is launched.

What a call costs is what a user feels inside a model, so the per-call path is kept to: argument
checks, output allocation, packing one argument struct and `cuLaunchKernel` on the caller's stream
(fagen/cuda_driver.py). No spec validation, no sympy, no rendering, no device query and no device
synchronisation happen there:

- **Streams.** torch tensors: PyTorch's current stream (outputs come from PyTorch's allocator on
  that stream, so they are safe there and inside CUDA graph capture). Other arrays: the `stream`
  entry of `__cuda_array_interface__`, or `stream=` (an int handle, a torch stream or a PyCUDA one).
- **Errors.** A launch that the driver refuses raises at once, naming the kernel. Faults inside a
  kernel surface at the next synchronisation, as in PyTorch; `FAGEN_SYNC_LAUNCHES=1` (or
  `fagen.runtime.CHECK_LAUNCHES = True`) synchronises after every call and names the kernel.
- **Loads.** A `Kernel` is made from what the build made (fagen/artifact.py: a JSON record and a cubin per
  pass); this module never solves, renders or compiles. `fagen.compile(spec)` (fagen/jit.py) finds that artifact
  in the disk plan cache or builds it there (fagen/build.py), then loads it here.
"""
from __future__ import annotations

import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import Any, Optional

from fagen import cuda_driver as driver
from fagen.artifact import INPUT_GRAD_BACKWARD, Artifact
from fagen.spec import Spec
from fagen.target import Target, from_attributes

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
CAI_TYPESTRS = {"fp16": ("<f2",), "bf16": ("<V2", "|V2", "<b2"), "fp32": ("<f4",)}
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}

#: Synchronise after each call, so that a fault inside a kernel names the call that caused it. Off
#: by default (a sync per call costs what the kernels win); FAGEN_SYNC_LAUNCHES=1 turns it on.
CHECK_LAUNCHES = os.environ.get("FAGEN_SYNC_LAUNCHES", "0") not in ("", "0", "false", "False")


class ArgumentError(ValueError):
    """A tensor or run-time argument the kernel cannot take; raised before any launch."""


# ---- the launch argument struct (mirrors fagen::AttentionArgs in templates/attention_common.cuh) ----
_POINTERS = ("q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv", "dq_accum", "delta", "o_accum", "row_max", "row_sum")
_FIELDS = ([(name, "Q", 1) for name in _POINTERS]
           + [(f"{t}_stride", "q", 3) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")]
           + [(name, "q", 1) for name in ("batch", "heads", "seq_q", "seq_k")]
           + [("kv_lengths", "Q", 1), ("block_mask", "Q", 1), ("block_mask_stride", "q", 4),
              ("seed", "Q", 1), ("offset", "Q", 1), ("row_groups", "q", 1),
              ("kv_group", "q", 1), ("dk_sum", "Q", 1), ("dv_sum", "Q", 1), ("dk_sum_stride", "q", 3),
              ("dv_sum_stride", "q", 3), ("cu_seqlens_q", "Q", 1), ("cu_seqlens_k", "Q", 1),
              ("max_seq_q", "q", 1), ("max_seq_k", "q", 1),
              ("mod_tensor", "Q", 4), ("mod_size", "q", 8), ("mod_stride", "q", 8), ("mod_scalar", "d", 4),
              ("mod_summary", "Q", 4), ("problems", "q", 1), ("seed_pointer", "Q", 1),
              ("block_table", "Q", 1), ("block_table_stride", "q", 1), ("page_size", "q", 1), ("page_count", "q", 1),
              ("mod_grad", "Q", 4), ("fold_heads", "q", 1), ("d_lse", "Q", 1)])
ARGS_STRUCT = struct.Struct("<" + "".join(code * count for _, code, count in _FIELDS))
_SLOT: dict[str, tuple[int, int]] = {}
for _name, _code, _count in _FIELDS:
    _SLOT[_name] = (sum(c for _, _, c in _FIELDS[:[f[0] for f in _FIELDS].index(_name)]), _count)
for _n in range(4):   # one slot per mod_tensor / mod_summary entry, for the fast path's pointer refills
    _SLOT[f"mod_tensor{_n}"] = (_SLOT["mod_tensor"][0] + _n, 1)
    _SLOT[f"mod_summary{_n}"] = (_SLOT["mod_summary"][0] + _n, 1)
_FLOAT_SLOTS = frozenset(range(_SLOT["mod_scalar"][0], _SLOT["mod_scalar"][0] + 4))


class LaunchArgs:
    """AttentionArgs as a flat list of 8-byte values, packed once per launch."""

    __slots__ = ("values",)

    def __init__(self):
        self.values = [0] * (ARGS_STRUCT.size // 8)

    def __setitem__(self, name: str, value) -> None:
        start, count = _SLOT[name]
        convert = float if start in _FLOAT_SLOTS else int
        if count == 1:
            self.values[start] = convert(value)
        else:
            self.values[start:start + count] = [convert(x) for x in value]

    def packed(self) -> "driver.LaunchArguments":
        arguments = driver.LaunchArguments(ARGS_STRUCT.size)
        ARGS_STRUCT.pack_into(arguments.buffer, 0, *self.values)
        return arguments


# ---- tensors ---------------------------------------------------------------------------------
@dataclass
class DeviceTensor:
    """What the kernel needs of a tensor: pointer, shape, strides in elements, dtype, owner."""

    name: str
    pointer: int
    shape: tuple
    strides: tuple
    dtype: str      # fp16 | bf16 | fp32 | int32 | uint8 | bool | other:<x>
    owner: Any
    is_torch: bool
    stream: Optional[int] = None   # __cuda_array_interface__'s stream, for other arrays


_TORCH_DTYPE_NAMES: dict = {}


def _torch_dtype_name(tensor) -> str:
    if not _TORCH_DTYPE_NAMES:
        import torch

        _TORCH_DTYPE_NAMES.update({torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                                   torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
                                   torch.bool: "bool"})
    return _TORCH_DTYPE_NAMES.get(tensor.dtype) or f"other:{tensor.dtype}"


def as_device_tensor(name: str, value: Any) -> DeviceTensor:
    if isinstance(value, DeviceTensor):
        return value
    if type(value).__module__.startswith("torch"):
        if not value.is_cuda:
            raise ArgumentError(f"{name}: tensor is on {value.device}; fagen kernels need CUDA tensors")
        return DeviceTensor(name, value.data_ptr(), tuple(value.shape), value.stride(), _torch_dtype_name(value),
                            value, True)
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is None:
        raise ArgumentError(f"{name}: expected a torch CUDA tensor or an object with __cuda_array_interface__, "
                            f"got {type(value).__name__}")
    typestr = cai["typestr"]
    itemsize = int(typestr[2:])
    dtype = next((k for k, v in CAI_TYPESTRS.items() if typestr in v), None) or \
        {"<i4": "int32", "<i8": "int64", "<u8": "uint64", "|u1": "uint8", "|b1": "bool"}.get(typestr, f"other:{typestr}")
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides, step = [], 1
        for extent in reversed(shape):
            strides.append(step)
            step *= extent
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // itemsize for s in cai["strides"])
    return DeviceTensor(name, int(cai["data"][0]), shape, strides, dtype, value, False, cai.get("stream"))


def _is_device_array(value) -> bool:
    return (type(value).__module__.startswith("torch") and getattr(value, "is_cuda", False)) or \
        hasattr(value, "__cuda_array_interface__")


def _fast_seed(seed, offset, tensor_type, int64, device: int) -> bool:
    """Whether the fast path takes this seed as it is: an int in range, or a torch tensor of one int64
    on the call's device (anything else goes through the full path, which checks it)."""
    if type(offset) is not int or not 0 <= offset < 2**32:
        return False
    if type(seed) is int:
        return 0 <= seed < 2**64
    return type(seed) is tensor_type and seed.dtype is int64 and seed.numel() == 1 and seed.get_device() == device


def _seed_values(seed, offset) -> tuple:
    """The fast path's (seed, offset, seed_pointer) slots: an int seed by value, a CUDA tensor seed by
    address (checked by the call that made the FastCall: see _signature)."""
    return (0, offset, seed.data_ptr()) if type(seed) is not int else (seed, offset, 0)


def stream_handle(stream) -> int:
    """A CUstream from what a user may pass: an int, a torch stream or a PyCUDA stream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attribute in ("cuda_stream", "handle"):   # torch.cuda.Stream, pycuda.driver.Stream
        if hasattr(stream, attribute):
            return int(getattr(stream, attribute))
    raise ArgumentError(f"stream: expected an int handle, a torch.cuda.Stream or a pycuda Stream, got {type(stream).__name__}")


def _caller_stream(like: DeviceTensor, stream):
    """A context that makes `stream` PyTorch's current stream on `like`'s device: a torch call given an
    explicit stream runs (allocations included) as if the caller had entered torch.cuda.stream(stream)."""
    import torch

    return torch.cuda.stream(torch.cuda.ExternalStream(stream_handle(stream), device=like.owner.device))


_pycuda_context = None


def ensure_context(device_index: Optional[int] = None):
    """Make the device's primary context current: the same one PyTorch uses. Also pushes it for
    PyCUDA, which allocates the outputs of calls made with non-torch arrays."""
    global _pycuda_context
    if device_index is None:
        device_index = _default_device()
    driver.make_current(device_index)
    if _pycuda_context is None:
        try:
            import pycuda.driver as cuda
        except ImportError:
            return None
        cuda.init()
        _pycuda_context = cuda.Device(device_index).retain_primary_context()
        _pycuda_context.push()
        import atexit

        atexit.register(_pycuda_context.pop)  # PyCUDA aborts at exit if a pushed context is left on the stack
    return _pycuda_context


def _default_device() -> int:
    """PyTorch's current device when PyTorch is in use, else the current context's, else 0."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    current = driver.current_device()
    return 0 if current is None else current


def _allocate(like: DeviceTensor, shape: tuple, dtype: str, stream: int, zero: bool = False,
              fill: Optional[float] = None):
    """An output (or workspace) on the same device, of the same kind as `like`, usable on `stream`;
    zeroed with `zero`, or every element `fill` (fp32 only).

    A torch output of `like`'s own shape and dtype is `torch.empty_like`: it keeps a dense input's
    memory layout, so (batch, seq, heads, d) activations viewed as (batch, heads, seq, d) give an
    output whose transpose back is free. The ops' fake kernels allocate the same way."""
    if like.is_torch:
        import torch

        if shape == like.shape and dtype == like.dtype and not zero and fill is None:
            return torch.empty_like(like.owner)
        torch_dtype = getattr(torch, TORCH_DTYPES.get(dtype, dtype))
        return _filled(torch.empty(shape, dtype=torch_dtype, device=like.owner.device), stream, zero, fill)
    import numpy as np
    import pycuda.gpuarray as gpuarray

    ensure_context()
    np_dtype = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "uint8": np.uint8}.get(dtype)
    if np_dtype is None:
        raise ArgumentError(f"{like.name}: allocating {dtype} outputs needs torch tensors as inputs")
    out = gpuarray.empty(shape, np_dtype)  # cuMemAlloc: fresh memory, safe on any stream
    _fill(int(out.gpudata), out.size, out.nbytes, stream, zero, fill)
    return out


def _fill(pointer: int, count: int, nbytes: int, stream: int, zero: bool = False, fill: Optional[float] = None,
          device: Optional[int] = None) -> None:
    """`count` elements from `pointer` (`nbytes` bytes) zeroed, or set to the fp32 `fill`, by one cuMemset on
    `stream`. `device`: the device the memory is on, whose context the memset is issued in (driver.enter_device:
    the thread's may be another GPU's, or none on autograd's thread, where torch's runtime-API calls bind one by
    themselves and driver calls do not); None for PyCUDA arrays, which live in the current context."""
    if fill is None and not zero:
        return
    previous = driver.enter_device(device) if device is not None else None
    try:
        if fill is not None:
            driver.memset_d32(pointer, struct.unpack("<I", struct.pack("<f", fill))[0], count, stream)
        else:
            driver.memset_d8(pointer, 0, nbytes, stream)
    finally:
        if previous:
            driver.leave_device(previous)


def _filled(tensor, stream: int, zero: bool = False, fill: Optional[float] = None):
    """A torch tensor just allocated (dense, from its first element) zeroed or filled by `_fill`: a cuMemset
    through ctypes costs the host a few µs less than torch's zeros / full (a fill kernel through the dispatcher),
    which counts in the fast paths' host time per call (issue 10)."""
    if zero or fill is not None:
        device = tensor.get_device()
        if stream is None:   # (a caller on torch's current stream, as torch's own fills would run)
            stream = _torch_types()["stream"](device)
        _fill(tensor.data_ptr(), tensor.numel(), tensor.numel() * tensor.element_size(), stream, zero, fill, device)
    return tensor


# ---- the per-call fast path ------------------------------------------------------------------------
_TORCH = {}   # "Tensor": torch.Tensor, "stream": the raw current-stream getter; filled on first use


def _torch_types():
    if not _TORCH:
        import torch

        _TORCH["Tensor"], _TORCH["int32"], _TORCH["uint8"] = torch.Tensor, torch.int32, torch.uint8
        _TORCH["float32"], _TORCH["int64"] = torch.float32, torch.int64
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH["stream"] = raw or (lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _TORCH


def _small_tensor_key(value, dtype, device: int):
    """The part of a call's signature that kv_lengths / block_mask contribute, or False where only the
    full path can take them (host lists, other dtypes or devices, non-contiguous: it converts them)."""
    if value is None:
        return None
    if (type(value) is not _TORCH["Tensor"] or value.dtype is not dtype or value.get_device() != device
            or not value.is_contiguous()):
        return False
    return tuple(value.shape)


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


#: Fast-path signatures kept per kernel and pass; a table that fills up is cleared (see _remember).
FAST_CALLS_KEPT = 256


def backward_scratch(rows: int, head_dim: int, deterministic: bool) -> tuple[int, int]:
    """The backward's fp32 scratch, one allocation: D_i (`rows` values, (batch, heads, seq_q)), then, unless
    the plan is deterministic, dq_accum (rows x head_dim, which the _delta kernel clears) from a 256-byte
    boundary. Returns (elements, dq_accum's offset in elements; 0 when there is none)."""
    if deterministic:
        return rows, 0
    offset = -(-rows // 64) * 64
    return offset + rows * head_dim, offset


class FastCall:
    """A call signature seen before (shapes, strides, dtypes, devices of every tensor): the packed
    argument struct with everything but the pointers, seed and offset filled in, and the launches.
    A call that matches one only allocates its outputs, writes those slots and launches: the checks
    ran on the first call with this signature and their outcome depends on nothing else."""

    __slots__ = ("values", "params", "slots", "launches", "prepared", "lock", "workspaces", "main", "folded")

    def __init__(self, args: LaunchArgs, pointers: tuple, launches: list, workspaces: tuple = (), folded: bool = False):
        import ctypes

        self.values = (ctypes.c_uint64 * len(args.values)).from_buffer_copy(ARGS_STRUCT.pack(*args.values))
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.values))
        self.slots = tuple(_SLOT[name][0] for name in pointers + ("seed", "offset", "seed_pointer"))
        self.launches = launches     # (CUfunction, grid, threads, smem, symbol)
        self.prepared = [driver.PreparedLaunch(*launch) for launch in launches]
        self.lock = threading.Lock()  # cuLaunchKernel copies the struct; the lock covers fill + launch
        # shapes of fp32 scratch tensors allocated per call: their pointers follow o, lse (forward) or
        # delta, dq_accum (backward)
        self.workspaces = workspaces
        self.folded = folded   # a grouped-KV backward whose blocks each walk a whole group (no dK, dV workspaces)
        # the kernel a failure is reported against (the first launch that is not a helper)
        self.main = next((launch[4] for launch in launches if not launch[4].endswith(_HELPER_KERNELS)),
                         launches[0][4])

    def launch(self, device: int, stream: int, values: tuple) -> None:
        params = self.params
        previous = driver.enter_device(device)
        try:
            with self.lock:
                array = self.values
                for slot, value in zip(self.slots, values):
                    array[slot] = value
                for launch in self.prepared:
                    code = launch(stream, params)
                    if code:
                        raise launch.failed(code)
        finally:
            if previous:   # (the caller's context, on another device)
                driver.leave_device(previous)


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


# ---- packed variable-length batches ------------------------------------------------------------
@dataclass
class Sequences:
    """The sequences of one packed call (spec layout packed): how many, the longest query and key
    lengths (the grid is sized for them), and cu_seqlens_q / cu_seqlens_k on the device."""

    count: int
    max_q: int
    max_k: int
    pointers: tuple          # (cu_seqlens_q, cu_seqlens_k) device pointers
    keep: list               # the device tensors behind them, held until the launches are queued
    covers_q: bool = False   # known (host offsets) to cover every query row from 0 to total_q
    covers_k: bool = False   # ... every key row: no output row is left unwritten by the kernels

    @property
    def has_work(self) -> bool:
        return self.max_q > 0 and self.max_k > 0


def _packed_view(tensor: DeviceTensor) -> DeviceTensor:
    """(total, heads, d) -> the (1, heads, total, d) view the kernels address as (batch, head, row);
    lse (heads, total) -> (1, heads, total). No copy: torch tensors become torch views (so that an
    aligned copy, if one is needed, is made of the view), other arrays a DeviceTensor with the strides."""
    if len(tensor.shape) == 3:
        shape = (1, tensor.shape[1], tensor.shape[0], tensor.shape[2])
        strides = (0, tensor.strides[1], tensor.strides[0], tensor.strides[2])
        owner = tensor.owner.unsqueeze(0).transpose(1, 2) if tensor.is_torch else tensor.owner
    else:
        shape, strides = (1, *tensor.shape), (tensor.shape[0] * tensor.shape[1], *tensor.strides)
        owner = tensor.owner.unsqueeze(0) if tensor.is_torch else tensor.owner
    if tensor.is_torch:
        return owner
    return DeviceTensor(tensor.name, tensor.pointer, shape, strides, tensor.dtype, owner, False, tensor.stream)


# ---- the kernel object -------------------------------------------------------------------------
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

    @classmethod
    def from_plan(cls, plan: dict, symbols, head_dim: int, folds_heads: bool = False) -> "LaunchPlan":
        return cls(tuple(symbols), plan["block_r"], plan["block_c"], plan["threads"], plan["smem_bytes"],
                   plan["stages"], plan["tensor_cores"], plan.get("head_dim") or head_dim, plan["template"],
                   plan["family"], folds_heads)


class Kernel:
    """A compiled spec: `forward(q, k, v, ...) -> (o, lse)` and `backward(...) -> (dq, dk, dv)`.

    Loaded from an artifact (fagen/artifact.py) that the build made: `fagen.compile(spec)` gives one."""

    def __init__(self, spec: Spec, target: Target, artifact: Artifact, *, device: Optional[int] = None):
        self.spec, self.target = spec, target
        record, cubins = artifact.record, artifact.cubins
        self.record = record
        self.plans = {p: LaunchPlan.from_plan(record["plans"][p], record["kernels"][p], spec.head_dim,
                                              record["folds_heads"][p])
                      for p in record["plans"]}
        self._cubins = {p: cubins[p] for p in self.plans}   # pass -> cubin
        self._input_grad_cubin: Optional[bytes] = cubins.get(INPUT_GRAD_BACKWARD)   # the backward WITH_INPUT_GRADS
        self._functions: dict[int, dict[str, int]] = {}   # device -> symbol -> CUfunction
        self._input_grad_functions: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()
        # Rows of whole 16-byte chunks are copied by cp.async (they must start on 16-byte boundaries);
        # other head dims load element by element, anywhere. An even d stores output pairs as 32 bits.
        self._chunked_rows = spec.head_dim * ELEMENT_BYTES[spec.dtype] % 16 == 0
        self._pair_stores = spec.head_dim % 2 == 0
        # The passes whose full path copies a tensor to align its rows (_aligned): a call remembered from that
        # copy would launch with the copy's strides on the caller's pointer, so the fast path checks rows there.
        self._checks_rows = {name: self._chunked_rows and (plan.stages > 1
                                                            or (name == "forward" and "decode" in self.plans))
                             for name, plan in self.plans.items()}
        self._fast_forward: dict[tuple, FastCall] = {}
        self._fast_backward: dict[tuple, FastCall] = {}
        # the torch autograd path's backwards by their forward's signature (see backward_after)
        self._fast_backward_after: dict[tuple, tuple] = {}
        self._modifiers = None
        self._load(_default_device() if device is None else device)

    @property
    def modifiers(self):
        """The spec's mask_mod / score_mod and their inputs (fagen/expressions/), parsed on first use."""
        if self._modifiers is None:
            self._modifiers = self.spec.modifiers
        return self._modifiers

    def _load(self, device: int) -> dict:
        """This kernel's functions in the device's primary context (modules are per context)."""
        with self._lock:
            functions = self._functions.get(device)
            if functions is None:
                functions = self._functions[device] = self._module_functions(device, self._cubins)
            return functions

    def _module_functions(self, device: int, cubins: dict) -> dict:
        """symbol -> CUfunction of each pass's cubin in `cubins`, loaded in the device's primary context."""
        functions = {}
        with driver.on_device(device):   # (the functions too: they belong to the module's context)
            for pass_name, cubin in cubins.items():
                module = driver.load_module(cubin)
                plan = self.plans[pass_name]
                for symbol in plan.symbols:
                    big = not symbol.endswith(_HELPER_KERNELS)  # the others are given plan.smem_bytes
                    functions[symbol] = driver.get_function(module, symbol, plan.smem_bytes if big else 0)
        return functions

    def _load_input_grad_backward(self, device: int) -> dict:
        """The backward's functions built WITH_INPUT_GRADS (the artifact's INPUT_GRAD_BACKWARD cubin), loaded when
        a backward first asks for input gradients."""
        with self._lock:
            functions = self._input_grad_functions.get(device)
            if functions is None:
                if self._input_grad_cubin is None:
                    raise ArgumentError(f"input_grads: {self.spec.variant_name}'s build has no backward with input "
                                        "gradients (score_mod reads no float tensor input, or no backward pass)")
                functions = self._module_functions(device, {"backward": self._input_grad_cubin})
                self._input_grad_functions[device] = functions
            return functions

    def __repr__(self) -> str:
        plans = ", ".join(f"{p}: Br={x['block_r']} Bc={x['block_c']} warps={x['warps']}"
                          for p, x in self.record["plans"].items())
        return f"<fagen.Kernel {self.spec.variant_name} on {self.target.name} ({plans})>"

    # ---- argument checks ----
    def _check_qkv(self, q, k, v, extra: dict) -> tuple[dict, tuple]:
        spec = self.spec
        tensors = {"q": as_device_tensor("q", q), "k": as_device_tensor("k", k), "v": as_device_tensor("v", v)}
        for key, value in extra.items():
            tensors[key] = as_device_tensor(key, value)
        for t in tensors.values():
            if len(t.shape) != 4:
                raise ArgumentError(f"{t.name}: expected 4 dimensions (batch, heads, seq, head_dim), got shape {t.shape}")
            if t.dtype != spec.dtype:
                raise ArgumentError(f"{t.name}: dtype {t.dtype} does not match the spec's dtype {spec.dtype}")
            if t.shape[3] != spec.head_dim:
                raise ArgumentError(f"{t.name}: head_dim {t.shape[3]} does not match the spec's head_dim {spec.head_dim}")
            if t.strides[3] != 1:
                raise ArgumentError(f"{t.name}: the last dimension must be contiguous (stride 1), got strides {t.strides}")
            if t.shape[2] < 1 or t.shape[0] < 1 or t.shape[1] < 1:
                raise ArgumentError(f"{t.name}: every dimension must be >= 1, got shape {t.shape}")
        batch, heads, seq_q, _ = tensors["q"].shape
        seq_k = tensors["k"].shape[2]
        if tensors["k"].shape != tensors["v"].shape:
            raise ArgumentError(f"k and v must have the same shape, got {tensors['k'].shape} and {tensors['v'].shape}")
        kv_heads = tensors["k"].shape[1]
        if tensors["k"].shape[0] != batch or heads % kv_heads:
            raise ArgumentError(f"q has (batch, heads) = {(batch, heads)} but k, v have {tensors['k'].shape[:2]}: "
                                f"the batch must match and the heads of k, v must divide q's (grouped KV heads: "
                                f"query head h reads K/V head h // (heads // kv_heads))")
        for key in ("o", "d_o"):
            if key in tensors and tensors[key].shape != tensors["q"].shape:
                raise ArgumentError(f"{key}: expected shape {tensors['q'].shape} (like q), got {tensors[key].shape}")
        if tensors["q"].is_torch:
            devices = {t.owner.device for t in tensors.values() if t.is_torch}
            if len(devices) > 1:
                raise ArgumentError(f"q, k, v are on different devices: {sorted(map(str, devices))}")
        return tensors, (batch, heads, seq_q, seq_k)

    def _runtime_args(self, args: LaunchArgs, tensors: dict, shape: tuple, kv_lengths, block_mask, inputs, seed, offset,
                      sequences: Optional["Sequences"] = None, stream: int = 0):
        """The run-time inputs into `args`; `shape` is (sequences, heads, longest Nq, longest Nk)."""
        spec = self.spec
        batch, heads, seq_q, seq_k = shape
        keep = []
        if sequences is not None:
            args["cu_seqlens_q"], args["cu_seqlens_k"] = sequences.pointers
            args["max_seq_q"], args["max_seq_k"] = sequences.max_q, sequences.max_k
            keep += sequences.keep
        if _is_device_array(seed):
            held = self._device_seed(seed, tensors["q"])
            keep.append(held.owner)
            args["seed_pointer"], seed = held.pointer, 0
        try:
            seed, offset = int(seed), int(offset)
        except (TypeError, ValueError):
            raise ArgumentError(f"seed and offset must be integers (or the seed a CUDA tensor holding one int64), "
                                f"got {seed!r}, {offset!r}") from None
        if not (0 <= seed < 2**64 and 0 <= offset < 2**32):
            raise ArgumentError(f"seed must be in [0, 2**64) and offset in [0, 2**32), got {seed}, {offset}")
        args["seed"], args["offset"] = seed, offset
        if spec.mask == "padding":
            if kv_lengths is None:
                raise ArgumentError("mask padding needs kv_lengths: the number of valid keys per batch entry, shape (batch,)")
            lengths = self._small_int_tensor("kv_lengths", kv_lengths, tensors["q"], "int32", upper=seq_k)
            if tuple(lengths.shape) != (batch,):
                raise ArgumentError(f"kv_lengths: expected shape ({batch},), got {tuple(lengths.shape)}")
            keep.append(lengths)
            args["kv_lengths"] = as_device_tensor("kv_lengths", lengths).pointer
        elif kv_lengths is not None:
            raise ArgumentError(f"kv_lengths is only for mask padding; this spec's mask is {spec.mask}")
        if spec.mask == "block_sparse":
            if block_mask is None:
                raise ArgumentError("mask block_sparse needs block_mask: shape (ceil(Nq/G), ceil(Nk/G)) or "
                                    "(batch|1, heads|1, ceil(Nq/G), ceil(Nk/G)), G = block_size")
            layout = self._small_int_tensor("block_mask", block_mask, tensors["q"], "uint8")
            grain = spec.block_size
            blocks = (math.ceil(seq_q / grain), math.ceil(seq_k / grain))
            lt = as_device_tensor("block_mask", layout)
            if len(lt.shape) == 2:
                lt_shape, lt_strides = (1, 1, *lt.shape), (0, 0, *lt.strides)
            elif len(lt.shape) == 4:
                lt_shape, lt_strides = lt.shape, lt.strides
            else:
                raise ArgumentError(f"block_mask: expected 2 or 4 dimensions, got shape {lt.shape}")
            if tuple(lt_shape[2:]) != blocks or lt_shape[0] not in (1, batch) or lt_shape[1] not in (1, heads):
                raise ArgumentError(f"block_mask: expected shape {blocks} or ({batch}|1, {heads}|1, {blocks[0]}, {blocks[1]}) "
                                    f"for block_size {grain}, got {tuple(lt.shape)}")
            strides = [0 if lt_shape[n] == 1 else lt_strides[n] for n in range(4)]
            keep.append(layout)
            args["block_mask"] = lt.pointer
            args["block_mask_stride"] = strides
        elif block_mask is not None:
            raise ArgumentError(f"block_mask is only for mask block_sparse; this spec's mask is {spec.mask}")
        keep += self._mod_inputs(args, inputs, tensors["q"], stream)
        return keep

    def _mod_inputs(self, args: LaunchArgs, inputs, like: DeviceTensor, stream: int) -> list:
        """The run-time inputs a spec's mask_mod / score_mod declare (`inputs` in the spec), from a dict
        name -> tensor (the declared dtype, as many dimensions as the expressions index) or number."""
        mods = self.modifiers
        declared = [name for name, _, _ in mods.tensors] + list(mods.scalars)
        given = dict(inputs or {})
        if not declared:
            if given:
                raise ArgumentError(f"inputs {sorted(given)} given, but {self.spec.variant_name} declares no inputs")
            return []
        missing = [name for name in declared if name not in given]
        unknown = [name for name in given if name not in declared]
        if missing or unknown:
            raise ArgumentError(f"inputs: {self.spec.variant_name} declares {declared}; "
                                + (f"missing {missing}" if missing else f"unknown {unknown}"))
        keep, pointers, sizes, strides = [], [0] * 4, [1] * 8, [0] * 8
        for n, (name, dtype, ndim) in enumerate(mods.tensors):
            tensor = self._input_tensor(name, given[name], like, dtype)
            dt = as_device_tensor(name, tensor)
            if len(dt.shape) != ndim or 0 in dt.shape:
                raise ArgumentError(f"inputs {name}: the expressions index it with {ndim} subscript(s): expected a "
                                    f"non-empty {ndim}-dimensional tensor, got shape {dt.shape}")
            keep.append(tensor)
            pointers[n] = dt.pointer
            sizes[2 * n:2 * n + ndim] = dt.shape
            strides[2 * n:2 * n + ndim] = dt.strides
        scalars = [0.0] * 4
        for n, name in enumerate(mods.scalars):
            try:
                scalars[n] = float(given[name])
            except (TypeError, ValueError):
                raise ArgumentError(f"inputs {name}: a scalar input takes a number, got {type(given[name]).__name__}") from None
            if not math.isfinite(scalars[n]):
                raise ArgumentError(f"inputs {name}: must be finite, got {scalars[n]}")
        args["mod_tensor"], args["mod_size"], args["mod_stride"], args["mod_scalar"] = pointers, sizes, strides, scalars
        if mods.summaries:   # min / max per SUMMARY_GRAIN positions: the forward's _summary kernel, the backward's _delta
            summaries = [0] * 4
            for slot, shape in self._summary_workspaces(args):
                workspace = _allocate(like, shape, "fp32", stream)
                keep.append(workspace)
                summaries[int(slot[-1])] = as_device_tensor("summary", workspace).pointer
            args["mod_summary"] = summaries
        return keep

    def _summary_workspaces(self, args: LaunchArgs) -> list:
        """(slot name, shape) of each run-time summary's workspace for the inputs in `args`: (entries, 2)
        4-byte values, an entry per SUMMARY_GRAIN positions along the summarised dimension and per index
        of the other one (templates/attention_common.cuh summarise_input)."""
        from fagen.expressions import SUMMARY_GRAIN   # (sympy: loaded already for this spec's modifiers)

        start = _SLOT["mod_size"][0]
        sizes = args.values[start:start + 8]
        return [(f"mod_summary{n}", (sizes[2 * n + 1 - dim] * -(-sizes[2 * n + dim] // SUMMARY_GRAIN), 2))
                for n, dim in self.modifiers.summaries]

    def _input_grad_outputs(self, grads: dict, args: Optional[LaunchArgs], inputs, like: DeviceTensor, stream) -> None:
        """Zeroed float32 outputs, one per score_mod tensor input with a derivative (contiguous, of the input's
        shape), into `grads` by name, and their pointers into args.mod_grad (the backward adds into them)."""
        mods = self.modifiers
        if mods.input_grads_not_derived:
            name, read, why = mods.input_grads_not_derived[0]
            raise ArgumentError(f"input_grads: no derivative of {self.spec.variant_name}'s score_mod in {read} ({why})")
        wanted = {name for name, _, _ in mods.kernel_input_grads}
        pointers = [0] * 4
        for n, (name, _, _) in enumerate(mods.tensors):
            if name not in wanted:
                continue
            value = (inputs or {}).get(name)
            if not hasattr(value, "shape"):   # a list: converted by _input_tensor for the launch
                import numpy as np

                value = np.asarray(value)
            shape = tuple(value.shape)
            grads[name] = _allocate(like, shape, "fp32", stream, zero=True)
            pointers[n] = as_device_tensor(name, grads[name]).pointer
        if args is not None:
            args["mod_grad"] = pointers

    @staticmethod
    def _input_tensor(name: str, value, like: DeviceTensor, dtype: str):
        """A tensor input on the device in the declared dtype ('float32' / 'int32'): device tensors of
        that dtype as they are, anything else converted (a copy)."""
        import numpy as np

        kind = {"float32": "f", "int32": "i"}[dtype]
        if like.is_torch:
            import torch

            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
            if tensor.is_complex() or tensor.dtype == torch.bool and kind == "f":
                raise ArgumentError(f"inputs {name}: expected {dtype}, got {tensor.dtype}")
            if kind == "i" and tensor.dtype.is_floating_point:
                raise ArgumentError(f"inputs {name}: declared int32, got {tensor.dtype} (convert it explicitly)")
            return tensor.to(device=like.owner.device, dtype=getattr(torch, dtype))
        import pycuda.gpuarray as gpuarray

        ensure_context()
        if hasattr(value, "__cuda_array_interface__"):
            value = value.get() if hasattr(value, "get") else np.asarray(value)
        array = np.asarray(value)
        if kind == "i" and array.dtype.kind == "f":
            raise ArgumentError(f"inputs {name}: declared int32, got {array.dtype} (convert it explicitly)")
        return gpuarray.to_gpu(np.ascontiguousarray(array.astype(dtype)))

    @staticmethod
    def _device_seed(seed, like: DeviceTensor) -> DeviceTensor:
        """A dropout seed given as a CUDA tensor: one int64 (read as unsigned 64 bits), on q's device.
        The kernels read it when they run, so a CUDA graph replaying a seed drawn on the GPU (torch's
        generator is graph-safe) draws a new mask each replay."""
        held = as_device_tensor("seed", seed)
        size = math.prod(held.shape)
        if held.dtype not in ("int64", "uint64") or size != 1:
            raise ArgumentError(f"seed: a CUDA tensor seed must hold one int64 (or uint64), got {size} values of "
                                f"{held.dtype}")
        if held.pointer % 8:
            raise ArgumentError(f"seed: the kernels read the seed as one 8-byte word; its address {held.pointer:#x} is "
                                "not 8-byte aligned")
        if held.is_torch and like.is_torch and held.owner.device != like.owner.device:
            raise ArgumentError(f"seed is on {held.owner.device}, q on {like.owner.device}")
        return held

    @staticmethod
    def _small_int_tensor(name: str, value, like: DeviceTensor, dtype: str, upper: Optional[int] = None):
        """kv_lengths / block_mask as a device tensor of `dtype`. Host arrays and lists are checked
        against [0, upper] and copied over; device tensors are used as they are (reading them back
        would synchronise), and the kernels clamp lengths to [0, Nk] where they read them."""
        import numpy as np

        on_device = (type(value).__module__.startswith("torch") and value.is_cuda) or \
            hasattr(value, "__cuda_array_interface__")
        if not on_device:
            array = np.asarray(value)
            if array.dtype.kind == "f":
                raise ArgumentError(f"{name}: expected integers or booleans, got {array.dtype}")
            if upper is not None and array.size and (array.min() < 0 or array.max() > upper):
                raise ArgumentError(f"{name}: every value must be in [0, {upper}] (the number of keys), got "
                                    f"{array.tolist()}")
            value = array
        if like.is_torch:
            import torch

            torch_dtype = getattr(torch, dtype)
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            if tensor.dtype.is_floating_point:
                raise ArgumentError(f"{name}: expected integers or booleans, got {tensor.dtype}")
            return tensor.to(device=like.owner.device, dtype=torch_dtype).contiguous()
        import pycuda.gpuarray as gpuarray

        ensure_context()
        if hasattr(value, "__cuda_array_interface__"):
            value = value.get() if hasattr(value, "get") else np.asarray(value)
        array = np.asarray(value)
        if array.dtype.kind == "f":
            raise ArgumentError(f"{name}: expected integers or booleans, got {array.dtype}")
        return gpuarray.to_gpu(np.ascontiguousarray(array.astype(dtype)))

    def _rows_aligned(self, pointer: int, strides, alignment: int = 16) -> bool:
        """Does every row start on an `alignment`-byte boundary (pointer and the three outer strides)?"""
        items = max(1, alignment // ELEMENT_BYTES[self.spec.dtype])
        # (no generator: the fast path's signature asks this for every tensor of every call)
        return not (pointer % alignment or strides[0] % items or strides[1] % items or strides[2] % items)

    def _aligned(self, tensor: DeviceTensor, alignment: int):
        """The tensor itself if every row starts on an `alignment`-byte boundary; else an aligned copy
        (torch) or a clear error."""
        if self._rows_aligned(tensor.pointer, tensor.strides, alignment):
            return tensor.owner if tensor.is_torch else tensor   # (a packed batch's view keeps its strides)
        if tensor.is_torch:
            import torch

            return tensor.owner.clone(memory_format=torch.contiguous_format)
        raise ArgumentError(f"{tensor.name}: the tensor-core kernel needs rows aligned to {alignment} bytes "
                            f"(pointer and strides); got pointer {tensor.pointer:#x}, strides {tensor.strides}")

    @staticmethod
    def _base_args(tensors, shape) -> LaunchArgs:
        args = LaunchArgs()
        for key in ("q", "k", "v"):
            args[key] = tensors[key].pointer
            args[f"{key}_stride"] = tensors[key].strides[:3]
        args["batch"], args["heads"], args["seq_q"], args["seq_k"] = shape
        args["kv_group"] = shape[1] // tensors["k"].shape[1]
        return args

    # ---- streams and launches ----
    def _stream(self, tensors: dict, stream) -> tuple[int, int]:
        """(device, stream) for this call: see the module docstring."""
        q = tensors["q"]
        if q.is_torch:
            device = q.owner.device.index
            if stream is None:
                import torch

                return device, torch.cuda.current_stream(device).cuda_stream
            return device, stream_handle(stream)
        device = driver.current_device()
        if device is None:
            ensure_context()
            device = driver.current_device()
        if stream is not None:
            return device, stream_handle(stream)
        return device, int(q.stream or 0)   # CAI: None = no stream given (legacy), 1 = legacy, 2 = per-thread

    def _folds(self, plan: LaunchPlan, blocks: int) -> bool:
        """Whether a grouped-KV backward runs a block per (sequence, K/V head) pair and key block, walking the
        group's query heads (its kernel built so: LaunchPlan.folds_heads,
        fagen/sources.py folds_kv_group), given the `blocks` that makes:
        only where those still fill the GPU FOLD_WAVES times over (fewer, longer blocks leave SMs idle at the end)."""
        return (plan.folds_heads and not self.spec.deterministic
                and blocks >= FOLD_WAVES * self.target.sm_count)   # (a deterministic _dq grid resets args.problems)

    def _blocks_grid(self, plan: LaunchPlan, blocks: int, problems: int, args) -> tuple:
        """The grid of a main kernel's `blocks` blocks per (sequence, head) pair: in groups of pairs for the
        templates built for it (GROUPED_TEMPLATES), one pair after another otherwise."""
        if plan.template in GROUPED_TEMPLATES:
            return grouped_grid(blocks, problems, block_group(self.spec), args)
        return problem_grid(blocks, problems, args)

    def _launch(self, device: int, symbol: str, arguments, grid: tuple, threads: int, smem: int, stream: int,
                functions: Optional[dict] = None):
        functions = functions or self._functions.get(device) or self._load(device)
        # (in the device's context: the thread's may be another GPU's, or none on autograd's thread)
        with driver.on_device(device):
            driver.launch(functions[symbol], grid, threads, smem, stream, arguments, symbol)

    @staticmethod
    def _finish(symbol: str, device: int):
        if CHECK_LAUNCHES:
            try:
                with driver.on_device(device):
                    driver.synchronize(f"{symbol} (FAGEN_SYNC_LAUNCHES)")
            except driver.CudaError as err:
                raise RuntimeError(f"{symbol} failed on the GPU: {err}") from None

    def _pass(self, pass_name: str) -> LaunchPlan:
        plan = self.plans.get(pass_name)
        if plan is None:
            raise ArgumentError(f"{self.spec.variant_name} was generated without the {pass_name} pass "
                                f"(passes: {list(self.spec.passes)})")
        return plan

    # ---- the fast path: a call whose signature was seen before ----
    def _signature(self, pass_name: str, tensors: tuple, aligned: tuple, kv_lengths, block_mask, inputs, seed, offset):
        """The key of a FastCall for these torch tensors, or None where the full path must run (other
        array types, rows not 16-byte aligned for cp.async, arguments it converts, odd seeds)."""
        if not type(tensors[0]).__module__.startswith("torch"):
            return None   # (PyCUDA / __cuda_array_interface__ arrays; torch may not even be installed)
        torch_types = _torch_types()
        tensor_type = torch_types["Tensor"]
        parts = []
        for t in tensors:
            if type(t) is not tensor_type:
                return None
            parts.append((t.shape, t.stride(), t.dtype, t.get_device()))
        if self._checks_rows.get(pass_name, False):   # (a missing pass: the full path says so)
            for t in aligned:
                if not self._rows_aligned(t.data_ptr(), t.stride()):
                    return None
        device = parts[0][3]
        if not _fast_seed(seed, offset, tensor_type, torch_types["int64"], device):
            return None
        lengths_key = _small_tensor_key(kv_lengths, torch_types["int32"], device)
        mask_key = _small_tensor_key(block_mask, torch_types["uint8"], device)
        if lengths_key is False or mask_key is False:
            return None
        inputs_key = None
        if inputs:   # tensors by shape and strides (their pointers are refilled), scalars by value
            mods = self.modifiers
            if set(inputs) != {name for name, _, _ in mods.tensors} | set(mods.scalars):
                return None
            inputs_key = []
            for name, dtype, _ in mods.tensors:
                value = inputs[name]
                if (type(value) is not tensor_type or value.dtype is not torch_types[dtype]
                        or value.get_device() != device):
                    return None
                inputs_key.append((value.shape, value.stride()))
            for name in mods.scalars:
                if type(inputs[name]) not in (int, float):
                    return None
                inputs_key.append(float(inputs[name]))
            inputs_key = tuple(inputs_key)
        return (tuple(parts), lengths_key, mask_key, inputs_key)

    def _runtime_pointers(self, kv_lengths, block_mask, inputs) -> tuple[tuple, list]:
        names, pointers = (), []
        if kv_lengths is not None:
            names, pointers = names + ("kv_lengths",), pointers + [kv_lengths.data_ptr()]
        if block_mask is not None:
            names, pointers = names + ("block_mask",), pointers + [block_mask.data_ptr()]
        if inputs:
            for n, (name, _, _) in enumerate(self.modifiers.tensors):
                names, pointers = names + (f"mod_tensor{n}",), pointers + [inputs[name].data_ptr()]
        return names, pointers

    def _remember(self, table: dict, key, args: LaunchArgs, names: tuple, launches: list, device: int,
                  workspaces: tuple = (), folded: bool = False) -> None:
        functions = self._functions[device]
        if len(table) >= FAST_CALLS_KEPT:   # shapes that keep changing (a growing KV cache) start it over
            table.clear()
        table[key] = FastCall(args, names, [(functions[symbol], grid, threads, smem, symbol)
                                            for symbol, grid, threads, smem in launches], workspaces, folded)

    # ---- packed variable-length batches ----
    def _is_packed_call(self, cu_seqlens_q, cu_seqlens_k) -> bool:
        packed = self.spec.layout == "packed"
        if packed and (cu_seqlens_q is None or cu_seqlens_k is None):
            raise ArgumentError(f"{self.spec.variant_name} has layout packed: pass cu_seqlens_q and cu_seqlens_k "
                                "(int32, batch + 1 offsets of each sequence's first query / key row)")
        if not packed and (cu_seqlens_q is not None or cu_seqlens_k is not None):
            raise ArgumentError(f"cu_seqlens_q / cu_seqlens_k are for specs with layout packed; "
                                f"{self.spec.variant_name} has layout padded")
        return packed

    def _check_packed(self, names_values: dict) -> dict:
        """(total, heads, d) tensors of the spec's dtype, last dim contiguous."""
        tensors = {}
        for name, value in names_values.items():
            t = tensors[name] = as_device_tensor(name, value)
            if len(t.shape) != 3:
                raise ArgumentError(f"{name}: layout packed takes 3 dimensions (total rows, heads, head_dim), "
                                    f"got shape {t.shape}")
            if t.dtype != self.spec.dtype:
                raise ArgumentError(f"{name}: dtype {t.dtype} does not match the spec's dtype {self.spec.dtype}")
            empty = t.shape[0] == 0   # a batch of empty sequences: its strides are whatever the allocator chose
            if t.shape[2] != self.spec.head_dim or (t.strides[2] != 1 and not empty) or t.shape[1] < 1:
                raise ArgumentError(f"{name}: expected (total rows, heads >= 1, {self.spec.head_dim}) with the last "
                                    f"dim contiguous, got shape {t.shape}, strides {t.strides}")
        return tensors

    def _sequences(self, like: DeviceTensor, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   total_q: int, total_k: int) -> Sequences:
        """cu_seqlens_q / cu_seqlens_k: int32, batch + 1 non-decreasing offsets: sequence b is query rows
        [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]).
        Host arrays (lists, numpy, CPU tensors) are checked here and max_seqlen_q / _k are computed from
        them. Device tensors cannot be read without synchronising: they need max_seqlen_q / _k, and the
        kernels clamp what they read (offsets into [0, total], each sequence to its max_seqlen)."""
        import numpy as np

        offsets, maxima, covers = [], [], []
        for name, value, given, total in (("cu_seqlens_q", cu_seqlens_q, max_seqlen_q, total_q),
                                           ("cu_seqlens_k", cu_seqlens_k, max_seqlen_k, total_k)):
            on_device = (type(value).__module__.startswith("torch") and value.is_cuda) or \
                hasattr(value, "__cuda_array_interface__")
            if given is not None and (isinstance(given, bool) or not isinstance(given, (int, np.integer))
                                      or given < 0):
                raise ArgumentError(f"max_seqlen_{name[-1]}: expected a non-negative integer, got {given!r}")
            if on_device:
                if given is None:
                    raise ArgumentError(f"{name} is on the GPU: pass max_seqlen_{name[-1]} too (the longest "
                                        f"sequence; reading {name} back would synchronise the device)")
                tensor = as_device_tensor(name, value)
                if tensor.dtype != "int32" or len(tensor.shape) != 1 or tensor.shape[0] < 2:
                    raise ArgumentError(f"{name}: expected int32 of shape (batch + 1,), got {tensor.dtype} "
                                        f"{tensor.shape}")
                device_value, maximum = value, int(given)
                covers.append(False)
            else:
                array = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
                if array.ndim != 1 or array.size < 2 or array.dtype.kind not in "iu":
                    raise ArgumentError(f"{name}: expected integers of shape (batch + 1,), got {array.dtype} "
                                        f"{array.shape}")
                lengths = np.diff(array.astype(np.int64))
                if array[0] < 0 or (lengths < 0).any() or array[-1] > total:
                    raise ArgumentError(f"{name}: offsets must be non-decreasing, from >= 0 to <= {total} (the "
                                        f"rows of {'q' if name.endswith('q') else 'k and v'}), got {array.tolist()}")
                maximum = int(lengths.max())
                if given is not None and given < maximum:
                    raise ArgumentError(f"max_seqlen_{name[-1]} = {given} is shorter than the longest sequence in "
                                        f"{name} ({maximum})")
                device_value = array
                covers.append(bool(array[0] == 0 and array[-1] == total))
            offsets.append(self._small_int_tensor(name, device_value, like, "int32"))
            maxima.append(maximum)
        described = [as_device_tensor(name, t) for name, t in zip(("cu_seqlens_q", "cu_seqlens_k"), offsets)]
        counts = [t.shape[0] - 1 for t in described]
        if counts[0] != counts[1]:
            raise ArgumentError(f"cu_seqlens_q and cu_seqlens_k describe {counts[0]} and {counts[1]} sequences; "
                                "they must describe the same batch")
        return Sequences(counts[0], maxima[0], maxima[1], tuple(t.pointer for t in described), offsets, *covers)

    def _packed_outputs(self, like: DeviceTensor, shapes: dict, out, stream: int, fills: dict) -> tuple:
        """Outputs of a packed call: given ones checked against `shapes`; new ones filled with `fills`
        where that is not None (rows outside every sequence, which no kernel writes, read 0 and lse -inf)."""
        if out is None:
            return tuple(_allocate(like, shape, dtype, stream, zero=fills[name] == 0, fill=fills[name] or None)
                         for name, (shape, dtype) in shapes.items())
        out = tuple(out)
        for (name, (shape, dtype)), value in zip(shapes.items(), out):
            t = as_device_tensor(f"out {name}", value)
            if t.shape != shape or t.dtype != dtype:
                raise ArgumentError(f"out {name}: expected {dtype} of shape {shape}, got {t.dtype} {t.shape}")
        return out

    @staticmethod
    def _clear_sequence_rows(outputs: tuple, sequences: Sequences, offsets: int) -> None:
        """When no kernel runs (every sequence empty of queries or keys) but the caller gave the outputs, the
        rows inside the sequences still get their values (o, dq, dk, dv 0; lse -inf): `outputs` holds
        (tensor, axis, value), rows along `axis` counted by the offsets sequences.keep[offsets]
        (0: cu_seqlens_q, 1: cu_seqlens_k). Torch tensors take a masked fill on the device (no read-back);
        other arrays read the two end offsets back, a synchronisation only this degenerate call pays."""
        cu = sequences.keep[offsets]
        for tensor, axis, value in outputs:
            t = as_device_tensor("out", tensor)
            rows = t.shape[axis]
            if t.is_torch:
                import torch

                index = torch.arange(rows, device=t.owner.device)
                inside = (index >= cu[0]) & (index < cu[-1])
                shape = [1] * len(t.shape)
                shape[axis] = rows
                t.owner.masked_fill_(inside.view(shape), value)
                continue
            import numpy as np

            first, last = (int(x) for x in np.asarray(cu.get() if hasattr(cu, "get") else cu)[[0, -1]])
            itemsize = 2 if t.dtype in ("fp16", "bf16") else 4
            if list(t.strides) != [int(np.prod(t.shape[n + 1:])) for n in range(len(t.shape))]:
                raise ArgumentError("out: a batch whose sequences all lack queries or keys needs contiguous outputs "
                                    "(their rows inside the sequences are written without a kernel)")
            # (total, heads, d): one range of rows; (heads, total): one range per head
            inner = int(np.prod(t.shape[axis + 1:]))
            for outer in range(int(np.prod(t.shape[:axis]))):
                start = t.pointer + ((outer * rows + first) * inner) * itemsize
                count = (last - first) * inner
                _fill(start, count, count * itemsize, t.stream or 0, zero=value == 0, fill=value or None)

    def _packed_signature(self, tensors: tuple, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths,
                          block_mask, inputs, seed, offset, lse=None):
        """The fast-path key of a packed call, or None: only torch tensors with offsets already on the
        GPU (int32, contiguous) and max_seqlen given, rows 16-byte aligned where cp.async reads them.
        `tensors`: (q, k, v) of a forward, (q, k, v, o, do) of a backward, which passes `lse` too."""
        torch_types = _torch_types()
        if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int or min(max_seqlen_q, max_seqlen_k) < 1:
            return None
        offsets = []
        for cu in (cu_seqlens_q, cu_seqlens_k):
            if (type(cu) is not torch_types["Tensor"] or cu.dtype is not torch_types["int32"] or cu.dim() != 1
                    or not cu.is_cuda or not cu.is_contiguous()):
                return None
            offsets.append(cu.shape[0])
        key = self._signature("forward", tensors, (), kv_lengths, block_mask, inputs, seed, offset)
        if key is None or any(len(t.shape) != 3 for t in tensors) or (inputs and self.modifiers.summaries):
            return None   # (packed calls with run-time summaries take the full path: their workspaces)
        if cu_seqlens_q.get_device() != key[0][0][3] or cu_seqlens_k.get_device() != key[0][0][3]:
            return None   # (offsets on another GPU: the full path copies them over)
        if self._chunked_rows and not all(self._rows_aligned(t.data_ptr(), (0, t.stride(1), t.stride(0)))
                                          for t in tensors):
            return None
        if lse is not None:   # the forward's (heads, total_q) fp32, contiguous
            if (type(lse) is not torch_types["Tensor"] or lse.dtype is not torch_types["float32"]
                    or lse.get_device() != key[0][0][3]):
                return None
            key += ((lse.shape, lse.stride()),)
        return ("packed", key, tuple(offsets), max_seqlen_q, max_seqlen_k)

    def _forward_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths,
                        block_mask, inputs, seed, offset, out, stream, signature=None):
        tensors = self._check_packed({"q": q, "k": k, "v": v})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            kv_lengths, block_mask, inputs, seed, offset, out, None)
        _, launch_stream = self._stream(tensors, stream)
        total_q, heads, _ = like.shape
        sequences = self._sequences(like, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q,
                                    tensors["k"].shape[0])
        o, lse = self._packed_outputs(like, {"o": (like.shape, self.spec.dtype), "lse": ((heads, total_q), "fp32")},
                                      out, launch_stream,
                                      {"o": None, "lse": None} if sequences.covers_q and sequences.has_work
                                      else {"o": 0, "lse": -math.inf})
        if out is not None and not sequences.has_work:
            self._clear_sequence_rows(((o, 0, 0.0), (lse, 1, -math.inf)), sequences, 0)
        if total_q == 0 or tensors["k"].shape[0] == 0:
            return o, lse
        views = [_packed_view(tensors[name]) for name in ("q", "k", "v")]
        self._forward(*views, kv_lengths, block_mask, inputs, seed, offset,
                      (_packed_view(as_device_tensor("o", o)), _packed_view(as_device_tensor("lse", lse))),
                      stream, signature, sequences)
        return o, lse

    def _backward_packed(self, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         kv_lengths, block_mask, inputs, seed, offset, out, stream, input_grad_out=None, signature=None,
                         d_lse=None):
        tensors = self._check_packed({"q": q, "k": k, "v": v, "o": o, "d_o": do})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, out, None,
                                             input_grad_out, d_lse=d_lse)
        _, launch_stream = self._stream(tensors, stream)
        total_q, heads, _ = like.shape
        total_k = tensors["k"].shape[0]
        lt = as_device_tensor("lse", lse)
        if lt.shape != (heads, total_q) or lt.dtype != "fp32" or (tuple(lt.strides) != (total_q, 1) and total_q):
            raise ArgumentError(f"lse: expected the forward's contiguous fp32 lse of shape {(heads, total_q)}")
        sequences = self._sequences(like, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k)
        grads = self._packed_outputs(like, {name: (tensors[name[1:]].shape, self.spec.dtype) for name in ("dq", "dk", "dv")},
                                     out, launch_stream, {"dq": None if sequences.covers_q and sequences.has_work else 0,
                                                          "dk": None if sequences.covers_k and sequences.has_work else 0,
                                                          "dv": None if sequences.covers_k and sequences.has_work else 0})
        if out is not None and not sequences.has_work:
            self._clear_sequence_rows(((grads[0], 0, 0.0),), sequences, 0)
            self._clear_sequence_rows(((grads[1], 0, 0.0), (grads[2], 0, 0.0)), sequences, 1)
        if total_q == 0 or total_k == 0:
            return grads
        self._d_lse_pointer(d_lse, lt)   # (checked against the packed lse here, before its view below)
        views = [_packed_view(tensors[name]) for name in ("q", "k", "v", "o")]
        self._backward(*views, _packed_view(lt), _packed_view(tensors["d_o"]), kv_lengths, block_mask, inputs, seed, offset,
                       tuple(_packed_view(as_device_tensor(name, g)) for name, g in zip(("dq", "dk", "dv"), grads)),
                       stream, signature, sequences, input_grad_out,
                       None if d_lse is None else _packed_view(as_device_tensor("d_lse", d_lse)))
        return grads

    # ---- forward ----
    def forward(self, q, k, v, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0, offset: int = 0,
                out=None, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                block_table=None):
        """(o, lse): o like q; lse float32 (batch, heads, seq_q), natural log, -inf for rows that see no key.

        `out=(o, lse)` writes into given tensors (o contiguous in its last dim, lse contiguous).
        `stream` overrides the stream the call runs on (default: see the module docstring).

        Specs with layout packed take q (total_q, heads, d), k and v (total_k, kv_heads, d) and
        cu_seqlens_q / cu_seqlens_k (see `_sequences`); o is (total_q, heads, d) and lse (heads, total_q).

        `block_table`: k and v are a paged K/V cache: decoding with a padded spec (see `_forward_paged`), packed
        query rows of any count per sequence with a packed spec (prefill, chunked prefill, speculative decoding:
        see `_forward_paged_packed`)."""
        if block_table is not None and self.spec.layout == "packed":
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ArgumentError("block_table with a layout packed spec: pass cu_seqlens_q (the query rows of each "
                                    "sequence) and cu_seqlens_k (their key counts, as offsets)")
            return self._forward_paged_packed(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, out, stream)
        if block_table is not None:
            if cu_seqlens_q is not None or cu_seqlens_k is not None:
                raise ArgumentError("block_table with cu_seqlens: a packed batch against a paged K/V cache takes a "
                                    "layout packed spec; a layout padded spec takes q of shape (batch, heads, Nq, d)")
            signature = None
            if out is None and stream is None and "decode" in self.plans:
                signature = self._paged_signature(q, k, v, block_table, kv_lengths, block_mask, inputs, seed, offset)
                call = self._fast_forward.get(signature) if signature is not None else None
                if call is not None:   # decode's split workspaces, then the table, as _decode remembered them
                    return self._fast_forward_call(call, q, k, v, kv_lengths, block_mask, inputs, seed, offset,
                                                   (block_table.data_ptr(),))
            return self._forward_paged(q, k, v, block_table, kv_lengths, block_mask, inputs, seed, offset, out, stream,
                                       signature)
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths,
                                        block_mask, inputs, seed, offset, out, stream)[:2]
        return self._padded_forward(q, k, v, kv_lengths, block_mask, inputs, seed, offset, out, stream)[:2]

    def _packed_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths, block_mask,
                        inputs, seed, offset, out, stream) -> tuple:
        """(o, lse, the call's fast-path signature or None) of a packed call."""
        signature = None
        if out is None and stream is None and self.spec.loop_order != "fa1":
            signature = self._packed_signature((q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               kv_lengths, block_mask, inputs, seed, offset)
            call = self._fast_forward.get(signature) if signature is not None else None
            if call is not None:
                import torch

                device = q.get_device()
                stream = _TORCH["stream"](device)
                # offsets on the GPU: which rows they cover is unknown, so the rest must read 0 / -inf
                o = _filled(torch.empty(q.shape, dtype=q.dtype, device=q.device), stream, zero=True)
                lse = _filled(torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device), stream,
                              fill=-math.inf)
                _, extra = self._runtime_pointers(kv_lengths, block_mask, inputs)
                call.launch(device, stream,
                            (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                             cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), *extra, *_seed_values(seed, offset)))
                self._finish(call.main, device)
                return o, lse, signature
        return (*self._forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      kv_lengths, block_mask, inputs, seed, offset, out, stream, signature), signature)

    def _padded_forward(self, q, k, v, kv_lengths, block_mask, inputs, seed, offset, out, stream) -> tuple:
        """(o, lse, the call's fast-path signature or None) of a (batch, heads, seq, d) call."""
        signature = None
        if out is None and stream is None and self.spec.loop_order != "fa1" and "forward" in self.plans:
            signature = self._signature("forward", (q, k, v), (q, k, v), kv_lengths, block_mask, inputs, seed, offset)
            call = self._fast_forward.get(signature) if signature is not None else None
            if call is not None:
                return (*self._fast_forward_call(call, q, k, v, kv_lengths, block_mask, inputs, seed, offset),
                        signature)
        return (*self._forward(q, k, v, kv_lengths, block_mask, inputs, seed, offset, out, stream, signature, None),
                signature)

    # ---- the autograd path: a backward keyed by its forward ----
    def forward_keyed(self, q, k, v, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0,
                      offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        """(o, lse, key): `forward` for an autograd node, with the key that `backward_after` takes for its
        backward (the call's fast-path signature, padded or packed: None where it has none)."""
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths,
                                        block_mask, inputs, seed, offset, None, None)
        return self._padded_forward(q, k, v, kv_lengths, block_mask, inputs, seed, offset, None, None)

    def backward_after(self, forward_key, q, k, v, o, lse, do, *, kv_lengths=None, block_mask=None, inputs=None,
                       seed: int = 0, offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, d_lse=None):
        """`backward` of the forward call that returned (o, lse, forward_key) from `forward_keyed`, with the
        same q, k, v and run-time arguments (the same offsets, for a packed call), and do of o's shape, dtype and
        device (what autograd hands a node). Its fast path is keyed by the forward's signature and do's strides,
        so the full signature is not recomputed: autograd runs backwards on its own thread, where this Python
        runs about 3x slower than on the caller's (host time per call, issue 10)."""
        packed = self._is_packed_call(cu_seqlens_q, cu_seqlens_k)
        if d_lse is not None:   # (lse reached the loss too: the general route, whose signature covers d_lse)
            return self.backward(q, k, v, o, lse, do, kv_lengths=kv_lengths, block_mask=block_mask, inputs=inputs,
                                 seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, d_lse=d_lse)
        entry = self._fast_backward_after.get(forward_key)
        if entry is not None:
            call, do_stride = entry
            # strides were checked when the entry was made (the forward key fixes q, k, v's, and o's and lse's with
            # them; do's is compared): only the pointers can have moved off a 16-byte boundary
            if do.stride() == do_stride and not (
                    (self._chunked_rows if packed else self._checks_rows["backward"])
                    and (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | do.data_ptr()) % 16):
                return self._fast_backward_call(call, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed,
                                                offset, (cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()) if packed
                                                else ())
        if packed:
            grads, signature = self._packed_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, None,
                                                     None)
        else:
            grads, signature = self._padded_backward(q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset,
                                                     None, None)
        call = self._fast_backward.get(signature) if signature is not None else None
        if call is not None:
            if len(self._fast_backward_after) >= FAST_CALLS_KEPT:
                self._fast_backward_after.clear()
            self._fast_backward_after[forward_key] = (call, do.stride())
        return grads

    def _fast_forward_call(self, call: FastCall, q, k, v, kv_lengths, block_mask, inputs, seed, offset, paged=()):
        """A remembered forward: outputs and workspaces allocated, the pointers written in, launched."""
        import torch

        device = q.get_device()
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        # decode: the splits' partial O and LSE; mask_mod inputs' run-time summaries. Held until the
        # launches are queued
        workspaces = [torch.empty(shape, dtype=torch.float32, device=q.device) for shape in call.workspaces]
        _, extra = self._runtime_pointers(kv_lengths, block_mask, inputs)
        call.launch(device, _TORCH["stream"](device),
                    (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     *[w.data_ptr() for w in workspaces], *paged, *extra, *_seed_values(seed, offset)))
        self._finish(call.main, device)
        return o, lse

    def _paged_signature(self, q, k_cache, v_cache, block_table, kv_lengths, block_mask, inputs, seed, offset):
        """The fast path's key of a paged call: the padded one's over q and the page pools, and the table's
        shape and row stride (its entries are data, read on the GPU)."""
        if not type(q).__module__.startswith("torch"):
            return None
        torch_types = _torch_types()
        if (type(block_table) is not torch_types["Tensor"] or block_table.dtype is not torch_types["int32"]
                or block_table.dim() != 2 or block_table.stride(1) != 1):
            return None
        key = self._signature("forward", (q, k_cache, v_cache), (q, k_cache, v_cache), kv_lengths, block_mask, inputs,
                              seed, offset)
        if key is None or block_table.get_device() != q.get_device():
            return None
        return ("paged", key, tuple(block_table.shape), block_table.stride(0))

    def _paged_cache(self, k_cache, v_cache, block_table, batch: int, q, view_batch: Optional[int] = None) -> tuple:
        """A paged K/V cache checked: k_cache and v_cache (pages, page_size, kv_heads, d), block_table (batch,
        pages per sequence) int32 on the GPU, sequence b's key j in page block_table[b, j // page_size], row
        j % page_size. Returns (k, v as the (batch, kv_heads, pages per sequence x page_size, d) views the kernels
        address: strides (page, head, row), the page stride used only through the block table (`view_batch`
        entries instead of batch: 1 for a packed call's, whose sequences are all in entry 0); the block-table
        fields of the argument struct; the table)."""
        pages = {name: as_device_tensor(name, value) for name, value in (("k", k_cache), ("v", v_cache))}
        for t in pages.values():
            if len(t.shape) != 4:
                raise ArgumentError(f"{t.name}: a paged cache has 4 dimensions (pages, page_size, kv_heads, head_dim), "
                                    f"got shape {t.shape}")
        if pages["k"].shape != pages["v"].shape:
            raise ArgumentError(f"k and v must have the same shape, got {pages['k'].shape} and {pages['v'].shape}")
        page_count, page_size, kv_heads, head_dim = pages["k"].shape
        table = as_device_tensor("block_table", block_table)
        if len(table.shape) != 2 or table.dtype != "int32" or table.strides[1] != 1 or table.shape[0] != batch:
            raise ArgumentError(f"block_table: expected int32 of shape (batch = {batch}, pages per sequence), last dim "
                                f"contiguous; got {table.dtype} of shape {table.shape}, strides {table.strides}")
        if min(table.shape[1], page_count, page_size) < 1:
            raise ArgumentError(f"block_table and the cache need at least one page of one row; got block_table "
                                f"{table.shape}, cache {pages['k'].shape}")
        owners = [t.owner for t in (*pages.values(), table) if t.is_torch]
        q_owner = getattr(q, "device", None)
        if q_owner is not None and any(o.device != q_owner for o in owners):
            raise ArgumentError(f"q, the cache and block_table must be on one device, got "
                                f"{sorted({str(q_owner), *(str(o.device) for o in owners)})}")
        view_batch = batch if view_batch is None else view_batch
        views = {name: DeviceTensor(name, t.pointer, (view_batch, kv_heads, table.shape[1] * page_size, head_dim),
                                    (t.strides[0], t.strides[2], t.strides[1], t.strides[3]), t.dtype, t.owner, False,
                                    t.stream) for name, t in pages.items()}
        fields = {"block_table": table.pointer, "block_table_stride": table.strides[0], "page_size": page_size,
                  "page_count": page_count}
        return views, fields, table

    def _forward_paged(self, q, k_cache, v_cache, block_table, kv_lengths, block_mask, inputs, seed, offset, out, stream,
                       signature=None):
        """Decoding from a paged K/V cache (_paged_cache), the layout of vLLM and FlashAttention's kvcache call.
        The keys are max pages x page_size long; mask padding with kv_lengths gives each sequence its own length.
        With a padded spec only the decode pass reads pages (the spec's passes must include it, and a call must
        fit its rows); a page must hold whole tiles of the decode plan's keys. (Packed specs: _forward_paged_packed.)"""
        decode = self.plans.get("decode")
        if decode is None:
            raise ArgumentError(f"{self.spec.variant_name}: with a layout padded spec, paged K/V caches are read by the "
                                f"decode pass; build the spec with passes including \"decode\" (passes: "
                                f"{list(self.spec.passes)}), or with layout packed for many query rows (prefill)")
        views, fields, table = self._paged_cache(k_cache, v_cache, block_table, as_device_tensor("q", q).shape[0], q)
        page_size = fields["page_size"]
        if page_size % decode.block_c:
            raise ArgumentError(f"page_size {page_size}: the decode kernel reads keys in tiles of {decode.block_c}, and a "
                                f"page must hold whole tiles (page_size a multiple of {decode.block_c})")
        return self._forward(q, views["k"], views["v"], kv_lengths, block_mask, inputs, seed, offset, out, stream,
                             signature, None, (fields, table.owner))

    def _forward_paged_packed(self, q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, out, stream):
        """Prefill, chunked prefill and speculative decoding against a paged K/V cache (_paged_cache): q packed
        (total_q, heads, d) with cu_seqlens_q, as a packed call's; cu_seqlens_k gives each sequence's key count
        (its differences: sequence b's keys are its pages' first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows,
        FlashAttention-2's varlen convention with a block table). Causal masks align bottom-right per sequence.
        Any page size; the forward kernels look each key row's page up."""
        plan = self._pass("forward")
        if plan.template not in PAGED_FORWARD_TEMPLATES:
            raise ArgumentError(f"{self.spec.variant_name}: its forward kernel ({plan.template}) does not read paged "
                                f"K/V caches; Hopper's warpgroup-MMA forwards do ({', '.join(sorted(PAGED_FORWARD_TEMPLATES))}: "
                                f"arch sm_90, fp16 / bf16, loop_order fa2)")
        if self.spec.head_dim % 8:
            raise ArgumentError(f"{self.spec.variant_name}: a paged K/V cache's rows are copied in 16-byte pieces, so "
                                f"head_dim must be a multiple of 8 (got {self.spec.head_dim})")
        tensors = self._check_packed({"q": q})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._forward_paged_packed(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, kv_lengths, block_mask, inputs, seed,
                                                  offset, out, None)
        _, launch_stream = self._stream(tensors, stream)
        total_q, heads, _ = like.shape
        table_shape = as_device_tensor("block_table", block_table).shape
        views, fields, table = self._paged_cache(k_cache, v_cache, block_table, table_shape[0] if table_shape else -1, q,
                                                 view_batch=1)
        capacity = views["k"].shape[2]
        # (cu_seqlens_k's offsets count keys, not rows of a tensor: only int32 bounds them; each sequence's count
        # is checked against its row of the table below)
        sequences = self._sequences(like, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, 2**31 - 1)
        if sequences.count != table_shape[0]:
            raise ArgumentError(f"block_table has {table_shape[0]} rows, one per sequence, but cu_seqlens_q describes "
                                f"{sequences.count} sequences")
        if sequences.max_k > capacity:
            raise ArgumentError(f"cu_seqlens_k / max_seqlen_k: sequences of up to {sequences.max_k} keys do not fit a row "
                                f"of the block table ({table_shape[1]} pages x {fields['page_size']} rows = {capacity} "
                                f"keys)")
        for name in ("k", "v"):
            if not self._rows_aligned(views[name].pointer, views[name].strides, 16):
                raise ArgumentError(f"{name}: a paged cache's rows and pages must start on 16-byte boundaries (pointer "
                                    f"and strides); got pointer {views[name].pointer:#x}, strides {views[name].strides}")
        o, lse = self._packed_outputs(like, {"o": (like.shape, self.spec.dtype), "lse": ((heads, total_q), "fp32")},
                                      out, launch_stream,
                                      {"o": None, "lse": None} if sequences.covers_q and sequences.has_work
                                      else {"o": 0, "lse": -math.inf})
        if out is not None and not sequences.has_work:
            self._clear_sequence_rows(((o, 0, 0.0), (lse, 1, -math.inf)), sequences, 0)
        if total_q == 0:
            return o, lse
        self._forward(_packed_view(tensors["q"]), views["k"], views["v"], kv_lengths, block_mask, inputs, seed, offset,
                      (_packed_view(as_device_tensor("o", o)), _packed_view(as_device_tensor("lse", lse))), stream, None,
                      sequences, (fields, table.owner))
        return o, lse

    def _forward(self, q, k, v, kv_lengths, block_mask, inputs, seed, offset, out, stream, signature,
                 sequences: Optional["Sequences"], paged: Optional[tuple] = None):
        """The full forward path (everything the fast path skips); `sequences` for packed batches,
        whose q, k, v arrive here as (1, heads, total, d) views; `paged`: (the block-table fields of the
        argument struct, the table) for a paged cache, whose k, v arrive as views (_forward_paged)."""
        plan = self._pass("forward")
        tensors, shape = self._check_qkv(q, k, v, {})
        if stream is not None and tensors["q"].is_torch:
            with _caller_stream(tensors["q"], stream):
                return self._forward(q, k, v, kv_lengths, block_mask, inputs, seed, offset, out, None, signature, sequences,
                                     paged)
        device, stream = self._stream(tensors, stream)
        batch, heads, seq_q, seq_k = shape
        problems = shape if sequences is None else (sequences.count, heads, max(1, sequences.max_q), max(1, sequences.max_k))
        if plan.stages > 1 and self._chunked_rows:  # cp.async moves 16-byte chunks: rows start on 16-byte boundaries
            q, k, v = (self._aligned(tensors[name], 16) for name in ("q", "k", "v"))
            tensors, shape = self._check_qkv(q, k, v, {})
        like = tensors["q"]
        if out is None:
            o = _allocate(like, (batch, heads, seq_q, self.spec.head_dim), self.spec.dtype, stream)
            lse = _allocate(like, (batch, heads, seq_q), "fp32", stream)
        else:
            o, lse = out
        ot, lt = as_device_tensor("o", o), as_device_tensor("lse", lse)
        if ot.shape != like.shape or ot.dtype != self.spec.dtype or ot.strides[3] != 1:
            raise ArgumentError(f"out o: expected {self.spec.dtype} of shape {like.shape}, last dim contiguous")
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or tuple(lt.strides) != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"out lse: expected contiguous fp32 of shape {(batch, heads, seq_q)}")
        if plan.tensor_cores and self._pair_stores and (ot.pointer % 4 or any(stride % 2 for stride in ot.strides[:3])):
            raise ArgumentError("out o: rows must start on 4-byte boundaries (even strides, aligned pointer)")
        args = self._base_args(tensors, shape)
        args["o"], args["lse"] = ot.pointer, lt.pointer
        args["o_stride"] = ot.strides[:3]
        keep = self._runtime_args(args, tensors, problems, kv_lengths, block_mask, inputs, seed, offset, sequences,
                                  stream)
        group = heads // tensors["k"].shape[1]
        decode = self.plans.get("decode")
        if paged is not None and sequences is not None:   # a packed batch against pages: the forward kernels
            fields, table = paged
            for name, value in fields.items():
                args[name] = value
            keep.append(table)
        elif paged is not None:
            if group * seq_q > decode.block_r:
                raise ArgumentError(f"a paged K/V cache is read by the decode kernel, which holds at most {decode.block_r} "
                                    f"query rows per K/V head (query heads per K/V head x Nq); got {group} x {seq_q}")
            fields, table = paged
            for name, value in fields.items():
                args[name] = value
            keep.append(table)
        if decode is not None and group * seq_q <= decode.block_r and not (paged is not None and sequences is not None):
            return self._decode(decode, args, tensors, shape, group, o, lse, keep, device, stream, signature,
                                kv_lengths, block_mask, inputs, paged is not None)
        symbol = plan.symbols[0]
        row_blocks = math.ceil(problems[2] / plan.block_r)
        if sequences is not None and not sequences.has_work:   # every sequence empty of queries or keys
            return o, lse                                      # (o, lse arrive as 0 and -inf)
        if self.spec.loop_order == "fa1":
            workspace = [_allocate(like, (batch, heads, seq_q, self.spec.head_dim), "fp32", stream),
                         _allocate(like, (batch, heads, seq_q), "fp32", stream),
                         _allocate(like, (batch, heads, seq_q), "fp32", stream)]
            keep += workspace
            for key, tensor in zip(("o_accum", "row_max", "row_sum"), workspace):
                args[key] = as_device_tensor(key, tensor).pointer
            # Enough row groups to fill the GPU twice over; each group walks j outer, i inner.
            row_groups = max(1, min(row_blocks, math.ceil(2 * self.target.sm_count / (problems[0] * heads))))
            args["row_groups"] = row_groups
            grid = problem_grid(row_groups, problems[0] * heads, args)
        else:
            grid = self._blocks_grid(plan, row_blocks, problems[0] * heads, args)
        arguments = args.packed()
        if self.modifiers.summaries:   # the mask_mod inputs' per-tile bounds, before the kernel reads them
            self._launch(device, symbol + "_summary", arguments, SUMMARY_GRID, 256, 0, stream)
        self._launch(device, symbol, arguments, grid, plan.threads, plan.smem_bytes, stream)
        self._finish(symbol, device)
        # (packed calls whose mask_mod needs run-time summaries get no signature: _packed_signature)
        if signature is not None and not (sequences is not None and self.modifiers.summaries):
            # the next call with this signature skips everything above
            names, _ = self._runtime_pointers(kv_lengths, block_mask, inputs)
            if sequences is not None:
                names = ("cu_seqlens_q", "cu_seqlens_k") + names
            launches = [(symbol, grid, plan.threads, plan.smem_bytes)]
            summaries = self._summary_workspaces(args) if self.modifiers.summaries else []
            if summaries:   # allocated per call like decode's workspaces: their pointers follow o and lse
                launches.insert(0, (symbol + "_summary", SUMMARY_GRID, 256, 0))
            self._remember(self._fast_forward, signature, args,
                           ("q", "k", "v", "o", "lse") + tuple(slot for slot, _ in summaries) + names,
                           launches, device, tuple(shape for _, shape in summaries))
        del keep  # torch's allocator orders the reuse of these after the kernel on this stream
        return o, lse

    def _decode(self, plan: LaunchPlan, args: LaunchArgs, tensors: dict, shape: tuple, group: int, o, lse, keep: list,
                device: int, stream: int, signature, kv_lengths, block_mask, inputs, paged: bool = False):
        """The split-KV forward for few query rows (templates/decode_splitkv.cu.j2): one block per
        (split of the keys, batch, K/V head) holds every query row of the head's group, then
        _combine merges the splits by LSE into o and lse."""
        batch, heads, seq_q, seq_k = shape
        for name in ("k", "v"):   # cp.async moves 16-byte chunks of K and V
            aligned = self._aligned(tensors[name], 16) if self._chunked_rows else tensors[name].owner
            if aligned is not tensors[name].owner:
                keep.append(aligned)
                tensors[name] = as_device_tensor(name, aligned)
                args[name], args[f"{name}_stride"] = tensors[name].pointer, tensors[name].strides[:3]
        # CUDA-core template: the smallest instance that holds the rows; tensor-core one: a single kernel
        rows = 1 << max(0, group * seq_q - 1).bit_length()
        main = next((symbol for symbol in plan.symbols if symbol.endswith(f"_r{rows}")), plan.symbols[0])
        combine = plan.symbols[-1]
        base = batch * (heads // group)
        splits = decode_splits(base, math.ceil(seq_k / plan.block_c), self.target.sm_count,
                               max(1, self.target.smem_per_block // max(plan.smem_bytes, 1)))
        workspaces = ((batch, heads, seq_q, splits, plan.head_dim), (batch, heads, seq_q, splits))
        like = tensors["q"]
        for name, workspace_shape in zip(("o_accum", "row_max"), workspaces):
            workspace = _allocate(like, workspace_shape, "fp32", stream)
            keep.append(workspace)
            args[name] = as_device_tensor(name, workspace).pointer
        args["row_groups"] = splits
        launches = [(main, problem_grid(splits, base, args), plan.threads, plan.smem_bytes),
                    (combine, (batch * heads * seq_q, 1, 1), 128, 0)]
        arguments = args.packed()
        for symbol, grid, threads, smem in launches:
            self._launch(device, symbol, arguments, grid, threads, smem, stream)
        self._finish(main, device)
        if signature is not None:
            names, _ = self._runtime_pointers(kv_lengths, block_mask, inputs)
            self._remember(self._fast_forward, signature, args, ("q", "k", "v", "o", "lse", "o_accum", "row_max")
                           + (("block_table",) if paged else ()) + names, launches, device, workspaces)
        del keep
        return o, lse

    # ---- backward ----
    def backward(self, q, k, v, o, lse, do, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0,
                 offset: int = 0, out=None, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, input_grads: bool = False, d_lse=None):
        """(dq, dk, dv) in the input's dtype, from the forward's o and lse and the output gradient do.

        `d_lse`: the gradient of the loss with respect to the forward's lse, where the loss reads lse too (a merge
        of partial attentions by their LSE, a sink logit in the softmax's denominator): fp32, lse's shape, dense.
        It adds d_lse_i * P_ij to each score's gradient (d lse_i / d s_ij = P_ij). None: lse did not reach the loss.

        `input_grads`: also the gradients of the score_mod's float tensor inputs (`inputs`) that it depends
        on, as a fourth item {name: float32 array of the input's shape} (Modifiers.kernel_input_grads). They
        are summed with float atomics, so their last bits may differ between runs, as dQ's do."""
        if input_grads:   # the full path (the fast path's FastCall has no slot for these outputs)
            grad_out = {}
            if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
                grads = self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, out, stream,
                                              grad_out, d_lse=d_lse)
            else:
                grads = self._backward(q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out, stream,
                                       None, None, grad_out, d_lse)
            if not grad_out:   # a packed batch with nothing to compute: zeros
                like = as_device_tensor("q", q)
                if stream is not None and like.is_torch:
                    with _caller_stream(like, stream):
                        self._input_grad_outputs(grad_out, None, inputs, like, None)
                else:
                    self._input_grad_outputs(grad_out, None, inputs, like, self._stream({"q": like}, stream)[1])
            return (*grads, grad_out)
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         kv_lengths, block_mask, inputs, seed, offset, out, stream, d_lse)[0]
        return self._padded_backward(q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out,
                                     stream, d_lse)[0]

    def _packed_backward(self, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kv_lengths,
                         block_mask, inputs, seed, offset, out, stream, d_lse=None) -> tuple:
        """((dq, dk, dv), the call's fast-path signature or None) of a packed call (with d_lse: the full path)."""
        signature = None
        if out is None and stream is None and d_lse is None and "backward" in self.plans:
            signature = self._packed_signature((q, k, v, o, do), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, kv_lengths, block_mask, inputs, seed, offset, lse)
            call = self._fast_backward.get(signature) if signature is not None else None
            if call is not None:
                return (self._fast_backward_call(call, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed,
                                                 offset, (cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr())),
                        signature)
        return (self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      kv_lengths, block_mask, inputs, seed, offset, out, stream, signature=signature,
                                      d_lse=d_lse),
                signature)

    def _padded_backward(self, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out,
                         stream, d_lse=None) -> tuple:
        """((dq, dk, dv), the call's fast-path signature or None) of a (batch, heads, seq, d) call."""
        signature = None
        if out is None and stream is None and "backward" in self.plans:
            # (d_lse's shape and strides in the key: a call with it remembers a launch with its pointer slot)
            signature = self._signature("backward", (q, k, v, o, lse, do) if d_lse is None else (q, k, v, o, lse, do, d_lse),
                                        (q, k, v, do), kv_lengths, block_mask, inputs, seed, offset)
            call = self._fast_backward.get(signature) if signature is not None else None
            if call is not None:
                return (self._fast_backward_call(call, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed,
                                                 offset, d_lse=d_lse), signature)
        return (self._backward(q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out, stream,
                               signature, None, d_lse=d_lse), signature)

    def _fast_backward_call(self, call: FastCall, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset,
                            offsets: tuple = (), d_lse=None):
        """A remembered backward: gradients and workspaces allocated, the pointers written in, launched.
        `offsets`: a packed call's cu_seqlens_q, cu_seqlens_k pointers, on the GPU, so which rows the sequences
        cover is unknown and rows outside every one must read 0: dQ's do without a fill (_dq_convert writes every
        row, from the accumulator _delta cleared; not the deterministic _dq pass), and dK's and dV's where
        _kv_group_sum adds up every key row; the other gradients start at 0."""
        import torch

        device = q.get_device()
        stream = _TORCH["stream"](device)
        packed = bool(offsets)
        summed = k.shape[1] != q.shape[1] and not call.folded
        if packed:   # contiguous, as the full path's (and the op's fake kernel's) packed gradients, whatever q's layout
            grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            _filled(grads[0], stream, zero=self.spec.deterministic)
            for grad in grads[1:]:
                _filled(grad, stream, zero=not summed)
        else:
            grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        pointers = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), do.data_ptr(), lse.data_ptr()]
        if d_lse is not None:
            pointers.append(d_lse.data_ptr())
        pointers += [grads[0].data_ptr(), grads[1].data_ptr(), grads[2].data_ptr()]
        if summed:
            # grouped KV heads: per-query-head dK, dV, then summed; packed, (1, heads, total_k, d) and zeroed (keys
            # outside every sequence are summed too)
            expanded = (1, q.shape[1], k.shape[0], k.shape[2]) if packed else (*q.shape[:2], k.shape[2], k.shape[3])
            # held (not just their pointers taken) until the launches are queued: a tensor freed
            # at once would hand the second workspace the first one's memory
            workspaces = [_filled(torch.empty(expanded, dtype=k.dtype, device=k.device), stream, zero=packed)
                          for _ in range(2)]
            pointers += [w.data_ptr() for w in workspaces]
        size, dq_accum_at = backward_scratch(math.prod(q.shape[:-1]), self.plans["backward"].head_dim,
                                             self.spec.deterministic)
        scratch = torch.empty(size, dtype=torch.float32, device=q.device)
        pointers.append(scratch.data_ptr())
        if dq_accum_at:
            pointers.append(pointers[-1] + 4 * dq_accum_at)
        # mask_mod inputs' run-time summaries, held until the launches are queued
        summaries = [torch.empty(shape, dtype=torch.float32, device=q.device) for shape in call.workspaces]
        pointers += [s.data_ptr() for s in summaries]
        _, extra = self._runtime_pointers(kv_lengths, block_mask, inputs)
        call.launch(device, stream, (*pointers, *offsets, *extra, *_seed_values(seed, offset)))
        self._finish(call.main, device)
        return grads

    @staticmethod
    def _d_lse_pointer(d_lse, lse: DeviceTensor) -> int:
        """The pointer of d_lse (backward's `d_lse`), checked against the lse it is the gradient of; 0 for None."""
        if d_lse is None:
            return 0
        held = as_device_tensor("d_lse", d_lse)
        if held.shape != lse.shape or held.dtype != "fp32" or tuple(held.strides) != tuple(lse.strides):
            raise ArgumentError(f"d_lse: expected a dense fp32 tensor of lse's shape {tuple(lse.shape)} (the gradient of "
                                f"the loss with respect to lse), got {held.dtype} of shape {tuple(held.shape)} and strides "
                                f"{tuple(held.strides)}")
        return held.pointer

    def _backward(self, q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out, stream, signature,
                  sequences: Optional["Sequences"], input_grad_out: Optional[dict] = None, d_lse=None):
        """The full backward path; `sequences` as in `_forward`; `input_grad_out`: a dict that receives
        score_mod's input gradients (see `backward`), or None."""
        plan = self._pass("backward")
        tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        if stream is not None and tensors["q"].is_torch:
            with _caller_stream(tensors["q"], stream):
                return self._backward(q, k, v, o, lse, do, kv_lengths, block_mask, inputs, seed, offset, out, None, signature,
                                      sequences, input_grad_out, d_lse)
        device, stream = self._stream(tensors, stream)
        batch, heads, seq_q, seq_k = shape
        problems = shape if sequences is None else (sequences.count, heads, max(1, sequences.max_q), max(1, sequences.max_k))
        if plan.stages > 1 and self._chunked_rows:  # cp.async moves 16-byte chunks of Q, dO, K, V
            q, k, v, do = (self._aligned(tensors[name], 16) for name in ("q", "k", "v", "d_o"))
            tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        lt = as_device_tensor("lse", lse)
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or tuple(lt.strides) != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"lse: expected the forward's contiguous fp32 lse of shape {(batch, heads, seq_q)}")
        d_lse_pointer = self._d_lse_pointer(d_lse, lt)
        if out is None:
            grads = tuple(_allocate(tensors[key], tensors[key].shape, self.spec.dtype, stream) for key in ("q", "k", "v"))
        else:
            grads = tuple(out)
        args = self._base_args(tensors, shape)
        args["o"], args["d_o"], args["lse"] = tensors["o"].pointer, tensors["d_o"].pointer, lt.pointer
        args["d_lse"] = d_lse_pointer
        args["o_stride"] = tensors["o"].strides[:3]
        args["do_stride"] = tensors["d_o"].strides[:3]
        kv_heads = tensors["k"].shape[1]
        grouped = kv_heads != heads
        key_blocks = math.ceil(problems[3] / plan.block_c)
        folded = grouped and self._folds(plan, problems[0] * kv_heads * key_blocks)
        args["fold_heads"] = heads // kv_heads if folded else 1
        summed = grouped and not folded   # dK, dV per query head into a workspace, then _kv_group_sum
        keep = []
        for key, grad, like in zip(("dq", "dk", "dv"), grads, ("q", "k", "v")):
            gt = as_device_tensor(key, grad)
            if gt.shape != tensors[like].shape or gt.dtype != self.spec.dtype or gt.strides[3] != 1:
                raise ArgumentError(f"out {key}: expected {self.spec.dtype} of shape {tensors[like].shape}")
            if plan.tensor_cores and self._pair_stores and (gt.pointer % 4 or any(stride % 2 for stride in gt.strides[:3])):
                raise ArgumentError(f"out {key}: rows must start on 4-byte boundaries (even strides, aligned pointer)")
            if summed and key != "dq":
                # Grouped KV heads: the main kernel writes each query head's dK, dV into a dense
                # (batch, heads, seq_k, d) workspace; _kv_group_sum adds each group into the output.
                # (zeroed for packed batches: keys outside every sequence are summed too, and must add 0)
                workspace = _allocate(tensors["k"], (batch, heads, seq_k, self.spec.head_dim), self.spec.dtype, stream,
                                      zero=sequences is not None and not sequences.covers_k)
                keep.append(workspace)
                wt = as_device_tensor(key, workspace)
                args[f"{key}_sum"], args[f"{key}_sum_stride"] = gt.pointer, gt.strides[:3]
                args[key], args[f"{key}_stride"] = wt.pointer, wt.strides[:3]
            else:
                args[key] = gt.pointer
                args[f"{key}_stride"] = gt.strides[:3]
        keep += self._runtime_args(args, tensors, problems, kv_lengths, block_mask, inputs, seed, offset, sequences,
                                   stream)
        if input_grad_out is not None:
            self._input_grad_outputs(input_grad_out, args, inputs, tensors["q"], stream)
        if sequences is not None and not sequences.has_work:   # dq, dk, dv arrive zeroed
            return grads
        main = plan.symbols[0]
        rows = batch * heads * seq_q
        size, dq_accum_at = backward_scratch(rows, plan.head_dim, self.spec.deterministic)
        scratch = _allocate(tensors["q"], (size,), "fp32", stream)
        keep.append(scratch)
        args["delta"] = base = as_device_tensor("scratch", scratch).pointer
        if dq_accum_at:
            args["dq_accum"] = base + 4 * dq_accum_at
        grid = self._blocks_grid(plan, key_blocks, problems[0] * (kv_heads if folded else heads), args)
        # _delta also writes the mask_mod inputs' summaries, where there are any, before the main kernel reads them:
        # at least the summary kernel's grid, whose entries follow the inputs' lengths, not the query rows (a few
        # query rows over a long key-side input)
        delta_grid = row_pass_grid(rows)
        if self.modifiers.summaries:
            delta_grid = (max(delta_grid[0], SUMMARY_GRID[0]), 1, 1)
        launches = [(main + "_delta", delta_grid, 256, 0), (main, grid, plan.threads, plan.smem_bytes)]
        if self.spec.deterministic:
            launches.append((main + "_dq", problem_grid(math.ceil(problems[2] / plan.block_r), problems[0] * heads, args),
                             plan.threads, plan.smem_bytes))
        else:
            launches.append((main + "_dq_convert", row_pass_grid(rows), 256, 0))
        if summed:
            launches.append((main + "_kv_group_sum", row_pass_grid(batch * kv_heads * seq_k), 256, 0))
        arguments = args.packed()   # after problem_grid set args["problems"]
        functions = self._load_input_grad_backward(device) if input_grad_out is not None else None
        for symbol, grid, threads, smem in launches:
            self._launch(device, symbol, arguments, grid, threads, smem, stream, functions)
        self._finish(main, device)
        if signature is not None:
            names, _ = self._runtime_pointers(kv_lengths, block_mask, inputs)
            if sequences is not None:
                names = ("cu_seqlens_q", "cu_seqlens_k") + names
            workspaces = ("delta",) if self.spec.deterministic else ("delta", "dq_accum")
            outputs = ("dq", "dk_sum", "dv_sum", "dk", "dv") if summed else ("dq", "dk", "dv")
            summaries = self._summary_workspaces(args) if self.modifiers.summaries else []
            self._remember(self._fast_backward, signature, args,
                           ("q", "k", "v", "o", "d_o", "lse") + (("d_lse",) if d_lse_pointer else ()) + outputs + workspaces
                           + tuple(slot for slot, _ in summaries) + names, launches, device,
                           tuple(shape for _, shape in summaries), folded)
        del keep
        return grads


_targets: dict[int, Target] = {}


def device_target(device_index: int) -> Target:
    target = _targets.get(device_index)
    if target is None:
        target = _targets[device_index] = from_attributes(driver.device_attributes(device_index))
    return target
