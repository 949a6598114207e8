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


def test_packed_positions_restart_at_each_sequence_and_fill_the_rows():
    rows = bench_model.packed_positions(batch=3, seq_len=1000, doc_len=128, seed=5)
    assert len(rows) == 3 and all(len(row) == 1000 for row in rows)
    for row in rows:
        starts = [n for n, p in enumerate(row) if p == 0]
        assert starts[0] == 0 and len(starts) >= 1000 // 192   # sequences of 64 to 192 tokens
        lengths = [b - a for a, b in zip(starts, starts[1:] + [len(row)])]
        assert all(64 <= n <= 192 for n in lengths[:-1]) and 1 <= lengths[-1] <= 192   # the last one cut
        assert all(row[n] == row[n - 1] + 1 for n in range(1, 1000) if n not in starts)
    assert rows[0] != rows[1]   # each row drawn on its own
    assert bench_model.packed_positions(3, 1000, 128, seed=5) == rows   # and the same for every implementation
    assert bench_model.packed_positions(1, 100, 4096) == [list(range(100))]   # longer than the row: one sequence


def test_packing_problems_hold_fagen_and_flex_to_packed_sdpa():
    problems = bench_model.packing_problems
    seen = {"fagen_vs_sdpa": 0.05, "flex_vs_sdpa": 0.07, "unpacked_vs_sdpa": 7.0}
    assert problems(seen, {}) == {}
    # an implementation no closer to packed SDPA than unpacked SDPA is ten times over did not pack
    wrong = problems({**seen, "flex_vs_sdpa": 0.7}, {})
    assert set(wrong) == {"flex"} and "not applied" in wrong["flex"] and "7.00e+00" in wrong["flex"]
    # a failed forward: that one is not timed, with the reason
    assert problems({k: v for k, v in seen.items() if k != "fagen_vs_sdpa"}, {"fagen": "OutOfMemoryError: x"}) == {
        "fagen": "packing check: OutOfMemoryError: x"}
    # nothing to hold them to: SDPA failed, or transformers packed nothing (unpacked equals packed), so none is timed
    for failed, seen_here in (({"sdpa": "OutOfMemoryError: y"}, {}), ({}, {**seen, "unpacked_vs_sdpa": 0.0})):
        untimed = problems(seen_here, failed)
        assert set(untimed) == {"fagen", "sdpa", "flex"}


def fake_report() -> ModelReport:
    rows = [ModelRow(64, 32, 8, 1024, 16, ms={"fagen": 100.0, "flash": 110.0, "sdpa": 105.0},
                     losses={"fagen": [10.4, 10.1], "flash": [10.4, 10.102], "sdpa": [10.4, 10.099]}),
            ModelRow(128, 16, 16, 8192, 2, ms={"fagen": 200.0, "flash": 190.0},
                     losses={"fagen": [10.4], "flash": [10.5]},
                     notes={"sdpa": "OutOfMemoryError: CUDA out of memory"}),
            ModelRow(128, 16, 4, 4096, 4, doc_len=1024, ms={"fagen": 80.0, "sdpa": 120.0, "flex": 96.0},
                     losses={"fagen": [10.4, 10.2], "sdpa": [10.4, 10.201], "flex": [10.4, 10.2]},
                     first_ms={"fagen": 900.0, "sdpa": 150.0, "flex": 21000.0},
                     packing={"fagen_vs_sdpa": 0.03, "flex_vs_sdpa": 0.04, "unpacked_vs_sdpa": 2.5}),
            ModelRow(64, 32, 8, 1024, 16, doc_len=4096, ms={"fagen": 50.0, "sdpa": 51.0, "flex": 52.0},
                     packing={"note": "every row of the first batch is one sequence: nothing packed to check"})]
    overhead = [OverheadRow("forward", False, us={"fagen": 30.0, "sdpa": 20.0}),
                OverheadRow("forward+backward", True, us={"sdpa": 80.0}, notes={"fagen": "Unsupported: ..."})]
    return ModelReport({"gpu": "NVIDIA H100", "torch": "2.11", "date": "2026-01-01"}, rows, overhead)


def test_rows_compute_speedups_loss_differences_and_targets():
    fast, slow, packed, _ = fake_report().rows
    assert fast.speedup("flash") == pytest.approx(1.1) and fast.speedup("sdpa") == pytest.approx(1.05)
    assert fast.loss_difference("flash") == pytest.approx(0.002)
    assert fast.target == 1.0 and slow.target == 1.05
    assert slow.speedup("sdpa") is None and slow.loss_difference("flash") == pytest.approx(0.1)
    assert fake_report().overhead[0].ratio == pytest.approx(1.5) and fake_report().overhead[1].ratio is None
    # rounds timed in pairs: the median of the pairs' ratios, not the ratio of the medians (2.0 / 1.0 here)
    paired = OverheadRow("forward", False, us={"fagen": 2.0, "sdpa": 1.0}, round_ratios=[1.2, 2.5, 1.4])
    assert paired.ratio == pytest.approx(1.4) and paired.to_dict()["fagen_over_sdpa"] == pytest.approx(1.4)
    # packed rows: held to SDPA with the packed mask (flash takes no mask) and to Flex; no issue target
    assert packed.impls == ("fagen", "sdpa", "flex") and packed.target is None
    assert packed.speedup("sdpa") == pytest.approx(1.5) and packed.speedup("flex") == pytest.approx(1.2)
    assert packed.loss_difference() == pytest.approx(0.001)


def test_tables_and_json(tmp_path):
    report = fake_report()
    console = Console(record=True, width=250)
    bench_model.print_model_report(report, console)
    text = console.export_text()
    for expected in ("training step", "1.10", "0.95", "2.0e-03", "1.0e-01", "OutOfMemoryError", "host time per call",
                     "1.50", "Unsupported", "packed sequences", "FlexAttention", "SDPA bool mask", "1.20", "1.0e-03",
                     "nothing packed to check"):
        assert expected in text, expected
    data = json.loads(bench_model.write_model_json(report, tmp_path / "out" / "model.json").read_text())
    assert data["meta"]["gpu"] == "NVIDIA H100"
    first = data["model"][0]
    assert first["fagen_over_flash"] == pytest.approx(1.1) and first["flash_losses"] == [10.4, 10.102]
    assert data["model"][1]["sdpa_ms"] is None and "OutOfMemoryError" in data["model"][1]["sdpa_note"]
    third = data["model"][2]
    assert third["doc_len"] == 1024 and third["fagen_over_flex"] == pytest.approx(1.2) and "flash_ms" not in third
    assert third["flex_first_step_ms"] == 21000.0 and third["loss_max_abs_diff_sdpa"] == pytest.approx(0.001)
    assert third["target"] is None and third["packing_check"]["unpacked_vs_sdpa"] == 2.5
    assert "packing_check" not in first
    assert data["overhead"][0] == {"mode": "forward", "compiled": False, "fagen_us": 30.0, "sdpa_us": 20.0,
                                   "fagen_over_sdpa": 1.5, "round_ratios": [], "target": 2.0, "fagen_note": "",
                                   "sdpa_note": ""}


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
    assert seen["packed_doc_len"] == 0
    result = _run("bench-model", "--packed-doc-len", "1024", "--no-overhead")
    assert result.exit_code == 0, result.stderr
    assert seen["packed_doc_len"] == 1024 and seen["overhead"] is False
