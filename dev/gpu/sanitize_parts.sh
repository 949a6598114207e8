# Device: one compute-sanitizer tool ($1: synccheck, memcheck, racecheck) over every part of dev/gpu/sanitize.py,
# each in its own process (synccheck stops a process at its first error), $JOBS at once. Logs in $OUT/$1/.
tool=${1:-synccheck}; mkdir -p "$OUT/$tool"
parts=${PARTS:-"$(python3 -c 'import dev.gpu.sanitize as s; print(*range(len(s.SPECS)))') folded pad_rows paged"}
for p in $parts; do echo $p; done | xargs -P ${JOBS:-6} -I{} sh -c \
  "SANITIZE_PART={} timeout ${PART_SECONDS:-120} compute-sanitizer --tool $tool --print-limit 4 python3 dev/gpu/sanitize.py \
   > $OUT/$tool/{}.log 2>&1; echo \"part {} rc \$?\" >> $OUT/$tool/summary"
for p in $parts; do
  f=$OUT/$tool/$p.log
  echo "$p $(grep -m1 -o "checking [a-z0-9_]*" $f) $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $f | tail -1) $(grep -m1 -E 'Barrier error|Race|Invalid' $f)"
done
