"""CPU tests of fagen/runtime/'s host-side decisions (the GPU paths: tests/test_runtime_gpu.py,
tests/test_torch_gpu.py, tests/test_decode_gpu.py)."""
import math

import pytest

from fagen.runtime import ArgumentError, LaunchPlan, decode_splits
from fagen.runtime.grids import ALL_PROBLEMS, GRID_YZ_LIMIT, GROUPED_TEMPLATES, block_group, grouped_grid, problem_grid
from fagen.solver import solve
from fagen.spec import Spec


@pytest.mark.parametrize("base", [1, 8, 32, 64, 256, 1024])
@pytest.mark.parametrize("sm_count, per_sm", [(132, 3), (108, 2), (132, 1)])
def test_decode_splits_fill_the_resident_slots_evenly(base, sm_count, per_sm):
    slots = sm_count * per_sm
    splits = decode_splits(base, key_tiles=512, sm_count=sm_count, blocks_per_sm=per_sm)
    waves = base * splits / slots
    fill = waves / math.ceil(waves)
    # no count up to the search bound fills the slots more than 3% better
    bound = min(256, 512, 4 * math.ceil(slots / base))
    best = max((base * s / slots) / math.ceil(base * s / slots) for s in range(1, bound + 1))
    assert 1 <= splits <= bound and fill >= 0.97 * best


def test_decode_splits_prefer_fewer_splits_and_respect_the_key_tiles():
    assert decode_splits(8, key_tiles=128, sm_count=132, blocks_per_sm=3) == 49   # one wave, not two
    assert decode_splits(256, key_tiles=128, sm_count=132, blocks_per_sm=3) == 3  # 1.94 waves, not 1.29
    assert decode_splits(8, key_tiles=2, sm_count=132, blocks_per_sm=3) == 2      # a split needs a tile of keys
    assert decode_splits(10_000, key_tiles=64, sm_count=132, blocks_per_sm=3) >= 1


# ---- the launch struct's layout ----------------------------------------------------------------
def test_args_struct_matches_attention_args(tmp_path):
    """fagen/runtime/arguments.py packs AttentionArgs by hand: every field's offset and the total size must be
    what the C++ compiler lays out (a host program built by nvcc prints them; no GPU needed)."""
    import subprocess

    from fagen.compiler import nvcc_path
    from fagen.runtime.arguments import ARGS_STRUCT, _FIELDS, _SLOT
    from fagen.sources import TEMPLATE_DIR

    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc is not available")
    names = {"do_stride": "do_stride", "d_o": "d_o"}
    fields = [names.get(name, name) for name, _, _ in _FIELDS]
    lines = "\n".join(f'  printf("{name} %zu\\n", offsetof(fagen::AttentionArgs, {name}));' for name in fields)
    source = tmp_path / "layout.cu"
    source.write_text(f'#include <cstddef>\n#include <cstdio>\n#include "attention_common.cuh"\n'
                      f'int main() {{\n{lines}\n  printf("size %zu\\n", sizeof(fagen::AttentionArgs));\n}}\n')
    binary = tmp_path / "layout"
    subprocess.run([nvcc, "-std=c++17", "-I", str(TEMPLATE_DIR), "-o", str(binary), str(source)], check=True,
                   capture_output=True)
    reported = dict(line.split() for line in subprocess.run([str(binary)], capture_output=True, text=True,
                                                             check=True).stdout.splitlines())
    assert int(reported.pop("size")) == ARGS_STRUCT.size
    assert {name: int(offset) for name, offset in reported.items()} == {name: 8 * _SLOT[name][0] for name in fields}


def test_launch_args_pack_scalars_as_doubles():
    import struct

    from fagen.runtime.arguments import ARGS_STRUCT, _SLOT, LaunchArgs

    args = LaunchArgs()
    args["mod_scalar"] = [30.0, -0.5, 1e-3, 2]
    args["mod_stride"] = [-3, 0, 1, 2, 3, 4, 5, 6]
    raw = bytearray(ARGS_STRUCT.size)
    ARGS_STRUCT.pack_into(raw, 0, *args.values)
    start = 8 * _SLOT["mod_scalar"][0]
    assert struct.unpack_from("<4d", raw, start) == (30.0, -0.5, 1e-3, 2.0)
    assert struct.unpack_from("<q", raw, 8 * _SLOT["mod_stride"][0])[0] == -3


