"""The disk cache (fagen/cache.py) and the run-time cubin cache on top of it (fagen/compiler.py)."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fagen.cache import DIGEST_BYTES, DiskCache, digest
from fagen.compiler import cubin_key, nvcc_available
from fagen.sources import TEMPLATE_DIR, fingerprint

ROOT = Path(__file__).resolve().parent.parent


def test_digest_separates_its_parts():
    assert digest("ab", "c") != digest("a", "bc")
    assert digest("x") == digest(b"x")


def test_round_trip_and_atomic_layout(tmp_path):
    cache = DiskCache(tmp_path)
    assert cache.get("cubin", "ab" * 32) is None
    cache.put("cubin", "ab" * 32, b"payload")
    assert cache.get("cubin", "ab" * 32) == b"payload"
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["ab" * 32], "no temporary files left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_corrupt_entries_are_reported_once_removed_and_rebuilt(tmp_path, damage):
    cache = DiskCache(tmp_path)
    key = digest("entry")
    cache.put("plan", key, b"x" * 1000)
    path = cache.path("plan", key)
    raw = path.read_bytes()
    path.write_bytes({"truncate": raw[:500], "flip": raw[:-1] + bytes([raw[-1] ^ 1]), "empty": b""}[damage])
    with pytest.warns(UserWarning, match="corrupt"):
        assert cache.get("plan", key) is None
    assert not path.exists()
    built = []
    assert cache.get_or_build("plan", key, lambda: built.append(1) or b"fresh") == b"fresh"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get("plan", key) == b"fresh"
    assert built == [1]


def test_unwritable_cache_warns_and_still_returns_the_build(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = DiskCache(blocker)   # every path under a file fails to be created
    with pytest.warns(UserWarning):
        assert cache.get_or_build("cubin", digest("k"), lambda: b"built") == b"built"


def test_cubin_key_follows_source_headers_and_arch():
    base = cubin_key("source", "sm_90", TEMPLATE_DIR)
    assert base == cubin_key("source", "sm_90", TEMPLATE_DIR)
    assert base != cubin_key("source ", "sm_90", TEMPLATE_DIR)
    assert base != cubin_key("source", "sm_80", TEMPLATE_DIR)


def test_fingerprint_is_stable_within_a_process():
    assert fingerprint() == fingerprint() and len(fingerprint()) == 64


_BUILD = r"""
import sys
from fagen.compiler import cached_cubin
from fagen.sources import TEMPLATE_DIR
data = cached_cubin(sys.argv[1], "sm_80", TEMPLATE_DIR)
print(len(data))
"""


@pytest.mark.skipif(not nvcc_available(), reason="nvcc is not on PATH")
def test_processes_compiling_the_same_source_at_once_all_succeed_with_one_entry(tmp_path):
    source = '#include "attention_common.cuh"\nextern "C" __global__ void probe_kernel(float* x) { x[0] = 1.f; }\n'
    env = dict(os.environ, FAGEN_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, source], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outputs]
    sizes = {int(out.strip()) for out, _ in outputs}
    assert len(sizes) == 1 and sizes.pop() > 0
    entries = [p for p in (tmp_path / "cubin").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert len(entries) == 1
    assert len(entries[0].read_bytes()) > DIGEST_BYTES
