"""Records and writers of `fagen bench` and `fagen bench-model`: plain data, no GPU needed.

Row and BenchReport (one timed configuration, a run; JSON round trip), the environment recorded with
every set of numbers (date, GPU, versions, command line), and the writers: the rich table, CSV, JSON,
the PNG plot and BENCHMARKS.md's Markdown tables. tests/test_bench.py drives them with fake numbers.
"""
from __future__ import annotations

import contextlib
import csv as csv_module
import datetime as _dt
import json as json_module
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from rich.markup import escape

from fagen import __version__

#: What a row times: fagen and the two SDPA backends it is compared with (fagen/bench/peers.py).
IMPLS = ("fagen", "flash", "cudnn")
IMPL_LABELS = {"fagen": "fagen", "flash": "SDPA flash", "cudnn": "SDPA cuDNN"}
#: The issue's targets, fagen / SDPA-flash, per pass (the table colours ratios against them).
TARGET_RATIO = {"forward": 1.0, "backward": 0.9}


# ==== records ==================================================================================
@dataclass
class Row:
    """One (spec, N, pass): the median milliseconds of each implementation (None: n/a) and why not."""

    spec: str
    dtype: str
    head_dim: int
    mask: str
    dropout: float
    seq_len: int
    batch: int
    heads: int
    pass_name: str
    flops: float
    ms: dict = field(default_factory=dict)        # impl -> median ms, or None
    notes: dict = field(default_factory=dict)     # impl -> why it is n/a
    rel_error: Optional[float] = None             # fagen vs SDPA: o (forward) or worst of dq, dk, dv (backward)
    check: str = "not checked"                    # "ok", "FAIL", or "not checked: <why>"
    plan: str = ""                                # the tile plan fagen ran: "Br=128 Bc=64 warps=4 (...)"
    kv_heads: Optional[int] = None                # heads of k and v where fewer than heads (grouped KV heads)

    def heads_text(self) -> str:
        """"32" or, with grouped KV heads, "32/8" (query heads / KV heads)."""
        return f"{self.heads}/{self.kv_heads}" if self.kv_heads and self.kv_heads != self.heads else str(self.heads)

    def tflops(self, impl: str) -> Optional[float]:
        ms = self.ms.get(impl)
        if ms is None or not ms > 0:
            return None
        return self.flops / (ms * 1e-3) / 1e12

    def ratio(self, other: str, impl: str = "fagen") -> Optional[float]:
        """Speed of `impl` over `other` (>1: impl is faster): the ratio of their TFLOP/s."""
        mine, theirs = self.tflops(impl), self.tflops(other)
        if mine is None or theirs is None:
            return None
        return mine / theirs

    def to_dict(self) -> dict:
        out = {"spec": self.spec, "dtype": self.dtype, "head_dim": self.head_dim, "mask": self.mask,
               "dropout": self.dropout, "seq_len": self.seq_len, "batch": self.batch, "heads": self.heads,
               "pass": self.pass_name, "flops": self.flops}
        for impl in IMPLS:
            out[f"{impl}_ms"] = self.ms.get(impl)
        for impl in IMPLS:
            out[f"{impl}_tflops"] = self.tflops(impl)
        for other in IMPLS[1:]:
            out[f"fagen_over_{other}"] = self.ratio(other)
        out.update(rel_error=self.rel_error, check=self.check, plan=self.plan)
        for impl in IMPLS:
            out[f"{impl}_note"] = self.notes.get(impl, "")
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Row":
        return cls(spec=data["spec"], dtype=data["dtype"], head_dim=int(data["head_dim"]), mask=data["mask"],
                   dropout=float(data["dropout"]), seq_len=int(data["seq_len"]), batch=int(data["batch"]),
                   heads=int(data["heads"]), pass_name=data["pass"], flops=float(data["flops"]),
                   ms={impl: _float_or_none(data.get(f"{impl}_ms")) for impl in IMPLS},
                   notes={impl: data[f"{impl}_note"] for impl in IMPLS if data.get(f"{impl}_note")},
                   rel_error=_float_or_none(data.get("rel_error")), check=data.get("check", "not checked"),
                   plan=data.get("plan", ""))


def _float_or_none(value: Any) -> Optional[float]:
    if value is None or value == "":
        return None
    return float(value)


