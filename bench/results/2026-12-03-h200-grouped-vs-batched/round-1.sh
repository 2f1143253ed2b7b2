# GPU round (2026-12-03, evening): nodrop's grouped GEMM against cuBLAS's strided batched GEMM of
# the same equal groups (what the capacity-factor layer runs), and what a group costs. The
# benchmark of this commit's tree (`--groups`, the batched column), built on the development
# machine (nvcc 13.0, sm_90a, stripped), carried as build/gpulib/round10.tar.xz; the engine is
# main's. 100 timed calls after 30, so the card runs at its power limit.
# 1. Equal groups at every shape of the benchmark.
# 2. Qwen3's GEMMs (M 131072, K 2048, N 768) split into 1, 8, 32 and 128 groups: same FLOPs.
# 3. Every tile at Qwen3 with equal groups.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/gb/logs /tmp/n10
L=$OUT/gb/logs
exec > >(tee -a $OUT/gb/round.log) 2>&1
tar xJf build/gpulib/round10.tar.xz -C /tmp/n10; B=/tmp/n10/nodrop_cuda_bench
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv
timeout 200 $B --sizes=uniform --iters=100 --warmup=30 --csv=$L/equal-groups.csv > $L/equal-groups.md 2>$L/equal-groups.err; el "equal groups rc=$?"
grep "^|" $L/equal-groups.md
timeout 150 $B --shapes=Qwen3-30B-A3B --groups=1,8,32,128 --sizes=uniform --iters=100 --warmup=30 --csv=$L/qwen3-groups.csv > $L/qwen3-groups.md 2>$L/qwen3-groups.err; el "qwen3 groups rc=$?"
grep "^|" $L/qwen3-groups.md
timeout 150 $B --shapes=Qwen3-30B-A3B --tiles=all --sizes=uniform --iters=100 --warmup=30 --csv=$L/qwen3-tiles.csv > $L/qwen3-tiles.md 2>$L/qwen3-tiles.err; el "qwen3 tiles rc=$?"
grep "^|" $L/qwen3-tiles.md
tar czf $OUT/gb/logs.tgz -C $OUT/gb logs && rm -rf $L; ls $OUT/gb
