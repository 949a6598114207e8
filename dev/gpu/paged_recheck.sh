# Device call for the grouped paged loads (branch paged-grouped-loads): precompile the paged specs, their tests,
# compute-sanitizer on the paged part of dev/gpu/sanitize.py, the benchmark; then the whole GPU suite (the
# templates changed: every forward_wgmma kernel recompiles).
source dev/gpu/device_prelude.sh
start=$(date +%s); at() { echo "  ($(( $(date +%s) - start )) s)"; }
python3 -c "
import tests.test_paged_prefill_gpu as g
from fagen.runtime import precompile
precompile(g.SPECS, jobs=16)" 2>&1 | grep -iv warn | tail -2; at
echo "== paged tests"
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -n 4 -W ignore tests/test_paged_prefill_gpu.py 2>&1 | tail -3; at
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool (paged part)"
  SANITIZE_PART=paged timeout 60 compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py \
    > "$OUT/sanitize-paged-$tool.log" 2>&1; echo "rc $?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error" "$OUT/sanitize-paged-$tool.log" | head -3
done; at
echo "== bench paged"
timeout 100 python3 -m fagen.bench paged --json "$OUT/paged.json" 2>&1 | tail -8; at
echo "== pytest -m gpu (all)"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/ 2>&1 | tail -4; at
