# GPU round 5 (2026-12-04): CUTLASS's batched GEMM on the tile cuBLAS's batched GEMM ran in
# round 4 (cooperative 128x256x64 in nodrop's terms), on a 2x1 and a 1x2 cluster, beside nodrop,
# cuBLAS's batched GEMM and CUTLASS batched on nodrop's tile: equal groups, the shapes where
# cuBLAS is furthest ahead and the mixtral preset's.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/rf/logs /tmp/rf
L=$OUT/rf/logs
exec > >(tee -a $OUT/rf/round.log) 2>&1
pack() { tar czf $OUT/rf/logs-5.tgz -C $OUT/rf logs; }
tar xJf build/gpulib/rows-form.tar.xz -C /tmp/rf; B=/tmp/rf/nodrop_cuda_bench
cublas=$(find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=${cublas:+$(dirname "$cublas"):}${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,uuid --format=csv
timeout 300 $B --shapes="Qwen3-30B-A3B,DeepSeek-V2-Lite,DeepSeek-V3 EP8 rank,Qwen3-30B-A3B 2k tokens,mixtral preset gate+up,mixtral preset down" \
  --sizes=uniform --iters=100 --warmup=30 --csv=$L/uniform.csv > $L/uniform.md 2>$L/uniform.err
el "uniform rc=$?"; pack; tail -2 $L/uniform.err
grep "^|" $L/uniform.md | cut -d'|' -f2-5,7,10-17
rm -rf $L; ls $OUT/rf
