"""Stage 5: launching. A `Kernel` is loaded from what the build made and called on tensors.

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
- **Loads.** A `Kernel` is made from an artifact (fagen/artifact.py: a JSON record and a cubin per pass); this
  package never solves, renders or compiles. `fagen.compile(spec)` (fagen/jit.py) finds that artifact in the disk
  plan cache or builds it there (fagen/build.py), then loads it here.

The package, one job a file:
- `kernel.py`: the Kernel (loading, forward, backward, decode, launches);
- `checks.py`: the checks of what a call passes; `tensors.py`: tensors as the kernels see them;
- `layouts.py`: packed variable-length batches and paged K/V caches;
- `fast_path.py`: a call whose signature was seen before;
- `call_inputs.py`: a call's run-time inputs (kv_lengths, ..., seed, offset) as one object down the call chain;
- `arguments.py`: the argument struct; `grids.py`: launch geometry; `device.py`: contexts, streams, memory.
"""
from __future__ import annotations

import os

#: Synchronise after each call, so that a fault inside a kernel names the call that caused it. Off
#: by default (a sync per call costs what the kernels win); FAGEN_SYNC_LAUNCHES=1 turns it on.
CHECK_LAUNCHES = os.environ.get("FAGEN_SYNC_LAUNCHES", "0") not in ("", "0", "false", "False")

from fagen.runtime.arguments import ARGS_STRUCT, LaunchArgs  # noqa: E402
from fagen.runtime.device import (_default_device, device_target, ensure_context,  # noqa: E402
                                  stream_handle)
from fagen.runtime.fast_path import FastCall  # noqa: E402
from fagen.runtime.grids import LaunchPlan, backward_scratch, decode_splits  # noqa: E402
from fagen.runtime.kernel import Kernel  # noqa: E402
from fagen.runtime.tensors import ArgumentError, DeviceTensor, as_device_tensor  # noqa: E402

__all__ = ["ARGS_STRUCT", "ArgumentError", "CHECK_LAUNCHES", "DeviceTensor", "FastCall", "Kernel", "LaunchArgs",
           "LaunchPlan", "_default_device", "as_device_tensor", "backward_scratch", "decode_splits",
           "device_target", "ensure_context", "stream_handle"]
