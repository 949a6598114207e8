# A/B of forward_wgmma's mask tested ahead of the tile (mask_mods that read inputs at key positions: documents)
# against a tree before it: `bash dev/gpu/ahead_ab.sh .ab_old [other trees]` (trees as in ab_trees.sh; .ab_old is
# the one before the change). The library against Flex in . and .ab_old (ab_modifiers.sh, twice, alternating; LIBRARY=0
# skips it), then the documents forward at other head dims, with dropout and packed, through dev/gpu/plan_time.py at
# each tree's solver plan (the first column for every tree but .ab_old: the change moved d = 64's residency).
source dev/gpu/device_prelude.sh >/dev/null 2>&1
old=$1
[ "${LIBRARY:-1}" = 1 ] && bash dev/gpu/ab_modifiers.sh . "$old" . "$old" 2>&1 | grep -E "^fagen bench|N=" | grep -v "^WARN"
trees=". $*"
while read -r extra new_plan old_plan; do
  extra=${extra//\~/ }; spec="{$extra, dtype: bf16, mask_mod: \"doc[b, i] == doc[b, j]\", inputs: {doc: int32}}"
  for tree in $trees; do
    plan=$new_plan; [ "$(basename $tree)" = .ab_old ] && plan=$old_plan
    set -- "$PWD/$tree" $plan
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
