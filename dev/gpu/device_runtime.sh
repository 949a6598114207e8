# Device call for the runtime work (issue 10): GPU tests of the torch integration and the runtime,
# then dev/gpu/runtime_probe.py (host overhead, load times, fwd+bwd through autograd). Logs in $OUT.
#   bash dev/gpu/device_runtime.sh [extra pytest files...]
source .whl/gpu-env.sh >/dev/null || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} FAGEN_CACHE_DIR=/tmp/fagen-cache PYTHONUNBUFFERED=1
mkdir -p "$FAGEN_CACHE_DIR"
echo "== precompile"
python3 -c "
import tests.test_runtime_gpu as t
from fagen.runtime import precompile; from fagen.spec import Spec
precompile(t.SPECS + t.GRAD_SPECS + [Spec(head_dim=64, dtype='bf16', mask='causal'), Spec(head_dim=64, dtype='bf16', mask='padding'),
  Spec(head_dim=64, dtype='bf16'), Spec(head_dim=128, dtype='bf16'), Spec(head_dim=128, dtype='bf16', mask='causal')], jobs=16)" 2>&1 | tail -3
echo "== pytest"
timeout ${TEST_SECONDS:-300} python3 -m pytest -m gpu -q -p no:cacheprovider -n 8 -W ignore::DeprecationWarning tests/test_torch_gpu.py "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
echo "== probe"
timeout 200 python3 dev/gpu/runtime_probe.py --json "$OUT/runtime_probe.json" 2>&1 | tail -20
