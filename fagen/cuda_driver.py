"""The few CUDA driver calls the launch stage needs, through ctypes on libcuda.

Why not PyCUDA's `Function.__call__`: it launches on a `pycuda.driver.Stream` only, and a stream
made by PyTorch (or anyone else) cannot be wrapped as one, so kernels ended up on the legacy default
stream, racing with work the caller had queued on its own stream. `cuLaunchKernel` takes any stream
handle, costs about a microsecond from Python, and a launch on a capturing stream is recorded into a
CUDA graph like any other. PyCUDA stays the run-time compiler (fagen/compiler.py); modules are
loaded here from the cubin bytes it produced.

Everything runs in the device's primary context, the one PyTorch uses, so tensors, streams and
modules are shared with it. Launches and memsets are queued in the context of the tensors' device
(`enter_device`), whichever GPU is current in the calling thread, as PyTorch's device guard does.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Optional

# CUfunction_attribute / CUdevice_attribute values from cuda.h (stable across CUDA versions).
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
DEVICE_ATTRIBUTES = {
    "sm_count": 16,                  # CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    "max_threads_per_sm": 39,        # CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR
    "cc_major": 75,                  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    "cc_minor": 76,
    "smem_per_sm": 81,               # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    "registers_per_sm": 82,          # CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR
    "smem_per_block": 97,            # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
}
ERROR_INVALID_CONTEXT = 201
ERROR_NOT_INITIALIZED = 3


class CudaError(RuntimeError):
    """A driver call failed; the message names the call, the error and what fagen was doing."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


_lib = None
_lib_lock = threading.Lock()
_get_current_context = None


def _load():
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise CudaError(-1, f"the CUDA driver (libcuda.so.1) could not be loaded: {err}; fagen's "
                                "run-time path needs an NVIDIA GPU and its driver") from None
        p, i, u, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        signatures = {
            "cuInit": [u], "cuDeviceGet": [ctypes.POINTER(i), i], "cuDeviceGetCount": [ctypes.POINTER(i)],
            "cuDeviceGetAttribute": [ctypes.POINTER(i), i, i], "cuDeviceGetName": [ctypes.c_char_p, i, i],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(p), i], "cuCtxGetCurrent": [ctypes.POINTER(p)],
            "cuDevicePrimaryCtxGetState": [i, ctypes.POINTER(u), ctypes.POINTER(i)],
            "cuCtxSetCurrent": [p], "cuCtxGetDevice": [ctypes.POINTER(i)], "cuCtxSynchronize": [],
            "cuModuleLoadData": [ctypes.POINTER(p), p], "cuModuleGetFunction": [ctypes.POINTER(p), p, ctypes.c_char_p],
            "cuFuncSetAttribute": [p, i, i],
            "cuLaunchKernel": [p, u, u, u, u, u, u, u, p, ctypes.POINTER(p), ctypes.POINTER(p)],
            "cuMemsetD32Async": [ctypes.c_uint64, u, s, p], "cuMemsetD8Async": [ctypes.c_uint64, ctypes.c_ubyte, s, p],
            "cuStreamSynchronize": [p],
            "cuTensorMapEncodeTiled": [p, i, u, p, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                       ctypes.POINTER(u), ctypes.POINTER(u), i, i, i, i],
            "cuGetErrorName": [i, ctypes.POINTER(ctypes.c_char_p)],
            "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        global _get_current_context   # cuCtxGetCurrent given its out-parameter's address: enter_device's fast form
        _get_current_context = lib["cuCtxGetCurrent"]
        _get_current_context.argtypes, _get_current_context.restype = [ctypes.c_void_p], ctypes.c_int
        _lib = lib
        return lib


def error_text(code: int) -> str:
    lib = _load()
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return f"{(name.value or b'CUDA_ERROR').decode()} ({(text.value or b'unknown error').decode()})"


def check(code: int, doing: str) -> None:
    if code:
        raise CudaError(code, f"{doing} failed: {error_text(code)}")


