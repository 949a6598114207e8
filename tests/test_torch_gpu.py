"""GPU tests of the torch integration: streams, CUDA graphs, torch.compile, the debug switch and the
disk cache seen from a fresh process.

Run on a GPU machine: python -m pytest -m gpu tests/test_torch_gpu.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent


def _torch():
    import torch

    return torch


def reference(q, k, v, causal: bool, scale: float):
    """float64 softmax(scale·QKᵀ [causal, bottom-right]) V."""
    torch = _torch()
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def rel(out, ref) -> float:
    out = out.double()
    assert not out.isnan().any(), "NaN in the output"
    return ((out - ref).norm() / ref.norm()).item()


SPEC_FIELDS = {"head_dim": 64, "dtype": "bf16", "mask": "causal"}
SPEC_STRING = json.dumps(SPEC_FIELDS)


@pytest.fixture(scope="module")
def spec():
    import fagen

    return fagen.Spec(**SPEC_FIELDS)


def _inputs(batch=2, heads=3, n=257, d=64, dtype=None, requires_grad=False):
    torch = _torch()
    dtype = dtype or torch.bfloat16
    return [torch.randn(batch, heads, n, d, device="cuda", dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def test_calls_run_on_the_callers_stream(spec):
    """Inputs written on a side stream behind a long matmul: a kernel on any other stream would read
    the NaN poison still in them."""
    import fagen

    torch = _torch()
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for trial in range(5):
        q, k, v = (torch.full((2, 3, 257, 64), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(3))
        sources = _inputs()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            for _ in range(3):
                big = (big @ big).clamp_(-1, 1)   # ~ms of work queued ahead of the copies
            for dst, src in zip((q, k, v), sources):
                dst.copy_(src)
            o = fagen.attention(q, k, v, spec)
        torch.cuda.synchronize()
        error = rel(o, reference(*sources, True, 64 ** -0.5))
        assert error < 1e-2, f"trial {trial}: relative error {error}"


def test_explicit_stream_argument(spec):
    import fagen

    torch = _torch()
    kernel = fagen.compile(spec)
    side = torch.cuda.Stream()
    q, k, v = _inputs()
    torch.cuda.synchronize()
    o, lse = kernel.forward(q, k, v, stream=side)
    side.synchronize()
    assert rel(o, reference(q, k, v, True, 64 ** -0.5)) < 1e-2


def test_cuda_graph_capture_and_replay_forward_and_backward(spec):
    """Capture fails if anything synchronises or allocates outside PyTorch's graph pool."""
    import fagen

    torch = _torch()
    q, k, v = _inputs(requires_grad=True)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up (compile, allocator) outside the capture
        for _ in range(2):
            fagen.attention(*static, spec).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fagen.attention(*static, spec)
        out.backward(grad_out)
    for trial in range(3):
        fresh = _inputs()
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
                dst.grad.fill_(float("nan"))   # poison: the replay must write every gradient
        graph.replay()
        torch.cuda.synchronize()
        leaves = [t.double().requires_grad_() for t in fresh]
        ref = reference(*leaves, True, 64 ** -0.5)
        ref.backward(grad_out.double())
        assert rel(out, ref.detach()) < 1e-2, f"replay {trial}: output"
        for name, t, leaf in zip("qkv", static, leaves):
            assert rel(t.grad, leaf.grad) < 2e-2, f"replay {trial}: d{name}"


