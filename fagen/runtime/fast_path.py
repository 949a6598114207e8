"""The per-call fast path: a call whose signature (shapes, strides, dtypes, devices of every tensor) was seen
before only allocates its outputs, writes the pointers into the remembered argument struct and launches."""
from __future__ import annotations

import math
import threading

from fagen import cuda_driver as driver
from fagen.runtime.arguments import ARGS_STRUCT, _SLOT, LaunchArgs
from fagen.runtime.call_inputs import CallInputs
from fagen.runtime.device import _TORCH, _filled, _torch_types, empty_in_layout
from fagen.runtime.grids import _HELPER_KERNELS, backward_scratch
from fagen.runtime.tensor_maps import MAPPED, TensorMapParameter

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



def _small_tensor_key(value, dtype, device: int):
    """The part of a call's signature that kv_lengths / block_mask contribute, or False where only the
    full path can take them (host lists, other dtypes or devices, non-contiguous: it converts them)."""
    if value is None:
        return None
    if (type(value) is not _TORCH["Tensor"] or value.dtype is not dtype or value.get_device() != device
            or not value.is_contiguous()):
        return False
    return tuple(value.shape)



#: Fast-path signatures kept per kernel and pass; a table that fills up is cleared (see _remember).
FAST_CALLS_KEPT = 256



class FastCall:
    """A call signature seen before (shapes, strides, dtypes, devices of every tensor): the packed
    argument struct with everything but the pointers, seed and offset filled in, and the launches.
    A call that matches one only allocates its outputs, writes those slots and launches: the checks
    ran on the first call with this signature and their outcome depends on nothing else."""

    __slots__ = ("values", "params", "slots", "launches", "prepared", "lock", "workspaces", "main", "folded", "maps",
                 "mapped")

    def __init__(self, args: LaunchArgs, pointers: tuple, launches: list, workspaces: tuple = (), folded: bool = False,
                 tensor_maps=None):
        import ctypes

        self.values = (ctypes.c_uint64 * len(args.values)).from_buffer_copy(ARGS_STRUCT.pack(*args.values))
        # a kernel that takes TMA tensor maps (`tensor_maps`: the geometries of MAPPED's first, q, k, v (, d_o)):
        # encoded again with each call's pointers, found in `pointers` by name
        self.maps = None if tensor_maps is None else TensorMapParameter(tensor_maps)
        self.mapped = tuple(pointers.index(name) for name in MAPPED[:len(tensor_maps or ())])
        if self.maps is None:
            self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.values))
        else:
            self.params = (ctypes.c_void_p * 2)(ctypes.addressof(self.values), self.maps.address)
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
                if self.maps is not None:
                    self.maps.encode([values[n] for n in self.mapped])
                for launch in self.prepared:
                    code = launch(stream, params)
                    if code:
                        raise launch.failed(code)
        finally:
            if previous:   # (the caller's context, on another device)
                driver.leave_device(previous)




class FastPath:
    """Kernel's fast path: the signature of a call, the calls remembered by it, and their launches."""

    def _signature(self, pass_name: str, tensors: tuple, aligned: tuple, given: CallInputs):
        """The key of a FastCall for these torch tensors and `given`'s run-time inputs, or None where the full
        path must run (other array types, rows not 16-byte aligned for cp.async, arguments it converts, odd
        seeds)."""
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
        if not _fast_seed(given.seed, given.offset, tensor_type, torch_types["int64"], device):
            return None
        lengths_key = _small_tensor_key(given.kv_lengths, torch_types["int32"], device)
        mask_key = _small_tensor_key(given.block_mask, torch_types["uint8"], device)
        if lengths_key is False or mask_key is False:
            return None
        inputs_key = None
        inputs = given.inputs
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
        descales_key = None
        if given.descales:   # tensors by shape and strides (their pointers are refilled); numbers: the full path
            descales_key = []
            for value in given.descales:
                if value is None:
                    descales_key.append(None)
                elif (type(value) is tensor_type and value.dtype is torch_types["float32"]
                      and value.get_device() == device):
                    descales_key.append((value.shape, value.stride()))
                else:
                    return None
            descales_key = tuple(descales_key)
        return (tuple(parts), lengths_key, mask_key, inputs_key, descales_key)

    def _runtime_pointers(self, given: CallInputs) -> tuple[tuple, list]:
        """(slot names, pointers) of `given`'s run-time tensors, in the order a FastCall fills them."""
        names, pointers = (), []
        if given.kv_lengths is not None:
            names, pointers = names + ("kv_lengths",), pointers + [given.kv_lengths.data_ptr()]
        if given.block_mask is not None:
            names, pointers = names + ("block_mask",), pointers + [given.block_mask.data_ptr()]
        if given.inputs:
            for n, (name, _, _) in enumerate(self.modifiers.tensors):
                names, pointers = names + (f"mod_tensor{n}",), pointers + [given.inputs[name].data_ptr()]
        if given.descales:   # (numbers take the full path: _signature)
            for n, value in enumerate(given.descales):
                if value is not None:
                    names, pointers = names + (f"descale{n}",), pointers + [value.data_ptr()]
        return names, pointers

    def _remember(self, table: dict, key, args: LaunchArgs, names: tuple, launches: list, device: int,
                  workspaces: tuple = (), folded: bool = False, tensor_maps=None) -> None:
        functions = self._functions[device]
        if len(table) >= FAST_CALLS_KEPT:   # shapes that keep changing (a growing KV cache) start it over
            table.clear()
        table[key] = FastCall(args, names, [(functions[symbol], grid, threads, smem, symbol)
                                            for symbol, grid, threads, smem in launches], workspaces, folded,
                              tensor_maps)


    def _fast_forward_call(self, call: FastCall, q, k, v, given: CallInputs, table_pointer: tuple = ()):
        """A remembered forward: outputs and workspaces allocated, the pointers written in, launched.
        `table_pointer`: a paged call's (block_table pointer,)."""
        import torch

        device = q.get_device()
        o = (torch.empty_like(q) if v.shape[-1] == q.shape[-1] and self._output_torch_dtype is None
             else empty_in_layout(q, self._output_shape(q.shape), self._output_torch_dtype))
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        # decode: the splits' partial O and LSE; mask_mod inputs' run-time summaries. Held until the
        # launches are queued
        workspaces = [torch.empty(shape, dtype=torch.float32, device=q.device) for shape in call.workspaces]
        _, extra = self._runtime_pointers(given)
        call.launch(device, _TORCH["stream"](device),
                    (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                     *[w.data_ptr() for w in workspaces], *table_pointer, *extra,
                     *_seed_values(given.seed, given.offset)))
        self._finish(call.main, device)
        return o, lse


    def _fast_backward_call(self, call: FastCall, q, k, v, o, lse, do, given: CallInputs, offsets: tuple = (),
                            d_lse=None):
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
            # held (not just their pointers taken) until the launches are queued: a tensor freed
            # at once would hand the second workspace the first one's memory
            workspaces = [_filled(torch.empty((1, q.shape[1], t.shape[0], t.shape[2]) if packed
                                              else (*q.shape[:2], t.shape[2], t.shape[3]), dtype=k.dtype, device=k.device),
                                  stream, zero=packed) for t in (k, v)]
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
        _, extra = self._runtime_pointers(given)
        call.launch(device, stream, (*pointers, *offsets, *extra, *_seed_values(given.seed, given.offset)))
        self._finish(call.main, device)
        return grads

