"""The `fagen` command: exit codes, one-line errors without tracebacks, and the shape of its output."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from fagen.build import prepare
from fagen.cache import DiskCache, digest, entry_digest
from fagen.cli import _kib, cli, why_first
from fagen.render import render
from fagen.solver import Plan, family_named, solve
from fagen.spec import json_schema, load_specs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
nvcc_stage = importlib.import_module("fagen.compiler")


@pytest.fixture
def run():
    """run(*args) -> click Result with separate .stdout and .stderr."""
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart by itself

    def invoke(*args):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture
def small_spec(tmp_path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text("head_dim: 32\ndtype: fp16\nmask: causal\npasses: [forward]\n")
    return path


def assert_one_line_error(result, status: int, *words: str) -> str:
    assert result.exit_code == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fagen: error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- bad specs: exit 2, one line ------------------------------------------------------------------
BAD_SPECS = {
    "head_dim": ("head_dim: 257\n", ["head_dim", "257", "from 1 to 256"]),
    "budget": ("head_dim: 64\nsram_budget: 1KiB\n", ["sram_budget", "1024", "smallest budget"]),
    "unknown_key": ("head_dim: 64\ndtyp: bf16\n", ["dtyp", "did you mean 'dtype'"]),
    "bad_yaml": ("head_dim: [64\n", ["not valid YAML"]),
    "missing_file": (None, ["missing.yaml", "cannot read"]),
}


@pytest.mark.parametrize("command", ["build", "solve", "render"])
@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_spec_exits_2_with_one_line(run, tmp_path, command, case):
    text, words = BAD_SPECS[case]
    path = tmp_path / ("missing.yaml" if text is None else "spec.yaml")
    if text is not None:
        path.write_text(text)
    extra = ["--out", tmp_path / "out"] if command == "build" else []
    message = assert_one_line_error(run(command, path, *extra), 2, *words)
    assert str(path) in message, "the message names the file"
    assert not (tmp_path / "out").exists(), "nothing is built from a bad spec"


def test_infeasible_variant_in_a_list_is_named(run, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("- head_dim: 64\n- {name: tiny, head_dim: 64, sram_budget: 1KiB}\n")
    assert_one_line_error(run("solve", path), 2, "tiny", "sram_budget")


def test_usage_errors_exit_2(run, small_spec):
    assert run("build", small_spec, "--arch", "sm_70").exit_code == 2
    assert run("solve", small_spec, "--policy", "greedy").exit_code == 2
    assert run("frobnicate").exit_code == 2


# ---- build --------------------------------------------------------------------------------------
def fake_compile_cubin(fail: bool):
    def compile_cubin(source_text, arch, include_dir, out_path=None):
        if fail:
            raise nvcc_stage.CompileError("kernel.cu(12): error: identifier \"oops\" is undefined")
        kernels = set(re.findall(r"\bfagen_(?:fwd|bwd)_\w+", source_text))
        usage = {"registers": 77, "smem_bytes": 0, "spill_stores": 0, "spill_loads": 0, "stack_bytes": 0}
        return types.SimpleNamespace(cubin=b"\x7fELF", resources={k: dict(usage) for k in kernels},
                                     command=["nvcc", f"-arch={arch}"], seconds=0.1)

    return compile_cubin


def test_compile_failure_exits_1_with_nvccs_message(run, small_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compile_cubin(fail=True))
    result = run("build", small_spec, "--out", tmp_path / "out")
    assert result.exit_code == 1
    name = load_specs(small_spec)[0].variant_name
    assert f"fagen: error: {name}: nvcc failed" in result.stderr
    assert 'identifier "oops" is undefined' in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "out" / f"{name}.cubin").exists()


def test_build_prints_summary_table(run, tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compile_cubin(fail=False))
    spec_file = EXAMPLES / "variants.yaml"
    result = run("build", spec_file, "--out", tmp_path / "out", "--jobs", 2)
    assert result.exit_code == 0, result.stderr
    for header in ("variant", "Br", "Bc", "warps", "smem", "registers", "spills", "file"):
        assert header in result.stdout
    assert "77" in result.stdout, "registers come from the ptxas report"
    for spec in load_specs(spec_file):
        assert spec.variant_name in result.stdout
        for ext in (".cu", ".json", ".cubin"):
            assert (tmp_path / "out" / f"{spec.variant_name}{ext}").exists()


def test_build_no_compile(run, small_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compile_cubin(fail=True))
    result = run("build", small_spec, "--out", tmp_path / "out", "--no-compile", "--arch", "sm_80")
    assert result.exit_code == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["d32_fp16_causal_fa2_sm80_for.cu", "d32_fp16_causal_fa2_sm80_for.json"]


def test_build_without_nvcc_notes_it_and_succeeds(run, small_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: False)
    result = run("build", small_spec, "--out", tmp_path / "out")
    assert result.exit_code == 0
    assert "nvcc is not on PATH" in result.stderr
    assert not list((tmp_path / "out").glob("*.cubin"))


# ---- solve, render, schema -----------------------------------------------------------------------
def test_solve_json_shape(run):
    spec_file = EXAMPLES / "variants.yaml"
    result = run("solve", spec_file, "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    specs = load_specs(spec_file)
    assert isinstance(data, list) and [d["name"] for d in data] == [s.variant_name for s in specs]
    for item, spec in zip(data, specs):
        assert {"name", "template", "block_r", "block_c", "warps", "stages", "smem_bytes", "constraint",
                "candidates", "passes"} <= set(item)
        assert {"expression", "lhs", "rhs", "holds"} <= set(item["constraint"])
        assert item["constraint"]["holds"] == (item["constraint"]["lhs"] <= item["constraint"]["rhs"])
        assert item["candidates"] and (item["candidates"][0]["block_r"], item["candidates"][0]["block_c"]) == \
            (item["block_r"], item["block_c"])
        assert set(item["passes"]) == set(spec.passes)
        for candidate in item["candidates"]:
            assert {"block_r", "block_c", "warps", "stages", "smem_bytes", "hbm_bytes"} <= set(candidate)


def test_solve_policy_paper_gives_the_closed_form(run, tmp_path):
    # the forward at d = 256 (the paper's tiles are too large for the backward's registers at that d)
    spec_file = tmp_path / "d256_forward.yaml"
    spec_file.write_text("head_dim: 256\ndtype: bf16\nmask: causal\npasses: [forward]\n")
    result = run("solve", spec_file, "--json", "--policy", "paper", "--arch", "sm_80")
    assert result.exit_code == 0, result.stderr
    (item,) = json.loads(result.stdout)
    spec = load_specs(spec_file)[0]
    m = 166912 // spec.element_bytes  # sm_80's per-block limit in elements
    block_c = -(-m // (4 * spec.head_dim))
    assert (item["block_r"], item["block_c"]) == (min(block_c, spec.head_dim), block_c)


def test_solve_table(run):
    spec_file = EXAMPLES / "causal_bf16.yaml"
    result = run("solve", spec_file)
    assert result.exit_code == 0, result.stderr
    spec = load_specs(spec_file)[0]
    solution = solve(spec)
    paper = solution.to_dict()["constraint"]
    assert spec.variant_name in result.stdout
    assert f"{paper['lhs']} {'<=' if paper['holds'] else '>'} {paper['rhs']}" in result.stdout
    assert "candidates" in result.stdout and "forward" in result.stdout and "backward" in result.stdout


def test_render_prints_every_variant_source(run):
    spec_file = EXAMPLES / "variants.yaml"
    result = run("render", spec_file)
    assert result.exit_code == 0, result.stderr
    expected = "".join(render(s, solve(s)).text for s in load_specs(spec_file))
    assert result.stdout == expected


def test_render_one_variant_for_another_arch(run):
    spec_file = EXAMPLES / "variants.yaml"
    result = run("render", spec_file, "--variant", "plain_fp16_d64_fa1", "--arch", "sm_80")
    assert result.exit_code == 0, result.stderr
    spec = load_specs(spec_file)[1].model_copy(update={"arch": "sm_80"})
    assert result.stdout == render(spec, solve(spec)).text
    assert_one_line_error(run("render", spec_file, "--variant", "nope"), 2, "nope", "plain_fp16_d64_fa2")


def test_schema_is_json(run):
    result = run("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == json_schema()


# ---- check and bench need a GPU -----------------------------------------------------------------
@pytest.mark.parametrize("command", ["check", "bench"])
def test_gpu_commands_without_gpu_exit_2(run, small_spec, monkeypatch, command):
    monkeypatch.setattr("fagen.cli._no_gpu_reason", lambda: "no CUDA device found")
    assert_one_line_error(run(command, small_spec), 2, f"fagen {command}", "GPU")


@pytest.mark.parametrize("command, module", [("check", "fagen.testing"), ("bench", "fagen.bench.kernels")])
def test_gpu_commands_without_their_module_exit_2(run, small_spec, monkeypatch, command, module):
    monkeypatch.setattr("fagen.cli._no_gpu_reason", lambda: None)
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    assert_one_line_error(run(command, small_spec), 2, f"fagen {command}", module)


def test_check_reports_a_bad_spec_first(run, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("head_dim: 300\n")
    assert_one_line_error(run("check", path), 2, "head_dim")


# ---- the installed console script ------------------------------------------------------------------
def console_script() -> str:
    beside = Path(sys.executable).parent / "fagen"
    found = str(beside) if beside.exists() else shutil.which("fagen")
    if not found:
        pytest.skip("the `fagen` console script is not installed: run pip install -e .")
    return found


def test_console_script(tmp_path):
    fagen = console_script()
    bad = tmp_path / "bad.yaml"
    bad.write_text("head_dim: 0\n")
    failed = subprocess.run([fagen, "build", str(bad)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert failed.returncode == 2
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith(f"fagen: error: {bad}: head_dim") and "from 1 to 256" in line
    assert "Traceback" not in failed.stdout + failed.stderr

    schema = subprocess.run([fagen, "schema"], capture_output=True, text=True, timeout=300)
    assert schema.returncode == 0 and json.loads(schema.stdout) == json_schema()


def test_readme_build_command(tmp_path):
    """The README's first command, `fagen build examples/causal_bf16.yaml`, as a user runs it."""
    fagen = console_script()
    done = subprocess.run([fagen, "build", str(EXAMPLES / "causal_bf16.yaml")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    name = load_specs(EXAMPLES / "causal_bf16.yaml")[0].variant_name
    wanted = [".cu", ".json"] + ([".cubin"] if nvcc_stage.nvcc_available() else [])
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == sorted(name + ext for ext in wanted)
    assert name in done.stdout


# ---- the package itself -----------------------------------------------------------------------
def test_import_fagen_is_light():
    code = ("import sys, fagen; fagen.Spec(head_dim=64); import fagen.build, fagen.cli; "
            "heavy = [m for m in ('pycuda', 'torch') if m in sys.modules]; assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_fagen_compile_is_the_jit_entry_point(monkeypatch):
    """`fagen.compile(spec)` is fagen/jit.py's compile (the nvcc stage module is fagen.compiler)."""
    import fagen

    calls = []
    jit = types.ModuleType("fagen.jit")
    jit.compile = lambda spec, **options: calls.append((spec, options)) or "kernel"
    monkeypatch.setitem(sys.modules, "fagen.jit", jit)
    spec = load_specs(EXAMPLES / "causal_bf16.yaml")[0]
    assert fagen.compile(spec, autotune=True) == "kernel" and calls == [(spec, {"autotune": True})]



# ---- build over several files -----------------------------------------------------------------------
def test_build_several_files_into_one_table(run, small_spec, tmp_path, monkeypatch):
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", fake_compile_cubin(fail=False))
    other = tmp_path / "other.yaml"
    other.write_text("name: other_d64\nhead_dim: 64\ndtype: bf16\npasses: [forward]\n")
    result = run("build", small_spec, other, small_spec, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("fagen build") == 1, "one table"
    names = [load_specs(small_spec)[0].variant_name, "other_d64"]
    for name in names:
        assert name in result.stdout
        assert (tmp_path / "out" / f"{name}.cubin").exists()
    assert result.stdout.count(names[0]) == 2, "a file named twice is built once (its name: the row and its file)"


def test_variants_of_one_name_in_two_files_are_an_error_naming_both(run, tmp_path):
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("name: shared\nhead_dim: 64\n")
    second.write_text("name: shared\nhead_dim: 128\n")
    line = assert_one_line_error(run("build", first, second, "--out", tmp_path / "out", "--no-compile"), 2,
                                 str(first), str(second), "shared", "overwrite")
    assert "Traceback" not in line
    assert not (tmp_path / "out").exists(), "nothing is written"


def test_an_arch_override_that_merges_two_variants_is_an_error(run, tmp_path):
    spec_file = tmp_path / "archs.yaml"
    spec_file.write_text("- {head_dim: 64, arch: sm_80}\n- {head_dim: 64, arch: sm_90}\n")
    assert run("build", spec_file, "--out", tmp_path / "a", "--no-compile").exit_code == 0
    assert_one_line_error(run("build", spec_file, "--out", tmp_path / "b", "--no-compile", "--arch", "sm_80"), 2,
                          str(spec_file), "two variants", "--arch sm_80")


def test_build_standalone_writes_the_headers(run, small_spec, tmp_path):
    result = run("build", small_spec, "--out", tmp_path / "out", "--no-compile", "--standalone")
    assert result.exit_code == 0, result.stderr
    name = load_specs(small_spec)[0].variant_name
    record = json.loads((tmp_path / "out" / f"{name}.json").read_text())["compile_alone"]
    assert record["include_dir"] == "." and record["headers"]
    for header in record["headers"]:
        assert (tmp_path / "out" / header).is_file()
    assert not any(part.startswith("-I") for part in record["command"])


def _spilling_and_failing(fail_kernel: str):
    def compile_cubin(source_text, arch, include_dir, out_path=None):
        if fail_kernel in source_text:
            raise nvcc_stage.CompileError("ptxas error: out of registers")
        kernels = set(re.findall(r"\bfagen_(?:fwd|bwd)_\w+", source_text))
        usage = {"registers": 96, "smem_bytes": 0, "spill_stores": 8, "spill_loads": 4, "stack_bytes": 0}
        return types.SimpleNamespace(cubin=b"\x7fELF", resources={k: dict(usage) for k in kernels},
                                     command=["nvcc"], seconds=0.1)

    return compile_cubin


def _two_variants(tmp_path) -> tuple[Path, str]:
    spec_file = tmp_path / "two.yaml"
    spec_file.write_text("- {name: spills, head_dim: 32, dtype: fp16, passes: [forward]}\n"
                         "- {name: breaks, head_dim: 64, dtype: bf16, passes: [forward]}\n")
    broken = prepare(load_specs(spec_file)[1]).rendered.kernels["forward"][0]
    return spec_file, broken


def test_build_output_is_plain_when_piped(run, tmp_path, monkeypatch):
    spec_file, broken = _two_variants(tmp_path)
    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", _spilling_and_failing(broken))
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)
    result = run("build", spec_file, "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert "FAILED (nvcc)" in result.stdout and "12 B" in result.stdout
    assert "\x1b[" not in result.stdout + result.stderr, "no escape codes into a pipe"


def test_build_colours_spills_and_failures_and_names_the_variant_compiling(run, tmp_path, monkeypatch):
    spec_file, broken = _two_variants(tmp_path)
    fake = _spilling_and_failing(broken)

    def slow(source_text, *args, **kwargs):   # long enough for the progress bar to be drawn while it runs
        time.sleep(0.6)
        return fake(source_text, *args, **kwargs)

    monkeypatch.setattr(nvcc_stage, "nvcc_available", lambda: True)
    monkeypatch.setattr(nvcc_stage, "compile_cubin", slow)
    monkeypatch.setenv("FORCE_COLOR", "1")   # what rich sees on a terminal
    monkeypatch.setenv("COLUMNS", "200")
    result = run("build", spec_file, "--out", tmp_path / "out", "--jobs", 1)
    assert result.exit_code == 1
    assert re.search(r"\x1b\[[0-9;]*31m[^\x1b]*FAILED \(nvcc\)", result.stdout), "FAILED in red"
    assert re.search(r"\x1b\[[0-9;]*33m[^\x1b]*12 B", result.stdout), "spills in yellow"
    assert "\x1b[1;33m0 B" not in result.stdout
    assert "compiling spills" in result.stderr or "compiling breaks" in result.stderr, "the bar names the variant"
    assert "eta" in result.stderr


def test_shared_memory_is_printed_with_two_decimals_at_most():
    assert _kib(203828) == "199.05 KiB"
    assert _kib(73 * 1024) == "73 KiB"
    assert _kib(58752) == "57.38 KiB"
    assert _kib(None) == "-"


# ---- solve explains itself --------------------------------------------------------------------------
def test_solve_presents_the_paper_constraint_as_a_reference_point(run):
    spec_file = EXAMPLES / "causal_bf16.yaml"
    result = run("solve", spec_file)
    assert result.exit_code == 0, result.stderr
    paper = solve(load_specs(spec_file)[0]).paper
    assert not paper["holds"], "this example's closed form is over M: the case that used to alarm"
    assert "does NOT hold" not in result.stdout and "violates" not in result.stdout
    assert "reference point, not the plan's footprint" in result.stdout
    assert f"closed-form tiles Br = {paper['block_r']}, Bc = {paper['block_c']}: {paper['lhs']} > {paper['rhs']}" \
        in result.stdout
    assert "FlashAttention-1" in result.stdout


def test_solve_says_why_each_first_plan_is_first(run):
    spec_file = EXAMPLES / "causal_bf16.yaml"
    spec = load_specs(spec_file)[0]
    solution = solve(spec)
    result = run("solve", spec_file)
    for pass_name, plan in solution.plans.items():
        (line,) = [l for l in result.stdout.splitlines() if l.startswith(f"first {pass_name} plan:")]
        least = min(p.hbm_bytes for p in solution.candidates[pass_name])
        if plan.hbm_bytes == least:
            assert "the least HBM traffic" in line
        else:
            assert "fewer HBM bytes" in line and "a rule ranked ahead of traffic" in line
    data = json.loads(run("solve", spec_file, "--json").stdout)
    assert data[0]["passes"]["forward"]["why_first"] == why_first(spec, solution, "forward")


def _plan(family: str, block_r: int, block_c: int, warps: int, head_dim: int, hbm: int, resident: int = 8) -> Plan:
    return Plan(family, family, block_r, block_c, warps, 2, 32 * warps, 1024, 100, hbm, resident, 0,
                family_named(family).tensor_cores, head_dim)


def _solution(plans: list) -> types.SimpleNamespace:
    spec = types.SimpleNamespace(head_dim=plans[0].head_dim, compute_dim=plans[0].head_dim)
    ranked = sorted(plans, key=lambda plan: plan.rank_key(spec.head_dim))
    return spec, types.SimpleNamespace(plans={"forward": ranked[0]}, candidates={"forward": tuple(ranked)})


def test_why_first_names_the_timed_first_rule():
    family = family_named("forward_wgmma")
    if not family.timed_first:
        pytest.skip("forward_wgmma times no plan first any more")
    head_dim, block_r, block_c, warps = family.timed_first[0]
    timed = _plan("forward_wgmma", block_r, block_c, warps, head_dim, hbm=2_000_000)
    cheaper = _plan("forward_wgmma", 128, 64 if block_c != 64 else 128, 8 if warps != 8 else 4, head_dim, hbm=1_000_000)
    spec, solution = _solution([cheaper, timed])
    assert solution.plans["forward"] is timed
    text = why_first(spec, solution, "forward")
    assert "rank 2 moves fewer HBM bytes (1,000,000 against 2,000,000" in text
    assert "timed_first" in text and f"Br = {block_r}, Bc = {block_c} with {warps} warps" in text


def test_why_first_least_traffic_and_its_tie_breaks():
    lean = _plan("forward_fa2_simt", 64, 64, 4, 64, hbm=1_000, resident=16)
    heavy = _plan("forward_fa2_simt", 32, 64, 4, 64, hbm=3_000)
    spec, solution = _solution([heavy, lean])
    assert why_first(spec, solution, "forward") == "the least HBM traffic (1,000 bytes at N = 4096)"
    tied = _plan("forward_fa2_simt", 32, 64, 4, 64, hbm=1_000, resident=8)
    spec, solution = _solution([tied, lean])
    text = why_first(spec, solution, "forward")
    assert "tied with rank 2" in text and "more warps resident per multiprocessor (16 against 8)" in text
    spec, solution = _solution([lean])
    assert why_first(spec, solution, "forward") == "the only feasible plan"


# ---- doctor -------------------------------------------------------------------------------------------
def _doctor(run, monkeypatch, *, versions, gpu, nvcc):
    import fagen.cli as cli_module

    monkeypatch.setattr(cli_module, "_module_version", lambda name: versions.get(name))
    monkeypatch.setattr(cli_module, "_gpu_status", lambda: gpu)
    monkeypatch.setattr(nvcc_stage, "nvcc_path", lambda: nvcc)
    result = run("doctor")
    assert result.exit_code == 0, result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("│ ").split("│")]
        if len(cells) == 4:
            rows[cells[0]] = cells
    return result, rows


def test_doctor_says_what_is_missing_and_what_to_install_and_exits_0(run, monkeypatch, cache_dir):
    result, rows = _doctor(run, monkeypatch, versions={}, gpu=(False, "no NVIDIA driver (libcuda.so.1)"), nvcc=None)
    for name in ("nvcc", "GPU and driver", "PyCUDA", "torch", "transformers", "matplotlib"):
        assert rows[name][1] == "missing", (name, rows)
    assert "pip install 'fagen[gpu]'" in rows["PyCUDA"][3]
    assert "pip install 'fagen[torch]'" in rows["torch"][3]
    assert "pip install 'fagen[transformers]'" in rows["transformers"][3]
    assert "pip install 'fagen[bench]'" in rows["matplotlib"][3]
    assert "CUDA toolkit" in rows["nvcc"][3]
    assert rows["cache"][1] == "ok" and str(cache_dir) in rows["cache"][2]
    assert "not available: nvcc, GPU and driver, PyCUDA, torch, transformers, matplotlib" in result.stdout
    assert "pip install -e" not in result.stdout


def test_doctor_all_present(run, monkeypatch, cache_dir, tmp_path):
    versions = {name: "9.9" for name in ("pycuda", "torch", "transformers", "matplotlib")}
    fake_nvcc = tmp_path / "nvcc"
    fake_nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    fake_nvcc.chmod(0o755)
    result, rows = _doctor(run, monkeypatch, versions=versions, gpu=(True, "NVIDIA H200, sm_90"), nvcc=str(fake_nvcc))
    assert {row[1] for row in rows.values() if row[0] != "check"} == {"ok"}, rows
    assert "(CUDA 13.0)" in rows["nvcc"][2] and rows["torch"][2] == "9.9"
    assert "everything fagen can use is here" in result.stdout


def test_doctor_reports_a_refused_cache_folder(run, monkeypatch, cache_dir):
    cache_dir.mkdir(mode=0o700)
    os.chmod(cache_dir, 0o777)
    result, rows = _doctor(run, monkeypatch, versions={}, gpu=(False, "none"), nvcc=None)
    assert rows["cache"][1] == "problem"
    assert "writable by group and others" in result.stdout and "chmod -R go-w" in result.stdout


def test_doctor_reports_a_cache_path_that_is_a_file(run, monkeypatch, cache_dir):
    cache_dir.write_text("not a folder")
    result, rows = _doctor(run, monkeypatch, versions={}, gpu=(False, "none"), nvcc=None)
    assert rows["cache"][1] == "problem" and "not a folder" in result.stdout


# ---- cache list | clear | verify ------------------------------------------------------------------------
def _fill(cache: DiskCache) -> dict:
    keys = {"cubin": digest("a cubin"), "plan": digest("a plan")}
    cache.put("cubin", keys["cubin"], b"c" * 3000)
    cache.put("plan", keys["plan"], b"p" * 100)
    return keys


def test_cache_list_shows_entries_and_totals(run, cache_dir):
    assert "no entries" in run("cache", "list").stdout
    keys = _fill(DiskCache())
    result = run("cache", "list")
    assert result.exit_code == 0, result.stderr
    for kind, key in keys.items():
        assert re.search(rf"{kind}\s*│\s*{key}\s*│\s*[\d.]+ (KiB|B)\s*│\s*\d+ s", result.stdout), result.stdout
    assert "2 entries, 3.1 KiB (cubin 1, 3.0 KiB; plan 1, 132 B)" in result.stdout
    only = run("cache", "list", "--kind", "plan").stdout
    assert keys["plan"] in only and keys["cubin"] not in only


def test_cache_clear_all_or_one_kind(run, cache_dir):
    cache = DiskCache()
    keys = _fill(cache)
    result = run("cache", "clear", "--kind", "cubin")
    assert result.exit_code == 0 and "removed 1 entry" in result.stdout
    assert cache.get("cubin", keys["cubin"]) is None and cache.get("plan", keys["plan"]) == b"p" * 100
    assert "removed 1 entry" in run("cache", "clear").stdout
    assert list(cache.entries()) == []
    assert run("cache", "clear", "--kind", "nonsense").exit_code == 2


def test_cache_verify_removes_bad_entries_and_exits_1(run, cache_dir):
    cache = DiskCache()
    keys = _fill(cache)
    corrupt, planted, old = digest("corrupt"), digest("planted"), digest("old")
    cache.put("cubin", corrupt, b"x" * 100)
    path = cache.path("cubin", corrupt)
    path.write_bytes(path.read_bytes()[:-1])
    for key, checksum, mode in ((planted, entry_digest("cubin", planted, b"evil"), 0o666),
                                (old, hashlib.sha256(b"old").digest(), 0o600)):
        path = cache.path("cubin", key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(checksum + (b"evil" if key == planted else b"old"))
        os.chmod(path, mode)
    result = run("cache", "verify")
    assert result.exit_code == 1
    assert re.search(rf"bad: \S*{corrupt}: it is corrupt", result.stdout)
    assert re.search(rf"bad: \S*{planted}: it is writable by group and others", result.stdout)
    assert re.search(rf"stale: \S*{old}: it was written by an older fagen", result.stdout)
    assert "checked 5 entries" in result.stdout and "2 good, 1 stale (an older fagen's, removed), 2 bad" in result.stdout
    assert {e.key for e in cache.entries()} == set(keys.values()), "the bad and stale ones are gone, the good kept"
    again = run("cache", "verify")
    assert again.exit_code == 0 and "checked 2 entries" in again.stdout and "2 good" in again.stdout


def test_cache_verify_reports_a_refused_folder_and_leaves_it(run, cache_dir):
    cache = DiskCache()
    keys = _fill(cache)
    os.chmod(cache_dir / "plan", 0o777)
    result = run("cache", "verify")
    assert result.exit_code == 1
    assert f"bad folder: {cache_dir / 'plan'}: it is writable by group and others" in result.stdout
    assert "1 entry in refused folders not checked" in result.stdout
    assert cache.path("plan", keys["plan"]).exists(), "a refused folder is left as it is"


# ---- plot ---------------------------------------------------------------------------------------------
BENCH_REPORT = ROOT / "benchmarks" / "results" / "bench.json"


def test_plot_without_matplotlib_names_the_extra(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert_one_line_error(run("plot", BENCH_REPORT, tmp_path / "out.png"), 2, "matplotlib", "pip install 'fagen[bench]'")
    assert not (tmp_path / "out.png").exists()


def test_plot_draws_the_report(run, tmp_path, monkeypatch):
    import fagen.bench.report as report_module

    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    drawn = []

    def plot_report(report, path, console=None):
        drawn.append((report, path))
        Path(path).write_bytes(b"\x89PNG")
        return Path(path)

    monkeypatch.setattr(report_module, "plot_report", plot_report)
    result = run("plot", BENCH_REPORT, tmp_path / "out.png")
    assert result.exit_code == 0, result.stderr
    ((report, path),) = drawn
    assert path == tmp_path / "out.png" and len(report.rows) == len(json.loads(BENCH_REPORT.read_text())["rows"])
    assert f"wrote {tmp_path / 'out.png'}" in result.stdout


@pytest.mark.parametrize("content, words", [(None, ["cannot read"]), ("{not json", ["not a `fagen bench --json` report"]),
                                            ('{"rows": [{"spec": "x"}]}', ["not a `fagen bench --json` report"])])
def test_plot_of_a_bad_report_is_one_line(run, tmp_path, monkeypatch, content, words):
    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    report = tmp_path / "report.json"
    if content is not None:
        report.write_text(content)
    assert_one_line_error(run("plot", report, tmp_path / "out.png"), 2, str(report), *words)


def test_plot_with_matplotlib(run, tmp_path):
    pytest.importorskip("matplotlib")
    result = run("plot", BENCH_REPORT, tmp_path / "out.png")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


# ---- the extras' hints ----------------------------------------------------------------------------------
def test_missing_pycuda_names_the_gpu_extra(monkeypatch):
    from fagen.cli import _no_gpu_reason

    monkeypatch.setitem(sys.modules, "pycuda", None)
    monkeypatch.setitem(sys.modules, "pycuda.driver", None)
    reason = _no_gpu_reason()
    assert "pip install 'fagen[gpu]'" in reason and "-e" not in reason


def test_bench_model_without_transformers_names_the_extra(run, monkeypatch):
    monkeypatch.setattr("fagen.cli._gpu_entry", lambda *args: (lambda **kwargs: None))
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert_one_line_error(run("bench-model"), 2, "pip install 'fagen[transformers]'")


def test_bench_refuses_fp8_variants_by_name_and_says_what_times_them(run, tmp_path):
    spec_file = tmp_path / "fp8.yaml"
    spec_file.write_text("- {head_dim: 128, dtype: fp8_e4m3}\n- {head_dim: 64, dtype: bf16}\n")
    result = run("bench", spec_file)
    assert result.exit_code == 2
    assert "d128_fp8e4m3_none_fa2_sm90_for is fp8_e4m3" in result.stderr and "python -m fagen.bench fp8" in result.stderr


def test_bench_refuses_a_latent_cache_by_name_and_says_what_times_it(run, tmp_path):
    spec_file = tmp_path / "mla.yaml"
    spec_file.write_text("- {head_dim: 576, value_head_dim: 512, latent_kv: true, dtype: bf16}\n")
    result = run("bench", spec_file)
    assert result.exit_code == 2
    assert "d576v512_bf16_none_fa2_sm90_dec_latent reads a latent cache" in result.stderr
    assert "python -m fagen.bench mla-decode" in result.stderr
