"""fagen.distributed: ring attention (issue 59).

On the CPU: the LSE merge against a softmax over the concatenated keys; the schedule's blocks against the
mask at global positions; the ring simulated in one process (SimulatedRing: W ranks as threads, the same code
path as a process group) against dense float64 attention on the whole sequence, forward and backward; and
torch.distributed with gloo in 2 and 4 processes, bit for bit against the simulated ring. All with the float64
ReferenceKernel. The GPU tests (fagen's kernels; NCCL on 2 GPUs) are marked gpu."""
import itertools
import json
import os
import tempfile

import numpy as np

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen import distributed as fd  # noqa: E402

B, H, D = 2, 4, 8


def _dense(q, k, v, causal, scale):
    """(o, lse) of attention on the whole sequence in float64 torch, differentiable (autograd's gradients
    are the reference for the ring's backward)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _inputs(n, h_kv, seed=0, nk=None):
    g = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, h_kv, nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, h_kv, nk, D, generator=g, dtype=torch.float64)
    w_o = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)   # loss = sum(o * w_o) + sum(lse * w_lse)
    w_lse = torch.randn(B, H, n, generator=g, dtype=torch.float64)
    return q, k, v, w_o, w_lse


def _rank_step(rank, world, ring, tensors, spec, layout, use_lse, kernel=None):
    """One rank's part: its shards, ring attention, the loss's backward. Returns o, lse, dq, dk, dv (shards)."""
    q, k, v, w_o, w_lse = (fd.shard_sequence(t, rank, world, layout) for t in tensors)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kernel = fd.ReferenceKernel(spec) if kernel is None else kernel
    o, lse = fd.ring_attention(q, k, v, spec, ring, layout=layout, return_lse=True, kernel=kernel)
    loss = (o * w_o).sum() + ((lse * w_lse).sum() if use_lse else 0)
    loss.backward()
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _simulated(world, tensors, spec, layout, use_lse):
    return fd.run_simulated(world, lambda rank, ring: _rank_step(rank, world, ring, tensors, spec, layout, use_lse))


def _unshard(per_rank, layout):
    return [fd.unshard_sequence([r[n] for r in per_rank], layout) for n in range(len(per_rank[0]))]


def _expected(tensors, causal, scale, use_lse):
    q, k, v, w_o, w_lse = tensors
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = _dense(q, k, v, causal, scale)
    loss = (o * w_o).sum() + ((lse * w_lse).sum() if use_lse else 0)
    loss.backward()
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _assert_all_close(got, want, names=("o", "lse", "dq", "dk", "dv"), tol=1e-10):
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


# ---- the merge ------------------------------------------------------------------------------------
def _softmax_parts(s, v, parts):
    """(o_i, lse_i) of each part of the keys (columns of s), computed directly."""
    outs, lses = [], []
    for cols in parts:
        si = s[..., cols]
        lse = torch.logsumexp(si, -1)
        p = torch.exp(si - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
        outs.append(p @ v[..., cols, :])
        lses.append(lse)
    return outs, lses


def test_merge_matches_softmax_over_concatenated_keys():
    g = torch.Generator().manual_seed(1)
    s = 3 * torch.randn(2, 3, 5, 12, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 12, 4, generator=g, dtype=torch.float64)
    s[..., 1, 0:4] = float("-inf")       # row 1 sees nothing of part 0
    s[..., 2, :] = float("-inf")         # row 2 sees no key at all
    s[..., 3, 4:12] = float("-inf")      # row 3 sees only part 0
    s[..., 4, :] += 5000.0               # huge scores: exp would overflow without the max subtraction
    parts = [slice(0, 4), slice(4, 7), slice(7, 12)]
    outs, lses = _softmax_parts(s, v, parts)
    o, lse = fd.merge_partials(outs, lses)
    want_lse = torch.logsumexp(s, -1)
    want_o = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v
    assert o.dtype == lse.dtype == torch.float64
    assert torch.isneginf(lse[..., 2]).all() and (o[..., 2, :] == 0).all()
    assert torch.isfinite(o).all()
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    # pairwise, in any order, and as the ring merges (into an empty start: o = 0, lse = -inf)
    acc_o, acc_lse = torch.zeros_like(o), torch.full_like(lse, float("-inf"))
    for n in (2, 0, 1):
        acc_o, acc_lse = fd.merge_partials([acc_o, outs[n]], [acc_lse, lses[n]])
    torch.testing.assert_close(acc_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_merge_in_float32_from_half_precision_partials():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64)
    outs, lses = _softmax_parts(s, v, [slice(0, 3), slice(3, 8)])
    o, lse = fd.merge_partials([x.to(torch.bfloat16) for x in outs], [x.to(torch.float32) for x in lses])
    assert o.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), torch.softmax(s, -1) @ v, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError):
        fd.merge_partials([outs[0]], lses)


# ---- the schedule ---------------------------------------------------------------------------------
def _positions(runs):
    return [p for start, n in runs for p in range(start, start + n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("mask,layout", [("none", "contiguous"), ("causal", "contiguous"), ("causal", "zigzag")])
def test_schedule_covers_every_visible_pair_once(world, mask, layout):
    n = 4 * world
    local = n // world
    causal = mask == "causal"
    work = []
    for rank in range(world):
        seen = []
        rows = fd.shard_positions(rank, world, local, layout).tolist()
        for step in range(world):
            source = (rank - step) % world
            keys = fd.shard_positions(source, world, local, layout).tolist()
            for block in fd.ring_schedule(rank, source, world, local, local, causal, layout):
                qp, kp = _positions(block.q_positions), _positions(block.k_positions)
                assert qp == rows[block.q_rows] and kp == keys[block.k_rows]   # the runs are the rows' positions
                if block.mask == "causal":
                    assert qp == kp
                for a, i in enumerate(qp):
                    for b, j in enumerate(kp):
                        if block.mask == "none" or b <= a:
                            assert not causal or j <= i, (rank, step, block)   # nothing in the future
                            seen.append((i, j))
        want = [(i, j) for i in rows for j in range(n) if not causal or j <= i]
        assert sorted(seen) == sorted(want)   # every visible pair once
        work.append(len(seen))
    if layout == "zigzag" or not causal:
        assert len(set(work)) == 1   # balanced


def test_shard_helpers_round_trip():
    x = torch.arange(2 * 3 * 16).reshape(2, 3, 16)
    for world, layout in itertools.product((1, 2, 4), fd.LAYOUTS):
        shards = [fd.shard_sequence(x, r, world, layout, dim=2) for r in range(world)]
        assert torch.equal(fd.unshard_sequence(shards, layout, dim=2), x)
        for r, shard in enumerate(shards):
            assert torch.equal(shard[0, 0] % 16, fd.shard_positions(r, world, 16 // world, layout))
    assert fd.zigzag_shard(torch.arange(8), 1, 2, dim=0).tolist() == [2, 3, 4, 5]
    assert fd.zigzag_unshard([torch.tensor([0, 3]), torch.tensor([1, 2])], dim=0).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        fd.shard_sequence(torch.arange(6), 0, 2, "zigzag", dim=0)


# ---- the ring, simulated in one process ----------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mask,layout", [("none", "contiguous"), ("causal", "contiguous"), ("causal", "zigzag")])
@pytest.mark.parametrize("h_kv", [H, 2])
def test_simulated_ring_matches_whole_sequence(world, mask, layout, h_kv):
    spec = fagen.Spec(head_dim=D, dtype="fp32", mask=mask)
    tensors = _inputs(32, h_kv, seed=world * 10 + h_kv)
    use_lse = h_kv == 2   # the loss reads lse too (d_lse reaches every block's backward) in half the cases
    got = _unshard(_simulated(world, tensors, spec, layout, use_lse), layout)
    want = _expected([fd.unshard_sequence([fd.shard_sequence(t, r, world, layout) for r in range(world)], layout)
                      for t in tensors], mask == "causal", spec.scale, use_lse)
    _assert_all_close(got, want)


def test_simulated_ring_none_mask_cross_attention_lengths_and_zigzag_layout():
    # mask none: shards of q and k may differ in length, and any layout is the same maths
    spec = fagen.Spec(head_dim=D, dtype="fp32", mask="none", softmax_scale=0.3)
    q, k, v, w_o, w_lse = _inputs(16, 1, seed=5, nk=24)

    def rank_fn(rank, ring):
        qs, w_os, w_ls = (fd.shard_sequence(t, rank, 4, "zigzag") for t in (q, w_o, w_lse))
        ks, vs = (fd.shard_sequence(t, rank, 4, "contiguous").clone().requires_grad_() for t in (k, v))
        qs = qs.clone().requires_grad_()
        o, lse = fd.ring_attention(qs, ks, vs, spec, ring, layout="zigzag", return_lse=True,
                                   kernel=fd.ReferenceKernel(spec))
        ((o * w_os).sum() + (lse * w_ls).sum()).backward()
        return o.detach(), lse.detach(), qs.grad, ks.grad, vs.grad

    per_rank = fd.run_simulated(4, rank_fn)
    got = [fd.unshard_sequence([r[n] for r in per_rank], "zigzag") for n in range(3)]
    got += [fd.unshard_sequence([r[n] for r in per_rank], "contiguous") for n in (3, 4)]
    _assert_all_close(got, _expected((q, k, v, w_o, w_lse), False, 0.3, True))


def test_float32_inputs_merge_in_float32_and_lse_only_losses():
    spec = fagen.Spec(head_dim=D, dtype="fp32", mask="causal")
    q, k, v, w_o, w_lse = (t.float() for t in _inputs(16, 2, seed=7))

    def rank_fn(rank, ring):
        qs, ks, vs = (fd.zigzag_shard(t, rank, 2).clone().requires_grad_() for t in (q, k, v))
        o, lse = fd.ring_attention(qs, ks, vs, spec, ring, layout="zigzag", return_lse=True,
                                   kernel=fd.ReferenceKernel(spec))
        assert o.dtype == lse.dtype == torch.float32
        (lse * fd.zigzag_shard(w_lse, rank, 2)).sum().backward()   # o unused: its gradient is None, zeros
        return o.detach(), lse.detach(), qs.grad, ks.grad, vs.grad

    got = _unshard(fd.run_simulated(2, rank_fn), "zigzag")
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    o, lse = _dense(qd, kd, vd, True, spec.scale)
    (lse * w_lse.double()).sum().backward()
    assert vd.grad is None and (got[4] == 0).all()   # lse does not depend on v
    _assert_all_close([x.double() for x in got[:4]], [o.detach(), lse.detach(), qd.grad, kd.grad], tol=1e-4)


def _functional_rank_step(rank, world, ring, tensors, spec, layout, use_lse, kernel=None):
    """_rank_step through ring_attention_forward / ring_attention_backward (no autograd): what the GPU tests
    run in threads."""
    q, k, v, w_o, w_lse = (fd.shard_sequence(t, rank, world, layout) for t in tensors)
    kernel = fd.ReferenceKernel(spec) if kernel is None else kernel
    o, lse = fd.ring_attention_forward(q, k, v, spec, ring, layout=layout, kernel=kernel)
    grads = fd.ring_attention_backward(q, k, v, o, lse, w_o, w_lse if use_lse else None, spec, ring, layout=layout,
                                       kernel=kernel)
    return [o, lse, *grads]


@pytest.mark.parametrize("use_lse", [False, True])
def test_functional_passes_equal_autograd(use_lse):
    spec = fagen.Spec(head_dim=D, dtype="fp32", mask="causal")
    tensors = _inputs(32, 2, seed=9)
    autograd = _simulated(4, tensors, spec, "zigzag", use_lse)
    functional = fd.run_simulated(4, lambda r, ring: _functional_rank_step(r, 4, ring, tensors, spec, "zigzag", use_lse))
    for a, f in zip(autograd, functional):
        assert all(torch.equal(x, y) for x, y in zip(a, f))


def test_world_of_one_without_torch_distributed():
    spec = fagen.Spec(head_dim=D, dtype="fp32", mask="causal")
    tensors = _inputs(8, H, seed=3)
    got = _rank_step(0, 1, None, tensors, spec, "contiguous", True)   # group=None, no process group: one rank
    _assert_all_close(got, _expected(tensors, True, spec.scale, True))


def test_refusals():
    q = torch.zeros(1, 2, 8, D, dtype=torch.float64)
    for fields in ({"mask": "sliding_window", "window": 4}, {"dropout": 0.1}, {"mask_mod": "i >= j"},
                   {"layout": "packed"}):
        spec = fagen.Spec(head_dim=D, dtype="fp32", **fields)
        with pytest.raises(NotImplementedError):
            fd.ring_attention(q, q, q, spec, kernel=fd.ReferenceKernel(fagen.Spec(head_dim=D)))
    mla = fagen.Spec(head_dim=16, value_head_dim=8, dtype="bf16")   # (checked before any shape)
    with pytest.raises(NotImplementedError, match="value_head_dim"):
        fd.ring_attention(q, q, q[..., :8], mla, kernel=fd.ReferenceKernel(fagen.Spec(head_dim=D)))
    with pytest.raises(NotImplementedError, match="value_head_dim"):
        fd.ReferenceKernel(mla)
    with pytest.raises(NotImplementedError, match="dtype fp8_e4m3"):
        fd.ReferenceKernel(fagen.Spec(head_dim=64, dtype="fp8_e4m3"))
    causal = {"head_dim": D, "dtype": "fp32", "mask": "causal"}
    with pytest.raises(ValueError, match="odd"):
        fd.ring_attention(q[:, :, :7], q[:, :, :7], q[:, :, :7], causal, layout="zigzag",
                          kernel=fd.ReferenceKernel(causal))
    with pytest.raises(ValueError, match="one length"):
        fd.ring_attention(q, q[:, :, :4], q[:, :, :4], causal, kernel=fd.ReferenceKernel(causal))
    with pytest.raises(ValueError, match="CUDA"):   # the default kernel is fagen's
        fd.ring_attention(q.float(), q.float(), q.float(), json.dumps(causal))


def test_fagen_kernel_variants():
    kernel = fd.FagenKernel(fagen.Spec(head_dim=64, dtype="bf16", mask="causal", name="mine", softmax_scale=0.5))
    for mask, key in kernel.keys.items():
        fields = json.loads(key)
        assert fields["mask"] == mask and fields["name"] is None and fields["softmax_scale"] == 0.5
    plain = fagen.Spec(head_dim=64, dtype="bf16", mask="causal")
    assert fd.FagenKernel(plain).keys["causal"] == fagen_torch().spec_key(plain)   # fagen.attention's own kernel


def fagen_torch():
    import fagen.torch

    return fagen.torch


class _ShapeRing:
    """A ring communicator that receives tensors of the sent shapes and no values: with fake tensors, one rank
    of any world runs every step of its schedule in one thread."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def exchange(self, tensors, tag=0):
        received = [torch.empty_like(t) for t in tensors]

        class Pending:
            def wait(self):
                return received
        return Pending()


