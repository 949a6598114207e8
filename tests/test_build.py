"""`fagen.build`: the files a build writes, the write-only-when-changed rule, the compile cache, failures."""
from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import types
from pathlib import Path

import pytest

from fagen.build import build_all, build_variant, needed_headers, prepare, write_if_changed
from fagen.render import render
from fagen.solver import solve
from fagen.spec import Spec, SpecError

nvcc_stage = importlib.import_module("fagen.compiler")
needs_nvcc = pytest.mark.skipif(not nvcc_stage.nvcc_available(),
                                reason="nvcc is not on PATH, so no .cubin can be built (install the CUDA toolkit)")

# Forward only and small: the quickest kernel to compile.
SMALL = Spec(head_dim=32, dtype="fp16", mask="causal", passes=("forward",))
OLD = 1_000_000_000  # an mtime (2001) that a rewrite would replace


def mtimes(paths) -> list[int]:
    return [Path(p).stat().st_mtime_ns for p in paths]


def age(paths) -> None:
    for path in paths:
        os.utime(path, (OLD, OLD))


# ---- a real compile with nvcc -------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real nvcc build shared by the tests below (compiling is the slow part)."""
    if not nvcc_stage.nvcc_available():
        pytest.skip("nvcc is not on PATH, so no .cubin can be built (install the CUDA toolkit)")
    out = tmp_path_factory.mktemp("build")
    return out, build_variant(SMALL, out)


@needs_nvcc
def test_build_writes_cu_json_and_cubin(built):
    out, result = built
    name = SMALL.variant_name
    assert result.ok and result.compiled and not result.cached
    assert result.files == {"cu": out / f"{name}.cu", "json": out / f"{name}.json", "cubin": out / f"{name}.cubin"}
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}{ext}" for ext in (".cu", ".cubin", ".json"))
    assert (out / f"{name}.cu").read_text() == render(SMALL, solve(SMALL)).text
    assert (out / f"{name}.cubin").read_bytes()[:4] == b"\x7fELF", "a cubin is an ELF image"

    report = json.loads((out / f"{name}.json").read_text())
    assert report["name"] == name and report["spec"] == SMALL.to_dict()
    plan = solve(SMALL).primary
    assert (report["solution"]["block_r"], report["solution"]["block_c"]) == (plan.block_r, plan.block_c)
    assert report["template"] == plan.template
    assert {"expression", "lhs", "rhs", "holds"} <= set(report["paper_constraint"])
    compiled = report["compile"]
    assert compiled["arch"] == "sm_90" and compiled["cubin"] == f"{name}.cubin"
    assert compiled["command"] and compiled["seconds"] > 0
    kernels = result.rendered.kernels["forward"]
    assert set(kernels) <= set(compiled["resources"]), "ptxas reports every kernel of the variant"
    for kernel in kernels:
        usage = compiled["resources"][kernel]
        assert 0 < usage["registers"] <= 255
        assert {"smem_bytes", "spill_stores", "spill_loads"} <= set(usage)


@needs_nvcc
def test_second_build_rewrites_nothing_and_skips_nvcc(built, monkeypatch):
    out, first = built
    files = list(first.files.values())
    age(files)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", lambda *a, **k: pytest.fail("nvcc ran for unchanged inputs"))
    again = build_variant(SMALL, out)
    assert again.written == [] and again.cached and again.compiled
    assert mtimes(files) == [OLD * 10**9] * len(files)


# ---- without nvcc: --no-compile and a stand-in compiler ----------------------------------------
def test_no_compile_writes_no_cubin(tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "compile_cubin", lambda *a, **k: pytest.fail("--no-compile ran nvcc"))
    result = build_variant(SMALL, tmp_path, compile=False)
    name = SMALL.variant_name
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.cu", f"{name}.json"]
    assert not result.compiled and result.skipped_reason == "--no-compile"
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert "compile" not in report and report["spec"] == SMALL.to_dict()

    age(result.files.values())
    again = build_variant(SMALL, tmp_path, compile=False)
    assert again.written == [] and mtimes(again.files.values()) == [OLD * 10**9] * 2


def test_record_shows_the_mask_kind_as_its_expression(tmp_path):
    """causal / sliding_window are rendered from an expression (fagen/expressions/modifiers.py MASK_KIND_TEXT): the
    record says which, and the source carries the struct made from it."""
    window = Spec(head_dim=32, dtype="fp16", mask="sliding_window", window=64, passes=("forward",))
    for spec, text in ((SMALL, "j <= i + Nk - Nq"), (window, "0 <= i + Nk - Nq - j < 64")):
        result = build_variant(spec, tmp_path, compile=False)
        report = json.loads((tmp_path / f"{spec.variant_name}.json").read_text())
        assert report["mask_expression"] == text
        source = (tmp_path / f"{spec.variant_name}.cu").read_text()
        assert f"// mask {spec.mask}: {text}" in source and "::KindMask;" in source
        assert result.files
    plain = Spec(head_dim=32, dtype="fp16", mask="none", passes=("forward",))
    build_variant(plain, tmp_path, compile=False)
    report = json.loads((tmp_path / f"{plain.variant_name}.json").read_text())
    assert "mask_expression" not in report


