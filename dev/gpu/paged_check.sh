# Device call for paged prefill (tests/test_paged_prefill_gpu.py): precompile, the paged tests, compute-sanitizer
# (memcheck, racecheck, synccheck) on the paged part of dev/gpu/sanitize.py, the benchmark (python -m fagen.bench
# paged), then the whole GPU suite in the time left. Logs in $OUT.
source dev/gpu/device_prelude.sh
start=$(date +%s); at() { echo "  ($(( $(date +%s) - start )) s)"; }
python3 -c "
import tests.test_runtime_gpu as t, tests.test_decode_gpu as d, tests.test_modifiers_gpu as m, dev.gpu.sanitize as s
import tests.test_varlen_gpu as v, tests.test_padding_clamp_gpu as p, tests.test_paged_prefill_gpu as g
from fagen.runtime import precompile
precompile(g.SPECS + t.SPECS + t.GRAD_SPECS + t.AUTOGRAD_SPECS + d.SPECS + d.PAGED_SPECS + m.SPECS + v.SPECS + p.SPECS
           + s.SPECS, jobs=16)" 2>&1 | grep -iv warn | tail -2; at
echo "== paged tests"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -W ignore tests/test_paged_prefill_gpu.py 2>&1 \
  | tee "$OUT/paged-tests.log" | tail -4; at
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool (paged part)"
  SANITIZE_PART=paged timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py \
    > "$OUT/sanitize-paged-$tool.log" 2>&1; echo "rc $?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|paged .* ok|Error" "$OUT/sanitize-paged-$tool.log" | head -5; at
done
echo "== bench paged"
timeout 150 python3 -m fagen.bench paged --json "$OUT/paged.json" 2>&1 | tail -8; at
echo "== pytest -m gpu (all)"
timeout $(( 540 - ($(date +%s) - start) )) python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/ 2>&1 \
  | tee "$OUT/pytest.log" | tail -5; at
