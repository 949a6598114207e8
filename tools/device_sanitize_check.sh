# Device call: precompile, compute-sanitizer memcheck + racecheck on one variant per mask kind, fagen check.
source tools/device_prelude.sh
python3 -c "
import tests.test_runtime_gpu as t, tools.sanitize as s
from fagen.runtime import precompile; from fagen.spec import Spec
precompile(t.SPECS + t.GRAD_SPECS + s.SPECS + [Spec(head_dim=64, dtype='fp16')], jobs=16)" 2>&1 | grep -iv warn | tail -2
save_cache
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool $tool --print-limit 20 python3 tools/sanitize.py 2>&1 | tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|hazard|d64_" | head -30
done
echo "== fagen check"
python3 -m fagen.cli check examples/causal_bf16.yaml --examples 20 2>&1 | tee "$OUT/check.log" | tail -15