@pytest.mark.parametrize("problems", [1, 7, 65535, 65536, 70001, 131070, 131071, 10**6, 65535 ** 2])
def test_problem_grid_folds_the_pairs_over_z_within_the_limits(problems):
    """(sequence, head) pairs past what grid.y holds fold over z; the kernels skip the spare blocks of
    the last z slice (templates/attention_common.cuh exit_if_spare), so y * z covers every pair with
    fewer than one slice to spare, and args["problems"] tells the kernels where the pairs end."""
    args = {}
    x, y, z = problem_grid(5, problems, args)
    assert x == 5 and args["problems"] == problems
    assert 1 <= y <= GRID_YZ_LIMIT and 1 <= z <= GRID_YZ_LIMIT
    assert problems <= y * z < problems + z
    assert z == 1 if problems <= GRID_YZ_LIMIT else z == math.ceil(problems / GRID_YZ_LIMIT)


def test_problem_grid_beyond_what_y_and_z_hold_is_a_clear_error():
    with pytest.raises(ArgumentError, match="pairs in one call"):
        problem_grid(1, GRID_YZ_LIMIT ** 2 + 1, {})


@pytest.mark.parametrize("blocks, problems, group", [(32, 64, 16), (32, 70, 16), (7, 3, 16), (1, 1, 4),
                                                    (5, 16 * GRID_YZ_LIMIT + 1, 16), (2, GRID_YZ_LIMIT ** 2, 4)])
def test_grouped_grid_covers_every_block_of_every_pair_in_group_order(blocks, problems, group):
    """x = a pair of the group, y = the block, z = the group (templates/attention_common.cuh
    grouped_problem = z * gridDim.x + x): every (pair, block) exactly once, spare pairs only in the last
    group, and groups of `group` unless z would exceed what it holds."""
    args = {}
    x, y, z = grouped_grid(blocks, problems, group, args)
    assert args["problems"] == problems and y == blocks
    assert 1 <= x and 1 <= z <= GRID_YZ_LIMIT
    assert problems <= x * z < problems + x
    assert x == min(problems, max(group, math.ceil(problems / GRID_YZ_LIMIT)))
    if problems * blocks <= 10_000:   # the kernels' mapping, in dispatch order (x fastest)
        order = [(gz * x + gx, gy) for gz in range(z) for gy in range(y) for gx in range(x) if gz * x + gx < problems]
        assert sorted(order) == [(p, b) for p in range(problems) for b in range(blocks)]
        # within a group, every pair's block b starts before any pair's block b + 1
        first_group = [b for p, b in order[: x * y]]
        assert first_group == sorted(first_group)


def test_grouped_grid_refuses_more_blocks_than_y_holds():
    with pytest.raises(ArgumentError, match="blocks of one"):
        grouped_grid(GRID_YZ_LIMIT + 1, 4, 4, {})


@pytest.mark.parametrize("spec_fields, grouped", [({"head_dim": 128, "dtype": "bf16", "mask": "causal"}, True),
                                                  ({"head_dim": 64, "dtype": "fp16", "arch": "sm_80"}, False)])
def test_launch_plans_know_their_template(spec_fields, grouped):
    """The runtime picks each launch's grid layout by the plan's template (a record the solver wrote)."""
    solution = solve(Spec(**spec_fields))
    for name, plan in solution.plans.items():
        launch = LaunchPlan.from_plan(plan.to_dict(), ("kernel",), 64, False)
        assert launch.template == plan.template
        assert (launch.template in GROUPED_TEMPLATES) == grouped


