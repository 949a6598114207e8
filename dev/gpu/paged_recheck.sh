# Device call for the grouped paged loads (branch paged-grouped-loads): precompile the suite, the paged tests,
# compute-sanitizer on the paged part of dev/gpu/sanitize.py, the benchmark; then the whole GPU suite (the
# templates changed: every forward_wgmma kernel recompiles).
source dev/gpu/device_prelude.sh
start=$(date +%s); at() { echo "  ($(( $(date +%s) - start )) s)"; }
precompile_suite; save_cache; at
GPU_TESTS=tests/test_paged_prefill_gpu.py TEST_SECONDS=120 TOOLS="" gpu_suite; at
for tool in memcheck racecheck synccheck; do SANITIZE_PART=paged SAN_SECONDS=70 sanitize $tool; done; at
echo "== bench paged"
timeout 100 python3 -m fagen.bench paged --json "$OUT/paged.json" 2>&1 | tail -12; at
TOOLS="" TEST_SECONDS=280 gpu_suite; at
