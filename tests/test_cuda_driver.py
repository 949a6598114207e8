"""CPU tests of fagen/cuda_driver.py's launch wrappers and context handling, against stand-ins for libcuda."""
import ctypes

import pytest

from fagen import cuda_driver as driver


class _FakeLib:
    def __init__(self, code: int):
        self.code, self.calls = code, []

    def cuLaunchKernel(self, *args):
        self.calls.append(args)
        return self.code

    def cuGetErrorName(self, code, name):
        name._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0

    def cuGetErrorString(self, code, text):
        text._obj.value = b"invalid argument"
        return 0


def test_prepared_launch_passes_converted_arguments_and_names_the_kernel_on_failure(monkeypatch):
    fake = _FakeLib(code=1)
    monkeypatch.setattr(driver, "_lib", fake)
    launch = driver.PreparedLaunch(0x1234, (3, 2, 1), 256, 99 * 1024, "fagen_bwd_test")
    params = (ctypes.c_void_p * 1)(None)
    assert launch(0x42, params) == 1
    (args,) = fake.calls
    assert [a.value for a in args[:8]] == [0x1234, 3, 2, 1, 256, 1, 1, 99 * 1024]
    assert args[8].value == 0x42 and args[9] is params and args[10] is None
    message = str(launch.failed(1))
    assert "fagen_bwd_test" in message and "(3, 2, 1)" in message and "256 threads" in message
    assert "CUDA_ERROR_INVALID_VALUE" in message and "invalid argument" in message


class _StandInDriver:
    """libcuda's context calls for fagen.cuda_driver, without a GPU: contexts are ints, each thread one current."""

    def __init__(self, current, devices):
        self.current, self.devices, self.calls = current, devices, []   # devices: context -> its device

    def get_current(self, address):   # cuCtxGetCurrent, its out-parameter by address (enter_device's form)
        ctypes.c_void_p.from_address(address).value = self.current
        return 0

    def cuCtxGetDevice(self, pointer):
        pointer._obj.value = self.devices[self.current]
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(("set", context))
        self.current = context
        return 0


PRIMARY = {0: 1000, 1: 1001}   # device -> its primary context (stand-ins)


@pytest.mark.parametrize("current, device, switched, restored, after", [
    (1001, 1, None, None, 1001),    # the device's primary context current already: nothing to do
    (1000, 1, 1001, 1000, 1000),    # cuda:0's current, tensors on cuda:1 (a model split over GPUs): there and back
    (None, 1, 1001, None, 1001),    # no context (autograd's device thread): the primary one made current, and kept
    (2000, 1, None, None, 2000),    # a context the caller made on this device (PyCUDA's autoinit): left current
])
def test_work_is_queued_in_a_context_of_the_tensors_device(monkeypatch, current, device, switched, restored, after):
    """cuda_driver.enter_device / leave_device, around every launch and memset: the thread's current context made
    one of the tensors' device for the call and the caller's given back after. No GPU: the driver is a stand-in."""
    lib = _StandInDriver(current, {1000: 0, 1001: 1, 2000: 1})
    monkeypatch.setattr(driver, "_lib", lib)
    monkeypatch.setattr(driver, "_get_current_context", lib.get_current)
    monkeypatch.setattr(driver, "_primary_contexts", dict(PRIMARY))
    previous = driver.enter_device(device)
    assert lib.current == (switched or current)
    assert lib.calls == ([("set", switched)] if switched else [])
    driver.leave_device(previous)
    assert lib.current == after
    assert lib.calls == [c for c in (("set", switched), ("set", restored)) if c[1]]
