"""Stage 5: launching. `fagen.compile(spec)` -> a `Kernel` you call on tensors.

Takes PyTorch CUDA tensors or any object exposing `__cuda_array_interface__`, layout
(batch, heads, seq, head_dim) with any strides whose last dimension is contiguous. Every argument is
checked before anything is launched. PyCUDA shares the primary CUDA context with PyTorch, and kernels
run on the legacy default stream, which PyTorch's default stream is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fagen import solver as solver_stage
from fagen.compiler import load_module
from fagen.render import render
from fagen.spec import Spec, spec_from_dict
from fagen.target import Target, from_device

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
CAI_TYPESTRS = {"fp16": ("<f2",), "bf16": ("<V2", "|V2", "<b2"), "fp32": ("<f4",)}


class ArgumentError(ValueError):
    """A tensor or run-time argument the kernel cannot take; raised before any launch."""


# ---- the launch argument struct (mirrors fagen::AttentionArgs in templates/attention_common.cuh) ----
_POINTERS = ("q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv", "dq_accum", "delta", "o_accum", "row_max", "row_sum")
ARGS_DTYPE = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(f"{t}_stride", np.int64, (3,)) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")]
    + [(name, np.int64) for name in ("batch", "heads", "seq_q", "seq_k")]
    + [("kv_lengths", np.uint64), ("block_mask", np.uint64), ("block_mask_stride", np.int64, (4,)),
       ("seed", np.uint64), ("offset", np.uint64), ("row_groups", np.int64)]
)


# ---- context and tensors ----------------------------------------------------------------------
_context = None


def ensure_context(device_index: Optional[int] = None):
    """Make the device's primary context current: the same one PyTorch uses."""
    global _context
    import pycuda.driver as cuda

    if _context is None:
        cuda.init()
        if device_index is None:
            try:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.init()
                    device_index = torch.cuda.current_device()
            except ImportError:
                pass
        _context = cuda.Device(device_index or 0).retain_primary_context()
        _context.push()
        import atexit

        atexit.register(_context.pop)  # PyCUDA aborts at exit if a pushed context is left on the stack
    return _context


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


def _torch_dtype_name(tensor) -> str:
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "int32",
            torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}.get(tensor.dtype, f"other:{tensor.dtype}")


def as_device_tensor(name: str, value: Any) -> DeviceTensor:
    module = type(value).__module__
    if module.startswith("torch"):
        if not value.is_cuda:
            raise ArgumentError(f"{name}: tensor is on {value.device}; fagen kernels need CUDA tensors")
        return DeviceTensor(name, value.data_ptr(), tuple(value.shape), tuple(value.stride()),
                            _torch_dtype_name(value), value, True)
    cai = getattr(value, "__cuda_array_interface__", None)
    if cai is None:
        raise ArgumentError(f"{name}: expected a torch CUDA tensor or an object with __cuda_array_interface__, "
                            f"got {type(value).__name__}")
    typestr = cai["typestr"]
    itemsize = int(typestr[2:])
    dtype = next((k for k, v in CAI_TYPESTRS.items() if typestr in v), None) or \
        {"<i4": "int32", "<i8": "int64", "|u1": "uint8", "|b1": "bool"}.get(typestr, f"other:{typestr}")
    shape = tuple(cai["shape"])
    if cai.get("strides") is None:
        strides, step = [], 1
        for extent in reversed(shape):
            strides.append(step)
            step *= extent
        strides = tuple(reversed(strides))
    else:
        strides = tuple(s // itemsize for s in cai["strides"])
    return DeviceTensor(name, int(cai["data"][0]), shape, strides, dtype, value, False)


def _allocate(like: DeviceTensor, shape: tuple, dtype: str, fill: Optional[float] = None):
    """An output (or workspace) on the same device, of the same kind as `like`."""
    if like.is_torch:
        import torch

        torch_dtype = getattr(torch, TORCH_DTYPES.get(dtype, dtype))
        out = torch.empty(shape, dtype=torch_dtype, device=like.owner.device)
        if fill is not None:
            out.fill_(fill)
        return out
    import pycuda.gpuarray as gpuarray

    np_dtype = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "uint8": np.uint8}.get(dtype)
    if np_dtype is None:
        raise ArgumentError(f"{like.name}: allocating {dtype} outputs needs torch tensors as inputs")
    out = gpuarray.empty(shape, np_dtype)
    if fill is not None:
        out.fill(fill)
    return out


