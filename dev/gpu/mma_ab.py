"""A/B timing of sm_80's mma.sync plans (forward_fa2_mma, backward_fa2_mma), compiled for the GPU at hand by
fagen.testing.kernel_under_test, across fagen trees in one process per tree: a proxy for a template change
aimed at sm_80 where no A100 is at hand (the plans and code are sm_80's, ptxas' allocation is this GPU's).

    git archive <commit> | tar x -C .ab_old
    FAGEN_CACHE_DIR=/tmp/cache-old python3 dev/gpu/mma_ab.py $PWD/.ab_old old
    python3 dev/gpu/mma_ab.py $PWD new
"""
import sys

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

from fagen import runtime  # noqa: E402
from fagen.bench.timing import time_cuda  # noqa: E402
from fagen.spec import Spec  # noqa: E402
from fagen.testing import kernel_under_test  # noqa: E402

runtime.ensure_context()


# (head dim, heads, spec fields); batch 4, N = 4096, bf16 unless the fields say otherwise
CASES = [(64, 32, dict(mask="none")), (64, 32, dict(mask="causal")), (128, 16, dict(mask="none")),
         (128, 16, dict(mask="causal")), (160, 16, dict(mask="causal")),
         (128, 16, dict(mask="sliding_window", window=256, dtype="fp16")), (64, 32, dict(mask="none", dropout=0.1)),
         (32, 32, dict(mask="none", dropout=0.1))]
rows = []
for d, heads, fields in CASES:
    fields = {"dtype": "bf16", **fields}
    kernel = kernel_under_test(Spec(head_dim=d, arch="sm_80", **fields))
    dtype = torch.bfloat16 if fields["dtype"] == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(4, heads, 4096, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    o, lse = kernel.forward(q, k, v)
    forward = time_cuda(lambda: kernel.forward(q, k, v), warmup=5, repeats=30)
    backward = time_cuda(lambda: kernel.backward(q, k, v, o, lse, do), warmup=5, repeats=30)
    label = f"d{d} {fields['mask']}{fields.get('window') or ''}{' drop' if fields.get('dropout') else ''}"
    rows.append(f"{label}: fwd {forward:.3f} bwd {backward:.3f} ms")
print(sys.argv[2], " | ".join(rows))