def fake_compiler(calls: list, fail_when: str = "\0"):
    """A stand-in for compile_cubin: records calls, reports every fagen kernel in the source."""

    def compile_cubin(source_text, arch, include_dir, out_path=None):
        calls.append(arch)
        if fail_when in source_text:
            raise nvcc_stage.CompileError(f"ptxas error: out of registers in {fail_when}")
        kernels = sorted(set(re.findall(r"\bfagen_(?:fwd|bwd)_\w+", source_text)))
        usage = {"registers": 96, "smem_bytes": 0, "spill_stores": 8, "spill_loads": 4, "stack_bytes": 0}
        return types.SimpleNamespace(cubin=b"\x7fELF" + source_text.encode()[:64],
                                     resources={k: dict(usage) for k in kernels},
                                     command=["nvcc", "-cubin", f"-arch={arch}"], seconds=0.25)

    return compile_cubin


@pytest.fixture
def fake_nvcc(monkeypatch):
    calls: list = []
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compiler(calls))
    return calls


def test_report_records_what_ptxas_said(tmp_path, fake_nvcc):
    result = build_variant(SMALL, tmp_path)
    report = json.loads(result.files["json"].read_text())
    assert report["compile"]["command"] == ["nvcc", "-cubin", "-arch=sm_90"]
    assert report["compile"]["seconds"] == 0.25
    for kernel in result.rendered.kernels["forward"]:
        assert report["compile"]["resources"][kernel]["spill_stores"] == 8
    assert result.resources == report["compile"]["resources"]
    assert fake_nvcc == ["sm_90"]


def test_cache_is_keyed_on_the_cubin_too(tmp_path, fake_nvcc):
    result = build_variant(SMALL, tmp_path)
    build_variant(SMALL, tmp_path)
    assert len(fake_nvcc) == 1, "unchanged inputs: nvcc skipped"
    result.files["cubin"].write_bytes(b"corrupt")
    repaired = build_variant(SMALL, tmp_path)
    assert len(fake_nvcc) == 2 and not repaired.cached
    assert result.files["cubin"].read_bytes().startswith(b"\x7fELF")


def test_stale_cubin_is_removed(tmp_path, fake_nvcc):
    result = build_variant(SMALL, tmp_path)
    report = json.loads(result.files["json"].read_text())
    report["compile"]["inputs_key"] = "from an older template"
    result.files["json"].write_text(json.dumps(report))
    build_variant(SMALL, tmp_path, compile=False)
    assert not result.files["cubin"].exists(), "a cubin of other inputs must not sit beside the new source"


def test_arch_override(tmp_path, fake_nvcc):
    result = build_variant(SMALL, tmp_path, arch="sm_80")
    assert result.spec.arch == "sm_80" and result.name == SMALL.model_copy(update={"arch": "sm_80"}).canonical_name
    assert json.loads(result.files["json"].read_text())["spec"]["arch"] == "sm_80"
    assert fake_nvcc == ["sm_80"]


def test_build_all_isolates_compile_failures(tmp_path, monkeypatch):
    specs = [SMALL, Spec(head_dim=64, dtype="bf16", passes=("forward",)), Spec(head_dim=32, dtype="fp32")]
    bad = prepare(specs[1]).rendered.kernels["forward"][0]
    calls: list = []
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compiler(calls, fail_when=bad))
    finished = []
    results = build_all(specs, tmp_path, jobs=3, progress=finished.append)
    assert [r.spec for r in results] == specs, "results come back in the order of the specs"
    assert sorted(id(r) for r in finished) == sorted(id(r) for r in results)
    assert [r.ok for r in results] == [True, False, True]
    assert "out of registers" in results[1].error
    assert not (tmp_path / f"{specs[1].variant_name}.cubin").exists()
    assert (tmp_path / f"{specs[1].variant_name}.cu").exists(), "the source is kept to look at"
    with pytest.raises(nvcc_stage.CompileError, match="out of registers"):
        build_variant(specs[1], tmp_path)


