# A/B of template changes across several fagen trees on one GPU: `bash dev/gpu/ab_trees.sh . .ab_old ...`
# (each an untracked copy, e.g. `git archive <commit> | tar x -C .ab_old`, carried as an ignored path).
# Compiles dev/gpu/ab_time.py's kernels for every tree at once (one kernel cache per tree), then times the
# trees in turn, twice round, so that drift on the GPU shows up as a difference between the rounds.
# AB_DROPOUT=1, AB_WINDOW=1: the dropout and sliding-window rows as well; AB_WIDE=1: only d = 160, 192, 256.
# AB_FORWARD=1: forwards only, dev/gpu/forward_ab.py's cases instead (WIDE=1 there: its d > 128 shapes).
source dev/gpu/device_prelude.sh
trees=("$@"); root=$PWD
cache_of() { echo "/tmp/fagen-cache-ab-$(echo "$1" | tr -c 'a-zA-Z0-9' _)"; }
script=$root/dev/gpu/ab_time.py
[ -n "${AB_FORWARD:-}" ] && script=$root/dev/gpu/forward_ab.py
for tree in "${trees[@]}"; do
  if [ -n "${AB_FORWARD:-}" ]; then
    (cd "$tree" && FAGEN_CACHE_DIR=$(cache_of "$tree") PYTHONPATH=$PWD:$PYTHONPATH python3 "$script" "$PWD" x --compile-only 2>&1 \
      | grep -iv warn | tail -2) &
    continue
  fi
  (cd "$tree" && FAGEN_CACHE_DIR=$(cache_of "$tree") PYTHONPATH=$PWD:$PYTHONPATH python3 -c "
from fagen.jit import precompile
from fagen.spec import Spec
import os
precompile([Spec(head_dim=d, dtype='bf16', mask=m, dropout=p) for d in (64, 128) for m in ('causal', 'none')
            for p in ((0.0, 0.1) if os.environ.get('AB_DROPOUT') else (0.0,))]
           + [Spec(head_dim=d, dtype='bf16', mask='sliding_window', window=1024) for d in (64, 128) if os.environ.get('AB_WINDOW')]
           + [Spec(head_dim=d, dtype='bf16', mask=m) for d in (160, 192, 256) for m in ('causal', 'none') if os.environ.get('AB_WIDE')],
           jobs=8)" 2>&1 | grep -iv warn | tail -2) &
done
wait
for round in 1 2; do
  for tree in "${trees[@]}"; do
    (cd "$tree" && FAGEN_CACHE_DIR=$(cache_of "$tree") PYTHONPATH=$PWD:$PYTHONPATH python3 "$script" "$PWD" "round $round $tree")
  done
done
