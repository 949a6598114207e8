"""Greedy generation with a static cache (cache_implementation="static"), fagen against SDPA, in one process: a
small Llama built from a config (random weights, bf16), the same prompt, the median wall time of a few runs and the
tokens each made (call level: prefill through the mask_mod j <= i + end[b] - Nq, the steps on the decode kernel).

    python dev/gpu/static_cache_generate.py [--prompt 512] [--new 64] [--batch 1,8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from fagen.integrations import transformers as fagen_hf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    fagen_hf.register()
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192)
    torch.manual_seed(0)
    models = {name: AutoModelForCausalLM.from_config(config, attn_implementation=name, dtype=torch.bfloat16).cuda().eval()
              for name in ("fagen", "sdpa")}
    models["sdpa"].load_state_dict(models["fagen"].state_dict())
    for batch in map(int, args.batch.split(",")):
        prompt = torch.randint(0, 32000, (batch, args.prompt), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(1))
        times, tokens = {}, {}
        for name, model in models.items():
            runs = []
            for _ in range(args.runs + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                         pad_token_id=0, cache_implementation="static")
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - start)
            times[name], tokens[name] = statistics.median(runs[1:]) * 1e3, out
        same = int((tokens["fagen"] == tokens["sdpa"]).all(dim=0).long().cumprod(0).sum()) - args.prompt
        print(f"batch {batch} prompt {args.prompt} new {args.new}: fagen {times['fagen']:.1f} ms, SDPA {times['sdpa']:.1f} ms, "
              f"SDPA / fagen {times['sdpa'] / times['fagen']:.2f}; tokens equal for the first {same} of {args.new}; "
              f"fallbacks {sorted(fagen_hf.fallback_reasons())}", flush=True)


if __name__ == "__main__":
    main()
