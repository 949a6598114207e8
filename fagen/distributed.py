"""Context parallelism: ring attention over torch.distributed (issue 59; docs/distributed.md).

Each rank holds a shard of the sequence: q, k, v of shape (batch, heads, local_seq, d), k and v possibly with
fewer heads (grouped KV heads). K/V shards travel around the ring (rank r sends to r + 1, receives from r - 1)
while each rank computes attention of its queries against the shard it holds; the partial outputs merge by
their LSE (`merge_partials`, fp32). The backward sends the K/V shards around again, each with its dK/dV
accumulator, which every rank adds its contribution to (the ring-flash-attention formulation: each block's
backward is given the merged o and LSE, so it returns exactly that block's share of dq, dk, dv).

    o = ring_attention(q, k, v, spec, group)                    # differentiable in q, k, v
    o, lse = ring_attention(q, k, v, spec, group, return_lse=True)   # lse (B, H, local_seq) too

Masks: `none`, and `causal` with the shards laid out `contiguous` (rank r holds chunk r of W) or `zigzag`
(rank r holds chunks r and 2W-1-r of 2W: every rank then has the same causal work; `shard_sequence`,
`unshard_sequence` and `shard_positions` cut a full sequence that way). Every local call is either a
square block on the diagonal (causal, so fagen's bottom-right alignment coincides with top-left) or a
block that is entirely visible (mask none); blocks entirely in the future are skipped (`ring_schedule`).

The local block is computed by a *local kernel* (`LocalKernel`): `FagenKernel` (the default; fagen's
own custom ops, CUDA) or `ReferenceKernel` (float64 torch, any device: what the CPU tests use). The
ring itself talks to a *ring communicator* (`ProcessGroupRing` over torch.distributed P2P,
`batch_isend_irecv`; `SimulatedRing`: W ranks as threads of one process, the same code path).

The all-to-all mode (DeepSpeed-Ulysses: `ulysses_attention`) swaps the sequence shards for head shards instead:
one all-to-all gives each rank the whole sequence of H / W query heads (and their K/V heads), the rank runs
one ordinary attention call on them (fagen.attention: every mask, window, mask_mod / score_mod that does not
read h), and a second all-to-all returns each rank its sequence shard of every head. The backward runs the
two exchanges the other way.

NCCL's NVLink multicast (NVLS) is turned off: importing this module sets NCCL_NVLS_ENABLE=0 in the
environment unless it is already set (child processes inherit it), and `init_process_group` forces it.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

# NVLink SHARP / multicast can take a shared host's GPUs out of service (issue 59): off unless the user says
# otherwise. NCCL reads it when a communicator is created, i.e. at the first NCCL operation of a group.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

try:
    import torch
except ModuleNotFoundError as err:   # the extra is not installed: say which one, not just the module
    raise ModuleNotFoundError("fagen.distributed needs PyTorch: pip install 'fagen[torch]'", name=err.name) from None

__all__ = [
    "ring_attention",
    "ring_attention_forward",
    "ring_attention_backward",
    "ulysses_attention",
    "merge_partials",
    "Block",
    "ring_schedule",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "zigzag_shard",
    "zigzag_unshard",
    "LocalKernel",
    "FagenKernel",
    "ReferenceKernel",
    "ProcessGroupRing",
    "SimulatedRing",
    "run_simulated",
    "init_process_group",
]

LAYOUTS = ("contiguous", "zigzag")


# ---- the LSE merge -------------------------------------------------------------------------------
def merge_partials(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None,
                   *, out: Optional[tuple] = None):
    """Merge attention outputs over disjoint sets of keys by their LSE: (o, lse) of the union.

        lse = logsumexp_i lse_i,    o = sum_i exp(lse_i - lse) * o_i

    outputs: tensors (..., d); lses: natural-log LSEs (...). Computed in `dtype` (default: float32, or
    float64 where an input is float64), and returned in it. Numerically stable: logsumexp subtracts the
    largest term, so every weight is in [0, 1]. A row that no partial saw (every lse_i = -inf) gives
    lse = -inf and o = 0, never NaN; a partial with lse_i = -inf has weight 0 whatever its o_i holds.

    out: (o, lse) tensors of `dtype` and the result's shapes to write the result into (and return); they may be
    outputs[0] and lses[0] themselves, which is how the ring adds a block into its running o and lse in place,
    but no other input."""
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"merge_partials: {len(outputs)} outputs and {len(lses)} LSEs; need the same number, >= 1")
    if dtype is None:
        dtype = torch.float32
        for t in (*outputs, *lses):
            dtype = torch.promote_types(dtype, t.dtype)
    o_out, lse_out = (None, None) if out is None else out
    stacked = torch.stack([lse.to(dtype) for lse in lses])   # (a copy: lse_out may be lses[0])
    lse = torch.logsumexp(stacked, dim=0, out=lse_out) if lse_out is not None else torch.logsumexp(stacked, dim=0)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)   # (-inf where every term is -inf)
    weights = torch.exp(stacked - finite).unsqueeze(-1).unbind(0)   # exp(-inf - x) = 0: masked partials drop out
    first = outputs[0].to(dtype)
    o = torch.mul(first, weights[0], out=o_out) if o_out is not None else first * weights[0]
    for w, part in zip(weights[1:], outputs[1:]):
        o.add_(w * part.to(dtype))
    return o, lse


# ---- the schedule -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One local kernel call of a ring step: queries `q_rows` of the rank's shard against keys `k_rows` of
    the K/V shard it holds at that step.

    mask: "none" (every key visible) or "causal" (a square block on the diagonal: key j visible iff j <= i;
    square, so fagen's bottom-right alignment is the same as top-left). q_positions / k_positions: where
    the block's rows sit in the full sequence, as runs (start, length), for kernels that need global
    positions (the reference kernel checks the mask against them; mask_mod / score_mod offsets later)."""
    q_rows: slice
    k_rows: slice
    mask: str
    q_positions: tuple
    k_positions: tuple


