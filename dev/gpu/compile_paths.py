"""Which whole-model torch.compile paths run fagen's kernels and which fall back to SDPA, on the GPU.

A tiny transformers Llama (bf16, 2 layers), compiled whole (torch.compile(model)), one training step and one
no-grad forward per path: with and without a cache (use_cache), with and without an attention_mask of ones.
Prints, per path, the fallback reasons and how many fagen and SDPA kernels the profiler saw.
    python dev/gpu/compile_paths.py
"""
import itertools
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig

from fagen.integrations import transformers as fagen_hf


def kernels(run):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fagen = sum(n.startswith("fagen_") for n in names)
    sdpa = sum(any(t in n.lower() for t in ("flash", "fmha", "cudnn", "efficient_attention", "sdpa")) for n in names)
    return fagen, sdpa


def main():
    fagen_hf.register()
    print("transformers", transformers.__version__, "torch", torch.__version__)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    x = torch.randint(0, 1000, (2, 512), device="cuda")
    for train, cache, mask in itertools.product([True, False], [None, True, False], [False, True]):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = AutoModelForCausalLM.from_config(config, attn_implementation="fagen", torch_dtype=torch.bfloat16).cuda()
        compiled = torch.compile(model)
        kwargs = {"attention_mask": torch.ones_like(x)} if mask else {}
        if cache is not None:
            kwargs["use_cache"] = cache
        fagen_hf.reset_fallbacks()

        def step():
            if train:
                compiled(x, labels=x, **kwargs).loss.backward()
            else:
                with torch.no_grad():
                    compiled(x, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()   # compile
            fagen_n, sdpa_n = kernels(step)
        reasons = sorted(fagen_hf.fallback_reasons())
        print(f"train={train!s:5} use_cache={cache!s:5} attention_mask={mask!s:5}: fagen kernels {fagen_n:3d}, "
              f"SDPA kernels {sdpa_n:3d}, fallbacks: {reasons[0][:60] if reasons else 'none'}")


if __name__ == "__main__":
    main()
