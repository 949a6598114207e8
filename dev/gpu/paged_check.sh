# Device call for paged prefill (tests/test_paged_prefill_gpu.py): precompile the suite, the paged tests,
# compute-sanitizer on the paged part of dev/gpu/sanitize.py, the benchmark; then the whole GPU suite
# (QUICK=1: the paged specs only, no whole suite).
source dev/gpu/device_prelude.sh
start=$(date +%s); at() { echo "  ($(( $(date +%s) - start )) s)"; }
if [ -n "${QUICK:-}" ]; then
  python3 -c "import tests.test_paged_prefill_gpu as g, dev.gpu.sanitize as s; from fagen.jit import precompile
precompile(g.SPECS + [x for x in s.SPECS if x.layout == 'packed'], jobs=16)" 2>&1 | grep -iv warn | tail -2
else
  precompile_suite; save_cache
fi; at
GPU_TESTS=tests/test_paged_prefill_gpu.py TEST_SECONDS=120 TOOLS="" gpu_suite; at
for tool in memcheck racecheck synccheck; do SANITIZE_PART=paged SAN_SECONDS=70 sanitize $tool; done; at
echo "== bench paged"
timeout 100 python3 -m fagen.bench paged --json "$OUT/paged.json" 2>&1 | tail -12; at
[ -z "${QUICK:-}" ] && { TOOLS="" TEST_SECONDS=280 gpu_suite; at; }
