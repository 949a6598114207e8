# Device: build the mbarrier probe and run each variant under synccheck (what "Missing wait" means).
nvcc -arch=sm_90a -o /tmp/mbprobe dev/gpu/probes/mbarrier_synccheck.cu || exit 1
for v in 0 1 2 3 4 5; do
  echo "== variant $v"; compute-sanitizer --tool synccheck --print-limit 2 /tmp/mbprobe $v 2>&1 | grep -E "variant|Barrier|ERROR SUMMARY|at k|by thread" | head -6
done
