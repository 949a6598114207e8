"""`fagen bench` without a GPU: FLOP counting, the records, the table/CSV/JSON/Markdown writers and the
plot on fake measurements, the event-timing helper on a fake torch, and the compile-time probe's plumbing."""
import csv
import json
import math
import sys
import types
from pathlib import Path

import pytest

from fagen.bench import __main__ as bench_main
from fagen.bench import extras, timing
from fagen.bench import report as writers
from fagen.bench.report import BenchReport, Row
from fagen.bench.timing import attention_flops
from fagen.spec import Spec, load_specs

#: The issue's benchmark grid (`fagen bench benchmarks/bench.yaml`).
GRID = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.yaml"


# ---- FLOPs ----------------------------------------------------------------------------------
def test_forward_flops_are_4_b_h_n_n_d():
    assert attention_flops(2, 16, 1024, 1024, 128) == 4 * 2 * 16 * 1024 * 1024 * 128


def test_causal_halves_and_backward_is_two_and_a_half_forward():
    full = attention_flops(1, 32, 16384, 16384, 64)
    causal = attention_flops(1, 32, 16384, 16384, 64, mask="causal")
    assert causal == full / 2
    assert attention_flops(1, 32, 16384, 16384, 64, mask="causal", pass_name="backward") == 2.5 * causal
    assert attention_flops(1, 32, 16384, 16384, 64, pass_name="backward") == 2.5 * full


def test_masks_that_run_fully_populated_count_dense():
    for mask in ("padding", "block_sparse"):
        assert attention_flops(1, 1, 100, 80, 64, mask=mask) == attention_flops(1, 1, 100, 80, 64)


@pytest.mark.parametrize("seq_q,seq_k,window", [(4, 4, 2), (64, 64, 7), (10, 17, 3), (5, 5, 100), (9, 4, 2)])
def test_sliding_window_counts_the_visible_pairs_of_the_reference_mask(seq_q, seq_k, window):
    from fagen.reference import visible_mask

    spec = Spec(head_dim=64, mask="sliding_window", window=window)
    visible = int(visible_mask(spec, 1, 1, seq_q, seq_k).sum())
    assert timing.visible_pairs(seq_q, seq_k, "sliding_window", window) == visible
    assert attention_flops(1, 1, seq_q, seq_k, 64, mask="sliding_window", window=window) == 4 * 64 * visible


def test_unknown_pass_is_refused():
    with pytest.raises(ValueError, match="forward or backward"):
        attention_flops(1, 1, 8, 8, 64, pass_name="sideways")


def test_shape_holds_tokens_and_model_dim_fixed():
    d64, d128 = Spec(head_dim=64), Spec(head_dim=128)
    assert timing.shape_for(d64, 1024, 16384, 2048) == (16, 32)
    assert timing.shape_for(d128, 16384, 16384, 2048) == (1, 16)
    assert timing.shape_for(d128, 32768, 16384, 2048) == (1, 16)  # never below one


# ---- fake measurements ----------------------------------------------------------------------
def _row(spec="d64_bf16", n=1024, pass_name="forward", ms=(1.0, 1.25, 0.8), mask="none", dropout=0.0, **extra):
    batch, heads = 16384 // n, 32
    flops = attention_flops(batch, heads, n, n, 64, mask=mask, pass_name=pass_name)
    return Row(spec, "bf16", 64, mask, dropout, n, batch, heads, pass_name, flops,
               ms=dict(zip(writers.IMPLS, ms)), **extra)


def _report():
    rows = []
    for spec, mask in (("d64_bf16", "none"), ("d64_bf16_causal", "causal")):
        for n in (1024, 4096, 16384):
            rows.append(_row(spec, n, "forward", (1.0 * n / 1024, 1.1 * n / 1024, 0.7 * n / 1024), mask=mask,
                             rel_error=3e-3, check="ok", plan="for Br=128 Bc=64 w=8"))
            rows.append(_row(spec, n, "backward", (3.0, 2.8, None), mask=mask, rel_error=7e-3, check="ok",
                             notes={"cudnn": "RuntimeError: No available kernel. Aborting execution."}))
    rows.append(_row("d64_bf16_window", 4096, "forward", (2.0, None, None), mask="none",
                     notes={"flash": "SDPA has no sliding_window mask", "cudnn": "SDPA has no sliding_window mask"},
                     check="FAIL", rel_error=math.inf))
    rows.append(_row("d64_bf16_drop0p1", 4096, "forward", (2.0, 1.5, 1.0), dropout=0.1,
                     check="not checked: dropout (SDPA draws other random numbers)"))
    meta = {"date": "2026-01-01T00:00:00+00:00", "gpu": "Fake GPU 80GB", "torch": "2.99.0", "cuda": "13.0",
            "cudnn": 91000, "fagen": "0.1.0", "command": "fagen bench benchmarks/bench.yaml --json out.json"}
    return BenchReport(meta, rows)


