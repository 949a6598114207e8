"""Hypothesis profiles: `ci` (derandomized, small fixed budget, never flaky) and `gpu` (more examples).

Pick one with FAGEN_HYPOTHESIS_PROFILE (default `ci`) or hypothesis's own `--hypothesis-profile`.
"""
import os
import sys

import pytest
from hypothesis import settings

# Under pytest-xdist (`python -m pytest -n auto`) each worker is one process per core: PyTorch's own intra-op
# threads on top of that oversubscribe the cores (its OpenMP threads spin), which made the torch and
# transformers CPU tests twice as slow on 2 cores. One thread per worker, unless the environment says otherwise.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None, print_blob=True)
settings.register_profile("gpu", max_examples=100, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("FAGEN_HYPOTHESIS_PROFILE", "ci"))


def gpu_unavailable_reason():
    """None when PyCUDA, PyTorch and a CUDA GPU are all present; otherwise why GPU tests skip."""
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        return "PyCUDA is not installed (pip install -e '.[gpu]')"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def pytest_configure(config):
    """FAGEN_REQUIRE_TORCH=1 (.ci/run sets it): torch and transformers must import, so that their CPU tests run
    rather than skip with "could not import"."""
    if os.environ.get("FAGEN_REQUIRE_TORCH"):
        for module in ("torch", "transformers"):
            try:
                __import__(module)
            except ImportError as err:
                raise pytest.UsageError(f"FAGEN_REQUIRE_TORCH is set but {module} cannot be imported ({err})")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = gpu_unavailable_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty FAGEN_CACHE_DIR for one test (kernels, plans and autotune results)."""
    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
