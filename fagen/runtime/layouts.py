"""The layouts a call may pass besides padded (batch, heads, seq, d) tensors: packed variable-length batches
(cu_seqlens) and paged K/V caches (a block table), each checked and turned into the problem the kernels walk."""
from __future__ import annotations

import math
from typing import Optional
from dataclasses import dataclass

from fagen.runtime.call_inputs import CallInputs
from fagen.runtime.device import _TORCH, _allocate, _caller_stream, _fill, _filled, _torch_types
from fagen.runtime.fast_path import _seed_values
from fagen.runtime.grids import PAGED_FORWARD_TEMPLATES
from fagen.runtime.tensors import ArgumentError, DeviceTensor, as_device_tensor

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




class Layouts:
    """Kernel's packed and paged calls."""

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
            dim = self.spec.tensor_dim(name)
            if t.shape[2] != dim or (t.strides[2] != 1 and not empty) or t.shape[1] < 1:
                raise ArgumentError(f"{name}: expected (total rows, heads >= 1, {dim}) with the last "
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

    def _packed_signature(self, tensors: tuple, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          given: CallInputs, lse=None):
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
        key = self._signature("forward", tensors, (), given)
        if key is None or any(len(t.shape) != 3 for t in tensors) or (given.inputs and self.modifiers.summaries):
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

    def _forward_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given: CallInputs,
                        out, stream, signature=None):
        tensors = self._check_packed({"q": q, "k": k, "v": v})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given,
                                            out, None)
        _, launch_stream = self._stream(tensors, stream)
        total_q, heads, _ = like.shape
        sequences = self._sequences(like, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q,
                                    tensors["k"].shape[0])
        o, lse = self._packed_outputs(like, {"o": (self._output_shape(like.shape), self.spec.output_dtype),
                                             "lse": ((heads, total_q), "fp32")},
                                      out, launch_stream,
                                      {"o": None, "lse": None} if sequences.covers_q and sequences.has_work
                                      else {"o": 0, "lse": -math.inf})
        if out is not None and not sequences.has_work:
            self._clear_sequence_rows(((o, 0, 0.0), (lse, 1, -math.inf)), sequences, 0)
        if total_q == 0 or tensors["k"].shape[0] == 0:
            return o, lse
        views = [_packed_view(tensors[name]) for name in ("q", "k", "v")]
        self._forward(*views, given._replace(sequences=sequences),
                      (_packed_view(as_device_tensor("o", o)), _packed_view(as_device_tensor("lse", lse))),
                      stream, signature)
        return o, lse

    def _backward_packed(self, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         given: CallInputs, out, stream, input_grad_out=None, signature=None, d_lse=None):
        tensors = self._check_packed({"q": q, "k": k, "v": v, "o": o, "d_o": do})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, given, out, None, input_grad_out, d_lse=d_lse)
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
        self._backward(*views, _packed_view(lt), _packed_view(tensors["d_o"]), given._replace(sequences=sequences),
                       tuple(_packed_view(as_device_tensor(name, g)) for name, g in zip(("dq", "dk", "dv"), grads)),
                       stream, signature, input_grad_out,
                       None if d_lse is None else _packed_view(as_device_tensor("d_lse", d_lse)))
        return grads

    def _packed_forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given: CallInputs,
                        out, stream) -> tuple:
        """(o, lse, the call's fast-path signature or None) of a packed call."""
        signature = None
        if out is None and stream is None and self.spec.loop_order != "fa1":
            signature = self._packed_signature((q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               given)
            call = self._fast_forward.get(signature) if signature is not None else None
            if call is not None:
                import torch

                device = q.get_device()
                stream = _TORCH["stream"](device)
                # offsets on the GPU: which rows they cover is unknown, so the rest must read 0 / -inf
                o = _filled(torch.empty(self._output_shape(q.shape), dtype=self._output_torch_dtype or q.dtype,
                                        device=q.device), stream, zero=True)
                lse = _filled(torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device), stream,
                              fill=-math.inf)
                _, extra = self._runtime_pointers(given)
                call.launch(device, stream,
                            (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                             cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), *extra,
                             *_seed_values(given.seed, given.offset)))
                self._finish(call.main, device)
                return o, lse, signature
        return (*self._forward_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given, out,
                                      stream, signature), signature)


    def _packed_backward(self, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         given: CallInputs, out, stream, d_lse=None) -> tuple:
        """((dq, dk, dv), the call's fast-path signature or None) of a packed call (with d_lse: the full path)."""
        signature = None
        if out is None and stream is None and d_lse is None and "backward" in self.plans:
            signature = self._packed_signature((q, k, v, o, do), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                               max_seqlen_k, given, lse)
            call = self._fast_backward.get(signature) if signature is not None else None
            if call is not None:
                return (self._fast_backward_call(call, q, k, v, o, lse, do, given,
                                                 (cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr())),
                        signature)
        return (self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      given, out, stream, signature=signature, d_lse=d_lse),
                signature)


    def _paged_signature(self, q, k_cache, v_cache, block_table, given: CallInputs):
        """The fast path's key of a paged call: the padded one's over q and the page pools, and the table's
        shape and row stride (its entries are data, read on the GPU)."""
        if not type(q).__module__.startswith("torch"):
            return None
        torch_types = _torch_types()
        if (type(block_table) is not torch_types["Tensor"] or block_table.dtype is not torch_types["int32"]
                or block_table.dim() != 2 or block_table.stride(1) != 1):
            return None
        key = self._signature("forward", (q, k_cache, v_cache), (q, k_cache, v_cache), given)
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
        if pages["k"].shape[:3] != pages["v"].shape[:3]:
            raise ArgumentError(f"k and v must have the same (pages, page_size, kv_heads), got {pages['k'].shape} and "
                                f"{pages['v'].shape}")
        page_count, page_size, kv_heads, _ = pages["k"].shape
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
        views = {name: DeviceTensor(name, t.pointer, (view_batch, kv_heads, table.shape[1] * page_size, t.shape[3]),
                                    (t.strides[0], t.strides[2], t.strides[1], t.strides[3]), t.dtype, t.owner, False,
                                    t.stream) for name, t in pages.items()}
        fields = {"block_table": table.pointer, "block_table_stride": table.strides[0], "page_size": page_size,
                  "page_count": page_count}
        return views, fields, table

    def _forward_paged(self, q, k_cache, v_cache, block_table, given: CallInputs, out, stream, signature=None):
        """Decoding from a paged K/V cache (_paged_cache), the layout of vLLM and FlashAttention's kvcache call.
        The keys are max pages x page_size long; mask padding with kv_lengths gives each sequence its own length.
        With a padded spec only the decode pass reads pages (the spec's passes must include it, and a call must
        fit its rows); a page must hold whole tiles of the decode plan's keys. (Packed specs: _forward_paged_packed.)"""
        decode = self.plans.get("decode")
        if decode is None and self.spec.fp8:
            raise ArgumentError(f"{self.spec.variant_name}: an fp8_e4m3 spec has no decode pass; it reads paged K/V "
                                "caches with layout packed (query rows per sequence by cu_seqlens_q)")
        if decode is None:
            raise ArgumentError(f"{self.spec.variant_name}: with a layout padded spec, paged K/V caches are read by the "
                                f"decode pass; build the spec with passes including \"decode\" (passes: "
                                f"{list(self.spec.passes)}), or with layout packed for many query rows (prefill)")
        views, fields, table = self._paged_cache(k_cache, v_cache, block_table, as_device_tensor("q", q).shape[0], q)
        page_size = fields["page_size"]
        if page_size % decode.block_c:
            raise ArgumentError(f"page_size {page_size}: the decode kernel reads keys in tiles of {decode.block_c}, and a "
                                f"page must hold whole tiles (page_size a multiple of {decode.block_c})")
        return self._forward(q, views["k"], views["v"], given._replace(paged=(fields, table.owner)), out, stream,
                             signature)

    def _forward_paged_packed(self, q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, given: CallInputs, out, stream):
        """Prefill, chunked prefill and speculative decoding against a paged K/V cache (_paged_cache): q packed
        (total_q, heads, d) with cu_seqlens_q, as a packed call's; cu_seqlens_k gives each sequence's key count
        (its differences: sequence b's keys are its pages' first cu_seqlens_k[b + 1] - cu_seqlens_k[b] rows,
        FlashAttention-2's varlen convention with a block table). Causal masks align bottom-right per sequence.
        Any page size; the forward kernels look each key row's page up."""
        plan = self._pass("forward")
        if plan.template not in PAGED_FORWARD_TEMPLATES:
            raise ArgumentError(f"{self.spec.variant_name}: its forward kernel ({plan.template}) does not read paged "
                                f"K/V caches; Hopper's warpgroup-MMA forwards do ({', '.join(sorted(PAGED_FORWARD_TEMPLATES))}: "
                                f"arch sm_90, fp16 / bf16 / fp8_e4m3, loop_order fa2)")
        if self.spec.head_dim % 8:
            raise ArgumentError(f"{self.spec.variant_name}: a paged K/V cache's rows are copied in 16-byte pieces, so "
                                f"head_dim must be a multiple of 8 (got {self.spec.head_dim})")
        tensors = self._check_packed({"q": q})
        like = tensors["q"]
        if stream is not None and like.is_torch:
            with _caller_stream(like, stream):
                return self._forward_paged_packed(q, k_cache, v_cache, block_table, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, given, out, None)
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
        o, lse = self._packed_outputs(like, {"o": (self._output_shape(like.shape), self.spec.output_dtype),
                                             "lse": ((heads, total_q), "fp32")},
                                      out, launch_stream,
                                      {"o": None, "lse": None} if sequences.covers_q and sequences.has_work
                                      else {"o": 0, "lse": -math.inf})
        if out is not None and not sequences.has_work:
            self._clear_sequence_rows(((o, 0, 0.0), (lse, 1, -math.inf)), sequences, 0)
        if total_q == 0:
            return o, lse
        self._forward(_packed_view(tensors["q"]), views["k"], views["v"],
                      given._replace(sequences=sequences, paged=(fields, table.owner)),
                      (_packed_view(as_device_tensor("o", o)), _packed_view(as_device_tensor("lse", lse))), stream, None)
        return o, lse

