"""fagen/tuning.py: the autotune results file (round trip, corrupt files, keys) and the rule that
keeps the runtime apart from the benchmark: it reads these results, it never imports what measures them."""
import json
import subprocess
import sys

import pytest

from fagen import tuning
from fagen.spec import Spec

GPU = "NVIDIA H200"
SPEC = Spec(name="d64_bf16", head_dim=64, dtype="bf16")


pytestmark = pytest.mark.usefixtures("cache_dir")   # conftest.py: a fresh FAGEN_CACHE_DIR per test


# ---- the cache ----------------------------------------------------------------------------------
def test_lookup_of_a_missing_cache_file_is_none(cache_dir):
    assert not (cache_dir / "autotune.json").exists()
    assert tuning.lookup(SPEC, GPU) is None


def test_lookup_of_a_missing_entry_is_none():
    tuning.store(SPEC, GPU, {"passes": {}})
    assert tuning.lookup(SPEC.model_copy(update={"dtype": "fp16"}), GPU) is None
    assert tuning.lookup(SPEC, "NVIDIA H100 80GB HBM3") is None
    assert tuning.lookup(SPEC, GPU) == {"passes": {}}


def test_corrupt_or_foreign_cache_reads_as_empty(cache_dir):
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "autotune.json").write_text("{not json")
    assert tuning.lookup(SPEC, GPU) is None
    (cache_dir / "autotune.json").write_text(json.dumps({"version": 99, "entries": {GPU: {}}}))
    assert tuning.lookup(SPEC, GPU) is None
    tuning.store(SPEC, GPU, {"passes": {}})  # replaces it with a valid file
    assert tuning.lookup(SPEC, GPU) == {"passes": {}}


def test_store_keeps_other_entries_and_writes_under_fagen_cache_dir(cache_dir):
    other = Spec(head_dim=128, dtype="fp16", mask="causal")
    tuning.store(SPEC, GPU, {"passes": {}, "n": 1})
    tuning.store(other, GPU, {"passes": {}, "n": 2})
    tuning.store(SPEC, "Another GPU", {"passes": {}, "n": 3})
    tuning.store(SPEC, GPU, {"passes": {}, "n": 4})  # replaces the first
    data = json.loads((cache_dir / "autotune.json").read_text())
    assert data["version"] == tuning.CACHE_VERSION
    assert tuning.lookup(SPEC, GPU)["n"] == 4
    assert tuning.lookup(other, GPU)["n"] == 2
    assert tuning.lookup(SPEC, "Another GPU")["n"] == 3
    assert [p.name for p in cache_dir.iterdir()] == ["autotune.json"]  # no temporary files left behind


def test_the_key_ignores_the_name_but_not_the_fields():
    assert tuning.spec_key(SPEC) == tuning.spec_key(SPEC.model_copy(update={"name": None}))
    assert tuning.spec_key(SPEC) != tuning.spec_key(SPEC.model_copy(update={"arch": "sm_80"}))
    assert tuning.spec_key(SPEC) != tuning.spec_key(SPEC.model_copy(update={"mask": "causal"}))


# ---- layout -------------------------------------------------------------------------------------
def test_the_runtime_imports_neither_the_benchmark_nor_the_autotuner():
    """Every fagen module `fagen.compile` (fagen/jit.py) loads, including the plan-cache miss path that solves
    and reads the autotune results (fagen/build.py solve), with torch and pycuda absent."""
    code = ("import sys; sys.modules['torch'] = sys.modules['pycuda'] = None\n"
            "from fagen import build, jit\n"
            "from fagen.spec import Spec\n"
            "from fagen.target import target_for\n"
            "build.solve(Spec(head_dim=64, dtype='bf16'), target_for('sm_90'), None)\n"
            "print(sorted(m for m in sys.modules if m.startswith('fagen')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout.strip().splitlines()[-1])  # a list of module names printed by the child
    assert {"fagen.jit", "fagen.runtime", "fagen.build", "fagen.tuning", "fagen.solver"} <= set(loaded)
    assert not [m for m in loaded if m.startswith("fagen.bench")], loaded


def test_an_autotune_file_another_user_could_write_is_ignored(cache_dir):
    tuning.store(SPEC, GPU, {"passes": {"forward": {"block_r": 64}}})
    path = cache_dir / "autotune.json"
    assert tuning.lookup(SPEC, GPU) is not None and (path.stat().st_mode & 0o777) == 0o600
    path.chmod(0o666)
    with pytest.warns(UserWarning, match="ignoring .*autotune.json"):
        assert tuning.lookup(SPEC, GPU) is None


def test_an_unwritable_cache_costs_the_tuning_result_not_the_run(cache_dir, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.warns(UserWarning, match="cannot store the autotune result"):
        tuning.store(SPEC, GPU, {"passes": {}})
