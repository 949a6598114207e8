# Where fagen-with-sinks differs from eager gpt-oss: one attention layer, then the logits (tiny model, bf16 vs fp32 eager).
import copy, torch, sys
sys.path.insert(0, ".")
import fagen.torch
from fagen.integrations import transformers as fh
fh.register()
from transformers import GptOssConfig, AutoModelForCausalLM
cfg = GptOssConfig(vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                   max_position_embeddings=4096)
torch.manual_seed(0)
nets = {}
for name, dt in (("fagen", torch.bfloat16), ("eager", torch.bfloat16), ("fp32", torch.float32)):
    nets[name] = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="fagen" if name == "fagen" else "eager", dtype=dt).cuda()
sd = nets["fagen"].state_dict()
for n, m in nets.items():
    m.load_state_dict({k: v.to(next(m.parameters()).dtype) if v.is_floating_point() else v for k, v in sd.items()})
x = torch.randint(0, 1024, (2, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
# one attention layer alone, same inputs
attn = {n: m.model.layers[0].self_attn for n, m in nets.items()}
h = torch.randn(2, 512, 512, device="cuda")
pos = torch.arange(512, device="cuda")[None]
emb = nets["fp32"].model.rotary_emb(h, pos)
mask = {}
for n in nets:
    a = attn[n]
    hh = h.to(next(a.parameters()).dtype)
    if n == "fagen":
        mk = None   # (fagen_mask's answer for a plain window: the kernel applies it)
    else:
        visible = fh.bottom_right_mask(512, 512, 128, "cuda")
        mk = torch.zeros(visible.shape, dtype=hh.dtype, device="cuda").masked_fill(~visible, torch.finfo(hh.dtype).min)
    with torch.no_grad():
        mask[n] = a(hh, (emb[0].to(hh.dtype), emb[1].to(hh.dtype)), mk)[0]
print("attention layer 0: fagen vs fp32", rel(mask["fagen"], mask["fp32"]), "eager bf16 vs fp32", rel(mask["eager"], mask["fp32"]))
with torch.no_grad():
    logits = {n: m(x).logits for n, m in nets.items()}
print("logits: fagen", rel(logits["fagen"], logits["fp32"]), "eager", rel(logits["eager"], logits["fp32"]), "fallbacks", fh.fallback_reasons())
