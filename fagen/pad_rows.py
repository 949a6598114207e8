"""Zero-padding the head dim of torch tensors on the GPU, for the torch adapter's route for head dims that are
not multiples of 8 (fagen/torch.py padded_spec_key).

Why a kernel of fagen's own: torch's `F.pad` of a (B, H, N, 59) bf16 tensor fills the padded tensor and then
copies the rows in with a strided elementwise kernel, 3-4x the time its bytes need; through `fagen.attention`
that put d = 59 at 1.4x the forward time of d = 64 (docs/benchmarks-journal.md, "Head dims that are not multiples of 16").
templates/pad_rows.cu writes every padded row as whole 16-byte stores, q, k and v in one launch, on the
caller's current stream. The padded tensors are new, contiguous and owned by PyTorch's caching allocator,
so they are safe on that stream and under CUDA graph capture. Part of the torch adapter's layer: it builds its
kernel through fagen/build.py and launches it through the runtime's driver.
"""
from __future__ import annotations

import struct
import threading
import warnings

from fagen import build
from fagen import cuda_driver as driver
from fagen.compiler import CompileError
from fagen.runtime import ArgumentError, Kernel, device_target
from fagen.runtime.device import _torch_types

#: Elements of a padded row written per thread (one 16-byte store of 2-byte elements); padded widths are
#: multiples of it.
CHUNK = 8
#: At most this many tensors per launch (the kernel's Args::operand).
OPERANDS = 3
_THREADS = 256
_GRID_LIMIT = 65535 * 4
# the kernel indexes chunks in 32 bits, and its grid-stride loop steps once past the last: keep both below 2^31
_CHUNK_LIMIT = 2 ** 31 - 1 - _GRID_LIMIT * _THREADS
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
                cubin = build.template_cubin("pad_rows.cu", device_target(device).arch)
                with driver.on_device(device):
                    function = _functions[device] = driver.get_function(driver.load_module(cubin), _SYMBOL)
    return function


def can_pad(tensor, padded_width: int) -> bool:
    """Whether `pad` takes this tensor: CUDA, 2-byte elements, 3 or 4 dims, a unit last stride, few enough
    chunks for the kernel's 32-bit indices."""
    import torch

    return (tensor.is_cuda and tensor.dtype in (torch.float16, torch.bfloat16) and tensor.dim() in (3, 4)
            and tensor.stride(-1) == 1 and padded_width % CHUNK == 0 and padded_width >= tensor.shape[-1]
            and tensor.numel() // max(tensor.shape[-1], 1) * (padded_width // CHUNK) <= _CHUNK_LIMIT)


class PadPlan:
    """One launch's arguments for tensors of given shapes, strides, dtype and device, all but the pointers
    worked out once: a call of a seen signature allocates, fills in pointers and launches (at a launch-bound
    shape the checks and packing cost more host time than attention's own call)."""

    __slots__ = ("values", "pointer_slots", "shapes", "dtype", "device", "grid", "function")

    def __init__(self, tensors, padded_width: int):
        import torch

        device = tensors[0].get_device()
        self.values, self.pointer_slots, self.shapes = [], [], []
        most_chunks = 0
        for i in range(OPERANDS):
            if i < len(tensors):
                t = tensors[i]
                outer = (1,) * (4 - t.dim()) + tuple(t.shape[:-1])
                strides = (0,) * (4 - t.dim()) + tuple(t.stride()[:-1])
                rows = outer[0] * outer[1] * outer[2]
                most_chunks = max(most_chunks, rows * (padded_width // CHUNK))
                self.pointer_slots.append(len(self.values))
                self.values += [0, 0, outer[1], outer[2], *strides, rows]
                self.shapes.append((*t.shape[:-1], padded_width))
            else:
                self.values += [0, 0, 1, 1, 0, 0, 0, 0]
        self.values += [tensors[0].shape[-1], padded_width, len(tensors)]
        self.dtype, self.device = tensors[0].dtype, torch.device("cuda", device)
        self.grid = (min(-(-most_chunks // _THREADS), _GRID_LIMIT), len(tensors), 1) if most_chunks else None
        self.function = _function(device) if most_chunks else None

    def run(self, tensors, out=None) -> list:
        """The padded copies, new (or written into `out`: contiguous tensors of the padded shapes)."""
        import torch

        padded = out if out is not None else [torch.empty(shape, dtype=self.dtype, device=self.device)
                                              for shape in self.shapes]
        if self.grid is None:
            return padded
        values = self.values.copy()
        for slot, t, p in zip(self.pointer_slots, tensors, padded):
            values[slot], values[slot + 1] = t.data_ptr(), p.data_ptr()
        arguments = driver.LaunchArguments(_ARGS.size)
        _ARGS.pack_into(arguments.buffer, 0, *values)
        device = self.device.index
        # the tensors' GPU may not be the thread's current one (or the thread may have no context yet)
        with driver.on_device(device):
            driver.launch(self.function, self.grid, _THREADS, 0, _torch_types()["stream"](device), arguments, _SYMBOL)
        Kernel._finish(_SYMBOL, device)   # the debug switch (FAGEN_SYNC_LAUNCHES) synchronises and names the kernel
        return padded


_plans: dict[tuple, "PadPlan | None"] = {}
_PLANS_KEPT = 256   # signatures remembered (a long-running process with ever-new shapes must not grow)


def plan_for(tensors, padded_width: int) -> "PadPlan | None":
    """The launch plan that pads these tensors (1 to 3 of them, one last dim, one device) to `padded_width`
    columns, or None where the kernel cannot take them (see can_pad)."""
    key = (padded_width, *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    plan = _plans.get(key, False)
    if plan is False:
        first = tensors[0]
        ok = (0 < len(tensors) <= OPERANDS
              and all(t.shape[-1] == first.shape[-1] and t.dtype == first.dtype and t.device == first.device
                      and can_pad(t, padded_width) for t in tensors))
        plan = None
        if ok:
            try:
                plan = PadPlan(tensors, padded_width)
            except (CompileError, driver.CudaError) as err:   # the caller's F.pad route still works
                warnings.warn(f"fagen: the head-dim padding kernel is unavailable ({err}); padding with F.pad",
                              RuntimeWarning, stacklevel=2)
        if len(_plans) >= _PLANS_KEPT:
            _plans.clear()
        _plans[key] = plan
    return plan


def pad(tensors, padded_width: int) -> list:
    """Contiguous copies of `tensors` (torch, fp16 / bf16, 3 or 4 dims, the same last dim, one device) with
    zero columns up to `padded_width`, in one launch on the current stream."""
    tensors = list(tensors)
    plan = plan_for(tensors, padded_width)
    if plan is None:
        described = ", ".join(f"{tuple(t.shape)} {t.dtype} on {t.device} strides {t.stride()}" for t in tensors)
        raise ArgumentError(f"pad_rows.pad: {described} cannot be padded to {padded_width} columns by the kernel "
                            f"(it takes 1 to {OPERANDS} CUDA fp16/bf16 tensors of 3 or 4 dims, a unit last stride, "
                            f"one last dim, dtype and device)")
    return plan.run(tensors)
