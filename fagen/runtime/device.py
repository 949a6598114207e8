"""The device side of a call: the primary context, streams, outputs and workspaces allocated and filled, and each
GPU's Target read off the driver."""
from __future__ import annotations

import struct
from typing import Optional

from fagen import cuda_driver as driver
from fagen.runtime.tensors import TORCH_DTYPES, ArgumentError, DeviceTensor
from fagen.target import Target, from_attributes

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


def empty_in_layout(like, shape: tuple, dtype=None):
    """An empty torch tensor of `shape` (`like`'s but for the last dim) whose dimensions lie in memory in `like`'s
    order: q of (batch, seq, heads, d) viewed as (batch, heads, seq, d) gives o whose transpose back is free.
    `dtype`: a torch dtype other than `like`'s (an fp8 forward's bf16 o)."""
    if len(shape) != like.dim() or like.stride(-1) != 1:
        return like.new_empty(shape, dtype=dtype)
    order = sorted(range(like.dim() - 1), key=lambda n: -like.stride(n)) + [like.dim() - 1]   # outermost first
    dense = like.new_empty([shape[n] for n in order], dtype=dtype)
    return dense.permute([order.index(n) for n in range(like.dim())])


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
        if tuple(shape[:-1]) == tuple(like.shape[:-1]) and dtype == like.dtype and not zero and fill is None:
            return empty_in_layout(like.owner, shape)   # o of a narrower value head dim, laid out as q
        if like.dtype == "fp8_e4m3" and tuple(shape[:-1]) == tuple(like.shape[:-1]) and not zero and fill is None:
            return empty_in_layout(like.owner, shape, getattr(torch, TORCH_DTYPES[dtype]))   # an fp8 forward's o
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



_TORCH = {}   # "Tensor": torch.Tensor, "stream": the raw current-stream getter; filled on first use


def _torch_types():
    if not _TORCH:
        import torch

        _TORCH["Tensor"], _TORCH["int32"], _TORCH["uint8"] = torch.Tensor, torch.int32, torch.uint8
        _TORCH["float32"], _TORCH["int64"] = torch.float32, torch.int64
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH["stream"] = raw or (lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _TORCH



_targets: dict[int, Target] = {}


def device_target(device_index: int) -> Target:
    target = _targets.get(device_index)
    if target is None:
        target = _targets[device_index] = from_attributes(driver.device_attributes(device_index))
    return target
