# Device call for the wide warpgroup-MMA backward (d > 128): its GPU property tests (the d = 160-256 specs of
# the runtime and modifier suites), memcheck and racecheck over its sanitize cases, then an A/B of this tree
# against the trees named (AB_WIDE rows of dev/gpu/ab_trees.sh) and the corners bench's wide rows.
source dev/gpu/device_prelude.sh
python3 -c "
import tests.test_runtime_gpu as t, tests.test_modifiers_gpu as m, dev.gpu.sanitize as s
from fagen.jit import precompile
from fagen.bench.corners import CORNERS
wide = lambda x: x.head_dim > 128
precompile([x for x in t.SPECS + t.GRAD_SPECS + m.SPECS + s.SPECS + [c.spec for c in CORNERS] if wide(x)], jobs=16)" 2>&1 | grep -iv warn | tail -3
echo "== pytest wide"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_runtime_gpu.py tests/test_modifiers_gpu.py -k "d256 or d192 or d255 or d250 or d160 or d145" 2>&1 | tail -15
for tool in memcheck racecheck; do
  echo "== $tool"
  SANITIZE_ONLY=d256,d192,d160 timeout 200 compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|rror" | head -8
done
[ $# -gt 0 ] && AB_WIDE=1 bash dev/gpu/ab_trees.sh . "$@" 2>&1 | grep "^round"
if [ -n "${CORNERS:-}" ]; then
  echo "== corners"
  timeout 200 python3 -m fagen.bench corners --only d160,d192,d256 --json "$OUT/corners_wide.json" 2>&1 | grep -v "^  " | tail -12
fi
