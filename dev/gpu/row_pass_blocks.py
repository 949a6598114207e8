"""The backward's row passes (_delta, _dq_convert) at other grid sizes (fagen/runtime/grids.py ROW_PASS_BLOCKS, set here
in-process): each kernel's device time (torch.profiler) for the d = 128 documents backward of the modifier
benchmark (4 x 16 x 2048). 2026-11-26, H200: 34-38 and 27-29 us at every size from 528 to 16384 blocks.

    python3 dev/gpu/row_pass_blocks.py
"""
import sys, os
sys.path.insert(0, os.getcwd())
import torch
from dev.gpu.kernel_times import kernel_table
from fagen import jit, runtime
from fagen.bench.modifiers import document_ids
from fagen.spec import Spec
runtime.ensure_context()
b, h, n, d = 4, 16, 2048, 128
spec = Spec(head_dim=d, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
kernel = jit.compile(spec)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(b, h, n, d, dtype=torch.bfloat16, device="cuda", generator=g) for _ in range(4))
inputs = {"doc": torch.from_numpy(document_ids(b, n, seed=n)).cuda()}
o, lse = kernel.forward(q, k, v, inputs=inputs)
for blocks in (4096, 1056, 2112, 8192, 16384, 528):
    runtime.grids.ROW_PASS_BLOCKS = blocks
    kernel._fast_backward.clear()
    rows = kernel_table(lambda: kernel.backward(q, k, v, o, lse, do, inputs=inputs), reps=30)
    print(blocks, " ".join(f"{key[-12:]}={t:.1f}" for key, (t, c) in rows))
