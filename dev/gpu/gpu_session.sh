#!/usr/bin/env bash
# One device call: set up PyCUDA + fagen's deps from .whl/, then run what is asked.
#   dev/gpu/gpu_session.sh tests   -> GPU pytest suite (FAGEN_HYPOTHESIS_PROFILE picks the example budget)
#   dev/gpu/gpu_session.sh py FILE -> a Python script
# Logs go to $OUT so they come back even when the call times out.
set -uo pipefail
source .whl/gpu-env.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export FAGEN_CACHE_DIR=/tmp/fagen-cache
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-tests}; shift || true
case "$what" in
  tests) python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" ;;
  py) python3 "$@" 2>&1 | tee "$OUT/py.log" ;;
  *) bash -c "$what $*" 2>&1 | tee "$OUT/cmd.log" ;;
esac