def _shard_runs(rank: int, world_size: int, local_len: int, layout: str) -> tuple:
    """The global positions of a shard's rows, as runs (start, length), in row order."""
    if layout == "contiguous":
        return ((rank * local_len, local_len),)
    chunk = local_len // 2
    return ((rank * chunk, chunk), ((2 * world_size - 1 - rank) * chunk, chunk))


def _runs_of(rows: slice, runs: tuple) -> tuple:
    """The runs of rows[rows] (a slice with step 1) of a shard laid out as `runs`."""
    out, first = [], 0
    for start, length in runs:
        lo, hi = max(rows.start, first), min(rows.stop, first + length)
        if lo < hi:
            out.append((start + lo - first, hi - lo))
        first += length
    return tuple(out)


def ring_schedule(rank: int, source: int, world_size: int, local_q: int, local_k: int, causal: bool,
                  layout: str = "contiguous") -> list:
    """The blocks rank `rank` computes while it holds the K/V shard of rank `source` (at ring step
    (rank - source) mod world_size). Blocks fully in the future are left out.

    contiguous: source == rank: the diagonal block (causal); source < rank: all visible; source > rank:
    nothing. zigzag (rank r holds chunks r and 2W-1-r, each local_len / 2 long): source == rank: causal over
    the whole local square (chunk r sees itself causally, chunk 2W-1-r sees chunk r fully and itself
    causally: exactly a causal mask on the concatenation); source < rank: every query against the source's
    first chunk (its second is in the future of both); source > rank: the second query chunk against both
    of the source's chunks (the first query chunk precedes both). With c = local_len / 2, every step of every
    rank then has 2c^2 visible pairs' worth of work (a causal 2c square, or a c x 2c / 2c x c block): the
    ranks are balanced, where with contiguous shards rank r has r + 1/2 blocks' worth and the last rank
    sets the pace."""
    _check_layout(layout)
    q_runs = _shard_runs(rank, world_size, local_q, layout)
    k_runs = _shard_runs(source, world_size, local_k, layout)

    def block(q_rows: slice, k_rows: slice, mask: str) -> Block:
        return Block(q_rows, k_rows, mask, _runs_of(q_rows, q_runs), _runs_of(k_rows, k_runs))

    all_q, all_k = slice(0, local_q), slice(0, local_k)
    if not causal:
        return [block(all_q, all_k, "none")]
    if local_q != local_k:
        raise ValueError(f"causal ring attention needs shards of q and k of one length, got {local_q} and {local_k}")
    if source == rank:
        return [block(all_q, all_k, "causal")]
    if layout == "contiguous":
        return [block(all_q, all_k, "none")] if source < rank else []
    half = local_q // 2
    if source < rank:
        return [block(all_q, slice(0, half), "none")]
    return [block(slice(half, local_q), all_k, "none")]


