"""fagen/pad_rows.py without a GPU: its kernel compiles for sm_80 and sm_90 without spills, and the launch
argument struct has the size the kernel's Args has (3 operands of 8 eight-byte fields, then 3 more).
The kernel's results are checked on a GPU in tests/test_pad_rows_gpu.py."""
import pytest

from fagen.compiler import compile_cubin, nvcc_available
from fagen.sources import TEMPLATE_DIR

ARCHS = ("sm_80", "sm_90")


@pytest.mark.skipif(not nvcc_available(), reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
def test_pad_kernel_compiles_without_spills(arch):
    compiled = compile_cubin((TEMPLATE_DIR / "pad_rows.cu").read_text(), arch, TEMPLATE_DIR)
    report = compiled.resources["fagen_pad_rows"]
    assert report["spill_stores"] == report["spill_loads"] == 0, report
    assert report["registers"] <= 64, report   # __launch_bounds__(256) and a grid-stride loop: keep it light


def test_launch_struct_matches_the_kernels_args():
    pad_rows = pytest.importorskip("fagen.pad_rows")
    assert pad_rows._ARGS.size == (pad_rows.OPERANDS * 8 + 3) * 8 == 216   # templates/pad_rows.cu static_asserts 216
    # the grid-stride loop's last step stays below 2^31 (the kernel's 32-bit chunk index)
    assert pad_rows._CHUNK_LIMIT + pad_rows._GRID_LIMIT * pad_rows._THREADS <= 2 ** 31 - 1
    assert pad_rows.CHUNK * 2 == 16   # one 16-byte store of 2-byte elements per thread