@pytest.mark.parametrize("plain_ops", [False, True], ids=["ops", "plain ops"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph_matches_eager(spec, mode, plain_ops, monkeypatch):
    """(plain ops: fagen.torch.PLAIN_OPS, the ops of calls without run-time arguments)"""
    import fagen
    import fagen.torch as fagen_torch

    torch = _torch()
    monkeypatch.setattr(fagen_torch, "PLAIN_OPS", plain_ops)
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, dtype=torch.bfloat16, device="cuda")

        def forward(self, q, k, v):
            return self.proj(fagen.attention(q, k, v, SPEC_STRING)).float().square().mean()

    block = Block()
    eager_block = Block()
    eager_block.load_state_dict(block.state_dict())
    compiled = torch.compile(block, fullgraph=True, mode=mode)
    for trial in range(4):   # reduce-overhead records a graph on the 2nd/3rd call and replays after
        # A training step starts: outputs of earlier graph runs (the loss, parameter gradients) may be
        # reused, so nothing from the last step is kept; gradients start from None as in a training loop.
        torch.compiler.cudagraph_mark_step_begin()
        block.zero_grad(set_to_none=True)
        q, k, v = _inputs(requires_grad=True)
        loss = compiled(q, k, v)
        loss.backward()
        compiled_loss = loss.item()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        eager = eager_block(q, k, v)
        eager.backward()
        assert abs(compiled_loss - eager.item()) <= 1e-2 * abs(eager.item()) + 1e-6
        for name, g, t in zip("qkv", grads, (q, k, v)):
            assert rel(g, t.grad.double()) < 2e-2, f"trial {trial} d{name}"
    # A Spec object made outside the compiled function works too (folded in as a constant).
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: fagen.attention(q, k, v, spec), fullgraph=True)
    q, k, v = _inputs()
    assert rel(fn(q, k, v), reference(q, k, v, True, 64 ** -0.5)) < 1e-2


def test_op_is_differentiable_on_its_own():
    torch = _torch()
    import fagen.torch  # noqa: F401  (registers the ops)

    q, k, v = _inputs(requires_grad=True)
    o, lse = torch.ops.fagen.attention_forward(q, k, v, SPEC_STRING)
    o.float().sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, True, 64 ** -0.5).sum().backward()
    for name, t, leaf in zip("qkv", (q, k, v), leaves):
        assert rel(t.grad, leaf.grad) < 2e-2, name


def test_op_without_grad_reaches_dispatch_modes_and_runs_with_its_arguments():
    """attention_forward's Autograd kernel calls the CUDA kernel itself when no input requires grad and only
    CUDA is left below autograd; a dispatch mode (what fake tensors and functionalization are) must still see
    the op, and run-time arguments (kv_lengths here) must still reach the kernel on that shortcut."""
    torch = _torch()
    from torch.utils._python_dispatch import TorchDispatchMode

    import fagen
    import fagen.torch  # noqa: F401  (registers the ops)
    from fagen import reference as fagen_reference
    from fagen.testing import relative_error

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _inputs()
    want = reference(q, k, v, True, 64 ** -0.5)
    seen = Seen()
    with seen:
        o, _ = torch.ops.fagen.attention_forward(q, k, v, SPEC_STRING)
    assert "fagen.attention_forward.default" in seen.ops
    assert rel(o, want) < 1e-2
    o, _ = torch.ops.fagen.attention_forward(q, k, v, SPEC_STRING)   # the shortcut
    assert rel(o, want) < 1e-2
    padding = {**SPEC_FIELDS, "mask": "padding"}
    lengths = [100, 257]
    o, _ = torch.ops.fagen.attention_forward(q, k, v, json.dumps(padding),
                                             torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    as64 = [t.double().cpu().numpy() for t in (q, k, v)]
    want, _ = fagen_reference.attention_forward(*as64, fagen.Spec(**padding), kv_lengths=np.array(lengths))
    assert relative_error(o.double().cpu().numpy(), want) < 1e-2


def test_opcheck_of_the_forward_ops():
    """torch.library.opcheck: the schema, the autograd registration and the fake implementation agree with
    what the op does on real tensors."""
    torch = _torch()
    import fagen.torch  # noqa: F401  (registers the ops)

    for op in (torch.ops.fagen.attention_forward.default, torch.ops.fagen.attention_forward_plain.default):
        for requires_grad in (False, True):
            q, k, v = _inputs(n=128, requires_grad=requires_grad)
            torch.library.opcheck(op, (q, k, v, SPEC_STRING),
                                  test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "op"])