# ---- sharding helpers ---------------------------------------------------------------------------
def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r}; expected one of {LAYOUTS}")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s shard of a full sequence along `dim` (2 for (batch, heads, seq, d)).

    contiguous: chunk `rank` of `world_size` equal chunks. zigzag: the sequence cut into 2 * world_size
    chunks, the shard is chunks rank and 2 * world_size - 1 - rank, concatenated (a copy)."""
    _check_layout(layout)
    n = x.shape[dim]
    parts = world_size if layout == "contiguous" else 2 * world_size
    if n % parts:
        raise ValueError(f"{layout} sharding over {world_size} ranks needs a length divisible by {parts}, got {n}")
    chunks = x.chunk(parts, dim=dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's shard (shards[r] from rank r): `shard_sequence`'s inverse."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    world_size = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    chunks = [halves[r][0] for r in range(world_size)] + [halves[world_size - 1 - r][1] for r in range(world_size)]
    return torch.cat(chunks, dim=dim)


def shard_positions(rank: int, world_size: int, local_len: int, layout: str = "contiguous", device=None) -> torch.Tensor:
    """The global positions (int64) of a shard's rows: what rotary embeddings of the shard need."""
    _check_layout(layout)
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks: local length {local_len} is odd")
    return torch.cat([torch.arange(start, start + length, device=device)
                      for start, length in _shard_runs(rank, world_size, local_len, layout)])


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    return shard_sequence(x, rank, world_size, "zigzag", dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
    return unshard_sequence(shards, "zigzag", dim)


# ---- local kernels ------------------------------------------------------------------------------
class LocalKernel(Protocol):
    """What the ring asks of the kernel that computes one block (q, k, v: (B, H, n_q, d), (B, H_kv, n_k, d)).

    forward(q, k, v, block) -> (o, lse): o (B, H, n_q, d) in q's dtype or wider, lse (B, H, n_q) natural log,
        float32 or wider, -inf (and o = 0) for a row that sees no key of the block.
    backward(q, k, v, o, lse, do, d_lse, block) -> (dq, dk, dv): with o, lse the *merged* (global) ones of
        these query rows and do, d_lse (None or float32) their gradients, the gradients of this block's
        share: P = exp(S - lse), dS = P * (dO V^T - (rowsum(dO * o) - d_lse)). dk, dv have k's heads."""

    def forward(self, q, k, v, block: Block): ...

    def backward(self, q, k, v, o, lse, do, d_lse, block: Block): ...


def _parse_spec(spec):
    """A Spec from what fagen.attention takes as a spec (Spec, dict, JSON string, compiled Kernel)."""
    from fagen.spec import Spec, spec_from_dict

    if isinstance(spec, Spec):
        return spec
    if hasattr(spec, "spec") and isinstance(spec.spec, Spec):   # a compiled fagen.Kernel
        return spec.spec
    if isinstance(spec, str):
        return spec_from_dict(json.loads(spec), where="ring_attention spec")
    return spec_from_dict(spec, where="ring_attention spec")


def _check_ring_spec(spec) -> None:
    """The spec features the ring implements; the rest say so instead of computing something else."""
    unsupported = []
    if spec.mask not in ("none", "causal"):
        unsupported.append(f"mask {spec.mask!r} (only none and causal)")
    if spec.dropout:
        unsupported.append("dropout")
    if spec.mask_mod is not None or spec.score_mod is not None or spec.inputs:
        unsupported.append("mask_mod / score_mod")
    if spec.layout != "padded":
        unsupported.append("layout packed")
    if spec.value_head_dim is not None:
        unsupported.append("value_head_dim (v and o of their own head dim)")
    if spec.fp8:
        unsupported.append("dtype fp8_e4m3 (its forward alone, with bf16 o)")
    if unsupported:
        raise NotImplementedError("ring_attention does not implement " + ", ".join(unsupported) + " yet "
                                  "(docs/distributed.md)")


class ReferenceKernel:
    """The local kernel in float64 torch (any device): dense scores, the block's mask, the maths of
    LocalKernel's docstring. Returns float64. With `check_positions`, each block's mask is checked
    against its global positions (the spec's mask on the full sequence), which tests the schedule."""

    def __init__(self, spec, check_positions: bool = True):
        self.spec = _parse_spec(spec)
        _check_ring_spec(self.spec)
        self.check_positions = check_positions

    def _visible(self, block: Block, nq: int, nk: int, device) -> Optional[torch.Tensor]:
        visible = None
        if block.mask == "causal":
            if nq != nk:
                raise ValueError(f"a causal block must be square, got {nq} x {nk}")
            visible = torch.ones(nq, nk, dtype=torch.bool, device=device).tril()
        elif block.mask != "none":
            raise ValueError(f"block mask {block.mask!r}")
        if self.check_positions:
            qp = torch.cat([torch.arange(s, s + n) for s, n in block.q_positions]) if block.q_positions else None
            kp = torch.cat([torch.arange(s, s + n) for s, n in block.k_positions]) if block.k_positions else None
            if qp is None or kp is None or len(qp) != nq or len(kp) != nk:
                raise AssertionError(f"block positions {block.q_positions} x {block.k_positions} do not cover "
                                     f"its {nq} x {nk} rows")
            truth = (kp[None, :] <= qp[:, None]) if self.spec.mask == "causal" else torch.ones(nq, nk, dtype=torch.bool)
            got = torch.ones(nq, nk, dtype=torch.bool) if visible is None else visible.cpu()
            if not torch.equal(truth, got):
                raise AssertionError(f"block {block}: its mask {block.mask!r} is not the spec's {self.spec.mask!r} mask "
                                     "at its global positions")
        return visible

    def _scores(self, q, k, block):
        q64, k64 = q.to(torch.float64), k.to(torch.float64)
        group = q.shape[1] // k.shape[1]
        k64 = k64.repeat_interleave(group, dim=1)
        s = self.spec.scale * q64 @ k64.transpose(-1, -2)
        visible = self._visible(block, q.shape[2], k.shape[2], q.device)
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        return s, group

    def forward(self, q, k, v, block: Block):
        s, group = self._scores(q, k, block)
        lse = torch.logsumexp(s, dim=-1)
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - finite.unsqueeze(-1))
        return p @ v.to(torch.float64).repeat_interleave(group, dim=1), lse

    def backward(self, q, k, v, o, lse, do, d_lse, block: Block):
        s, group = self._scores(q, k, block)
        lse = lse.to(torch.float64)
        finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - finite.unsqueeze(-1))
        do64, v64 = do.to(torch.float64), v.to(torch.float64).repeat_interleave(group, dim=1)
        delta = (do64 * o.to(torch.float64)).sum(-1)
        if d_lse is not None:
            delta = delta - d_lse.to(torch.float64)
        ds = p * (do64 @ v64.transpose(-1, -2) - delta.unsqueeze(-1))
        k64 = k.to(torch.float64).repeat_interleave(group, dim=1)
        dq = self.spec.scale * ds @ k64
        dk = self.spec.scale * ds.transpose(-1, -2) @ q.to(torch.float64)
        dv = p.transpose(-1, -2) @ do64
        b, h, n, d = dk.shape
        return (dq, dk.view(b, h // group, group, n, d).sum(2), dv.view(b, h // group, group, n, d).sum(2))


class FagenKernel:
    """The local kernel on fagen's own kernels, through its custom ops (fagen/torch.py):
    `fagen::attention_forward_plain` for (o, lse) and `fagen::attention_backward_plain` given the merged o and
    lse and d_lse. Two variants of the spec: mask none (blocks fully visible) and causal (the diagonal).
    CUDA tensors of the spec's dtype and head dim. A fp16 / bf16 head dim that is not a multiple of 8 runs
    unpadded (correct, slower: fagen.attention pads those, the ops do not)."""

    def __init__(self, spec):
        import fagen.torch  # noqa: F401  (registers the ops)

        self.spec = _parse_spec(spec)
        _check_ring_spec(self.spec)
        from fagen.spec import spec_from_dict

        fields = self.spec.to_dict()
        fields.pop("name", None)   # the two variants must not share a name
        self.keys = {mask: spec_from_dict({**fields, "mask": mask}).canonical_json() for mask in ("none", "causal")}
        # the ops, looked up once (and replaceable on an instance, which the CPU tests use to see the calls)
        self.forward_op = torch.ops.fagen.attention_forward_plain
        self.backward_op = torch.ops.fagen.attention_backward_plain

    def prepare(self, device=None) -> "FagenKernel":
        """Compile (or load from the cache) both variants for a CUDA device (default: the current one), so
        that no rank compiles inside the ring; optional, the first call does it otherwise."""
        from fagen.torch import kernel_for

        index = None if device is None else torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        for key in self.keys.values():
            kernel_for(key, index)
        return self

    def forward(self, q, k, v, block: Block):
        if not q.is_cuda:
            raise ValueError(f"FagenKernel: q is on {q.device}; fagen's kernels need CUDA tensors "
                             "(ReferenceKernel runs anywhere)")
        return self.forward_op(q, k, v, self.keys[block.mask])

    def backward(self, q, k, v, o, lse, do, d_lse, block: Block):
        # the backward takes lse (and d_lse) contiguous fp32 (a zigzag block's rows are a strided view of them)
        if d_lse is not None:
            d_lse = _contiguous(d_lse.to(torch.float32))
        do = do if do.stride(-1) == 1 else _contiguous(do)
        return self.backward_op(q, k, v, o, _contiguous(lse.to(torch.float32)), do, d_lse, self.keys[block.mask])


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """t.contiguous(), written as a clone so that fake CUDA tensors on a CPU-only build take it too (the tests
    run FagenKernel's calls through the ops' fake implementations)."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


_fagen_kernels: dict = {}


def _default_kernel(spec) -> FagenKernel:
    from fagen.torch import spec_key

    key = spec_key(_parse_spec(spec))
    kernel = _fagen_kernels.get(key)
    if kernel is None:
        kernel = _fagen_kernels[key] = FagenKernel(spec)
    return kernel


# ---- ring communicators -------------------------------------------------------------------------
class ProcessGroupRing:
    """The ring over a torch.distributed process group: `exchange` sends tensors to the next rank and
    receives tensors of the same shapes from the previous one, by P2P (`batch_isend_irecv`; each tensor its
    own tag, which gloo matches on and NCCL ignores: every rank posts the same exchanges in the same order).
    With NCCL, ProcessGroupNCCL runs P2P on its own stream, which waits for the current stream's work up to
    the post and which the current stream waits for in `wait()`: the local kernels queued between the two
    overlap the transfer."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((self.rank + 1) % self.world_size)
        self.prev = to_global((self.rank - 1) % self.world_size)

    def exchange(self, tensors: Sequence[torch.Tensor], tag: int = 0):
        dist = self._dist
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag * 16 + n) for n, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag * 16 + n) for n, t in enumerate(received)]
        return _Pending(dist.batch_isend_irecv(ops), received)

    def all_to_all(self, chunks: Sequence[torch.Tensor]) -> list:
        """chunks[r] to rank r; returns what each rank r sent this one, in rank order (shapes as the caller's
        chunks: every rank sends chunks of one shape). Waits for the exchange."""
        chunks = [c.contiguous() for c in chunks]
        received = [torch.empty_like(c) for c in chunks]
        self._dist.all_to_all(received, chunks, group=self.group)
        return received


