"""fagen.bench.model without a GPU: the model shapes, the records, the tables and JSON (fake numbers),
and the `fagen bench-model` command's errors. The timing itself runs on the GPU machine:
    fagen bench-model --json bench-model.json
"""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from rich.console import Console

from fagen.bench import model as bench_model
from fagen.bench.model import ModelReport, ModelRow, OverheadRow, model_shapes
from fagen.cli import cli


def test_import_needs_neither_torch_nor_transformers():
    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = sys.modules['pycuda'] = None; "
            "import fagen.bench.model, fagen.cli; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_model_shapes_hold_tokens_and_width_fixed():
    shapes = model_shapes(head_dims=(64, 128), seqlens=(1024, 8192), tokens=16384, hidden=2048, kv_groups=(1, 4))
    assert len(shapes) == 2 * 2 * 2
    assert {"head_dim": 64, "heads": 32, "kv_heads": 8, "seq_len": 1024, "batch": 16} in shapes
    assert {"head_dim": 128, "heads": 16, "kv_heads": 16, "seq_len": 8192, "batch": 2} in shapes
    assert all(s["batch"] * s["seq_len"] == 16384 and s["heads"] * s["head_dim"] == 2048 for s in shapes)
    assert model_shapes(head_dims=(128,), hidden=384, kv_groups=(2,)) == []  # 3 heads do not group by 2


def test_llama_config_follows_the_shape():
    pytest.importorskip("transformers")
    config = bench_model.llama_config({"head_dim": 128, "heads": 16, "kv_heads": 4, "seq_len": 8192, "batch": 2},
                                      hidden=2048, layers=4, vocab=32000)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 4, 128)
    assert config.intermediate_size == 5632 and config.max_position_embeddings >= 8192
    assert config.attention_dropout == 0.0  # the loss curves are compared: no dropout


def fake_report() -> ModelReport:
    rows = [ModelRow(64, 32, 8, 1024, 16, ms={"fagen": 100.0, "flash": 110.0, "sdpa": 105.0},
                     losses={"fagen": [10.4, 10.1], "flash": [10.4, 10.102], "sdpa": [10.4, 10.099]}),
            ModelRow(128, 16, 16, 8192, 2, ms={"fagen": 200.0, "flash": 190.0},
                     losses={"fagen": [10.4], "flash": [10.5]},
                     notes={"sdpa": "OutOfMemoryError: CUDA out of memory"})]
    overhead = [OverheadRow("forward", False, us={"fagen": 30.0, "sdpa": 20.0}),
                OverheadRow("forward+backward", True, us={"sdpa": 80.0}, notes={"fagen": "Unsupported: ..."})]
    return ModelReport({"gpu": "NVIDIA H100", "torch": "2.11", "date": "2026-01-01"}, rows, overhead)


def test_rows_compute_speedups_loss_differences_and_targets():
    fast, slow = fake_report().rows
    assert fast.speedup("flash") == pytest.approx(1.1) and fast.speedup("sdpa") == pytest.approx(1.05)
    assert fast.loss_difference("flash") == pytest.approx(0.002)
    assert fast.target == 1.0 and slow.target == 1.05
    assert slow.speedup("sdpa") is None and slow.loss_difference("flash") == pytest.approx(0.1)
    assert fake_report().overhead[0].ratio == pytest.approx(1.5) and fake_report().overhead[1].ratio is None


def test_tables_and_json(tmp_path):
    report = fake_report()
    console = Console(record=True, width=250)
    bench_model.print_model_report(report, console)
    text = console.export_text()
    for expected in ("training step", "1.10", "0.95", "2.0e-03", "1.0e-01", "OutOfMemoryError", "host time per call",
                     "1.50", "Unsupported"):
        assert expected in text, expected
    data = json.loads(bench_model.write_model_json(report, tmp_path / "out" / "model.json").read_text())
    assert data["meta"]["gpu"] == "NVIDIA H100"
    first = data["model"][0]
    assert first["fagen_over_flash"] == pytest.approx(1.1) and first["flash_losses"] == [10.4, 10.102]
    assert data["model"][1]["sdpa_ms"] is None and "OutOfMemoryError" in data["model"][1]["sdpa_note"]
    assert data["overhead"][0] == {"mode": "forward", "compiled": False, "fagen_us": 30.0, "sdpa_us": 20.0,
                                   "fagen_over_sdpa": 1.5, "target": 2.0, "fagen_note": "", "sdpa_note": ""}


def _run(*args):
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli, list(args), catch_exceptions=False)


def test_cli_without_gpu_exits_2_with_one_line(monkeypatch):
    monkeypatch.setattr("fagen.cli._no_gpu_reason", lambda: "no CUDA device found")
    result = _run("bench-model")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == ["fagen: error: fagen bench-model needs a CUDA GPU: no CUDA device found"]


def test_cli_passes_its_options_on(monkeypatch):
    seen = {}
    monkeypatch.setattr("fagen.cli._no_gpu_reason", lambda: None)
    monkeypatch.setattr(bench_model, "run_model_bench", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    result = _run("bench-model", "--head-dims", "128", "--seqlens", "4096,8192", "--kv-groups", "4", "--no-compile",
                  "--steps", "5")
    assert result.exit_code == 0, result.stderr
    assert seen["head_dims"] == (128,) and seen["seqlens"] == (4096, 8192) and seen["kv_groups"] == (4,)
    assert seen["compiled"] is False and seen["overhead"] is True and seen["steps"] == 5 and seen["json"] is None