def test_row_tflops_and_ratios():
    row = _row(ms=(2.0, 1.0, None))
    assert row.tflops("fagen") == pytest.approx(row.flops / 2e-3 / 1e12)
    assert row.ratio("flash") == pytest.approx(0.5)       # fagen takes twice as long: half the speed
    assert row.ratio("cudnn") is None and row.tflops("cudnn") is None
    assert _row(ms=(0.0, 1.0, 1.0)).tflops("fagen") is None


def test_row_dict_round_trip_keeps_every_number():
    row = _report().rows[1]
    data = row.to_dict()
    for key in ("fagen_ms", "flash_ms", "cudnn_ms", "fagen_tflops", "flash_tflops", "cudnn_tflops",
                "fagen_over_flash", "fagen_over_cudnn", "flops", "rel_error", "check", "cudnn_note"):
        assert key in data
    back = Row.from_dict(data)
    assert back == row


def test_json_has_meta_and_every_row_and_reads_back(tmp_path):
    report = _report()
    path = writers.write_json(report, tmp_path / "sub" / "bench.json")
    data = json.loads(path.read_text())  # strict JSON: no bare Infinity
    assert "Infinity" not in path.read_text()
    for key in ("date", "gpu", "torch", "command"):
        assert data["meta"][key] == report.meta[key]
    assert len(data["rows"]) == len(report.rows)
    assert data["rows"][0]["fagen_tflops"] == pytest.approx(report.rows[0].tflops("fagen"))
    again = BenchReport.load(path)
    assert again.rows[:-2] == report.rows[:-2]
    assert math.isinf(again.rows[-2].rel_error)
    assert [r.check for r in again.failures] == ["FAIL"]


def test_csv_has_a_line_per_row_with_numbers_and_metadata(tmp_path):
    report = _report()
    path = writers.write_csv(report, tmp_path / "bench.csv")
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(report.rows)
    first = rows[0]
    assert first["spec"] == "d64_bf16" and first["pass"] == "forward" and first["seq_len"] == "1024"
    assert float(first["fagen_ms"]) == 1.0 and float(first["fagen_over_flash"]) == pytest.approx(1.1)
    assert first["gpu"] == "Fake GPU 80GB" and first["torch"] == "2.99.0" and first["command"].startswith("fagen bench")
    assert first["date"] == report.meta["date"]
    backward = rows[1]
    assert backward["cudnn_ms"] == "" and backward["cudnn_tflops"] == "" and "No available kernel" in backward["cudnn_note"]


def test_csv_of_an_empty_report_has_the_header(tmp_path):
    path = writers.write_csv(BenchReport({"date": "x"}), tmp_path / "empty.csv")
    header = path.read_text().splitlines()[0].split(",")
    assert header[:2] == ["spec", "dtype"] and "fagen_tflops" in header and "command" in header


def test_table_shows_every_column_and_n_a_with_reasons():
    from rich.console import Console

    console = Console(record=True, width=260, color_system=None)
    writers.print_table(_report(), console)
    text = console.export_text()
    for header in ("spec", "N", "batch", "heads", "pass", "fagen TFLOP/s", "flash TFLOP/s", "cudnn TFLOP/s",
                   "fagen/flash", "fagen/cudnn", "fagen ms", "flash ms", "cudnn ms", "check"):
        assert header in text
    assert "d64_bf16_causal" in text and "n/a" in text and "FAIL" in text
    assert "cudnn n/a: RuntimeError: No available kernel" in text
    assert "Fake GPU 80GB" in text
    assert "1.10" in text  # fagen/flash of the first row


