# GPU round 1 (2026-12-04): the rows-form prototype (bench/cuda/rows_grouped_gemm.cu: one TMA
# descriptor per operand, tiles starting at any row, rows past a group's end masked in the
# epilogue) beside nodrop's pointer-array grouped kernel, CUTLASS's batched GEMM and cuBLAS's
# batched GEMM. compute-sanitizer on the prototype's edge cases first, then every shape with
# uniform, router-like and Zipf group sizes, twice, then Qwen3's and DeepSeek-V2-Lite's rows in 8, 32 and 128 groups.
# nodrop_cuda_bench built on the development machine (nvcc 13.0, sm_90a, stripped), carried as
# build/gpulib/rows-form.tar.xz; the engine is main's.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/rf/logs /tmp/rf
L=$OUT/rf/logs
exec > >(tee -a $OUT/rf/round.log) 2>&1
tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $B --rows-form-edges > $L/$tool.log 2>&1
  el "$tool rc=$?"; tail -2 $L/$tool.log
done
for turn in 1 2; do
  for sizes in uniform router-like 'zipf(1)'; do
    name=${sizes%(1)}-$turn
    timeout 120 $B --sizes=$sizes --iters=100 --warmup=30 --csv=$L/$name.csv > $L/$name.md 2>$L/$name.err
    el "$sizes turn $turn rc=$?"; tail -1 $L/$name.err
    grep "^|" $L/$name.md | cut -d'|' -f2-5,7,10-15
  done
done
timeout 120 $B --shapes=Qwen3-30B-A3B,DeepSeek-V2-Lite --groups=8,32,128 --sizes=uniform --iters=100 --warmup=30 --csv=$L/groups.csv > $L/groups.md 2>$L/groups.err
el "groups rc=$?"
grep "^|" $L/groups.md | cut -d'|' -f2-5,7,10-15
tar czf $OUT/rf/logs-1.tgz -C $OUT/rf logs && rm -rf $L; ls $OUT/rf
