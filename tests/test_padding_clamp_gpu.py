"""GPU tests of the padding mask's clamp: kv_lengths read from device memory outside [0, Nk] behave as
if clamped to [0, Nk] (templates/attention_common.cuh, visible_keys), forward and backward, on every
kind of template: mma.sync (fp16, d = 96), wgmma on sm_90 (bf16, d = 64), and the CUDA-core ones
(fp32, both loop orders, the deterministic backward). Nothing is read out of bounds (run under
compute-sanitizer to see that directly), and a length that clamps to 0 gives O = 0, LSE = -inf and
zero gradients, exactly.

Run on a GPU machine: python -m pytest -m gpu tests/test_padding_clamp_gpu.py
"""
import numpy as np
import pytest

from fagen.spec import Spec

pytestmark = pytest.mark.gpu

SPECS = [
    Spec(head_dim=96, dtype="fp16", mask="padding"),                  # forward_fa2_mma, backward_fa2_mma
    Spec(head_dim=64, dtype="bf16", mask="padding"),                  # forward_wgmma, backward_wgmma on sm_90
    Spec(head_dim=64, dtype="fp32", mask="padding"),                  # forward_fa2_simt, backward_simt
    Spec(head_dim=32, dtype="fp32", mask="padding", loop_order="fa1", deterministic=True),  # forward_fa1_simt
]
BATCH, HEADS, SEQ_Q, SEQ_K = 4, 2, 150, 133  # neither length a multiple of any tile
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
LENGTHS = {
    "brief": [-3, 0, SEQ_K + 5, SEQ_K // 2],
    "int32-extremes": [INT32_MAX, INT32_MIN, 1, SEQ_K],
}


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    from fagen.jit import precompile

    precompile(SPECS)


def _as64(tensor) -> np.ndarray:
    return tensor.detach().double().cpu().numpy()


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.canonical_name)
def test_out_of_range_kv_lengths_act_clamped(spec, lengths):
    import torch

    import fagen
    from fagen import reference
    from fagen.testing import CANCELLATION_FLOOR, TOLERANCES, Case, make_inputs, relative_error

    kernel = fagen.compile(spec)
    templates = {name: plan.template for name, plan in kernel.plans.items()}
    case = Case(batch=BATCH, heads=HEADS, seq_q=SEQ_Q, seq_k=SEQ_K, layout="bhnd", data_seed=3, seed=0, offset=0)
    q, k, v = make_inputs(spec, case)
    (do,) = make_inputs(spec, Case(**{**case.__dict__, "data_seed": 4}), names=("do",))
    # On the device, as a model passes them: the runtime cannot check them there without a sync, and
    # rejects out-of-range host arrays before launch, so only device lengths reach the kernels' clamp.
    device_lengths = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    clamped = np.clip(lengths, 0, SEQ_K)

    # Outputs poisoned with NaN, so that an element a kernel leaves unwritten fails.
    o = torch.full_like(q, float("nan"))
    lse = torch.full((BATCH, HEADS, SEQ_Q), float("nan"), device="cuda")
    kernel.forward(q, k, v, kv_lengths=device_lengths, out=(o, lse))
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    kernel.backward(q, k, v, o, lse, do, kv_lengths=device_lengths, out=grads)
    torch.cuda.synchronize()

    qn, kn, vn, don, on, lsen = (_as64(t) for t in (q, k, v, do, o, lse))
    dq, dk, dv = (_as64(t) for t in grads)
    where = f"{spec.variant_name} ({templates}), kv_lengths {lengths} -> {clamped.tolist()}"
    # The reference clamps the same way (out-of-range lengths given to it as they are).
    ref_o, ref_lse = reference.attention_forward(qn, kn, vn, spec, kv_lengths=np.array(lengths, dtype=np.int64))
    tolerance = TOLERANCES[spec.dtype]
    assert relative_error(on, ref_o) <= tolerance, f"o: {where}"
    assert np.array_equal(np.isneginf(lsen), np.isneginf(ref_lse)) and not np.isnan(lsen).any(), f"lse: {where}"
    finite = np.isfinite(ref_lse)
    assert relative_error(lsen[finite], ref_lse[finite]) <= tolerance, f"lse: {where}"
    magnitudes = {}
    ref_grads = reference.attention_backward(qn, kn, vn, don, spec, kv_lengths=np.array(lengths, dtype=np.int64),
                                             o=on, magnitudes=magnitudes)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        error = relative_error(got, ref, CANCELLATION_FLOOR * magnitudes.get(name, 0.0))
        assert error <= tolerance, f"{name}: relative error {error:.3g}: {where}"

    # Exactly zero where nothing is visible: whole batch entries clamped to no key, and every key at or
    # past the clamped length (no tile beyond it contributes, and none is left unwritten).
    for b, n in enumerate(clamped):
        if n == 0:
            assert (on[b] == 0).all() and np.isneginf(lsen[b]).all(), f"batch entry {b}: {where}"
            assert (dq[b] == 0).all(), f"dq of batch entry {b}: {where}"
        assert (dk[b, :, n:] == 0).all() and (dv[b, :, n:] == 0).all(), f"dk/dv past key {n} of batch entry {b}: {where}"