def test_table_prints_brackets_in_messages_literally():
    from rich.console import Console

    report = BenchReport({"gpu": "G [x]"}, [_row(spec="odd", ms=(None, 1.0, 1.0), check="FAIL",
                                                notes={"fagen": "nvcc: error [sm_90] at [/tmp/x.cu]"})])
    console = Console(record=True, width=260, color_system=None)
    writers.print_table(report, console)  # rich markup would raise MarkupError on "[/tmp/x.cu]"
    assert "nvcc: error [sm_90] at [/tmp/x.cu]" in console.export_text()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = writers.plot_report(_report(), tmp_path / "plots" / "bench.png")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so_and_does_not_crash(tmp_path, monkeypatch):
    from rich.console import Console

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    console = Console(record=True, width=200, color_system=None)
    assert writers.plot_report(_report(), tmp_path / "x.png", console=console) is None
    assert "python -m fagen.bench plot" in console.export_text()
    assert not (tmp_path / "x.png").exists()


def test_markdown_tables_split_by_pass_and_dropout():
    report = _report()
    forward = writers.markdown(report, "forward", dropout=False)
    assert forward.count("\n") == 2 + 7  # header, rule, 6 grid rows and the window row
    assert "| d64_bf16 | 1024 | 16 x 32 |" in forward and "1.10 ✓" in forward
    assert "drop0p1" not in forward
    backward = writers.markdown(report, "backward", dropout=False)
    assert "0.93 ✓" in backward  # 2.8 / 3.0 >= 0.9
    dropout = writers.markdown(report, "forward", dropout=True)
    assert "d64_bf16_drop0p1" in dropout and "0.75 ✗" in dropout


def test_efficiency_is_a_fraction_of_the_gemm_rate():
    report = _report()
    rows = writers.efficiency(report, gemm_tflops=800.0, head_dim=64)
    assert rows and all(r["fraction_of_gemm"] == pytest.approx(r["tflops"] / 800.0) for r in rows)
    assert writers.efficiency(report, 800.0, head_dim=128) == []


