"""A/B timing of the padded forward / backward kernels of two fagen trees on one GPU, e.g. before and
after a template change (bf16, batch 4, N = 4096, d 64 and 128, causal and not; median of 30 calls; with
AB_DROPOUT=1 also d 64 and 128 with dropout 0.1, causal and not; with AB_WINDOW=1 d 128 and 64 with a sliding
window of 1024 at batch 2, N = 8192; with AB_WIDE=1 only d = 160, 192, 256 causal and d = 256 at N = 3000):

    git archive <commit> | tar x -C ab_old        # the tree to compare with (a throw-away copy)
    FAGEN_CACHE_DIR=/tmp/cache-old python3 dev/gpu/ab_time.py $PWD/ab_old old
    python3 dev/gpu/ab_time.py $PWD new
"""
import os, sys, statistics
sys.path.insert(0, sys.argv[1])
import torch
from fagen import jit, runtime
from fagen.spec import Spec
runtime.ensure_context()
def t(fn, n=30):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    es=[(torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a,b in es:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a,b in es)
out=[]
# (head dim, heads, mask, dropout, window, batch, N)
CASES=[(d,h,mask,0.0,None,4,4096) for d,h in ((64,32),(128,16)) for mask in ("causal","none")]
if os.environ.get("AB_DROPOUT"): CASES+=[(d,h,mask,0.1,None,4,4096) for d,h in ((64,32),(128,16)) for mask in ("causal","none")]
if os.environ.get("AB_WINDOW"): CASES+=[(128,16,"sliding_window",0.0,1024,2,8192), (64,16,"sliding_window",0.0,1024,2,8192)]
if os.environ.get("AB_WIDE"): CASES=[(d,16,"causal",0.0,None,4,4096) for d in (160,192,256)] + [(256,16,"none",0.0,None,2,3000)]
for d,h,mask,p,window,batch,n in CASES:
    k=jit.compile(Spec(head_dim=d,dtype="bf16",mask=mask,dropout=p,window=window))
    g=torch.Generator(device="cuda").manual_seed(0)
    q,kk,v,do=(torch.randn(batch,h,n,d,device="cuda",dtype=torch.bfloat16,generator=g) for _ in range(4))
    o,lse=k.forward(q,kk,v)
    f=t(lambda: k.forward(q,kk,v)); b=t(lambda: k.backward(q,kk,v,o,lse,do))
    out.append(f"d{d} {mask}{window or ''}{' drop' if p else ''}: fwd {f:.3f} ms bwd {b:.3f} ms")
print(sys.argv[2], " | ".join(out))