def test_block_groups_follow_the_mask():
    assert block_group(Spec(head_dim=64, mask="causal")) == 16
    windowed = {"sliding_window": {"window": 128}, "block_sparse": {"block_size": 64}}
    assert {block_group(Spec(head_dim=64, mask=m, **windowed.get(m, {})))
            for m in ("none", "sliding_window", "padding", "block_sparse")} == {1}
    prefix_lm = Spec(head_dim=64, mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"})
    assert block_group(prefix_lm) == 16   # a mask_mod counts as causal-like
    # a band of keys plus fixed ones (window + sinks): few heavy blocks per problem, all problems' first
    sinks = Spec(head_dim=64, mask_mod="j <= i and (i - j < 256 or j < 4)")
    assert block_group(sinks) == ALL_PROBLEMS
    assert grouped_grid(16, 64, block_group(sinks), {})[0] == 64   # one group of every problem
    for triangle in ("j <= i", "(i - j) % 4 == 0", "j < 300 or j <= i"):   # triangles, a lattice, a prefix: many
        assert block_group(Spec(head_dim=64, mask_mod=triangle)) == 16, triangle
    documents = Spec(head_dim=64, mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
    assert block_group(documents) == 16   # decided by run-time values: not known to be a band
    assert set(GROUPED_TEMPLATES) == {"forward_wgmma.cu.j2", "forward_wgmma_ws.cu.j2", "backward_wgmma.cu.j2",
                                      "backward_wgmma_ws.cu.j2", "backward_wgmma_wide.cu.j2"}


def test_fast_path_keys_return_none_for_arrays_that_are_not_torch_tensors():
    """PyCUDA / __cuda_array_interface__ arrays take the full call path: the fast path's keys give up on
    them before importing torch, which such a user may not have installed."""
    from fagen.runtime import Kernel
    from fagen.runtime.call_inputs import CallInputs

    class Array:
        __cuda_array_interface__ = {"shape": (1, 1, 8, 64), "typestr": "<f2", "data": (256, False), "version": 3}

    array = Array()
    assert Kernel._signature(object(), "forward", (array, array, array), (), CallInputs()) is None
    assert Kernel._paged_signature(object(), array, array, array, array, CallInputs()) is None


def test_call_inputs_default_to_no_run_time_inputs_and_replace_keeps_the_others():
    """CallInputs, the run-time inputs handed down Kernel's private call chain: a call that passes none has
    none (seed and offset 0), and the packed and paged paths' `_replace` adds their part and keeps the call's."""
    from fagen.runtime.call_inputs import CallInputs

    assert CallInputs() == (None, None, None, 0, 0, None, None, None)
    assert CallInputs()._fields == ("kv_lengths", "block_mask", "inputs", "seed", "offset", "sequences", "paged",
                                    "descales")
    given = CallInputs([3, 5], "mask", {"bias": 1.5}, 7, 2)
    packed = given._replace(sequences="sequences")
    assert packed == CallInputs([3, 5], "mask", {"bias": 1.5}, 7, 2, sequences="sequences")
    assert packed._replace(paged=("fields", "table")) == (*given[:5], "sequences", ("fields", "table"), None)
    assert given.sequences is None and given.paged is None   # (a new tuple: the call's own is unchanged)


def test_a_paged_cache_with_mismatched_layout_arguments_is_refused_before_anything_runs():
    """block_table (a paged K/V cache): a padded spec takes padded q (cu_seqlens with it get a clear error at
    once, not the packed path); a packed spec needs cu_seqlens_q and cu_seqlens_k (packed rows against pages);
    a packed spec whose forward kernel does not read pages says which ones do."""
    from types import SimpleNamespace

    from fagen.runtime import Kernel, LaunchPlan
    from fagen.runtime.call_inputs import CallInputs

    padded = SimpleNamespace(spec=Spec(head_dim=64, dtype="bf16", mask="padding", passes=["forward", "decode"]))
    with pytest.raises(ArgumentError, match="takes a layout packed spec"):
        Kernel.forward(padded, None, None, None, block_table=[[0]], cu_seqlens_q=[0, 1])
    packed = SimpleNamespace(spec=Spec(head_dim=64, dtype="bf16", mask="causal", layout="packed"))
    with pytest.raises(ArgumentError, match="pass cu_seqlens_q"):
        Kernel.forward(packed, None, None, None, block_table=[[0]])
    for template in ("forward_fa2_simt.cu.j2", "forward_fa1_simt.cu.j2", "forward_fa2_mma.cu.j2"):
        plan = LaunchPlan(("f",), 64, 64, 128, 0, 2, False, 64, template, template.split(".")[0], False)
        packed = SimpleNamespace(spec=Spec(head_dim=64, dtype="fp32", mask="causal", layout="packed"),
                                 _pass=lambda name: plan)
        with pytest.raises(ArgumentError, match="does not read paged K/V caches; Hopper's warpgroup-MMA"):
            Kernel._forward_paged_packed(packed, None, None, None, [[0]], [0, 1], [0, 1], None, None, CallInputs(),
                                         None, None)


def test_backward_scratch_holds_delta_then_an_aligned_dq_accum():
    """One fp32 allocation per backward: D_i first, dq_accum from the next 256-byte boundary (its rows are
    cleared by the _delta kernel and written with vector atomics); deterministic plans have no dq_accum."""
    from fagen.runtime import backward_scratch

    for rows, head_dim in ((1, 64), (63, 64), (64, 128), (65, 256), (3 * 257, 40)):
        size, at = backward_scratch(rows, head_dim, deterministic=False)
        assert at >= rows and at * 4 % 256 == 0, (rows, at)
        assert size == at + rows * head_dim
    assert backward_scratch(100, 64, deterministic=True) == (100, 0)


def test_forward_keyed_checks_the_layout_as_forward_does():
    """The autograd path's forward (Kernel.forward_keyed) routes through forward's layout check: a packed spec
    without cu_seqlens gets forward's one-line error, not the padded fast path. (No GPU: the check runs first.)"""
    from fagen.runtime import Kernel

    kernel = object.__new__(Kernel)
    kernel.spec = Spec(head_dim=64, dtype="bf16", layout="packed")
    with pytest.raises(ArgumentError, match="has layout packed: pass cu_seqlens_q and cu_seqlens_k"):
        kernel.forward_keyed(None, None, None)
    kernel.spec = Spec(head_dim=64, dtype="bf16")
    with pytest.raises(ArgumentError, match="are for specs with layout packed"):
        kernel.forward_keyed(None, None, None, cu_seqlens_q=[0, 4], cu_seqlens_k=[0, 4])


def test_grouped_backward_folds_only_foldable_specs_on_folding_templates_with_enough_blocks():
    """Kernel._folds: a block per (sequence, K/V head) pair and key block walking the group's query heads only on
    FOLDING_TEMPLATES, for Spec.kv_group_foldable specs (a mask_mod not reading h on 64- or 128-row blocks), where that
    grid has FOLD_WAVES blocks per multiprocessor (MQA with 64 blocks on 132 SMs ran 3.4x slower folded). No GPU:
    the rule reads the plan, spec and target."""
    from types import SimpleNamespace

    from fagen.runtime import Kernel
    from fagen.runtime.grids import FOLD_WAVES
    from fagen.sources import FOLDING_TEMPLATES, folds_kv_group

    target = SimpleNamespace(sm_count=132)
    ws, ws_64_rows = (SimpleNamespace(template=FOLDING_TEMPLATES[0], block_r=rows) for rows in (128, 64))   # (d <= 64, 72-128)
    other = SimpleNamespace(template="backward_wgmma.cu.j2", block_r=64)
    foldable = SimpleNamespace(spec=Spec(head_dim=64, dtype="bf16", mask="causal"), target=target)
    dropout = SimpleNamespace(spec=Spec(head_dim=64, dtype="bf16", mask="causal", dropout=0.1), target=target)
    documents = SimpleNamespace(spec=Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]",
                                          inputs={"doc": "int32"}), target=target)
    per_head = SimpleNamespace(spec=Spec(head_dim=128, dtype="bf16", mask_mod="i - j < window[h]",
                                         inputs={"window": "int32"}), target=target)
    enough = FOLD_WAVES * 132

    def folds(kernel, plan, blocks):   # the build's record of the kernel (folds_kv_group), then the runtime's rule
        return Kernel._folds(kernel, SimpleNamespace(folds_heads=folds_kv_group(kernel.spec, plan)), blocks)

    assert folds(foldable, ws, enough)
    assert not folds(foldable, ws, enough - 1)
    assert not folds(foldable, other, 10 * enough)
    assert not folds(dropout, ws, 10 * enough)
    assert folds(documents, ws_64_rows, enough)          # the same mask in every head of the group
    assert folds(documents, ws, enough)                   # 128-row blocks too (8 B spilled, still faster)
    assert not folds(per_head, ws_64_rows, 10 * enough)  # a mask that reads h