@dataclass
class BenchReport:
    meta: dict
    rows: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "rows": [row.to_dict() for row in self.rows]}

    @classmethod
    def from_dict(cls, data: dict) -> "BenchReport":
        return cls(dict(data.get("meta", {})), [Row.from_dict(row) for row in data.get("rows", [])])

    @classmethod
    def load(cls, path) -> "BenchReport":
        return cls.from_dict(json_module.loads(Path(path).read_text()))

    @property
    def failures(self) -> list:
        return [row for row in self.rows if row.check == "FAIL"]


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """This process's command line, as typed (`fagen bench ...`, not the script's full path)."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return ""
    head = os.path.basename(argv[0])
    folders = Path(argv[0]).parts[:-1]
    if head.endswith(".py") and "fagen" in folders:  # python -m fagen.cli / fagen.bench: a module of the package
        top = len(folders) - 1 - folders[::-1].index("fagen")
        module = ".".join(folders[top:] + (() if head == "__main__.py" else (head[:-3],)))
        head = f"{os.path.basename(sys.executable)} -m {module}"
    elif head in ("-c", "-m") or head.endswith(".py"):
        head = f"{os.path.basename(sys.executable)} {argv[0]}"
    return " ".join([head, *(shlex.quote(arg) for arg in argv[1:])])


def environment(torch: Any = None) -> dict:
    """Date, GPU, software versions and the command line: recorded with every set of numbers."""
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(), "fagen": __version__, "python": platform.python_version()}
    if torch is not None:
        meta["torch"] = torch.__version__
        meta["cuda"] = getattr(torch.version, "cuda", None)
        with contextlib.suppress(Exception):
            meta["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            meta["gpu"] = torch.cuda.get_device_name()
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            meta["sm_count"] = props.multi_processor_count
            meta["capability"] = f"sm_{props.major}{props.minor}"
    return meta


def reason(err: BaseException, limit: int = 160) -> str:
    """An exception as one short line, for the 'n/a' notes."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ==== writers (CPU) ============================================================================
def make_console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console.width = 220  # piped or captured: no screen to fit
    return console


def fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(report: BenchReport, console=None) -> None:
    """The rich table: per row TFLOP/s, ratios (green where the issue's target is met) and ms of each."""
    from rich.table import Table

    console = console or make_console()
    meta = report.meta
    table = Table(title=escape(f"fagen bench: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
                               f"{meta.get('date', '')}"),
                  title_justify="left")
    for header in ("spec", "N", "batch", "heads", "pass", "fagen TFLOP/s", "flash TFLOP/s", "cudnn TFLOP/s",
                   "fagen/flash", "fagen/cudnn", "fagen ms", "flash ms", "cudnn ms", "check"):
        table.add_column(header, no_wrap=header == "spec", justify="left" if header in ("spec", "pass", "check")
                         else "right")
    notes: dict[str, list[str]] = {}
    for row in report.rows:
        ratio = row.ratio("flash")
        target = TARGET_RATIO.get(row.pass_name, 1.0)
        flash_ratio = fmt(ratio, ".2f")
        if ratio is not None:
            flash_ratio = f"[{'green' if ratio >= target else 'red'}]{flash_ratio}[/]"
        check = row.check if len(row.check) <= 48 else row.check[:45] + "..."  # in full in the CSV/JSON
        check = escape(check if row.rel_error is None else f"{check} {row.rel_error:.1e}")
        if row.check == "FAIL":
            check = f"[bold red]{check}[/]"
        table.add_row(escape(row.spec), str(row.seq_len), str(row.batch), row.heads_text(), row.pass_name,
                      *(fmt(row.tflops(i), ".1f") for i in IMPLS), flash_ratio, fmt(row.ratio("cudnn"), ".2f"),
                      *(fmt(row.ms.get(i), ".3f") for i in IMPLS), check)
        for impl, note in row.notes.items():
            notes.setdefault(f"{impl} n/a: {note}", []).append(f"{row.spec} N={row.seq_len} {row.pass_name}")
    console.print(table)
    for note, where in notes.items():
        console.print(f"  {escape(note)}  [dim]({len(where)} row{'s' if len(where) > 1 else ''}, "
                      f"e.g. {escape(where[0])})[/dim]")


def _meta_columns(report: BenchReport) -> dict:
    meta = report.meta
    return {"date": meta.get("date", ""), "gpu": meta.get("gpu", ""), "torch": meta.get("torch", ""),
            "command": meta.get("command", "")}


def write_csv(report: BenchReport, path) -> Path:
    """One line per row with every number, then the date, GPU, torch version and command line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**row.to_dict(), **_meta_columns(report)} for row in report.rows]
    header = list(rows[0]) if rows else list(Row("", "", 0, "", 0, 0, 0, 0, "", 0).to_dict()) + list(
        _meta_columns(report))
    with path.open("w", newline="") as handle:
        writer = csv_module.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def write_json(report: BenchReport, path) -> Path:
    """{"meta": {date, gpu, torch, command, settings...}, "rows": [every number of every row]}."""
    return write_results(path, report.to_dict())


def write_results(path, data: Any) -> Path:
    """A bench's results as strict JSON (strict_json), its folder made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_module.dumps(strict_json(data), indent=2, default=str) + "\n")
    return path


