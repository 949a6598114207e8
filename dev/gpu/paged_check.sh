# Device call for paged prefill (tests/test_paged_prefill_gpu.py): precompile, the paged tests and compute-sanitizer
# (memcheck, racecheck, synccheck) on the paged part of dev/gpu/sanitize.py, the benchmark (python -m fagen.bench
# paged), then the whole GPU suite. Logs in $OUT.
source dev/gpu/device_prelude.sh
precompile_suite
save_cache
GPU_TESTS=tests/test_paged_prefill_gpu.py SANITIZE_PART=paged SAN_SECONDS=100 gpu_suite
echo "== bench paged"
timeout 150 python3 -m fagen.bench paged --json "$OUT/paged.json" 2>&1 | tail -8
TOOLS="" gpu_suite
