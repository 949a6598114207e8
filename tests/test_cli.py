"""The `fagen` command: exit codes, one-line errors without tracebacks, and the shape of its output."""
from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from fagen.cli import cli
from fagen.render import render
from fagen.solver import solve
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
    assert f"{paper['lhs']} <= {paper['rhs']}" in result.stdout
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


def test_fagen_compile_is_the_runtime_entry_point(monkeypatch):
    """`fagen.compile(spec)` is the runtime's compile (the nvcc stage module is fagen.compiler)."""
    import fagen

    calls = []
    runtime = types.ModuleType("fagen.runtime")
    runtime.compile = lambda spec, **options: calls.append((spec, options)) or "kernel"
    monkeypatch.setitem(sys.modules, "fagen.runtime", runtime)
    spec = load_specs(EXAMPLES / "causal_bf16.yaml")[0]
    assert fagen.compile(spec, autotune=True) == "kernel" and calls == [(spec, {"autotune": True})]
