# GPU round 3 (2026-12-04): the prototype with CUTLASS's TMA-store epilogue (D indexed by row
# tile; correct only where every group is whole 128-row tiles) beside its register-store one,
# the same scheduler and mainloop: compute-sanitizer on the edge cases of both, then every shape
# with equal groups, then Qwen3's and DeepSeek-V2-Lite's rows in 8, 32 and 128 groups.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/rf/logs /tmp/rf
L=$OUT/rf/logs
exec > >(tee -a $OUT/rf/round.log) 2>&1
pack() { tar czf $OUT/rf/logs-3.tgz -C $OUT/rf logs; }
tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $B --rows-form-edges > $L/$tool.log 2>&1
  el "$tool rc=$?"; tail -2 $L/$tool.log
done
pack
timeout 280 $B --sizes=uniform --iters=100 --warmup=30 --csv=$L/uniform.csv > $L/uniform.md 2>$L/uniform.err
el "uniform rc=$?"; pack
grep "^|" $L/uniform.md | cut -d'|' -f2-5,7,12-17
timeout 120 $B --shapes=Qwen3-30B-A3B,DeepSeek-V2-Lite --groups=8,32,128 --sizes=uniform --iters=100 --warmup=30 --csv=$L/groups.csv > $L/groups.md 2>$L/groups.err
el "groups rc=$?"; pack
grep "^|" $L/groups.md | cut -d'|' -f2-5,7,12-17
rm -rf $L; ls $OUT/rf
