# GPU round 2 (2026-12-04): round 1's uniform runs ran past their 120 s and were lost. Equal
# groups (where CUTLASS's batched GEMM, same mainloop and tile but a TMA epilogue, runs beside the
# prototype) once with 300 s, then Qwen3's and DeepSeek-V2-Lite's rows in 8, 32 and 128 groups.
# The logs are packed after each step, so a step that runs out of time loses only itself.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/rf/logs /tmp/rf
L=$OUT/rf/logs
exec > >(tee -a $OUT/rf/round.log) 2>&1
pack() { tar czf $OUT/rf/logs-2.tgz -C $OUT/rf logs; }
tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv
timeout 300 $B --sizes=uniform --iters=100 --warmup=30 --csv=$L/uniform.csv > $L/uniform.md 2>$L/uniform.err
el "uniform rc=$?"; pack
grep "^|" $L/uniform.md | cut -d'|' -f2-5,7,10-15
timeout 200 $B --shapes=Qwen3-30B-A3B,DeepSeek-V2-Lite --groups=8,32,128 --sizes=uniform --iters=100 --warmup=30 --csv=$L/groups.csv > $L/groups.md 2>$L/groups.err
el "groups rc=$?"; pack
grep "^|" $L/groups.md | cut -d'|' -f2-5,7,10-15
rm -rf $L; ls $OUT/rf