def test_fills_are_queued_in_the_devices_context_and_give_the_callers_back(monkeypatch):
    """runtime._fill (the fast paths' cuMemsets) issues its memset between enter_device and leave_device when it
    knows the memory's device (torch tensors), gives the caller's context back when the memset fails too, and
    leaves the context alone for PyCUDA arrays (device None, memory of the current context). No GPU: stand-ins."""
    from fagen import cuda_driver as driver
    from fagen.runtime import device as runtime

    calls = []

    def memset(pointer, value, count, stream):
        calls.append(("memset", pointer, value, count, stream))
        if pointer == 0:
            raise driver.CudaError(1, "invalid value")

    monkeypatch.setattr(driver, "memset_d8", memset)
    monkeypatch.setattr(driver, "memset_d32", memset)
    monkeypatch.setattr(driver, "enter_device", lambda device: calls.append(("enter", device)) or 1000)
    monkeypatch.setattr(driver, "leave_device", lambda previous: calls.append(("leave", previous)))
    runtime._fill(4096, 8, 16, 7, zero=True, device=1)
    assert calls == [("enter", 1), ("memset", 4096, 0, 16, 7), ("leave", 1000)]
    calls.clear()
    runtime._fill(4096, 8, 32, 7, fill=float("-inf"), device=1)   # fp32 -inf: its bit pattern, 8 elements
    assert calls == [("enter", 1), ("memset", 4096, 0xFF800000, 8, 7), ("leave", 1000)]
    calls.clear()
    with pytest.raises(driver.CudaError):
        runtime._fill(0, 8, 16, 7, zero=True, device=1)
    assert calls == [("enter", 1), ("memset", 0, 0, 16, 7), ("leave", 1000)]
    calls.clear()
    runtime._fill(4096, 8, 16, 7, zero=True)   # a PyCUDA array: its memory is the current context's
    assert calls == [("memset", 4096, 0, 16, 7)]
    calls.clear()
    runtime._fill(4096, 8, 16, 7, device=1)        # nothing to fill: no call
    assert calls == []


