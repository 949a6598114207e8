# Device call: GPU property tests, sanitizers (memcheck, racecheck, synccheck), then the issue-5 benchmark grid (forward + backward),
# compile/cache-load times, the GEMM ceiling and the ptxas report. Everything lands in $OUT.
# AUTOTUNE=1 times the solver's top candidates per spec first (fagen bench --autotune).
source dev/gpu/device_prelude.sh
precompile_suite benchmarks/bench.yaml
save_cache
[ "${1:-all}" = bench ] && SKIP_TESTS=1
if [ -z "${SKIP_TESTS:-}" ]; then
gpu_suite
fi
[ "${1:-all}" = tests ] && exit 0
echo "== bench"
timeout ${BENCH_SECONDS:-330} python3 -m fagen.cli bench benchmarks/bench.yaml --seqlens 1024,4096,16384 --tokens 16384 --model-dim 2048 \
  --warmup 3 --repeats 10 ${AUTOTUNE:+--autotune} --json "$OUT/bench.json" --csv "$OUT/bench.csv" --plot "$OUT/bench.png" 2>&1 | grep -v "^  " | tail -45
echo "== extras"
timeout 100 python3 -m fagen.bench extras benchmarks/bench.yaml --json "$OUT/extras.json" 2>&1 | tail -8
cp "$(python3 -c "from fagen.tuning import cache_path; print(cache_path())")" "$OUT/autotune.json" 2>/dev/null || true
