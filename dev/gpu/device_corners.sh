# Device call for issue 13 (no slow corners): precompile, the GPU tests of the new plans (`tests`: the
# backward property tests, packed, modifiers, GQA), `all` (the whole GPU suite + sanitizers), `bench`
# (`python -m fagen.bench corners`: head dims, dropout and masks against SDPA-flash, cuDNN and Flex),
# `dropout-tests` (the GPU tests with dropout), `bench-dropout` (the bench's dropout rows only). ONLY=a,b limits `bench` to the rows whose variant names have a or b.
# `bench-old`: the same bench rows from another fagen tree (AB_OLD=path, e.g. `git archive <commit> | tar x -C .ab_old`
# here, carried as an ignored path), in its own process and kernel cache: an A/B of a template change on one GPU.
source dev/gpu/device_prelude.sh
set -o pipefail   # a failing test or bench row fails the call (exit 1 at the end), not hidden behind `| tail`
failed=
# precompile in parallel what the steps use (the test modules' specs only when tests run); the kernel cache
# is not carried back: with every variant in it the archive is over what a device call returns
case " $* " in *" tests "*|*" all "*) TEST_SPECS=1 ;; esac
case " $* " in *" bench "*|*" tests "*|*" all "*) ;; *) SKIP_PRECOMPILE=1 ;; esac
[ -z "${SKIP_PRECOMPILE:-}" ] && \
TEST_SPECS=${TEST_SPECS:-} python3 -c "
import os
from fagen.bench.corners import CORNERS
from fagen.jit import precompile
specs = [c.spec for c in CORNERS]
if os.environ['TEST_SPECS']:
    import tests.test_runtime_gpu as t, tests.test_varlen_gpu as v, tests.test_modifiers_gpu as m, dev.gpu.sanitize as s
    specs += t.SPECS + t.GRAD_SPECS + [p[0] for p in t.MANY_PAIRS] + v.SPECS + m.SPECS + s.SPECS
precompile(specs, jobs=16)" 2>&1 | grep -iv warn | tail -3
for step in "$@"; do
  if [ "$step" = tests ]; then
    echo "== pytest (issue 13 plans)"
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_runtime_gpu.py \
      tests/test_varlen_gpu.py tests/test_modifiers_gpu.py "tests/test_torch_gpu.py::test_grouped_kv_heads_without_copies" 2>&1 | tail -25 || failed=1
  fi
  if [ "$step" = all ]; then
    echo "== pytest -m gpu (all)"
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/ 2>&1 | tee "$OUT/pytest.log" | tail -8 || failed=1
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer --tool $tool"
      compute-sanitizer --tool $tool --print-limit 10 python3 dev/gpu/sanitize.py 2>&1 | tee "$OUT/sanitize-$tool.log" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Race" | head -8 || failed=1
    done
  fi
  if [ "$step" = bench ]; then
    echo "== bench corners"
    timeout 400 python3 -m fagen.bench corners ${ONLY:+--only $ONLY} --json "$OUT/corners.json" 2>&1 | tail -30 || failed=1
  fi
  if [ "$step" = dropout-tests ]; then
    echo "== pytest (dropout: bit for bit against the reference, GQA, packed, modifiers, autograd)"
    python3 -c "
import tests.test_runtime_gpu as t, tests.test_varlen_gpu as v, tests.test_modifiers_gpu as m
from fagen.jit import precompile
precompile([s for s in t.SPECS + t.GRAD_SPECS + t.AUTOGRAD_SPECS + v.SPECS + m.SPECS if s.dropout], jobs=16)" 2>&1 | grep -iv warn | tail -2
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_runtime_gpu.py tests/test_varlen_gpu.py \
      tests/test_modifiers_gpu.py tests/test_torch_gpu.py -k "drop or grouped or seed" 2>&1 | tail -6 || failed=1
  fi
  if [ "$step" = bench-old ]; then
    # without AB_OLD, `cd ""` stays here and the "old" run would time this tree again (it happened once)
    [ -d "${AB_OLD:-}" ] || { echo "bench-old: set AB_OLD to the old tree (e.g. AB_OLD=.ab_old)"; failed=1; continue; }
    echo "== bench corners, tree $AB_OLD"
    old_tree=$(cd "$AB_OLD" && pwd); other_paths=${PYTHONPATH#$PWD:}   # the old tree first, not this one
    (cd "$old_tree" && PYTHONPATH=$old_tree:$other_paths FAGEN_CACHE_DIR=/tmp/fagen-cache-old timeout 400 python3 -m fagen.bench corners \
      ${ONLY:+--only $ONLY} --json "$OUT/corners_old.json" 2>&1 | tail -30) || failed=1
  fi
  if [ "$step" = bench-dropout ]; then
    echo "== bench corners (dropout rows)"
    timeout 200 python3 -m fagen.bench corners --only drop --json "$OUT/corners_dropout.json" 2>&1 | tail -8 || failed=1
  fi
done
exit ${failed:-0}
