"""One small forward + backward per mask kind (and fa1), for compute-sanitizer memcheck / racecheck:
    compute-sanitizer --tool memcheck python dev/gpu/sanitize.py
    compute-sanitizer --tool racecheck python dev/gpu/sanitize.py
    SANITIZE_ONLY=d59,d111 compute-sanitizer --tool memcheck python dev/gpu/sanitize.py   # some specs only
    SANITIZE_PART=3 ... (SPECS[3] only), SANITIZE_PART=folded, =pad_rows, =paged: one part per process
    (synccheck stops a process at its first error: dev/gpu/sanitize_parts.sh runs every part on its own)
Shapes are small and not multiples of the tiles, so the edge paths run."""
import sys
import os

# dev/gpu/sanitize.py -> the repository root, three folders up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fagen.spec import Spec
from fagen.testing import Case, assert_matches_reference, input_fields

SPECS = [
    Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.1),
    Spec(head_dim=64, dtype="bf16", mask="causal"),
    Spec(head_dim=64, dtype="fp16", mask="sliding_window", window=40),
    Spec(head_dim=64, dtype="fp32", mask="padding"),
    Spec(head_dim=64, dtype="fp16", mask="block_sparse", block_size=64),
    Spec(head_dim=64, dtype="fp16", mask="causal", loop_order="fa1", dropout=0.2),
    Spec(head_dim=64, dtype="fp16", mask="causal", deterministic=True),
    Spec(head_dim=128, dtype="bf16", mask="causal"),  # d=128 warpgroup-MMA forward and backward on sm_90
    # 64-byte swizzle panels (d an odd number of 32-column halves) on warpgroup MMA, with dropout
    Spec(head_dim=96, dtype="bf16", mask="causal", dropout=0.1),
    Spec(head_dim=32, dtype="fp16", mask="sliding_window", window=40),
    # the wide backwards (P^T, dS^T shared between warps through shared memory): on warpgroup MMA with dropout
    # (d = 256) and 64-byte panels (d = 192); on mma.sync at d = 160 and in its sm_80 plan (Br = 32)
    Spec(head_dim=256, dtype="bf16", mask="causal", dropout=0.1),
    Spec(head_dim=192, dtype="bf16", mask="sliding_window", window=40),
    Spec(head_dim=160, dtype="fp16", mask="causal"),
    Spec(head_dim=192, dtype="fp16", mask="none", arch="sm_80"),
    # sm_80's mma.sync plans (fagen.testing.kernel_under_test: compiled for this GPU) with their row pointers in shared
    # memory (block_values_in_shared): the backward's per-step ones at Br = 128 (d = 64) and 64 (d = 128), in registers
    # at Br = 32 (d = 128 with dropout)
    Spec(head_dim=64, dtype="fp16", mask="none", arch="sm_80"),
    Spec(head_dim=128, dtype="bf16", mask="causal", arch="sm_80"),
    Spec(head_dim=128, dtype="fp16", mask="causal", dropout=0.2, arch="sm_80"),
    # head dims padded inside the tensor-core kernels: cp.async with zero columns (40); 4-byte cp.async with a
    # 2-byte last column where rows are 4-byte aligned, element loads where not (59, heads = 1 below); 4-byte
    # copies with threads sitting out and element loads in the odd heads (111 on sm_80: 56 words a row, 128 threads)
    Spec(head_dim=40, dtype="fp16", mask="none", dropout=0.1, passes=["forward", "backward", "decode"]),
    Spec(head_dim=59, dtype="bf16", mask="causal", passes=["forward", "backward", "decode"]),
    Spec(head_dim=111, dtype="fp16", mask="sliding_window", window=30, arch="sm_80"),
    # packed variable-length batches: empty and length-1 sequences, spare rows after the last one
    Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed"),
    Spec(head_dim=64, dtype="fp16", mask="none", dropout=0.1, layout="packed", arch="sm_80"),
    # mask_mod / score_mod: a run-time summary (document ids) and clamped input loads; a derivative != 1
    Spec(head_dim=64, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}),
    # a mask_mod on the warp-specialized backward (the producer's walk handed over with each stage)
    Spec(head_dim=64, dtype="fp16", mask_mod="j <= i and (i - j < 100 or j < 4)"),
    # ... a document mask at d = 128, packed (spare rows): forward_wgmma's 64 x 64 at two blocks, tested ahead
    Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"},
         layout="packed"),
    # ... and on the warp-specialized d = 128 forward, a mask_mod with a per-batch input, packed (the producer's
    # walk handed over with each stage, spare rows)
    Spec(head_dim=128, dtype="bf16", mask_mod="j < prefix[b] or j <= i", inputs={"prefix": "int32"}, layout="packed"),
    Spec(head_dim=128, dtype="bf16", score_mod="cap * tanh(score / cap) + bias[h, i - j]",
         inputs={"cap": "scalar", "bias": "float32"}, dropout=0.1),
    # score_mod input gradients (fagen.testing asks for them): per-head sums of a derivative that reads the score
    Spec(head_dim=64, dtype="bf16", mask="causal", score_mod="score + w[h] * tanh(score)", inputs={"w": "float32"}),
    # the transformers integration's padded batches (fagen.integrations.transformers): each row's key run, ANDed
    # with causal (d = 128, warpgroup MMA), a static cache's runs, and the keys' own padding (d = 64)
    Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="rows[b, 0] <= j < rows[b, 1]", inputs={"rows": "int32"}),
    Spec(head_dim=64, dtype="fp16", mask_mod="rows[b, 0] <= j < rows[b, 1] and j <= i + rows[b, 2] - Nq",
         inputs={"rows": "int32"}),
    Spec(head_dim=64, dtype="bf16", mask="causal", mask_mod="keys[b, j] != 0", inputs={"keys": "int32"}),
    # a value head dim unlike the query's (MLA): V, O, dO, dV of value_head_dim columns, zeros past them in the tiles;
    # the wide backward's dims split between warpgroups (192 / 128), v wider than q (64 / 128), the decode kernel
    Spec(head_dim=192, value_head_dim=128, dtype="bf16", mask="causal"),
    Spec(head_dim=96, value_head_dim=64, dtype="fp16", dropout=0.1),
    Spec(head_dim=64, value_head_dim=128, dtype="bf16", mask="causal"),
    Spec(head_dim=128, value_head_dim=64, dtype="bf16", mask="padding", passes=["forward", "backward", "decode"]),
    Spec(head_dim=192, value_head_dim=128, dtype="fp16", mask="causal", arch="sm_80"),
    # ... V's tiles narrowed past the values (96 columns for 72, 32 for 24), backward_wgmma (block-sparse)
    Spec(head_dim=192, value_head_dim=72, dtype="bf16", mask="causal"),
    Spec(head_dim=64, value_head_dim=24, dtype="fp16"),
    Spec(head_dim=96, value_head_dim=64, dtype="bf16", mask="block_sparse", block_size=64),
    # the fp8 forward (forward_wgmma's e4m3 build): V^T written from V's stage by every thread between two barriers
    # (d = 128: forward_wgmma_ws's e4m3 build, the producer writing V^T once V's copies landed)
    Spec(head_dim=128, dtype="fp8_e4m3", mask="causal"),
    Spec(head_dim=128, dtype="fp8_e4m3", dropout=0.1, layout="packed"),
    Spec(head_dim=256, dtype="fp8_e4m3", dropout=0.1),
    Spec(head_dim=64, dtype="fp8_e4m3", mask="causal", layout="packed"),
    # decoding from a latent cache (MLA): one K tile serves both products, P~ and the row maxes shared by the warps
    Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", mask="padding"),
    Spec(head_dim=160, value_head_dim=128, latent_kv=True, dtype="fp16", mask="causal"),
    Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", arch="sm_80"),   # 32-key tiles, 4 warps
]
CASE = dict(batch=2, heads=2, seq_q=150, seq_k=133, layout="bnhd", data_seed=1, seed=7, offset=3)
GROUPED = dict(CASE, heads=4, kv_heads=1)                       # MQA: the backward's group sums
DECODE = dict(CASE, heads=8, kv_heads=2, seq_q=2, seq_k=3001)   # 4 x 2 rows per block: the split-KV kernel


