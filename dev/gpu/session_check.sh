# Device call: precompile what the GPU suite and sanitize.py use, the GPU suite, then compute-sanitizer's memcheck,
# racecheck and synccheck over dev/gpu/sanitize.py (gpu_suite of dev/gpu/device_prelude.sh: SANITIZE_ONLY subsets
# the sanitizers, TOOLS picks them, GPU_TESTS the tests). Logs in $OUT.
source dev/gpu/device_prelude.sh
precompile_suite
save_cache
gpu_suite