# ---- the kernel object -------------------------------------------------------------------------
class Kernel:
    """A compiled spec: `forward(q, k, v, ...) -> (o, lse)` and `backward(...) -> (dq, dk, dv)`."""

    def __init__(self, spec: Spec, target: Target, solution: solver_stage.Solution):
        self.spec, self.target, self.solution = spec, target, solution
        self.rendered = render(spec, solution)
        self.module = load_module(self.rendered.text, target.arch, self.rendered.include_dir)
        self._functions = {}
        import pycuda.driver as cuda

        for pass_name, names in self.rendered.kernels.items():
            plan = solution.plans[pass_name]
            for symbol in names:
                function = self.module.get_function(symbol)
                if symbol == names[0] or symbol.endswith("_dq"):
                    function.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, plan.smem_bytes)
                self._functions[symbol] = function

    def __repr__(self) -> str:
        plans = ", ".join(f"{p}: Br={x.block_r} Bc={x.block_c} warps={x.warps}" for p, x in self.solution.plans.items())
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
        if tensors["k"].shape[:2] != (batch, heads):
            raise ArgumentError(f"q has (batch, heads) = {(batch, heads)} but k has {tensors['k'].shape[:2]}")
        for key in ("o", "d_o"):
            if key in tensors and tensors[key].shape != tensors["q"].shape:
                raise ArgumentError(f"{key}: expected shape {tensors['q'].shape} (like q), got {tensors[key].shape}")
        devices = {t.owner.device for t in tensors.values() if t.is_torch}
        if len(devices) > 1:
            raise ArgumentError(f"q, k, v are on different devices: {sorted(map(str, devices))}")
        return tensors, (batch, heads, seq_q, seq_k)

    def _runtime_args(self, args: np.ndarray, tensors: dict, shape: tuple, kv_lengths, block_mask, seed, offset):
        spec = self.spec
        batch, heads, seq_q, seq_k = shape
        keep = []
        try:
            seed, offset = int(seed), int(offset)
        except (TypeError, ValueError):
            raise ArgumentError(f"seed and offset must be integers, got {seed!r}, {offset!r}") from None
        if not (0 <= seed < 2**64 and 0 <= offset < 2**32):
            raise ArgumentError(f"seed must be in [0, 2**64) and offset in [0, 2**32), got {seed}, {offset}")
        args["seed"], args["offset"] = seed, offset
        if spec.mask == "padding":
            if kv_lengths is None:
                raise ArgumentError("mask padding needs kv_lengths: the number of valid keys per batch entry, shape (batch,)")
            lengths = self._small_int_tensor("kv_lengths", kv_lengths, tensors["q"], "int32")
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
        return keep

    @staticmethod
    def _small_int_tensor(name: str, value, like: DeviceTensor, dtype: str):
        """kv_lengths / block_mask as a device tensor of `dtype` (host arrays and lists are copied over)."""
        if like.is_torch:
            import torch

            torch_dtype = getattr(torch, dtype)
            tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
            if tensor.dtype.is_floating_point:
                raise ArgumentError(f"{name}: expected integers or booleans, got {tensor.dtype}")
            return tensor.to(device=like.owner.device, dtype=torch_dtype).contiguous()
        import pycuda.gpuarray as gpuarray

        if hasattr(value, "__cuda_array_interface__"):
            value = value.get() if hasattr(value, "get") else np.asarray(value)
        array = np.asarray(value)
        if array.dtype.kind == "f":
            raise ArgumentError(f"{name}: expected integers or booleans, got {array.dtype}")
        return gpuarray.to_gpu(np.ascontiguousarray(array.astype(dtype)))

    @staticmethod
    def _aligned(tensor: DeviceTensor, alignment: int):
        """The tensor itself if every row starts on an `alignment`-byte boundary; else an aligned copy
        (torch) or a clear error."""
        items = alignment // 2
        if tensor.pointer % alignment == 0 and all(stride % items == 0 for stride in tensor.strides[:3]):
            return tensor.owner
        if tensor.is_torch:
            import torch

            return tensor.owner.clone(memory_format=torch.contiguous_format)
        raise ArgumentError(f"{tensor.name}: the tensor-core kernel needs rows aligned to {alignment} bytes "
                            f"(pointer and strides); got pointer {tensor.pointer:#x}, strides {tensor.strides}")

    @staticmethod
    def _set_strides(args: np.ndarray, key: str, tensor: DeviceTensor):
        args[f"{key}_stride"] = tensor.strides[:3]

    def _base_args(self, tensors, shape):
        args = np.zeros((), dtype=ARGS_DTYPE)
        for key in ("q", "k", "v"):
            args[key] = tensors[key].pointer
            self._set_strides(args, key, tensors[key])
        args["batch"], args["heads"], args["seq_q"], args["seq_k"] = shape
        return args

    def _launch(self, symbol: str, args: np.ndarray, grid: tuple, threads: int, smem: int = 0):
        function = self._functions[symbol]
        function(args[()], block=(threads, 1, 1), grid=grid, shared=smem)

    # ---- forward ----
    def forward(self, q, k, v, *, kv_lengths=None, block_mask=None, seed: int = 0, offset: int = 0, out=None):
        """(o, lse): o like q; lse float32 (batch, heads, seq_q), natural log, -inf for rows that see no key.

        `out=(o, lse)` writes into given tensors (o contiguous in its last dim, lse contiguous)."""
        if "forward" not in self.solution.plans:
            raise ArgumentError(f"{self.spec.variant_name} was generated without the forward pass (passes: {self.spec.passes})")
        ensure_context()
        tensors, shape = self._check_qkv(q, k, v, {})
        batch, heads, seq_q, seq_k = shape
        plan = self.solution.plans["forward"]
        if plan.stages > 1:  # cp.async moves 16-byte chunks: rows must start on 16-byte boundaries
            q, k, v = (self._aligned(tensors[name], 16) for name in ("q", "k", "v"))
            tensors, shape = self._check_qkv(q, k, v, {})
        if out is None:
            o = _allocate(tensors["q"], (batch, heads, seq_q, self.spec.head_dim), self.spec.dtype)
            lse = _allocate(tensors["q"], (batch, heads, seq_q), "fp32")
        else:
            o, lse = out
        ot, lt = as_device_tensor("o", o), as_device_tensor("lse", lse)
        if ot.shape != tensors["q"].shape or ot.dtype != self.spec.dtype or ot.strides[3] != 1:
            raise ArgumentError(f"out o: expected {self.spec.dtype} of shape {tensors['q'].shape}, last dim contiguous")
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or lt.strides != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"out lse: expected contiguous fp32 of shape {(batch, heads, seq_q)}")
        args = self._base_args(tensors, shape)
        args["o"], args["lse"] = ot.pointer, lt.pointer
        self._set_strides(args, "o", ot)
        if ot.pointer % 4 or any(stride % 2 for stride in ot.strides[:3]):
            raise ArgumentError("out o: rows must start on 4-byte boundaries (even strides, aligned pointer)")
        keep = self._runtime_args(args, tensors, shape, kv_lengths, block_mask, seed, offset)
        symbol = self.rendered.kernels["forward"][0]
        row_blocks = math.ceil(seq_q / plan.block_r)
        if self.spec.loop_order == "fa1":
            workspace = [_allocate(tensors["q"], (batch, heads, seq_q, self.spec.head_dim), "fp32"),
                         _allocate(tensors["q"], (batch, heads, seq_q), "fp32"),
                         _allocate(tensors["q"], (batch, heads, seq_q), "fp32")]
            keep += workspace
            for key, tensor in zip(("o_accum", "row_max", "row_sum"), workspace):
                args[key] = as_device_tensor(key, tensor).pointer
            # Enough row groups to fill the GPU twice over; each group walks j outer, i inner.
            row_groups = max(1, min(row_blocks, math.ceil(2 * self.target.sm_count / (batch * heads))))
            args["row_groups"] = row_groups
            grid = (row_groups, batch * heads, 1)
        else:
            grid = (row_blocks, batch * heads, 1)
        self._launch(symbol, args, grid, plan.threads, plan.smem_bytes)
        _check_launch(symbol)
        del keep
        return o, lse

    # ---- backward ----
    def backward(self, q, k, v, o, lse, do, *, kv_lengths=None, block_mask=None, seed: int = 0, offset: int = 0,
                 out=None):
        """(dq, dk, dv) in the input's dtype, from the forward's o and lse and the output gradient do."""
        if "backward" not in self.solution.plans:
            raise ArgumentError(f"{self.spec.variant_name} was generated without the backward pass (passes: {self.spec.passes})")
        ensure_context()
        tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        batch, heads, seq_q, seq_k = shape
        plan = self.solution.plans["backward"]
        if plan.stages > 1:  # cp.async moves 16-byte chunks of Q, dO, K, V
            q, k, v, do = (self._aligned(tensors[name], 16) for name in ("q", "k", "v", "d_o"))
            tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        lt = as_device_tensor("lse", lse)
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or lt.strides != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"lse: expected the forward's contiguous fp32 lse of shape {(batch, heads, seq_q)}")
        if out is None:
            grads = tuple(_allocate(tensors[key], tensors[key].shape, self.spec.dtype) for key in ("q", "k", "v"))
        else:
            grads = tuple(out)
        args = self._base_args(tensors, shape)
        args["o"], args["d_o"], args["lse"] = tensors["o"].pointer, tensors["d_o"].pointer, lt.pointer
        self._set_strides(args, "o", tensors["o"])
        self._set_strides(args, "do", tensors["d_o"])
        for key, grad, like in zip(("dq", "dk", "dv"), grads, ("q", "k", "v")):
            gt = as_device_tensor(key, grad)
            if gt.shape != tensors[like].shape or gt.dtype != self.spec.dtype or gt.strides[3] != 1:
                raise ArgumentError(f"out {key}: expected {self.spec.dtype} of shape {tensors[like].shape}")
            if plan.tensor_cores and (gt.pointer % 4 or any(stride % 2 for stride in gt.strides[:3])):
                raise ArgumentError(f"out {key}: rows must start on 4-byte boundaries (even strides, aligned pointer)")
            args[key] = gt.pointer
            self._set_strides(args, key, gt)
        keep = self._runtime_args(args, tensors, shape, kv_lengths, block_mask, seed, offset)
        delta = _allocate(tensors["q"], (batch, heads, seq_q), "fp32")
        keep.append(delta)
        args["delta"] = as_device_tensor("delta", delta).pointer
        main = self.rendered.kernels["backward"][0]
        delta_kernel, dq_kernel, convert_kernel = main + "_delta", main + "_dq", main + "_dq_convert"
        rows = batch * heads * seq_q
        self._launch(delta_kernel, args, (math.ceil(rows / 8), 1, 1), 256)
        if not self.spec.deterministic:
            dq_accum = _allocate(tensors["q"], (batch, heads, seq_q, self.spec.head_dim), "fp32", fill=0.0)
            keep.append(dq_accum)
            args["dq_accum"] = as_device_tensor("dq_accum", dq_accum).pointer
        self._launch(main, args, (math.ceil(seq_k / plan.block_c), batch * heads, 1), plan.threads, plan.smem_bytes)
        if self.spec.deterministic:
            self._launch(dq_kernel, args, (math.ceil(seq_q / plan.block_r), batch * heads, 1), plan.threads, plan.smem_bytes)
        else:
            total = rows * self.spec.head_dim
            self._launch(convert_kernel, args, (min(math.ceil(total / 256), 65535), 1, 1), 256)
        _check_launch(main)
        del keep
        return grads