@pytest.mark.parametrize("mask,layout", [("none", "contiguous"), ("causal", "contiguous"), ("causal", "zigzag")])
def test_fagen_kernel_calls_fit_the_ops_on_fake_cuda_tensors(mask, layout):
    """FagenKernel's calls of fagen's ops (arguments, strided rows, lse and d_lse slices made contiguous, dtypes)
    through the ops' fake implementations, for every block kind of a world of 4: what the CPU can check of the
    GPU path. Shapes and dtypes only: fake tensors hold no values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = fagen.Spec(head_dim=64, dtype="bf16", mask=mask)
    kernel, calls = fd.FagenKernel(spec), []
    forward_op, backward_op = kernel.forward_op, kernel.backward_op

    def forward(q, k, v, key):
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1   # what the kernels take (fagen/runtime/)
        calls.append(json.loads(key)["mask"])
        return forward_op(q, k, v, key)

    def backward(q, k, v, o, lse, do, d_lse, key):
        assert lse.dtype == torch.float32 and lse.is_contiguous() and d_lse.is_contiguous()   # (the runtime's check)
        assert all(t.stride(-1) == 1 for t in (q, k, v, o, do))
        return backward_op(q, k, v, o, lse, do, d_lse, key)

    kernel.forward_op, kernel.backward_op = forward, backward
    with FakeTensorMode():
        try:
            q = torch.empty(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16)
        except (RuntimeError, AssertionError) as err:
            pytest.skip(f"this torch makes no fake CUDA tensors without CUDA: {err}")
        k = torch.empty(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
        for rank in range(4):
            ring = _ShapeRing(rank, 4)
            o, lse = fd.ring_attention_forward(q, k, k, spec, ring, layout=layout, kernel=kernel)
            grads = fd.ring_attention_backward(q, k, k, o, lse, o, lse, spec, ring, layout=layout, kernel=kernel)
            assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, q.shape[:3], torch.float32)
            assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, k)]
    # forward calls: one per step and rank, but contiguous causal shards skip the future (rank r: r + 1 blocks)
    assert calls.count("causal") == (4 if mask == "causal" else 0)
    assert len(calls) == (1 + 2 + 3 + 4 if (mask, layout) == ("causal", "contiguous") else 16)


def test_nvls_off_in_the_environment():
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"


# ---- torch.distributed, gloo, several processes ---------------------------------------------------
GLOO_CASES = {   # name: (mask, layout, kv heads, loss reads lse)
    "none": ("none", "contiguous", H, True),
    "causal": ("causal", "contiguous", 2, False),
    "zigzag_gqa": ("causal", "zigzag", 1, True),
}


def _gloo_tensors(name, world):
    mask, layout, h_kv, use_lse = GLOO_CASES[name]
    return _inputs(8 * world, h_kv, seed=100 + world)


def _gloo_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    fd.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for name, (mask, layout, h_kv, use_lse) in GLOO_CASES.items():
            spec = fagen.Spec(head_dim=D, dtype="fp32", mask=mask)
            results[name] = _rank_step(rank, world, None, _gloo_tensors(name, world), spec, layout, use_lse)
        if world == 4:   # a subgroup of ranks 2, 3: its ring's neighbours are global ranks
            sub = dist.new_group([2, 3])
            if rank >= 2:
                spec = fagen.Spec(head_dim=D, dtype="fp32", mask="causal")
                results["subgroup"] = _rank_step(rank - 2, 2, sub, _gloo_tensors("zigzag_gqa", 2), spec, "zigzag",
                                                 True)
        results["nvls"] = os.environ.get("NCCL_NVLS_ENABLE")
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_match_the_simulated_ring(world):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the workers: the same BLAS calls on one thread give the same bits
    try:
        for name, (mask, layout, h_kv, use_lse) in GLOO_CASES.items():
            spec = fagen.Spec(head_dim=D, dtype="fp32", mask=mask)
            tensors = _gloo_tensors(name, world)
            simulated = _simulated(world, tensors, spec, layout, use_lse)
            for rank in range(world):
                for what, got, want in zip(("o", "lse", "dq", "dk", "dv"), per_rank[rank][name], simulated[rank]):
                    assert torch.equal(got, want), f"{name}, rank {rank}: {what} differs from the simulated ring"
            whole = [fd.unshard_sequence([fd.shard_sequence(t, r, world, layout) for r in range(world)], layout)
                     for t in tensors]
            _assert_all_close(_unshard([p[name] for p in per_rank], layout),
                              _expected(whole, mask == "causal", spec.scale, use_lse))
        if world == 4:
            spec = fagen.Spec(head_dim=D, dtype="fp32", mask="causal")
            simulated = _simulated(2, _gloo_tensors("zigzag_gqa", 2), spec, "zigzag", True)
            for rank in (2, 3):
                assert all(torch.equal(g, w) for g, w in zip(per_rank[rank]["subgroup"], simulated[rank - 2]))
    finally:
        torch.set_num_threads(threads)
    assert all(p["nvls"] == "0" for p in per_rank)


# ---- GPU: fagen's kernels (not run without a GPU) -------------------------------------------------
def _gpu_inputs(n, h_kv, seed, dtype=torch.bfloat16, d=64, h=4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, h, n, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(2, h_kv, n, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(2, h_kv, n, d, generator=g, device="cuda", dtype=dtype)
    do = torch.randn(2, h, n, d, generator=g, device="cuda", dtype=dtype)
    return q, k, v, do


def _fagen_whole(q, k, v, do, spec):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fagen.attention(q, k, v, spec, return_lse=True)
    o.backward(do)
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _fagen_ring_rank(rank, world, ring, tensors, spec, layout):
    """One rank through ring_attention and autograd (a world of one, or a process of its own)."""
    q, k, v, do = (fd.shard_sequence(t, rank, world, layout) for t in tensors)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fd.ring_attention(q, k, v, spec, ring, layout=layout, return_lse=True)
    o.backward(do)
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _fagen_simulated(world, tensors, spec, layout):
    """The ring simulated on one GPU, fagen's kernels: the two passes without autograd (whose one CUDA device
    thread would serialise the threads' backwards, each waiting for the others: ring_attention_forward)."""
    def rank_fn(rank, ring):
        q, k, v, do = (fd.shard_sequence(t, rank, world, layout) for t in tensors)
        o, lse = fd.ring_attention_forward(q, k, v, spec, ring, layout=layout)
        return [o, lse, *fd.ring_attention_backward(q, k, v, o, lse, do, None, spec, ring, layout=layout)]

    fd._default_kernel(spec).prepare()   # compiled before the threads start, not by several of them at once
    return fd.run_simulated(world, rank_fn)


