# Sourced at the start of every device call: PyCUDA + wheels, fagen on the path, and the kernel
# cache carried between calls as .device-cache/cache.tgz (fresh machines start with no cache).
source .whl/gpu-env.sh >/dev/null || return 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} FAGEN_CACHE_DIR=/tmp/fagen-cache PYTHONUNBUFFERED=1
mkdir -p "$FAGEN_CACHE_DIR"
[ -f .device-cache/cache.tgz ] && tar xzf .device-cache/cache.tgz -C "$FAGEN_CACHE_DIR" 2>/dev/null
save_cache() { tar czf "$OUT/cache.tgz" -C "$FAGEN_CACHE_DIR" . ; }
# Compile what the GPU suite and dev/gpu/sanitize.py use, and the specs of any YAML files given, 16 at a time.
precompile_suite() {
  python3 - "$@" <<'PY' 2>&1 | grep -iv warn | tail -2
import sys
import tests.test_runtime_gpu as t, tests.test_decode_gpu as d, tests.test_modifiers_gpu as m, dev.gpu.sanitize as s
import tests.test_varlen_gpu as v, tests.test_padding_clamp_gpu as p, tests.test_paged_prefill_gpu as g
import tests.test_value_head_dim_gpu as vd, tests.test_fp8_gpu as f8, tests.test_latent_decode_gpu as lat
from fagen.jit import precompile
from fagen.spec import load_specs
precompile(g.SPECS + vd.SPECS + f8.SPECS + lat.SPECS + t.SPECS + t.GRAD_SPECS + t.AUTOGRAD_SPECS + d.SPECS + d.PAGED_SPECS + m.SPECS + v.SPECS + p.SPECS
           + s.SPECS + [spec for path in sys.argv[1:] for spec in load_specs(path)], jobs=16)
PY
}
# compute-sanitizer's tool $1 over dev/gpu/sanitize.py (SANITIZE_ONLY, SANITIZE_PART pick what); the log in $OUT.
sanitize() {
  local log="$OUT/sanitize-${SANITIZE_PART:+$SANITIZE_PART-}$1.log"
  timeout ${SAN_SECONDS:-150} compute-sanitizer --tool "$1" --print-limit 10 python3 dev/gpu/sanitize.py > "$log" 2>&1
  echo "== compute-sanitizer --tool $1 (${SANITIZE_PART:-${SANITIZE_ONLY:-all}}): rc $?"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race|sanitize run complete|paged .* ok" "$log" | head -6
}
# pytest -m gpu over GPU_TESTS (default: the whole suite; SKIP_TESTS skips it), then each sanitizer of TOOLS (default:
# memcheck, racecheck, synccheck; TOOLS="" none). Logs in $OUT.
gpu_suite() {
  if [ -z "${SKIP_TESTS:-}" ]; then
    echo "== pytest -m gpu ${GPU_TESTS:-tests/}"
    timeout ${TEST_SECONDS:-420} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore ${GPU_TESTS:-tests/} \
      2>&1 | tee "$OUT/pytest-$(basename "${GPU_TESTS:-all}" .py).log" | tail -8
  fi
  for tool in ${TOOLS-memcheck racecheck synccheck}; do sanitize "$tool"; done
}
# A / B of templates in one device call (the device's copy only): the caller's function $1, given a label, run on this
# tree's templates, then with .ab/old/* in their place, then on this tree's again (dev/gpu/template_ab.sh, row_pass_ab.sh).
ab_templates() {
  mkdir -p /tmp/ab_new && for f in .ab/old/*; do cp "templates/$(basename "$f")" /tmp/ab_new/; done
  "$1" "this tree"; cp .ab/old/* templates/
  "$1" "old templates"; cp /tmp/ab_new/* templates/
  "$1" "this tree again"
}