#: Synchronise after each call so that a launch failure names the call that caused it. Benchmarks
#: turn this off (fagen/bench.py) to time back-to-back launches.
CHECK_LAUNCHES = True


def _check_launch(symbol: str):
    """Surface an asynchronous launch error at the call that caused it."""
    import pycuda.driver as cuda

    if not CHECK_LAUNCHES:
        return
    try:
        cuda.Context.synchronize()
    except cuda.Error as err:
        raise RuntimeError(f"{symbol} failed on the GPU: {err}") from None


_kernel_cache: dict[tuple, Kernel] = {}


def compile(spec, *, policy: Optional[str] = None) -> Kernel:
    """Solve, render and compile `spec` (a Spec or a dict) for the GPU in this process.

    The target is read off the device (its arch replaces spec.arch). Compiled modules are cached on
    disk (FAGEN_CACHE_DIR, default ~/.cache/fagen) and in memory for this process."""
    spec = spec_from_dict(spec) if not isinstance(spec, Spec) else spec
    ensure_context()
    target = from_device()
    spec = spec.model_copy(update={"arch": target.arch}) if target.arch in ("sm_80", "sm_86", "sm_89", "sm_90") else spec
    key = (spec.canonical_json(), policy, target)
    if key not in _kernel_cache:
        solution = solver_stage.solve(spec, target, policy)
        if (policy or spec.tile_policy) == "auto":  # the per-(GPU, spec) winner of `fagen bench --autotune`
            from fagen import autotune

            solution = autotune.apply(solution, autotune.lookup(spec, target.name))
        _kernel_cache[key] = Kernel(spec, target, solution)
    return _kernel_cache[key]


def precompile(specs, jobs: int = 8) -> None:
    """Compile many specs into the on-disk cache in parallel (nvcc runs in threads; no context needed),
    so that later `compile(spec)` calls only load."""
    from concurrent.futures import ThreadPoolExecutor

    from fagen.compiler import compile_to_cache

    ensure_context()
    target = from_device()
    sources = []
    for spec in specs:
        spec = spec_from_dict(spec) if not isinstance(spec, Spec) else spec
        spec = spec.model_copy(update={"arch": target.arch})
        rendered = render(spec, solver_stage.solve(spec, target))
        sources.append(rendered)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda r: compile_to_cache(r.text, target.arch, r.include_dir), sources))
