# Device call for the fp8 forward (tests/test_fp8_gpu.py, dev/gpu/sanitize.py's fp8e4m3 specs): PART=fp8 compiles
# what is missing from the carried cache, runs the fp8 tests, memcheck, racecheck and synccheck over the fp8 specs,
# then `python -m fagen.bench fp8` (BENCH=0 skips it); PART=suite precompiles from a cold cache and runs the whole GPU
# suite. Logs in $OUT.
source dev/gpu/device_prelude.sh
if [ "${PART:-fp8}" = suite ]; then
  precompile_suite
  save_cache
  TOOLS="" gpu_suite
else
  GPU_TESTS=tests/test_fp8_gpu.py SANITIZE_ONLY=${SANITIZE_ONLY:-fp8e4m3} SAN_SECONDS=${SAN_SECONDS:-120} gpu_suite
  [ "${BENCH:-1}" = 1 ] && python3 -m fagen.bench fp8 --json "$OUT/fp8_h200.json" 2>&1 | grep -v -i warn | tail -30
fi