def test_module_cli_redraws_the_plot_and_prints_the_markdown(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = writers.write_json(_report(), tmp_path / "bench.json")
    extras = tmp_path / "extras.json"
    extras.write_text(json.dumps({"gemm_tflops": 800.0}))
    assert bench_main.main(["plot", str(saved), str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 1000
    assert bench_main.main(["markdown", str(saved), "--extras", str(extras)]) == 0
    out = capsys.readouterr().out
    assert "### Forward" in out and "### Backward" in out and "### Dropout, forward" in out
    assert "Fake GPU 80GB" in out and "fagen bench benchmarks/bench.yaml" in out


def test_command_line_reads_like_what_was_typed():
    assert writers.command_line(["/usr/bin/fagen", "bench", "a b.yaml", "--json", "x.json"]) == \
        "fagen bench 'a b.yaml' --json x.json"
    assert writers.command_line(["/tmp/w/fagen/cli.py", "bench", "e.yaml"]).endswith(" -m fagen.cli bench e.yaml")


def test_environment_without_torch_has_date_and_command():
    meta = writers.environment()
    assert meta["date"] and "command" in meta and meta["fagen"]


# ---- the timing helper, on a fake torch -----------------------------------------------------
class _FakeClock:
    """Stands in for the GPU: each call of fn advances time by the next duration."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def fn(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


def _fake_torch(clock):
    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = clock.now

        def elapsed_time(self, end):
            return end.t - self.t

    synced = []
    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: synced.append(clock.calls))
    return types.SimpleNamespace(cuda=cuda, synced=synced)


def test_time_cuda_warms_up_then_takes_the_median_of_the_timed_runs(monkeypatch):
    clock = _FakeClock([100.0] * 3 + [1.0, 9.0, 2.0, 3.0, 50.0])  # 3 warm-up calls, then 5 timed
    fake = _fake_torch(clock)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert timing.time_cuda(clock.fn, warmup=3, repeats=5) == 3.0
    assert clock.calls == 8
    assert fake.synced == [3, 8]  # once after the warm-up, once after the timed runs, never in between


def test_time_cuda_cuts_repeats_of_a_slow_call_to_its_time_budget(monkeypatch):
    clock = _FakeClock([1000.0])  # one second per call
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock))
    assert timing.time_cuda(clock.fn, warmup=10, repeats=50, max_seconds=8.0) == 1000.0
    assert clock.calls == 1 + 2 + 8  # the estimate, budget/4 warm-ups, budget timed runs
    clock = _FakeClock([1000.0])
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock))
    timing.time_cuda(clock.fn, warmup=10, repeats=50, max_seconds=1.0)
    assert clock.calls == 1 + 0 + timing.MIN_REPEATS
    clock = _FakeClock([0.01])
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock))
    timing.time_cuda(clock.fn, warmup=10, repeats=50, max_seconds=5.0)
    assert clock.calls == 10 + 50  # fast: exactly what was asked (the estimate is the first warm-up)


def test_unchecked_launches_restores_the_flag_even_on_error():
    from fagen import runtime

    saved = runtime.CHECK_LAUNCHES
    runtime.CHECK_LAUNCHES = True   # as FAGEN_SYNC_LAUNCHES=1 sets it
    try:
        with pytest.raises(KeyError):
            with timing.unchecked_launches():
                assert runtime.CHECK_LAUNCHES is False
                raise KeyError("boom")
        assert runtime.CHECK_LAUNCHES is True
    finally:
        runtime.CHECK_LAUNCHES = saved


def test_reason_is_one_short_line():
    text = writers.reason(RuntimeError("No available kernel.\n  Aborting " + "x" * 500))
    assert "\n" not in text and len(text) <= 160 and text.startswith("RuntimeError: No available kernel.")


# ---- compile-time probe plumbing (a stand-in probe: no GPU here) ---------------------------------
def test_compile_times_use_one_fresh_cache_for_a_cold_then_a_warm_process(monkeypatch):
    probe = r"""
import json, os, sys
cache = os.environ["FAGEN_CACHE_DIR"]
cold = not os.listdir(cache)
open(os.path.join(cache, "module"), "w").write("compiled")
import fagen.spec  # the package is importable in the child
spec = fagen.spec.spec_from_dict(json.loads(sys.argv[1]))
print("noise")
print("FAGEN_PROBE " + json.dumps({"seconds": 12.5 if cold else 0.25, "kernel": spec.variant_name}))
"""
    monkeypatch.setattr(extras, "_COMPILE_PROBE", probe)
    spec = load_specs(GRID)[4]
    times = extras.measure_compile_times(spec)
    assert times["cold_s"] == 12.5 and times["warm_s"] == 0.25
    assert times["kernel"] == spec.variant_name == "d128_bf16"
    assert times["cold_process_s"] > 0 and times["warm_process_s"] > 0


def test_compile_probe_failure_is_reported(monkeypatch):
    monkeypatch.setattr(extras, "_COMPILE_PROBE", "import sys; sys.exit('nvcc exploded')")
    with pytest.raises(RuntimeError, match="nvcc exploded"):
        extras.measure_compile_times(Spec(head_dim=64))


# ---- the example grid -------------------------------------------------------------------------
def test_bench_example_is_the_issue_grid():
    specs = load_specs(GRID)
    grid = {(s.head_dim, s.mask, s.dtype) for s in specs if not s.dropout}
    assert grid == {(d, m, t) for d in (64, 128) for m in ("none", "causal") for t in ("bf16", "fp16")}
    dropout = [s for s in specs if s.dropout]
    assert sorted(s.head_dim for s in dropout) == [64, 128] and {s.dropout for s in dropout} == {0.1}
    assert all(s.loop_order == "fa2" and s.passes == ("forward", "backward") for s in specs)


def test_pick_variant_defaults_to_the_d128_bf16_forward():
    specs = load_specs(GRID)
    assert bench_main._pick_variant(specs, None).variant_name == "d128_bf16"
    assert bench_main._pick_variant(specs, "d64_fp16").variant_name == "d64_fp16"
    with pytest.raises(SystemExit):
        bench_main._pick_variant(specs, "nope")


def test_bench_and_autotune_import_without_torch_or_pycuda():
    import subprocess

    code = ("import sys; sys.modules['torch'] = sys.modules['pycuda'] = None; "
            "import fagen.bench.kernels, fagen.bench.model, fagen.bench.extras, fagen.bench.__main__, fagen.bench.autotune; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# ---- `python -m fagen.bench modifiers` (FlexAttention versions of examples/modifiers.yaml) -------
def test_every_modifiers_variant_has_a_flex_version_and_inputs():
    from fagen.bench import modifiers

    specs = load_specs(modifiers.SPEC_FILE)
    assert {s.variant_name for s in specs} == set(modifiers.FLEX_VARIANTS)
    makers = {"slope", "cap", "prefix", "doc", "bias"}   # the inputs make_case builds
    assert all(set(dict(s.inputs or ())) <= makers for s in specs)


def test_modifiers_document_ids_are_non_decreasing_documents_of_about_n_over_8():
    from fagen.bench.modifiers import document_ids

    ids = document_ids(8, 4096, seed=1)
    assert ids.shape == (8, 4096) and ids.dtype.name == "int32"
    assert (ids[:, 1:] >= ids[:, :-1]).all() and (ids[:, 0] == 0).all()
    mean_length = 8 * 4096 / sum(int(row.max()) + 1 for row in ids)
    assert 4096 / 16 < mean_length < 4096 / 4


def test_module_cli_parses_the_modifiers_command(monkeypatch):
    from fagen.bench import modifiers

    calls = []
    monkeypatch.setattr(modifiers, "run_modifiers", lambda *a, **kw: calls.append((a, kw)))
    assert bench_main.main(["modifiers", "--seq-lens", "1024", "--json", "x.json"]) == 0
    (args, kwargs), = calls
    assert args == ([1024], 4, 16) and kwargs["json"] == "x.json" and kwargs["first_call"] is False
    assert kwargs["spec_file"] == modifiers.SPEC_FILE and kwargs["variants"] is None and kwargs["head_dim"] is None


def test_modifiers_variants_at_another_head_dim_keep_their_flex_version():
    """`--head-dim 128`: the library's d = 64 mask_mods timed at d = 128, each against its own Flex functions."""
    from fagen.bench import modifiers

    specs = modifiers._load(modifiers.SPEC_FILE, ["documents_bf16_d64", "prefix_lm_bf16_d64"], head_dim=128)
    assert [(s.variant_name, s.head_dim) for s in specs] == [("documents_bf16_d64_at_d128", 128),
                                                              ("prefix_lm_bf16_d64_at_d128", 128)]
    assert specs[0].mask_mod == "doc[b, i] == doc[b, j]" and specs[0].mask == "causal"
    assert modifiers.flex_mods(specs[1], {"prefix": None}).per_batch
    assert not modifiers.flex_mods(modifiers._load(modifiers.SPEC_FILE, ["dilated_fp16_d64_sm80"], 96)[0], {}).per_batch


# ---- corners (issue 13): the masks Flex gets are fagen's -------------------------------------
def test_corners_in_fp16_are_the_same_rows():
    """`python -m fagen.bench corners --dtype fp16`: every row's spec and shape as written, in fp16."""
    from fagen.bench.corners import CORNERS, corners_in

    fp16 = corners_in("fp16")
    assert len(fp16) == len(CORNERS) and all(c.spec.dtype == "fp16" for c in fp16)
    for mine, written in zip(fp16, CORNERS):
        assert mine[1:] == written[1:]
        assert mine.spec.model_dump() == {**written.spec.model_dump(), "dtype": "fp16"}
    assert corners_in("bf16") == CORNERS



@pytest.mark.parametrize("spec", [Spec(head_dim=64, dtype="bf16", mask="causal"),
                                  Spec(head_dim=64, dtype="bf16", mask="sliding_window", window=37),
                                  Spec(head_dim=64, dtype="bf16", mask="block_sparse", block_size=16)],
                         ids=lambda s: s.mask)
def test_corners_flex_masks_are_the_reference_masks(spec):
    """`python -m fagen.bench corners` times Flex on a mask_mod written by hand: it must be the mask fagen
    computes (fagen.reference.visible_mask), or the comparison is of different work."""
    import numpy as np

    from fagen import reference
    from fagen.bench.corners import CORNERS, _flex_mask

    n = 100
    table = (np.random.default_rng(0).random((7, 7)) < 0.5).astype(np.uint8)
    q_idx, kv_idx = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    flex = np.asarray(_flex_mask(spec, n, table)(0, 0, q_idx, kv_idx), dtype=bool)
    fagen_mask = reference.visible_mask(spec, 1, 1, n, n, block_mask=table)[0, 0]
    assert np.array_equal(flex, np.broadcast_to(fagen_mask, (n, n)))
    assert {c.spec.mask for c in CORNERS} >= {"causal", "sliding_window", "block_sparse"}


def test_paged_bench_counts_bottom_right_causal_pairs_and_scatters_keys_into_pages():
    """fagen.bench.paged: the FLOP count's visible pairs (row i of nq sees keys j <= i + nk - nq), and the pool its
    paged calls read: each sequence's keys are the first rows of its table's pages, in order."""
    torch = pytest.importorskip("torch")
    from fagen.bench.paged import _causal_pairs, _paged

    assert _causal_pairs(3, 3) == 6 and _causal_pairs(2, 5) == 4 + 5 and _causal_pairs(3, 0) == 0
    assert _causal_pairs(4, 2) == 0 + 0 + 1 + 2   # more rows than keys: the first rows see none
    lengths = [5, 0, 17]
    k = torch.randn(sum(lengths), 2, 8)
    v = torch.randn_like(k)
    k_cache, v_cache, table = _paged(k, v, lengths, 4, torch.Generator().manual_seed(0))
    assert table.dtype == torch.int32 and table.shape == (3, 5) and sorted(table.flatten().tolist()) == list(range(15))
    start = 0
    for b, n in enumerate(lengths):
        for cache, original in ((k_cache, k), (v_cache, v)):
            assert torch.equal(cache[table[b].long()].flatten(0, 1)[:n], original[start:start + n])
        start += n


def test_mla_flops_count_each_product_at_its_head_dim():
    """Equal head dims give the usual counts (forward 4 N^2 d, backward 2.5x); 192 / 128 counts each product."""
    from fagen.bench.mla import mla_flops
    from fagen.bench.timing import attention_flops

    for causal, mask in ((False, "none"), (True, "causal")):
        for pass_name in ("forward", "backward"):
            assert mla_flops(2, 3, 256, 64, 64, causal, pass_name) == attention_flops(2, 3, 256, 256, 64, mask=mask,
                                                                                      pass_name=pass_name)
    assert mla_flops(1, 1, 10, 192, 128, False, "forward") == 100 * 2 * (192 + 128)
    assert mla_flops(1, 1, 10, 192, 128, True, "backward") == 50 * 2 * (3 * 192 + 2 * 128)


def test_bench_inputs_and_flops_take_a_value_head_dim(monkeypatch):
    """`fagen bench` on an MLA spec: v and dO of value_head_dim, and each product counted at its own d."""
    torch = pytest.importorskip("torch")
    from fagen.bench import timing

    monkeypatch.setattr(timing, "DEVICE", "cpu")
    spec = Spec(head_dim=192, value_head_dim=128, dtype="bf16", mask="causal")
    inputs = timing.make_inputs(spec, 2, 4, 10, kv_heads=2)
    assert [tuple(t.shape) for t in (inputs.q, inputs.k, inputs.v, inputs.do)] == [
        (2, 4, 10, 192), (2, 2, 10, 192), (2, 2, 10, 128), (2, 4, 10, 128)]
    assert timing.spec_flops(spec, 1, 1, 10, "forward") == 50 * 2 * (192 + 128)
    assert timing.spec_flops(spec, 1, 1, 10, "backward") == 50 * 2 * (3 * 192 + 2 * 128)
    plain = Spec(head_dim=64, dtype="bf16")
    assert timing.spec_flops(plain, 1, 1, 10, "backward") == timing.attention_flops(1, 1, 10, 10, 64,
                                                                                    pass_name="backward")
    assert torch.is_tensor(inputs.v)


def test_the_mla_decode_bench_checks_outputs_against_the_float64_reference_s_answer():
    """bench/mla_decode.py's fp32 reference on the first sequence (v = k's first 512 columns, every key visible) is
    the float64 reference's answer: what fagen and each peer are checked against before they are timed."""
    torch = pytest.importorskip("torch")
    from fagen import reference
    from fagen.bench.mla_decode import HEAD_DIM, VALUE_DIM, _first_sequence_reference
    from fagen.spec import Spec

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, HEAD_DIM, generator=generator)
    k = torch.randn(2, 1, 70, HEAD_DIM, generator=generator)
    spec = Spec(head_dim=HEAD_DIM, value_head_dim=VALUE_DIM, latent_kv=True, dtype="bf16", softmax_scale=0.07)
    ref_o, _ = reference.attention_forward(q[:1].double().numpy(), k[:1].double().numpy(),
                                           k[:1, ..., :VALUE_DIM].double().numpy(), spec)
    got = _first_sequence_reference(q, k, 0.07).double().numpy()
    assert abs(got - ref_o[0]).max() < 1e-4
