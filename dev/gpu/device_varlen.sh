# Device call for packed variable-length batches: their GPU tests first, then (argument `all`) the
# whole GPU suite, the sanitizers over dev/gpu/sanitize.py and `python -m fagen.bench varlen`.
source dev/gpu/device_prelude.sh
python3 -c "
import tests.test_varlen_gpu as v, tests.test_runtime_gpu as t, dev.gpu.sanitize as s
from fagen.runtime import precompile
precompile(v.SPECS + t.SPECS + t.GRAD_SPECS + s.SPECS, jobs=16)" 2>&1 | grep -iv warn | tail -3
save_cache
echo "== pytest varlen"
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore tests/test_varlen_gpu.py 2>&1 | tail -25
[ "${1:-}" = all ] || exit 0
gpu_suite
echo "== bench varlen"
timeout 200 python3 -m fagen.bench varlen --json "$OUT/varlen.json" 2>&1 | tail -8
