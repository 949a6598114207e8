"""Padded batches through the transformers integration (issue 58 item 5), in one process on the GPU: a small Llama
built from a config (random weights, bf16), a prefill and a training step of one padded batch (4 x 512 by default,
padding 0/7/100/300 on the left, then on the right) with attn_implementation="fagen" against "sdpa" as PyTorch
dispatches it (a boolean mask: its memory-efficient kernel), the same weights and tokens.

    python dev/gpu/padded_batch_time.py [--layers 4] [--hidden 2048] [--head-dim 128] [--kv-heads 4]
                                        [--batch-pads 0,7,100,300] [--seq 512] [--warmup 5] [--repeats 20]

Rows: prefill (forward, no grad, with a dynamic cache, as generate()'s first step), train (forward, backward and an
AdamW step; labels -100 at the padding), each for left and right padding, plus "none" (the same batch without an
attention mask) for reference. Each row prints fagen's and SDPA's median time over the repeats after the warm-up
(CUDA events around each call; the implementations take turns, one call each, in alternating order, so that drift
and order fall on both alike), the ratio SDPA / fagen (> 1: fagen faster), the largest logit difference at the
positions that see a key, the number of attention calls that reached fagen's kernels in the untimed check, and any
fallback. At 4 x 512 this model's step is mostly launch-bound (host time): compare the rows with padding against the
"none" rows, whose path (no mask) the padding does not touch.
A last pair of rows times fagen with its kernels made unavailable (DEVICE_TYPES emptied): every call falls back to
SDPA with the mask transformers builds for it, which must cost what SDPA itself does (ratio about 1.0).
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import fagen.torch
from fagen.integrations import transformers as fagen_hf


def padded_mask(pads, seq, side):
    positions = torch.arange(seq, device="cuda")
    return torch.stack([(positions >= pad) if side == "left" else (positions < seq - pad) for pad in pads]).long()


def timed(fn, warmup: int, repeats: int, names) -> dict:
    """{name: median ms} of fn(name), the names taking turns (one call each per round, in the reverse order every
    other round, so that whatever the order costs falls on each alike) after `warmup` rounds."""
    for _ in range(warmup):
        for name in names:
            fn(name)
    torch.cuda.synchronize()
    events = {name: [] for name in names}
    for round_ in range(repeats):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(name)
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(a.elapsed_time(b) for a, b in pairs) for name, pairs in events.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch-pads", default="0,7,100,300")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    fagen_hf.register()
    heads = args.hidden // args.head_dim
    mlp = -(-8 * args.hidden // 3 // 256) * 256   # (fagen bench-model's width)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=mlp,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, max_position_embeddings=8192)
    torch.manual_seed(0)
    # (a config each: from_config records the implementation on the config it is given)
    models = {name: AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name,
                                                     dtype=torch.bfloat16).cuda()
              for name in ("fagen", "sdpa")}
    models["sdpa"].load_state_dict(models["fagen"].state_dict())
    initial = {name: tensor.clone() for name, tensor in models["fagen"].state_dict().items()}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, model in models.items()}
    pads = [int(p) for p in args.batch_pads.split(",")]
    x = torch.randint(0, args.vocab, (len(pads), args.seq), device="cuda",
                      generator=torch.Generator(device="cuda").manual_seed(1))
    print(f"{torch.cuda.get_device_name()}: Llama {args.layers} layers, hidden {args.hidden}, {heads} heads / "
          f"{args.kv_heads} KV heads, d {args.head_dim}, batch {len(pads)} x {args.seq}, padding {pads}; median of "
          f"{args.repeats} after {args.warmup} warm-up rounds", flush=True)
    cases = [("left", padded_mask(pads, args.seq, "left")), ("right", padded_mask(pads, args.seq, "right")),
             ("none", None)]
    for side, mask in cases:
        valid = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
        # the positions that see a key (a left-padded row's padding sees none: 0 from both, but compare the rest)
        seen = valid.cumsum(-1) > 0
        labels = x.masked_fill(~valid, -100)

        def prefill(name):
            with torch.no_grad():
                return models[name](x, attention_mask=mask, use_cache=True).logits

        def train(name):
            model = models[name]
            loss = model(x, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            return loss

        fagen_hf.reset_fallbacks()
        real, reached = fagen.torch.attention, []
        fagen.torch.attention = lambda *a, **k: reached.append(1) or real(*a, **k)
        try:
            logits = {name: prefill(name) for name in models}
        finally:
            fagen.torch.attention = real
        difference = (logits["fagen"][seen].float() - logits["sdpa"][seen].float()).abs().max().item()
        for name, model in models.items():
            model.load_state_dict(initial)
        losses = {name: train(name).item() for name in models}
        for name, model in models.items():   # (the same weights again for the timed steps)
            model.load_state_dict(initial)
        for what, fn in (("prefill", prefill), ("train", train)):
            times = timed(fn, args.warmup, args.repeats, list(models))
            note = f"max |logits diff| {difference:.3g}, {len(reached)} calls on fagen" if what == "prefill" else (
                f"first losses fagen {losses['fagen']:.4f} sdpa {losses['sdpa']:.4f}")
            print(f"{what:8s} padding {side:5s}: fagen {times['fagen']:7.3f} ms, SDPA {times['sdpa']:7.3f} ms, "
                  f"SDPA / fagen {times['sdpa'] / times['fagen']:.2f}; {note}; "
                  f"fallbacks {sorted(fagen_hf.fallback_reasons()) or 'none'}", flush=True)
    # the remaining fallback's cost: fagen's kernels unavailable, every call SDPA's with transformers' mask
    kernels = fagen_hf.DEVICE_TYPES
    fagen_hf.DEVICE_TYPES = ()
    try:
        mask = cases[0][1]
        labels = x.masked_fill(~mask.bool(), -100)
        for name, model in models.items():
            model.load_state_dict(initial)

        def prefill(name):
            with torch.no_grad():
                return models[name](x, attention_mask=mask, use_cache=True).logits

        def train(name):
            loss = models[name](x, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)

        fagen_hf.reset_fallbacks()
        for what, fn in (("prefill", prefill), ("train", train)):
            times = timed(fn, args.warmup, args.repeats, list(models))
            print(f"{what:8s} padding left, fagen falling back: {times['fagen']:7.3f} ms, "
                  f"SDPA {times['sdpa']:7.3f} ms, "
                  f"SDPA / fallback {times['sdpa'] / times['fagen']:.2f}; fallbacks "
                  f"{sorted(fagen_hf.fallback_reasons())}", flush=True)
    finally:
        fagen_hf.DEVICE_TYPES = kernels


if __name__ == "__main__":
    main()
