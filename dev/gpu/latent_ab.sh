# The latent-cache decode (python -m fagen.bench mla-decode without peers, on $ARGS), then an A/B of the decode
# templates in .ab/old (ab_templates: this tree's, .ab/old/*, this tree's again) by dev/gpu/decode_time.py; where
# NCU=1, ncu's throughput, stall and occupancy sections on one launch of each shape in $NCU_SHAPES (batch,heads,kv_len).
source dev/gpu/device_prelude.sh >/dev/null 2>&1
ARGS=${ARGS:---batches 1,32,128 --kv-lens 4096,32768 --heads 16,128 --queries 1}
echo "=== mla-decode"
timeout 120 python3 -m fagen.bench mla-decode --no-peers $ARGS 2>&1 | grep -E "^B=" | sed -E 's/; notes.*//'
run() { echo "=== $1"; timeout 100 python3 dev/gpu/decode_time.py "$1" 2>&1 | grep -v -i warn | tail -6; }
[ -d .ab/old ] && ab_templates run
if [ "${NCU:-0}" = 1 ]; then
  for shape in ${NCU_SHAPES:-1,128,32768 32,16,4096}; do IFS=, read -r b h n <<< "$shape"
    echo "=== ncu B=$b H=$h Nk=$n"
    timeout 120 ncu --kernel-name regex:'latent.*w[0-9]+$' --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy \
      python3 -m fagen.bench mla-decode --no-peers --batches $b --heads $h --kv-lens $n --queries 1 2>&1 \
      | grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved" | head -20
  done
fi
