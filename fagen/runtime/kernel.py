"""The Kernel: a compiled spec loaded from its artifact, `forward(q, k, v, ...) -> (o, lse)` and
`backward(...) -> (dq, dk, dv)`; the checks, layouts and fast path it inherits live beside it."""
from __future__ import annotations

import math
import threading
from typing import Optional

import fagen.runtime
from fagen import cuda_driver as driver
from fagen.artifact import INPUT_GRAD_BACKWARD, Artifact
from fagen.runtime.arguments import LaunchArgs
from fagen.runtime.call_inputs import CallInputs
from fagen.runtime.checks import ArgumentChecks
from fagen.runtime.device import _allocate, _caller_stream, _default_device, ensure_context, stream_handle
from fagen.runtime.fast_path import FAST_CALLS_KEPT, FastCall, FastPath
from fagen.runtime.grids import (_HELPER_KERNELS, FOLD_WAVES, GROUPED_TEMPLATES, SUMMARY_GRID, LaunchPlan,
                                 backward_scratch, block_group, decode_splits, grouped_grid, problem_grid,
                                 row_pass_grid)
from fagen.runtime.layouts import Layouts
from fagen.runtime.tensor_maps import TensorMapParameter, kernel_geometries
from fagen.runtime.tensors import ELEMENT_BYTES, TORCH_DTYPES, ArgumentError, DeviceTensor, as_device_tensor
from fagen.spec import Spec
from fagen.target import Target