def _float64_errors(got, tensors, spec):
    q, k, v, do = (t.double().requires_grad_() for t in tensors)
    o, lse = _dense(q, k, v, spec.mask == "causal", spec.scale)
    o.backward(do.double())
    want = [o.detach(), lse.detach(), q.grad, k.grad, v.grad]
    return [((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.parametrize("mask,layout", [("none", "contiguous"), ("causal", "contiguous"), ("causal", "zigzag")])
def test_gpu_world_of_one_equals_fagen_attention(mask, layout):
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask=mask)
    tensors = _gpu_inputs(512, 2, seed=1)
    got = _fagen_ring_rank(0, 1, None, tensors, spec, layout)
    want = _fagen_whole(*tensors, spec)
    # one block, merged into an empty accumulator: o and lse are the kernel's own bits; the gradients up to
    # the backward's atomics (dq) and GQA sums, which may differ in the last bits between runs
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mask,layout", [("none", "contiguous"), ("causal", "contiguous"), ("causal", "zigzag")])
@pytest.mark.parametrize("h_kv", [4, 1])
def test_gpu_simulated_ring_matches_fagen_attention(world, mask, layout, h_kv):
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask=mask)
    tensors = _gpu_inputs(1024, h_kv, seed=world + h_kv)
    got = _unshard(_fagen_simulated(world, tensors, spec, layout), layout)
    whole = [fd.unshard_sequence([fd.shard_sequence(t, r, world, layout) for r in range(world)], layout)
             for t in tensors]
    want = _fagen_whole(*whole, spec)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    # and no further from float64 than fagen.attention on the whole sequence, beyond bf16's rounding
    ring_errors, whole_errors = _float64_errors(got, whole, spec), _float64_errors(want, whole, spec)
    for name, r, w in zip(("o", "lse", "dq", "dk", "dv"), ring_errors, whole_errors):
        assert r <= 2 * w + 1e-2, (name, r, w)


def _nccl_worker(rank, world, init_file, out_dir, cases):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    fd.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for name, (mask, layout, h_kv) in cases.items():
            spec = fagen.Spec(head_dim=128, dtype="bf16", mask=mask)
            tensors = [t.to(f"cuda:{rank}") for t in _gpu_inputs(2048, h_kv, seed=11, d=128)]
            results[name] = [t.cpu() for t in _fagen_ring_rank(rank, world, None, tensors, spec, layout)]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_nccl_two_ranks_match_one_gpu():
    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"   # (the spawned ranks inherit it)
    cases = {"none": ("none", "contiguous", 4), "causal": ("causal", "contiguous", 2), "zigzag": ("causal", "zigzag", 1)}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(2, os.path.join(tmp, "init"), tmp, cases), nprocs=2, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
    torch.cuda.set_device(0)
    for name, (mask, layout, h_kv) in cases.items():
        spec = fagen.Spec(head_dim=128, dtype="bf16", mask=mask)
        tensors = _gpu_inputs(2048, h_kv, seed=11, d=128)
        simulated = _fagen_simulated(2, tensors, spec, layout)
        for rank in range(2):
            got, want = per_rank[rank][name], [t.cpu() for t in simulated[rank]]
            # the same kernels on the same blocks in the same order: the forward bit for bit, the gradients up
            # to the backward's atomics
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (name, rank)
            for g, w in zip(got[2:], want[2:]):
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


# ---- the all-to-all mode (ulysses_attention) -------------------------------------------------------------
def _dense_attend(spec):
    """attend(q, k, v) -> (o, lse) for ulysses_attention on the CPU: float64 torch with autograd, under the spec's
    mask as fagen.reference.visible_mask gives it (mask, window, mask_mod; bottom-right alignment)."""
    from fagen import reference

    def attend(q, k, v, kv_lengths=None, inputs=None):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = spec.scale * q @ k.transpose(-1, -2)
        visible = torch.from_numpy(reference.visible_mask(spec, *q.shape[:3], k.shape[2], kv_lengths=kv_lengths,
                                                          inputs=inputs).copy())
        s = s.masked_fill(~visible.broadcast_to(s.shape), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        return p @ v, lse

    return attend


ULYSSES_SPECS = {"none": fagen.Spec(head_dim=D, dtype="fp32", mask="none"),
                 "causal": fagen.Spec(head_dim=D, dtype="fp32", mask="causal"),
                 "window": fagen.Spec(head_dim=D, dtype="fp32", mask="sliding_window", window=5),
                 "mask_mod": fagen.Spec(head_dim=D, dtype="fp32", mask_mod="j <= i and (i - j < 7 or j < 2)")}


def _ulysses_step(rank, world, comm, tensors, spec, layout, **extra):
    q, k, v, w_o, w_lse = (fd.shard_sequence(t, rank, world, layout) for t in tensors)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = fd.ulysses_attention(q, k, v, spec, comm, layout=layout, return_lse=True, attend=_dense_attend(spec),
                                  **extra)
    ((o * w_o).sum() + (lse * w_lse).sum()).backward()
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


def _ulysses_whole(tensors, spec, **extra):
    q, k, v, w_o, w_lse = (t.clone() for t in tensors)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = _dense_attend(spec)(q, k, v, **extra)
    ((o * w_o).sum() + (lse * w_lse).sum()).backward()
    return [o.detach(), lse.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(ULYSSES_SPECS))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_ulysses_matches_attention_on_the_whole_sequence(world, name, layout, h_kv):
    """Each rank's o, lse and gradients, unsharded, against the same attention on the whole sequence: heads
    split over the ranks (H_kv dividing by W, or dividing W: each rank's heads share one K/V head), the sequence
    in contiguous or zigzag shards, every mask kind the mode takes; the dense attend itself against
    fagen.reference."""
    from fagen import reference

    spec = ULYSSES_SPECS[name]
    tensors = _inputs(4 * world, h_kv, seed=world * 10 + h_kv)
    per_rank = fd.run_simulated(world, lambda rank, comm: _ulysses_step(rank, world, comm, tensors, spec, layout))
    got = _unshard(per_rank, layout)
    whole = [fd.unshard_sequence([fd.shard_sequence(t, r, world, layout) for r in range(world)], layout)
             for t in tensors]
    want = _ulysses_whole(whole, spec)
    for what, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=what)
    ref_o, ref_lse = reference.attention_forward(*(t.numpy() for t in whole[:3]), spec)
    assert np.allclose(want[0].numpy(), ref_o, atol=1e-12) and np.allclose(want[1].numpy(), ref_lse, atol=1e-12)


def test_ulysses_bottom_right_with_fewer_queries_than_keys():
    """Shards of q shorter than k's (a chunk against its history): causal aligns bottom-right on the whole."""
    spec, world = ULYSSES_SPECS["causal"], 2
    tensors = _inputs(6, 2, seed=3, nk=10)
    got = _unshard(fd.run_simulated(world, lambda rank, comm: _ulysses_step(rank, world, comm, tensors, spec,
                                                                            "contiguous")), "contiguous")
    for what, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, _ulysses_whole(tensors, spec)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=what)