def test_fills_of_torch_tensors_run_on_the_given_stream_or_torchs_current_one(monkeypatch):
    """runtime._filled: a torch tensor's cuMemset goes to the stream the call runs on; a caller that passes none
    (it runs under torch's current stream, _caller_stream) gets torch's current stream of the tensor's device, not
    the legacy default stream, which torch's own streams do not wait for. No GPU: stand-ins for the tensor, the
    driver and torch's stream getter."""
    from types import SimpleNamespace

    from fagen import cuda_driver as driver
    from fagen.runtime import device as runtime

    calls = []
    monkeypatch.setattr(driver, "memset_d8", lambda pointer, value, nbytes, stream: calls.append((pointer, nbytes, stream)))
    monkeypatch.setattr(driver, "enter_device", lambda device: None)
    monkeypatch.setattr(driver, "leave_device", lambda previous: None)
    monkeypatch.setattr(runtime, "_torch_types", lambda: {"stream": lambda device: 1000 + device})
    tensor = SimpleNamespace(data_ptr=lambda: 4096, numel=lambda: 6, element_size=lambda: 2, get_device=lambda: 3)
    assert runtime._filled(tensor, 77, zero=True) is tensor
    assert runtime._filled(tensor, None, zero=True) is tensor
    runtime._filled(tensor, None)   # nothing to fill
    assert calls == [(4096, 12, 77), (4096, 12, 1003)]


def test_kernel_functions_are_looked_up_in_the_devices_context(monkeypatch):
    """Kernel._module_functions: the modules are loaded and their functions looked up (cuModuleGetFunction, the
    shared-memory attribute) inside driver.on_device, the functions belonging to the module's context. No GPU:
    stand-ins for the driver calls."""
    import contextlib
    from types import SimpleNamespace

    from fagen import cuda_driver as driver
    from fagen import runtime

    events = []

    @contextlib.contextmanager
    def on_device(device):
        events.append(("enter", device))
        yield
        events.append(("leave", device))

    monkeypatch.setattr(driver, "on_device", on_device)
    monkeypatch.setattr(driver, "load_module", lambda cubin: events.append(("load", cubin)) or 7)
    monkeypatch.setattr(driver, "get_function", lambda module, symbol, smem: events.append(("get", symbol, smem)) or 9)
    kernel = SimpleNamespace(plans={"backward": SimpleNamespace(symbols=("main", "main_delta"), smem_bytes=99000)})
    assert runtime.Kernel._module_functions(kernel, 1, {"backward": b"cubin"}) == {"main": 9, "main_delta": 9}
    assert events == [("enter", 1), ("load", b"cubin"), ("get", "main", 99000), ("get", "main_delta", 0), ("leave", 1)]


