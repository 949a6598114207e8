"""What a call passes, as the kernels see it: a DeviceTensor (pointer, shape, strides in elements, dtype, owner)
from a torch CUDA tensor or any __cuda_array_interface__ array, and the error every bad argument gets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
CAI_TYPESTRS = {"fp16": ("<f2",), "bf16": ("<V2", "|V2", "<b2"), "fp32": ("<f4",)}
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1}


class ArgumentError(ValueError):
    """A tensor or run-time argument the kernel cannot take; raised before any launch."""


# ---- tensors ---------------------------------------------------------------------------------
@dataclass
class DeviceTensor:
    """What the kernel needs of a tensor: pointer, shape, strides in elements, dtype, owner."""

    name: str
    pointer: int
    shape: tuple
    strides: tuple
    dtype: str      # fp16 | bf16 | fp32 | fp8_e4m3 | int32 | uint8 | bool | other:<x>
    owner: Any
    is_torch: bool
    stream: Optional[int] = None   # __cuda_array_interface__'s stream, for other arrays


_TORCH_DTYPE_NAMES: dict = {}


def _torch_dtype_name(tensor) -> str:
    if not _TORCH_DTYPE_NAMES:
        import torch

        _TORCH_DTYPE_NAMES.update({torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                                   torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
                                   torch.bool: "bool", torch.float8_e4m3fn: "fp8_e4m3"})
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