def test_ulysses_refuses_what_it_would_compute_differently():
    q, k, v, _, _ = _inputs(8, 2)
    ring = fd.SimulatedRing(2).member(0)
    for spec, match in ((fagen.Spec(head_dim=D, dtype="fp32", dropout=0.1), "dropout"),
                        (fagen.Spec(head_dim=D, dtype="fp32", mask_mod="(h + j) % 2 == 0"), "reads h"),
                        (fagen.Spec(head_dim=D, dtype="fp32", score_mod="score * w[h]", inputs={"w": "float32"}),
                         "reads h"),
                        (fagen.Spec(head_dim=D, dtype="fp32", mask="block_sparse", block_size=16), "block_sparse"),
                        (fagen.Spec(head_dim=16, value_head_dim=8, dtype="bf16"), "value_head_dim"),
                        (fagen.Spec(head_dim=64, dtype="fp8_e4m3"), "dtype fp8_e4m3")):
        with pytest.raises(NotImplementedError, match=match):
            fd.ulysses_attention(q, k, v, spec, ring)
    spec = ULYSSES_SPECS["none"]
    with pytest.raises(ValueError, match="must divide by the ranks"):
        fd.ulysses_attention(q, k, v, spec, fd.SimulatedRing(3).member(0))
    k3 = torch.randn(B, 3, 8, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="K/V heads"):
        fd.ulysses_attention(torch.randn(B, 6, 8, D, dtype=torch.float64), k3, k3, spec, fd.SimulatedRing(2).member(0))


