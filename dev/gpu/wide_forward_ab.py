"""Forward time of the wide head dims (d = 160, 192, 256, bf16) in the fagen tree given, against SDPA-flash on
the same tensors, at the shapes issue 13's rows use (N = 1024 without a mask, the d = 192 row under SDPA-flash, and
causal N = 4096): an A/B of a forward template change across trees, e.g.

    FAGEN_CACHE_DIR=/tmp/cache-old python3 dev/gpu/wide_forward_ab.py $PWD/.ab_old old
    python3 dev/gpu/wide_forward_ab.py $PWD new
"""
import statistics
import sys

sys.path.insert(0, sys.argv[1])
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fagen import jit, runtime
from fagen.spec import Spec

runtime.ensure_context()


def median_ms(fn, n=30):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


rows = []
for d, mask, (batch, heads, n) in [(192, "none", (8, 8, 1024)), (192, "none", (16, 16, 1024)), (160, "none", (16, 16, 1024)),
                                   (256, "none", (16, 16, 1024)), (160, "causal", (4, 16, 4096)),
                                   (192, "causal", (4, 16, 4096)), (256, "causal", (4, 16, 4096))]:
    kernel = jit.compile(Spec(head_dim=d, dtype="bf16", mask=mask))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    fagen_ms = median_ms(lambda: kernel.forward(q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal"))
    rows.append(f"d{d} {mask} {batch}x{heads}x{n}: fagen {fagen_ms * 1000:.0f} us flash {flash_ms * 1000:.0f} us "
                f"({flash_ms / fagen_ms:.3f}x)")
print(sys.argv[2], " | ".join(rows))