def test_head_dims_that_are_not_multiples_of_8_run_padded(eager, monkeypatch):
    """d = 59 through fagen.attention: q, k, v padded to 64 with zero columns, o a view of 59 columns, the
    gradients back through the padding; against float64 with d = 59's scale. (Added 2026-11-23 without a GPU
    run: no device time was left that session.)"""
    torch = _torch()
    import fagen
    import fagen.torch as fagen_torch

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", eager)
    q, k, v = _inputs(d=59, requires_grad=True)
    o = fagen.attention(q, k, v, fagen.Spec(head_dim=59, dtype="bf16", mask="causal"))
    assert o.shape == q.shape
    do = torch.randn_like(o)
    o.backward(do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, True, 59 ** -0.5)
    want.backward(do.double())
    assert rel(o, want) < 1e-2
    for name, t, leaf in zip("qkv", (q, k, v), leaves):
        assert rel(t.grad, leaf.grad) < 2e-2, name


def test_sync_switch_names_nothing_when_all_is_well(spec, monkeypatch):
    import fagen
    from fagen import runtime

    monkeypatch.setattr(runtime, "CHECK_LAUNCHES", True)
    q, k, v = _inputs()
    o = fagen.attention(q, k, v, spec)
    assert rel(o, reference(q, k, v, True, 64 ** -0.5)) < 1e-2


def test_device_kv_lengths_out_of_range_are_clamped_and_host_ones_rejected():
    import fagen
    from fagen.runtime import ArgumentError

    torch = _torch()
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="padding")
    kernel = fagen.compile(spec)
    q, k, v = _inputs(batch=4, n=100)
    with pytest.raises(ArgumentError, match=r"kv_lengths: every value must be in \[0, 100\]"):
        kernel.forward(q, k, v, kv_lengths=[5, 101, 3, 4])
    with pytest.raises(ArgumentError, match=r"kv_lengths"):
        kernel.forward(q, k, v, kv_lengths=[-1, 10, 3, 4])
    lengths = torch.tensor([-3, 0, 105, 50], dtype=torch.int32, device="cuda")
    o, lse = kernel.forward(q, k, v, kv_lengths=lengths)
    torch.cuda.synchronize()
    clamped = [0, 0, 100, 50]
    for b, n in enumerate(clamped):
        if n == 0:
            assert (o[b] == 0).all() and torch.isneginf(lse[b]).all()
        else:
            ref = reference(q[b:b + 1, :, :, :], k[b:b + 1, :, :n], v[b:b + 1, :, :n], False, 64 ** -0.5)
            assert rel(o[b:b + 1], ref) < 1e-2, f"batch entry {b}"


_LOAD_PROBE = r"""
import json, sys, time, warnings
start = time.perf_counter()
import fagen
from fagen import jit, runtime
spec = fagen.Spec(**json.loads(sys.argv[1]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kernel = jit.compile(spec, device=0)
seconds = time.perf_counter() - start
print("PROBE " + json.dumps({"seconds": seconds, "warnings": [str(w.message) for w in caught],
                             "sympy": "sympy" in sys.modules, "jinja2": "jinja2" in sys.modules}))
"""


