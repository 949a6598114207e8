# What the forward's O and LSE stores cost (main kernel, dev/gpu/block_cost.py --pass forward): the device
# copy's epilogue edited so that they never run. Written against the templates of 8a39f16; docs/benchmarks-journal.md, 2026-11-26.
source dev/gpu/device_prelude.sh >/dev/null 2>&1
E=templates/forward_wgmma_epilogue.cu.j2; cp $E /tmp/epi.orig
if grep -q store_tile_staged $E; then   # the edits below match only the stores from the fragments
  echo "$E stages its stores since 3db19be: check 8a39f16's templates out to run this"; exit 1; fi
run() { echo "=== $1"; timeout 200 python3 dev/gpu/block_cost.py --pass forward --only "mask_mod window 1" causal documents 2>&1 | grep -E "main"; 
  timeout 200 python3 dev/gpu/block_cost.py --pass forward --head-dim 64 --only "mask_mod window 1" causal documents 2>&1 | grep -E "main"; }
run baseline
sed -i 's/if (row >= seq_q) continue;/if (row >= seq_q || args.problems != 123456789) continue;/' $E; grep -c 123456789 $E
run "no O, LSE stores"
cp /tmp/epi.orig $E
