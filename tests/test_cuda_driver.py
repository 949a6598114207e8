"""CPU tests of fagen/cuda_driver.py's launch wrappers, against a stand-in for libcuda."""
import ctypes

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