def _child_env(cache_dir) -> dict:
    """This checkout first on the path, then whatever the parent had (the GPU machine's extra packages)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, FAGEN_CACHE_DIR=str(cache_dir), PYTHONPATH=path)


def _probe(cache_dir, fields) -> dict:
    env = _child_env(cache_dir)
    out = subprocess.run([sys.executable, "-c", _LOAD_PROBE, json.dumps(fields)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[6:])


def test_a_fresh_process_loads_from_the_cache_without_sympy_and_survives_corruption(tmp_path):
    fields = {"head_dim": 64, "dtype": "fp16", "mask": "sliding_window", "window": 33}
    first = _probe(tmp_path, fields)
    assert first["sympy"], "a cold cache has to solve"
    second = _probe(tmp_path, fields)
    assert not second["sympy"] and not second["jinja2"], "a cached spec loads without the solver or Jinja"
    assert not second["warnings"]
    # Truncate every cache entry (plans and cubins): the next process rebuilds, warns, does not crash.
    entries = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.parent.name in ("plan", "cubin")]
    assert entries
    for path in entries:
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])
    third = _probe(tmp_path, fields)
    assert any("corrupt" in w for w in third["warnings"]), third["warnings"]
    fourth = _probe(tmp_path, fields)
    assert not fourth["warnings"] and not fourth["sympy"]


def test_processes_building_the_same_spec_at_once_all_succeed(tmp_path):
    fields = {"head_dim": 32, "dtype": "bf16", "mask": "none", "dropout": 0.25}
    env = _child_env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_PROBE, json.dumps(fields)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    solved = [json.loads(next(l for l in r[0].splitlines() if l.startswith("PROBE "))[6:])["sympy"] for r in results]
    assert solved.count(True) == 1, "one process solves and compiles; the others wait for its lock and load"


def test_repeated_calls_take_the_fast_path_and_follow_new_data():
    """The second call with a signature reuses the first's checked launch; what changes between calls
    (pointers, kv_lengths values, seed) must still reach the kernel. Heads-interleaved inputs give
    outputs in the same layout; a misaligned view keeps taking the full path, correctly."""
    import fagen

    torch = _torch()
    kernel = fagen.compile(fagen.Spec(head_dim=64, dtype="bf16", mask="padding"))
    lengths = torch.tensor([50, 257], dtype=torch.int32, device="cuda")
    signatures_before = len(kernel._fast_forward)   # other tests in this process may share the kernel
    for trial, valid in enumerate(([50, 257], [7, 1], [257, 200])):
        lengths.copy_(torch.tensor(valid, dtype=torch.int32))   # same tensor, new values
        packed = torch.randn(2, 257, 3, 3, 64, device="cuda", dtype=torch.bfloat16)   # (b, n, qkv, h, d)
        q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
        o, lse = kernel.forward(q, k, v, kv_lengths=lengths)
        # q is a strided view (every third head slot); o is dense, with q's order of dimensions
        assert o.stride() == (257 * 3 * 64, 64, 3 * 64, 1), "o is laid out (batch, seq, heads, d) like q"
        for b, n in enumerate(valid):
            ref = reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], False, 64 ** -0.5)
            assert rel(o[b:b + 1], ref) < 1e-2, f"trial {trial} batch {b}"
    assert len(kernel._fast_forward) == signatures_before + 1, "one signature, one cached launch"
    base = torch.randn(2 * 3 * 257 * 64 + 8, device="cuda", dtype=torch.bfloat16)
    q = base[4:4 + 2 * 3 * 257 * 64].view(2, 3, 257, 64)   # 8-byte aligned only: cp.async needs 16
    k, v = _inputs()[1:]
    for _ in range(2):
        o, _ = kernel.forward(q, k, v, kv_lengths=[257, 100])
        for b, n in enumerate((257, 100)):
            ref = reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], False, 64 ** -0.5)
            assert rel(o[b:b + 1], ref) < 1e-2


def test_repeated_backward_with_dropout_follows_the_seed():
    """The first call checks and launches; later ones with the same signature take the cached launch.
    Both must give the same bits for the same seed, and a new seed must draw a new mask."""
    import fagen

    torch = _torch()
    kernel = fagen.compile(fagen.Spec(head_dim=64, dtype="bf16", dropout=0.2))
    q, k, v = _inputs(n=130)
    do = torch.randn_like(q)
    results = []
    before = len(kernel._fast_forward), len(kernel._fast_backward)   # other tests may share the kernel
    for seed in (1, 1, 2, 1):
        o, lse = kernel.forward(q, k, v, seed=seed)
        results.append((o, *kernel.backward(q, k, v, o, lse, do, seed=seed)))
    first, again, other, last = results
    assert (len(kernel._fast_forward), len(kernel._fast_backward)) == (before[0] + 1, before[1] + 1)
    for a, b in (first, again), (first, last):   # (o, dq, dk, dv); dq sums with atomics: equal up to order
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), "same seed, same bits"
        assert rel(a[1], b[1].double()) < 1e-2
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[3], other[3]), "a new seed, a new mask"


# wgmma (d 64 / 128), mma.sync (d 96 on sm_90, d 64 sm_80 plans), CUDA cores (d 40 fp32, FA1 loop), decode
SEED_TENSOR_SPECS = [dict(head_dim=64, dtype="bf16", mask="causal", dropout=0.2),
                     dict(head_dim=96, dtype="fp16", mask="none", dropout=0.3),
                     dict(head_dim=64, dtype="bf16", mask="sliding_window", window=40, dropout=0.1, arch="sm_80"),
                     dict(head_dim=40, dtype="fp32", mask="causal", dropout=0.2),
                     dict(head_dim=64, dtype="fp16", mask="none", dropout=0.2, loop_order="fa1"),
                     dict(head_dim=128, dtype="bf16", mask="causal", dropout=0.1, passes=["forward", "decode"])]


@pytest.mark.parametrize("fields", SEED_TENSOR_SPECS, ids=lambda f: "-".join(str(v) for v in f.values()))
def test_a_seed_tensor_gives_the_bits_of_its_value(fields):
    """seed= a CUDA int64 tensor: the kernels read it when they run and draw exactly the mask of the int
    seed it holds (forward and backward, full path then fast path), and a new value a new mask."""
    import fagen

    from fagen.testing import kernel_under_test

    torch = _torch()
    spec = fagen.Spec(**fields)
    kernel = kernel_under_test(spec)   # (the sm_80 entry on its sm_80 plan)
    decode = "decode" in spec.passes
    q = torch.randn(2, 4, 1 if decode else 150, spec.head_dim, device="cuda", dtype=getattr(torch, {
        "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[spec.dtype]))
    k, v = (torch.randn(2, 4, 333, spec.head_dim, device="cuda", dtype=q.dtype) for _ in range(2))
    do = torch.randn_like(q)
    value = 2**62 + 12345   # high bits set: the kernels read all 64
    seed = torch.tensor([value], dtype=torch.int64, device="cuda")

    def run(s):
        o, lse = kernel.forward(q, k, v, seed=s, offset=7)
        grads = kernel.backward(q, k, v, o, lse, do, seed=s, offset=7) if "backward" in spec.passes else ()
        return (o, *grads)

    expected = run(value)
    for call in range(2):   # the second call with these shapes takes the fast path
        got = run(seed)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
            if name == "dq":   # summed with atomics: equal up to the order of the additions
                assert rel(a, b.double()) < 1e-2, f"call {call}: {name}"
            else:
                assert torch.equal(a, b), f"call {call}: {name} differs from the int seed's"
    seed.fill_(value + 1)
    assert not torch.equal(run(seed)[0], expected[0]), "a new value in the tensor, a new mask"


def test_cuda_graph_replays_draw_new_dropout_masks():
    """A graph that captured fagen.torch.dropout_seed() and a dropout forward + backward: each replay
    draws a new seed on the GPU, so a new mask, and each replay's outputs are those of the seed it drew."""
    import fagen
    import fagen.torch as fagen_torch

    torch = _torch()
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="causal", dropout=0.2)
    q, k, v = (t.requires_grad_() for t in _inputs(n=200))
    grad_out = torch.randn_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm up (compile, allocator) outside the capture
        for _ in range(2):
            fagen.attention(q, k, v, spec, seed=fagen_torch.dropout_seed()).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed = fagen_torch.dropout_seed()
        out = fagen.attention(q, k, v, spec, seed=seed)
        out.backward(grad_out)
    seeds, outputs = [], []
    kernel = fagen.compile(spec)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        value = int(seed.item())
        seeds.append(value)
        outputs.append(out.detach().clone())
        o, lse = kernel.forward(q.detach(), k.detach(), v.detach(), seed=value)
        dq, dk, dv = kernel.backward(q.detach(), k.detach(), v.detach(), o, lse, grad_out, seed=value)
        assert torch.equal(out, o), "the replay's output is the forward of the seed it drew"
        assert torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
        assert rel(q.grad, dq.double()) < 1e-2
    assert len(set(seeds)) == 3, f"each replay draws a new seed: {seeds}"
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])


