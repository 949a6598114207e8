# Device call: forward-only A/B of fagen trees, `bash dev/gpu/forward_ab.sh . .ab_old` (an untracked copy of the tree
# before, carried as an ignored path; WIDE=1 for the d > 128 shapes): every tree's kernels compile at once, each in its
# own kernel cache, then the trees are timed in turn, twice round (dev/gpu/forward_ab.py).
source dev/gpu/device_prelude.sh >/dev/null 2>&1
trees=("$@"); root=$PWD
cache_of() { echo "/tmp/fagen-cache-ab-$(echo "$1" | tr -c 'a-zA-Z0-9' _)"; }
for tree in "${trees[@]}"; do
  (cd "$tree" && FAGEN_CACHE_DIR=$(cache_of "$tree") PYTHONPATH=$PWD:$PYTHONPATH python3 "$root/dev/gpu/forward_ab.py" "$PWD" x --compile-only 2>&1 | grep -iv warn | tail -2) &
done
wait
for round in 1 2; do
  for tree in "${trees[@]}"; do
    (cd "$tree" && FAGEN_CACHE_DIR=$(cache_of "$tree") PYTHONPATH=$PWD:$PYTHONPATH python3 "$root/dev/gpu/forward_ab.py" "$PWD" "round $round $tree")
  done
done
