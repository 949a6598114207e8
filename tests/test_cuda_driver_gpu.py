"""GPU tests of the context every launch and memset is queued in (fagen/cuda_driver.py enter_device): a thread
with no CUDA context at all, and tensors on a GPU that is not the thread's current one (a model put on cuda:1
without torch.cuda.set_device(1), or split over GPUs). Each call must give the float64 reference's answer and
leave the caller's current device as it found it.

Run on a GPU machine: python -m pytest -m gpu tests/test_cuda_driver_gpu.py (the second-GPU tests need two).
"""
import threading

import numpy as np
import pytest

from fagen.spec import Spec

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

PADDED = Spec(head_dim=64, dtype="bf16", mask="causal")
PACKED = Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed")


def two_gpus():
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two GPUs")


def as64(t):
    return t.detach().double().cpu().numpy()


def relative(got, want) -> float:
    got = as64(got)
    assert np.isfinite(got).all(), "NaN or inf in the output"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def padded_case(device, seed):
    generator = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(2, 3, 200, 64, device=device, dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    return q, k, v, do


def padded_reference(q, k, v, do):
    """float64 causal attention and its gradients, on the CPU."""
    q64, k64, v64 = (torch.tensor(as64(t), requires_grad=True) for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * 64 ** -0.5
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(s, -1) @ v64
    o.backward(torch.tensor(as64(do)))
    return [as64(t) for t in (o, q64.grad, k64.grad, v64.grad)]


def packed_case(device, seed, lengths=(130, 0, 1, 77)):
    generator = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, 4, 128, device=device, dtype=torch.bfloat16, generator=generator)
                   for _ in range(4))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    return q, k, v, do, cu, max(lengths)


def check_padded(kernel, q, k, v, do, **call):
    """Forward and backward through the kernel's API: the first call of a shape runs the full path, the second
    the remembered fast path; both against the reference."""
    want = padded_reference(q, k, v, do)
    for _ in range(2):
        o, lse = kernel.forward(q, k, v, **call)
        grads = kernel.backward(q, k, v, o, lse, do, **call)
        torch.cuda.synchronize(q.device)
        for got, expected in zip((o, *grads), want):
            assert relative(got, expected) < 1e-2


def check_packed(kernel, q, k, v, do, cu, longest, before_each_call=lambda: None):
    """A packed batch, offsets on the GPU: its fast paths fill o, lse and the gradients by cuMemset."""
    from fagen import reference

    cu64 = cu.cpu().numpy()
    want_o, _ = reference.packed_forward(as64(q), as64(k), as64(v), cu64, cu64, PACKED)
    want_grads = reference.packed_backward(as64(q), as64(k), as64(v), as64(do), cu64, cu64, PACKED, o=want_o)
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    for _ in range(2):
        before_each_call()
        o, lse = kernel.forward(q, k, v, **call)
        before_each_call()
        grads = kernel.backward(q, k, v, o, lse, do, **call)
        torch.cuda.synchronize(q.device)
        for got, expected in zip((o, *grads), (want_o, *want_grads)):
            assert relative(got, expected) < 1e-2
        del o, lse, grads


@pytest.fixture(scope="module")
def kernels():
    from fagen.jit import compile, precompile

    precompile([PADDED, PACKED])
    return compile(PADDED), compile(PACKED)


def test_calls_from_a_thread_with_no_context(kernels, monkeypatch):
    """A thread whose driver has no current context (autograd's device threads start so): the calls bind the
    device's primary context themselves. The context is unbound before every call, full path then fast path,
    padded and packed (whose fast paths fill by cuMemset); enter_device is watched to see that it did meet a
    thread without one (torch's own runtime calls, an allocation that misses its cache, may bind one first)."""
    from fagen import cuda_driver as driver

    padded, packed = kernels
    seen = []
    real_enter = driver.enter_device

    def watched(device):
        seen.append(driver.current_device())
        return real_enter(device)

    monkeypatch.setattr(driver, "enter_device", watched)
    errors = []

    def unbind():
        driver.check(driver._load().cuCtxSetCurrent(None), "unbinding the thread's context")
        assert driver.current_device() is None

    def run():
        try:
            q, k, v, do = padded_case("cuda:0", 1)
            want = padded_reference(q, k, v, do)
            for _ in range(2):   # the full path, then the remembered one
                unbind()
                o, lse = padded.forward(q, k, v)
                unbind()
                grads = padded.backward(q, k, v, o, lse, do)
                torch.cuda.synchronize()
                for got, expected in zip((o, *grads), want):
                    assert relative(got, expected) < 1e-2
                del o, lse, grads
            q, k, v, do, cu, longest = packed_case("cuda:0", 2)
            check_packed(packed, q, k, v, do, cu, longest, before_each_call=unbind)
            assert driver.current_device() == 0
        except BaseException as err:   # (reported on the test's thread)
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    assert None in seen, "no launch or memset met a thread without a context"


@two_gpus()
def test_tensors_on_a_gpu_that_is_not_the_current_one(kernels):
    """cuda:0 current, tensors on cuda:1: every launch and memset goes to cuda:1 (its context, its stream),
    through the API, an explicit stream and autograd, and the thread's current device is still cuda:0 after."""
    import fagen
    from fagen import cuda_driver as driver
    from fagen import runtime

    padded, packed = kernels
    torch.cuda.set_device(0)
    check_padded(padded, *padded_case("cuda:1", 3))
    assert torch.cuda.current_device() == 0 and driver.current_device() == 0
    check_packed(packed, *packed_case("cuda:1", 4))
    assert torch.cuda.current_device() == 0 and driver.current_device() == 0

    side = torch.cuda.Stream(device="cuda:1")
    q, k, v, do = padded_case("cuda:1", 5)
    side.wait_stream(torch.cuda.current_stream("cuda:1"))
    check_padded(padded, q, k, v, do, stream=side)
    assert torch.cuda.current_device() == 0

    previous = runtime.CHECK_LAUNCHES
    runtime.CHECK_LAUNCHES = True   # the debug switch synchronises the tensors' device, not the current one
    try:
        q, k, v, do = padded_case("cuda:1", 6)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want = padded_reference(q, k, v, do)
        for _ in range(2):
            for t in leaves:
                t.grad = None
            o = fagen.attention(*leaves, PADDED)
            o.backward(do)
            for got, expected in zip((o, *(t.grad for t in leaves)), want):
                assert relative(got, expected) < 1e-2
    finally:
        runtime.CHECK_LAUNCHES = previous
    assert torch.cuda.current_device() == 0 and driver.current_device() == 0


@two_gpus()
def test_each_gpu_gets_its_own_answer_when_both_are_used(kernels):
    """The same shapes on cuda:0 and cuda:1, alternately: the remembered calls are per device (a launch of
    cuda:0's kernel on cuda:1's data would fault or give cuda:0's numbers)."""
    padded, _ = kernels
    cases = {device: padded_case(device, seed) for seed, device in enumerate(("cuda:0", "cuda:1"), start=7)}
    for _ in range(2):
        for device, case in cases.items():
            check_padded(padded, *case)
    assert torch.cuda.current_device() == 0