@pytest.mark.parametrize("head_dim, kv_heads", [(128, 2), (64, 1), (96, 4), (192, 2)])
def test_grouped_kv_heads_without_copies(head_dim, kv_heads):
    """GQA / MQA: k, v with fewer heads go to the kernels as they are (no repeat in memory); the
    gradients of k, v are their groups' sums. Checked against the float64 reference through autograd,
    twice (the second call takes the fast path), for the wgmma (d 128), mma, d 96 and wide d 192 kernels."""
    import numpy as np

    import fagen
    from fagen import reference as ref
    from fagen.testing import CANCELLATION_FLOOR, relative_error

    torch = _torch()
    spec = fagen.Spec(head_dim=head_dim, dtype="bf16", mask="causal", dropout=0.1)
    batch, heads, n_q, n_k = 2, 8, 190, 223
    as64 = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
    kernel = fagen.compile(spec)   # the kernel fagen.attention uses (one per spec and device)
    before = len(kernel._fast_forward), len(kernel._fast_backward)
    for call in range(2):
        q = torch.randn(batch, heads, n_q, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, kv_heads, n_k, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        do = torch.randn_like(q)
        o = fagen.attention(q, k, v, spec, seed=7 + call)
        o.backward(do)
        ref_o, _ = ref.attention_forward(as64(q), as64(k), as64(v), spec, seed=7 + call)
        assert relative_error(as64(o), ref_o) < 1e-2, f"call {call}: o"
        magnitudes = {}
        grads = ref.attention_backward(as64(q), as64(k), as64(v), as64(do), spec, seed=7 + call, o=as64(o),
                                       magnitudes=magnitudes)
        for name, tensor, expected in zip(("dq", "dk", "dv"), (q, k, v), grads):
            assert tensor.grad.shape == tensor.shape
            error = relative_error(as64(tensor.grad), expected, CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
            assert error < 1e-2, f"call {call}: {name} relative error {error:.3g}"
    assert (len(kernel._fast_forward), len(kernel._fast_backward)) == (before[0] + 1, before[1] + 1), \
        "the second call took the fast path"
    assert np.isfinite(as64(o)).all()


def test_kv_heads_that_do_not_divide_the_query_heads_are_rejected():
    import fagen
    from fagen.runtime import ArgumentError

    torch = _torch()
    q = torch.randn(1, 6, 32, 64, device="cuda", dtype=torch.bfloat16)
    k = v = torch.randn(1, 4, 32, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="must divide"):
        fagen.attention(q, k, v, fagen.Spec(head_dim=64, dtype="bf16"))


def test_fast_path_never_reuses_the_strides_of_an_aligned_copy():
    """q whose rows are 68 elements apart (not 16-byte multiples) is copied to an aligned tensor by the
    full path; a later call must not launch with that copy's strides on the caller's own q."""
    import fagen

    torch = _torch()
    kernel = fagen.compile(fagen.Spec(head_dim=64, dtype="bf16", mask="causal"))
    for trial in range(3):
        wide = torch.randn(2, 3, 200, 68, device="cuda", dtype=torch.bfloat16)
        q = wide[..., :64]
        _, k, v = _inputs(n=200)
        o, _ = kernel.forward(q, k, v)
        error = rel(o, reference(q, k, v, True, 64 ** -0.5))
        assert error < 1e-2, f"trial {trial}: relative error {error:.3g}"


def test_autograd_backward_keyed_by_its_forward_follows_new_grad_layouts():
    """fagen.attention's backward takes Kernel.backward_after's route, keyed by the forward's signature
    and dO's strides, from the second call on. A dO with other strides, or one whose pointer is off a
    16-byte boundary (cp.async's), must not reuse that entry: each call's gradients match float64's."""
    import fagen
    import fagen.torch as fagen_torch

    torch = _torch()
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="causal")
    kernel = fagen_torch.kernel_for(fagen_torch.spec_key(spec), 0)
    batch, heads, n, d = 2, 3, 200, 64
    q, k, v = _inputs(batch, heads, n, d)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = reference(*leaves64, True, d ** -0.5)
    base = torch.randn(batch * heads * n * d + 8, device="cuda", dtype=torch.bfloat16)
    grads_out = {
        "dense": lambda: torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16),
        "dense again": lambda: torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16),
        "8-byte aligned": lambda: base[4:4 + batch * heads * n * d].view(batch, heads, n, d).normal_(),
        "heads-interleaved": lambda: torch.randn(batch, n, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
        "dense, last": lambda: torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16),
    }
    entries = []
    for name, make in grads_out.items():
        grad = make()
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        got = torch.autograd.grad(fagen.attention(*leaves, spec), leaves, grad)
        want = torch.autograd.grad(out64, leaves64, grad.double(), retain_graph=True)
        for label, g, w in zip(("dq", "dk", "dv"), got, want):
            assert rel(g, w) < 2e-2, f"{name}: {label} relative error {rel(g, w):.3g}"
        entries.append(dict(kernel._fast_backward_after))
    assert entries[0], "the first backward left an entry keyed by its forward"
    assert entries[1] == entries[0], "the second dense call reused it"
    strides = {entry[1] for entry in entries[3].values()}
    assert (n * heads * d, d, heads * d, 1) in strides, "other dO strides: a new entry, not the dense one"