def main():
    ONLY = [w for w in os.environ.get("SANITIZE_ONLY", "").split(",") if w]   # variant-name substrings, e.g. d59,d111
    PART = os.environ.get("SANITIZE_PART", "")
    chosen = [s for s in SPECS if not ONLY or any(w in s.variant_name for w in ONLY)]
    if PART:
        chosen = [SPECS[int(PART)]] if PART.isdigit() else []
    for spec in chosen:
        print("checking", spec.variant_name, flush=True)
        extra = {}
        if spec.mask == "padding":
            extra["kv_lengths"] = (133, 70)
        if spec.mask == "block_sparse":
            extra["block_mask"] = ((1, 0, 1), (0, 1, 1), (1, 1, 0))
        # mask_mod / score_mod inputs as the property tests draw them, at sizes covering every case below
        extra.update(input_fields(spec, 4, 4, 150, 133, seed=5, scalars=[2.5] * len(spec.modifiers.scalars)))
        cases = [CASE] + ([GROUPED] if spec.mask in ("none", "causal") else [])
        cases += [dict(CASE, heads=1)] if spec.head_dim % 2 else []   # bnhd, one head: an odd row stride
        if spec.layout == "packed":
            cases = [dict(GROUPED, batch=4, q_lengths=(150, 0, 1, 97), k_lengths=(133, 5, 0, 140), spare_rows=3)]
        cases += [DECODE] if "decode" in spec.passes else []
        for case in cases:
            errors = assert_matches_reference(spec, Case(**case, **extra), backward="backward" in spec.passes)
            print(spec.variant_name, case["heads"], case.get("kv_heads"), {k: f"{v:.2e}" for k, v in errors.items()},
                  flush=True)
    # grouped KV heads folded: every backward block walks its K/V head's group (runtime.kernel.FOLD_WAVES at 0: at any
    # size; a shape of its own, so that no call remembered unfolded above is taken)
    from fagen import runtime

    runtime.kernel.FOLD_WAVES = 0
    for spec in (Spec(head_dim=64, dtype="bf16", mask="causal"),
                 Spec(head_dim=128, dtype="fp16", mask="sliding_window", window=40),
                 # a mask_mod that does not read h: the producer walks the first head's tiles again for each head
                 Spec(head_dim=128, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"}),
                 # ... on 128-row blocks (d = 64), where the consumers' head loop spills a few bytes
                 Spec(head_dim=64, dtype="bf16", mask="causal", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})):
        if (not PART or PART == "folded") and (not ONLY or any(w in spec.variant_name for w in ONLY)):
            case = dict(GROUPED, kv_heads=2, seq_q=140, seq_k=141)
            case.update(input_fields(spec, 4, 4, 140, 141, seed=5, scalars=[]))
            errors = assert_matches_reference(spec, Case(**case), backward=True)
            print(spec.variant_name, "folded", {k: f"{v:.2e}" for k, v in errors.items()}, flush=True)
    # the torch adapter's head-dim padding kernel (fagen/pad_rows.py) on the layouts it is given, odd widths
    import torch
    from fagen import pad_rows

    for shape, width, padded in (((2, 3, 77, 59), 59, 64), ((2, 77, 3, 111), 111, 112), ((131, 3, 3), 3, 8)):
        if PART and PART != "pad_rows":
            break
        tensors = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        if len(shape) == 4 and width == 111:
            tensors = [t.transpose(1, 2) for t in tensors]   # (B, N, H, d) seen as (B, H, N, d)
        result = pad_rows.pad(tensors, padded)
        assert all(torch.equal(r, torch.nn.functional.pad(t, (0, padded - width))) for t, r in zip(tensors, result))
        print("pad_rows", shape, padded, "ok", flush=True)
    # packed query rows against a paged K/V cache (tests/test_paged_prefill_gpu.py's check): warp-specialized
    # d = 128 and forward_wgmma d = 64 with dropout, pages of 1 and 48 rows
    if not PART or PART == "paged":
        import tests.test_paged_prefill_gpu as paged

        for spec, page_size in ((paged.SPECS[0], 48), (paged.SPECS[1], 1)):
            if not ONLY or any(w in spec.variant_name for w in ONLY):
                paged.test_paged_prefill_equals_the_contiguous_call_and_the_reference(spec, page_size)
                print(spec.variant_name, "paged", page_size, "ok", flush=True)
    print("sanitize run complete", file=sys.stderr)


if __name__ == "__main__":
    main()
