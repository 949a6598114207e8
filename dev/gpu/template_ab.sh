# A/B of templates in one device call: this tree's, then .ab/old/* in their place (the device's copy only), then
# this tree's again; each time the main kernel of both passes over windows, causal and documents masks
# (dev/gpu/block_cost.py) at the head dims $DIMS (default 64 96 128 256), N = $SEQ (default 2048), the cases $CASES.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
DIMS=${DIMS:-64 96 128 256}; SEQ=${SEQ:-2048}; CASES=${CASES:-mask_mod window 1,causal,documents}
run() { echo "=== $1"; for d in $DIMS; do for p in forward backward; do
  IFS=, read -ra only <<< "$CASES"
  timeout 200 python3 dev/gpu/block_cost.py --pass $p --head-dim $d --seq $SEQ --only "${only[@]}" 2>&1 \
    | grep -E "main" | sed "s/^/$p d=$d /"; done; done; }
ab_templates run
