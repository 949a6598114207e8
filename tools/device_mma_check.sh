# Device call: GPU property tests (all templates), sanitizers on one variant per mask kind, and a quick
# forward benchmark against SDPA.
source tools/device_prelude.sh
python3 -c "
import tests.test_runtime_gpu as t, tools.sanitize as s
from fagen.runtime import precompile; from fagen.spec import Spec
precompile(t.SPECS + t.GRAD_SPECS + s.SPECS + [Spec(head_dim=64, dtype='fp16')], jobs=16)" 2>&1 | grep -iv warn | tail -2
save_cache
echo "== pytest -m gpu"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_runtime_gpu.py 2>&1 | tee "$OUT/pytest.log" | tail -12
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool $tool --print-limit 10 python3 tools/sanitize.py 2>&1 | tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|hazard" | head -12
done
echo "== bench (forward)"
timeout 150 python3 -m fagen.cli bench benchmarks/bench_forward_quick.yaml --warmup 3 --repeats 10 --json "$OUT/bench_quick.json" 2>&1 | tail -25
