"""Benchmarks: fagen against PyTorch's attention, at the three levels of docs/design.md's "Measuring speed".

    timing.py   how a call is timed (CUDA events), FLOP counts, fresh inputs, the error measure
    peers.py    the implementations fagen is compared with (SDPA: flash, cuDNN, memory-efficient)
    report.py   records (Row, BenchReport), the environment, and the writers: table, CSV, JSON, plot, Markdown
    kernels.py  `fagen bench`: kernel level, each pass timed alone against SDPA, after a correctness check
    model.py    `fagen bench-model`: a transformers model's training step, and the host time per call
    extras.py   compile / cache-load times, the GEMM rate and ptxas's report, for BENCHMARKS.md
    __main__.py `python -m fagen.bench`: extras, and plots / Markdown redrawn from a saved JSON

The runtime never imports this package; records and writers run without a GPU.
"""
