"""Zero-padding the head dim of torch tensors on the GPU, for the torch adapter's route for head dims that are
not multiples of 8 (fagen/torch.py padded_spec_key).

Why a kernel of fagen's own: torch's `F.pad` of a (B, H, N, 59) bf16 tensor fills the padded tensor and then
copies the rows in with a strided elementwise kernel, 3-4x the time its bytes need; through `fagen.attention`
that put d = 59 at 1.4x the forward time of d = 64 (BENCHMARKS.md, "Head dims that are not multiples of 16").
templates/pad_rows.cu writes every padded row as whole 16-byte stores, q, k and v in one launch, on the
caller's current stream. The padded tensors are new, contiguous and owned by PyTorch's caching allocator,
so they are safe on that stream and under CUDA graph capture. Launch stage: imports the compiler and the
driver, never the torch adapter.
"""
from __future__ import annotations

import struct
import threading

from fagen import cuda_driver as driver
from fagen.compiler import cached_cubin
from fagen.runtime import ArgumentError, Kernel, device_target
from fagen.sources import TEMPLATE_DIR

#: Elements of a padded row written per thread (one 16-byte store of 2-byte elements); padded widths are
#: multiples of it.
CHUNK = 8
#: At most this many tensors per launch (the kernel's Args::operand).
OPERANDS = 3
_THREADS = 256
_CHUNK_LIMIT = 2 ** 31 - 1   # the kernel indexes chunks in 32 bits
# fagen_pad::Args: per operand source, padded, extent[2], stride[3], rows; then width, padded_width, count
_ARGS = struct.Struct("<" + "QQqqqqqq" * OPERANDS + "qqq")
_SYMBOL = "fagen_pad_rows"

_functions: dict[int, int] = {}
_lock = threading.Lock()


def _function(device: int) -> int:
    """The padding kernel in the device's primary context, compiled (or read from the disk cache) once."""
    function = _functions.get(device)
    if function is None:
        with _lock:
            function = _functions.get(device)
            if function is None:
                source = (TEMPLATE_DIR / "pad_rows.cu").read_text()
                cubin = cached_cubin(source, device_target(device).arch, TEMPLATE_DIR)
                previous = driver.current_device()
                if previous != device:
                    driver.make_current(device)
                try:
                    function = _functions[device] = driver.get_function(driver.load_module(cubin), _SYMBOL)
                finally:
                    if previous is not None and previous != device:
                        driver.make_current(previous)
    return function


def can_pad(tensor, padded_width: int) -> bool:
    """Whether `pad` takes this tensor: CUDA, 2-byte elements, 3 or 4 dims, a unit last stride, few enough
    chunks for the kernel's 32-bit indices."""
    import torch

    return (tensor.is_cuda and tensor.dtype in (torch.float16, torch.bfloat16) and tensor.dim() in (3, 4)
            and tensor.stride(-1) == 1 and padded_width % CHUNK == 0 and padded_width >= tensor.shape[-1]
            and tensor.numel() // max(tensor.shape[-1], 1) * (padded_width // CHUNK) <= _CHUNK_LIMIT)


def pad(tensors, padded_width: int) -> list:
    """Contiguous copies of `tensors` (torch, fp16 / bf16, 3 or 4 dims, the same last dim, one device) with
    zero columns up to `padded_width`, in one launch on the current stream."""
    import torch

    tensors = list(tensors)
    if not 0 < len(tensors) <= OPERANDS:
        raise ArgumentError(f"pad_rows.pad takes 1 to {OPERANDS} tensors, got {len(tensors)}")
    width = tensors[0].shape[-1]
    device = tensors[0].get_device()
    for t in tensors:
        if t.shape[-1] != width or t.get_device() != device or not can_pad(t, padded_width):
            raise ArgumentError(f"pad_rows.pad: a {tuple(t.shape)} {t.dtype} tensor on {t.device} with strides "
                                f"{t.stride()} cannot be padded to {padded_width} columns by the kernel (it takes "
                                f"CUDA fp16/bf16 tensors of 3 or 4 dims, a unit last stride and one last dim)")
    padded = [torch.empty(*t.shape[:-1], padded_width, dtype=t.dtype, device=t.device) for t in tensors]
    values = []
    most_chunks = 0
    for i in range(OPERANDS):
        if i < len(tensors):
            t, p = tensors[i], padded[i]
            outer = (1,) * (4 - t.dim()) + tuple(t.shape[:-1])
            strides = (0,) * (4 - t.dim()) + tuple(t.stride()[:-1])
            rows = outer[0] * outer[1] * outer[2]
            most_chunks = max(most_chunks, rows * (padded_width // CHUNK))
            values += [t.data_ptr(), p.data_ptr(), outer[1], outer[2], *strides, rows]
        else:
            values += [0, 0, 1, 1, 0, 0, 0, 0]
    values += [width, padded_width, len(tensors)]
    if most_chunks:
        arguments = driver.LaunchArguments(_ARGS.size)
        _ARGS.pack_into(arguments.buffer, 0, *values)
        blocks = min(-(-most_chunks // _THREADS), 65535 * 4)
        stream = torch.cuda.current_stream(tensors[0].device).cuda_stream
        function = _function(device)
        try:
            driver.launch(function, (blocks, len(tensors), 1), _THREADS, 0, stream, arguments, _SYMBOL)
        except driver.CudaError as err:
            if err.code != driver.ERROR_INVALID_CONTEXT:
                raise
            driver.make_current(device)   # a thread that never touched CUDA: give it the primary context
            driver.launch(function, (blocks, len(tensors), 1), _THREADS, 0, stream, arguments, _SYMBOL)
        Kernel._finish(_SYMBOL)   # the debug switch (FAGEN_SYNC_LAUNCHES) synchronises and names the kernel
    return padded
