# Sourced at the start of every device call: PyCUDA + wheels, fagen on the path, and the kernel
# cache carried between calls as .device-cache/cache.tgz (fresh machines start with no cache).
source .whl/gpu-env.sh >/dev/null || return 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} FAGEN_CACHE_DIR=/tmp/fagen-cache PYTHONUNBUFFERED=1
mkdir -p "$FAGEN_CACHE_DIR"
[ -f .device-cache/cache.tgz ] && tar xzf .device-cache/cache.tgz -C "$FAGEN_CACHE_DIR" 2>/dev/null
save_cache() { tar czf "$OUT/cache.tgz" -C "$FAGEN_CACHE_DIR" . ; }
# The whole GPU suite, then compute-sanitizer's memcheck and racecheck over dev/gpu/sanitize.py; logs in $OUT.
gpu_suite() {
  echo "== pytest -m gpu (all)"
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/ 2>&1 | tee "$OUT/pytest.log" | tail -8
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py 2>&1 | tee "$OUT/sanitize-$tool.log" \
      | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race" | head -8
  done
}
# A / B of templates in one device call (the device's copy only): the caller's function $1, given a label, run on this
# tree's templates, then with .ab/old/* in their place, then on this tree's again (dev/gpu/template_ab.sh, row_pass_ab.sh).
ab_templates() {
  mkdir -p /tmp/ab_new && for f in .ab/old/*; do cp "templates/$(basename "$f")" /tmp/ab_new/; done
  "$1" "this tree"; cp .ab/old/* templates/
  "$1" "old templates"; cp /tmp/ab_new/* templates/
  "$1" "this tree again"
}
