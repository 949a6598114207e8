# Device call for a value head dim unlike the query's (tests/test_value_head_dim_gpu.py, dev/gpu/sanitize.py's MLA
# specs): PART=suite precompiles from a cold cache and runs the whole GPU suite; PART=sanitize runs memcheck, racecheck
# and synccheck over the MLA specs, then `python -m fagen.bench mla` (BENCH=0 skips it). Logs in $OUT.
source dev/gpu/device_prelude.sh
if [ "${PART:-suite}" = suite ]; then
  precompile_suite
  save_cache
  TOOLS="" gpu_suite
else
  SANITIZE_ONLY=${SANITIZE_ONLY:-d192v128,d96v64,d64v128,d128v64} SAN_SECONDS=${SAN_SECONDS:-90} SKIP_TESTS=1 gpu_suite
  [ "${BENCH:-1}" = 1 ] && python3 -m fagen.bench mla --json "$OUT/mla_h200.json" 2>&1 | grep -v -i warn | tail -12
fi