LSE_SPECS = {"wgmma": {"head_dim": 64, "dtype": "bf16", "mask": "causal"},
             "mma-sync-gqa": {"head_dim": 128, "dtype": "fp16", "mask": "causal", "arch": "sm_80"},
             "simt-odd-d": {"head_dim": 59, "dtype": "fp32", "mask": "none"},
             "window-gqa": {"head_dim": 96, "dtype": "bf16", "mask": "sliding_window", "window": 50}}


def grad_error(got, want, wants) -> float:
    """rel(got, want), or where want is exactly 0 (dV of a loss that reads lse alone, which does not depend on V)
    got's norm against the largest of the reference gradients'."""
    scale = want.norm().item() or max(w.norm().item() for w in wants)
    assert not got.double().isnan().any(), "NaN in a gradient"
    return ((got.double() - want).norm() / scale).item()


def _lse_reference(q, k, v, spec, w_o, w_lse, sink=None):
    """float64: o, lse of softmax(scale QKᵀ) V (K/V heads repeated for their query heads) and the gradients of
    sum(o' * w_o) + sum(lse * w_lse), o' = o * sigmoid(lse - sink[h]) where a sink logit is given (gpt-oss)."""
    torch = _torch()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, 1) for t in leaves[1:])
    s = (leaves[0] @ kk.transpose(-1, -2)) * spec.scale
    n, m = s.shape[-2:]
    visible = torch.ones(n, m, dtype=torch.bool, device=q.device)
    if spec.mask in ("causal", "sliding_window"):
        visible = visible.tril(m - n)
    if spec.mask == "sliding_window":
        visible &= ~torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n - spec.window)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vv
    if sink is not None:
        sink = sink.detach().double().requires_grad_()
        leaves.append(sink)
        o = o * torch.sigmoid(lse - sink[None, :, None])[..., None]
    loss = (o * w_o.double()).sum() + (lse * w_lse.double()).sum()
    return o, lse, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("route", ["eager", "op"])
