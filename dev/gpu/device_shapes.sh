# Device call for issue 11 (the shapes models use): the GPU tests of grouped heads, packed batches, odd head
# dims (the padding kernel, through torch) and decoding; then, per argument, `headdim` (odd d through torch
# against the next multiple of 16 and SDPA-flash, four shapes), `gqa`, `decode`, `varlen` (the benchmark rows
# of docs/benchmarks-journal.md), `all` (the whole GPU suite and the sanitizers). Output in $OUT.
source dev/gpu/device_prelude.sh
echo "== pytest (shapes)"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_pad_rows_gpu.py tests/test_torch_gpu.py \
  tests/test_decode_gpu.py tests/test_varlen_gpu.py 2>&1 | tee "$OUT/pytest-shapes.log" | tail -8
for step in "$@"; do
  case "$step" in
  headdim)
    echo "== odd head dims through torch"
    timeout 240 python3 dev/gpu/head_dim_speed.py 59:64 111:112 58:64 3:16 --torch \
      --shapes 4:16:4096,1:32:16384,32:16:512,3:16:3000 2>&1 | grep -v "^fagen from" | tee "$OUT/headdim.log" ;;
  gqa)
    echo "== bench gqa"
    timeout 240 python3 -m fagen.cli bench benchmarks/gqa.yaml --model-dim 4096 --kv-group 4 --seqlens 1024,4096,8192 \
      --warmup 3 --repeats 10 --json "$OUT/gqa.json" 2>&1 | grep -v "^  " | tail -16 ;;
  decode)
    echo "== bench decode"
    timeout 200 python3 -m fagen.bench decode --json "$OUT/decode.json" 2>&1 | tail -8 ;;
  varlen)
    echo "== bench varlen"
    timeout 200 python3 -m fagen.bench varlen --json "$OUT/varlen.json" 2>&1 | tail -8 ;;
  all)
    gpu_suite ;;
  esac
done
save_cache
