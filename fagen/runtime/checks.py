"""What a call may pass: Kernel's checks of q, k, v and every run-time argument (kv_lengths, block_mask, inputs,
seed, offset), each failing with an ArgumentError that names the argument and what is allowed."""
from __future__ import annotations

import math
from typing import Optional

from fagen.runtime.arguments import _SLOT, LaunchArgs
from fagen.runtime.call_inputs import CallInputs
from fagen.runtime.device import _allocate, ensure_context
from fagen.runtime.tensors import ELEMENT_BYTES, ArgumentError, DeviceTensor, _is_device_array, as_device_tensor

#: how a message names a tensor's head dim, keyed by whether it is head_dim (q, k, or a spec without value_head_dim)
VALUE_FIELD = {True: "head_dim", False: "value_head_dim"}


class ArgumentChecks:
    """Kernel's argument checks and the argument struct they fill."""

    def _output_shape(self, q_shape: tuple) -> tuple:
        """o's shape (and dO's) for q of `q_shape`: q's, with v's head dim last."""
        return (*q_shape[:-1], self.spec.value_dim)

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
            dim = spec.tensor_dim(t.name)
            field = VALUE_FIELD[t.name in ("q", "k") or spec.value_head_dim is None]
            if t.shape[3] != dim:
                raise ArgumentError(f"{t.name}: head_dim {t.shape[3]} does not match the spec's {field} {dim}")
            if t.strides[3] != 1:
                raise ArgumentError(f"{t.name}: the last dimension must be contiguous (stride 1), got strides {t.strides}")
            if t.shape[2] < 1 or t.shape[0] < 1 or t.shape[1] < 1:
                raise ArgumentError(f"{t.name}: every dimension must be >= 1, got shape {t.shape}")
        batch, heads, seq_q, _ = tensors["q"].shape
        seq_k = tensors["k"].shape[2]
        if tensors["k"].shape[:3] != tensors["v"].shape[:3]:
            raise ArgumentError(f"k and v must have the same (batch, heads, seq), got {tensors['k'].shape} and "
                                f"{tensors['v'].shape}")
        kv_heads = tensors["k"].shape[1]
        if tensors["k"].shape[0] != batch or heads % kv_heads:
            raise ArgumentError(f"q has (batch, heads) = {(batch, heads)} but k, v have {tensors['k'].shape[:2]}: "
                                f"the batch must match and the heads of k, v must divide q's (grouped KV heads: "
                                f"query head h reads K/V head h // (heads // kv_heads))")
        for key in ("o", "d_o"):
            expected = self._output_shape(tensors["q"].shape)
            if key in tensors and tensors[key].shape != expected:
                raise ArgumentError(f"{key}: expected shape {expected} (q's, with v's head dim), got {tensors[key].shape}")
        if tensors["q"].is_torch:
            devices = {t.owner.device for t in tensors.values() if t.is_torch}
            if len(devices) > 1:
                raise ArgumentError(f"q, k, v are on different devices: {sorted(map(str, devices))}")
        return tensors, (batch, heads, seq_q, seq_k)

    def _runtime_args(self, args: LaunchArgs, tensors: dict, shape: tuple, given: CallInputs, stream: int = 0):
        """The run-time inputs `given` into `args` (a packed batch's offsets too); `shape` is (sequences, heads,
        longest Nq, longest Nk)."""
        spec = self.spec
        batch, heads, seq_q, seq_k = shape
        kv_lengths, block_mask, seed, offset, sequences = (given.kv_lengths, given.block_mask, given.seed, given.offset,
                                                           given.sequences)
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
        keep += self._mod_inputs(args, given.inputs, tensors["q"], stream)
        keep += self._descales(args, given.descales, tensors, batch, stream)
        return keep

    def _descales(self, args: LaunchArgs, descales, tensors: dict, batch: int, stream: int) -> list:
        """An fp8 forward's q_descale, k_descale, v_descale into `args` (None: 1). Each a positive number (put in a
        one-element tensor), a float32 tensor of one element (broadcast) or of shape (batch, kv_heads), on q's
        device (its values, unread on the host, must be positive too); `batch` counts a packed call's sequences."""
        if descales is None:
            return []
        if not self.spec.fp8:
            raise ArgumentError(f"q_descale, k_descale, v_descale are for dtype fp8_e4m3 specs; this spec's dtype is "
                                f"{self.spec.dtype}")
        kv_heads = tensors["k"].shape[1]
        like = tensors["q"]
        keep, pointers, strides = [], [0, 0, 0], [0] * 6
        for n, (name, value) in enumerate(zip(("q_descale", "k_descale", "v_descale"), descales)):
            if value is None:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if not (math.isfinite(value) and value > 0):
                    raise ArgumentError(f"{name}: expected a positive finite number, got {value}")
                value = _allocate(like, (1,), "fp32", stream, fill=float(value))
            elif not _is_device_array(value):
                raise ArgumentError(f"{name}: expected a number or a float32 CUDA tensor of one element or of shape "
                                    f"(batch, kv_heads) = {(batch, kv_heads)}, got {type(value).__name__}")
            t = as_device_tensor(name, value)
            if t.dtype != "fp32":
                raise ArgumentError(f"{name}: expected float32, got {t.dtype}")
            if t.is_torch and like.is_torch and t.owner.device != like.owner.device:
                raise ArgumentError(f"{name}: on {t.owner.device}, but q is on {like.owner.device}")
            if math.prod(t.shape) == 1:
                pair = (0, 0)
            elif tuple(t.shape) == (batch, kv_heads):
                pair = tuple(t.strides)
            else:
                raise ArgumentError(f"{name}: expected one element or shape (batch, kv_heads) = {(batch, kv_heads)}, "
                                    f"got shape {tuple(t.shape)}")
            keep.append(value)
            pointers[n], strides[2 * n:2 * n + 2] = t.pointer, pair
        args["descale"], args["descale_stride"] = pointers, strides
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

