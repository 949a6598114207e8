# A/B of forward_wgmma's mask tested ahead of the tile (mask_mods that read inputs at key positions: documents)
# against a tree before it: `bash dev/gpu/ahead_ab.sh .ab_old` (the old tree as in ab_trees.sh). The library
# against Flex in each tree (ab_modifiers.sh, twice, alternating), then the documents forward at other head dims,
# with dropout and packed, through dev/gpu/plan_time.py at each tree's solver plan (NEW_D64: the new tree's d = 64
# residency, which the change moved from 8 warps to 12).
source dev/gpu/device_prelude.sh >/dev/null 2>&1
old=$1
bash dev/gpu/ab_modifiers.sh . "$old" . "$old" 2>&1 | grep -E "^fagen bench|N=" | grep -v "^WARN"
while read -r extra new_plan old_plan; do
  extra=${extra//\~/ }; spec="{$extra, dtype: bf16, mask_mod: \"doc[b, i] == doc[b, j]\", inputs: {doc: int32}}"
  for run in "$PWD $new_plan" "$PWD/$old $old_plan"; do
    set -- $run
    echo "== $1 $spec"
    (cd "$1" && FAGEN_CACHE_DIR=/tmp/c_$(basename "$1") PYTHONPATH=$PWD:/tmp/site timeout 120 python3 dev/gpu/plan_time.py \
       "$spec" --modifier-inputs --seq 4096 "forward:$2" 2>&1 | grep -E "us" | grep -v -i warn)
  done
done <<'LIST'
head_dim:~64,~mask:~causal 64,128,4,12 64,128,4,8
head_dim:~64,~mask:~causal,~dropout:~0.1 64,128,4,8 64,128,4,8
head_dim:~128,~mask:~causal 128,128,8,8 128,128,8,8
head_dim:~96,~mask:~causal 128,128,8,8 128,128,8,8
head_dim:~64,~mask:~causal,~layout:~packed 64,128,4,8 64,128,4,8
LIST