def strict_json(value: Any) -> Any:
    """inf and NaN (a kernel that wrote NaN has relative error inf) as the strings "inf"/"nan": strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _groups(report: BenchReport) -> list[tuple[str, str, list]]:
    """(spec, pass, rows sorted by N) in the order they first appear."""
    order: dict[tuple[str, str], list] = {}
    for row in report.rows:
        order.setdefault((row.spec, row.pass_name), []).append(row)
    return [(spec, p, sorted(rows, key=lambda r: r.seq_len)) for (spec, p), rows in order.items()]


def plot_report(report: BenchReport, path, console=None) -> Optional[Path]:
    """PNG: one subplot per (spec, pass), TFLOP/s against N (log2 axis), one line per implementation.
    Without matplotlib, says so and returns None (`python -m fagen.bench plot` redraws from the JSON)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        (console or make_console(stderr=True)).print(escape(f"fagen bench: no plot ({err}); redraw it from the JSON "
                                                        f"with `python -m fagen.bench plot`"), style="yellow")
        return None
    groups = _groups(report)
    if not groups:
        raise ValueError("nothing to plot: the report has no rows")
    passes = [p for p in ("forward", "backward") if any(g[1] == p for g in groups)]
    specs = list(dict.fromkeys(g[0] for g in groups))
    ncols = len(passes)
    nrows = len(specs)
    figure, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    styles = {"fagen": dict(color="tab:red", marker="o", linewidth=2.2), "flash": dict(color="tab:blue", marker="s"),
              "cudnn": dict(color="tab:green", marker="^")}
    by_key = {(spec, p): rows for spec, p, rows in groups}
    for r, spec in enumerate(specs):
        for c, pass_name in enumerate(passes):
            ax = axes[r][c]
            rows = by_key.get((spec, pass_name))
            if not rows:
                ax.set_axis_off()
                continue
            drawn = 0
            for impl in IMPLS:
                points = [(row.seq_len, row.tflops(impl)) for row in rows if row.tflops(impl) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, label=IMPL_LABELS[impl], **styles[impl])
                    drawn += 1
            ax.set_xscale("log", base=2)
            ax.set_xticks([row.seq_len for row in rows])
            ax.set_xticklabels([f"{row.seq_len // 1024}k" if row.seq_len % 1024 == 0 else str(row.seq_len)
                                for row in rows])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{spec} ({pass_name})", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
            if drawn:
                ax.legend(fontsize=7, loc="lower right")
            else:
                ax.text(0.5, 0.5, "no timings (see the table's notes)", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
    meta = report.meta
    figure.suptitle(f"fagen vs PyTorch SDPA: {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
                    f"{meta.get('date', '')}", fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.4 * nrows)))   # room for the title above the first row
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def markdown(report: BenchReport, pass_name: str, dropout: Optional[bool] = None) -> str:
    """A Markdown table of one pass for BENCHMARKS.md (dropout=False: without dropout, True: only dropout)."""
    lines = ["| variant | N | batch x heads | fagen TFLOP/s | SDPA flash | SDPA cuDNN | fagen/flash | fagen/cuDNN "
             "| fagen ms | check (rel. err.) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in report.rows:
        if row.pass_name != pass_name or (dropout is not None and bool(row.dropout) != dropout):
            continue
        ratio = row.ratio("flash")
        target = TARGET_RATIO.get(pass_name, 1.0)
        flash_ratio = fmt(ratio, ".2f") + ("" if ratio is None else (" ✓" if ratio >= target else " ✗"))
        check = row.check if row.rel_error is None else f"{row.check} ({row.rel_error:.1e})"
        lines.append(f"| {row.spec} | {row.seq_len} | {row.batch} x {row.heads_text()} | {fmt(row.tflops('fagen'), '.1f')} "
                     f"| {fmt(row.tflops('flash'), '.1f')} | {fmt(row.tflops('cudnn'), '.1f')} | {flash_ratio} "
                     f"| {fmt(row.ratio('cudnn'), '.2f')} | {fmt(row.ms.get('fagen'), '.3f')} | {check} |")
    return "\n".join(lines) + "\n"


def efficiency(report: BenchReport, gemm_tflops: float, head_dim: int = 128, pass_name: str = "forward") -> list[dict]:
    """fagen's TFLOP/s at head_dim as a fraction of the measured GEMM rate, per row."""
    out = []
    for row in report.rows:
        tf = row.tflops("fagen")
        if row.head_dim == head_dim and row.pass_name == pass_name and tf is not None:
            out.append({"spec": row.spec, "seq_len": row.seq_len, "tflops": tf, "fraction_of_gemm": tf / gemm_tflops})
    return out
