# What the backward's dQ atomics and dK, dV stores cost (main kernel, dev/gpu/block_cost.py): the device copy's
# templates edited so that they never run (a run-time test that never holds keeps the work that feeds them).
# Written against the templates of 8a39f16 (dK, dV straight from the fragments); docs/benchmarks-journal.md, 2026-11-26.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
cp -r templates /tmp/templates.orig
R=templates/backward_wgmma_rows.cu.j2; K=templates/backward_wgmma_key_grads.cu.j2
if grep -q store_tile_staged $K; then   # the edits below match only the stores from the fragments
  echo "$K stages its stores since 3db19be: check 8a39f16's templates out to run this"; exit 1; fi
run() { echo "=== $1"; timeout 150 python3 dev/gpu/block_cost.py --only "mask_mod window 1" "mask_mod window 960" documents 2>&1 | grep -v -i warn; }
run baseline
sed -i 's/warp_dq_row0 + r < seq_q \&\& c \/ 2 >= dq_skip_tiles)/warp_dq_row0 + r < seq_q \&\& c \/ 2 >= dq_skip_tiles \&\& args.problems == 123456789)/' $R; grep -c 123456789 $R
run "no dQ reds"
sed -i 's/if (key >= seq_k) continue;/if (key >= seq_k || args.problems != 123456789) continue;/' $K; grep -c 123456789 $K
run "no dQ reds, no dK dV stores"
cp /tmp/templates.orig/* templates/
sed -i 's/if (key >= seq_k) continue;/if (key >= seq_k || args.problems != 123456789) continue;/' $K
run "no dK dV stores"
cp /tmp/templates.orig/* templates/