def test_device_target_reads_the_driver_once_per_device(monkeypatch):
    """runtime.device_target: the driver's attributes (fagen.cuda_driver) made into a Target by fagen.target,
    which never touches the driver itself; remembered per device."""
    from fagen import cuda_driver
    from fagen.runtime import device as runtime

    calls = []
    attributes = {"cc_major": 9, "cc_minor": 0, "smem_per_block": 232448, "smem_per_sm": 233472,
                  "registers_per_sm": 65536, "max_threads_per_sm": 2048, "sm_count": 132, "name": "a GPU"}
    monkeypatch.setattr(cuda_driver, "device_attributes", lambda index: calls.append(index) or attributes)
    monkeypatch.setattr(runtime, "_targets", {})
    target = runtime.device_target(7)
    assert (target.arch, target.sm_count, target.smem_per_block, target.name) == ("sm_90", 132, 232448, "a GPU")
    assert runtime.device_target(7) is target and calls == [7]


def test_outputs_of_a_narrower_value_head_dim_keep_qs_memory_order():
    """o of (batch, heads, seq, dv) for q viewed from (batch, seq, heads, d) activations: transposing back is free."""
    torch = pytest.importorskip("torch")
    from fagen.runtime.device import empty_in_layout

    q = torch.randn(2, 100, 8, 192).transpose(1, 2)
    o = empty_in_layout(q, (2, 8, 100, 128))
    assert o.shape == (2, 8, 100, 128) and o.transpose(1, 2).is_contiguous()
    assert empty_in_layout(torch.randn(2, 8, 10, 64), (2, 8, 10, 32)).is_contiguous()


def test_descale_slots_follow_the_struct_and_take_one_pointer_each():
    from fagen.runtime.arguments import _SLOT

    start, count = _SLOT["descale"]
    assert count == 3 and [_SLOT[f"descale{n}"] for n in range(3)] == [(start + n, 1) for n in range(3)]
    assert _SLOT["descale_stride"] == (start + 3, 6)


def test_a_latent_call_takes_v_from_k_and_names_what_it_refuses():
    """Kernel._latent_values (latent_kv specs): v is a view of k's first value_head_dim columns; a v given, a k of the
    wrong width or rank, and a k that is not a torch tensor are refused by name; the autograd path refuses the spec.
    (No GPU: the checks run before any launch.)"""
    torch = pytest.importorskip("torch")
    import numpy as np

    from fagen.runtime import Kernel

    kernel = object.__new__(Kernel)
    kernel.spec = Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", mask="padding")
    k = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    v = kernel._latent_values(k, None)
    assert v.shape == (2, 1, 64, 512) and v.stride() == k.stride() and v.data_ptr() == k.data_ptr()
    with pytest.raises(ArgumentError, match="pass v=None"):
        kernel._latent_values(k, v)
    with pytest.raises(ArgumentError, match="last is head_dim 576"):
        kernel._latent_values(k[..., :512], None)
    with pytest.raises(ArgumentError, match="last is head_dim 576"):
        kernel._latent_values(k[0], None)
    with pytest.raises(ArgumentError, match="from a torch tensor k"):
        kernel._latent_values(np.zeros((2, 1, 64, 576), np.float16), None)
    with pytest.raises(ArgumentError, match="fagen.attention and autograd do not take yet"):
        kernel.forward_keyed(torch.zeros(2, 16, 1, 576, dtype=torch.bfloat16), k, v)


# ---- TMA tensor maps: tests/test_tensor_maps.py; the plans that take them ----
def test_plans_of_the_tma_kernels_carry_their_box_columns():
    from fagen.runtime.grids import LaunchPlan
    from fagen.target import target_for

    sm90, sm80 = target_for("sm_90"), target_for("sm_80")
    bf16 = solve(Spec(head_dim=128, dtype="bf16", mask="causal"), sm90).plans["forward"]
    fp8 = solve(Spec(head_dim=128, dtype="fp8_e4m3", mask="causal"), sm90).plans["forward"]
    assert (bf16.family, bf16.tensor_map_columns) == ("forward_wgmma_ws", 64)
    assert (fp8.family, fp8.tensor_map_columns) == ("forward_wgmma_ws_fp8", 128)
    assert solve(Spec(head_dim=64, dtype="bf16"), sm90).plans["forward"].tensor_map_columns == 0
    assert solve(Spec(head_dim=128, dtype="bf16"), sm80).plans["forward"].tensor_map_columns == 0
    launch = LaunchPlan.from_plan(bf16.to_dict(), ["f"], 128, False)
    assert launch.tensor_map_columns == 64
    # the backward's: d = 96 in 64-byte panels of 32 columns
    for head_dim, columns in ((64, 64), (96, 32), (128, 64)):
        backward = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal"), sm90).plans["backward"]
        assert (backward.family, backward.tensor_map_columns) == ("backward_wgmma_ws", columns)