# ---- devices and contexts ----------------------------------------------------------------------
def current_device() -> Optional[int]:
    """The device of the calling thread's current context, or None if it has none."""
    lib = _load()
    context = ctypes.c_void_p()
    code = lib.cuCtxGetCurrent(ctypes.byref(context))
    if code == ERROR_NOT_INITIALIZED or (code == 0 and not context.value):
        return None
    check(code, "cuCtxGetCurrent")
    device = ctypes.c_int()
    check(lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
    return device.value


def make_current(device_index: int) -> None:
    """Make the device's primary context (PyTorch's) current in this thread."""
    check(_load().cuCtxSetCurrent(primary_context(device_index)), "cuCtxSetCurrent")


def primary_context(device_index: int) -> int:
    """The device's primary context, retained once per device for the life of the process, as PyTorch
    does, so it is never torn down under a module."""
    context = _primary_contexts.get(device_index)
    if context is None:
        lib = _load()
        check(lib.cuInit(0), "cuInit")
        count = ctypes.c_int()
        check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if not 0 <= device_index < count.value:
            raise CudaError(-1, f"CUDA device {device_index} does not exist; this machine has {count.value}")
        handle = ctypes.c_void_p()
        device = ctypes.c_int()
        check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain")
        context = _primary_contexts[device_index] = handle.value
    return context


_primary_contexts: dict[int, int] = {}


def enter_device(device_index: int) -> Optional[int]:
    """Before queueing work on `device_index`'s memory and streams (a launch, a memset): the calling
    thread's current context made one of that device's, as PyTorch's device guard does around its own
    ops. Tensors on cuda:1 while cuda:0 is current (a model split over GPUs) otherwise send the work to
    the wrong device's context.

    Returns the caller's context, to give back with `leave_device` once the work is queued; None where
    nothing changed, or where the thread had no context (autograd's device threads: the device's primary
    context stays current, as PyTorch's own calls leave it). Where the current context already is the
    device's primary one (every call but the first, as a rule) this is one cuCtxGetCurrent."""
    try:
        context, address = _thread_slot.current
    except AttributeError:   # (each thread its own out-parameter, made once: the call is on every launch's path)
        _load()
        context = ctypes.c_void_p()
        address = ctypes.addressof(context)
        _thread_slot.current = context, address
    code = _get_current_context(address)
    if not code and context.value and context.value == _primary_contexts.get(device_index):
        return None
    lib = _lib
    if code == ERROR_NOT_INITIALIZED or (not code and not context.value):
        make_current(device_index)
        return None
    check(code, "cuCtxGetCurrent")
    device = ctypes.c_int()
    check(lib.cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
    if device.value == device_index:
        # a context of this device: its primary one seen for the first time (retained, so that the next call
        # takes the short way), or one the caller made itself (PyCUDA's autoinit), which is left current: its
        # memory is there, and fagen's modules are loaded there too (on_device). For such a caller no primary
        # context is created (they cost hundreds of MB): only one that is active already is looked up.
        if device_index not in _primary_contexts and _primary_active(device_index):
            primary_context(device_index)
        return None
    make_current(device_index)
    return context.value


_thread_slot = threading.local()


def _primary_active(device_index: int) -> bool:
    """Whether the device's primary context exists (retained by someone: PyTorch, as a rule)."""
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    check(_lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    check(_lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)),
          "cuDevicePrimaryCtxGetState")
    return bool(active.value)


def leave_device(context: Optional[int]) -> None:
    """Give the caller back the context `enter_device` replaced (nothing for None)."""
    if context:
        check(_lib.cuCtxSetCurrent(context), "restoring the calling thread's CUDA context (cuCtxSetCurrent)")


@contextlib.contextmanager
def on_device(device_index: int):
    """`enter_device` for the block, `leave_device` after it."""
    previous = enter_device(device_index)
    try:
        yield
    finally:
        leave_device(previous)


def device_attributes(device_index: int) -> dict:
    """The limits fagen.target.Target needs, read off the device, plus its name."""
    lib = _load()
    check(lib.cuInit(0), "cuInit")
    device = ctypes.c_int()
    check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    values = {}
    for key, attribute in DEVICE_ATTRIBUTES.items():
        value = ctypes.c_int()
        check(lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device), "cuDeviceGetAttribute")
        values[key] = value.value
    name = ctypes.create_string_buffer(256)
    check(lib.cuDeviceGetName(name, 256, device), "cuDeviceGetName")
    values["name"] = name.value.decode()
    return values


