# GPU round 2 (2026-12-07, session 6): round 1's trace had nodrop's grouped GEMMs at 121.9 ms a
# `mixtral` step against cuBLAS's 105.8 for capacity 1.0's batched GEMMs (H100). Every tile of
# the engine at the preset's two expert shapes (gate+up 65536 x 2048 x 11264 and down
# 65536 x 5632 x 2048, 8 experts), equal and router-like groups, beside cuBLAS's batched GEMM
# and CUTLASS's batched GEMM on nodrop's tile and on cuBLAS's.
set -u
mkdir -p $OUT/r
exec > >(tee -a $OUT/r/round.log) 2>&1
nvidia-smi -L
tar xJf build/gpulib/deps.tar.xz -C / --skip-old-files
mkdir -p build/gpu && tar xJf build/gpulib/bench.tar.xz -C build/gpu
timeout 400 build/gpu/nodrop_cuda_bench --tiles=all --shapes="mixtral preset gate+up,mixtral preset down" \
  --sizes=uniform,router-like --csv=$OUT/r/tiles.csv > $OUT/r/tiles.md 2> $OUT/r/tiles.err
echo "rc=$?"
tar czf $OUT/r.tgz -C $OUT r; rm -rf $OUT/r
