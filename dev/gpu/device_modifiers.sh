# Device call for mask_mod / score_mod: their GPU tests first; then, per argument, `all` (the whole GPU
# suite and the sanitizers over dev/gpu/sanitize.py), `bench` (`python -m fagen.bench modifiers`, against
# Flex), `first` (first-call latency, fresh processes), `ab` (the padded kernels of this tree against the
# tree in ab_old/, made beforehand on the host: git archive 395c888 | tar x -C ab_old; remove it after).
source dev/gpu/device_prelude.sh
python3 -c "
import tests.test_modifiers_gpu as m
from fagen.jit import precompile
precompile(m.SPECS, jobs=16)" 2>&1 | grep -iv warn | tail -3
save_cache
echo "== pytest modifiers"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_modifiers_gpu.py 2>&1 | tail -30
for step in "$@"; do
  if [ "$step" = all ]; then
    gpu_suite
  fi
  if [ "$step" = bench ]; then
    echo "== bench modifiers"
    timeout 300 python3 -m fagen.bench modifiers --json "$OUT/modifiers.json" 2>&1 | tail -20
  fi
  if [ "$step" = ab ] && [ -d ab_old ]; then
    echo "== A/B: padded kernels before (ab_old) and after"
    FAGEN_CACHE_DIR=/tmp/cache-old python3 dev/gpu/ab_time.py "$PWD/ab_old" old 2>&1 | tail -1
    python3 dev/gpu/ab_time.py "$PWD" new 2>&1 | tail -1
  fi
  if [ "$step" = first ]; then
    echo "== bench modifiers --first-call"
    timeout 400 python3 -m fagen.bench modifiers --first-call --json "$OUT/modifiers_first.json" 2>&1 | tail -12
  fi
done
save_cache