def test_build_all_rejects_infeasible_specs_before_compiling(tmp_path, fake_nvcc):
    with pytest.raises(SpecError, match="sram_budget"):
        build_all([SMALL, Spec(head_dim=64, sram_budget="1KiB")], tmp_path)
    assert fake_nvcc == [] and not any(tmp_path.iterdir())


# ---- write_if_changed --------------------------------------------------------------------------
def test_write_if_changed(tmp_path):
    path = tmp_path / "sub" / "file.txt"
    assert write_if_changed(path, b"one")
    age([path])
    assert not write_if_changed(path, b"one")
    assert mtimes([path]) == [OLD * 10**9]
    assert write_if_changed(path, b"two") and path.read_bytes() == b"two"
    assert [p.name for p in path.parent.iterdir()] == ["file.txt"], "no temporary file left behind"



# ---- compiling a .cu alone -----------------------------------------------------------------------
def test_record_says_how_to_compile_the_source_alone(tmp_path):
    result = build_variant(SMALL, tmp_path, compile=False)
    alone = json.loads(result.files["json"].read_text())["compile_alone"]
    include_dir = Path(result.rendered.include_dir).resolve()
    assert alone["include_dir"] == str(include_dir)
    assert alone["headers"] == needed_headers(result.rendered)
    assert "attention_common.cuh" in alone["headers"]
    for header in alone["headers"]:
        assert (include_dir / header).is_file()
    name = SMALL.variant_name
    assert alone["command"] == ["nvcc", "-cubin", f"-arch={nvcc_stage.nvcc_arch(SMALL.arch)}", *nvcc_stage.NVCC_OPTIONS,
                                f"-I{include_dir}", "-o", f"{name}.cubin", f"{name}.cu"]
    assert alone["command_line"] == shlex.join(alone["command"])
    assert not any(p.suffix == ".cuh" for p in tmp_path.iterdir()), "headers only with standalone"


def test_needed_headers_follow_includes_between_headers():
    spec = Spec(head_dim=64, dtype="bf16", mask="causal", passes=("forward",))   # forward_wgmma on sm_90
    rendered = prepare(spec).rendered
    assert '#include "warpgroup_mma.cuh"' in rendered.text and '#include "tensor_core.cuh"' not in rendered.text
    assert {"attention_common.cuh", "warpgroup_mma.cuh", "tensor_core.cuh"} <= set(needed_headers(rendered)), \
        "warpgroup_mma.cuh includes tensor_core.cuh"


def test_standalone_headers_are_written_once_and_only_when_changed(tmp_path):
    first = build_variant(SMALL, tmp_path, compile=False, standalone=True)
    assert first.headers and all(h.is_file() for h in first.headers)
    assert set(first.headers) <= set(first.written)
    age(first.headers)
    again = build_variant(SMALL, tmp_path, compile=False, standalone=True)
    assert again.written == [] and mtimes(again.headers) == [OLD * 10**9] * len(again.headers)


