# GPU round 2 (2026-12-03, evening): round 1 again, with CUTLASS's own batched GEMM on nodrop's
# tile beside it (bench/cuda/cutlass_batched_gemm.cu: GemmUniversal kBatched, one TMA descriptor
# per operand, the batch a coordinate; forward and input gradient, for the pingpong 128x128 1x2
# and cooperative 128x256 1x1 tiles): the same tile, schedule and tile order with and without the
# pointer-array machinery. Benchmark built on the development machine (nvcc 13.0, sm_90a,
# stripped), carried as build/gpulib/round11.tar.xz; the engine is main's.
set -u
start=$(date +%s); el() { echo "[$(( $(date +%s) - start ))s] $*"; }
mkdir -p $OUT/gb/logs /tmp/n11
L=$OUT/gb/logs
exec > >(tee -a $OUT/gb/round.log) 2>&1
tar xJf build/gpulib/round11.tar.xz -C /tmp/n11; B=/tmp/n11/nodrop_cuda_bench
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.max.sm --format=csv
for turn in 1 2; do
  timeout 200 $B --sizes=uniform --iters=100 --warmup=30 --csv=$L/equal-groups-$turn.csv > $L/equal-groups-$turn.md 2>$L/equal-groups-$turn.err; el "equal groups turn $turn rc=$?"
  grep "^|" $L/equal-groups-$turn.md | cut -d'|' -f2-5,8,11-14
done
timeout 150 $B --shapes=Qwen3-30B-A3B,DeepSeek-V2-Lite --groups=1,8,32,128 --sizes=uniform --iters=100 --warmup=30 --csv=$L/groups.csv > $L/groups.md 2>$L/groups.err; el "groups rc=$?"
grep "^|" $L/groups.md | cut -d'|' -f2-5,8,11-14
tar czf $OUT/gb/logs-2.tgz -C $OUT/gb logs && rm -rf $L; ls $OUT/gb