def synchronize(doing: str) -> None:
    check(_load().cuCtxSynchronize(), doing)


# ---- modules, functions, launches ----------------------------------------------------------------
def load_module(cubin: bytes) -> int:
    """Load a cubin into the current context; the handle lives as long as the process."""
    lib = _load()
    handle = ctypes.c_void_p()
    buffer = ctypes.create_string_buffer(cubin, len(cubin))
    check(lib.cuModuleLoadData(ctypes.byref(handle), buffer), "loading a compiled fagen module (cuModuleLoadData)")
    return handle.value


def get_function(module: int, symbol: str, dynamic_smem: int = 0) -> int:
    lib = _load()
    handle = ctypes.c_void_p()
    check(lib.cuModuleGetFunction(ctypes.byref(handle), module, symbol.encode()), f"finding kernel {symbol}")
    if dynamic_smem > 48 * 1024:  # above 48 KiB a kernel must opt in to its dynamic shared memory
        check(lib.cuFuncSetAttribute(handle, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_smem),
              f"allowing {symbol} {dynamic_smem} B of shared memory")
    return handle.value


class LaunchArguments:
    """The kernel parameters: the AttentionArgs struct, packed into a buffer cuLaunchKernel copies at the launch
    (so the buffer can be reused by the next call at once), and where the kernel takes them its TMA tensor maps
    (`extra`: the host address of that parameter; a kernel of one parameter ignores the second)."""

    def __init__(self, size: int, extra: Optional[int] = None):
        self.buffer = ctypes.create_string_buffer(size)
        if extra is None:
            self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        else:
            self.params = (ctypes.c_void_p * 2)(ctypes.addressof(self.buffer), extra)


def encode_tensor_map(address: int, data_type: int, pointer: int, dims, strides, box, element_strides,
                      swizzle: int) -> int:
    """cuTensorMapEncodeTiled into the 64-byte-aligned host `address` (no interleave, 128-byte L2 promotion, zeros
    out of bounds); its CUresult (0: encoded). `dims`, `strides`, `box`, `element_strides`: ctypes arrays."""
    return _load().cuTensorMapEncodeTiled(address, data_type, len(dims), pointer, dims, strides, box, element_strides,
                                          0, swizzle, 2, 0)


def launch(function: int, grid: tuple, threads: int, smem: int, stream: int, arguments: LaunchArguments,
           symbol: str) -> None:
    code = _load().cuLaunchKernel(function, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream,
                                  arguments.params, None)
    if code:
        raise launch_failed(code, symbol, grid, threads, smem)


def launch_failed(code: int, symbol: str, grid: tuple, threads: int, smem: int) -> CudaError:
    return CudaError(code, f"launching {symbol} (grid {grid}, {threads} threads, {smem} B shared memory) "
                           f"failed: {error_text(code)}")


class PreparedLaunch:
    """One launch of a remembered call (fagen.runtime.FastCall): cuLaunchKernel's arguments but the stream
    and parameters, converted to ctypes values once, so a call converts only the stream (about a
    microsecond less per launch than `launch`, which converts eleven Python ints)."""

    __slots__ = ("arguments", "launch")

    def __init__(self, function: int, grid: tuple, threads: int, smem: int, symbol: str):
        _load()
        u = ctypes.c_uint
        self.arguments = (ctypes.c_void_p(function), u(grid[0]), u(grid[1]), u(grid[2]), u(threads), u(1), u(1),
                          u(smem))
        self.launch = (symbol, grid, threads, smem)   # for the error message

    def __call__(self, stream: int, params) -> int:
        """The launch's CUresult (0: queued)."""
        return _lib.cuLaunchKernel(*self.arguments, ctypes.c_void_p(stream), params, None)

    def failed(self, code: int) -> CudaError:
        return launch_failed(code, *self.launch)


def memset_d32(pointer: int, value: int, count: int, stream: int) -> None:
    check(_load().cuMemsetD32Async(pointer, value, count, stream), "clearing a workspace (cuMemsetD32Async)")


def memset_d8(pointer: int, value: int, count: int, stream: int) -> None:
    check(_load().cuMemsetD8Async(pointer, value, count, stream), "clearing an output (cuMemsetD8Async)")