@pytest.mark.parametrize("name", list(LSE_SPECS))
def test_gradients_flow_through_lse(name, route, monkeypatch):
    """fagen.attention(..., return_lse=True) with a loss that reads lse as well as o: dq, dk, dv against float64
    autograd through both outputs, twice (the second call on the remembered launch with its d_lse slot), then a
    call whose loss reads o alone on the same shapes (a launch without d_lse), and lse alone (dO zeros)."""
    torch = _torch()
    import fagen
    import fagen.torch as fagen_torch

    monkeypatch.setattr(fagen_torch, "EAGER_FAST_PATH", route == "eager")
    spec = fagen.Spec(**LSE_SPECS[name])
    kv_heads = 2 if "gqa" in name else 4
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec.dtype]
    for call, reads in enumerate(("both", "both", "o", "lse")):
        generator = torch.Generator(device="cuda").manual_seed(call)
        make = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=generator)  # noqa: E731
        q, k, v = make(2, 4, 130, spec.head_dim), make(2, kv_heads, 130, spec.head_dim), make(2, kv_heads, 130, spec.head_dim)
        w_o = make(*q.shape) if reads != "lse" else torch.zeros_like(q)
        w_lse = torch.randn(2, 4, 130, device="cuda", generator=generator) if reads != "o" else torch.zeros(2, 4, 130, device="cuda")
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o, lse = fagen.attention(*leaves, spec, return_lse=True)
        loss = {"both": (o.float() * w_o.float()).sum() + (lse * w_lse).sum(), "o": (o.float() * w_o.float()).sum(),
                "lse": (lse * w_lse).sum()}[reads]
        got = torch.autograd.grad(loss, leaves)
        want_o, want_lse, want = _lse_reference(q, k, v, spec, w_o, w_lse)
        assert rel(lse, want_lse) < 1e-3
        for grad_name, g, w in zip(("dq", "dk", "dv"), got, want):
            error = grad_error(g, w, want)
            assert error < 1e-2, (call, reads, grad_name, error)