@needs_nvcc
def test_a_standalone_source_compiles_alone_with_the_recorded_command(tmp_path):
    """The README's promise: `nvcc -cubin -arch=... X.cu` in the output folder, nothing else (one small sm_80 kernel)."""
    spec = SMALL.model_copy(update={"arch": "sm_80"})
    result = build_variant(spec, tmp_path, compile=False, standalone=True)
    alone = json.loads(result.files["json"].read_text())["compile_alone"]
    assert alone["include_dir"] == "." and not any(part.startswith("-I") for part in alone["command"])
    done = subprocess.run(alone["command"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / f"{spec.variant_name}.cubin").read_bytes()[:4] == b"\x7fELF"


def test_build_all_reports_each_variant_as_it_starts(tmp_path, fake_nvcc):
    specs = [SMALL, Spec(head_dim=64, dtype="bf16", passes=("forward",))]
    events = []
    build_all(specs, tmp_path, jobs=1, started=lambda item: events.append(("start", item.name)),
              progress=lambda result: events.append(("done", result.name)))
    assert events == [("start", specs[0].variant_name), ("done", specs[0].variant_name),
                      ("start", specs[1].variant_name), ("done", specs[1].variant_name)]


# ---- run-time artifacts (fagen.compile's half of the build) -------------------------------------
def _stub_cached_cubin(monkeypatch) -> list:
    """fagen.compiler.cached_cubin with nvcc replaced by a recorder (the 'cubin' names the arch and the source's
    length), stored in the disk cache under its key as the real one is."""
    from fagen.cache import DiskCache

    compiled = []

    def cached_cubin(source, arch, include_dir, key=None):
        def compile_it():
            compiled.append((arch, source))
            return f"{arch}:{len(source)}".encode()
        return DiskCache().get_or_build("cubin", key or nvcc_stage.cubin_key(source, arch, include_dir), compile_it)

    monkeypatch.setattr(nvcc_stage, "cached_cubin", cached_cubin)
    return compiled


def test_an_artifact_is_built_once_then_loaded_from_the_plan_cache(cache_dir, monkeypatch):
    """artifact(): a miss solves, renders and compiles each pass as its own unit and stores the record; the next
    call (any process) loads record and cubins from the disk cache, compiling nothing."""
    from fagen import build
    from fagen.artifact import RECORD_FORMAT, RECORD_KEYS
    from fagen.target import target_for

    compiled = _stub_cached_cubin(monkeypatch)
    spec, target = Spec(head_dim=64, dtype="bf16", mask="causal", arch="sm_90"), target_for("sm_90")
    first = build.artifact(spec, target)
    assert sorted(first.cubins) == ["backward", "forward"] and len(compiled) == 2
    assert {arch for arch, _ in compiled} == {"sm_90"}
    record = first.record
    assert record["format"] == RECORD_FORMAT and all(key in record for key in RECORD_KEYS)
    assert set(record["plans"]) == set(record["kernels"]) == set(record["folds_heads"]) == {"forward", "backward"}
    assert record["kernels"]["forward"][0] in compiled[0][1] + compiled[1][1]   # the symbols are the source's
    again = build.artifact(spec, target)
    assert len(compiled) == 2 and again.record == json.loads(json.dumps(record)) and again.cubins == first.cubins


def test_an_artifact_of_another_format_is_rebuilt_with_a_warning(cache_dir, monkeypatch):
    from fagen import build
    from fagen.cache import DiskCache
    from fagen.target import target_for

    compiled = _stub_cached_cubin(monkeypatch)
    spec, target = SMALL.model_copy(update={"arch": "sm_80"}), target_for("sm_80")
    first = build.artifact(spec, target)
    key = build._plan_key(spec, target, None)
    DiskCache().put("plan", key, json.dumps({**first.record, "format": 1}).encode())
    with pytest.warns(UserWarning, match="format 1, this fagen writes"):
        rebuilt = build.artifact(spec, target)
    assert rebuilt.record == first.record and len(compiled) == 1   # (its cubin was still in the cache)


def test_a_score_mod_with_float_tensor_inputs_carries_its_input_gradient_backward(cache_dir, monkeypatch):
    """The backward WITH_INPUT_GRADS is part of the artifact where score_mod reads float tensors (the runtime
    never renders it on first use), and absent where it reads none."""
    from fagen import build
    from fagen.artifact import INPUT_GRAD_BACKWARD
    from fagen.target import target_for

    compiled = _stub_cached_cubin(monkeypatch)
    target = target_for("sm_90")
    bias = Spec(head_dim=64, dtype="bf16", score_mod="score + bias[h, i - j]", inputs={"bias": "float32"}, arch="sm_90")
    made = build.artifact(bias, target)
    assert sorted(made.cubins) == sorted(["forward", "backward", INPUT_GRAD_BACKWARD])
    assert len(compiled) == 3 and sum("(the build WITH_INPUT_GRADS)" in source for _, source in compiled) == 1
    capped = Spec(head_dim=64, dtype="bf16", score_mod="cap * tanh(score / cap)", inputs={"cap": "scalar"}, arch="sm_90")
    assert INPUT_GRAD_BACKWARD not in build.artifact(capped, target).cubins


def test_the_runtime_kernel_loads_an_artifact_without_the_build(cache_dir, monkeypatch):
    """fagen.runtime.Kernel takes what the build made: its plans from the record (family, template, folds_heads),
    each pass's cubin loaded through the driver; the record's extra cubin is the input-gradient backward."""
    from fagen import build, runtime
    from fagen.artifact import INPUT_GRAD_BACKWARD, Artifact
    from fagen.target import target_for

    _stub_cached_cubin(monkeypatch)
    spec = Spec(head_dim=64, dtype="bf16", mask="causal", arch="sm_90")
    item = build.prepare(spec)
    record = build.compile_prepared(item).record   # (the cubins below stand in for the compiled ones)
    loaded = []
    monkeypatch.setattr(runtime.Kernel, "_module_functions", lambda self, device, cubins: loaded.append(cubins) or {})
    kernel = runtime.Kernel(spec, target_for("sm_90"), Artifact(record, {"forward": b"f", "backward": b"b",
                                                                         INPUT_GRAD_BACKWARD: b"g"}), device=0)
    assert loaded == [{"forward": b"f", "backward": b"b"}]
    assert kernel.plans["backward"].folds_heads and not kernel.plans["forward"].folds_heads
    assert kernel.plans["forward"].family == item.solution.plans["forward"].family
    assert kernel._input_grad_cubin == b"g"
