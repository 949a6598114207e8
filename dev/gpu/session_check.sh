# Device call: precompile what the GPU suite and sanitize.py use, the GPU suite, then compute-sanitizer's memcheck,
# racecheck and synccheck over dev/gpu/sanitize.py (SANITIZE_ONLY subsets it). Logs in $OUT.
source dev/gpu/device_prelude.sh
start=$(date +%s)
python3 -c "
import tests.test_runtime_gpu as t, tests.test_decode_gpu as d, tests.test_modifiers_gpu as m, dev.gpu.sanitize as s
import tests.test_varlen_gpu as v, tests.test_padding_clamp_gpu as p
from fagen.runtime import precompile
precompile(t.SPECS + t.GRAD_SPECS + t.AUTOGRAD_SPECS + d.SPECS + d.PAGED_SPECS + m.SPECS + v.SPECS + p.SPECS + s.SPECS,
           jobs=16)" 2>&1 | grep -iv warn | tail -2
echo "precompile $(( $(date +%s) - start )) s"; save_cache
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== pytest -m gpu ${GPU_TESTS:-tests/}"
  timeout ${TEST_SECONDS:-300} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore ${GPU_TESTS:-tests/} 2>&1 \
    | tee "$OUT/pytest.log" | tail -6
  echo "tests done at $(( $(date +%s) - start )) s"
fi
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  echo "== compute-sanitizer --tool $tool (SANITIZE_ONLY=${SANITIZE_ONLY:-all})"
  timeout ${SAN_SECONDS:-150} compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py \
    > "$OUT/sanitize-$tool.log" 2>&1; echo "rc $?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|sanitize run complete|Error" "$OUT/sanitize-$tool.log" | head -6
  echo "at $(( $(date +%s) - start )) s"
done
save_cache