def test_a_sink_logit_through_lse_gives_gpt_oss_attention_and_its_gradients():
    """gpt-oss's attention sinks (a learned logit per head in the softmax's denominator, with no value) from
    fagen's o and lse alone: o * sigmoid(lse - sink[h]). Forward and the gradients of q, k, v and the sinks
    against float64 autograd; the packed layout too."""
    torch = _torch()
    import fagen

    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="sliding_window", window=48)
    generator = torch.Generator(device="cuda").manual_seed(11)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)  # noqa: E731
    q, k, v = make(2, 8, 200, 64), make(2, 2, 200, 64), make(2, 2, 200, 64)
    sink = torch.randn(8, device="cuda", generator=generator)
    w_o = make(*q.shape)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
    o, lse = fagen.attention(*leaves[:3], spec, return_lse=True)
    sunk = o.float() * torch.sigmoid(lse - leaves[3][None, :, None])[..., None]
    got = torch.autograd.grad((sunk * w_o.float()).sum(), leaves)
    want_o, _, want = _lse_reference(q, k, v, spec, w_o, torch.zeros(2, 8, 200, device="cuda"), sink=sink)
    assert rel(sunk, want_o) < 1e-2
    for grad_name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert rel(g, w) < 1e-2, grad_name

    packed = fagen.Spec(head_dim=64, dtype="bf16", mask="causal", layout="packed")
    lengths = [70, 0, 130]
    cu = torch.tensor([0, 70, 70, 200], dtype=torch.int32, device="cuda")
    qp, kp, vp = make(200, 4, 64), make(200, 2, 64), make(200, 2, 64)
    w_lse = torch.randn(4, 200, device="cuda", generator=generator)
    leaves = [t.clone().requires_grad_() for t in (qp, kp, vp)]
    for _ in range(2):   # (twice: a packed backward with d_lse takes the full path each time, fresh checks)
        o, lse = fagen.attention(*leaves, packed, return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130,
                                 max_seqlen_k=130)
        got = torch.autograd.grad((lse * w_lse).sum(), leaves)
        start = 0
        for length in lengths:   # each sequence alone, as a batch of one
            rows = slice(start, start + length)
            start += length
            if not length:
                continue
            as_batch = [t[rows].transpose(0, 1)[None] for t in (qp, kp, vp)]
            _, _, want = _lse_reference(*as_batch, packed, torch.zeros_like(as_batch[0]), w_lse[:, rows][None])
            for grad_name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert grad_error(g[rows].transpose(0, 1)[None], w, want) < 1e-2, (length, grad_name)