def _gloo_ulysses_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    fd.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        for name, layout, h_kv in (("causal", "zigzag", 1), ("window", "contiguous", 2)):
            tensors = _inputs(4 * world, h_kv, seed=world + h_kv)
            results[name] = _ulysses_step(rank, world, None, tensors, ULYSSES_SPECS[name], layout)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_gloo_processes_match_the_simulated_ulysses():
    """torch.distributed's all_to_all over gloo in 2 processes: bit for bit what the simulated ranks give."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_ulysses_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, layout, h_kv in (("causal", "zigzag", 1), ("window", "contiguous", 2)):
            tensors = _inputs(4 * world, h_kv, seed=world + h_kv)
            simulated = fd.run_simulated(world, lambda rank, comm: _ulysses_step(rank, world, comm, tensors,
                                                                                 ULYSSES_SPECS[name], layout))
            for rank in range(world):
                for what, got, want in zip(("o", "lse", "dq", "dk", "dv"), per_rank[rank][name], simulated[rank]):
                    assert torch.equal(got, want), f"{name}, rank {rank}: {what} differs from the simulated ranks"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gpu_simulated_ulysses_equals_fagen_attention(world):
    """On one GPU, fagen's kernels: the forward of W simulated ranks (each runs fagen.attention on its H / W heads
    of the whole sequence) is bit for bit fagen.attention on all heads (every head's blocks are computed alone);
    a world of one through autograd, gradients included."""
    spec = fagen.Spec(head_dim=64, dtype="bf16", mask="causal")
    q, k, v, do = _gpu_inputs(512, 4, seed=world)
    want_o, want_lse = fagen.attention(q, k, v, spec, return_lse=True)

    def rank_fn(rank, comm):
        shards = [fd.shard_sequence(t, rank, world, "zigzag") for t in (q, k, v)]
        with torch.no_grad():
            return fd.ulysses_attention(*shards, spec, comm, layout="zigzag", return_lse=True)

    import fagen.torch as fagen_torch

    fagen_torch.kernel_for(fagen_torch.spec_key(spec), torch.cuda.current_device())   # compiled before the threads
    per_rank = fd.run_simulated(world, rank_fn)
    got_o, got_lse = (fd.unshard_sequence([r[n] for r in per_rank], "zigzag") for n in (0, 1))
    assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse.float())
    if world == 1:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fd.ulysses_attention(*leaves, spec).backward(do)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        fagen.attention(*whole, spec).backward(do)
        for g, w in zip(leaves, whole):   # (dQ's atomics may differ in the last bits between runs)
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-2, atol=1e-2)


def test_ulysses_passes_kv_lengths_and_inputs_to_the_local_call():
    """mask padding with kv_lengths, and a mask_mod reading an input (a per-sequence prefix), through the
    all-to-all: the same as the whole sequence's attention with them."""
    world = 2
    cases = ((fagen.Spec(head_dim=D, dtype="fp32", mask="padding"), {"kv_lengths": [5, 13]}),
             (fagen.Spec(head_dim=D, dtype="fp32", mask="causal", mask_mod="j < prefix[b] or j <= i - 2",
                         inputs={"prefix": "int32"}), {"inputs": {"prefix": np.array([3, 9], dtype=np.int32)}}))
    for spec, extra in cases:
        tensors = _inputs(8, 2, seed=4)
        got = _unshard(fd.run_simulated(world, lambda rank, comm: _ulysses_step(rank, world, comm, tensors, spec,
                                                                                "contiguous", **extra)), "contiguous")
        for what, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, _ulysses_whole(tensors, spec, **extra)):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"{spec.mask}: {what}")