class _Pending:
    def __init__(self, requests, received):
        self._requests, self._received = requests, received

    def wait(self) -> list:
        for request in self._requests:
            request.wait()
        return self._received


class _SingleRank:
    """A world of one: nothing is ever exchanged (the ring's loops run one step)."""
    rank, world_size = 0, 1

    def exchange(self, tensors, tag: int = 0):   # pragma: no cover - never called with one rank
        raise RuntimeError("a world of one rank exchanges nothing")

    def all_to_all(self, chunks) -> list:
        return list(chunks)


class SimulatedRing:
    """W ranks of a ring inside one process, for tests: `member(rank)` is rank `rank`'s communicator,
    to be used from its own thread (`run_simulated`). An exchange delivers copies of the tensors to the
    next rank's mailbox under (tag); `wait()` blocks until the previous rank's arrive. A rank that fails
    breaks the ring, and every waiting rank then raises instead of hanging."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self._mail: list[dict] = [{} for _ in range(world_size)]
        self._all_to_alls = [0] * world_size   # per rank: the all-to-alls it made (their tags; see all_to_all)
        self._condition = threading.Condition()
        self.failed: Optional[BaseException] = None

    def member(self, rank: int) -> "_SimulatedMember":
        return _SimulatedMember(self, rank)

    def _post(self, rank: int, tag: int, tensors) -> None:
        with self._condition:
            self._mail[rank].setdefault(tag, []).append(tensors)
            self._condition.notify_all()

    def _take(self, rank: int, tag: int):
        with self._condition:
            ok = self._condition.wait_for(lambda: self.failed is not None or self._mail[rank].get(tag),
                                          timeout=self.timeout)
            if self.failed is not None:
                raise RuntimeError("simulated ring: another rank failed") from self.failed
            if not ok:
                raise TimeoutError(f"simulated ring: rank {rank} waited {self.timeout} s for tag {tag}")
            return self._mail[rank][tag].pop(0)

    def fail(self, error: BaseException) -> None:
        with self._condition:
            if self.failed is None:
                self.failed = error
            self._condition.notify_all()


class _SimulatedMember:
    def __init__(self, ring: SimulatedRing, rank: int):
        self.ring, self.rank, self.world_size = ring, rank, ring.world_size

    def exchange(self, tensors, tag: int = 0):
        self.ring._post((self.rank + 1) % self.world_size, tag, [t.detach().clone() for t in tensors])
        return _SimulatedPending(self.ring, self.rank, tag)

    def all_to_all(self, chunks) -> list:
        # every rank posts one chunk to each rank (its own included), with its rank, under the tag of its n-th
        # all-to-all (every rank makes the same calls in the same order; a fast rank's next one must not mix in).
        # The count lives on the ring, per rank, so that every member object of a rank shares it.
        ring = self.ring
        with ring._condition:
            ring._all_to_alls[self.rank] += 1
            tag = (_TAG_ALL_TO_ALL, ring._all_to_alls[self.rank])
        for target, chunk in enumerate(chunks):
            ring._post(target, tag, (self.rank, chunk.detach().clone()))
        received = sorted((ring._take(self.rank, tag) for _ in range(self.world_size)), key=lambda item: item[0])
        senders = [sender for sender, _ in received]
        if senders != list(range(self.world_size)):
            raise RuntimeError(f"simulated all-to-all {tag[1]} of rank {self.rank}: chunks from ranks {senders}")
        return [chunk for _, chunk in received]


class _SimulatedPending:
    def __init__(self, ring, rank, tag):
        self.ring, self.rank, self.tag = ring, rank, tag

    def wait(self) -> list:
        return self.ring._take(self.rank, self.tag)


def run_simulated(world_size: int, fn: Callable, timeout: float = 120.0) -> list:
    """Run fn(rank, ring) for every rank of a SimulatedRing of `world_size`, each rank in its own thread
    (ring: that rank's communicator, to pass as ring_attention's `group`). Returns the results in rank order;
    re-raises the first rank's exception. A CUDA device current in the caller is made current in each thread."""
    ring = SimulatedRing(world_size, timeout)
    results: list = [None] * world_size
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def body(rank):
        try:
            if device is not None:
                torch.cuda.set_device(device)
            results[rank] = fn(rank, ring.member(rank))
        except BaseException as err:   # noqa: BLE001 - reported below, after every thread ends
            ring.fail(err)

    threads = [threading.Thread(target=body, args=(rank,), name=f"ring-rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if ring.failed is not None:   # the first failure (the others are, as a rule, "another rank failed")
        raise ring.failed
    return results


def init_process_group(*args, **kwargs):
    """torch.distributed.init_process_group with NCCL_NVLS_ENABLE=0 set first (NCCL's NVLink multicast off,
    also for any process started after this). Arguments as torch's."""
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    return dist.init_process_group(*args, **kwargs)


def _ring_of(group):
    if group is not None and hasattr(group, "exchange") and hasattr(group, "world_size"):
        return group   # a ring communicator (SimulatedRing's member, ProcessGroupRing, your own)
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return _SingleRank()
    return ProcessGroupRing(group)


# ---- the ring -----------------------------------------------------------------------------------
_TAG_KV, _TAG_DKV, _TAG_ALL_TO_ALL = 1, 2, 3


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows `rows` of the sequence dim (2) as a view (narrow: what fake CUDA tensors on a CPU build take too)."""
    return t.narrow(2, rows.start, rows.stop - rows.start)


def _ring_forward(q, k, v, kernel, ring, causal: bool, layout: str):
    rank, world = ring.rank, ring.world_size
    acc = _accumulator_dtype(q.dtype)
    b, h, nq, d = q.shape
    o = torch.zeros(b, h, nq, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((b, h, nq), float("-inf"), dtype=acc, device=q.device)
    kv = (k, v)
    for step in range(world):
        # post the next shard's transfer first, so that it runs while this step's blocks compute
        pending = ring.exchange(kv, _TAG_KV * 1024 + step) if step + 1 < world else None
        source = (rank - step) % world
        for block in ring_schedule(rank, source, world, nq, k.shape[2], causal, layout):
            qr, kr = block.q_rows, block.k_rows
            o_b, lse_b = kernel.forward(_rows(q, qr), _rows(kv[0], kr), _rows(kv[1], kr), block)
            o_rows, lse_rows = _rows(o, qr), _rows(lse, qr)
            merge_partials([o_rows, o_b], [lse_rows, lse_b], acc, out=(o_rows, lse_rows))
        if pending is not None:
            kv = tuple(pending.wait())
    return o.to(q.dtype), lse


def _ring_backward(q, k, v, o, lse, do, d_lse, kernel, ring, causal: bool, layout: str):
    rank, world = ring.rank, ring.world_size
    acc = _accumulator_dtype(q.dtype)
    nq = q.shape[2]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = (k, v)
    dkv_pending = None
    for step in range(world):
        kv_pending = ring.exchange(kv, _TAG_KV * 1024 + step) if step + 1 < world else None
        source = (rank - step) % world
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for block in ring_schedule(rank, source, world, nq, k.shape[2], causal, layout):
            qr, kr = block.q_rows, block.k_rows
            dq_b, dk_b, dv_b = kernel.backward(_rows(q, qr), _rows(kv[0], kr), _rows(kv[1], kr), _rows(o, qr),
                                               _rows(lse, qr), _rows(do, qr),
                                               None if d_lse is None else _rows(d_lse, qr), block)
            _rows(dq, qr).add_(dq_b)
            _rows(dk, kr).add_(dk_b)
            _rows(dv, kr).add_(dv_b)
        # dK, dV of the shard held now: what the ranks before this one added (it travelled with the shard)
        # plus this rank's share; then on to the next rank. After the last step each shard is back home.
        if dkv_pending is not None:
            dk_in, dv_in = dkv_pending.wait()
            dk += dk_in
            dv += dv_in
        if world > 1:
            dkv_pending = ring.exchange((dk, dv), _TAG_DKV * 1024 + step)
        if kv_pending is not None:
            kv = tuple(kv_pending.wait())
    if dkv_pending is not None:
        dk, dv = dkv_pending.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel, ring, causal, layout):
        o, lse = _ring_forward(q, k, v, kernel, ring, causal, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.kernel, ctx.ring, ctx.causal, ctx.layout = kernel, ring, causal, layout
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, o, lse = ctx.saved_tensors
        # every rank takes part in the ring, even one whose loss read neither output (zeros then)
        grad_o = torch.zeros_like(o) if grad_o is None else grad_o
        dq, dk, dv = _ring_backward(q, k, v, o, lse, grad_o, grad_lse, ctx.kernel, ctx.ring, ctx.causal, ctx.layout)
        return dq, dk, dv, None, None, None, None


def _prepare(q, k, v, spec, group, layout: str, kernel):
    """(ring communicator, local kernel, causal) for a call, after checking what the ring can compute."""
    spec = _parse_spec(spec)
    _check_ring_spec(spec)
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"k and v must have one shape, q's batch, and heads dividing q's: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    causal = spec.mask == "causal"
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal ring attention needs shards of q and k of one length, got {q.shape[2]} and "
                         f"{k.shape[2]}")
    if layout == "zigzag" and (q.shape[2] % 2 or k.shape[2] % 2):
        raise ValueError(f"a zigzag shard holds two equal chunks: local lengths {q.shape[2]}, {k.shape[2]}; one is odd")
    return _ring_of(group), _default_kernel(spec) if kernel is None else kernel, causal


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, group=None, *,
                   layout: str = "contiguous", return_lse: bool = False, kernel: Optional[LocalKernel] = None):
    """Attention of the whole sequence, each rank holding its shard: q (B, H, n, d), k and v (B, H_kv, n_k, d)
    with H_kv dividing H, every rank the same shapes. Differentiable in q, k, v (and through lse).

    spec: as fagen.attention takes it (Spec, dict, JSON string); mask none or causal, no dropout, mask_mod,
    score_mod or packed layout (NotImplementedError). group: a torch.distributed process group (None: the
    default group, or a world of one without torch.distributed), or a ring communicator (`SimulatedRing`'s
    member). layout: how the sequence is sharded, `contiguous` or `zigzag` (`shard_sequence`); only causal
    masks depend on it. kernel: the local kernel (default `FagenKernel(spec)`: CUDA; `ReferenceKernel(spec)`
    on any device, float64).

    Returns o (q's dtype), and with return_lse the LSE (B, H, n) in float32 (float64 for float64 inputs).
    Every rank of the group must call it, forward and backward alike (it communicates); a rank whose loss
    reads neither output gets no backward call from autograd, and the others then wait for it."""
    ring, kernel, causal = _prepare(q, k, v, spec, group, layout, kernel)
    o, lse = _RingAttention.apply(q, k, v, kernel, ring, causal, layout)
    return (o, lse) if return_lse else o


def ring_attention_forward(q, k, v, spec, group=None, *, layout: str = "contiguous",
                           kernel: Optional[LocalKernel] = None):
    """ring_attention's forward without autograd: (o, lse). With `ring_attention_backward`, the two passes
    for code that drives its own backward. (Also what the simulated ring runs on a GPU: autograd runs CUDA
    nodes of every thread's graph on one device thread, where the simulated ranks' backwards, each waiting
    for the others, would block one another.)"""
    ring, kernel, causal = _prepare(q, k, v, spec, group, layout, kernel)
    with torch.no_grad():
        return _ring_forward(q, k, v, kernel, ring, causal, layout)


def ring_attention_backward(q, k, v, o, lse, do, d_lse, spec, group=None, *, layout: str = "contiguous",
                            kernel: Optional[LocalKernel] = None):
    """ring_attention's backward without autograd: (dq, dk, dv) of this rank's shards, from the forward's o and
    lse and their gradients do (a tensor) and d_lse (None where the loss did not read lse)."""
    ring, kernel, causal = _prepare(q, k, v, spec, group, layout, kernel)
    with torch.no_grad():
        return _ring_backward(q, k, v, o, lse, do, d_lse, kernel, ring, causal, layout)


# ---- the all-to-all mode (DeepSpeed-Ulysses) ---------------------------------------------------------
def _communicator_of(group):
    """A communicator with all_to_all (SimulatedRing's member, ProcessGroupRing, your own), from `group`."""
    if group is not None and hasattr(group, "all_to_all") and hasattr(group, "world_size"):
        return group
    comm = _ring_of(group)
    if not hasattr(comm, "all_to_all"):
        raise TypeError(f"ulysses_attention needs a communicator with all_to_all(chunks) -> list (chunks[r] to rank "
                        f"r; what each rank sent back, in rank order): {type(comm).__name__} has none")
    return comm


def _heads_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[1] // world
    return t.narrow(1, rank * per, per)


def _sequence_to_heads(t: torch.Tensor, comm, layout: str) -> torch.Tensor:
    """(B, H, n, ...) this rank's sequence shard of every head -> (B, H / W, W n, ...) the whole sequence of its
    heads (rank r: heads r H / W ..), in sequence order whatever the shards' layout."""
    world = comm.world_size
    received = comm.all_to_all([_heads_of(t, r, world) for r in range(world)])
    return unshard_sequence(received, layout, dim=2)


def _heads_to_sequence(t: torch.Tensor, comm, layout: str) -> torch.Tensor:
    """_sequence_to_heads' inverse: (B, H / W, N, ...) -> (B, H, N / W, ...)."""
    world = comm.world_size
    received = comm.all_to_all([shard_sequence(t, r, world, layout, dim=2) for r in range(world)])
    return torch.cat(received, dim=1)


class _AllToAll(torch.autograd.Function):
    """_sequence_to_heads (to_heads) or _heads_to_sequence; each one's backward is the other."""

    @staticmethod
    def forward(ctx, t, comm, layout, to_heads):
        ctx.comm, ctx.layout, ctx.to_heads = comm, layout, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(t, comm, layout)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return inverse(grad.contiguous(), ctx.comm, ctx.layout), None, None, None


def _check_ulysses_spec(spec) -> None:
    """What the all-to-all mode computes exactly as one GPU would; the rest say so. A rank holds heads
    r H / W .. of the whole sequence, and the kernels number them from 0: dropout's stream and a mask_mod /
    score_mod that reads h would see other heads than on one GPU."""
    unsupported = []
    if spec.dropout:
        unsupported.append("dropout (its random stream is keyed by the head)")
    modifiers = spec.modifiers
    from fagen.expressions import H

    if any(expr is not None and H in expr.free_symbols for expr in (modifiers.mask, modifiers.score)):
        unsupported.append("a mask_mod / score_mod that reads h")
    if spec.layout != "padded":
        unsupported.append("layout packed")
    if spec.mask == "block_sparse":
        unsupported.append("mask block_sparse")
    if spec.value_head_dim is not None:
        unsupported.append("value_head_dim (v and o of their own head dim)")
    if spec.fp8:
        unsupported.append("dtype fp8_e4m3 (its forward alone, with bf16 o)")
    if unsupported:
        raise NotImplementedError("ulysses_attention does not implement " + ", ".join(unsupported) + " yet "
                                  "(docs/distributed.md)")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec, group=None, *,
                      layout: str = "contiguous", return_lse: bool = False, attend: Optional[Callable] = None,
                      kv_lengths=None, inputs: Optional[dict] = None):
    """Attention of the whole sequence by all-to-all (DeepSpeed-Ulysses), each rank holding its shard: q
    (B, H, n, d), k and v (B, H_kv, n_k, d), every rank the same shapes (the exchanges size what they receive by
    what they send), sharded as `layout` says
    (`shard_sequence`). Differentiable in q, k, v (and through lse). Needs H divisible by the world size W,
    and H_kv either divisible by W (each rank gets H_kv / W K/V heads) or dividing it (each rank's query heads
    share one K/V head, which it receives).

    Every spec feature of a single call works (masks, windows, padding with `kv_lengths`, a mask_mod /
    score_mod and its `inputs`, bottom-right alignment of n != n_k) except dropout, a mask_mod / score_mod that
    reads h, block_sparse and layout packed (NotImplementedError; see `_check_ulysses_spec`). `attend(q, k,
    v, **extra) -> (o, lse)` computes a rank's heads over the whole sequence, `extra` holding `kv_lengths` and
    `inputs` where given: default fagen.attention with the spec (CUDA); the CPU tests pass a float64 one. group: as ring_attention's. Returns o (and with return_lse the
    LSE, (B, H, n) float32) of this rank's shard."""
    spec = _parse_spec(spec)
    _check_ulysses_spec(spec)
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"q, k, v must be (batch, heads, seq, head_dim) with k and v of one shape and q's batch, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    comm = _communicator_of(group)
    world = comm.world_size
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % world or heads % kv_heads:
        raise ValueError(f"ulysses_attention splits the query heads over the ranks: {heads} query heads, "
                         f"{kv_heads} K/V heads and {world} ranks (the heads must divide by the ranks, and the "
                         f"K/V heads divide the query heads)")
    if kv_heads % world:
        if world % kv_heads:
            raise ValueError(f"{kv_heads} K/V heads over {world} ranks: the K/V heads must divide by the ranks, or "
                             f"divide them (each rank's query heads then share one K/V head)")
        # rank r's query heads all read K/V head r // (W / H_kv): each rank is sent that one
        k, v = (t.repeat_interleave(world // kv_heads, dim=1) for t in (k, v))
    if layout == "zigzag" and (q.shape[2] % 2 or k.shape[2] % 2):
        raise ValueError(f"a zigzag shard holds two equal chunks: local lengths {q.shape[2]}, {k.shape[2]}; one is odd")
    extra = {name: value for name, value in (("kv_lengths", kv_lengths), ("inputs", inputs)) if value is not None}
    if attend is None:
        import fagen.torch as fagen_torch

        def attend(q_, k_, v_, **given):
            return fagen_torch.attention(q_, k_, v_, spec, return_lse=True, **given)

    q_full, k_full, v_full = (_AllToAll.apply(t, comm, layout, True) for t in (q, k, v))
    o_full, lse_full = attend(q_full, k_full, v_full, **extra)
    o = _AllToAll.apply(o_full, comm, layout, False)
    if not return_lse:
        return o
    lse = _AllToAll.apply(lse_full.to(_accumulator_dtype(q.dtype)).unsqueeze(-1), comm, layout, False)
    return o, lse.squeeze(-1)