class Kernel(ArgumentChecks, Layouts, FastPath):
    """A compiled spec: `forward(q, k, v, ...) -> (o, lse)` and `backward(...) -> (dq, dk, dv)`.

    Loaded from an artifact (fagen/artifact.py) that the build made: `fagen.compile(spec)` gives one."""

    def __init__(self, spec: Spec, target: Target, artifact: Artifact, *, device: Optional[int] = None):
        self.spec, self.target = spec, target
        record, cubins = artifact.record, artifact.cubins
        self.record = record
        self.plans = {p: LaunchPlan.from_plan(record["plans"][p], record["kernels"][p], spec.compute_dim,
                                              record["folds_heads"][p])
                      for p in record["plans"]}
        self._cubins = {p: cubins[p] for p in self.plans}   # pass -> cubin
        self._input_grad_cubin: Optional[bytes] = cubins.get(INPUT_GRAD_BACKWARD)   # the backward WITH_INPUT_GRADS
        self._functions: dict[int, dict[str, int]] = {}   # device -> symbol -> CUfunction
        self._input_grad_functions: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()
        # Rows of whole 16-byte chunks are copied by cp.async (they must start on 16-byte boundaries);
        # other head dims load element by element, anywhere. An even d stores output pairs as 32 bits.
        # (a value_head_dim unlike head_dim is a multiple of 8, as head_dim then is: both or neither are chunked)
        self._chunked_rows = spec.head_dim * ELEMENT_BYTES[spec.dtype] % 16 == 0
        self._pair_stores = spec.head_dim % 2 == 0
        # The passes whose full path copies a tensor to align its rows (_aligned): a call remembered from that
        # copy would launch with the copy's strides on the caller's pointer, so the fast path checks rows there.
        self._checks_rows = {name: self._chunked_rows and (plan.stages > 1
                                                            or (name == "forward" and "decode" in self.plans))
                             for name, plan in self.plans.items()}
        if spec.latent_kv:   # (forward calls run the decode pass, which copies k to align it)
            self._checks_rows["forward"] = self._chunked_rows
        # o's torch dtype where it is not q's (an fp8 forward's bf16), for the fast paths' allocations
        self._output_torch_dtype = None
        if spec.output_dtype != spec.dtype:   # (fp8 tensors are torch's: a call of one imports it anyway)
            import torch

            self._output_torch_dtype = getattr(torch, TORCH_DTYPES[spec.output_dtype])
        self._fast_forward: dict[tuple, FastCall] = {}
        self._fast_backward: dict[tuple, FastCall] = {}
        # the torch autograd path's backwards by their forward's signature (see backward_after)
        self._fast_backward_after: dict[tuple, tuple] = {}
        self._modifiers = None
        self._load(_default_device() if device is None else device)

    @property
    def modifiers(self):
        """The spec's mask_mod / score_mod and their inputs (fagen/expressions/), parsed on first use."""
        if self._modifiers is None:
            self._modifiers = self.spec.modifiers
        return self._modifiers

    def _load(self, device: int) -> dict:
        """This kernel's functions in the device's primary context (modules are per context)."""
        with self._lock:
            functions = self._functions.get(device)
            if functions is None:
                functions = self._functions[device] = self._module_functions(device, self._cubins)
            return functions

    def _module_functions(self, device: int, cubins: dict) -> dict:
        """symbol -> CUfunction of each pass's cubin in `cubins`, loaded in the device's primary context."""
        functions = {}
        with driver.on_device(device):   # (the functions too: they belong to the module's context)
            for pass_name, cubin in cubins.items():
                module = driver.load_module(cubin)
                plan = self.plans[pass_name]
                for symbol in plan.symbols:
                    big = not symbol.endswith(_HELPER_KERNELS)  # the others are given plan.smem_bytes
                    functions[symbol] = driver.get_function(module, symbol, plan.smem_bytes if big else 0)
        return functions

    def _load_input_grad_backward(self, device: int) -> dict:
        """The backward's functions built WITH_INPUT_GRADS (the artifact's INPUT_GRAD_BACKWARD cubin), loaded when
        a backward first asks for input gradients."""
        with self._lock:
            functions = self._input_grad_functions.get(device)
            if functions is None:
                if self._input_grad_cubin is None:
                    raise ArgumentError(f"input_grads: {self.spec.variant_name}'s build has no backward with input "
                                        "gradients (score_mod reads no float tensor input, or no backward pass)")
                functions = self._module_functions(device, {"backward": self._input_grad_cubin})
                self._input_grad_functions[device] = functions
            return functions

    def __repr__(self) -> str:
        plans = ", ".join(f"{p}: Br={x['block_r']} Bc={x['block_c']} warps={x['warps']}"
                          for p, x in self.record["plans"].items())
        return f"<fagen.Kernel {self.spec.variant_name} on {self.target.name} ({plans})>"

    # ---- streams and launches ----
    def _stream(self, tensors: dict, stream) -> tuple[int, int]:
        """(device, stream) for this call: see the module docstring."""
        q = tensors["q"]
        if q.is_torch:
            device = q.owner.device.index
            if stream is None:
                import torch

                return device, torch.cuda.current_stream(device).cuda_stream
            return device, stream_handle(stream)
        device = driver.current_device()
        if device is None:
            ensure_context()
            device = driver.current_device()
        if stream is not None:
            return device, stream_handle(stream)
        return device, int(q.stream or 0)   # CAI: None = no stream given (legacy), 1 = legacy, 2 = per-thread

    def _folds(self, plan: LaunchPlan, blocks: int) -> bool:
        """Whether a grouped-KV backward runs a block per (sequence, K/V head) pair and key block, walking the
        group's query heads (its kernel built so: LaunchPlan.folds_heads,
        fagen/sources.py folds_kv_group), given the `blocks` that makes:
        only where those still fill the GPU FOLD_WAVES times over (fewer, longer blocks leave SMs idle at the end)."""
        return (plan.folds_heads and not self.spec.deterministic
                and blocks >= FOLD_WAVES * self.target.sm_count)   # (a deterministic _dq grid resets args.problems)

    def _blocks_grid(self, plan: LaunchPlan, blocks: int, problems: int, args) -> tuple:
        """The grid of a main kernel's `blocks` blocks per (sequence, head) pair: in groups of pairs for the
        templates built for it (GROUPED_TEMPLATES), one pair after another otherwise."""
        if plan.template in GROUPED_TEMPLATES:
            return grouped_grid(blocks, problems, block_group(self.spec), args)
        return problem_grid(blocks, problems, args)

    def _launch(self, device: int, symbol: str, arguments, grid: tuple, threads: int, smem: int, stream: int,
                functions: Optional[dict] = None):
        functions = functions or self._functions.get(device) or self._load(device)
        # (in the device's context: the thread's may be another GPU's, or none on autograd's thread)
        with driver.on_device(device):
            driver.launch(functions[symbol], grid, threads, smem, stream, arguments, symbol)

    @staticmethod
    def _finish(symbol: str, device: int):
        if fagen.runtime.CHECK_LAUNCHES:
            try:
                with driver.on_device(device):
                    driver.synchronize(f"{symbol} (FAGEN_SYNC_LAUNCHES)")
            except driver.CudaError as err:
                raise RuntimeError(f"{symbol} failed on the GPU: {err}") from None

    def _forward_plan(self) -> Optional[LaunchPlan]:
        """The plan forward calls start from: the forward's, or a latent_kv spec's decode plan (its only pass)."""
        return self.plans.get("decode" if self.spec.latent_kv else "forward")

    def _pass(self, pass_name: str) -> LaunchPlan:
        plan = self.plans.get(pass_name)
        if plan is None:
            raise ArgumentError(f"{self.spec.variant_name} was generated without the {pass_name} pass "
                                f"(passes: {list(self.spec.passes)})")
        return plan

    # ---- the fast path: a call whose signature was seen before ----
    # ---- forward ----
    def forward(self, q, k, v, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0, offset: int = 0,
                out=None, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                block_table=None, q_descale=None, k_descale=None, v_descale=None):
        """(o, lse): o of q's shape with v's head dim (a spec's value_head_dim), laid out as q; lse float32 (batch,
        heads, seq_q), natural log, -inf for rows that see no key.

        `out=(o, lse)` writes into given tensors (o contiguous in its last dim, lse contiguous).
        `stream` overrides the stream the call runs on (default: see the module docstring).

        Specs with layout packed take q (total_q, heads, d), k and v (total_k, kv_heads, d) and
        cu_seqlens_q / cu_seqlens_k (see `_sequences`); o is (total_q, heads, d) and lse (heads, total_q).

        `block_table`: k and v are a paged K/V cache: decoding with a padded spec (see `_forward_paged`), packed
        query rows of any count per sequence with a packed spec (prefill, chunked prefill, speculative decoding:
        see `_forward_paged_packed`).

        `q_descale`, `k_descale`, `v_descale` (dtype fp8_e4m3 specs; FlashAttention-3's): the true q, k, v are the
        e4m3 elements times these. Each a number, a float32 CUDA tensor of one element, or one of shape (batch,
        kv_heads) (packed: (sequences, kv_heads)); default 1. o is bf16."""
        if self.spec.latent_kv:
            v = self._latent_values(k, v)
        descales = None if q_descale is None and k_descale is None and v_descale is None else (q_descale, k_descale,
                                                                                                v_descale)
        given = CallInputs(kv_lengths, block_mask, inputs, seed, offset, descales=descales)
        if block_table is not None and self.spec.layout == "packed":
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ArgumentError("block_table with a layout packed spec: pass cu_seqlens_q (the query rows of each "
                                    "sequence) and cu_seqlens_k (their key counts, as offsets)")
            return self._forward_paged_packed(q, k, v, block_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, given, out, stream)
        if block_table is not None:
            if cu_seqlens_q is not None or cu_seqlens_k is not None:
                raise ArgumentError("block_table with cu_seqlens: a packed batch against a paged K/V cache takes a "
                                    "layout packed spec; a layout padded spec takes q of shape (batch, heads, Nq, d)")
            signature = None
            if out is None and stream is None and "decode" in self.plans:
                signature = self._paged_signature(q, k, v, block_table, given)
                call = self._fast_forward.get(signature) if signature is not None else None
                if call is not None:   # decode's split workspaces, then the table, as _decode remembered them
                    return self._fast_forward_call(call, q, k, v, given, (block_table.data_ptr(),))
            return self._forward_paged(q, k, v, block_table, given, out, stream, signature)
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given, out,
                                        stream)[:2]
        return self._padded_forward(q, k, v, given, out, stream)[:2]

    def _latent_values(self, k, v):
        """A latent_kv spec's v: k's first value_head_dim columns, as a view (the kernel reads them from K's tile)."""
        if v is not None:
            raise ArgumentError(f"{self.spec.variant_name} reads a latent cache (latent_kv): v is k's first "
                                f"{self.spec.value_dim} columns; pass v=None (Kernel.forward: fagen.attention does "
                                "not take latent_kv specs yet)")
        if not type(k).__module__.startswith("torch"):
            raise ArgumentError(f"{self.spec.variant_name} reads a latent cache (latent_kv) from a torch tensor k "
                                f"(its first {self.spec.value_dim} columns are v); got {type(k).__name__}")
        if k.dim() != 4 or k.shape[3] != self.spec.head_dim:
            raise ArgumentError(f"k: a latent cache of 4 dimensions whose last is head_dim {self.spec.head_dim} (the "
                                f"latent, then the rope columns); got shape {tuple(k.shape)}")
        return k[..., :self.spec.value_dim]

    def _padded_forward(self, q, k, v, given: CallInputs, out, stream) -> tuple:
        """(o, lse, the call's fast-path signature or None) of a (batch, heads, seq, d) call."""
        signature = None
        if out is None and stream is None and self.spec.loop_order != "fa1" and self._forward_plan() is not None:
            signature = self._signature("forward", (q, k, v), (q, k, v), given)
            call = self._fast_forward.get(signature) if signature is not None else None
            if call is not None:
                return (*self._fast_forward_call(call, q, k, v, given), signature)
        return (*self._forward(q, k, v, given, out, stream, signature), signature)

    # ---- the autograd path: a backward keyed by its forward ----
    def forward_keyed(self, q, k, v, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0,
                      offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
        """(o, lse, key): `forward` for an autograd node, with the key that `backward_after` takes for its
        backward (the call's fast-path signature, padded or packed: None where it has none)."""
        if self.spec.latent_kv:   # (an autograd node would pass a v the kernel never reads)
            raise ArgumentError(f"{self.spec.variant_name} reads a latent cache (latent_kv), which fagen.attention and "
                                "autograd do not take yet: call fagen.compile(spec).forward(q, k, None, ...)")
        given = CallInputs(kv_lengths, block_mask, inputs, seed, offset)
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, given, None,
                                        None)
        return self._padded_forward(q, k, v, given, None, None)

    def backward_after(self, forward_key, q, k, v, o, lse, do, *, kv_lengths=None, block_mask=None, inputs=None,
                       seed: int = 0, offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, d_lse=None):
        """`backward` of the forward call that returned (o, lse, forward_key) from `forward_keyed`, with the
        same q, k, v and run-time arguments (the same offsets, for a packed call), and do of o's shape, dtype and
        device (what autograd hands a node). Its fast path is keyed by the forward's signature and do's strides,
        so the full signature is not recomputed: autograd runs backwards on its own thread, where this Python
        runs about 3x slower than on the caller's (host time per call, issue 10)."""
        packed = self._is_packed_call(cu_seqlens_q, cu_seqlens_k)
        if d_lse is not None:   # (lse reached the loss too: the general route, whose signature covers d_lse)
            return self.backward(q, k, v, o, lse, do, kv_lengths=kv_lengths, block_mask=block_mask, inputs=inputs,
                                 seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, d_lse=d_lse)
        given = CallInputs(kv_lengths, block_mask, inputs, seed, offset)
        entry = self._fast_backward_after.get(forward_key)
        if entry is not None:
            call, do_stride = entry
            # strides were checked when the entry was made (the forward key fixes q, k, v's, and o's and lse's with
            # them; do's is compared): only the pointers can have moved off a 16-byte boundary
            if do.stride() == do_stride and not (
                    (self._chunked_rows if packed else self._checks_rows["backward"])
                    and (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr() | do.data_ptr()) % 16):
                return self._fast_backward_call(call, q, k, v, o, lse, do, given,
                                                (cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()) if packed else ())
        if packed:
            grads, signature = self._packed_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                     max_seqlen_k, given, None, None)
        else:
            grads, signature = self._padded_backward(q, k, v, o, lse, do, given, None, None)
        call = self._fast_backward.get(signature) if signature is not None else None
        if call is not None:
            if len(self._fast_backward_after) >= FAST_CALLS_KEPT:
                self._fast_backward_after.clear()
            self._fast_backward_after[forward_key] = (call, do.stride())
        return grads

    def _forward(self, q, k, v, given: CallInputs, out, stream, signature):
        """The full forward path (everything the fast path skips); `given.sequences` for packed batches,
        whose q, k, v arrive here as (1, heads, total, d) views; `given.paged` for a paged cache, whose k, v
        arrive as views (_forward_paged)."""
        plan = self._forward_plan() or self._pass("forward")
        tensors, shape = self._check_qkv(q, k, v, {})
        if stream is not None and tensors["q"].is_torch:
            with _caller_stream(tensors["q"], stream):
                return self._forward(q, k, v, given, out, None, signature)
        sequences, paged = given.sequences, given.paged
        device, stream = self._stream(tensors, stream)
        batch, heads, seq_q, seq_k = shape
        problems = shape if sequences is None else (sequences.count, heads, max(1, sequences.max_q), max(1, sequences.max_k))
        if plan.stages > 1 and self._chunked_rows:  # cp.async moves 16-byte chunks: rows start on 16-byte boundaries
            q, k, v = (self._aligned(tensors[name], 16) for name in ("q", "k", "v"))
            tensors, shape = self._check_qkv(q, k, v, {})
        like = tensors["q"]
        if out is None:
            o = _allocate(like, (batch, heads, seq_q, self.spec.value_dim), self.spec.output_dtype, stream)
            lse = _allocate(like, (batch, heads, seq_q), "fp32", stream)
        else:
            o, lse = out
        ot, lt = as_device_tensor("o", o), as_device_tensor("lse", lse)
        if ot.shape != self._output_shape(like.shape) or ot.dtype != self.spec.output_dtype or ot.strides[3] != 1:
            raise ArgumentError(f"out o: expected {self.spec.output_dtype} of shape {self._output_shape(like.shape)}, last dim "
                                "contiguous")
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or tuple(lt.strides) != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"out lse: expected contiguous fp32 of shape {(batch, heads, seq_q)}")
        if plan.tensor_cores and self._pair_stores and (ot.pointer % 4 or any(stride % 2 for stride in ot.strides[:3])):
            raise ArgumentError("out o: rows must start on 4-byte boundaries (even strides, aligned pointer)")
        args = self._base_args(tensors, shape)
        args["o"], args["lse"] = ot.pointer, lt.pointer
        args["o_stride"] = ot.strides[:3]
        keep = self._runtime_args(args, tensors, problems, given, stream)
        group = heads // tensors["k"].shape[1]
        decode = self.plans.get("decode")
        # the decode kernel holds a K/V head's query rows in one block (a latent cache's: any number, 16 a block)
        rows_fit_decode = decode is not None and (self.spec.latent_kv or group * seq_q <= decode.block_r)
        if paged is not None and sequences is not None:   # a packed batch against pages: the forward kernels
            fields, table = paged
            for name, value in fields.items():
                args[name] = value
            keep.append(table)
        elif paged is not None:
            if not rows_fit_decode:
                raise ArgumentError(f"a paged K/V cache is read by the decode kernel, which holds at most {decode.block_r} "
                                    f"query rows per K/V head (query heads per K/V head x Nq); got {group} x {seq_q}")
            fields, table = paged
            for name, value in fields.items():
                args[name] = value
            keep.append(table)
        if rows_fit_decode and not (paged is not None and sequences is not None):
            return self._decode(decode, args, tensors, shape, group, o, lse, keep, device, stream, signature, given)
        symbol = plan.symbols[0]
        row_blocks = math.ceil(problems[2] / plan.block_r)
        if sequences is not None and not sequences.has_work:   # every sequence empty of queries or keys
            return o, lse                                      # (o, lse arrive as 0 and -inf)
        if self.spec.loop_order == "fa1":
            workspace = [_allocate(like, (batch, heads, seq_q, self.spec.value_dim), "fp32", stream),
                         _allocate(like, (batch, heads, seq_q), "fp32", stream),
                         _allocate(like, (batch, heads, seq_q), "fp32", stream)]
            keep += workspace
            for key, tensor in zip(("o_accum", "row_max", "row_sum"), workspace):
                args[key] = as_device_tensor(key, tensor).pointer
            # Enough row groups to fill the GPU twice over; each group walks j outer, i inner.
            row_groups = max(1, min(row_blocks, math.ceil(2 * self.target.sm_count / (problems[0] * heads))))
            args["row_groups"] = row_groups
            grid = problem_grid(row_groups, problems[0] * heads, args)
        else:
            grid = self._blocks_grid(plan, row_blocks, problems[0] * heads, args)
        geometries = None   # the TMA's maps of q, k, v where the kernel takes them (none for a paged cache)
        if plan.tensor_map_columns:
            geometries = () if paged is not None else kernel_geometries(
                self.spec.dtype, ELEMENT_BYTES[self.spec.dtype], tensors, plan.tensor_map_columns, plan.block_r,
                plan.block_c)
            maps = TensorMapParameter(geometries)
            maps.encode([tensors[name].pointer for name in ("q", "k", "v")])
            keep.append(maps)
        arguments = args.packed(maps.address if geometries is not None else None)
        if self.modifiers.summaries:   # the mask_mod inputs' per-tile bounds, before the kernel reads them
            self._launch(device, symbol + "_summary", arguments, SUMMARY_GRID, 256, 0, stream)
        self._launch(device, symbol, arguments, grid, plan.threads, plan.smem_bytes, stream)
        self._finish(symbol, device)
        # (packed calls whose mask_mod needs run-time summaries get no signature: _packed_signature)
        if signature is not None and not (sequences is not None and self.modifiers.summaries):
            # the next call with this signature skips everything above
            names, _ = self._runtime_pointers(given)
            if sequences is not None:
                names = ("cu_seqlens_q", "cu_seqlens_k") + names
            launches = [(symbol, grid, plan.threads, plan.smem_bytes)]
            summaries = self._summary_workspaces(args) if self.modifiers.summaries else []
            if summaries:   # allocated per call like decode's workspaces: their pointers follow o and lse
                launches.insert(0, (symbol + "_summary", SUMMARY_GRID, 256, 0))
            self._remember(self._fast_forward, signature, args,
                           ("q", "k", "v", "o", "lse") + tuple(slot for slot, _ in summaries) + names,
                           launches, device, tuple(shape for _, shape in summaries), tensor_maps=geometries)
        del keep  # torch's allocator orders the reuse of these after the kernel on this stream
        return o, lse

    def _decode(self, plan: LaunchPlan, args: LaunchArgs, tensors: dict, shape: tuple, group: int, o, lse, keep: list,
                device: int, stream: int, signature, given: CallInputs):
        """The split-KV forward for few query rows (templates/decode_splitkv.cu.j2): one block per
        (split of the keys, batch, K/V head) holds every query row of the head's group, then
        _combine merges the splits by LSE into o and lse; `given.paged` for a paged cache. A latent cache's kernel
        (templates/decode_latent_mma.cu.j2) takes the group's rows in chunks of 16, a block per chunk."""
        batch, heads, seq_q, seq_k = shape
        for name in ("q", "k", "v"):   # cp.async moves 16-byte chunks of Q, K and V (q: where no forward plan aligned it)
            aligned = self._aligned(tensors[name], 16) if self._chunked_rows else tensors[name].owner
            if aligned is not tensors[name].owner:
                keep.append(aligned)
                tensors[name] = as_device_tensor(name, aligned)
                args[name], args[f"{name}_stride"] = tensors[name].pointer, tensors[name].strides[:3]
        # CUDA-core template: the smallest instance that holds the rows; tensor-core one: a single kernel
        rows = 1 << max(0, group * seq_q - 1).bit_length()
        main = next((symbol for symbol in plan.symbols if symbol.endswith(f"_r{rows}")), plan.symbols[0])
        combine = plan.symbols[-1]
        # a latent cache's decode kernel takes the group's rows in chunks of block_r (one block per chunk)
        chunks = math.ceil(group * seq_q / plan.block_r) if self.spec.latent_kv else 1
        base = batch * (heads // group) * chunks
        splits = decode_splits(base, math.ceil(seq_k / plan.block_c), self.target.sm_count,
                               max(1, self.target.smem_per_block // max(plan.smem_bytes, 1)))
        workspaces = ((batch, heads, seq_q, splits, plan.head_dim), (batch, heads, seq_q, splits))
        like = tensors["q"]
        for name, workspace_shape in zip(("o_accum", "row_max"), workspaces):
            workspace = _allocate(like, workspace_shape, "fp32", stream)
            keep.append(workspace)
            args[name] = as_device_tensor(name, workspace).pointer
        args["row_groups"] = splits
        launches = [(main, problem_grid(splits, base, args), plan.threads, plan.smem_bytes),
                    (combine, (batch * heads * seq_q, 1, 1), 128, 0)]
        arguments = args.packed()
        for symbol, grid, threads, smem in launches:
            self._launch(device, symbol, arguments, grid, threads, smem, stream)
        self._finish(main, device)
        if signature is not None:
            names, _ = self._runtime_pointers(given)
            self._remember(self._fast_forward, signature, args, ("q", "k", "v", "o", "lse", "o_accum", "row_max")
                           + (("block_table",) if given.paged is not None else ()) + names, launches, device,
                           workspaces)
        del keep
        return o, lse

    # ---- backward ----
    def backward(self, q, k, v, o, lse, do, *, kv_lengths=None, block_mask=None, inputs=None, seed: int = 0,
                 offset: int = 0, out=None, stream=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, input_grads: bool = False, d_lse=None):
        """(dq, dk, dv) in the input's dtype, from the forward's o and lse and the output gradient do.

        `d_lse`: the gradient of the loss with respect to the forward's lse, where the loss reads lse too (a merge
        of partial attentions by their LSE, a sink logit in the softmax's denominator): fp32, lse's shape, dense.
        It adds d_lse_i * P_ij to each score's gradient (d lse_i / d s_ij = P_ij). None: lse did not reach the loss.

        `input_grads`: also the gradients of the score_mod's float tensor inputs (`inputs`) that it depends
        on, as a fourth item {name: float32 array of the input's shape} (Modifiers.kernel_input_grads). They
        are summed with float atomics, so their last bits may differ between runs, as dQ's do."""
        given = CallInputs(kv_lengths, block_mask, inputs, seed, offset)
        if input_grads:   # the full path (the fast path's FastCall has no slot for these outputs)
            grad_out = {}
            if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
                grads = self._backward_packed(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, given, out, stream, grad_out, d_lse=d_lse)
            else:
                grads = self._backward(q, k, v, o, lse, do, given, out, stream, None, grad_out, d_lse)
            if not grad_out:   # a packed batch with nothing to compute: zeros
                like = as_device_tensor("q", q)
                if stream is not None and like.is_torch:
                    with _caller_stream(like, stream):
                        self._input_grad_outputs(grad_out, None, inputs, like, None)
                else:
                    self._input_grad_outputs(grad_out, None, inputs, like, self._stream({"q": like}, stream)[1])
            return (*grads, grad_out)
        if self._is_packed_call(cu_seqlens_q, cu_seqlens_k):
            return self._packed_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         given, out, stream, d_lse)[0]
        return self._padded_backward(q, k, v, o, lse, do, given, out, stream, d_lse)[0]

    def _padded_backward(self, q, k, v, o, lse, do, given: CallInputs, out, stream, d_lse=None) -> tuple:
        """((dq, dk, dv), the call's fast-path signature or None) of a (batch, heads, seq, d) call."""
        signature = None
        if out is None and stream is None and "backward" in self.plans:
            # (d_lse's shape and strides in the key: a call with it remembers a launch with its pointer slot)
            signature = self._signature("backward", (q, k, v, o, lse, do) if d_lse is None else (q, k, v, o, lse, do, d_lse),
                                        (q, k, v, do), given)
            call = self._fast_backward.get(signature) if signature is not None else None
            if call is not None:
                return self._fast_backward_call(call, q, k, v, o, lse, do, given, d_lse=d_lse), signature
        return self._backward(q, k, v, o, lse, do, given, out, stream, signature, d_lse=d_lse), signature

    @staticmethod
    def _d_lse_pointer(d_lse, lse: DeviceTensor) -> int:
        """The pointer of d_lse (backward's `d_lse`), checked against the lse it is the gradient of; 0 for None."""
        if d_lse is None:
            return 0
        held = as_device_tensor("d_lse", d_lse)
        if held.shape != lse.shape or held.dtype != "fp32" or tuple(held.strides) != tuple(lse.strides):
            raise ArgumentError(f"d_lse: expected a dense fp32 tensor of lse's shape {tuple(lse.shape)} (the gradient of "
                                f"the loss with respect to lse), got {held.dtype} of shape {tuple(held.shape)} and strides "
                                f"{tuple(held.strides)}")
        return held.pointer

    def _backward(self, q, k, v, o, lse, do, given: CallInputs, out, stream, signature,
                  input_grad_out: Optional[dict] = None, d_lse=None):
        """The full backward path; `given.sequences` as in `_forward`; `input_grad_out`: a dict that receives
        score_mod's input gradients (see `backward`), or None."""
        plan = self._pass("backward")
        tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        if stream is not None and tensors["q"].is_torch:
            with _caller_stream(tensors["q"], stream):
                return self._backward(q, k, v, o, lse, do, given, out, None, signature, input_grad_out, d_lse)
        sequences = given.sequences
        device, stream = self._stream(tensors, stream)
        batch, heads, seq_q, seq_k = shape
        problems = shape if sequences is None else (sequences.count, heads, max(1, sequences.max_q), max(1, sequences.max_k))
        if plan.stages > 1 and self._chunked_rows:  # cp.async moves 16-byte chunks of Q, dO, K, V
            q, k, v, do = (self._aligned(tensors[name], 16) for name in ("q", "k", "v", "d_o"))
            tensors, shape = self._check_qkv(q, k, v, {"o": o, "d_o": do})
        lt = as_device_tensor("lse", lse)
        if lt.shape != (batch, heads, seq_q) or lt.dtype != "fp32" or tuple(lt.strides) != (heads * seq_q, seq_q, 1):
            raise ArgumentError(f"lse: expected the forward's contiguous fp32 lse of shape {(batch, heads, seq_q)}")
        d_lse_pointer = self._d_lse_pointer(d_lse, lt)
        if out is None:
            grads = tuple(_allocate(tensors[key], tensors[key].shape, self.spec.dtype, stream) for key in ("q", "k", "v"))
        else:
            grads = tuple(out)
        args = self._base_args(tensors, shape)
        args["o"], args["d_o"], args["lse"] = tensors["o"].pointer, tensors["d_o"].pointer, lt.pointer
        args["d_lse"] = d_lse_pointer
        args["o_stride"] = tensors["o"].strides[:3]
        args["do_stride"] = tensors["d_o"].strides[:3]
        kv_heads = tensors["k"].shape[1]
        grouped = kv_heads != heads
        key_blocks = math.ceil(problems[3] / plan.block_c)
        folded = grouped and self._folds(plan, problems[0] * kv_heads * key_blocks)
        args["fold_heads"] = heads // kv_heads if folded else 1
        summed = grouped and not folded   # dK, dV per query head into a workspace, then _kv_group_sum
        keep = []
        for key, grad, like in zip(("dq", "dk", "dv"), grads, ("q", "k", "v")):
            gt = as_device_tensor(key, grad)
            if gt.shape != tensors[like].shape or gt.dtype != self.spec.dtype or gt.strides[3] != 1:
                raise ArgumentError(f"out {key}: expected {self.spec.dtype} of shape {tensors[like].shape}")
            if plan.tensor_cores and self._pair_stores and (gt.pointer % 4 or any(stride % 2 for stride in gt.strides[:3])):
                raise ArgumentError(f"out {key}: rows must start on 4-byte boundaries (even strides, aligned pointer)")
            if summed and key != "dq":
                # Grouped KV heads: the main kernel writes each query head's dK, dV into a dense
                # (batch, heads, seq_k, d) workspace; _kv_group_sum adds each group into the output.
                # (zeroed for packed batches: keys outside every sequence are summed too, and must add 0)
                workspace = _allocate(tensors["k"], (batch, heads, seq_k, tensors[like].shape[3]), self.spec.dtype, stream,
                                      zero=sequences is not None and not sequences.covers_k)
                keep.append(workspace)
                wt = as_device_tensor(key, workspace)
                args[f"{key}_sum"], args[f"{key}_sum_stride"] = gt.pointer, gt.strides[:3]
                args[key], args[f"{key}_stride"] = wt.pointer, wt.strides[:3]
            else:
                args[key] = gt.pointer
                args[f"{key}_stride"] = gt.strides[:3]
        keep += self._runtime_args(args, tensors, problems, given, stream)
        if input_grad_out is not None:
            self._input_grad_outputs(input_grad_out, args, given.inputs, tensors["q"], stream)
        if sequences is not None and not sequences.has_work:   # dq, dk, dv arrive zeroed
            return grads
        main = plan.symbols[0]
        rows = batch * heads * seq_q
        size, dq_accum_at = backward_scratch(rows, plan.head_dim, self.spec.deterministic)
        scratch = _allocate(tensors["q"], (size,), "fp32", stream)
        keep.append(scratch)
        args["delta"] = base = as_device_tensor("scratch", scratch).pointer
        if dq_accum_at:
            args["dq_accum"] = base + 4 * dq_accum_at
        grid = self._blocks_grid(plan, key_blocks, problems[0] * (kv_heads if folded else heads), args)
        # _delta also writes the mask_mod inputs' summaries, where there are any, before the main kernel reads them:
        # at least the summary kernel's grid, whose entries follow the inputs' lengths, not the query rows (a few
        # query rows over a long key-side input)
        delta_grid = row_pass_grid(rows)
        if self.modifiers.summaries:
            delta_grid = (max(delta_grid[0], SUMMARY_GRID[0]), 1, 1)
        launches = [(main + "_delta", delta_grid, 256, 0), (main, grid, plan.threads, plan.smem_bytes)]
        if self.spec.deterministic:
            launches.append((main + "_dq", problem_grid(math.ceil(problems[2] / plan.block_r), problems[0] * heads, args),
                             plan.threads, plan.smem_bytes))
        else:
            launches.append((main + "_dq_convert", row_pass_grid(rows), 256, 0))
        if summed:
            launches.append((main + "_kv_group_sum", row_pass_grid(batch * kv_heads * seq_k), 256, 0))
        geometries = None   # the TMA's maps of q, k, v, dO where the main kernel takes them
        if plan.tensor_map_columns:
            geometries = kernel_geometries(self.spec.dtype, ELEMENT_BYTES[self.spec.dtype], tensors,
                                           plan.tensor_map_columns, plan.block_r, plan.block_c)
            maps = TensorMapParameter(geometries)
            maps.encode([tensors[name].pointer for name in ("q", "k", "v", "d_o")])
            keep.append(maps)
        arguments = args.packed(maps.address if geometries is not None else None)   # after problem_grid set args["problems"]
        functions = self._load_input_grad_backward(device) if input_grad_out is not None else None
        for symbol, grid, threads, smem in launches:
            self._launch(device, symbol, arguments, grid, threads, smem, stream, functions)
        self._finish(main, device)
        if signature is not None:
            names, _ = self._runtime_pointers(given)
            if sequences is not None:
                names = ("cu_seqlens_q", "cu_seqlens_k") + names
            workspaces = ("delta",) if self.spec.deterministic else ("delta", "dq_accum")
            outputs = ("dq", "dk_sum", "dv_sum", "dk", "dv") if summed else ("dq", "dk", "dv")
            summaries = self._summary_workspaces(args) if self.modifiers.summaries else []
            self._remember(self._fast_backward, signature, args,
                           ("q", "k", "v", "o", "d_o", "lse") + (("d_lse",) if d_lse_pointer else ()) + outputs + workspaces
                           + tuple(slot for slot, _ in summaries) + names, launches, device,
                           tuple(shape for _, shape in summaries), folded, geometries)
        del keep
        return grads