def test_simulated_all_to_alls_stay_apart_across_member_objects():
    """Each rank's n-th all-to-all is counted on the ring, so fresh member objects of one rank (ring.member(rank)
    called anew) and ranks at different speeds still pair every chunk with its own exchange."""
    import random
    import threading

    world, rounds = 3, 20
    ring = fd.SimulatedRing(world, timeout=30)
    results = [[] for _ in range(world)]

    def body(rank):
        rng = random.Random(rank)
        for n in range(rounds):
            member = ring.member(rank)   # a new object each time
            threading.Event().wait(rng.random() * 0.003)
            got = member.all_to_all([torch.tensor([100.0 * n + 10 * rank + target]) for target in range(world)])
            results[rank].append([int(t.item()) for t in got])

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ring.failed is None
    for rank in range(world):
        assert results[rank] == [[100 * n + 10 * sender + rank for sender in range(world)] for n in range(rounds)]


def test_ulysses_names_what_a_communicator_needs():
    class RingOnly:
        rank, world_size = 0, 2

        def exchange(self, tensors, tag=0):   # pragma: no cover - never reached
            raise AssertionError

    q, k, v, _, _ = _inputs(8, 2)
    with pytest.raises(TypeError, match="all_to_all"):
        fd.ulysses_attention(q, k, v, ULYSSES_SPECS["none"], RingOnly())

